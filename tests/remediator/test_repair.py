"""The repair loop's decisions on the in-memory cluster, and the AWS reboot step (pure).

The loop runs over the snapshot backend with an injected clock and a scripted verifier (the checks'
own HTTP path is covered on the real API server in tests/kube/test_repair.py). Covered: dry-run plans
and changes nothing; a node that has not answered its checks yet is tried again, not failed; an old
quarantine leaves the window and does not count towards escalation; a condition set back by someone
else ends the quarantine untouched; a rule's `verify` picks the checks; `reboot_step` reboots, waits
for the reboot it asked for, asks again when it never happened, and escalates a fault that comes back.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from remediator.audit import DecisionRecord
from remediator.cluster import Node, NodeCondition
from remediator.desired import Cause
from remediator.executors.snapshot import SnapshotCluster
from remediator.policy import AwsReboot, parse_policy
from remediator.record import CORDONED_BY, MANAGER
from remediator.repair import (
    HISTORY,
    QUARANTINE,
    REBOOTED,
    ExporterChecks,
    RepairLoop,
    Verification,
    reboot_step,
)
from tests.remediator.conftest import FakeClock

POLICY = """
repair: {checks: [remapped], escalate_after: 2, window_seconds: 1000}
rules:
  - name: bus
    match: ['alertname="AccelGPUFellOffBus"']
    verify: [pciebw, power]
    actions: [{type: condition, condition_type: AcceleratorHealthy}, cordon]
  - name: other
    match: []
    actions: [{type: condition, condition_type: AcceleratorHealthy}, cordon]
