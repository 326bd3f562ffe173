"""The Kubernetes executor: `remediator.cluster.Cluster` over the official asyncio client (kubernetes.aio).

Every write is made so that it can be retried and never clobbers somebody else's change:

- cordon, un-cordon and taints are JSON merge patches that carry the resourceVersion just read, so a
  concurrent writer makes the API answer 409 and the change is recomputed on the fresh object (the
  taint list is computed from the node as read, never replaced blindly);
- what this service did is recorded in node annotations (`accel-health.io/…`), and every write names
  this service as its field manager: un-cordon requires both the annotation and the API server's own
  record (metadata.managedFields) that this service still manages spec.unschedulable, so a human's
  uncordon + re-cordon (which moves the field to their manager) is never undone; un-taint undoes only
  the taints the annotation lists;
- node conditions go to the status subresource as strategic merge patches (conditions merge by
  type, so the kubelet's own conditions are untouched); Events go to core/v1 with involvedObject
  kind Node, the way the kubelet writes them, so `kubectl describe node` lists them;
- drains follow `kubectl drain` (planning in remediator.actuators.drainplan) with policy/v1 Evictions, bounded
  concurrency, 429s retried with backoff until the deadline, and a wait until every evicted pod is
  gone or replaced; progress is kept in annotations, so a restarted (or newly elected) remediator
  resumes a half-done drain with the original deadline.

Reads come from watch-backed caches (remediator.executors.watchcache), not a LIST per read: every
node for as long as the service runs; while a drain of a node runs, that node's pods (LIST with
`fieldSelector=spec.nodeName=…` once, then WATCH) and every PodDisruptionBudget (shared by the
drains running at once). A LIST made for a plan (`list_pods`, `list_pdbs`) is where a drain that
starts right after it begins its watch, so planning and draining a node cost one LIST of its pods.

Transport failures, timeouts and 5xx answers are retried a few times and then raise
`BackendUnavailable`: the webhook answers 503 and Alertmanager redelivers, and because every write
checks the node's state first, a redelivery never does anything twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import random
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
from kubernetes.aio import client as k8s
from kubernetes.aio import config as k8s_config
from kubernetes.aio.config import incluster_config as k8s_incluster

from remediator.actuators.drainplan import DrainPlan, plan_drain
from remediator.cluster import (
    BackendUnavailable,
    BlockedPod,
    DrainOutcome,
    DrainSettings,
    EvictionResult,
    Node,
    NodeCondition,
    NodeListener,
    NotLeader,
    ObjectFormatError,
    Pod,
    PodDisruptionBudget,
    Returned,
    StateConflict,
    Taint,
    WriteRefused,
    node_from_object,
    pdb_from_object,
    pod_from_object,
)
from remediator.executors.watchcache import SharedWatch, WatchCache, namespaced_key
from remediator.gates.state import StateError
from remediator.lifecycle.record import (
    CORDONED_AT,
    CORDONED_BY,
    DRAIN_BLOCKED,
    DRAIN_DEADLINE,
    DRAIN_STARTED,
    DRAIN_STATUS,
    MANAGER,
    PREFIX,
    RETURN_FORGETS,
    TAINTS_ADDED,
    RecordChange,
    owned_taints,
    parse_rfc3339,
    rfc3339,
    taint_id,
)

logger = logging.getLogger("remediator.kubernetes")

MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
EVENT_MESSAGE_LIMIT = 1024
EVENT_SERIES_SECONDS = 600.0
"""A repeat within this long bumps an Event's count (client-go's window); older series are forgotten."""


class ApiError(Exception):
    """A non-retryable answer from the API server (4xx other than 429, or 500 from an eviction)."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message


SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
"""Where Kubernetes mounts a pod's service-account token, CA certificate and namespace."""


@dataclass(frozen=True)
class ClientConfig:
    """A Kubernetes client configuration and where it came from (logged at start-up)."""

    configuration: k8s.Configuration
    """The client configuration."""
    source: str
    """Which source it was read from, in words."""


PDB_API = "policy/v1 poddisruptionbudgets"
DAEMONSET_API = "apps/v1 daemonsets"
"""Read to tell a pod of a DaemonSet that no longer exists (kubectl drain's orphan), when allowed."""
"""The optional API a drain reads (planning only; evictions enforce the budgets themselves)."""

STATE_KEY = "state.json"
"""The data key of the document an older release kept all its gate state in (migrated, then deleted)."""
GATES_KEY = "gates.json"
"""The gates ConfigMap's data key: the pause switch and the storm breaker's latch
(remediator/gates/state.py)."""

PRIMED_LIST_SECONDS = 5.0
"""How long a LIST made for a plan may seed the watch of a drain that starts after it (the engine
plans a drain, cordons, then starts it: well within this). Older ones are not used: the drain lists."""
PRIMED_LISTS_KEPT = 64
"""At most this many such LISTs are kept (the oldest go first)."""
TLS_CLOSE_GRACE_SECONDS = 0.25
"""How long the event loop must still run after TLS connections are closed for their sockets to close
(aiohttp's advice): `close` waits it after watches, a command's own loop before it ends."""


@dataclass(frozen=True)
class KubernetesSettings:
    """How the executor talks to the API server."""

    manager: str = MANAGER
    """Written into annotations and as the Events' source component; identifies this service."""
    instance: str = field(default_factory=socket.gethostname)
    """Events' reportingInstance (the pod name in a cluster)."""
    event_namespace: str = "default"
    """Namespace for node Events (the kubelet uses `default`; `kubectl describe node` finds them)."""
    request_timeout_seconds: float = 10.0
    """Total time allowed for one API request."""
    attempts: int = 3
    """Tries per request on transport errors, timeouts, 5xx and 429 (not for evictions)."""
    retry_base_seconds: float = 0.2
    """First retry delay; doubled per attempt, with jitter."""
    conflict_attempts: int = 8
    """Tries of a read-modify-write on 409 Conflict before giving up."""
    state_namespace: str = "accel-health"
    """Namespace of the gates ConfigMap (the remediator's own)."""
    gates_configmap: str = "accel-health-remediator-gates"
    """Name of the ConfigMap holding the pause switch and the storm breaker's latch (under 1 KiB,
    written only when one of them changes). Everything else this service remembers is on the nodes."""
    legacy_configmap: str = "accel-health-remediator-state"
    """Name of the ConfigMap an older release kept all its gate state in: read once by a new leader,
    what still matters moved onto the nodes, then deleted."""
    watch_seconds: int = 300
    """Server-side timeout of one WATCH request (the caches' watches are started again from their
    last resourceVersion when it ends)."""


def _pick_kubeconfig(kubeconfig: Path | None, env: Mapping[str, str], sa_dir: Path) -> tuple[str | None, str]:
    """(kubeconfig path, source in words), or (None, ...) for the service account; client-go's order.

    Raises ValueError naming everything tried when nothing is there.
    """
    if kubeconfig is not None:
        return str(kubeconfig), f"--kubeconfig {kubeconfig}"
    tried = ["--kubeconfig (not given)"]
    paths = [p for p in env.get("KUBECONFIG", "").split(os.pathsep) if p]
    existing = [p for p in paths if Path(p).expanduser().exists()]
    if existing:
        joined = os.pathsep.join(existing)
        return joined, f"$KUBECONFIG ({joined})"
    tried.append(f"$KUBECONFIG ({'no file at ' + os.pathsep.join(paths) if paths else 'not set'})")
    host, port = env.get("KUBERNETES_SERVICE_HOST", ""), env.get("KUBERNETES_SERVICE_PORT", "")
    if host and port and (sa_dir / "token").is_file():
        return None, "in-cluster service account"
    if host and port:
        tried.append(f"in-cluster service account (no token at {sa_dir / 'token'})")
    else:
        tried.append("in-cluster service account (KUBERNETES_SERVICE_HOST/KUBERNETES_SERVICE_PORT not set)")
    home = Path(env.get("HOME") or Path.home()) / ".kube" / "config"
    if home.exists():
        return str(home), str(home)
    tried.append(f"{home} (no such file)")
    raise ValueError("cannot load Kubernetes client configuration; tried " + "; ".join(tried))


def _annotations(obj: Mapping[str, Any]) -> dict[str, str]:
    return dict((obj.get("metadata") or {}).get("annotations") or {})


def _record_annotation(record: RecordChange | None, obj: Mapping[str, Any]) -> dict[str, str | None]:
    """The annotation entry that applies `record` to the node as read ({} for none)."""
    return {} if record is None else record.annotation(_annotations(obj))


def _kept(stored: Mapping[str, str], wanted: Mapping[str, str], record: RecordChange | None) -> bool:
    """Did a write keep these annotations and this record change?"""
    if any(stored.get(k) != v for k, v in wanted.items()):
        return False
    return record is None or not record.annotation(stored)


def _taint_json(taint: Taint) -> dict[str, str]:
    out = {"key": taint.key, "effect": taint.effect}
    if taint.value:
        out["value"] = taint.value
    return out


NODE_STATUS_UNREAD = ("images", "volumesInUse", "volumesAttached", "daemonEndpoints", "config")
"""Parts of a node's status the remediator never reads. `images` alone is tens of KB on a GPU node
with many images: kept for 2,000 nodes it would be most of the service's memory."""


