"""The cluster as the remediator sees it: small typed views of nodes, pods and PDBs, and the seams.

A drain's settings and outcome live here too (not in an executor), because `Cluster.drain` names them.

`Cluster` and `Aws` are the only ways the decision engine touches the outside world. The snapshot
backend (executors/snapshot.py) implements both in memory; the Kubernetes and AWS executors of later
issues implement the same Protocols. This module imports no client library: it is pure data.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol

from remediator.lifecycle.record import RecordChange


class BackendUnavailable(RuntimeError):
    """The backend could not be reached; the webhook answers 503 so that Alertmanager retries."""


class WriteRefused(RuntimeError):
    """The API refused a write for good (invalid, forbidden): retrying would get the same answer, so
    the step is recorded as failed instead of answering 503 to every redelivery."""


class NotLeader(BackendUnavailable):
    """This replica lost (or never had) the leader Lease; another one acts. Answered with 503."""


class StateConflict(BackendUnavailable):
    """The stored gates changed since they were read (another writer): read again, re-apply, retry."""


class ObjectFormatError(ValueError):
    """A Kubernetes object does not have the shape the remediator needs."""


@dataclass(frozen=True)
class Taint:
    """A node taint, as in `spec.taints`."""

    key: str
    """Taint key, e.g. `accel-health.io/unhealthy`."""
    value: str
    """Taint value (may be empty)."""
    effect: str
    """NoSchedule, PreferNoSchedule or NoExecute."""


@dataclass(frozen=True)
class NodeCondition:
    """One entry of a node's `status.conditions`."""

    type: str
    """Condition type, e.g. `AcceleratorHealthy`."""
    status: str
    """"True", "False" or "Unknown"."""
    reason: str = ""
    """CamelCase machine-readable reason (the alert name)."""
    message: str = ""
    """Human-readable message."""


@dataclass(frozen=True)
class Node:
    """What the remediator needs to know about a node."""

    name: str
    """metadata.name"""
    labels: Mapping[str, str] = field(default_factory=dict)
    """metadata.labels"""
    unschedulable: bool = False
    """spec.unschedulable: true once cordoned."""
    taints: tuple[Taint, ...] = ()
    """spec.taints"""
    provider_id: str = ""
    """spec.providerID, e.g. `aws:///us-west-2a/i-0123…`; empty when unknown."""
    conditions: tuple[NodeCondition, ...] = ()
    """status.conditions"""
    accelerators: tuple[str, ...] = ()
    """Accelerator resources in status.capacity with a count above 0 (nvidia.com/gpu,
    aws.amazon.com/neuron, ...); empty on CPU-only nodes."""
    annotations: Mapping[str, str] = field(default_factory=dict)
    """metadata.annotations (what this service recorded about the node lives there)."""
    uid: str = ""
    """metadata.uid: a node object deleted and created again under the same name gets a new one."""
    boot_id: str = ""
    """status.nodeInfo.bootID: changes when the machine reboots."""

    @property
    def has_accelerators(self) -> bool:
        """An accelerator node: it advertises an accelerator resource or carries a GPU-present label."""
        return bool(self.accelerators) or any(
            self.labels.get(label, "").lower() == "true" for label in ACCELERATOR_LABELS
        )

    @property
    def ready(self) -> bool:
        """The kubelet's Ready condition is True (a node without conditions counts as ready)."""
        cond = next((c for c in self.conditions if c.type == "Ready"), None)
        return cond is None or cond.status == "True"


ACCELERATOR_RESOURCE_PREFIXES = (
    "nvidia.com/gpu",
    "nvidia.com/mig-",
    "amd.com/gpu",
    "aws.amazon.com/neuron",
    "habana.ai/gaudi",
    "google.com/tpu",
    "gpu.intel.com/",
)
"""Extended resources that make a node an accelerator node (device plugins advertise them)."""
ACCELERATOR_LABELS = ("nvidia.com/gpu.present", "feature.node.kubernetes.io/pci-10de.present")
"""Labels (GPU operator, node feature discovery) that mark an accelerator node before its device
plugin has registered."""