"""


class ScriptedVerifier:
    """Answers from a list, one per call, and remembers what it was asked."""

    def __init__(self, *answers: Verification) -> None:
        self.answers = list(answers)
        self.asked: list[tuple[str, tuple[str, ...]]] = []

    async def verify(self, node: str, checks: Sequence[str]) -> Verification:
        self.asked.append((node, tuple(checks)))
        return self.answers.pop(0)


def out_node(name: str = "gpu-1", *, boot: str = "boot-a", annotations: dict[str, str] | None = None) -> Node:
    return Node(
        name=name,
        unschedulable=True,
        conditions=(NodeCondition("AcceleratorHealthy", "False", "AccelGPUFellOffBus"),),
        accelerators=("nvidia.com/gpu",),
        annotations={CORDONED_BY: MANAGER, **(annotations or {})},  # cordoned by this service
        boot_id=boot,
        uid="uid-1",
    )


def loop_over(
    cluster: SnapshotCluster,
    verifier: ScriptedVerifier,
    clock: FakeClock,
    *,
    firing: Sequence[Cause] = (),
    dry_run: bool = False,
) -> tuple[RepairLoop, list[DecisionRecord]]:
    records: list[DecisionRecord] = []
    loop = RepairLoop(
        policy=parse_policy(POLICY),
        cluster=cluster,
        verifier=verifier,
        firing=lambda _node: list(firing),
        publish=records.append,
        clock=clock,
        dry_run=dry_run,
    )
    return loop, records


def cause(rule: str = "bus") -> Cause:
    return Cause("fp", "AccelGPUFellOffBus", rule, frozenset({"cordon"}), 0.0)


async def test_a_dry_run_plans_the_return_and_changes_nothing() -> None:
    quarantine = json.dumps({"bootID": "boot-a", "uid": "uid-1", "rules": ["bus"], "alerts": ["X"]})
    cluster = SnapshotCluster(
        nodes=[out_node(boot="boot-b", annotations={QUARANTINE: quarantine})], pods=[], pdbs=[]
    )
    verifier = ScriptedVerifier(Verification("pass"))
    loop, records = loop_over(cluster, verifier, FakeClock(), dry_run=True)
    await loop.reconcile()
    await loop.reconcile()  # nothing was written, yet the plan is not repeated nor the checks run again
    assert len(verifier.asked) == 1
    assert cluster.mutations == []
    assert [(r.action, r.outcome, r.dry_run) for r in records] == [("return_to_pool", "planned", True)]
    assert records[0].reason.startswith("would: the node rebooted (new boot id); checks pciebw, power passed")


async def test_a_node_that_does_not_answer_its_checks_yet_is_tried_again_not_failed() -> None:
    quarantine = json.dumps({"bootID": "boot-a", "rules": ["other"], "alerts": ["X"]})
    cluster = SnapshotCluster(
        nodes=[out_node(boot="boot-b", annotations={QUARANTINE: quarantine})], pods=[], pdbs=[]
    )
    verifier = ScriptedVerifier(Verification("error", error="connection refused"), Verification("pass"))
    loop, records = loop_over(cluster, verifier, FakeClock())
    assert await loop.reconcile() == []
    assert cluster.nodes["gpu-1"].unschedulable
    assert cluster.mutations == []
    await loop.reconcile()
    assert verifier.asked == [("gpu-1", ("remapped",)), ("gpu-1", ("remapped",))]  # repair.checks
    assert [(r.action, r.outcome) for r in records] == [("return_to_pool", "done")]
    node = cluster.nodes["gpu-1"]
    assert not node.unschedulable
    assert QUARANTINE not in node.annotations
    assert ("AcceleratorHealthy", "True", "RepairVerified") in [
        (c.type, c.status, c.reason) for c in node.conditions
    ]


async def test_a_node_still_firing_is_not_verified_even_after_a_reboot() -> None:
    quarantine = json.dumps({"bootID": "boot-a", "rules": ["bus"], "alerts": ["X"]})
    cluster = SnapshotCluster(
        nodes=[out_node(boot="boot-b", annotations={QUARANTINE: quarantine})], pods=[], pdbs=[]
    )
    verifier = ScriptedVerifier()
    loop, records = loop_over(cluster, verifier, FakeClock(), firing=[cause()])
    await loop.reconcile()
    assert (verifier.asked, records, cluster.mutations) == ([], [], [])


async def test_quarantines_older_than_the_window_do_not_count_towards_escalation() -> None:
    clock = FakeClock(10_000.0)
    history = json.dumps([clock.now - 1500])  # outside the 1000 s window
    cluster = SnapshotCluster(nodes=[out_node(annotations={HISTORY: history})], pods=[], pdbs=[])
    loop, records = loop_over(cluster, ScriptedVerifier(), clock, firing=[cause()])
    await loop.reconcile()
    assert [(r.action, r.outcome) for r in records] == [("quarantine", "done")]
    node = cluster.nodes["gpu-1"]
    assert json.loads(node.annotations[HISTORY]) == [clock.now]
    assert json.loads(node.annotations[QUARANTINE])["rules"] == ["bus"]
    assert "accel-health.io/needs-human" not in node.labels


async def test_the_second_quarantine_within_the_window_is_escalated() -> None:
    clock = FakeClock(10_000.0)
    history = json.dumps([clock.now - 500])
    cluster = SnapshotCluster(nodes=[out_node(annotations={HISTORY: history})], pods=[], pdbs=[])
    loop, records = loop_over(cluster, ScriptedVerifier(), clock, firing=[cause()])
    await loop.reconcile()
    assert [(r.action, r.outcome) for r in records] == [("escalate", "done")]
    assert cluster.nodes["gpu-1"].labels["accel-health.io/needs-human"] == "true"
    assert [e["reason"] for e in cluster.events] == ["AccelRepeatedFaultsEscalated"]
    assert loop.status.escalated == {"gpu-1"}
    assert loop.status.results == {"escalated": 1}


async def test_a_condition_set_back_by_someone_else_ends_the_quarantine_untouched() -> None:
    quarantine = json.dumps({"bootID": "boot-a"})
    node = out_node(annotations={QUARANTINE: quarantine})
    healthy = NodeCondition("AcceleratorHealthy", "True", "FixedByHand")
    cluster = SnapshotCluster(nodes=[Node(**{**node.__dict__, "conditions": (healthy,)})], pods=[], pdbs=[])
    loop, records = loop_over(cluster, ScriptedVerifier(), FakeClock())
    await loop.reconcile()
    assert records == []
    assert cluster.mutations == ["annotate gpu-1 accel-health.io/quarantine, accel-health.io/repair-failed"]
    assert cluster.nodes["gpu-1"].unschedulable  # a cordon it does not own is not its business
    assert loop.status.results == {"handed_back": 1}


def rebooted(at: float, boot: str) -> Node:
    return out_node(boot="boot-now", annotations={REBOOTED: json.dumps({"at": at, "bootID": boot})})


def test_reboot_step_reboots_waits_asks_again_and_escalates() -> None:
    action = AwsReboot(replace_after_reboot_seconds=3600)
    assert reboot_step(out_node(), action, now=0)[0] == "reboot"
    assert reboot_step(rebooted(1000, "boot-now"), action, now=1100)[0] == "wait"  # same boot: under way
    assert reboot_step(rebooted(1000, "boot-now"), action, now=3000)[0] == "reboot"  # never happened
    step, why = reboot_step(rebooted(1000, "boot-before"), action, now=2000)
    assert step == "replace"
    assert "came back 1000 s after the reboot" in why
    assert reboot_step(rebooted(1000, "boot-before"), action, now=1000 + 3601)[0] == "reboot"  # long ago


async def test_the_checks_token_file_is_read_at_each_verification_and_a_missing_one_is_no_failure(
    tmp_path: Path,
) -> None:
    asked: list[str] = []

    async def endpoint(node: str) -> str | None:
        asked.append(node)
        return None  # no exporter pod: the verification after the token is there gets this far

    token_file = tmp_path / "token"
    verifier = ExporterChecks(endpoint=endpoint, token_file=token_file)
    missing = await verifier.verify("gpu-node-1", ["remapped"])
    assert missing.verdict == "error"
    assert "no checks token" in missing.error
    assert asked == []  # nothing was asked of the node without a token
    token_file.write_text("s3cret\n")
    later = await verifier.verify("gpu-node-1", ["remapped"])
    assert later.verdict == "error"
    assert asked == ["gpu-node-1"]