def trim_node(obj: dict[str, Any]) -> dict[str, Any]:
    """A node as the cache keeps it: without the status the remediator never reads, and with
    managedFields cut down to who manages `spec.unschedulable` (what `manages_unschedulable` reads)."""
    status = obj.get("status")
    meta = obj.get("metadata")
    if not isinstance(status, dict) or not isinstance(meta, dict):
        return obj
    out = dict(obj)
    out["status"] = {k: v for k, v in status.items() if k not in NODE_STATUS_UNREAD}
    entries = meta.get("managedFields")
    if isinstance(entries, list):
        kept: list[dict[str, Any]] = []
        for entry in entries:
            if not isinstance(entry, dict):
                continue
            fields_v1 = entry.get("fieldsV1")
            spec = (fields_v1.get("f:spec") or {}) if isinstance(fields_v1, dict) else {}
            fields: dict[str, Any] = {"f:spec": {"f:unschedulable": {}}} if "f:unschedulable" in spec else {}
            kept.append({"manager": entry.get("manager"), "fieldsV1": fields})
        out["metadata"] = {**meta, "managedFields": kept}
    return out


def manages_unschedulable(obj: Mapping[str, Any], manager: str) -> bool:
    """Does `manager` still own spec.unschedulable, per the API server's managedFields? (True when the
    server records no managedFields at all: then only the annotation can tell.)"""
    entries = (obj.get("metadata") or {}).get("managedFields")
    if not entries:
        return True
    for entry in entries:
        if entry.get("manager") != manager:
            continue
        spec = (entry.get("fieldsV1") or {}).get("f:spec") or {}
        if "f:unschedulable" in spec:
            return True
    return False


BLOCKED_SHOWN = 20
"""Pods `drain-blocked` names at most (the rest counted): a node's annotations stay small whatever
blocks a drain (the decision record and the Event list them all)."""


def blocked_annotation(blocked: Sequence[BlockedPod]) -> str:
    """`drain-blocked`: `ns/a,ns/b` of the first BLOCKED_SHOWN pods, then `,+N more`."""
    names = [f"{b.namespace}/{b.name}" for b in blocked[:BLOCKED_SHOWN]]
    if len(blocked) > BLOCKED_SHOWN:
        names.append(f"+{len(blocked) - BLOCKED_SHOWN} more")
    return ",".join(names)


def _refused_or_unavailable(what: str, exc: ApiError) -> Exception:
    """A write's error answer: refused for good (400, 403, 422: the same write gets the same answer;
    the step is recorded as failed, not retried by every redelivery), else worth a retry (503)."""
    if exc.status in (400, 403, 422):
        return WriteRefused(f"Kubernetes API refused to {what}: {exc}")
    return BackendUnavailable(f"Kubernetes API: {what}: {exc}")


def _pod_key(obj: Mapping[str, Any]) -> tuple[str, str]:
    meta = obj.get("metadata") or {}
    return str(meta.get("namespace") or "default"), str(meta.get("name", ""))