def accelerator_resources(capacity: Mapping[str, Any]) -> tuple[str, ...]:
    """The accelerator resources of a status.capacity with a count above 0."""
    out = []
    for name, value in capacity.items():
        if not str(name).startswith(ACCELERATOR_RESOURCE_PREFIXES):
            continue
        try:
            count = int(str(value))
        except ValueError:
            count = 1  # a quantity like "1k": present
        if count > 0:
            out.append(str(name))
    return tuple(sorted(out))


@dataclass(frozen=True)
class OwnerReference:
    """One entry of metadata.ownerReferences."""

    kind: str
    """Owner kind, e.g. Job, ReplicaSet, DaemonSet."""
    name: str
    """Owner name."""
    controller: bool
    """True for the managing controller."""


@dataclass(frozen=True)
class Pod:
    """What drain planning needs to know about a pod."""

    namespace: str
    """metadata.namespace"""
    name: str
    """metadata.name"""
    node_name: str = ""
    """spec.nodeName"""
    labels: Mapping[str, str] = field(default_factory=dict)
    """metadata.labels (PDB selectors match on them)."""
    annotations: Mapping[str, str] = field(default_factory=dict)
    """metadata.annotations (mirror pods carry kubernetes.io/config.mirror)."""
    owners: tuple[OwnerReference, ...] = ()
    """metadata.ownerReferences"""
    phase: str = "Running"
    """status.phase"""
    emptydir_volumes: tuple[str, ...] = ()
    """Names of the pod's emptyDir volumes."""
    ip: str = ""
    """status.podIP (empty until the pod has one)."""
    ready: bool = True
    """The Ready condition is True (a pod that reports no conditions counts as ready): a pod that is
    not counts for nothing in its PodDisruptionBudget, and the Eviction API may let it go without
    charging the budget."""
    deleting: bool = False
    """metadata.deletionTimestamp is set: being deleted already (the Eviction API ignores budgets)."""

    @property
    def controller(self) -> OwnerReference | None:
        """The owner reference with controller=true, if any."""
        return next((o for o in self.owners if o.controller), None)


@dataclass(frozen=True)
class LabelRequirement:
    """One matchExpressions entry of a label selector."""

    key: str
    """Label key."""
    operator: str
    """In, NotIn, Exists or DoesNotExist."""
    values: tuple[str, ...] = ()
    """Values for In / NotIn."""


SELECTOR_OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist")
"""The operators of a matchExpressions entry."""


@dataclass(frozen=True)
class LabelSelector:
    """A Kubernetes label selector (matchLabels AND matchExpressions)."""

    match_labels: Mapping[str, str] = field(default_factory=dict)
    """matchLabels"""
    match_expressions: tuple[LabelRequirement, ...] = ()
    """matchExpressions"""

    @property
    def empty(self) -> bool:
        """No requirement at all (matches everything)."""
        return not self.match_labels and not self.match_expressions

    def __str__(self) -> str:
        """As kubectl's `-l` writes it: `pool=p5,zone in (a,b),!spot`."""
        parts = [f"{k}={v}" for k, v in sorted(self.match_labels.items())]
        for req in self.match_expressions:
            if req.operator == "Exists":
                parts.append(req.key)
            elif req.operator == "DoesNotExist":
                parts.append(f"!{req.key}")
            else:
                op = "in" if req.operator == "In" else "notin"
                parts.append(f"{req.key} {op} ({','.join(req.values)})")
        return ",".join(parts) or "(every node)"

    def matches(self, labels: Mapping[str, str]) -> bool:
        """Kubernetes semantics; an empty selector matches everything (policy/v1 PDB)."""
        if any(labels.get(k) != v for k, v in self.match_labels.items()):
            return False
        for req in self.match_expressions:
            present = req.key in labels
            ok = {
                "In": present and labels.get(req.key) in req.values,
                "NotIn": not present or labels.get(req.key) not in req.values,
                "Exists": present,
                "DoesNotExist": not present,
            }.get(req.operator, False)
            if not ok:
                return False
        return True


