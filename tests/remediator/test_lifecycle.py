"""A node's lifecycle from the first fault back to the pool, on the in-memory cluster (the same
scenarios on the real API server are in tests/kube/test_lifecycle.py). Each test interrupts one
node's life once, the way issue 34 found them going wrong:

- a human's uncordon (or taint removal) ends the node's remediation for its current episodes: the
  running drain stops (`stopped`), later steps never run, the budget slot is free at once, the node
  is not cordoned again for those episodes, and a new episode starts afresh;
- a node held by a `taint` rule comes back with its taint gone (the exact value), its record and
  its drain and ownership annotations removed;
- a drain left `in-progress` by a previous leader is resumed with the rule its episode recorded (no
  Alertmanager needed), or ended when its alerts no longer fire; it never holds a budget slot on a
  node a human uncordoned;
- telemetry (CloudWatch) never blocks the cordon;
- a reboot whose EC2 call failed is asked for again on the next delivery;
- a fault that fires at the moment of the return stops it;
- a node's phase moves as the table in docs/remediator.md says, written by the write that moves it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from remediator.cluster import (
    BackendUnavailable,
    DrainOutcome,
    DrainSettings,
    Node,
    NotLeader,
    OwnerReference,
    Pod,
)
from remediator.desired.alertmanager import AlertmanagerView
from remediator.executors.snapshot import AwsOff, RecordingAws, SnapshotCluster
from remediator.intake.payload import WebhookPayload, parse_payload
from remediator.lifecycle import steps
from remediator.lifecycle.engine import Engine
from remediator.lifecycle.model import EngineSettings
from remediator.lifecycle.phases import PHASES
from remediator.lifecycle.record import (
    CORDONED_BY,
    DRAIN_STATUS,
    EPISODES,
    TAINTS_ADDED,
    Episode,
    NodeRecord,
    RecordChange,
    moves_forward,
    read,
)
from remediator.lifecycle.repair import QUARANTINE, RepairLoop, Verification
from remediator.policy import parse_policy
from tests.remediator.conftest import FakeClock

INSTANCE = "i-0123456789abcdef0"

POLICY = """
safety: {max_disrupted_nodes: 1}
repair: {checks: [remapped], escalate_after: 5, window_seconds: 1000}
rules:
  - name: drain
    match: ['remediation="drain"']
    actions:
      - {type: condition, condition_type: AcceleratorHealthy}
      - cordon
      - {type: drain, timeout_seconds: 600}
      - aws_set_unhealthy
  - name: taint
    match: ['remediation="taint"']
    actions:
      - {type: condition, condition_type: AcceleratorHealthy}
      - {type: taint, key: accel-health.io/unhealthy, value: "true", effect: NoSchedule}
  - name: cordon
    match: ['remediation="cordon"']
    actions:
      - {type: condition, condition_type: AcceleratorHealthy}
      - cordon
  - name: metric-first
    match: ['remediation="metric"']
    actions:
      - {type: cloudwatch_metric, namespace: AccelHealth, metric_name: NodeFaults}
      - cordon
  - name: reboot
    match: ['remediation="reboot"']
    actions:
      - cordon
      - {type: aws_reboot, replace_after_reboot_seconds: 86400}
"""


def alert(
    node: str,
    *,
    remediation: str = "drain",
    fingerprint: str = "fp-1",
    starts: str = "2026-11-28T10:00:00Z",
    status: str = "firing",
) -> WebhookPayload:
    return parse_payload(
        {
            "version": "4",
            "status": status,
            "alerts": [
                {
                    "status": status,
                    "labels": {"alertname": "AccelGPUFatalXid", "node": node, "remediation": remediation},
                    "startsAt": starts,
                    "fingerprint": fingerprint,
                }
            ],
        }
    )


def gpu(name: str, *, boot: str = "boot-a") -> Node:
    return Node(
        name=name,
        accelerators=("nvidia.com/gpu",),
        provider_id=f"aws:///us-east-1a/{INSTANCE}",
        boot_id=boot,
        uid=f"uid-{name}",
    )


def work_pod(node: str, name: str = "train-0") -> Pod:
    return Pod(
        namespace="work",
        name=name,
        node_name=node,
        owners=(OwnerReference(kind="ReplicaSet", name="train", controller=True),),
    )


class HeldDrains(SnapshotCluster):
    """A snapshot whose drains run until the test ends them (a drain that takes its time)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.draining: dict[str, asyncio.Event] = {}
        self.finish = asyncio.Event()

    async def drain(
        self,
        node: str,
        settings: DrainSettings,
        *,
        ended: Callable[[DrainOutcome], RecordChange | None] | None = None,
    ) -> DrainOutcome:
        self.draining.setdefault(node, asyncio.Event()).set()
        await self.finish.wait()
        return await super().drain(node, settings, ended=ended)


