"""Evictions and drains, as `kubectl drain` does them (planning in remediator/actuators/drainplan.py):
policy/v1 Evictions with bounded concurrency, 429s retried with backoff until the deadline, and a wait
until every evicted pod is gone or replaced. While a drain of a node runs, that node's pods (LIST with
`fieldSelector=spec.nodeName=…` once, then WATCH) and every PodDisruptionBudget (shared by the drains
running at once) are watched, not listed again and again; a LIST made for a plan is where a drain
that starts right after it begins its watch. Progress is kept in node annotations, so a restarted (or
newly elected) remediator resumes a half-done drain with the original deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import AsyncIterator, Callable, Collection, Mapping, Sequence
from typing import Any, TypeVar

from remediator.actuators.drainplan import DrainPlan, plan_drain
from remediator.cluster import (
    BackendUnavailable,
    BlockedPod,
    DrainOutcome,
    DrainSettings,
    EvictionResult,
    NotLeader,
    ObjectFormatError,
    Pod,
    PodDisruptionBudget,
    pdb_from_object,
    pod_from_object,
)
from remediator.executors.kubernetes.api import Api, ApiError
from remediator.executors.kubernetes.nodes import NodeStore, annotations_of, record_annotation, uid_of
from remediator.executors.watchcache import SharedWatch, WatchCache, namespaced_key
from remediator.lifecycle.record import (
    CORDONED_AT,
    CORDONED_BY,
    DRAIN_BLOCKED,
    DRAIN_DEADLINE,
    DRAIN_STARTED,
    DRAIN_STATUS,
    RecordChange,
    parse_rfc3339,
    rfc3339,
)

logger = logging.getLogger("remediator.kubernetes")

PDB_API = "policy/v1 poddisruptionbudgets"
DAEMONSET_API = "apps/v1 daemonsets"
"""Read to tell a pod of a DaemonSet that no longer exists (kubectl drain's orphan), when allowed."""
PRIMED_LIST_SECONDS = 5.0
"""How long a LIST made for a plan may seed the watch of a drain that starts after it (the engine
plans a drain, cordons, then starts it: well within this). Older ones are not used: the drain lists."""
PRIMED_LISTS_KEPT = 64
"""At most this many such LISTs are kept (the oldest go first)."""
BLOCKED_SHOWN = 20
"""Pods `drain-blocked` names at most (the rest counted): a node's annotations stay small whatever
blocks a drain (the decision record and the Event list them all)."""


def blocked_annotation(blocked: Sequence[BlockedPod]) -> str:
    """`drain-blocked`: `ns/a,ns/b` of the first BLOCKED_SHOWN pods, then `,+N more`."""
    names = [f"{b.namespace}/{b.name}" for b in blocked[:BLOCKED_SHOWN]]
    if len(blocked) > BLOCKED_SHOWN:
        names.append(f"+{len(blocked) - BLOCKED_SHOWN} more")
    return ",".join(names)


def _pod_key(obj: Mapping[str, Any]) -> tuple[str, str]:
    meta = obj.get("metadata") or {}
    return str(meta.get("namespace") or "default"), str(meta.get("name", ""))


class Drainer:
    """The node's pods and the budgets, evictions, and drains (start, run, end)."""

    def __init__(self, api: Api, nodes: NodeStore) -> None:
        self._api = api
        self._nodes = nodes
        self.pod_watches: dict[str, SharedWatch] = {}
        """Node -> the watch of its pods, while a drain of it runs."""
        self.pdb_watches: dict[str, SharedWatch] = {}
        """The watch of every PodDisruptionBudget (key ""), while any drain runs."""
        self.watched = False
        """A watch of pods or PodDisruptionBudgets ran (the client's close then waits for TLS)."""
        self._primed: dict[str, tuple[float, list[dict[str, Any]], str]] = {}
        # LISTs just made for a plan: watch key -> (when, items, resourceVersion)
        self._started_here: dict[str, tuple[float, bool]] = {}
        # node -> (deadline, resumed) of the drain `start_drain` just stamped or found running (the
        # deadline to the fraction of a second, where the annotation keeps whole seconds)

    async def stop(self) -> None:
        """Stop every watch of pods and budgets."""
        for table in (self.pod_watches, self.pdb_watches):
            for shared in list(table.values()):
                await shared.stop()
            table.clear()

    async def _list_pods_with_version(self, node: str) -> tuple[list[dict[str, Any]], str]:
        """The node's pods (any namespace) and the list's resourceVersion."""
        try:
            return await self._api.list_with_version(
                f"list pods on {node}",
                self._api.core.list_pod_for_all_namespaces_without_preload_content,
                field_selector=f"spec.nodeName={node}",
            )
        except ApiError as exc:
            raise BackendUnavailable(f"Kubernetes API: list pods on {node}: {exc}") from exc

    async def _list_pdbs_with_version(self) -> tuple[list[dict[str, Any]], str]:
        """Every PodDisruptionBudget and the list's resourceVersion; ApiError(404) when the server
        does not serve policy/v1, BackendUnavailable for anything else that fails."""
        try:
            return await self._api.list_with_version(
                "list PodDisruptionBudgets",
                self._api.policy.list_pod_disruption_budget_for_all_namespaces_without_preload_content,
            )
        except ApiError as exc:
            if exc.status == 404:
                raise
            raise BackendUnavailable(f"Kubernetes API: list PodDisruptionBudgets: {exc}") from exc

    def _prime(self, key: str, listed: tuple[list[dict[str, Any]], str]) -> None:
        """Keep a LIST just made for a plan: a drain starting right after it watches from there."""
        self._primed.pop(key, None)
        self._primed[key] = (self._api.clock(), *listed)
        while len(self._primed) > PRIMED_LISTS_KEPT:
            del self._primed[next(iter(self._primed))]

    def _take_primed(self, key: str) -> tuple[list[dict[str, Any]], str] | None:
        entry = self._primed.pop(key, None)
        if entry is None or self._api.clock() - entry[0] > PRIMED_LIST_SECONDS:
            return None
        return entry[1], entry[2]

    def _pod_cache(self, node: str) -> WatchCache:
        return WatchCache(
            what=f"pods on {node}",
            list_all=lambda: self._list_pods_with_version(node),
            watch=self._api.core.list_pod_for_all_namespaces_without_preload_content,
            watch_args={"field_selector": f"spec.nodeName={node}"},
            key=namespaced_key,
            watch_seconds=self._api.settings.watch_seconds,
        )

    def _pdb_cache(self) -> WatchCache:
        return WatchCache(
            what="PodDisruptionBudgets",
            list_all=self._list_pdbs_with_version,
            watch=self._api.policy.list_pod_disruption_budget_for_all_namespaces_without_preload_content,
            key=namespaced_key,
            watch_seconds=self._api.settings.watch_seconds,
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
                await self._api.call(
                    f"read daemonset {namespace}/{name}",
                    self._api.apps.read_namespaced_daemon_set_without_preload_content,
                    name,
                    namespace,
                )
            except ApiError as exc:
                if exc.status == 404 and exc.reason == "NotFound":
                    continue  # gone: its pods are orphans
                self._api.missing(DAEMONSET_API, exc)
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
                self._api.missing(PDB_API, exc)
                return []
            self._prime("pdbs", listed)
            objs = listed[0]
        try:
            return [pdb_from_object(o) for o in objs]
        except ObjectFormatError as exc:
            raise BackendUnavailable(f"a PodDisruptionBudget has an unexpected shape: {exc}") from exc

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
            await self._api.call(
                f"evict {namespace}/{name}",
                self._api.core.create_namespaced_pod_eviction_without_preload_content,
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
        self._api.ensure_leader(f"evict {namespace}/{name}")
        result, _ = await self._evict(
            namespace=namespace, name=name, grace_period_seconds=grace_period_seconds
        )
        return result

    def _drain_window(
        self, obj: Mapping[str, Any], timeout_s: float
    ) -> tuple[float, bool, dict[str, str | None]]:
        """(deadline, resumed, annotations to write): resume the recorded drain if it still runs."""
        annotations = (obj.get("metadata") or {}).get("annotations") or {}
        now = self._api.clock()
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

        await self._nodes.modify(node, "cordon and record drain start", change, current=obj)

    def _drain_patch(
        self, obj: Mapping[str, Any], stamp: Mapping[str, str | None], record: RecordChange | None
    ) -> dict[str, Any] | None:
        """The patch that cordons the node (claiming the cordon when it flips it) with `stamp` (the
        drain's annotations) and `record` applied; None when it changes nothing."""
        annotations: dict[str, str | None] = dict(stamp)
        patch: dict[str, Any] = {}
        if not obj.get("spec", {}).get("unschedulable"):
            annotations |= {CORDONED_BY: self._api.settings.manager, CORDONED_AT: rfc3339(self._api.clock())}
            patch["spec"] = {"unschedulable": True}
        annotations |= record_annotation(record, obj)
        return {**patch, "metadata": {"annotations": annotations}} if annotations else None

    async def start_drain(
        self, node: str, settings: DrainSettings, *, record: RecordChange | None = None
    ) -> None:
        """Cordon (claiming it, if this call flips it), stamp the drain's start and deadline (kept when
        a drain of the node is already in progress) and apply `record`, in one write from the node as
        the watch saw it (a conflict reads it again)."""

        deadline, resumed = self._api.clock() + settings.timeout_seconds, False

        def change(obj: dict[str, Any]) -> dict[str, Any] | None:
            nonlocal deadline, resumed
            deadline, resumed, stamp = self._drain_window(obj, settings.timeout_seconds)
            return self._drain_patch(obj, stamp, record)

        await self._nodes.modify(node, "start drain", change)
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
        self._api.ensure_leader(f"drain {node}")
        async with contextlib.AsyncExitStack() as stack:
            # At once; every watch that started is in the stack before a failure ends the drain.
            started = await asyncio.gather(
                stack.enter_async_context(self.watching_pods(node)),
                self._enter_pdb_watch(stack),
                self._nodes.read_object(node),
                return_exceptions=True,
            )
            pod_cache, pdb_cache, obj = _all_or_raise(*started)
            if obj is None:
                raise BackendUnavailable(f"drain {node}: node not found")
            pod_objs = pod_cache.objects()
            uids = {_pod_key(o): uid_of(o) for o in pod_objs}
            daemonsets = await self.daemonsets_exist(_daemonset_refs(pod_objs))
            plan = _plan(node, pod_objs, pdb_cache, settings, daemonsets)
            skipped = tuple(f"{p.namespace}/{p.name}" for p in plan.skip)
            here = self._started_here.pop(node, None)
            if plan.needs_permission:
                await self._cordon_for_drain(node, obj, {}, None)
                blocked = tuple(BlockedPod(p.namespace, p.name, p.reason) for p in plan.needs_permission)
                outcome = DrainOutcome(node, False, False, (), skipped, blocked, False, self._api.clock())
                in_progress = here is not None or annotations_of(obj).get(DRAIN_STATUS) == "in-progress"
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
            self._api.missing(PDB_API, exc)
            return None

    async def _finish_drain(
        self, node: str, outcome: DrainOutcome, *, status: str | None, record: RecordChange | None = None
    ) -> None:
        if status is not None:
            blocked = blocked_annotation(outcome.blocked)
            await self._nodes.annotate(
                node,
                "record drain result",
                {DRAIN_STATUS: status, DRAIN_BLOCKED: blocked or None},
                record=record,
            )
        # The node's Event (AccelDrainFinished / AccelDrainBlocked) is the engine's, as the policy's
        # `events` setting says.
        logger.info("%s: %s", node, outcome.summary())


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
        cluster: Drainer,
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
        return self.deadline - self.cluster._api.clock()

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
        self.uids |= {_pod_key(o): uid_of(o) for o in fresh}
        late = [(p.namespace, p.name) for p in (*plan.evict, *plan.waiting_on_pdb)]
        if late:
            logger.info("%s: %d pod(s) arrived after the plan; evicting them too", self.node, len(late))
        return late

    async def _evict_one(self, namespace: str, name: str) -> BlockedPod | None:
        delay = self.settings.backoff_initial_seconds
        last = "the drain timed out before an eviction was tried"
        while True:
            self.cluster._api.ensure_leader(f"evict {namespace}/{name}")
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
                if obj is None or uid_of(obj) != self.uids.get(key, uid_of(obj)):
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