@dataclass(frozen=True)
class PodDisruptionBudget:
    """The part of a PDB the eviction API consults."""

    namespace: str
    """metadata.namespace"""
    name: str
    """metadata.name"""
    selector: LabelSelector = field(default_factory=LabelSelector)
    """spec.selector"""
    disruptions_allowed: int = 0
    """status.disruptionsAllowed: 0 means every eviction of a ready pod is refused with 429."""
    current_healthy: int = 0
    """status.currentHealthy"""
    desired_healthy: int = 0
    """status.desiredHealthy"""
    unhealthy_pod_eviction_policy: str = ""
    """spec.unhealthyPodEvictionPolicy (`IfHealthyBudget`, the default when empty, or `AlwaysAllow`)."""

    def lets_unready_go(self) -> bool:
        """Does the Eviction API let a pod that is not Ready go without charging this budget?
        (AlwaysAllow; IfHealthyBudget: while the budget's application is healthy.)"""
        if self.unhealthy_pod_eviction_policy == "AlwaysAllow":
            return True
        return self.current_healthy >= self.desired_healthy > 0


class EvictionResult(enum.Enum):
    """What the eviction API answered."""

    EVICTED = "evicted"
    REFUSED_BY_PDB = "refused-by-pdb"  # 429
    GONE = "gone"  # 404
    REFUSED = "refused"  # 403 or another 4xx (an admission webhook's denial): retrying will not help


@dataclass(frozen=True)
class DrainSettings:
    """One drain's knobs (timeout and permissions come from the policy's drain action)."""

    timeout_seconds: float = 600.0
    """Overall deadline, counted from the drain's first start (kept across restarts)."""
    grace_period_seconds: int | None = None
    """DeleteOptions.gracePeriodSeconds of each Eviction; None keeps each pod's own."""
    delete_emptydir_data: bool = False
    """Evict pods with emptyDir volumes (their data is lost), like --delete-emptydir-data."""
    force_bare_pods: bool = False
    """Evict pods that no controller recreates, like --force."""
    concurrency: int = 10
    """Evictions in flight at once."""
    backoff_initial_seconds: float = 1.0
    """First wait after a 429 or a transient error; doubles up to backoff_max_seconds (with jitter)."""
    backoff_max_seconds: float = 10.0
    """Longest wait between two eviction attempts of one pod (kubectl waits 5 s)."""
    poll_interval_seconds: float = 1.0
    """Longest pause between two looks at the pods left on the node while waiting for evicted pods to
    go (the Kubernetes executor looks at its watch of the node's pods, also at every change)."""


@dataclass(frozen=True)
class BlockedPod:
    """A pod that kept a drain from finishing, and why."""

    namespace: str
    """Pod namespace."""
    name: str
    """Pod name."""
    reason: str
    """The last thing the API said about it, in words."""

    def as_json(self) -> dict[str, str]:
        return {"namespace": self.namespace, "name": self.name, "reason": self.reason}


@dataclass(frozen=True)
class DrainOutcome:
    """What a drain did."""

    node: str
    """The node."""
    completed: bool
    """True when every pod that had to go is gone (or replaced)."""
    timed_out: bool
    """True when the deadline passed with pods left."""
    evicted: tuple[str, ...]
    """`namespace/name` of pods evicted and gone."""
    skipped: tuple[str, ...]
    """`namespace/name` of pods a drain leaves alone (mirror, DaemonSet)."""
    blocked: tuple[BlockedPod, ...]
    """Pods that kept the drain from finishing, each with the reason."""
    resumed: bool
    """True when this call continued a drain started earlier (by this or another replica)."""
    deadline: float
    """The drain's deadline, Unix seconds."""

    def summary(self) -> str:
        """One line for logs, decision records and the node's Event."""
        head = (
            "drain complete" if self.completed else ("drain timed out" if self.timed_out else "drain refused")
        )
        parts = [f"{head}: {len(self.evicted)} evicted, {len(self.skipped)} skipped"]
        if self.blocked:
            pods = "; ".join(f"{b.namespace}/{b.name}: {b.reason}" for b in self.blocked)
            parts.append(f"{len(self.blocked)} blocking: {pods}")
        return ", ".join(parts)