class FlakyAws(RecordingAws):
    """AWS whose chosen calls fail (BackendUnavailable) the first `times` times."""

    def __init__(self, *, failing: str, times: int = 1) -> None:
        super().__init__()
        self.failing = failing
        self.left = times

    def _maybe_fail(self, operation: str) -> None:
        if operation == self.failing and self.left > 0:
            self.left -= 1
            raise BackendUnavailable(f"AWS {operation}: ThrottlingException (rate exceeded)")

    async def put_metric(self, *, namespace: str, name: str, value: float, dimensions: Any) -> None:
        self._maybe_fail("put_metric")
        await super().put_metric(namespace=namespace, name=name, value=value, dimensions=dimensions)

    async def reboot(self, instance_id: str) -> None:
        self._maybe_fail("reboot")
        await super().reboot(instance_id)


def engine_on(cluster: SnapshotCluster, *, aws: RecordingAws | None = None, clock: Any = None) -> Engine:
    return Engine(
        policy=parse_policy(POLICY),
        cluster=cluster,
        aws=aws or RecordingAws(),
        settings=EngineSettings(),
        clock=clock or FakeClock(),
    )


def decisions(engine: Engine, node: str = "gpu-1") -> list[tuple[str, str]]:
    return [(r.action, r.outcome) for r in engine.log.records() if r.node == node]


def cordoned(cluster: SnapshotCluster, node: str) -> bool:
    return cluster.nodes[node].unschedulable


def record_of(cluster: SnapshotCluster, node: str = "gpu-1") -> NodeRecord:
    return read(cluster.nodes[node].annotations)


def events(cluster: SnapshotCluster, reason: str) -> list[dict[str, str]]:
    return [e for e in cluster.events if e["reason"] == reason]


async def settled(engine: Engine) -> None:
    """Until the background work (the node queue, drains) has ended."""
    for _ in range(3):
        await engine.queue.idle()
        await engine.drained()
        await asyncio.sleep(0)


# -- a human wins --------------------------------------------------------------------------------


async def test_a_humans_uncordon_ends_the_episode_and_frees_the_budget_at_once() -> None:
    cluster = SnapshotCluster(
        nodes=[gpu("gpu-1"), gpu("gpu-2")] + [gpu(f"n{i}") for i in range(8)], pods=[], pdbs=[]
    )
    engine = engine_on(cluster)
    await engine.handle(alert("gpu-1", remediation="cordon"))
    assert cordoned(cluster, "gpu-1")
    assert engine.gates.budget.in_use == 1
    cluster.change_node("gpu-1", unschedulable=False)  # kubectl uncordon
    await settled(engine)
    assert engine.gates.budget.in_use == 0  # from the watch, before any delivery
    node = cluster.nodes["gpu-1"]
    assert CORDONED_BY not in node.annotations
    record = record_of(cluster)
    assert record.phase == "released"
    assert all(e.released for e in record.episodes.values())
    assert len(events(cluster, "AccelReleasedByHuman")) == 1
    assert decisions(engine)[-1] == ("release", "done")
    # The same episode resent: not cordoned again, nothing decided again.
    before = len(engine.log)
    await engine.handle(alert("gpu-1", remediation="cordon"))
    assert not cordoned(cluster, "gpu-1")
    assert len(engine.log) == before
    # Another node may take the slot the human gave back.
    await engine.handle(alert("gpu-2", remediation="cordon", fingerprint="fp-2"))
    assert cordoned(cluster, "gpu-2")
    # A new episode of the first alert starts afresh.
    await engine.handle(alert("gpu-2", remediation="cordon", fingerprint="fp-2", status="resolved"))
    cluster.change_node("gpu-2", unschedulable=False)
    await settled(engine)
    await engine.handle(alert("gpu-1", remediation="cordon", starts="2026-11-28T11:00:00Z"))
    assert cordoned(cluster, "gpu-1")
    assert record_of(cluster).phase == "held"


