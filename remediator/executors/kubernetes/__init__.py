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

The executor is composed of parts, each acting on one kind of object, each handed the request layer
(`api.Api`: the client, settings, clock and leadership fence): `nodes.NodeStore` (the node cache and
every node write), `events.EventWriter` (node Events), `drains.Drainer` (pods, budgets, evictions and
drains; it writes the drain's node annotations through the node store) and
`configmaps.ConfigMapStore` (the gates document, an older release's state, the durable quarantine
copies). `KubernetesCluster` puts them together behind the `Cluster` seam; the engine's parts are
each handed the narrow part of that seam they use (remediator/cluster.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

from kubernetes.aio import client as k8s

from remediator.cluster import (
    DrainOutcome,
    DrainSettings,
    EvictionResult,
    Node,
    NodeCondition,
    NodeListener,
    Pod,
    PodDisruptionBudget,
    Returned,
    Taint,
)
from remediator.executors.kubernetes.api import (
    SERVICE_ACCOUNT_DIR,
    TLS_CLOSE_GRACE_SECONDS,
    Api,
    ApiError,
    ClientConfig,
    KubernetesSettings,
    client_configuration,
)
from remediator.executors.kubernetes.configmaps import (
    GATES_KEY,
    STATE_KEY,
    ConfigMapStore,
    quarantine_configmap_name,
)
from remediator.executors.kubernetes.drains import BLOCKED_SHOWN, PDB_API, Drainer, blocked_annotation
from remediator.executors.kubernetes.events import EventWriter
from remediator.executors.kubernetes.nodes import NodeStore, manages_unschedulable, trim_node
from remediator.executors.watchcache import SharedWatch, WatchCache
from remediator.lifecycle.record import RecordChange

__all__ = [
    "BLOCKED_SHOWN",
    "GATES_KEY",
    "PDB_API",
    "SERVICE_ACCOUNT_DIR",
    "STATE_KEY",
    "TLS_CLOSE_GRACE_SECONDS",
    "ApiError",
    "ClientConfig",
    "KubernetesCluster",
    "KubernetesSettings",
    "blocked_annotation",
    "manages_unschedulable",
    "quarantine_configmap_name",
    "trim_node",
]


class KubernetesCluster:
    """remediator.cluster.Cluster against a real API server, composed of its parts (module docstring).

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
        self.requests = Api(api=api, settings=self.settings, should_act=should_act, clock=clock)
        """The request layer the parts share."""
        self.node_store = NodeStore(self.requests)
        self.events = EventWriter(self.requests)
        self.drainer = Drainer(self.requests, self.node_store)
        self.configmaps = ConfigMapStore(self.requests)
        self._cache_task: asyncio.Task[None] | None = None

    # -- what tests, metrics and the service read ------------------------------------------------

    @property
    def nodes(self) -> WatchCache:
        """The watch-backed node cache; reads come from it once `start_cache()` synced it."""
        return self.node_store.cache

    @property
    def pod_watches(self) -> dict[str, SharedWatch]:
        return self.drainer.pod_watches

    @property
    def pdb_watches(self) -> dict[str, SharedWatch]:
        return self.drainer.pdb_watches

    @property
    def api_unavailable(self) -> dict[str, int]:
        """Optional API -> how often it answered 404 (not served by this API server); a metric."""
        return self.requests.api_unavailable

    @property
    def event_series(self) -> int:
        """Event series remembered to count repeats (those written in the last 10 minutes)."""
        return self.events.event_series

    # -- connecting, the cache, closing ------------------------------------------------------------

    @staticmethod
    async def configuration(
        *,
        kubeconfig: Path | None = None,
        context: str | None = None,
        in_cluster: bool = False,
        environ: Mapping[str, str] | None = None,
        service_account_dir: Path | None = None,
    ) -> ClientConfig:
        """Client configuration, found the way client-go and controller-runtime find it (see
        `api.client_configuration`)."""
        return await client_configuration(
            kubeconfig=kubeconfig,
            context=context,
            in_cluster=in_cluster,
            environ=environ,
            service_account_dir=service_account_dir,
        )

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
        watched = self.drainer.watched or self._cache_task is not None
        if self._cache_task is not None:
            self._cache_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._cache_task
            self._cache_task = None
        await self.drainer.stop()
        await self.api.close()  # type: ignore[no-untyped-call]  # untyped upstream
        if watched:
            await asyncio.sleep(TLS_CLOSE_GRACE_SECONDS)

    # -- nodes (NodeStore) -------------------------------------------------------------------------

    async def get_node(self, name: str) -> Node | None:
        return await self.node_store.get_node(name)

    async def list_nodes(self) -> list[Node]:
        return await self.node_store.list_nodes()

    def observed_nodes(self) -> list[Node] | None:
        return self.node_store.observed_nodes()

    def watch_nodes(self, listener: NodeListener) -> None:
        self.node_store.watch_nodes(listener)

    async def node_annotations(self, name: str) -> dict[str, str]:
        return await self.node_store.node_annotations(name)

    async def annotate_node(
        self, node: str, annotations: Mapping[str, str | None], *, record: RecordChange | None = None
    ) -> None:
        await self.node_store.annotate_node(node, annotations, record=record)

    async def label_node(self, node: str, labels: Mapping[str, str | None]) -> None:
        await self.node_store.label_node(node, labels)

    async def cordon(self, node: str, *, record: RecordChange | None = None) -> bool:
        return await self.node_store.cordon(node, record=record)

    async def uncordon(self, node: str, *, record: RecordChange | None = None) -> bool:
        return await self.node_store.uncordon(node, record=record)

    async def add_taint(self, node: str, taint: Taint, *, record: RecordChange | None = None) -> None:
        await self.node_store.add_taint(node, taint, record=record)

    async def remove_taint(self, node: str, taint: Taint, *, record: RecordChange | None = None) -> None:
        await self.node_store.remove_taint(node, taint, record=record)

    async def return_node(
        self,
        node: str,
        *,
        uid: str,
        taints: Sequence[Taint],
        annotations: Mapping[str, str | None],
        record: RecordChange | None = None,
    ) -> Returned | None:
        return await self.node_store.return_node(
            node, uid=uid, taints=taints, annotations=annotations, record=record
        )

    async def set_condition(
        self,
        node: str,
        condition: NodeCondition,
        *,
        record: RecordChange | None = None,
        annotations: Mapping[str, str | None] | None = None,
    ) -> None:
        await self.node_store.set_condition(node, condition, record=record, annotations=annotations)

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
        return await self.node_store.set_startup_taint(
            node, uid=uid, taint=taint, present=present, annotations=annotations, labels=labels
        )

    # -- Events (EventWriter) ----------------------------------------------------------------------

    async def record_event(self, *, node: str, reason: str, message: str, type_: str) -> None:
        await self.events.record_event(node=node, reason=reason, message=message, type_=type_)

    # -- pods, budgets, evictions, drains (Drainer) ------------------------------------------------

    async def list_pods(self, node: str) -> list[Pod]:
        return await self.drainer.list_pods(node)

    async def list_pdbs(self) -> list[PodDisruptionBudget]:
        return await self.drainer.list_pdbs()

    async def daemonsets_exist(self, refs: Collection[tuple[str, str]]) -> set[tuple[str, str]] | None:
        return await self.drainer.daemonsets_exist(refs)

    def watching_pods(self, node: str) -> contextlib.AbstractAsyncContextManager[WatchCache]:
        return self.drainer.watching_pods(node)

    def watching_pdbs(self) -> contextlib.AbstractAsyncContextManager[WatchCache]:
        return self.drainer.watching_pdbs()

    async def evict_pod(
        self, *, namespace: str, name: str, grace_period_seconds: int | None
    ) -> EvictionResult:
        return await self.drainer.evict_pod(
            namespace=namespace, name=name, grace_period_seconds=grace_period_seconds
        )

    async def start_drain(
        self, node: str, settings: DrainSettings, *, record: RecordChange | None = None
    ) -> None:
        await self.drainer.start_drain(node, settings, record=record)

    async def drain(
        self,
        node: str,
        settings: DrainSettings,
        *,
        ended: Callable[[DrainOutcome], RecordChange | None] | None = None,
    ) -> DrainOutcome:
        return await self.drainer.drain(node, settings, ended=ended)

    # -- this service's own ConfigMaps (ConfigMapStore) --------------------------------------------

    async def load_gates(self) -> Mapping[str, Any] | None:
        return await self.configmaps.load_gates()

    async def save_gates(self, document: Mapping[str, Any]) -> None:
        await self.configmaps.save_gates(document)

    async def load_legacy_state(self) -> Mapping[str, Any] | None:
        return await self.configmaps.load_legacy_state()

    async def delete_legacy_state(self) -> None:
        await self.configmaps.delete_legacy_state()

    async def load_quarantines(self) -> Mapping[str, Mapping[str, Any]]:
        return await self.configmaps.load_quarantines()

    async def save_quarantine(self, node: str, document: Mapping[str, Any]) -> None:
        await self.configmaps.save_quarantine(node, document)

    async def delete_quarantine(self, node: str) -> None:
        await self.configmaps.delete_quarantine(node)