@dataclass(frozen=True)
class Returned:
    """What a node's return to the pool did (`Cluster.return_node`)."""

    found: bool = False
    """The node with that uid was there."""
    uncordoned: bool = False
    """This service's cordon was lifted."""
    cordon_kept: bool = False
    """The node stays cordoned: the cordon was not this service's, or someone changed it since."""
    taints_removed: tuple[str, ...] = ()
    """`key:effect` of the taints removed."""


NodeListener = Callable[[str, Mapping[str, str] | None], None]
"""(node name, its annotations; None when it was deleted): told of every change the node watch sees."""


class NodeReads(Protocol):
    """The nodes as observed (the Kubernetes executor answers from its watch cache). Methods raise
    BackendUnavailable."""

    async def get_node(self, name: str) -> Node | None:
        """The node, or None when it does not exist."""
        ...

    async def list_nodes(self) -> list[Node]:
        """All nodes (the denominator of percentage budgets and of the storm breaker). Called at most
        once per webhook delivery that may act; an executor may answer from a watch cache."""
        ...

    def observed_nodes(self) -> list[Node] | None:
        """Every node as the backend observes it now, without a request (a watch cache, the snapshot);
        None when it has no such view yet. For what is computed at scrape time (the repair loop's
        gauges), never for a decision."""
        ...


class NodeWrites(Protocol):
    """Every write this service makes on a node; each takes `record`: a change to the node's record
    (remediator/lifecycle/record.py) made in the same request, computed from the node as it is just
    before the write. Methods raise BackendUnavailable."""

    async def cordon(self, node: str, *, record: RecordChange | None = None) -> bool:
        """Set spec.unschedulable=true and record that this service did. True when this call cordoned
        it; False when it was already cordoned (by someone else: not claimed, `record` not written)."""
        ...

    async def uncordon(self, node: str, *, record: RecordChange | None = None) -> bool:
        """Set spec.unschedulable=false, only if this service cordoned it and nobody changed the
        cordon since. True when this call uncordoned it."""
        ...

    async def add_taint(self, node: str, taint: Taint, *, record: RecordChange | None = None) -> None:
        """Add (or replace, by key and effect) a taint."""
        ...

    async def remove_taint(self, node: str, taint: Taint, *, record: RecordChange | None = None) -> None:
        """Remove the taint with this key, effect and value, only if this service added it."""
        ...

    async def set_condition(
        self,
        node: str,
        condition: NodeCondition,
        *,
        record: RecordChange | None = None,
        annotations: Mapping[str, str | None] | None = None,
    ) -> None:
        """Upsert a node condition by type (status subresource), with `annotations` in the same write."""
        ...

    async def annotate_node(
        self, node: str, annotations: Mapping[str, str | None], *, record: RecordChange | None = None
    ) -> None:
        """Set (None: remove) this service's annotations on the node (the repair loop's record,
        remediator/lifecycle/repair.py)."""
        ...

    async def label_node(self, node: str, labels: Mapping[str, str | None]) -> None:
        """Set (None: remove) labels on the node, others kept (a repeat offender's label for a human)."""
        ...

    async def return_node(
        self,
        node: str,
        *,
        uid: str,
        taints: Sequence[Taint],
        annotations: Mapping[str, str | None],
        record: RecordChange | None = None,
    ) -> Returned | None:
        """Give the node object with this `uid` back to the pool in one write: uncordon it when this
        service cordoned it and nobody changed the cordon since, remove exactly these taints (key,
        effect and value) where this service added them, forget this service's ownership and drain
        annotations, set (None: remove) `annotations` and apply `record`. None when no node with
        this uid exists."""
        ...

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
        """In one write on the node object with this `uid` (none when it has another: it was replaced
        again): add (`present`) or remove every taint with `taint.key`, whoever put it there (the
        kubelet's --register-with-taints, Karpenter's startupTaints, this service), and set (None:
        remove) annotations and labels of this service. False when no node with this uid exists."""
        ...