async def test_a_humans_uncordon_mid_drain_stops_it_and_nothing_after_it_runs() -> None:
    nodes = [gpu("gpu-1")] + [gpu(f"n{i}") for i in range(8)]
    cluster = HeldDrains(nodes=nodes, pods=[work_pod("gpu-1")], pdbs=[])
    aws = RecordingAws()
    engine = engine_on(cluster, aws=aws)
    await engine.handle(alert("gpu-1"))
    await cluster.draining.setdefault("gpu-1", asyncio.Event()).wait()
    assert record_of(cluster).phase == "draining"
    cluster.change_node("gpu-1", unschedulable=False)
    await settled(engine)
    assert "gpu-1" not in engine.drains.running
    assert cluster.nodes["gpu-1"].annotations[DRAIN_STATUS] == "stopped"
    assert ("drain", "stopped") in decisions(engine)
    assert ("aws_set_unhealthy", "skipped") in decisions(engine)
    assert aws.calls == []  # the instance is never marked for replacement
    assert cluster.pods  # the pod the drain had not evicted yet stays
    assert engine.gates.budget.in_use == 0
    cluster.finish.set()
    await settled(engine)
    assert not cordoned(cluster, "gpu-1")  # a deferred drain never re-cordons it
    await engine.handle(alert("gpu-1"))  # the episode resent
    await settled(engine)
    assert not cordoned(cluster, "gpu-1")
    assert aws.calls == []


class LostLead(SnapshotCluster):
    """A replica whose Lease went to another one: its node writes are refused."""

    lead = True

    async def annotate_node(self, node: str, annotations: Any, *, record: Any = None) -> None:
        if not self.lead:
            raise NotLeader("not the leader; refusing to annotate")
        await super().annotate_node(node, annotations, record=record)


async def test_a_replica_that_does_not_lead_leaves_a_node_for_later_without_an_error() -> None:
    """The watch queues a human's uncordon on every replica; one that lost the lead (or whose renewal
    runs late) is refused the release write: not an error, looked at again later, quietly."""
    cluster = LostLead(nodes=[gpu("gpu-1")] + [gpu(f"n{i}") for i in range(8)], pods=[], pdbs=[])
    engine = engine_on(cluster)
    await engine.handle(alert("gpu-1", remediation="cordon"))
    cluster.lead = False
    cluster.change_node("gpu-1", unschedulable=False)  # kubectl uncordon
    await settled(engine)
    assert engine.queue.failures == 0
    assert engine.queue.deferred == 1  # looked at, left for later
    assert CORDONED_BY in cluster.nodes["gpu-1"].annotations  # the leader writes the release
    await engine.queue.stop()


async def test_a_taint_removed_by_someone_else_releases_the_node() -> None:
    cluster = SnapshotCluster(nodes=[gpu("gpu-1")] + [gpu(f"n{i}") for i in range(8)], pods=[], pdbs=[])
    engine = engine_on(cluster)
    await engine.handle(alert("gpu-1", remediation="taint"))
    assert engine.gates.budget.in_use == 1
    cluster.change_node("gpu-1", taints=())
    await settled(engine)
    assert engine.gates.budget.in_use == 0
    assert TAINTS_ADDED not in cluster.nodes["gpu-1"].annotations
    assert record_of(cluster).phase == "released"
    await engine.handle(alert("gpu-1", remediation="taint"))
    assert cluster.nodes["gpu-1"].taints == ()  # not tainted again for this episode