def _uid(obj: Mapping[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("uid", ""))


class KubernetesCluster:
    """remediator.cluster.Cluster against a real API server.

    `should_act` is asked before every write; when it says no (this replica is not the leader) the
    write is not made and NotLeader is raised.
    """

    def __init__(
        self,
        *,
        api: k8s.ApiClient,
        settings: KubernetesSettings | None = None,
        should_act: Callable[[], bool] = lambda: True,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.api = api
        self.settings = settings or KubernetesSettings()
        self._core = k8s.CoreV1Api(api)
        self._policy = k8s.PolicyV1Api(api)
        self._apps = k8s.AppsV1Api(api)
        self._should_act = should_act
        self._clock = clock
        self._events: dict[tuple[str, str, str, str], tuple[str, int, float]] = {}
        self._state_version: str | None = None  # resourceVersion of the state ConfigMap last read
        self.api_unavailable: dict[str, int] = {}
        """Optional API -> how often it answered 404 (not served by this API server); a metric."""
        self.nodes = WatchCache(
            what="nodes",
            list_all=self._list_nodes_with_version,
            watch=self._core.list_node_without_preload_content,
            trim=trim_node,
            watch_seconds=self.settings.watch_seconds,
        )
        """The watch-backed node cache; reads come from it once `start_cache()` synced it."""
        self._cache_task: asyncio.Task[None] | None = None
        self._watched = False
        """A watch of pods or PodDisruptionBudgets ran (see `close`)."""
        self.pod_watches: dict[str, SharedWatch] = {}
        """Node -> the watch of its pods, while a drain of it runs."""
        self.pdb_watches: dict[str, SharedWatch] = {}
        """The watch of every PodDisruptionBudget (key ""), while any drain runs."""
        self._primed: dict[str, tuple[float, list[dict[str, Any]], str]] = {}
        self._started_here: dict[str, tuple[float, bool]] = {}
        # node -> (deadline, resumed) of the drain `start_drain` just stamped or found running (the
        # deadline to the fraction of a second, where the annotation keeps whole seconds)
        # LISTs just made for a plan: watch key -> (when, items, resourceVersion)

    # -- connecting ----------------------------------------------------------------------------

    @staticmethod
    async def configuration(
        *,
        kubeconfig: Path | None = None,
        context: str | None = None,
        in_cluster: bool = False,
        environ: Mapping[str, str] | None = None,
        service_account_dir: Path | None = None,
    ) -> ClientConfig:
        """Client configuration, found the way client-go and controller-runtime find it.

        `in_cluster` uses the pod's service account and nothing else. Otherwise the first of: the
        `kubeconfig` file; the files in $KUBECONFIG (separated by ':'); the pod's service account
        (when KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT are set and its token exists);
        ~/.kube/config. Raises ValueError naming everything tried. The asyncio client allows 100
        connections in flight, well above a drain's concurrency.
        """
        env = os.environ if environ is None else environ
        sa_dir = SERVICE_ACCOUNT_DIR if service_account_dir is None else service_account_dir

        async def from_kubeconfig(path: str, source: str) -> ClientConfig:
            cfg = k8s.Configuration()
            try:
                await k8s_config.load_kube_config(  # type: ignore[no-untyped-call]  # untyped upstream
                    config_file=path, context=context, client_configuration=cfg, persist_config=False
                )
            except (k8s_config.ConfigException, OSError, ValueError, TypeError, AttributeError) as exc:
                # A malformed file makes the loader raise anything from ConfigException to TypeError.
                raise ValueError(f"cannot load Kubernetes client configuration from {source}: {exc}") from exc
            return ClientConfig(cfg, source)

        def from_service_account() -> ClientConfig:
            cfg = k8s.Configuration()
            loader = k8s_incluster.InClusterConfigLoader(  # type: ignore[no-untyped-call]  # untyped upstream
                token_filename=str(sa_dir / "token"), cert_filename=str(sa_dir / "ca.crt"), environ=env
            )
            try:
                loader.load_and_set(cfg)  # type: ignore[no-untyped-call]  # untyped upstream
            except (k8s_config.ConfigException, OSError) as exc:
                raise ValueError(
                    f"cannot load Kubernetes client configuration from the service account in {sa_dir}: {exc}"
                ) from exc
            return ClientConfig(cfg, f"in-cluster service account ({sa_dir}, API {cfg.host})")

        if in_cluster:
            return from_service_account()
        path, source = _pick_kubeconfig(kubeconfig, env, sa_dir)
        if path is None:
            return from_service_account()
        return await from_kubeconfig(path, source)

    async def start_cache(self, *, wait_seconds: float = 60.0) -> bool:
        """Start watching nodes and wait (up to `wait_seconds`) for the first LIST: whether it synced.
        Until it has, node reads go to the API."""
        if self._cache_task is None:
            self._cache_task = asyncio.create_task(self.nodes.run(), name="node-cache")
        return await self.nodes.wait_synced(wait_seconds)

    async def close(self) -> None:
        """Stop the watches and close the HTTP connection pool.

        A watch stopped mid-stream gives its connection back unfinished, and the pool closes that
        TLS connection on the spot, outside the set of connections its own close waits for. The
        TLS shutdown needs the event loop for a moment more: without it, a loop that ends right
        after this (a test, a command) leaves the socket to the garbage collector, which reports it
        unclosed wherever it happens to run. So after watches, the close waits TLS_CLOSE_GRACE_SECONDS."""
        watched = self._watched or self._cache_task is not None
        if self._cache_task is not None:
            self._cache_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._cache_task
            self._cache_task = None
        for table in (self.pod_watches, self.pdb_watches):
            for shared in list(table.values()):
                await shared.stop()
            table.clear()
        await self.api.close()  # type: ignore[no-untyped-call]  # untyped upstream
        if watched:
            await asyncio.sleep(TLS_CLOSE_GRACE_SECONDS)

    # -- the request layer ---------------------------------------------------------------------

    def _ensure_leader(self, what: str) -> None:
        if not self._should_act():
            raise NotLeader(f"not the leader; refusing to {what}")

    async def _call(
        self,
        what: str,
        method: Callable[..., Awaitable[Any]],
        *args: Any,
        retry: bool = True,
        **kwargs: Any,
    ) -> Any:
        """One API request: the parsed JSON body of a 2xx answer.

        Transport errors, timeouts, 5xx and 429 are retried (when `retry`) and then raise
        BackendUnavailable; other 4xx raise ApiError at once.
        """
        attempts = self.settings.attempts if retry else 1
        delay = self.settings.retry_base_seconds
        last = ""
        for attempt in range(1, attempts + 1):
            try:
                resp = await method(*args, _request_timeout=self.settings.request_timeout_seconds, **kwargs)
                try:
                    body = await resp.read()
                finally:
                    resp.release()
            except (aiohttp.ClientError, TimeoutError) as exc:
                last = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            else:
                if 200 <= resp.status < 300:
                    return json.loads(body) if body else {}
                reason, message = resp.reason or "", body.decode("utf-8", "replace")
                try:
                    status_obj = json.loads(body)
                    reason = str(status_obj.get("reason") or reason)
                    message = str(status_obj.get("message") or message)
                except (ValueError, AttributeError):
                    pass
                if resp.status < 500 and resp.status != 429:
                    raise ApiError(resp.status, reason, message)
                if not retry:
                    raise ApiError(resp.status, reason, message)
                last = f"{resp.status} {reason}: {message}"[:300]
            if attempt < attempts:
                await asyncio.sleep(delay * (0.5 + random.random()))  # noqa: S311  jitter, not crypto
                delay *= 2
        raise BackendUnavailable(f"Kubernetes API: {what} failed after {attempts} attempts: {last}")

    async def _read_node_object(self, name: str) -> dict[str, Any] | None:
        """The node as the API server has it now (a GET: read-modify-write starts here)."""
        try:
            obj: dict[str, Any] = await self._call(
                f"read node {name}", self._core.read_node_without_preload_content, name
            )
        except ApiError as exc:
            if exc.status == 404:
                self.nodes.forget(name)
                return None
            raise BackendUnavailable(f"Kubernetes API: read node {name}: {exc}") from exc
        self.nodes.observe(obj)
        return obj

    async def _cached_node_object(self, name: str) -> dict[str, Any] | None:
        """The node as the watch last saw it (the API when the cache is not synced yet)."""
        if self.nodes.synced:
            return self.nodes.get(name)
        return await self._read_node_object(name)

    async def _patch_node(
        self, name: str, body: Mapping[str, Any], *, status: bool = False, ctype: str = MERGE_PATCH
    ) -> dict[str, Any]:
        method = (
            self._core.patch_node_status_without_preload_content
            if status
            else self._core.patch_node_without_preload_content
        )
        obj: dict[str, Any] = await self._call(
            f"patch node {name}{'/status' if status else ''}",
            method,
            name,
            dict(body),
            _content_type=ctype,
            field_manager=self.settings.manager,
        )
        self.nodes.observe(obj)  # our own write, seen at once
        return obj

    async def _modify_node(
        self,
        name: str,
        what: str,
        change: Callable[[dict[str, Any]], dict[str, Any] | None],
        *,
        current: dict[str, Any] | None = None,
        status: bool = False,
        ctype: str = MERGE_PATCH,
    ) -> dict[str, Any] | None:
        """Read-modify-write with the resourceVersion as precondition; retried on 409 Conflict.

        `change` gets the node and returns a patch (without resourceVersion), or None when nothing
        needs to change. The first attempt starts from `current` or, when not given, from the node
        as the watch last saw it (no GET: a write costs one request); a conflict (the cache was
        behind, or another writer was there) reads the node from the API and decides again.
        `status` writes to the status subresource (conditions). Returns the node as written, or None
        when nothing was written.
        """
        if current is None and self.nodes.synced:
            current = self.nodes.get(name)
        for attempt in range(1, self.settings.conflict_attempts + 1):
            self._ensure_leader(what)  # also before a retry: a conflict may mean another leader wrote
            if attempt > 1 or current is None:
                current = await self._read_node_object(name)
            if current is None:
                logger.warning("%s: node %s not found; nothing to do", what, name)
                return None
            patch = change(current)
            if patch is None:
                return None
            rv = current.get("metadata", {}).get("resourceVersion")
            patch.setdefault("metadata", {})["resourceVersion"] = rv
            try:
                written = await self._patch_node(name, patch, status=status, ctype=ctype)
            except ApiError as exc:
                if exc.status == 409 and attempt < self.settings.conflict_attempts:
                    logger.info("%s on %s: conflict (attempt %d), re-reading", what, name, attempt)
                    await asyncio.sleep(0.01 * attempt * random.random())  # noqa: S311  jitter, not crypto
                    continue
                if exc.status == 404:
                    return None
                raise _refused_or_unavailable(f"{what} {name}", exc) from exc
            return written
        raise BackendUnavailable(f"Kubernetes API: {what} {name}: still conflicting")  # pragma: no cover

    async def _annotate(
        self,
        name: str,
        what: str,
        annotations: Mapping[str, str | None],
        *,
        record: RecordChange | None = None,
    ) -> None:
        """Merge-patch this service's own annotations, and apply `record` to the node's record in the
        same write (with the resourceVersion as precondition: the record is computed from the node)."""
        if record is None:
            self._ensure_leader(what)
            try:
                await self._patch_node(name, {"metadata": {"annotations": dict(annotations)}})
            except ApiError as exc:
                if exc.status != 404:
                    raise _refused_or_unavailable(f"{what} {name}", exc) from exc
            return

        def change(obj: dict[str, Any]) -> dict[str, Any] | None:
            merged = {**dict(annotations), **record.annotation(_annotations(obj))}
            return {"metadata": {"annotations": merged}} if merged else None

        await self._modify_node(name, what, change)

    # -- reads ---------------------------------------------------------------------------------

    async def get_node(self, name: str) -> Node | None:
        obj = await self._cached_node_object(name)
        if obj is None:
            return None
        try:
            return node_from_object(obj)
        except ObjectFormatError as exc:
            raise BackendUnavailable(f"node {name} has an unexpected shape: {exc}") from exc

    async def annotate_node(
        self, node: str, annotations: Mapping[str, str | None], *, record: RecordChange | None = None
    ) -> None:
        """Set (or, with None, remove) annotations of this service on the node; `record` is applied
        to the node's record in the same write."""
        await self._annotate(node, "annotate", annotations, record=record)

    async def label_node(self, node: str, labels: Mapping[str, str | None]) -> None:
        """Set (or, with None, remove) labels on the node (a merge patch: other labels are kept)."""
        self._ensure_leader("label")
        try:
            await self._patch_node(node, {"metadata": {"labels": dict(labels)}})
        except ApiError as exc:
            if exc.status != 404:
                raise BackendUnavailable(f"Kubernetes API: label {node}: {exc}") from exc

    async def node_annotations(self, name: str) -> dict[str, str]:
        """The node's annotations ({} when it does not exist)."""
        obj = await self._read_node_object(name)
        return dict((obj or {}).get("metadata", {}).get("annotations") or {})

    def _api_missing(self, api: str, exc: ApiError) -> None:
        """An optional API this server does not serve: logged the first time, counted every time."""
        if api not in self.api_unavailable:
            logger.warning(
                "the API server does not serve %s (%s); going on without it "
                "(counted in accel_remediator_api_unavailable_total)",
                api,
                exc,
            )
        self.api_unavailable[api] = self.api_unavailable.get(api, 0) + 1

    async def _list_with_version(
        self, what: str, method: Callable[..., Awaitable[Any]], **kwargs: Any
    ) -> tuple[list[dict[str, Any]], str]:
        """Every page of a list and the list's resourceVersion (where a watch starts); ApiError as
        `_call` raises it."""
        items: list[dict[str, Any]] = []
        token: str | None = None
        while True:
            extra: dict[str, Any] = {"_continue": token} if token else {}
            page = await self._call(what, method, limit=500, **kwargs, **extra)
            items.extend(page.get("items") or [])
            meta = page.get("metadata") or {}
            token = meta.get("continue")
            if not token:
                return items, str(meta.get("resourceVersion", ""))

    async def _list_nodes_with_version(self) -> tuple[list[dict[str, Any]], str]:
        """Every node and the list's resourceVersion (where the node watch starts)."""
        try:
            return await self._list_with_version("list nodes", self._core.list_node_without_preload_content)
        except ApiError as exc:
            raise BackendUnavailable(f"Kubernetes API: list nodes: {exc}") from exc

    async def _list_pods_with_version(self, node: str) -> tuple[list[dict[str, Any]], str]:
        """The node's pods (any namespace) and the list's resourceVersion."""
        try:
            return await self._list_with_version(
                f"list pods on {node}",
                self._core.list_pod_for_all_namespaces_without_preload_content,
                field_selector=f"spec.nodeName={node}",
            )
        except ApiError as exc:
            raise BackendUnavailable(f"Kubernetes API: list pods on {node}: {exc}") from exc

    async def _list_pdbs_with_version(self) -> tuple[list[dict[str, Any]], str]:
        """Every PodDisruptionBudget and the list's resourceVersion; ApiError(404) when the server
        does not serve policy/v1, BackendUnavailable for anything else that fails."""
        try:
            return await self._list_with_version(
                "list PodDisruptionBudgets",
                self._policy.list_pod_disruption_budget_for_all_namespaces_without_preload_content,
            )
        except ApiError as exc:
            if exc.status == 404:
                raise
            raise BackendUnavailable(f"Kubernetes API: list PodDisruptionBudgets: {exc}") from exc

    # -- watches of drains ---------------------------------------------------------------------

    def _prime(self, key: str, listed: tuple[list[dict[str, Any]], str]) -> None:
        """Keep a LIST just made for a plan: a drain starting right after it watches from there."""
        self._primed.pop(key, None)
        self._primed[key] = (self._clock(), *listed)
        while len(self._primed) > PRIMED_LISTS_KEPT:
            del self._primed[next(iter(self._primed))]

    def _take_primed(self, key: str) -> tuple[list[dict[str, Any]], str] | None:
        entry = self._primed.pop(key, None)
        if entry is None or self._clock() - entry[0] > PRIMED_LIST_SECONDS:
            return None
        return entry[1], entry[2]

    def _pod_cache(self, node: str) -> WatchCache:
        return WatchCache(
            what=f"pods on {node}",
            list_all=lambda: self._list_pods_with_version(node),
            watch=self._core.list_pod_for_all_namespaces_without_preload_content,
            watch_args={"field_selector": f"spec.nodeName={node}"},
            key=namespaced_key,
            watch_seconds=self.settings.watch_seconds,
        )

    def _pdb_cache(self) -> WatchCache:
        return WatchCache(
            what="PodDisruptionBudgets",
            list_all=self._list_pdbs_with_version,
            watch=self._policy.list_pod_disruption_budget_for_all_namespaces_without_preload_content,
            key=namespaced_key,
            watch_seconds=self.settings.watch_seconds,
        )

    @contextlib.asynccontextmanager
    async def _watching(
        self, table: dict[str, SharedWatch], key: str, primed: str, make: Callable[[], WatchCache]
    ) -> AsyncIterator[WatchCache]:
        """The shared watch `table[key]`, synced, while the block runs: started (from the LIST kept
        under `primed`, or a LIST of its own) when nobody used it, stopped when the last user leaves."""
        shared = table.get(key)
        if shared is None:
            shared = table[key] = SharedWatch(make())
        self._watched = True
        shared.users += 1
        try:
            yield await shared.start(self._take_primed(primed))
        finally:
            shared.users -= 1
            if shared.users == 0:
                if table.get(key) is shared:
                    del table[key]
                await shared.stop()

    def watching_pods(self, node: str) -> contextlib.AbstractAsyncContextManager[WatchCache]:
        """The node's pods, watched while the block runs (a drain of the node)."""
        return self._watching(self.pod_watches, node, f"pods/{node}", lambda: self._pod_cache(node))

    def watching_pdbs(self) -> contextlib.AbstractAsyncContextManager[WatchCache]:
        """Every PodDisruptionBudget, watched while the block runs (shared by the drains running).
        Raises ApiError(404) when the server does not serve policy/v1."""
        return self._watching(self.pdb_watches, "", "pdbs", self._pdb_cache)

    async def _pod_objects(self, node: str) -> list[dict[str, Any]]:
        """The node's pods: from the watch while a drain of the node runs, else one LIST (kept for a
        drain that starts right after it)."""
        shared = self.pod_watches.get(node)
        if shared is not None and shared.running:
            return shared.cache.objects()
        listed = await self._list_pods_with_version(node)
        self._prime(f"pods/{node}", listed)
        return listed[0]

    async def list_nodes(self) -> list[Node]:
        try:
            if self.nodes.synced:
                return self.nodes.converted(node_from_object)
            objs, _ = await self._list_nodes_with_version()
            return [node_from_object(o) for o in objs]
        except ObjectFormatError as exc:
            raise BackendUnavailable(f"a node has an unexpected shape: {exc}") from exc

    async def list_pods(self, node: str) -> list[Pod]:
        try:
            return [pod_from_object(o) for o in await self._pod_objects(node)]
        except ObjectFormatError as exc:
            raise BackendUnavailable(f"a pod on {node} has an unexpected shape: {exc}") from exc

    async def daemonsets_exist(self, refs: Collection[tuple[str, str]]) -> set[tuple[str, str]] | None:
        """Which of these (namespace, name) DaemonSets exist (a GET each, as kubectl drain makes); None
        when the API does not say (no permission, not served): every one then counts as existing."""
        found: set[tuple[str, str]] = set()
        for namespace, name in sorted(set(refs)):
            try:
                await self._call(
                    f"read daemonset {namespace}/{name}",
                    self._apps.read_namespaced_daemon_set_without_preload_content,
                    name,
                    namespace,
                )
            except ApiError as exc:
                if exc.status == 404 and exc.reason == "NotFound":
                    continue  # gone: its pods are orphans
                self._api_missing(DAEMONSET_API, exc)
                return None
            found.add((namespace, name))
        return found

    async def list_pdbs(self) -> list[PodDisruptionBudget]:
        """Every PodDisruptionBudget (from the watch while a drain runs, else one LIST); none when the
        API server does not serve policy/v1 (before 1.21).

        Without the list a drain is still safe: every eviction goes through the Eviction API, and the
        API server enforces the budgets there (429 while a budget allows no disruption), so a pod a
        budget protects is only planned as `evict` instead of `waits on a PodDisruptionBudget`, and
        then waits for the same 429s. The missing API is logged once and counted
        (accel_remediator_api_unavailable_total), never a 503 forever.
        """
        shared = self.pdb_watches.get("")
        if shared is not None and shared.running:
            objs = shared.cache.objects()
        else:
            try:
                listed = await self._list_pdbs_with_version()
            except ApiError as exc:
                self._api_missing(PDB_API, exc)
                return []
            self._prime("pdbs", listed)
            objs = listed[0]
        try:
            return [pdb_from_object(o) for o in objs]
        except ObjectFormatError as exc:
            raise BackendUnavailable(f"a PodDisruptionBudget has an unexpected shape: {exc}") from exc

    # -- the gates ConfigMap (pause, breaker latch) and the older release's state ---------------

    async def _read_configmap(self, name: str) -> dict[str, Any] | None:
        namespace = self.settings.state_namespace
        try:
            obj: dict[str, Any] = await self._call(
                f"read ConfigMap {namespace}/{name}",
                self._core.read_namespaced_config_map_without_preload_content,
                name,
                namespace,
            )
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise BackendUnavailable(f"Kubernetes API: read ConfigMap {namespace}/{name}: {exc}") from exc
        return obj

    @staticmethod
    def _document(obj: Mapping[str, Any], key: str, where: str) -> dict[str, Any] | None:
        text = (obj.get("data") or {}).get(key)
        if text is None:
            return None
        try:
            document = json.loads(text)
        except ValueError as exc:
            raise StateError(f"ConfigMap {where} key {key} is not JSON: {exc}") from exc
        if not isinstance(document, dict):
            raise StateError(f"ConfigMap {where} key {key} is not a JSON object")
        return document

    async def load_gates(self) -> Mapping[str, Any] | None:
        """The pause switch and breaker latch last saved; None when there are none yet. StateError
        when the ConfigMap holds something that is not a JSON object (the engine then starts paused
        rather than with the gates open), BackendUnavailable when unreachable."""
        name = self.settings.gates_configmap
        obj = await self._read_configmap(name)
        self._state_version = None if obj is None else (obj.get("metadata") or {}).get("resourceVersion")
        if obj is None:
            return None
        return self._document(obj, GATES_KEY, f"{self.settings.state_namespace}/{name}")

    async def save_gates(self, document: Mapping[str, Any]) -> None:
        """Replace the gates document, with the resourceVersion last read or written as precondition
        (creating the ConfigMap when there was none); StateConflict when another writer changed or
        created it since."""
        name, namespace = self.settings.gates_configmap, self.settings.state_namespace
        self._ensure_leader(f"write ConfigMap {namespace}/{name}")
        body: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {
                "name": name,
                "namespace": namespace,
                "labels": {"app.kubernetes.io/managed-by": self.settings.manager},
            },
            "data": {GATES_KEY: json.dumps(document, separators=(",", ":"), sort_keys=True)},
        }
        what = f"write ConfigMap {namespace}/{name}"
        try:
            if self._state_version is None:
                obj = await self._call(
                    what, self._core.create_namespaced_config_map_without_preload_content, namespace, body
                )
            else:
                body["metadata"]["resourceVersion"] = self._state_version
                obj = await self._call(
                    what,
                    self._core.replace_namespaced_config_map_without_preload_content,
                    name,
                    namespace,
                    body,
                )
        except ApiError as exc:
            if exc.status in (404, 409):  # changed, created or deleted by another writer
                raise StateConflict(f"{what}: {exc}") from exc
            raise BackendUnavailable(f"Kubernetes API: {what}: {exc}") from exc
        self._state_version = (obj.get("metadata") or {}).get("resourceVersion")

    async def load_legacy_state(self) -> Mapping[str, Any] | None:
        """The gate-state document of an older release, if its ConfigMap is still there (StateError
        when it holds garbage). Read with a LIST narrowed to its name (the quarantine Role's `list`:
        no grant of its own for an object that is read once)."""
        name, namespace = self.settings.legacy_configmap, self.settings.state_namespace
        try:
            page = await self._call(
                f"list ConfigMap {namespace}/{name}",
                self._core.list_namespaced_config_map_without_preload_content,
                namespace,
                field_selector=f"metadata.name={name}",
            )
        except ApiError as exc:
            raise BackendUnavailable(f"Kubernetes API: list ConfigMap {namespace}/{name}: {exc}") from exc
        items = page.get("items") or []
        if not items:
            return None
        return self._document(items[0], STATE_KEY, f"{namespace}/{name}") or {}

    async def delete_legacy_state(self) -> None:
        """Delete the older release's ConfigMap (once its content was moved onto the nodes)."""
        name, namespace = self.settings.legacy_configmap, self.settings.state_namespace
        self._ensure_leader(f"delete ConfigMap {namespace}/{name}")
        try:
            await self._call(
                f"delete ConfigMap {namespace}/{name}",
                self._core.delete_namespaced_config_map_without_preload_content,
                name,
                namespace,
            )
        except ApiError as exc:
            if exc.status != 404:
                raise BackendUnavailable(
                    f"Kubernetes API: delete ConfigMap {namespace}/{name}: {exc}"
                ) from exc

    # -- cordon and taints ---------------------------------------------------------------------

    async def cordon(self, node: str, *, record: RecordChange | None = None) -> bool:
        """Cordon and record ownership (and `record`) in one write; True when this call cordoned it.
        A node someone else cordoned (before the read, or between the read and the write: the
        resourceVersion precondition makes that a conflict, and the re-read sees the cordon) is left
        as it is and not claimed."""

        def change(obj: dict[str, Any]) -> dict[str, Any] | None:
            if obj.get("spec", {}).get("unschedulable"):
                return None
            annotations: dict[str, str | None] = {
                CORDONED_BY: self.settings.manager,
                CORDONED_AT: rfc3339(self._clock()),
                **_record_annotation(record, obj),
            }
            return {"metadata": {"annotations": annotations}, "spec": {"unschedulable": True}}

        done = await self._modify_node(node, "cordon", change) is not None
        if done:
            logger.info("cordoned %s", node)
        return done

    async def uncordon(self, node: str, *, record: RecordChange | None = None) -> bool:
        """Un-cordon only a node this service cordoned and whose cordon nobody changed since (the
        annotation, and managedFields showing this service still manages spec.unschedulable); True
        when this call uncordoned it. Otherwise only the ownership annotation is forgotten. `record`
        is applied to the node's record in the same write."""
        flipped = False

        def change(obj: dict[str, Any]) -> dict[str, Any] | None:
            nonlocal flipped
            flipped = False
            annotations = _annotations(obj)
            if annotations.get(CORDONED_BY) != self.settings.manager:
                logger.info("uncordon %s: not cordoned by %s; left as it is", node, self.settings.manager)
                return None
            drop: dict[str, str | None] = {CORDONED_BY: None, CORDONED_AT: None}
            forget: dict[str, Any] = {
                "metadata": {"annotations": {**drop, **_record_annotation(record, obj)}}
            }
            if not obj.get("spec", {}).get("unschedulable"):
                return forget  # a human un-cordoned it already
            if not manages_unschedulable(obj, self.settings.manager):
                logger.info("uncordon %s: the cordon was changed by someone else since; left", node)
                return forget
            flipped = True
            return {**forget, "spec": {"unschedulable": False}}

        written = await self._modify_node(node, "uncordon", change) is not None
        if written and flipped:
            logger.info("uncordoned %s", node)
        return written and flipped

    async def add_taint(self, node: str, taint: Taint, *, record: RecordChange | None = None) -> None:
        """Add (or replace by key and effect) one taint; other taints are kept as they are. `record`
        is applied to the node's record in the same write."""

        def change(obj: dict[str, Any]) -> dict[str, Any] | None:
            taints = list(obj.get("spec", {}).get("taints") or [])
            want = _taint_json(taint)
            same = [t for t in taints if (t.get("key"), t.get("effect")) == (taint.key, taint.effect)]
            if same and all(t.get("value", "") == taint.value for t in same):
                return None
            kept = [t for t in taints if (t.get("key"), t.get("effect")) != (taint.key, taint.effect)]
            owned = owned_taints(_annotations(obj))
            tid = taint_id(taint.key, taint.effect)
            patch: dict[str, Any] = {
                "spec": {"taints": [*kept, {**want, "timeAdded": rfc3339(self._clock())}]}
            }
            annotations = _record_annotation(record, obj)
            if not same and tid not in owned:  # only a taint we created is ours to remove later
                annotations[TAINTS_ADDED] = json.dumps(sorted([*owned, tid]))
            if annotations:
                patch["metadata"] = {"annotations": annotations}
            return patch

        if await self._modify_node(node, "taint", change):
            logger.info("tainted %s with %s=%s:%s", node, taint.key, taint.value, taint.effect)

    async def remove_taint(self, node: str, taint: Taint, *, record: RecordChange | None = None) -> None:
        """Remove a taint, but only one this service added (per the taints-added annotation) and only
        with the value it set: a taint someone changed since is left where it is and is no longer
        counted as this service's. `record` is applied to the node's record in the same write."""

        def change(obj: dict[str, Any]) -> dict[str, Any] | None:
            owned = owned_taints(_annotations(obj))
            tid = taint_id(taint.key, taint.effect)
            if tid not in owned:
                return None
            left = sorted(t for t in owned if t != tid)
            taints = list(obj.get("spec", {}).get("taints") or [])
            kept = [
                t
                for t in taints
                if (t.get("key"), t.get("effect"), t.get("value", ""))
                != (taint.key, taint.effect, taint.value)
            ]
            annotations = {TAINTS_ADDED: json.dumps(left) if left else None}
            annotations |= _record_annotation(record, obj)
            return {"metadata": {"annotations": annotations}, "spec": {"taints": kept}}

        if await self._modify_node(node, "untaint", change):
            logger.info("removed taint %s:%s from %s", taint.key, taint.effect, node)

    async def return_node(
        self,
        node: str,
        *,
        uid: str,
        taints: Sequence[Taint],
        annotations: Mapping[str, str | None],
        record: RecordChange | None = None,
    ) -> Returned | None:
        """Give the node with this `uid` back to the pool in one write: uncordon it if this service
        cordoned it and nobody changed the cordon since (annotation and managedFields), remove exactly
        these taints (key, effect and value) where this service added them, forget the ownership and
        drain annotations, set (None: remove) `annotations` and apply `record`. None when no node
        with that uid exists (gone, or replaced again)."""
        done = Returned()

        def change(obj: dict[str, Any]) -> dict[str, Any] | None:
            nonlocal done
            if _uid(obj) != uid:
                return None
            current = _annotations(obj)
            owned = owned_taints(current)
            spec_taints = list(obj.get("spec", {}).get("taints") or [])
            gone = {(t.key, t.effect, t.value) for t in taints if taint_id(t.key, t.effect) in owned}
            kept = [t for t in spec_taints if (t.get("key"), t.get("effect"), t.get("value", "")) not in gone]
            removed = tuple(sorted(taint_id(k, e) for k, e, _ in gone))
            meta: dict[str, str | None] = {k: None for k in (*RETURN_FORGETS, TAINTS_ADDED) if k in current}
            meta.update(annotations)
            meta |= _record_annotation(record, obj)
            patch: dict[str, Any] = {"metadata": {"annotations": meta}}
            if len(kept) != len(spec_taints):
                patch["spec"] = {"taints": kept}
            ours = current.get(CORDONED_BY) == self.settings.manager
            cordoned = bool(obj.get("spec", {}).get("unschedulable"))
            flip = ours and cordoned and manages_unschedulable(obj, self.settings.manager)
            if flip:
                patch.setdefault("spec", {})["unschedulable"] = False
            done = Returned(
                found=True,
                uncordoned=flip,
                cordon_kept=cordoned and not flip,
                taints_removed=removed,
            )
            return patch

        written = await self._modify_node(node, "return to the pool", change)
        if written is None and not done.found:
            return None
        logger.info("%s returned to the pool: %s", node, done)
        return done

    # -- conditions and events -----------------------------------------------------------------

    async def set_condition(
        self,
        node: str,
        condition: NodeCondition,
        *,
        record: RecordChange | None = None,
        annotations: Mapping[str, str | None] | None = None,
    ) -> None:
        """Upsert by type on the status subresource (a strategic merge patch: the kubelet's own
        conditions are untouched); lastTransitionTime moves only when status does. `record` and
        `annotations` go into the same write (the API server keeps metadata written through a node's
        status subresource), with the resourceVersion as precondition."""

        def change(obj: dict[str, Any]) -> dict[str, Any] | None:
            now = rfc3339(self._clock())
            previous = next(
                (c for c in obj.get("status", {}).get("conditions") or [] if c.get("type") == condition.type),
                None,
            )
            transition = now
            if previous is not None and previous.get("status") == condition.status:
                transition = str(previous.get("lastTransitionTime") or now)
            entry = {
                "type": condition.type,
                "status": condition.status,
                "reason": condition.reason,
                "message": condition.message,
                "lastHeartbeatTime": now,
                "lastTransitionTime": transition,
            }
            patch: dict[str, Any] = {"status": {"conditions": [entry]}}
            meta = {**dict(annotations or {}), **_record_annotation(record, obj)}
            if meta:
                patch["metadata"] = {"annotations": meta}
            return patch

        written = await self._modify_node(
            node, "set a node condition", change, status=True, ctype=STRATEGIC_MERGE_PATCH
        )
        wanted = {k: v for k, v in (annotations or {}).items() if v is not None}
        if (
            written is not None
            and (record is not None or wanted)
            and not _kept(_annotations(written), wanted, record)
        ):
            # An API server that drops metadata written through the status subresource (the 1.20
            # one keeps it): the record and annotations follow in a write of their own.
            logger.info("%s: metadata not kept by the status subresource; writing it apart", node)
            await self._annotate(node, "record the condition", dict(annotations or {}), record=record)

    async def record_event(self, *, node: str, reason: str, message: str, type_: str) -> None:
        """A core/v1 Event about the node; a repeat within 10 minutes bumps the count, like client-go."""
        self._ensure_leader("record an event")
        now = self._clock()
        stamp = rfc3339(now)
        ns = self.settings.event_namespace
        if len(message) > EVENT_MESSAGE_LIMIT:
            message = message[: EVENT_MESSAGE_LIMIT - 3] + "..."
        key = (node, reason, message, type_)
        seen = self._events.get(key)
        if seen is not None and now - seen[2] < EVENT_SERIES_SECONDS:
            name, count, _ = seen
            try:
                await self._call(
                    f"update event {name}",
                    self._core.patch_namespaced_event_without_preload_content,
                    name,
                    ns,
                    {"count": count + 1, "lastTimestamp": stamp},
                    _content_type=MERGE_PATCH,
                )
            except ApiError as exc:
                if exc.status != 404:
                    raise BackendUnavailable(f"Kubernetes API: update event {name}: {exc}") from exc
            else:
                self._remember_event(key, (name, count + 1, now))
                return
        name = f"{node}.{time.time_ns():x}"
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": name, "namespace": ns},
            # The kubelet's convention for nodes (uid = node name) is what `kubectl describe node` queries.
            "involvedObject": {"apiVersion": "v1", "kind": "Node", "name": node, "uid": node},
            "reason": reason,
            "message": message,
            "type": type_,
            "count": 1,
            "firstTimestamp": stamp,
            "lastTimestamp": stamp,
            "source": {"component": self.settings.manager},
            "reportingComponent": self.settings.manager,
            "reportingInstance": self.settings.instance,
        }
        try:
            await self._call(
                f"create event on {node}",
                self._core.create_namespaced_event_without_preload_content,
                ns,
                body,
            )
        except ApiError as exc:
            raise BackendUnavailable(f"Kubernetes API: create event on {node}: {exc}") from exc
        self._remember_event(key, (name, 1, now))

    def _remember_event(self, key: tuple[str, str, str, str], series: tuple[str, int, float]) -> None:
        """Keep the series last written (kept in order of last write) and forget those older than
        the window: a storm's Events on thousands of nodes are not remembered forever."""
        self._events.pop(key, None)
        self._events[key] = series
        horizon = series[2] - EVENT_SERIES_SECONDS
        while True:  # ends at the latest: the one just written is within the window
            oldest = next(iter(self._events))
            if self._events[oldest][2] >= horizon:
                return
            del self._events[oldest]

    @property
    def event_series(self) -> int:
        """Event series remembered to count repeats (those written in the last 10 minutes)."""
        return len(self._events)

    # -- eviction and drain --------------------------------------------------------------------

    async def _evict(
        self, *, namespace: str, name: str, grace_period_seconds: int | None
    ) -> tuple[EvictionResult, str]:
        body: dict[str, Any] = {
            "apiVersion": "policy/v1",
            "kind": "Eviction",
            "metadata": {"name": name, "namespace": namespace},
        }
        if grace_period_seconds is not None:
            body["deleteOptions"] = {"gracePeriodSeconds": grace_period_seconds}
        try:
            await self._call(
                f"evict {namespace}/{name}",
                self._core.create_namespaced_pod_eviction_without_preload_content,
                name,
                namespace,
                body,
                retry=False,
            )
        except ApiError as exc:
            if exc.status == 404:
                return EvictionResult.GONE, "gone"
            if exc.status == 429:
                return EvictionResult.REFUSED_BY_PDB, f"eviction refused (429): {exc.message}"
            if exc.status >= 500:
                raise BackendUnavailable(f"evict {namespace}/{name}: {exc.status}: {exc.message}") from exc
            # 403 (RBAC, a policy engine), 400/422 (an admission webhook's denial): a refusal, not an
            # outage; retrying until the deadline would not change the answer.
            return EvictionResult.REFUSED, f"eviction refused ({exc.status} {exc.reason}): {exc.message}"
        return EvictionResult.EVICTED, "evicted"

    async def evict_pod(
        self, *, namespace: str, name: str, grace_period_seconds: int | None
    ) -> EvictionResult:
        """One policy/v1 Eviction: EVICTED (accepted), REFUSED_BY_PDB (429), GONE (404) or REFUSED
        (403, an admission denial)."""
        self._ensure_leader(f"evict {namespace}/{name}")
        result, _ = await self._evict(
            namespace=namespace, name=name, grace_period_seconds=grace_period_seconds
        )
        return result

    def _drain_window(
        self, obj: Mapping[str, Any], timeout_s: float
    ) -> tuple[float, bool, dict[str, str | None]]:
        """(deadline, resumed, annotations to write): resume the recorded drain if it still runs."""
        annotations = (obj.get("metadata") or {}).get("annotations") or {}
        now = self._clock()
        if annotations.get(DRAIN_STATUS) == "in-progress":
            deadline = parse_rfc3339(annotations.get(DRAIN_DEADLINE, ""))
            if deadline is not None and deadline > now:
                return deadline, True, {}
        deadline = now + timeout_s
        stamp: dict[str, str | None] = {
            DRAIN_STARTED: rfc3339(now),
            DRAIN_DEADLINE: rfc3339(deadline),
            DRAIN_STATUS: "in-progress",
            DRAIN_BLOCKED: None,
        }
        return deadline, False, stamp

    async def _cordon_for_drain(
        self,
        node: str,
        obj: dict[str, Any],
        stamp: Mapping[str, str | None],
        record: RecordChange | None,
    ) -> None:
        """Cordon (claiming it, if this service flips it) and record the drain's start in one write."""

        def change(current: dict[str, Any]) -> dict[str, Any] | None:
            return self._drain_patch(current, stamp, record)

        await self._modify_node(node, "cordon and record drain start", change, current=obj)

    def _drain_patch(
        self, obj: Mapping[str, Any], stamp: Mapping[str, str | None], record: RecordChange | None
    ) -> dict[str, Any] | None:
        """The patch that cordons the node (claiming the cordon when it flips it) with `stamp` (the
        drain's annotations) and `record` applied; None when it changes nothing."""
        annotations: dict[str, str | None] = dict(stamp)
        patch: dict[str, Any] = {}
        if not obj.get("spec", {}).get("unschedulable"):
            annotations |= {CORDONED_BY: self.settings.manager, CORDONED_AT: rfc3339(self._clock())}
            patch["spec"] = {"unschedulable": True}
        annotations |= _record_annotation(record, obj)
        return {**patch, "metadata": {"annotations": annotations}} if annotations else None

    async def start_drain(
        self, node: str, settings: DrainSettings, *, record: RecordChange | None = None
    ) -> None:
        """Cordon (claiming it, if this call flips it), stamp the drain's start and deadline (kept when
        a drain of the node is already in progress) and apply `record`, in one write from the node as
        the watch saw it (a conflict reads it again)."""

        deadline, resumed = self._clock() + settings.timeout_seconds, False

        def change(obj: dict[str, Any]) -> dict[str, Any] | None:
            nonlocal deadline, resumed
            deadline, resumed, stamp = self._drain_window(obj, settings.timeout_seconds)
            return self._drain_patch(obj, stamp, record)

        await self._modify_node(node, "start drain", change)
        self._started_here[node] = (deadline, resumed)

    async def drain(
        self,
        node: str,
        settings: DrainSettings,
        *,
        ended: Callable[[DrainOutcome], RecordChange | None] | None = None,
    ) -> DrainOutcome:
        """Cordon (if needed) and drain the node like `kubectl drain`, until done or the deadline.

        Pods that need permission the settings do not give (bare pods, emptyDir data) make the drain
        refuse before anything is evicted, as kubectl does (the node stays cordoned). Raises
        BackendUnavailable when the API is unreachable and NotLeader when leadership is lost; the
        annotations let the next attempt (here or on the new leader) resume with the same deadline.
        The node's pods and the PodDisruptionBudgets are watched while it runs: the plan, the retries
        and the wait for evicted pods read the watches, not the API. After `start_drain` (one write),
        the write that records the end (or the refusal) carries `ended(outcome)`: two writes of the node
        per drain.
        """
        self._ensure_leader(f"drain {node}")
        async with contextlib.AsyncExitStack() as stack:
            # At once; every watch that started is in the stack before a failure ends the drain.
            started = await asyncio.gather(
                stack.enter_async_context(self.watching_pods(node)),
                self._enter_pdb_watch(stack),
                self._read_node_object(node),
                return_exceptions=True,
            )
            pod_cache, pdb_cache, obj = _all_or_raise(*started)
            if obj is None:
                raise BackendUnavailable(f"drain {node}: node not found")
            pod_objs = pod_cache.objects()
            uids = {_pod_key(o): _uid(o) for o in pod_objs}
            daemonsets = await self.daemonsets_exist(_daemonset_refs(pod_objs))
            plan = _plan(node, pod_objs, pdb_cache, settings, daemonsets)
            skipped = tuple(f"{p.namespace}/{p.name}" for p in plan.skip)
            here = self._started_here.pop(node, None)
            if plan.needs_permission:
                await self._cordon_for_drain(node, obj, {}, None)
                blocked = tuple(BlockedPod(p.namespace, p.name, p.reason) for p in plan.needs_permission)
                outcome = DrainOutcome(node, False, False, (), skipped, blocked, False, self._clock())
                in_progress = here is not None or _annotations(obj).get(DRAIN_STATUS) == "in-progress"
                refused = "refused" if in_progress else None
                await self._finish_drain(
                    node, outcome, status=refused, record=ended(outcome) if ended else None
                )
                return outcome
            deadline, resumed, stamp = self._drain_window(obj, settings.timeout_seconds)
            if here is not None:
                deadline, resumed = here
            await self._cordon_for_drain(node, obj, stamp, None)
            targets = [(p.namespace, p.name) for p in (*plan.evict, *plan.waiting_on_pdb)]
            known = {(p.namespace, p.name) for p in (*plan.evict, *plan.skip, *plan.blocked)}
            run = _DrainRun(
                self,
                node=node,
                settings=settings,
                deadline=deadline,
                uids=uids,
                pods=pod_cache,
                pdbs=pdb_cache,
                known=known,
                daemonsets=daemonsets,
            )
            blocked_list = await run.execute(targets)
            evicted = tuple(f"{ns}/{name}" for ns, name in run.targets if (ns, name) in run.gone)
            timed_out = bool(blocked_list) and not run.refused
            outcome = DrainOutcome(
                node, not blocked_list, timed_out, evicted, skipped, tuple(blocked_list), resumed, deadline
            )
            status = "refused" if run.refused else ("timed-out" if timed_out else "done")
            await self._finish_drain(node, outcome, status=status, record=ended(outcome) if ended else None)
            return outcome

    async def _enter_pdb_watch(self, stack: contextlib.AsyncExitStack) -> WatchCache | None:
        """The PodDisruptionBudgets' watch for the rest of the drain; None when the server does not
        serve policy/v1 (the evictions still honour the budgets: the server enforces them)."""
        try:
            return await stack.enter_async_context(self.watching_pdbs())
        except ApiError as exc:  # 404 only: anything else is BackendUnavailable already
            self._api_missing(PDB_API, exc)
            return None

    async def _finish_drain(
        self, node: str, outcome: DrainOutcome, *, status: str | None, record: RecordChange | None = None
    ) -> None:
        if status is not None:
            blocked = blocked_annotation(outcome.blocked)
            await self._annotate(
                node,
                "record drain result",
                {DRAIN_STATUS: status, DRAIN_BLOCKED: blocked or None},
                record=record,
            )
        # The node's Event (AccelDrainFinished / AccelDrainBlocked) is the engine's, as the policy's
        # `events` setting says.
        logger.info("%s: %s", node, outcome.summary())

    # -- durable quarantine copies and the startup taint (remediator/lifecycle/repair.py) ----------------
    #
    # A quarantine must outlive the Node object (a machine replaced under the same name is a new
    # object, without the old one's annotations): one small ConfigMap per quarantined node in the
    # remediator's own namespace, labelled so that one LIST with a label selector reads them all.

    def watch_nodes(self, listener: NodeListener) -> None:
        """Call `listener(name, annotations)` at every change the node watch delivers (annotations
        None: the node was deleted)."""

        def tell(key: Hashable, obj: dict[str, Any] | None) -> None:
            if obj is None:
                listener(str(key), None)
            else:
                listener(str(key), _annotations(obj))

        self.nodes.listeners.append(tell)

    def observed_nodes(self) -> list[Node] | None:
        """The nodes as the watch cache has them (no request); None until it synced."""
        if not self.nodes.synced:
            return None
        try:
            return self.nodes.converted(node_from_object)
        except ObjectFormatError:
            return None

    async def set_startup_taint(
        self,
        node: str,
        *,
        uid: str,
        taint: Taint,
        present: bool,
        annotations: Mapping[str, str | None],
        labels: Mapping[str, str | None],
    ) -> bool:
        """One merge patch with the resourceVersion as precondition, on the node object with `uid`
        only: add (`present`) or remove the taints with `taint.key` (whoever added them: the taint is
        this service's to lift), with annotation and label changes. False when no such node exists."""
        found = False

        def change(obj: dict[str, Any]) -> dict[str, Any] | None:
            nonlocal found
            found = _uid(obj) == uid
            if not found:
                return None
            meta = obj.get("metadata") or {}
            taints = list((obj.get("spec") or {}).get("taints") or [])
            kept = [t for t in taints if t.get("key") != taint.key]
            patch: dict[str, Any] = {}
            if present and len(kept) == len(taints):
                added = _taint_json(taint)
                if taint.effect == "NoExecute":
                    added["timeAdded"] = rfc3339(self._clock())
                patch["spec"] = {"taints": [*taints, added]}
            elif not present and len(kept) != len(taints):
                patch["spec"] = {"taints": kept}
            have = meta.get("annotations") or {}
            changed: dict[str, str | None] = {k: v for k, v in annotations.items() if have.get(k) != v}
            owned = owned_taints(have)
            left = [t for t in owned if not t.startswith(taint.key + ":")]
            if not present and left != owned:
                changed[TAINTS_ADDED] = json.dumps(left) if left else None
            have_labels = meta.get("labels") or {}
            relabel = {k: v for k, v in labels.items() if have_labels.get(k) != v}
            if changed or relabel:
                patch["metadata"] = {
                    **({"annotations": changed} if changed else {}),
                    **({"labels": relabel} if relabel else {}),
                }
            return patch or None

        what = "add the startup taint" if present else "remove the startup taint"
        if await self._modify_node(node, what, change):
            logger.info("%s: %s %s", node, what, taint.key)
        return found

    async def _list_quarantine_objects(self) -> list[dict[str, Any]]:
        namespace = self.settings.state_namespace
        try:
            items, _ = await self._list_with_version(
                f"list quarantine ConfigMaps in {namespace}",
                self._core.list_namespaced_config_map_without_preload_content,
                namespace=namespace,
                label_selector=f"{QUARANTINE_LABEL}=true,{MANAGED_BY}={self.settings.manager}",
            )
        except ApiError as exc:
            raise BackendUnavailable(
                f"Kubernetes API: list quarantine ConfigMaps in {namespace}: {exc}"
            ) from exc
        return items

    async def load_quarantines(self) -> Mapping[str, Mapping[str, Any]]:
        """Node name -> document, from one LIST (label selector) of the remediator's namespace; a
        ConfigMap that holds no such document is logged and skipped."""
        out: dict[str, Mapping[str, Any]] = {}
        for obj in await self._list_quarantine_objects():
            name = (obj.get("metadata") or {}).get("name", "")
            try:
                doc = json.loads((obj.get("data") or {}).get(QUARANTINE_KEY) or "")
            except ValueError:
                doc = None
            if not isinstance(doc, dict) or not isinstance(doc.get("node"), str):
                logger.warning(
                    "ConfigMap %s holds no quarantine document (key %s); skipped", name, QUARANTINE_KEY
                )
                continue
            out[doc["node"]] = doc
        return out

    async def save_quarantine(self, node: str, document: Mapping[str, Any]) -> None:
        """Create the node's ConfigMap; one already there (an update: rare, the quarantine's history
        or escalation changed) is deleted, with its uid and resourceVersion as preconditions, and
        created again, so that the Role needs no update or patch of ConfigMaps it cannot name."""
        namespace, name = self.settings.state_namespace, quarantine_configmap_name(node)
        what = f"write ConfigMap {namespace}/{name}"
        self._ensure_leader(what)
        body = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {
                "name": name,
                "namespace": namespace,
                "labels": {MANAGED_BY: self.settings.manager, QUARANTINE_LABEL: "true"},
            },
            "data": {QUARANTINE_KEY: json.dumps(document, separators=(",", ":"), sort_keys=True)},
        }
        create = self._core.create_namespaced_config_map_without_preload_content
        try:
            await self._call(what, create, namespace, body)
            return
        except ApiError as exc:
            if exc.status != 409:
                raise BackendUnavailable(f"Kubernetes API: {what}: {exc}") from exc
        there = next(
            (o for o in await self._list_quarantine_objects() if o["metadata"]["name"] == name), None
        )
        if there is not None:
            meta = there["metadata"]
            await self._delete_quarantine_object(
                name, preconditions={"uid": meta.get("uid"), "resourceVersion": meta.get("resourceVersion")}
            )
        try:
            await self._call(what, create, namespace, body)
        except ApiError as exc:  # 409: another writer between the delete and the create
            raise BackendUnavailable(f"Kubernetes API: {what}: {exc}") from exc

    async def delete_quarantine(self, node: str) -> None:
        """Delete the node's ConfigMap (none there: nothing to do)."""
        await self._delete_quarantine_object(quarantine_configmap_name(node))

    async def _delete_quarantine_object(
        self, name: str, *, preconditions: Mapping[str, Any] | None = None
    ) -> None:
        namespace = self.settings.state_namespace
        what = f"delete ConfigMap {namespace}/{name}"
        self._ensure_leader(what)
        body = {"preconditions": dict(preconditions)} if preconditions else None
        try:
            await self._call(
                what,
                self._core.delete_namespaced_config_map_without_preload_content,
                name,
                namespace,
                body=body,
            )
        except ApiError as exc:
            if exc.status != 404:
                raise BackendUnavailable(f"Kubernetes API: {what}: {exc}") from exc