class EventSink(Protocol):
    """Node Events (what `kubectl describe node` shows). Methods raise BackendUnavailable."""

    async def record_event(self, *, node: str, reason: str, message: str, type_: str) -> None:
        """Record a Kubernetes Event about the node."""
        ...


class Drains(Protocol):
    """A node's pods and the budgets over them, evictions, and drains like `kubectl drain`. Methods
    raise BackendUnavailable."""

    async def list_pods(self, node: str) -> list[Pod]:
        """Pods bound to the node (all namespaces)."""
        ...

    async def list_pdbs(self) -> list[PodDisruptionBudget]:
        """All PodDisruptionBudgets."""
        ...

    async def daemonsets_exist(self, refs: Collection[tuple[str, str]]) -> set[tuple[str, str]] | None:
        """Which of these (namespace, name) DaemonSets exist; None when the backend cannot tell (every
        one then counts as existing: its pods are skipped by a drain)."""
        ...

    async def evict_pod(
        self, *, namespace: str, name: str, grace_period_seconds: int | None
    ) -> EvictionResult:
        """Create a policy/v1 Eviction for the pod."""
        ...

    async def start_drain(
        self, node: str, settings: DrainSettings, *, record: RecordChange | None = None
    ) -> None:
        """Cordon the node (claimed when this call cordons it), record the drain's start and deadline
        (kept when a drain of it is already running: it resumes) and `record`, in one write. Made
        before the webhook is answered; `drain` then runs the evictions."""
        ...

    async def drain(
        self,
        node: str,
        settings: DrainSettings,
        *,
        ended: Callable[[DrainOutcome], RecordChange | None] | None = None,
    ) -> DrainOutcome:
        """Cordon (if needed) and drain the node like `kubectl drain`, until done or the deadline.
        The write that records the end (or the refusal) carries `ended(outcome)`, asked for at that moment.

        Pods that need permission the settings do not give (bare pods, emptyDir data) refuse the
        drain before any eviction (completed and timed_out both false). May take as long as
        `settings.timeout_seconds`: the engine runs it in the background, never inside a webhook
        request. A drain interrupted (BackendUnavailable, NotLeader, cancellation) and started again
        resumes with its original deadline where the backend remembers one.
        """
        ...


class GatesStore(Protocol):
    """The one small document no node can hold (the pause switch, the breaker's latch), and an older
    release's whole-state document. Methods raise BackendUnavailable."""

    async def load_gates(self) -> Mapping[str, Any] | None:
        """The gates document last saved (remediator/gates/state.py: pause switch, breaker latch), or None."""
        ...

    async def save_gates(self, document: Mapping[str, Any]) -> None:
        """Store the gates document (under 1 KiB), replacing the one last read or written by this
        backend; StateConflict when another writer changed it since. A mutating call: never made in
        dry-run."""
        ...

    async def load_legacy_state(self) -> Mapping[str, Any] | None:
        """The whole gate-state document an older release kept in one object, if it is still there."""
        ...

    async def delete_legacy_state(self) -> None:
        """Delete that document (a new leader moved what still matters onto the nodes)."""
        ...


class QuarantineStore(Protocol):
    """The durable copies of quarantines, kept apart from the Node objects. Methods raise
    BackendUnavailable."""

    async def load_quarantines(self) -> Mapping[str, Mapping[str, Any]]:
        """Node name -> the durable copy of its quarantine (remediator/lifecycle/repair.py), kept apart
        from the Node object so that a node deleted and created again under the same name is still
        known as quarantined. Every copy this service saved and has not deleted."""
        ...

    async def save_quarantine(self, node: str, document: Mapping[str, Any]) -> None:
        """Store (create, or replace) the durable copy of the node's quarantine: a JSON-serialisable
        document of at most 1 KiB. A mutating call: never made in dry-run."""
        ...

    async def delete_quarantine(self, node: str) -> None:
        """Forget the durable copy of the node's quarantine (no-op when there is none)."""
        ...