# -- the way back ---------------------------------------------------------------------------------


def repair_loop(engine: Engine, cluster: SnapshotCluster, clock: FakeClock) -> RepairLoop:
    class Passing:
        async def verify(self, node: str, checks: Sequence[str]) -> Verification:
            return Verification("pass")

    return RepairLoop(
        policy=engine.policy,
        cluster=cluster,
        verifier=Passing(),
        firing=engine.causes,
        publish=engine.publish,
        clock=clock,
        node_lock=engine.queue.lock,
    )


async def test_a_taint_rule_node_is_returned_without_its_taint_or_any_of_the_services_marks() -> None:
    clock = FakeClock()
    cluster = SnapshotCluster(nodes=[gpu("gpu-1")] + [gpu(f"n{i}") for i in range(8)], pods=[], pdbs=[])
    engine = engine_on(cluster, clock=clock)
    loop = repair_loop(engine, cluster, clock)
    await engine.handle(alert("gpu-1", remediation="taint"))
    await loop.reconcile()
    assert cluster.nodes["gpu-1"].taints[0].value == "true"
    cluster.rebooted("gpu-1", "boot-b")
    await engine.handle(alert("gpu-1", remediation="taint", status="resolved"))
    await settled(engine)
    records = await loop.reconcile()
    assert [(r.action, r.outcome) for r in records] == [("return_to_pool", "done")]
    node = cluster.nodes["gpu-1"]
    assert node.taints == ()
    assert not any(
        k.startswith("accel-health.io/") and k != "accel-health.io/quarantine-history"
        for k in node.annotations
    )
    assert [c.status for c in node.conditions if c.type == "AcceleratorHealthy"] == ["True"]
    assert "taint accel-health.io/unhealthy:NoSchedule removed" in records[0].reason
    await engine.refresh()
    assert engine.gates.budget.in_use == 0


async def test_a_fault_firing_at_the_moment_of_the_return_stops_it() -> None:
    clock = FakeClock()
    cluster = SnapshotCluster(nodes=[gpu("gpu-1")] + [gpu(f"n{i}") for i in range(8)], pods=[], pdbs=[])
    engine = engine_on(cluster, clock=clock)

    class DeliveryDuringChecks:
        """The verification is where a second fault arrives (a delivery for the same node)."""

        async def verify(self, node: str, checks: Sequence[str]) -> Verification:
            await engine.handle(alert("gpu-1", remediation="cordon", fingerprint="fp-new"))
            return Verification("pass")

    loop = RepairLoop(
        policy=engine.policy,
        cluster=cluster,
        verifier=DeliveryDuringChecks(),
        firing=engine.causes,
        publish=engine.publish,
        clock=clock,
        node_lock=engine.queue.lock,
    )
    await engine.handle(alert("gpu-1", remediation="cordon"))
    await loop.reconcile()
    cluster.rebooted("gpu-1", "boot-b")
    await engine.handle(alert("gpu-1", remediation="cordon", status="resolved"))
    records = await loop.reconcile()
    assert [(r.action, r.outcome) for r in records] == [("return_to_pool", "skipped")]
    assert "fires on the node now" in records[0].reason
    assert cordoned(cluster, "gpu-1")
    assert QUARANTINE in cluster.nodes["gpu-1"].annotations


# -- a drain nobody runs --------------------------------------------------------------------------


def left_draining(*, episodes: int = 1) -> tuple[SnapshotCluster, Engine]:
    """A node a previous leader cordoned and started draining (for `episodes` alerts), then died; a
    new engine over it."""
    started = tuple(
        Episode(
            fingerprint=f"fp-{i + 1}",
            rule="drain",
            alertname="AccelGPUFatalXid",
            start=1_795_860_000,
            steps=0b011,
        )
        for i in range(episodes)
    )
    record = RecordChange(episodes=started, kind="drain", at=1_795_860_000, phase="draining").apply(
        NodeRecord()
    )
    node = gpu("gpu-1")
    annotations = {
        CORDONED_BY: "accel-health-remediator",
        DRAIN_STATUS: "in-progress",
        "accel-health.io/drain-deadline": "2099-01-01T00:00:00Z",
        EPISODES: record.encode() or "",
    }
    node = Node(**{**node.__dict__, "unschedulable": True, "annotations": annotations})
    cluster = SnapshotCluster(
        nodes=[node] + [gpu(f"n{i}") for i in range(8)], pods=[work_pod("gpu-1")], pdbs=[]
    )
    return cluster, engine_on(cluster)


