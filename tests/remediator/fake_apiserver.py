"""A small stateful Kubernetes API on top of kmock, for the executor tests and the drain benchmark.

kmock serves HTTP, parses Kubernetes URLs, records every request and lets a test put reactions in
front (fault injection: `api[...][:2] << 500`). Behind those reactions, `FakeApiServer` keeps
objects the way kube-apiserver does for the few resources the remediator touches:

- resourceVersion and uid on every object; a write (PUT, or a merge patch) that names an older
  resourceVersion is refused with 409 Conflict;
- merge patches (RFC 7386) and strategic merge patches; in the latter, `status.conditions` merge by
  `type`, as the Node schema's patchMergeKey says; the `status` subresource changes status and
  metadata (a Node's does, on kube-apiserver 1.20: tried) but never spec, and the main resource
  never changes status;
- `fieldSelector` on lists (`spec.nodeName=…`, `involvedObject.name=…`);
- watches (`?watch=true`): from `resourceVersion` on (every change since, then each as it happens;
  from "" or "0": the current objects as ADDED first), narrowed by namespace and `fieldSelector`,
  ended after `timeoutSeconds`; `compact()` forgets the changes so far, as etcd's compaction does, so
  a watch from an older version is answered with a 410 Gone ERROR event;
- the policy/v1 Eviction subresource: 404 for a missing pod, 500 when several PodDisruptionBudgets
  match, 429 while the matching budget allows no disruption (terminal pods excepted); an eviction
  spends one disruption and deletes the pod after `termination_seconds`, optionally replacing it
  under the same name with a new uid (as a StatefulSet does);
- an optional per-request latency, for the benchmark.

It is a test double of the API's contract, not of its internals; anything not listed answers 404.
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import itertools
import ssl
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any

import aiohttp.test_utils
import aiohttp.web
import attrs
import kmock
from kmock import KubernetesError, KubernetesScaffold

# (group, version, plural) -> namespaced?
SERVED: dict[tuple[str, str, str], bool] = {
    ("", "v1", "nodes"): False,
    ("", "v1", "pods"): True,
    ("", "v1", "events"): True,
    ("policy", "v1", "poddisruptionbudgets"): True,
    ("coordination.k8s.io", "v1", "leases"): True,
    ("", "v1", "configmaps"): True,
}
KINDS = {
    "nodes": "Node",
    "pods": "Pod",
    "events": "Event",
    "poddisruptionbudgets": "PodDisruptionBudget",
    "leases": "Lease",
    "configmaps": "ConfigMap",
}

Key = tuple[str, str, str]  # (plural, namespace or "", name)
Change = tuple[int, str, str, dict[str, Any]]  # (resourceVersion, plural, ADDED/MODIFIED/DELETED, object)


def _now() -> str:
    return datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def status_error(code: int, reason: str, message: str) -> KubernetesError:
    return KubernetesError(status=code, reason=reason, message=message, details={"code": code})


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch: mappings merge, null deletes, everything else replaces."""
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def strategic_merge_patch(target: Any, patch: Any, path: str = "") -> Any:
    """Merge patch, except that lists with a merge key (here: conditions by `type`) merge per item."""
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        here = f"{path}.{key}" if path else key
        if value is None:
            result.pop(key, None)
        elif here == "status.conditions" and isinstance(value, list):
            merged = {c.get("type"): c for c in result.get(key) or []}
            for cond in value:
                merged[cond.get("type")] = merge_patch(merged.get(cond.get("type")), cond)
            result[key] = list(merged.values())
        else:
            result[key] = strategic_merge_patch(result.get(key), value, here)
    return result


def _field(obj: Mapping[str, Any], dotted: str) -> str:
    value: Any = obj
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, Mapping) else None
    return "" if value is None else str(value)


def field_selector_matches(obj: Mapping[str, Any], selector: str) -> bool:
    """`a.b=x,c!=y` as the API server evaluates it (only = / == / != are supported)."""
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if _field(obj, key) == value:
                return False
        else:
            key, value = term.replace("==", "=").split("=", 1)
            if _field(obj, key) != value:
                return False
    return True