QUARANTINE_CONFIGMAP_PREFIX = "accel-health-quarantine-"
"""Name of a node's durable quarantine ConfigMap: this prefix and the node name (a hash when long)."""
QUARANTINE_LABEL = PREFIX + "quarantine"
"""Label (value "true") of the durable quarantine ConfigMaps; the LIST selects on it."""
MANAGED_BY = "app.kubernetes.io/managed-by"
"""Label naming this service (its `manager`) on the ConfigMaps it writes."""
QUARANTINE_KEY = "quarantine.json"
"""The data key holding a durable quarantine document."""
NAME_LIMIT = 253
"""The longest object name (a DNS subdomain)."""


def quarantine_configmap_name(node: str) -> str:
    """`accel-health-quarantine-<node>`; a name too long for an object keeps its start and ends with
    a hash of the whole node name."""
    name = QUARANTINE_CONFIGMAP_PREFIX + node
    if len(name) <= NAME_LIMIT:
        return name
    digest = hashlib.sha256(node.encode()).hexdigest()[:16]
    return f"{name[: NAME_LIMIT - len(digest) - 1].rstrip('-.')}-{digest}"


_A = TypeVar("_A")
_B = TypeVar("_B")
_C = TypeVar("_C")


def _all_or_raise(a: _A | BaseException, b: _B | BaseException, c: _C | BaseException) -> tuple[_A, _B, _C]:
    """The results of a gather(return_exceptions=True), or the first exception among them."""
    for result in (a, b, c):
        if isinstance(result, BaseException):
            raise result
    return a, b, c  # type: ignore[return-value]  # none is an exception: checked just above


