"""The snapshot backend: a cluster read from `kubectl get nodes,pods,poddisruptionbudgets -A -o yaml`.

Mutations change only the in-memory copy (the file is never written), and every mutating call is
listed in `mutations` (saves of the gates document are counted in `gates_saves`, saves and deletes
of the durable quarantine copies listed in `quarantine_writes`), so tests can assert that a dry run
made none. Writes keep what the Kubernetes executor keeps on a node: the ownership annotations
(`cordoned-by`, `taints-added`) and the node's record (remediator/lifecycle/record.py), in the same in-memory
change, so a second engine over the same backend derives exactly what it would derive from a real
cluster. The gates document is kept in memory as JSON text. `RecordingAws` is the matching AWS seam:
it records calls and calls nothing.

`drain` plans with remediator.actuators.drainplan like the Kubernetes executor and answers with the same
`DrainOutcome`: pods that need permission refuse the drain before any eviction; the others are
evicted at once (an in-memory pod is gone when evicted). A pod whose PodDisruptionBudget refuses
stays and is reported as blocking with the reason; since nothing here ever changes a budget by
itself (there is no disruption controller), waiting could not help, so such a drain ends at once as
if its deadline had passed (`timed_out`).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from remediator.actuators.drainplan import plan_drain
from remediator.cluster import (
    BackendUnavailable,
    BlockedPod,
    DrainOutcome,
    DrainSettings,
    EvictionResult,
    Node,
    NodeCondition,
    NodeListener,
    ObjectFormatError,
    Pod,
    PodDisruptionBudget,
    Returned,
    Taint,
    node_from_object,
    pdb_from_object,
    pod_from_object,
)
from remediator.lifecycle.record import (
    CORDONED_AT,
    CORDONED_BY,
    DRAIN_STATUS,
    MANAGER,
    RETURN_FORGETS,
    TAINTS_ADDED,
    RecordChange,
    owned_taints,
    rfc3339,
    taint_id,
)


class SnapshotError(ValueError):
    """The snapshot file cannot be used; the message names the file and the item."""


class SnapshotCluster:
    """An in-memory cluster implementing remediator.cluster.Cluster."""

    def __init__(
        self,
        *,
        nodes: list[Node],
        pods: list[Pod],
        pdbs: list[PodDisruptionBudget],
        source: str = "<memory>",
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.source = source
        self._clock = clock
        self.nodes: dict[str, Node] = {n.name: n for n in nodes}
        self.pods: dict[tuple[str, str], Pod] = {(p.namespace, p.name): p for p in pods}
        self.pdbs: dict[tuple[str, str], PodDisruptionBudget] = {(b.namespace, b.name): b for b in pdbs}
        self.events: list[dict[str, str]] = []
        self.mutations: list[str] = []
        """Every mutating call, e.g. `cordon gpu-node-1`, in order."""
        self.gates: str | None = None
        """The saved gates document (pause, breaker latch), as JSON text."""
        self.gates_saves = 0
        """How often the gates document was saved (a mutating call not listed in `mutations`)."""
        self.legacy_state: str | None = None
        """An older release's whole gate-state document, as JSON text (migrated, then deleted)."""
        self.quarantines: dict[str, str] = {}
        """Node name -> the durable copy of its quarantine, as JSON text."""
        self._listeners: list[NodeListener] = []
        self.quarantine_writes: list[str] = []
        """Every save and delete of a durable quarantine copy (`save gpu-1`, `delete gpu-1`), in order;
        mutating calls kept apart from `mutations`, which lists what is done to the nodes."""

    @classmethod
    def from_file(cls, path: Path) -> SnapshotCluster:
        """Load a `kind: List` of Nodes, Pods and PodDisruptionBudgets (other kinds are ignored)."""
        try:
            doc = yaml.safe_load(path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise SnapshotError(f"{path}: cannot read cluster snapshot: {exc.strerror or exc}") from exc
        except yaml.YAMLError as exc:
            raise SnapshotError(f"{path}: not valid YAML: {exc}") from exc
        return cls.from_document(doc, source=str(path))

    @classmethod
    def from_document(cls, doc: Any, *, source: str) -> SnapshotCluster:
        """Build from an already-parsed `kind: List` document."""
        if not isinstance(doc, Mapping) or not isinstance(doc.get("items"), list):
            raise SnapshotError(
                f"{source}: expected the output of `kubectl get nodes,pods,poddisruptionbudgets -A -o yaml` "
                "(a mapping with kind: List and items: [...])"
            )
        nodes, pods, pdbs = [], [], []
        for index, item in enumerate(doc["items"]):
            if not isinstance(item, Mapping):
                raise SnapshotError(f"{source}: items[{index}]: expected a Kubernetes object, got {item!r}")
            kind = item.get("kind")
            name = item.get("metadata", {}).get("name") if isinstance(item.get("metadata"), Mapping) else None
            try:
                if kind == "Node":
                    nodes.append(node_from_object(item))
                elif kind == "Pod":
                    pods.append(pod_from_object(item))
                elif kind == "PodDisruptionBudget":
                    pdbs.append(pdb_from_object(item))
            except ObjectFormatError as exc:
                raise SnapshotError(f"{source}: items[{index}] ({kind} {name}): {exc}") from exc
        return cls(nodes=nodes, pods=pods, pdbs=pdbs, source=source)

    # -- reads -----------------------------------------------------------------------------------

    async def get_node(self, name: str) -> Node | None:
        return self.nodes.get(name)

    async def list_nodes(self) -> list[Node]:
        return list(self.nodes.values())

    async def list_pods(self, node: str) -> list[Pod]:
        return [p for p in self.pods.values() if p.node_name == node]

    async def list_pdbs(self) -> list[PodDisruptionBudget]:
        return list(self.pdbs.values())

    async def daemonsets_exist(self, refs: Collection[tuple[str, str]]) -> set[tuple[str, str]] | None:
        """A snapshot (`kubectl get nodes,pods,poddisruptionbudgets`) holds no DaemonSets: unknown."""
        del refs
        return None

    # -- writes (in memory) ----------------------------------------------------------------------

    def _replace_node(self, name: str, **changes: Any) -> None:
        if name in self.nodes:
            self.nodes[name] = dataclasses.replace(self.nodes[name], **changes)
            self._notify(name)

    def watch_nodes(self, listener: NodeListener) -> None:
        """Call `listener(name, annotations)` at every change of a node (annotations None: deleted),
        as a watch would deliver it: this backend's own writes, and `change_node`."""
        self._listeners.append(listener)

    def _notify(self, name: str) -> None:
        node = self.nodes.get(name)
        for listener in self._listeners:
            listener(name, node.annotations if node is not None else None)

    def change_node(self, name: str, **changes: Any) -> None:
        """Someone else changed the node (a test plays a human: `unschedulable=False`, other taints)."""
        self.mutations.append(f"someone else changed {name}: {', '.join(sorted(changes))}")
        self._replace_node(name, **changes)

    def delete_node(self, name: str) -> None:
        """Someone deleted the node object."""
        if self.nodes.pop(name, None) is not None:
            self._notify(name)

    def _annotations(
        self, name: str, annotations: Mapping[str, str | None], record: RecordChange | None
    ) -> dict[str, str]:
        """The node's annotations after this write (None removes; `record` applied)."""
        current = dict(self.nodes[name].annotations)
        changes = {**dict(annotations), **(record.annotation(current) if record is not None else {})}
        merged = {**current, **changes}
        return {k: v for k, v in merged.items() if v is not None}

    async def cordon(self, node: str, *, record: RecordChange | None = None) -> bool:
        self.mutations.append(f"cordon {node}")
        before = self.nodes.get(node)
        if before is None or before.unschedulable:
            return False
        stamp: dict[str, str | None] = {CORDONED_BY: MANAGER, CORDONED_AT: rfc3339(self._clock())}
        self._replace_node(node, unschedulable=True, annotations=self._annotations(node, stamp, record))
        return True

    async def uncordon(self, node: str, *, record: RecordChange | None = None) -> bool:
        """Like the Kubernetes executor: only a cordon this service made (its annotation)."""
        self.mutations.append(f"uncordon {node}")
        before = self.nodes.get(node)
        if before is None or before.annotations.get(CORDONED_BY) != MANAGER:
            return False
        forget = {CORDONED_BY: None, CORDONED_AT: None}
        self._replace_node(node, unschedulable=False, annotations=self._annotations(node, forget, record))
        return before.unschedulable

    async def add_taint(self, node: str, taint: Taint, *, record: RecordChange | None = None) -> None:
        self.mutations.append(f"taint {node} {taint.key}={taint.value}:{taint.effect}")
        if node not in self.nodes:
            return
        current = self.nodes[node]
        same = [t for t in current.taints if (t.key, t.effect) == (taint.key, taint.effect)]
        kept = tuple(t for t in current.taints if (t.key, t.effect) != (taint.key, taint.effect))
        owned = owned_taints(current.annotations)
        tid = taint_id(taint.key, taint.effect)
        extra: dict[str, str | None] = {}
        if not same and tid not in owned:  # only a taint this service created is its to remove
            extra[TAINTS_ADDED] = json.dumps(sorted([*owned, tid]))
        self._replace_node(node, taints=(*kept, taint), annotations=self._annotations(node, extra, record))

    async def remove_taint(self, node: str, taint: Taint, *, record: RecordChange | None = None) -> None:
        """Like the Kubernetes executor: only a taint this service added, and only with the value it
        set (a taint someone changed since is left, and no longer counted as this service's)."""
        self.mutations.append(f"untaint {node} {taint.key}:{taint.effect}")
        if node not in self.nodes:
            return
        current = self.nodes[node]
        owned = owned_taints(current.annotations)
        tid = taint_id(taint.key, taint.effect)
        if tid not in owned:
            return
        left = sorted(t for t in owned if t != tid)
        forget: dict[str, str | None] = {TAINTS_ADDED: json.dumps(left) if left else None}
        ours = [
            t for t in current.taints if (t.key, t.effect, t.value) == (taint.key, taint.effect, taint.value)
        ]
        kept = tuple(t for t in current.taints if t not in ours)
        self._replace_node(node, taints=kept, annotations=self._annotations(node, forget, record))

    async def return_node(
        self,
        node: str,
        *,
        uid: str,
        taints: Sequence[Taint],
        annotations: Mapping[str, str | None],
        record: RecordChange | None = None,
    ) -> Returned | None:
        """Like the Kubernetes executor (the cordon is this service's when its annotation says so)."""
        current = self.nodes.get(node)
        if current is None or current.uid != uid:
            return None
        self.mutations.append(f"return {node}")
        owned = owned_taints(current.annotations)
        gone = {(t.key, t.effect, t.value) for t in taints if taint_id(t.key, t.effect) in owned}
        kept = tuple(t for t in current.taints if (t.key, t.effect, t.value) not in gone)
        forget: dict[str, str | None] = {
            k: None for k in (*RETURN_FORGETS, TAINTS_ADDED) if k in current.annotations
        }
        forget.update(annotations)
        flip = current.unschedulable and current.annotations.get(CORDONED_BY) == MANAGER
        self._replace_node(
            node,
            taints=kept,
            unschedulable=current.unschedulable and not flip,
            annotations=self._annotations(node, forget, record),
        )
        return Returned(
            found=True,
            uncordoned=flip,
            cordon_kept=current.unschedulable and not flip,
            taints_removed=tuple(sorted(taint_id(k, e) for k, e, _ in gone)),
        )

    async def set_condition(
        self,
        node: str,
        condition: NodeCondition,
        *,
        record: RecordChange | None = None,
        annotations: Mapping[str, str | None] | None = None,
    ) -> None:
        self.mutations.append(f"condition {node} {condition.type}={condition.status}")
        if node in self.nodes:
            kept = tuple(c for c in self.nodes[node].conditions if c.type != condition.type)
            merged = self._annotations(node, annotations or {}, record)
            self._replace_node(node, conditions=(*kept, condition), annotations=merged)

    async def annotate_node(
        self, node: str, annotations: Mapping[str, str | None], *, record: RecordChange | None = None
    ) -> None:
        self.mutations.append(f"annotate {node} {', '.join(sorted(annotations))}")
        if node in self.nodes:
            self._replace_node(node, annotations=self._annotations(node, annotations, record))

    async def label_node(self, node: str, labels: Mapping[str, str | None]) -> None:
        self.mutations.append(f"label {node} {', '.join(f'{k}={v}' for k, v in sorted(labels.items()))}")
        if node in self.nodes:
            merged = {**self.nodes[node].labels, **labels}
            self._replace_node(node, labels={k: v for k, v in merged.items() if v is not None})

    def rebooted(self, node: str, boot_id: str) -> None:
        """The node came back from a reboot with this boot id (the demo plays the machine)."""
        self._replace_node(node, boot_id=boot_id)

    async def record_event(self, *, node: str, reason: str, message: str, type_: str) -> None:
        self.mutations.append(f"event {node} {type_} {reason}")
        self.events.append({"node": node, "reason": reason, "message": message, "type": type_})

    async def evict_pod(
        self, *, namespace: str, name: str, grace_period_seconds: int | None
    ) -> EvictionResult:
        """Mimics the eviction API: 404 when gone, 429 when a matching PDB allows no disruption."""
        self.mutations.append(f"evict {namespace}/{name}")
        pod = self.pods.get((namespace, name))
        if pod is None:
            return EvictionResult.GONE
        terminal = pod.phase in ("Succeeded", "Failed")
        matching = [
            b for b in self.pdbs.values() if b.namespace == namespace and b.selector.matches(pod.labels)
        ]
        if not terminal and matching:
            if len(matching) > 1 or matching[0].disruptions_allowed <= 0:
                return EvictionResult.REFUSED_BY_PDB
            pdb = matching[0]
            self.pdbs[(pdb.namespace, pdb.name)] = dataclasses.replace(
                pdb, disruptions_allowed=pdb.disruptions_allowed - 1
            )
        del self.pods[(namespace, name)]
        return EvictionResult.EVICTED

    async def start_drain(
        self, node: str, settings: DrainSettings, *, record: RecordChange | None = None
    ) -> None:
        """Cordon (claimed when this call cordons it), mark the drain in progress, apply `record`."""
        if node not in self.nodes:
            raise BackendUnavailable(f"drain {node}: node not found")
        if not self.nodes[node].unschedulable:
            await self.cordon(node)
        stamp: dict[str, str | None] = {DRAIN_STATUS: "in-progress"}
        self._replace_node(node, annotations=self._annotations(node, stamp, record))

    async def drain(
        self,
        node: str,
        settings: DrainSettings,
        *,
        ended: Callable[[DrainOutcome], RecordChange | None] | None = None,
    ) -> DrainOutcome:
        """Cordon and evict what `kubectl drain` would, in memory (see the module docstring); the end
        is recorded on the node with `ended(outcome)`, as the Kubernetes executor writes it."""
        if node not in self.nodes:
            raise BackendUnavailable(f"drain {node}: node not found")
        self.mutations.append(f"drain {node}")
        outcome = await self._drain(node, settings)
        status = "done" if outcome.completed else ("timed-out" if outcome.timed_out else "refused")
        change = ended(outcome) if ended is not None else None
        if node in self.nodes:
            self._replace_node(node, annotations=self._annotations(node, {DRAIN_STATUS: status}, change))
        return outcome

    async def _drain(self, node: str, settings: DrainSettings) -> DrainOutcome:
        plan = plan_drain(
            await self.list_pods(node),
            await self.list_pdbs(),
            delete_emptydir_data=settings.delete_emptydir_data,
            force_bare_pods=settings.force_bare_pods,
        )
        now = self._clock()
        skipped = tuple(f"{p.namespace}/{p.name}" for p in plan.skip)
        if not self.nodes[node].unschedulable:
            await self.cordon(node)
        if plan.needs_permission:
            blocked = tuple(BlockedPod(p.namespace, p.name, p.reason) for p in plan.needs_permission)
            return DrainOutcome(node, False, False, (), skipped, blocked, False, now)
        evicted: list[str] = []
        refused: list[BlockedPod] = []
        for pod in (*plan.evict, *plan.waiting_on_pdb):
            result = await self.evict_pod(
                namespace=pod.namespace, name=pod.name, grace_period_seconds=settings.grace_period_seconds
            )
            if result is EvictionResult.REFUSED_BY_PDB:
                why = pod.reason or "a PodDisruptionBudget allows no disruption now"
                refused.append(BlockedPod(pod.namespace, pod.name, f"eviction refused (429): {why}"))
            else:
                evicted.append(f"{pod.namespace}/{pod.name}")
        return DrainOutcome(
            node,
            completed=not refused,
            timed_out=bool(refused),
            evicted=tuple(evicted),
            skipped=skipped,
            blocked=tuple(refused),
            resumed=False,
            deadline=now if refused else now + settings.timeout_seconds,
        )

    # -- the gates document, and an older release's state -----------------------------------------

    async def load_gates(self) -> Mapping[str, Any] | None:
        if self.gates is None:
            return None
        doc: Mapping[str, Any] = json.loads(self.gates)
        return doc

    async def save_gates(self, document: Mapping[str, Any]) -> None:
        self.gates_saves += 1
        self.gates = json.dumps(document, sort_keys=True)

    async def load_legacy_state(self) -> Mapping[str, Any] | None:
        if self.legacy_state is None:
            return None
        doc: Mapping[str, Any] = json.loads(self.legacy_state)
        return doc

    async def delete_legacy_state(self) -> None:
        self.mutations.append("delete legacy state")
        self.legacy_state = None

    # -- durable quarantine copies and the startup taint ----------------------------------------

    def observed_nodes(self) -> list[Node] | None:
        return list(self.nodes.values())

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
        current = self.nodes.get(node)
        if current is None or current.uid != uid:
            return False
        self.mutations.append(f"{'hold' if present else 'release'} {node} {taint.key}:{taint.effect}")
        kept = tuple(t for t in current.taints if t.key != taint.key)
        merged_annotations = {**current.annotations, **annotations}
        merged_labels = {**current.labels, **labels}
        self._replace_node(
            node,
            taints=(*kept, taint) if present else kept,
            annotations={k: v for k, v in merged_annotations.items() if v is not None},
            labels={k: v for k, v in merged_labels.items() if v is not None},
        )
        return True

    async def load_quarantines(self) -> Mapping[str, Mapping[str, Any]]:
        return {node: json.loads(text) for node, text in self.quarantines.items()}

    async def save_quarantine(self, node: str, document: Mapping[str, Any]) -> None:
        self.quarantine_writes.append(f"save {node}")
        self.quarantines[node] = json.dumps(document, sort_keys=True)

    async def delete_quarantine(self, node: str) -> None:
        self.quarantine_writes.append(f"delete {node}")
        self.quarantines.pop(node, None)

    def replace_node(self, node: Node) -> None:
        """The node object was deleted and created again under its name (a test plays the cloud's
        repair: a new uid, none of the old annotations, conditions or cordon)."""
        self.nodes[node.name] = node
        self._notify(node.name)


class RecordingAws:
    """The AWS seam in snapshot mode and in dry-run: remembers the calls, calls nothing."""

    enabled = True
    """It stands in for AWS (what a snapshot or a dry run would have called)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        """(operation, arguments) in order."""

    async def set_unhealthy(self, instance_id: str) -> bool:
        self.calls.append(("SetInstanceHealth", {"InstanceId": instance_id, "HealthStatus": "Unhealthy"}))
        return True

    async def health(self, instance_id: str) -> str | None:
        """Unhealthy once marked here, else Healthy (every instance is in a group here). A read: not
        listed in `calls`, which holds what would have changed something."""
        marked = any(
            op == "SetInstanceHealth" and args.get("InstanceId") == instance_id for op, args in self.calls
        )
        return "Unhealthy" if marked else "Healthy"

    async def reboot(self, instance_id: str) -> None:
        self.calls.append(("RebootInstances", {"InstanceIds": [instance_id]}))

    async def put_metric(
        self, *, namespace: str, name: str, value: float, dimensions: Mapping[str, str]
    ) -> None:
        self.calls.append(
            (
                "PutMetricData",
                {"Namespace": namespace, "MetricName": name, "Value": value, "Dimensions": dict(dimensions)},
            )
        )


class AwsOff:
    """The AWS seam of a service that acts on a real cluster without --aws: it calls nothing and says
    so (`enabled` is False), so an AWS action is skipped with that reason, never reported as done."""

    enabled = False
    """No AWS calls."""

    async def health(self, instance_id: str) -> str | None:
        raise AssertionError("AWS is off: the engine checks `enabled` before any call")

    async def set_unhealthy(self, instance_id: str) -> bool:
        raise AssertionError("AWS is off: the engine checks `enabled` before any call")

    async def reboot(self, instance_id: str) -> None:
        raise AssertionError("AWS is off: the engine checks `enabled` before any call")

    async def put_metric(
        self, *, namespace: str, name: str, value: float, dimensions: Mapping[str, str]
    ) -> None:
        raise AssertionError("AWS is off: the engine checks `enabled` before any call")