@attrs.define(kw_only=True)
class FakeApiServer(KubernetesScaffold):
    """kmock's scaffold plus an object store with the API server behaviour listed above."""

    latency_seconds: float = 0.0
    """Added to every Kubernetes request (the benchmark's per-request latency)."""
    termination_seconds: float = 0.0
    """How long an evicted pod keeps terminating (deletionTimestamp set) before it is gone."""
    replace_evicted: bool = False
    """Recreate an evicted pod under the same name with a new uid, as a StatefulSet would."""
    store: dict[Key, dict[str, Any]] = attrs.field(factory=dict, init=False)
    """Current objects by (plural, namespace, name)."""
    evictions: list[tuple[str, str, int]] = attrs.field(factory=list, init=False)
    """(namespace, name, HTTP status) of every eviction request, in order."""
    evictions_in_flight: int = attrs.field(default=0, init=False)
    """Eviction requests being served right now."""
    max_evictions_in_flight: int = attrs.field(default=0, init=False)
    """The most eviction requests ever served at once (bounded concurrency shows here)."""
    changes: list[Change] = attrs.field(factory=list, init=False)
    """(resourceVersion, plural, ADDED/MODIFIED/DELETED, object) of every change, oldest first."""
    compacted: int = attrs.field(default=0, init=False)
    """Watches from a resourceVersion older than this are answered 410 Gone."""
    _watchers: set[asyncio.Queue[Change | None]] = attrs.field(factory=set, init=False)
    _versions: itertools.count[int] = attrs.field(factory=lambda: itertools.count(1000), init=False)
    _tasks: set[asyncio.Task[None]] = attrs.field(factory=set, init=False)
    _own: Any = attrs.field(default=None, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        # Below the tests' own reactions (priority 0), above kmock's discovery fallbacks (-inf).
        self._own = (self**-1)[self._is_served] << self._serve

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        # kmock matches a request against every reaction's view of all past requests, which costs
        # O(requests) each; with no reaction of the test's own in front, serve the store directly
        # (the benchmark's 110-pod drain would otherwise measure kmock's matching).
        if (
            self._is_served(request)
            and not _is_watch(request)
            and not any(p is not self._own and (p.priorities or (0,))[:1] >= (0,) for p in self._payloads)
        ):
            try:
                return aiohttp.web.json_response(await self._serve(request))
            except KubernetesError as exc:
                self.errors.append(exc)
                return await self._render_error(exc)
        return await super()._handle(request)

    # -- helpers for tests ---------------------------------------------------------------------

    def add(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Create or overwrite an object directly (test set-up); returns the stored copy."""
        kind = str(obj["kind"])
        plural = next(p for p, k in KINDS.items() if k == kind)
        meta = obj.get("metadata", {})
        key = (plural, str(meta.get("namespace", "")), str(meta["name"]))
        stored = self._stamp(copy.deepcopy(dict(obj)), new=True)
        self.store[key] = stored
        return stored

    def stored(self, plural: str, name: str, namespace: str = "") -> dict[str, Any] | None:
        """The stored object, or None."""
        return self.store.get((plural, namespace, name))

    def touch_node(self, name: str, *, taint: dict[str, str]) -> None:
        """Another client adds a taint to the node (bumps its resourceVersion)."""
        obj = self.store[("nodes", "", name)]
        obj.setdefault("spec", {}).setdefault("taints", []).append(taint)
        self._stamp(obj, new=False)

    def set_disruptions_allowed(self, namespace: str, name: str, allowed: int) -> None:
        """What the disruption controller does when replacement pods become ready."""
        pdb = self.store[("poddisruptionbudgets", namespace, name)]
        pdb.setdefault("status", {})["disruptionsAllowed"] = allowed
        self._stamp(pdb, new=False)

    def compact(self) -> int:
        """Forget every change so far, as etcd's compaction does: a watch from an older
        resourceVersion is answered 410 Gone. Returns the version compacted to."""
        self.compacted = next(self._versions)
        self.changes.clear()
        return self.compacted

    def remove(self, plural: str, name: str, namespace: str = "") -> None:
        """Another client deletes an object (a watch sees DELETED)."""
        self._remove((plural, namespace, name))

    def end_watches(self) -> None:
        """End every watch being served (as a restarting API server does); clients watch again."""
        for queue in self._watchers:
            queue.put_nowait(None)

    async def aclose(self) -> None:
        """End the watches and cancel pending pod terminations."""
        self.end_watches()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # -- the store -----------------------------------------------------------------------------

    def _stamp(self, obj: dict[str, Any], *, new: bool) -> dict[str, Any]:
        """A new resourceVersion (and for a new object its uid), and the change for the watches."""
        meta = obj.setdefault("metadata", {})
        meta["resourceVersion"] = str(next(self._versions))
        if new:
            meta["uid"] = str(uuid.uuid4())
            meta.setdefault("creationTimestamp", _now())
        self._changed(obj, "ADDED" if new else "MODIFIED")
        return obj

    def _remove(self, key: Key) -> dict[str, Any] | None:
        obj = self.store.pop(key, None)
        if obj is not None:
            obj["metadata"]["resourceVersion"] = str(next(self._versions))
            self._changed(obj, "DELETED")
        return obj

    def _changed(self, obj: Mapping[str, Any], kind: str) -> None:
        plural = next((p for p, k in KINDS.items() if k == obj.get("kind")), None)
        if plural is None:
            return
        change = (int(obj["metadata"]["resourceVersion"]), plural, kind, copy.deepcopy(dict(obj)))
        self.changes.append(change)
        for queue in self._watchers:
            queue.put_nowait(change)

    def _backlog(self, wanted: Callable[[Change], bool], since: str) -> list[dict[str, Any]]:
        """What a watch from `since` sends first: the current objects ("" or "0"), every change after
        `since`, or a 410 Gone ERROR when `since` was compacted away."""
        if since in ("", "0"):
            objs = [obj for (plural, _, _), obj in self.store.items() if wanted((0, plural, "ADDED", obj))]
            return [{"type": "ADDED", "object": copy.deepcopy(obj)} for obj in objs]
        if int(since) < self.compacted:
            gone = f"too old resource version: {since} ({self.compacted})"
            status = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": gone}
            return [{"type": "ERROR", "object": {**status, "reason": "Expired", "code": 410}}]
        return [{"type": c[2], "object": c[3]} for c in self.changes if c[0] > int(since) and wanted(c)]

    async def _watch(self, request: kmock.Request, plural: str, namespace: str) -> AsyncIterator[Any]:
        """A watch stream: kmock sends each yielded event as one JSON line."""
        yield b""  # the answer's headers go out now, as kube-apiserver's do
        selector = request.params.get("fieldSelector", "")
        timeout = float(request.params.get("timeoutSeconds") or 1800)
        raw = request._raw_request

        def wanted(change: Change) -> bool:
            obj = change[3]
            ns = str(obj["metadata"].get("namespace") or "")
            return (
                change[1] == plural
                and (not namespace or ns == namespace)
                and field_selector_matches(obj, selector)
            )

        queue: asyncio.Queue[Change | None] = asyncio.Queue()
        self._watchers.add(queue)  # with the backlog taken at once: no change is lost or sent twice
        try:
            for event in self._backlog(wanted, request.params.get("resourceVersion", "")):
                yield event
                if event["type"] == "ERROR":
                    return
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout
            while (left := deadline - loop.time()) > 0:
                if raw is not None and (raw.transport is None or raw.transport.is_closing()):
                    return  # the client went away
                try:
                    change = await asyncio.wait_for(queue.get(), timeout=min(left, 0.2))
                except TimeoutError:
                    continue
                if change is None:  # the server stops
                    return
                if wanted(change):
                    yield {"type": change[2], "object": change[3]}
        finally:
            self._watchers.discard(queue)

    @staticmethod
    def _is_served(request: kmock.Request) -> bool:
        res = request.resource
        return res is not None and (res.group, res.version, res.plural) in SERVED

    async def _serve(self, request: kmock.Request) -> Any:
        if _is_watch(request):
            res = request.resource
            assert res is not None
            assert res.plural is not None
            return self._watch(request, res.plural, request.namespace or "")
        if request.subresource != "eviction":
            if self.latency_seconds:
                await asyncio.sleep(self.latency_seconds)
            return self._serve_now(request)
        self.evictions_in_flight += 1
        self.max_evictions_in_flight = max(self.max_evictions_in_flight, self.evictions_in_flight)
        try:
            if self.latency_seconds:
                await asyncio.sleep(self.latency_seconds)
            return self._serve_now(request)
        finally:
            self.evictions_in_flight -= 1

    def _serve_now(self, request: kmock.Request) -> dict[str, Any]:  # noqa: PLR0911  one per verb
        res = request.resource
        assert res is not None
        assert res.plural is not None
        plural = res.plural
        namespace = request.namespace or ""
        method = str(request.method.value).upper()
        if request.name is None:
            if method == "GET":
                return self._list(plural, namespace, request.params.get("fieldSelector", ""))
            if method == "POST":
                return self._create(plural, namespace, request.data)
            raise status_error(405, "MethodNotAllowed", f"{method} on a collection")
        key = (plural, namespace, request.name)
        sub = request.subresource or ""
        if sub == "eviction" and method == "POST":
            return self._evict(namespace, request.name, request.data or {})
        if sub not in ("", "status"):
            raise status_error(404, "NotFound", f"subresource {sub} is not served")
        current = self.store.get(key)
        if current is None:
            raise status_error(404, "NotFound", f'{plural} "{request.name}" not found')
        if method == "GET":
            return current
        if method == "PUT":
            return self._write(key, current, request.data, sub=sub, mode="replace")
        if method == "PATCH":
            ctype = request.headers.get("Content-Type", "").split(";")[0].strip()
            mode = {
                "application/merge-patch+json": "merge",
                "application/strategic-merge-patch+json": "strategic",
            }.get(ctype)
            if mode is None:
                raise status_error(415, "UnsupportedMediaType", f"patch type {ctype!r} is not served")
            return self._write(key, current, request.data, sub=sub, mode=mode)
        if method == "DELETE":
            self._remove(key)
            return {"kind": "Status", "apiVersion": "v1", "status": "Success"}
        raise status_error(405, "MethodNotAllowed", method)

    def _list(self, plural: str, namespace: str, selector: str) -> dict[str, Any]:
        items = [
            obj
            for (p, ns, _), obj in self.store.items()
            if p == plural and (not namespace or ns == namespace) and field_selector_matches(obj, selector)
        ]
        return {
            "kind": f"{KINDS[plural]}List",
            "apiVersion": "v1",
            "metadata": {"resourceVersion": str(next(self._versions))},
            "items": items,
        }

    def _create(self, plural: str, namespace: str, body: Any) -> dict[str, Any]:
        if not isinstance(body, Mapping) or not body.get("metadata", {}).get("name"):
            raise status_error(422, "Invalid", "metadata.name: Required value")
        key = (plural, namespace, str(body["metadata"]["name"]))
        if key in self.store:
            raise status_error(409, "AlreadyExists", f'{plural} "{key[2]}" already exists')
        obj = copy.deepcopy(dict(body))
        obj["metadata"]["namespace"] = namespace or None
        if not namespace:
            obj["metadata"].pop("namespace")
        obj.setdefault("kind", KINDS[plural])
        self.store[key] = self._stamp(obj, new=True)
        return self.store[key]

    def _write(self, key: Key, current: dict[str, Any], body: Any, *, sub: str, mode: str) -> dict[str, Any]:
        if not isinstance(body, Mapping):
            raise status_error(400, "BadRequest", "expected a JSON object")
        wanted_rv = body.get("metadata", {}).get("resourceVersion")
        if wanted_rv and wanted_rv != current["metadata"]["resourceVersion"]:
            raise status_error(
                409,
                "Conflict",
                f'Operation cannot be fulfilled on {key[0]} "{key[2]}": the object has been modified; '
                "please apply your changes to the latest version and try again",
            )
        if mode == "replace":
            new = copy.deepcopy(dict(body))
        elif mode == "merge":
            new = merge_patch(current, body)
        else:
            new = strategic_merge_patch(current, body)
        # The status subresource changes status (and metadata), never spec; the main resource never
        # changes status.
        if sub == "status":
            new = {**current, "metadata": new.get("metadata", {}), "status": new.get("status", {})}
        elif "status" in current or "status" in new:
            new["status"] = current.get("status", {})
        new["metadata"] = {
            **new.get("metadata", {}),
            "uid": current["metadata"]["uid"],
            "name": current["metadata"]["name"],
        }
        self.store[key] = self._stamp(new, new=False)
        return self.store[key]

    def _evict(self, namespace: str, name: str, body: Mapping[str, Any]) -> dict[str, Any]:
        key = ("pods", namespace, name)
        pod = self.store.get(key)
        if pod is None:
            self.evictions.append((namespace, name, 404))
            raise status_error(404, "NotFound", f'pods "{name}" not found')
        labels = pod.get("metadata", {}).get("labels") or {}
        budgets = [
            obj
            for (p, ns, _), obj in self.store.items()
            if p == "poddisruptionbudgets" and ns == namespace and _selects(obj, labels)
        ]
        terminal = pod.get("status", {}).get("phase") in ("Succeeded", "Failed")
        if not terminal and not pod["metadata"].get("deletionTimestamp"):
            if len(budgets) > 1:
                self.evictions.append((namespace, name, 500))
                raise status_error(
                    500,
                    "InternalError",
                    "This pod has more than one PodDisruptionBudget, which the eviction "
                    "subresource does not support.",
                )
            if budgets:
                status = budgets[0].setdefault("status", {})
                if int(status.get("disruptionsAllowed", 0)) <= 0:
                    self.evictions.append((namespace, name, 429))
                    pdb_name = budgets[0]["metadata"]["name"]
                    raise status_error(
                        429,
                        "TooManyRequests",
                        "Cannot evict pod as it would violate the pod's disruption budget. "
                        f"The disruption budget {pdb_name} needs more healthy pods.",
                    )
                status["disruptionsAllowed"] = int(status["disruptionsAllowed"]) - 1
                self._stamp(budgets[0], new=False)
        self.evictions.append((namespace, name, 201))
        grace = (body.get("deleteOptions") or {}).get("gracePeriodSeconds")
        pod["metadata"]["deletionTimestamp"] = _now()
        if grace is not None:
            pod["metadata"]["deletionGracePeriodSeconds"] = grace
        self._stamp(pod, new=False)
        if self.termination_seconds:
            task = asyncio.get_running_loop().create_task(self._terminate(key, self.termination_seconds))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        else:
            self._finish_termination(key)
        return {"kind": "Status", "apiVersion": "v1", "status": "Success", "code": 201}

    async def _terminate(self, key: Key, delay: float) -> None:
        await asyncio.sleep(delay)
        self._finish_termination(key)

    def _finish_termination(self, key: Key) -> None:
        pod = self._remove(key)
        if pod is not None and self.replace_evicted:
            fresh = copy.deepcopy(pod)
            fresh["metadata"].pop("deletionTimestamp", None)
            fresh["metadata"].pop("deletionGracePeriodSeconds", None)
            self.store[key] = self._stamp(fresh, new=True)


def _is_watch(request: kmock.Request) -> bool:
    return request.name is None and request.params.get("watch") in ("true", "1")


def _selects(pdb: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    selector = pdb.get("spec", {}).get("selector") or {}
    match = selector.get("matchLabels") or {}
    return all(labels.get(k) == v for k, v in match.items())


def _tls_server(context: ssl.SSLContext) -> type[aiohttp.test_utils.RawTestServer]:
    class TlsServer(aiohttp.test_utils.RawTestServer):
        async def __aenter__(self) -> TlsServer:
            await self.start_server(ssl=context)
            return self

    return TlsServer


@asynccontextmanager
async def serve(
    *, tls: ssl.SSLContext | None = None, **options: Any
) -> AsyncIterator[tuple[FakeApiServer, str]]:
    """A running FakeApiServer on 127.0.0.1 and its base URL (https:// with `tls`, as a pod sees it)."""
    extra: dict[str, Any] = {"server_cls": _tls_server(tls)} if tls is not None else {}
    async with FakeApiServer(**options) as api, kmock.Server(api, **extra) as server:
        try:
            yield api, str(server.url).rstrip("/")
        finally:
            await api.aclose()


# -- object builders -------------------------------------------------------------------------------


def node(
    name: str,
    *,
    unschedulable: bool = False,
    taints: list[dict[str, str]] | None = None,
    annotations: dict[str, str] | None = None,
    provider_id: str = "",
) -> dict[str, Any]:
    """A Node as the API serves it, with a kubelet-written Ready condition."""
    spec: dict[str, Any] = {}
    if unschedulable:
        spec["unschedulable"] = True
    if taints:
        spec["taints"] = taints
    if provider_id:
        spec["providerID"] = provider_id
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {"kubernetes.io/hostname": name},
            "annotations": annotations or {},
        },
        "spec": spec,
        "status": {
            "conditions": [
                {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "kubelet is ready"}
            ]
        },
    }


def pod(
    name: str,
    *,
    node_name: str,
    namespace: str = "training",
    owner: tuple[str, str] | None = ("ReplicaSet", "trainer-5d9f"),
    labels: dict[str, str] | None = None,
    emptydir: bool = False,
    phase: str = "Running",
    annotations: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A Pod bound to `node_name`."""
    meta: dict[str, Any] = {
        "name": name,
        "namespace": namespace,
        "labels": labels or {"app": "trainer"},
        "annotations": annotations or {},
    }
    if owner is not None:
        meta["ownerReferences"] = [
            {
                "apiVersion": "apps/v1",
                "kind": owner[0],
                "name": owner[1],
                "uid": "u-" + owner[1],
                "controller": True,
            }
        ]
    volumes = [{"name": "scratch", "emptyDir": {}}] if emptydir else []
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta,
        "spec": {
            "nodeName": node_name,
            "containers": [{"name": "main", "image": "trainer"}],
            "volumes": volumes,
        },
        "status": {"phase": phase},
    }


def pdb(name: str, *, namespace: str = "training", match: dict[str, str], allowed: int) -> dict[str, Any]:
    """A policy/v1 PodDisruptionBudget with its status already computed."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"selector": {"matchLabels": match}, "minAvailable": 1},
        "status": {"disruptionsAllowed": allowed},
    }
