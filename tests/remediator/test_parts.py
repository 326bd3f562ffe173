"""Each part of the engine alone, handed small fakes of the narrow seams it uses (remediator/cluster.py:
NodeReads, NodeWrites, EventSink, Drains, GatesStore; Aws): what each part promises, without an
engine, a backend or a clock that moves by itself.

- the EventRecorder: an Event that cannot be written never fails the action it tells of;
- the NodeActuator: a cordon is one write that carries the episode and the phase `held`, and a node
  someone else cordoned is neither written nor claimed;
- the AwsActuator: a reboot's intent is written before EC2 is called, and a failed call is made again;
- the DrainRunner: a drain stopped (a human's uncordon) ends `stopped` for its alert, nothing after it;
- the LatchStore: a conflict reads the gates again and applies the change once more.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Callable, Collection, Mapping, Sequence
from typing import Any

import pytest

from remediator.actuators.aws import AwsActuator
from remediator.actuators.events import EventRecorder, NodeEvent
from remediator.actuators.nodes import NodeActuator
from remediator.cluster import (
    BackendUnavailable,
    DrainOutcome,
    DrainSettings,
    EvictionResult,
    Node,
    NodeCondition,
    Pod,
    PodDisruptionBudget,
    Returned,
    StateConflict,
    Taint,
)
from remediator.desired.firing import FiringSet
from remediator.gates.gates import Gates, LatchStore
from remediator.gates.safety import PauseSwitch, StormBreaker, StormSettings
from remediator.intake.payload import Alert
from remediator.lifecycle.drains import DrainRunner
from remediator.lifecycle.model import Context, RunningDrain
from remediator.lifecycle.record import RecordChange, read
from remediator.lifecycle.repair import REBOOT_PATIENCE_SECONDS
from remediator.lifecycle.view import NodeView
from remediator.policy import AwsReboot, Drain, parse_policy
from tests.remediator.conftest import FakeClock

INSTANCE = "i-0123456789abcdef0"
POLICY = parse_policy(
    "rules:\n  - {name: r, actions: [cordon, {type: drain, timeout_seconds: 60}, aws_reboot]}\n"
)


def gpu(name: str = "gpu-1", **changes: Any) -> Node:
    node = Node(name=name, accelerators=("nvidia.com/gpu",), provider_id=f"aws:///us-east-1a/{INSTANCE}")
    return dataclasses.replace(node, **changes)


def context(node: Node, *, index: int = 0, intent: int = 0) -> Context:
    alert = Alert(
        status="firing",
        labels={"alertname": "AccelGPUFatalXid", "node": node.name},
        annotations={},
        starts_at="2026-11-28T10:00:00.000Z",
        ends_at="",
        generator_url="",
        fingerprint="fp-1",
    )
    return Context(
        alert=alert,
        node_name=node.name,
        node=node,
        rule=POLICY.rules[0],
        dry_run=False,
        protected=None,
        index=index,
        intent=intent,
    )


class Nodes:
    """NodeReads and NodeWrites over a dict; every write listed in `writes`, in order."""

    def __init__(self, *nodes: Node) -> None:
        self.nodes = {n.name: n for n in nodes}
        self.writes: list[tuple[str, str, RecordChange | None]] = []

    async def get_node(self, name: str) -> Node | None:
        return self.nodes.get(name)

    async def list_nodes(self) -> list[Node]:
        return list(self.nodes.values())

    def observed_nodes(self) -> list[Node] | None:
        return list(self.nodes.values())

    def _apply(self, name: str, record: RecordChange | None, **changes: Any) -> None:
        node = self.nodes[name]
        annotations = dict(node.annotations)
        if record is not None:
            annotations.update({k: v for k, v in record.annotation(annotations).items() if v is not None})
        self.nodes[name] = dataclasses.replace(node, annotations=annotations, **changes)

    async def cordon(self, node: str, *, record: RecordChange | None = None) -> bool:
        self.writes.append(("cordon", node, record))
        if self.nodes[node].unschedulable:
            return False
        self._apply(node, record, unschedulable=True)
        return True

    async def uncordon(self, node: str, *, record: RecordChange | None = None) -> bool:
        self.writes.append(("uncordon", node, record))
        return False

    async def add_taint(self, node: str, taint: Taint, *, record: RecordChange | None = None) -> None:
        self.writes.append(("taint", node, record))

    async def remove_taint(self, node: str, taint: Taint, *, record: RecordChange | None = None) -> None:
        self.writes.append(("untaint", node, record))

    async def set_condition(
        self,
        node: str,
        condition: NodeCondition,
        *,
        record: RecordChange | None = None,
        annotations: Mapping[str, str | None] | None = None,
    ) -> None:
        self.writes.append(("condition", node, record))

    async def annotate_node(
        self, node: str, annotations: Mapping[str, str | None], *, record: RecordChange | None = None
    ) -> None:
        self.writes.append(("annotate", node, record))
        self._apply(node, record)
        merged = {**self.nodes[node].annotations, **annotations}
        kept = {k: v for k, v in merged.items() if v is not None}
        self.nodes[node] = dataclasses.replace(self.nodes[node], annotations=kept)

    async def label_node(self, node: str, labels: Mapping[str, str | None]) -> None:
        self.writes.append(("label", node, None))

    async def return_node(
        self,
        node: str,
        *,
        uid: str,
        taints: Sequence[Taint],
        annotations: Mapping[str, str | None],
        record: RecordChange | None = None,
    ) -> Returned | None:
        self.writes.append(("return", node, record))
        return Returned(found=True)

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
        self.writes.append(("startup-taint", node, None))
        return True


class Sink:
    """An EventSink; `failing` makes every write raise BackendUnavailable."""

    def __init__(self, *, failing: bool = False) -> None:
        self.failing = failing
        self.events: list[tuple[str, str]] = []

    async def record_event(self, *, node: str, reason: str, message: str, type_: str) -> None:
        if self.failing:
            raise BackendUnavailable("events: 503")
        self.events.append((node, reason))


def gates(clock: FakeClock) -> Gates:
    return Gates(policy=POLICY, clock=clock, dry_run=False)


# -- EventRecorder ---------------------------------------------------------------------------------


async def test_an_event_that_cannot_be_written_never_fails_what_it_tells_of() -> None:
    recorder = EventRecorder(sink=Sink(failing=True), mode="all", seen=lambda _key: True)
    await recorder.write("gpu-1", [NodeEvent("Normal", "AccelCordoned", "cordoned")])  # no raise
    ok = Sink()
    await EventRecorder(sink=ok, mode="all", seen=lambda _key: True).write(
        "gpu-1", [NodeEvent("Normal", "AccelCordoned", "cordoned")]
    )
    assert ok.events == [("gpu-1", "AccelCordoned")]


# -- NodeActuator -----------------------------------------------------------------------------------


def node_actuator(nodes: Nodes, clock: FakeClock) -> NodeActuator:
    view = NodeView(cluster=nodes)
    return NodeActuator(
        nodes=nodes,
        events=Sink(),
        view=view,
        gates=gates(clock),
        firing=FiringSet(clock=clock),
        draining=lambda _node: False,
        taint_values={},
        clock=clock,
    )


async def test_a_cordon_is_one_write_carrying_the_episode_and_the_phase_held() -> None:
    clock = FakeClock()
    nodes = Nodes(gpu())
    result = await node_actuator(nodes, clock).cordon(context(nodes.nodes["gpu-1"]), nodes.nodes["gpu-1"])
    assert result.outcome == "done"
    [(kind, _, record)] = nodes.writes
    assert kind == "cordon"
    assert record is not None
    assert record.phase == "held"
    assert [e.fingerprint for e in record.episodes] == ["fp-1"]
    assert read(nodes.nodes["gpu-1"].annotations).phase == "held"


async def test_a_node_someone_else_cordoned_is_not_written_nor_claimed() -> None:
    clock = FakeClock()
    nodes = Nodes(gpu(unschedulable=True))
    result = await node_actuator(nodes, clock).cordon(context(nodes.nodes["gpu-1"]), nodes.nodes["gpu-1"])
    assert (result.outcome, nodes.writes) == ("skipped", [])


# -- AwsActuator ------------------------------------------------------------------------------------


class Ec2:
    """The Aws seam: RebootInstances fails the first `failures` times; every call listed."""

    enabled = True

    def __init__(self, nodes: Nodes, *, failures: int) -> None:
        self.nodes = nodes
        self.failures = failures
        self.calls: list[tuple[str, int]] = []  # (call, node writes made before it)

    async def reboot(self, instance_id: str) -> None:
        self.calls.append(("reboot", len(self.nodes.writes)))
        if self.failures:
            self.failures -= 1
            raise BackendUnavailable("EC2: RequestLimitExceeded")

    async def health(self, instance_id: str) -> str | None:
        return "Healthy"

    async def set_unhealthy(self, instance_id: str) -> bool:
        return True

    async def put_metric(
        self, *, namespace: str, name: str, value: float, dimensions: Mapping[str, str]
    ) -> None:
        self.calls.append(("put_metric", len(self.nodes.writes)))


async def test_a_reboots_intent_is_written_before_ec2_is_called_and_a_failed_call_is_made_again() -> None:
    clock = FakeClock()
    nodes = Nodes(gpu(boot_id="boot-a"))
    ec2 = Ec2(nodes, failures=1)
    actuator = AwsActuator(aws=ec2, nodes=nodes, gates=gates(clock), clock=clock)
    action = POLICY.rules[0].actions[2]
    assert isinstance(action, AwsReboot)
    with pytest.raises(BackendUnavailable):
        await actuator.reboot(context(nodes.nodes["gpu-1"], index=2), nodes.nodes["gpu-1"], action)
    assert ec2.calls == [("reboot", 1)]  # one write (the intent) before the call
    assert "accel-health.io/rebooted" in nodes.nodes["gpu-1"].annotations
    # The redelivery finds the intent recorded (bit 2) and the same boot id: it calls again.
    again = await actuator.reboot(
        context(nodes.nodes["gpu-1"], index=2, intent=0b100), nodes.nodes["gpu-1"], action
    )
    assert again.outcome == "done"
    assert [c for c, _ in ec2.calls] == ["reboot", "reboot"]
    # A node that booted since the intent is not rebooted again.
    booted = dataclasses.replace(nodes.nodes["gpu-1"], boot_id="boot-b")
    fresh = AwsActuator(aws=ec2, nodes=nodes, gates=gates(clock), clock=clock)
    later = await fresh.reboot(context(booted, index=2, intent=0b100), booted, action)
    assert later.outcome == "done"
    assert "a new boot id since" in later.reason
    assert len(ec2.calls) == 2


async def test_a_reboot_an_earlier_leader_asked_for_is_not_asked_again_before_the_node_could_boot() -> None:
    """A fail-over between the reboot's call and the node's boot: the new leader finds the intent and
    the same boot id, as it would had the call failed, but it cannot tell; within the reboot's
    patience it waits for the boot instead of rebooting the node a second time (bench_failover
    --lifecycle saw RebootInstances twice for one episode)."""
    clock = FakeClock()
    nodes = Nodes(gpu(boot_id="boot-a"))
    ec2 = Ec2(nodes, failures=0)
    action = POLICY.rules[0].actions[2]
    assert isinstance(action, AwsReboot)
    dead = AwsActuator(aws=ec2, nodes=nodes, gates=gates(clock), clock=clock)
    first = await dead.reboot(context(nodes.nodes["gpu-1"], index=2), nodes.nodes["gpu-1"], action)
    assert first.outcome == "done"
    assert [c for c, _ in ec2.calls] == ["reboot"]
    clock.now += 10  # the leader dies; the next one takes over before the node booted
    leader = AwsActuator(aws=ec2, nodes=nodes, gates=gates(clock), clock=clock)
    node = nodes.nodes["gpu-1"]
    again = await leader.reboot(context(node, index=2, intent=0b100), node, action)
    assert [c for c, _ in ec2.calls] == ["reboot"]  # not rebooted twice
    assert again.outcome == "skipped"
    assert "waiting for it to boot" in again.reason
    # A reboot asked for that never happened (same boot id past the patience) is asked for again.
    clock.now += REBOOT_PATIENCE_SECONDS
    late = AwsActuator(aws=ec2, nodes=nodes, gates=gates(clock), clock=clock)
    assert (await late.reboot(context(node, index=2, intent=0b100), node, action)).outcome == "done"
    assert [c for c, _ in ec2.calls] == ["reboot", "reboot"]


# -- DrainRunner ------------------------------------------------------------------------------------


class SlowDrains:
    """The Drains seam: a drain runs until cancelled."""

    def __init__(self) -> None:
        self.started = asyncio.Event()

    async def list_pods(self, node: str) -> list[Pod]:
        return []

    async def list_pdbs(self) -> list[PodDisruptionBudget]:
        return []

    async def daemonsets_exist(self, refs: Collection[tuple[str, str]]) -> set[tuple[str, str]] | None:
        return None

    async def evict_pod(
        self, *, namespace: str, name: str, grace_period_seconds: int | None
    ) -> EvictionResult:
        return EvictionResult.EVICTED

    async def start_drain(
        self, node: str, settings: DrainSettings, *, record: RecordChange | None = None
    ) -> None:
        return None

    async def drain(
        self,
        node: str,
        settings: DrainSettings,
        *,
        ended: Callable[[DrainOutcome], RecordChange | None] | None = None,
    ) -> DrainOutcome:
        self.started.set()
        await asyncio.Event().wait()  # until cancelled
        raise AssertionError("unreachable")


async def test_a_drain_stopped_by_a_humans_uncordon_ends_stopped_for_its_alert() -> None:
    clock = FakeClock()
    drains = SlowDrains()
    nodes = Nodes(gpu())
    ended: list[tuple[str, bool, str]] = []

    async def on_end(running: RunningDrain, outcome: DrainOutcome | None, error: str, final: bool) -> None:
        ended.append((running.stopped, final, error))

    @contextlib.asynccontextmanager
    async def no_lock(node: str) -> AsyncIterator[None]:
        del node
        yield

    runner = DrainRunner(
        cluster=drains,
        gates=gates(clock),
        view=NodeView(cluster=nodes),
        settings=DrainSettings(),
        clock=clock,
        lock=no_lock,
    )
    runner.on_end = on_end
    action = POLICY.rules[0].actions[1]
    assert isinstance(action, Drain)
    result = await runner.start(context(nodes.nodes["gpu-1"], index=1), nodes.nodes["gpu-1"], action)
    assert result.outcome == "started"
    await drains.started.wait()
    assert runner.stop_node("gpu-1", "the node was uncordoned by someone else")
    await runner.wait()
    assert ended == [
        ("the node was uncordoned by someone else", True, "the node was uncordoned by someone else")
    ]
    assert "gpu-1" not in runner.running


# -- LatchStore -------------------------------------------------------------------------------------


class Conflicting:
    """The GatesStore: the first save meets another writer's document (StateConflict)."""

    def __init__(self, theirs: Mapping[str, Any]) -> None:
        self.theirs = dict(theirs)
        self.saved: list[Mapping[str, Any]] = []
        self.conflicts = 1

    async def load_gates(self) -> Mapping[str, Any] | None:
        return self.theirs

    async def save_gates(self, document: Mapping[str, Any]) -> None:
        if self.conflicts:
            self.conflicts -= 1
            raise StateConflict("409 the object has been modified")
        self.saved.append(document)

    async def load_legacy_state(self) -> Mapping[str, Any] | None:
        return None

    async def delete_legacy_state(self) -> None:
        return None


async def test_a_conflict_reads_the_gates_again_and_applies_the_change_once_more() -> None:
    clock = FakeClock()
    pause, breaker = PauseSwitch(clock=clock), StormBreaker(settings=StormSettings(), clock=clock)
    theirs = {
        "version": 2,
        "pause": {"paused": False, "since": 0.0, "reason": ""},
        "breaker": {"open": True, "opened_at": clock.now, "trips": 3},
    }
    store = Conflicting(theirs)
    latches = LatchStore(store=store, clock=clock)

    def pause_it(p: PauseSwitch, _b: StormBreaker) -> None:
        p.pause("rack maintenance")

    pause_it(pause, breaker)
    await latches.save(pause, breaker, reapply=pause_it)
    [saved] = store.saved
    assert saved["pause"]["paused"] is True  # our change, applied again after the re-read
    assert saved["breaker"]["open"] is True  # theirs kept: an open latch stays open
    assert saved["breaker"]["trips"] == 3