async def test_a_drain_left_running_is_resumed_with_its_recorded_rule_without_alertmanager() -> None:
    cluster, engine = left_draining()
    await engine.sync()
    await settled(engine)
    assert ("drain", "started") in decisions(engine)
    assert ("drain", "done") in decisions(engine)
    assert not cluster.pods
    assert cluster.nodes["gpu-1"].annotations[DRAIN_STATUS] == "done"


async def test_a_node_queued_before_a_new_leaders_rebuild_is_reconciled_after_it() -> None:
    """The watch queues the node the moment this replica becomes leader, before its rebuild: the
    drain left running is resumed for the episode the rebuild finds, not ended for want of one."""
    cluster, engine = left_draining()
    engine.became_leader()
    engine.queue.add("gpu-1")  # no sync() yet: the worker runs first
    await settled(engine)
    assert ("drain", "stopped") not in decisions(engine)
    assert ("drain", "started") in decisions(engine)
    assert cluster.nodes["gpu-1"].annotations[DRAIN_STATUS] == "done"


async def test_a_drain_a_previous_leader_started_is_not_told_started_again_when_it_is_resumed() -> None:
    """The drain's start was told (AccelDrainStarted, with AccelFaultDetected before it) by the leader
    that started it; the next leader tells only its end (bench_failover --lifecycle: both twice)."""
    cluster, engine = left_draining()
    await engine.sync()
    await settled(engine)
    assert ("drain", "started") in decisions(engine)
    assert [e["reason"] for e in cluster.events] == ["AccelDrainFinished", "AccelInstanceMarkedUnhealthy"]


async def test_an_episode_that_joined_a_drain_before_a_fail_over_is_not_told_it_started_again() -> None:
    cluster, engine = left_draining(episodes=2)
    await engine.sync()
    await settled(engine)
    assert [(a, o) for a, o in decisions(engine) if a == "drain"].count(("drain", "started")) == 2
    assert "AccelDrainStarted" not in [e["reason"] for e in cluster.events]
    assert "AccelFaultDetected" not in [e["reason"] for e in cluster.events]


async def test_a_drain_whose_alert_resolved_meanwhile_is_ended_and_holds_no_slot_after_an_uncordon() -> None:
    cluster, engine = left_draining()

    async def nothing_fires() -> AlertmanagerView:
        return AlertmanagerView(alerts={}, reached=("http://alertmanager",))

    engine.alertmanager = nothing_fires  # the alert resolved before the new leader's first read
    await engine.sync()
    await settled(engine)
    assert cluster.nodes["gpu-1"].annotations[DRAIN_STATUS] == "stopped"
    assert ("drain", "stopped") in decisions(engine)
    assert cluster.pods  # nothing evicted for an alert that no longer fires
    assert engine.gates.budget.in_use == 1  # the cordon holds it until its repair
    cluster.change_node("gpu-1", unschedulable=False)
    await settled(engine)
    await engine.refresh()
    assert engine.gates.budget.in_use == 0


# -- many deferred actions -----------------------------------------------------------------------