class Cluster(NodeReads, NodeWrites, EventSink, Drains, GatesStore, QuarantineStore, Protocol):
    """Everything the engine reads from or does to Kubernetes: the backends (executors/) implement it
    whole; each part of the engine is handed the narrow protocol above it uses (NodeView the reads,
    NodeActuator the node writes and the Events, DrainRunner the drains, LatchStore the gates...)."""


class Aws(Protocol):
    """The AWS calls the engine makes. Methods raise BackendUnavailable when retrying could help."""

    @property
    def enabled(self) -> bool:
        """False when this service makes no AWS calls at all (run without --aws): AWS actions are
        then skipped, saying so, and never reported as done."""
        ...

    async def health(self, instance_id: str) -> str | None:
        """The instance's HealthStatus in its Auto Scaling group (`Healthy`, `Unhealthy`), or None
        when it is in no group (DescribeAutoScalingInstances)."""
        ...

    async def set_unhealthy(self, instance_id: str) -> bool:
        """SetInstanceHealth(Unhealthy, ShouldRespectGracePeriod=False): the ASG replaces it. False
        when the instance is in no Auto Scaling group (nothing marked, nothing replaces it)."""
        ...

    async def put_metric(
        self, *, namespace: str, name: str, value: float, dimensions: Mapping[str, str]
    ) -> None:
        """PutMetricData of one value."""
        ...

    async def reboot(self, instance_id: str) -> None:
        """RebootInstances of one instance (the hypervisor reboots it; same instance, new boot id)."""
        ...


def instance_id_from_provider_id(provider_id: str) -> str | None:
    """`aws:///us-west-2a/i-0abc` or `aws:////i-0abc` -> `i-0abc`; None for other providers."""
    if not provider_id.startswith("aws://"):
        return None
    last = provider_id.rstrip("/").rsplit("/", 1)[-1]
    return last if last.startswith("i-") else None


# -- parsing Kubernetes objects (dicts as kubectl -o yaml prints them) ---------------------------


def _mapping(obj: Any, where: str) -> Mapping[str, Any]:
    if obj is None:
        return {}
    if not isinstance(obj, Mapping):
        raise ObjectFormatError(f"{where}: expected a mapping, got {type(obj).__name__}")
    return obj


def _list(obj: Any, where: str) -> list[Any]:
    if obj is None:
        return []
    if not isinstance(obj, list):
        raise ObjectFormatError(f"{where}: expected a list, got {type(obj).__name__}")
    return obj


def _str(obj: Any, where: str, *, required: bool = False) -> str:
    if obj is None and not required:
        return ""
    if not isinstance(obj, str) or (required and not obj):
        raise ObjectFormatError(f"{where}: expected a non-empty string, got {obj!r}")
    return obj


def _str_map(obj: Any, where: str) -> Mapping[str, str]:
    raw = _mapping(obj, where)
    return MappingProxyType({str(k): str(v) for k, v in raw.items()})