def _daemonset_refs(pod_objs: list[dict[str, Any]]) -> set[tuple[str, str]]:
    """(namespace, name) of the DaemonSets that control these pods."""
    refs = set()
    for obj in pod_objs:
        meta = obj.get("metadata") or {}
        for ref in meta.get("ownerReferences") or []:
            if isinstance(ref, dict) and ref.get("controller") is True and ref.get("kind") == "DaemonSet":
                refs.add((str(meta.get("namespace") or "default"), str(ref.get("name", ""))))
    return refs


def _plan(
    node: str,
    pod_objs: list[dict[str, Any]],
    pdbs: WatchCache | None,
    settings: DrainSettings,
    daemonsets: Collection[tuple[str, str]] | None = None,
) -> DrainPlan:
    """The drain plan of these pods under the watched budgets (none when policy/v1 is not served)."""
    try:
        pods = [pod_from_object(o) for o in pod_objs]
        budgets = [pdb_from_object(o) for o in pdbs.objects()] if pdbs is not None else []
    except ObjectFormatError as exc:
        raise BackendUnavailable(f"a pod on {node} or a budget has an unexpected shape: {exc}") from exc
    return plan_drain(
        pods,
        budgets,
        delete_emptydir_data=settings.delete_emptydir_data,
        force_bare_pods=settings.force_bare_pods,
        daemonsets=daemonsets,
    )