async def test_deferrals_past_the_cap_are_not_remembered_and_those_remembered_are_not_churned(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """More deferred actions than room, deferred again in the same order at every read: those
    remembered keep their place and their record, the others are counted, not recorded each time
    (forgetting the oldest made every deferral of every read a new record and a log line)."""
    monkeypatch.setattr(steps, "MAX_PENDING", 3)
    cluster = SnapshotCluster(nodes=[gpu(f"n{i}") for i in range(8)], pods=[], pdbs=[])
    engine = engine_on(cluster)
    await engine.handle(alert("n0", fingerprint="fp-0"))  # cordoned; its later steps and every
    # other node's wait on the gates (the budget's one slot, then the breaker: 7 of 8 nodes alerting)
    faults = tuple(a for i in range(1, 7) for a in alert(f"n{i}", fingerprint=f"fp-{i}").alerts)
    for _ in range(3):  # three reads of Alertmanager showing the same six faults
        await engine.handle(dataclasses.replace(alert("n1"), alerts=faults))
    deferred = [r for r in engine.log.records() if r.outcome == "deferred"]
    assert len(engine.reconciler.pending) == 3
    assert len(deferred) == 3  # one record each for the three remembered, none again
    assert engine.reconciler.pending_overflow > 0
    assert cordoned(cluster, "n0")
    assert not any(cordoned(cluster, f"n{i}") for i in range(1, 7))


# -- telemetry, AWS intents -----------------------------------------------------------------------


async def test_cloudwatch_down_does_not_block_the_cordon() -> None:
    cluster = SnapshotCluster(nodes=[gpu("gpu-1")] + [gpu(f"n{i}") for i in range(8)], pods=[], pdbs=[])
    engine = engine_on(cluster, aws=FlakyAws(failing="put_metric", times=100))
    await engine.handle(alert("gpu-1", remediation="metric"))
    assert decisions(engine) == [("cloudwatch_metric", "failed"), ("cordon", "done")]
    assert cordoned(cluster, "gpu-1")


async def test_a_reboot_whose_call_failed_is_asked_for_again() -> None:
    cluster = SnapshotCluster(nodes=[gpu("gpu-1")] + [gpu(f"n{i}") for i in range(8)], pods=[], pdbs=[])
    aws = FlakyAws(failing="reboot", times=1)
    engine = engine_on(cluster, aws=aws)
    with pytest.raises(BackendUnavailable):
        await engine.handle(alert("gpu-1", remediation="reboot"))  # the webhook answers 503
    assert "accel-health.io/rebooted" in cluster.nodes["gpu-1"].annotations  # the intent came first
    assert aws.calls == []
    await engine.handle(alert("gpu-1", remediation="reboot"))  # Alertmanager retries
    assert [op for op, _ in aws.calls] == ["RebootInstances"]
    assert decisions(engine)[-1] == ("aws_reboot", "done")
    await engine.handle(alert("gpu-1", remediation="reboot"))  # and once more: nothing again
    assert [op for op, _ in aws.calls] == ["RebootInstances"]
    assert record_of(cluster).phase == "repair"


async def test_a_new_leader_before_the_node_booted_neither_reboots_it_again_nor_tells_the_fault_again() -> (
    None
):
    """A fail-over after the reboot's call, before the node booted (bench_failover --lifecycle: a
    second RebootInstances, AccelFaultDetected and AccelInstanceRebooted for one episode)."""
    cluster = SnapshotCluster(nodes=[gpu("gpu-1")] + [gpu(f"n{i}") for i in range(8)], pods=[], pdbs=[])
    aws = RecordingAws()
    clock = FakeClock()
    await engine_on(cluster, aws=aws, clock=clock).handle(alert("gpu-1", remediation="reboot"))
    assert [op for op, _ in aws.calls] == ["RebootInstances"]
    told = [e["reason"] for e in cluster.events]
    assert told == ["AccelFaultDetected", "AccelInstanceRebooted"]
    clock.now += 10  # the leader dies; the next one reads the same node, not booted yet
    leader = engine_on(cluster, aws=aws, clock=clock)
    await leader.handle(alert("gpu-1", remediation="reboot"))  # Alertmanager's resend
    assert [op for op, _ in aws.calls] == ["RebootInstances"]
    assert [e["reason"] for e in cluster.events] == told
    cluster.rebooted("gpu-1", "boot-b")
    clock.now += 10  # and the next leader, after the node booted
    await engine_on(cluster, aws=aws, clock=clock).handle(alert("gpu-1", remediation="reboot"))
    assert [op for op, _ in aws.calls] == ["RebootInstances"]
    assert [e["reason"] for e in cluster.events] == told


async def test_a_new_leader_does_not_tell_again_an_instance_marked_unhealthy_before() -> None:
    cluster = SnapshotCluster(nodes=[gpu("gpu-1")] + [gpu(f"n{i}") for i in range(8)], pods=[], pdbs=[])
    aws = RecordingAws()
    dead = engine_on(cluster, aws=aws)
    await dead.handle(alert("gpu-1"))
    await settled(dead)
    assert [op for op, _ in aws.calls] == ["SetInstanceHealth"]
    told = [e["reason"] for e in cluster.events]
    assert told[-1] == "AccelInstanceMarkedUnhealthy"
    leader = engine_on(cluster, aws=aws)  # after a fail-over: the intent on the record, the instance
    await leader.handle(alert("gpu-1"))  # Unhealthy already
    await settled(leader)
    assert [op for op, _ in aws.calls] == ["SetInstanceHealth"]
    assert ("aws_set_unhealthy", "done") in decisions(leader)
    assert [e["reason"] for e in cluster.events] == told


# -- phases ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("current", "asked", "force", "after"),
    [
        ("", "held", False, "held"),
        ("held", "evidence", False, "evidence"),
        ("held", "draining", False, "draining"),
        ("draining", "held", False, "draining"),  # a second alert's cordon does not move it back
        ("draining", "repair", False, "repair"),
        ("draining", "escalated", False, "escalated"),
        ("repair", "verifying", False, "verifying"),
        ("verifying", "repair", True, "repair"),  # a failed check: back to waiting for a repair
        ("escalated", "held", False, "escalated"),  # a human has it
        ("held", "released", True, "released"),
        ("released", "held", False, "held"),  # a new episode starts afresh
    ],
)
def test_a_phase_moves_only_as_the_lifecycle_says(current: str, asked: str, force: bool, after: str) -> None:
    start = NodeRecord(episodes={"fp": Episode("fp", "r", "A", 1)}, phase=current, since=1 if current else 0)
    changed = RecordChange(phase=asked, force=force, at=2).apply(start)
    assert changed.phase == after
    assert changed.since == (2 if after != current else start.since)
    assert moves_forward(current, asked) or force or after == current