def node_from_object(obj: Mapping[str, Any]) -> Node:
    """A Node object (dict) -> Node."""
    meta = _mapping(obj.get("metadata"), "metadata")
    spec = _mapping(obj.get("spec"), "spec")
    status = _mapping(obj.get("status"), "status")
    taints = tuple(
        Taint(
            key=_str(_mapping(t, f"spec.taints[{i}]").get("key"), f"spec.taints[{i}].key", required=True),
            value=_str(t.get("value"), f"spec.taints[{i}].value"),
            effect=_str(t.get("effect"), f"spec.taints[{i}].effect"),
        )
        for i, t in enumerate(_list(spec.get("taints"), "spec.taints"))
    )
    conditions = tuple(
        NodeCondition(
            type=_str(_mapping(c, f"status.conditions[{i}]").get("type"), f"status.conditions[{i}].type"),
            status=_str(c.get("status"), f"status.conditions[{i}].status"),
            reason=_str(c.get("reason"), f"status.conditions[{i}].reason"),
            message=_str(c.get("message"), f"status.conditions[{i}].message"),
        )
        for i, c in enumerate(_list(status.get("conditions"), "status.conditions"))
    )
    return Node(
        name=_str(meta.get("name"), "metadata.name", required=True),
        labels=_str_map(meta.get("labels"), "metadata.labels"),
        unschedulable=bool(spec.get("unschedulable", False)),
        taints=taints,
        provider_id=_str(spec.get("providerID"), "spec.providerID"),
        conditions=conditions,
        accelerators=accelerator_resources(_mapping(status.get("capacity"), "status.capacity")),
        annotations=_str_map(meta.get("annotations"), "metadata.annotations"),
        uid=_str(meta.get("uid"), "metadata.uid"),
        boot_id=_str(
            _mapping(status.get("nodeInfo"), "status.nodeInfo").get("bootID"), "status.nodeInfo.bootID"
        ),
    )


def pod_from_object(obj: Mapping[str, Any]) -> Pod:
    """A Pod object (dict) -> Pod."""
    meta = _mapping(obj.get("metadata"), "metadata")
    spec = _mapping(obj.get("spec"), "spec")
    status = _mapping(obj.get("status"), "status")
    owners = []
    for i, ref in enumerate(_list(meta.get("ownerReferences"), "metadata.ownerReferences")):
        where = f"metadata.ownerReferences[{i}]"
        ref_map = _mapping(ref, where)
        owners.append(
            OwnerReference(
                kind=_str(ref_map.get("kind"), f"{where}.kind", required=True),
                name=_str(ref_map.get("name"), f"{where}.name", required=True),
                controller=ref_map.get("controller") is True,
            )
        )
    emptydirs = []
    for i, vol in enumerate(_list(spec.get("volumes"), "spec.volumes")):
        vol_map = _mapping(vol, f"spec.volumes[{i}]")
        if "emptyDir" in vol_map:
            emptydirs.append(_str(vol_map.get("name"), f"spec.volumes[{i}].name"))
    conditions = [
        _mapping(c, f"status.conditions[{i}]")
        for i, c in enumerate(_list(status.get("conditions"), "status.conditions"))
    ]
    ready_conditions = [c for c in conditions if c.get("type") == "Ready"]
    return Pod(
        namespace=_str(meta.get("namespace"), "metadata.namespace") or "default",
        name=_str(meta.get("name"), "metadata.name", required=True),
        node_name=_str(spec.get("nodeName"), "spec.nodeName"),
        labels=_str_map(meta.get("labels"), "metadata.labels"),
        annotations=_str_map(meta.get("annotations"), "metadata.annotations"),
        owners=tuple(owners),
        phase=_str(status.get("phase"), "status.phase") or "Pending",
        emptydir_volumes=tuple(emptydirs),
        ip=_str(status.get("podIP"), "status.podIP"),
        ready=not ready_conditions or ready_conditions[0].get("status") == "True",
        deleting=bool(meta.get("deletionTimestamp")),
    )


def pdb_from_object(obj: Mapping[str, Any]) -> PodDisruptionBudget:
    """A policy/v1 PodDisruptionBudget object (dict) -> PodDisruptionBudget."""
    meta = _mapping(obj.get("metadata"), "metadata")
    spec = _mapping(obj.get("spec"), "spec")
    status = _mapping(obj.get("status"), "status")
    problems: list[str] = []
    selector = label_selector_from_object(spec.get("selector"), "spec.selector", problems)
    if problems:
        raise ObjectFormatError("; ".join(problems))
    counts = {}
    for key in ("disruptionsAllowed", "currentHealthy", "desiredHealthy"):
        value = status.get(key, 0)
        if not isinstance(value, int) or isinstance(value, bool):
            raise ObjectFormatError(f"status.{key}: expected an integer, got {value!r}")
        counts[key] = value
    return PodDisruptionBudget(
        namespace=_str(meta.get("namespace"), "metadata.namespace") or "default",
        name=_str(meta.get("name"), "metadata.name", required=True),
        selector=selector,
        disruptions_allowed=counts["disruptionsAllowed"],
        current_healthy=counts["currentHealthy"],
        desired_healthy=counts["desiredHealthy"],
        unhealthy_pod_eviction_policy=_str(
            spec.get("unhealthyPodEvictionPolicy"), "spec.unhealthyPodEvictionPolicy"
        ),
    )