class _DrainRun:
    """One drain's evictions (bounded concurrency) and the wait for evicted pods to go, reading the
    watches of the node's pods and of the PodDisruptionBudgets."""

    def __init__(
        self,
        cluster: KubernetesCluster,
        *,
        node: str,
        settings: DrainSettings,
        deadline: float,
        uids: dict[tuple[str, str], str],
        pods: WatchCache,
        pdbs: WatchCache | None,
        known: set[tuple[str, str]],
        daemonsets: Collection[tuple[str, str]] | None = None,
    ) -> None:
        self.cluster = cluster
        self.daemonsets = daemonsets
        self.node = node
        self.settings = settings
        self.deadline = deadline
        self.uids = uids
        self.pods = pods
        self.pdbs = pdbs
        self.known = known
        """Pods the plan placed (evict, skip or blocked); a pod the watch shows beside them arrived
        after the plan's LIST and is planned in a later round."""
        self.targets: list[tuple[str, str]] = []
        """Every pod this drain tried to evict, in order."""
        self.gone: set[tuple[str, str]] = set()
        self.waiting: dict[tuple[str, str], str] = {}  # evicted, not yet gone -> why we wait
        self.semaphore = asyncio.Semaphore(max(1, settings.concurrency))
        self.refused = False
        """An eviction was refused (403, admission): the drain ends as refused, not timed out."""
        self.evicting_done = asyncio.Event()
        self.wake = asyncio.Event()  # an eviction was accepted, or the last one ended

    def _remaining(self) -> float:
        return self.deadline - self.cluster._clock()

    async def execute(self, targets: list[tuple[str, str]]) -> list[BlockedPod]:
        """Evict every target and wait for them to go, then the pods that arrived after the plan's
        LIST (as the watch shows them), until none is left; the pods left when the deadline passed."""
        blocked: list[BlockedPod] = []
        while True:
            if targets:
                blocked += await self._round(targets)
            if self._remaining() <= 0 or self.refused:
                break
            targets = self._late_targets()
            if not targets:
                break
        blocked += [BlockedPod(ns, name, why) for (ns, name), why in sorted(self.waiting.items())]
        return blocked

    async def _round(self, targets: list[tuple[str, str]]) -> list[BlockedPod]:
        self.targets += targets
        self.evicting_done.clear()
        waiter = asyncio.create_task(self._wait_for_pods())
        evictions = [asyncio.create_task(self._evict_one(ns, name)) for ns, name in targets]
        try:
            pending: set[asyncio.Task[Any]] = {*evictions, waiter}
            while not all(task.done() for task in evictions):  # the waiter fails early on a broken watch
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    if task.exception() is not None:
                        raise task.exception()  # type: ignore[misc]  # checked not None just above
            self.evicting_done.set()
            self.wake.set()
            await waiter
        finally:
            for task in (*evictions, waiter):
                task.cancel()
            await asyncio.gather(*evictions, waiter, return_exceptions=True)
        return [b for b in (t.result() for t in evictions) if b is not None]

    def _late_targets(self) -> list[tuple[str, str]]:
        """Pods on the node the plan did not know that a drain evicts (or that wait on a budget).

        The plan may come from a LIST made moments before the node was cordoned; whatever was bound
        to the node in between arrives through the watch. Pods needing permission are left, as any
        pod that arrives after kubectl's LIST is.
        """
        fresh = [o for o in self.pods.objects() if _pod_key(o) not in self.known]
        if not fresh:
            return []
        plan = _plan(self.node, fresh, self.pdbs, self.settings, self.daemonsets)
        self.known |= {(p.namespace, p.name) for p in (*plan.evict, *plan.skip, *plan.blocked)}
        self.uids |= {_pod_key(o): _uid(o) for o in fresh}
        late = [(p.namespace, p.name) for p in (*plan.evict, *plan.waiting_on_pdb)]
        if late:
            logger.info("%s: %d pod(s) arrived after the plan; evicting them too", self.node, len(late))
        return late

    async def _evict_one(self, namespace: str, name: str) -> BlockedPod | None:
        delay = self.settings.backoff_initial_seconds
        last = "the drain timed out before an eviction was tried"
        while True:
            self.cluster._ensure_leader(f"evict {namespace}/{name}")
            if self._remaining() <= 0:
                return BlockedPod(namespace, name, last)
            result: EvictionResult | None
            try:
                async with self.semaphore:
                    result, said = await self.cluster._evict(
                        namespace=namespace,
                        name=name,
                        grace_period_seconds=self.settings.grace_period_seconds,
                    )
            except NotLeader:
                raise
            except BackendUnavailable as exc:  # 5xx (e.g. several PDBs match), timeouts: retried
                result, said = None, str(exc)
            if result is EvictionResult.GONE:
                self.gone.add((namespace, name))
                return None
            if result is EvictionResult.REFUSED:
                self.refused = True
                logger.warning("%s/%s: %s; not retried", namespace, name, said)
                return BlockedPod(namespace, name, said)
            if result is EvictionResult.EVICTED:
                grace = self.settings.grace_period_seconds
                self.waiting[(namespace, name)] = "evicted, still terminating" + (
                    f" (grace period {grace}s)" if grace is not None else " (the pod's own grace period)"
                )
                self.wake.set()
                return None
            last = said
            pause = min(delay * (0.5 + random.random()), max(0.0, self._remaining()))  # noqa: S311  jitter
            logger.info("%s/%s: %s; retrying in %.1fs at most", namespace, name, said, pause)
            if result is EvictionResult.REFUSED_BY_PDB:
                await self._wait_for_budget(namespace, name, pause)
            else:
                await asyncio.sleep(pause)
            delay = min(delay * 2, self.settings.backoff_max_seconds)

    async def _wait_for_budget(self, namespace: str, name: str, pause: float) -> None:
        """Up to `pause`, less when the watch shows the pod's budget allowing a disruption again."""
        if self.pdbs is None:
            await asyncio.sleep(pause)
            return
        loop = asyncio.get_running_loop()
        end = loop.time() + pause
        while (left := end - loop.time()) > 0:
            if not await self.pdbs.wait_change(left):
                return
            if self._budget_allows(namespace, name):
                return

    def _budget_allows(self, namespace: str, name: str) -> bool:
        """The watched budgets let an eviction of the pod through now (or it is gone: try, get 404)."""
        assert self.pdbs is not None
        obj = self.pods.get((namespace, name))
        if obj is None:
            return True
        labels = (obj.get("metadata") or {}).get("labels") or {}
        matching = []
        for raw in self.pdbs.objects():
            if (raw.get("metadata") or {}).get("namespace") != namespace:
                continue
            try:
                budget = pdb_from_object(raw)
            except ObjectFormatError:
                continue  # the eviction's answer tells
            if budget.selector.matches(labels):
                matching.append(budget)
        return len(matching) == 1 and matching[0].disruptions_allowed > 0

    async def _wait_for_pods(self) -> None:
        """Until every evicted pod is gone or replaced, as the pod watch shows it (or the deadline).

        Looks again at each change the watch delivers, each accepted eviction, and at least every
        poll interval; none of it is a request. Raises BackendUnavailable when the watch is broken
        (the API does not answer it, nor the LIST after it): the drain does not wait on a stale view.
        """
        while True:
            changed = self.pods.next_change()
            if self.pods.broken:
                raise BackendUnavailable(
                    f"Kubernetes API: the watch of the pods on {self.node} fails ({self.pods.last_error}); "
                    "the drain goes on with the next attempt"
                )
            for key in list(self.waiting):
                obj = self.pods.get(key)
                if obj is None or _uid(obj) != self.uids.get(key, _uid(obj)):
                    del self.waiting[key]
                    self.gone.add(key)
            if self.evicting_done.is_set() and (not self.waiting or self._remaining() <= 0):
                return
            pause = max(0.01, min(self.settings.poll_interval_seconds, self._remaining()))
            woken = asyncio.ensure_future(self.wake.wait())
            seen = asyncio.ensure_future(changed.wait())
            try:
                await asyncio.wait((woken, seen), timeout=pause, return_when=asyncio.FIRST_COMPLETED)
            finally:
                woken.cancel()
                seen.cancel()
                await asyncio.gather(woken, seen, return_exceptions=True)
            self.wake.clear()