def test_a_phase_is_kept_in_the_record_and_read_back() -> None:
    episode = Episode("fp", "drain", "AccelGPUFatalXid", 1_795_860_000, 0b11, released=True)
    record = NodeRecord(episodes={"fp": episode}, times={"cordon": 5}, phase="released", since=7)
    text = record.encode()
    assert text is not None
    assert json.loads(text)["p"] == ["released", 7]
    assert read({EPISODES: text}) == record


async def test_a_dry_run_without_aws_says_it_would_skip_what_an_enforcing_run_skips() -> None:
    nodes = [gpu("gpu-1")] + [gpu(f"n{i}") for i in range(8)]
    results = {}
    for dry_run in (True, False):
        cluster = SnapshotCluster(nodes=list(nodes), pods=[], pdbs=[])
        engine = Engine(
            policy=parse_policy(POLICY),
            cluster=cluster,
            aws=AwsOff(),  # the service runs without --aws
            settings=EngineSettings(dry_run=dry_run),
            clock=FakeClock(),
        )
        await engine.handle(alert("gpu-1", remediation="reboot"))
        [reboot] = [r for r in engine.log.records() if r.action == "aws_reboot"]
        results[dry_run] = (reboot.outcome, reboot.reason)
    assert results[False][0] == results[True][0] == "skipped"
    assert results[True][1] == "would skip: " + results[False][1]
    assert "AWS calls are off" in results[False][1]


def test_the_readme_lifecycle_table_is_the_one_the_code_runs() -> None:
    page = Path(__file__).resolve().parents[2] / "docs" / "remediator.md"
    readme = page.read_text(encoding="utf-8")
    for phase in PHASES:
        row = (
            f"| `{phase.name}` | {phase.meaning} | {phase.entered_by} | {phase.event} | {phase.leaves_when} |"
        )
        assert row in readme, f"docs/remediator.md's lifecycle table lacks (or alters) {phase.name}'s row"