def _selector_requirement(raw: Any, where: str, problems: list[str]) -> LabelRequirement | None:
    if not isinstance(raw, Mapping):
        problems.append(f"{where}: expected a mapping with key, operator and values, got {raw!r}")
        return None
    before = len(problems)
    problems.extend(
        f"{where}.{k}: unknown field (known: key, operator, values)"
        for k in raw
        if k not in ("key", "operator", "values")
    )
    key, operator, values = raw.get("key"), raw.get("operator"), raw.get("values")
    if not isinstance(key, str) or not key:
        problems.append(f"{where}.key: required, a non-empty string")
    if operator not in SELECTOR_OPERATORS:
        problems.append(
            f"{where}.operator: expected one of {', '.join(SELECTOR_OPERATORS)}, got {operator!r}"
        )
    if values is not None and (not isinstance(values, list) or not all(isinstance(v, str) for v in values)):
        problems.append(f"{where}.values: expected a list of strings (quote numbers and true/false)")
    elif operator in ("In", "NotIn") and not values:
        problems.append(f"{where}.values: required, at least one value, for operator {operator}")
    elif operator in ("Exists", "DoesNotExist") and values:
        problems.append(f"{where}.values: must be empty for operator {operator}")
    if len(problems) > before:
        return None
    return LabelRequirement(key=str(key), operator=str(operator), values=tuple(values or ()))


def label_selector_from_object(raw: Any, where: str, problems: list[str]) -> LabelSelector:
    """A label selector as Kubernetes objects write it (`{matchLabels: {...}, matchExpressions:
    [{key, operator, values}]}`; None is the empty selector) -> LabelSelector. Each problem, checked
    as the API server validates selectors, is appended to `problems` naming its field; the selector
    returned then is not to be used."""
    if raw is None:
        return LabelSelector()
    if not isinstance(raw, Mapping):
        problems.append(f"{where}: expected a mapping with matchLabels and/or matchExpressions, got {raw!r}")
        return LabelSelector()
    problems.extend(
        f"{where}.{k}: unknown field (known: matchLabels, matchExpressions)"
        for k in raw
        if k not in ("matchLabels", "matchExpressions")
    )
    labels: dict[str, str] = {}
    raw_labels = raw.get("matchLabels") or {}
    if not isinstance(raw_labels, Mapping):
        problems.append(f"{where}.matchLabels: expected a mapping of label -> value, got {raw_labels!r}")
        raw_labels = {}
    for key, value in raw_labels.items():
        if not isinstance(key, str) or not key:
            problems.append(f"{where}.matchLabels: label names must be non-empty strings, got {key!r}")
        elif not isinstance(value, str):
            problems.append(
                f"{where}.matchLabels.{key}: expected a string (quote numbers and true/false), got {value!r}"
            )
        else:
            labels[key] = value
    exprs: list[LabelRequirement] = []
    raw_exprs = raw.get("matchExpressions")
    if raw_exprs is not None and not isinstance(raw_exprs, list):
        problems.append(f"{where}.matchExpressions: expected a list, got {type(raw_exprs).__name__}")
    elif raw_exprs is not None:
        for i, item in enumerate(raw_exprs):
            req = _selector_requirement(item, f"{where}.matchExpressions[{i}]", problems)
            if req is not None:
                exprs.append(req)
    return LabelSelector(match_labels=MappingProxyType(labels), match_expressions=tuple(exprs))
