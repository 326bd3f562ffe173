"""The repair loop's decisions on the in-memory cluster, and the AWS reboot step (pure).

The loop runs over the snapshot backend with an injected clock and a scripted verifier (the checks'
own HTTP path is covered on the real API server in tests/kube/test_repair.py). Covered: dry-run plans
and changes nothing; a node that has not answered its checks yet is tried again, not failed; an old
quarantine leaves the window and does not count towards escalation; a condition set back by someone
else ends the quarantine untouched; a rule's `verify` picks the checks; `reboot_step` reboots, waits
for the reboot it asked for, asks again when it never happened, and escalates a fault that comes back.

A quarantine outlives the Node object: `quarantine_annotations` (the record the condition's write may
carry); the durable copy written once, bounded to 1 KiB, read by a new leader, deleted on return,
hand-back, or a window after its name disappeared; a replacement under the quarantined name held with
the startup taint (one write) until its checks pass; escalation counted across Node objects, also
when the replacement was quarantined before the loop saw it, and inherited until a human removes the
label; a new node's startup taint lifted at once or (`verify_new_nodes`) after its checks; a dry-run
writes nothing; the quarantined gauge computed at scrape time.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from remediator.audit import DecisionRecord
from remediator.cluster import Node, NodeCondition
from remediator.desired.firing import Cause
from remediator.executors.snapshot import SnapshotCluster
from remediator.lifecycle.record import CORDONED_BY, MANAGER
from remediator.lifecycle.repair import (
    DURABLE_MAX_BYTES,
    HISTORY,
    HISTORY_CAP,
    QUARANTINE,
    REBOOTED,
    REPAIR_FAILED,
    STARTUP_TAINT,
    DurableQuarantine,
    ExporterChecks,
    RepairCollector,
    RepairLoop,
    Verification,
    quarantine_annotations,
    reboot_step,
    unverified,
)
from remediator.policy import AwsReboot, parse_policy
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


# -- a quarantine outlives the Node object ---------------------------------------------------------


def fresh_node(
    name: str = "gpu-1", *, uid: str = "uid-2", boot: str = "boot-new", startup: bool = False
) -> Node:
    """A Node object as a replacement machine registers it: a new uid, no annotations, no condition."""
    return Node(
        name=name,
        accelerators=("nvidia.com/gpu",),
        uid=uid,
        boot_id=boot,
        taints=(STARTUP_TAINT,) if startup else (),
    )


def durable(cluster: SnapshotCluster, node: str = "gpu-1") -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(cluster.quarantines[node])
    return doc


def test_quarantine_annotations_record_the_node_its_causes_and_the_history_within_the_window() -> None:
    node = Node(
        name="gpu-1",
        uid="uid-1",
        boot_id="boot-a",
        provider_id="aws:///us-west-2a/i-0abc",
        annotations={HISTORY: json.dumps([100.0, 9_000.0])},
    )
    out = quarantine_annotations(
        node,
        causes=[cause(), cause("other")],
        now=10_000.0,
        window_seconds=5_000.0,
        earlier=[8_000.0, 9_000.0],
    )
    assert json.loads(out[QUARANTINE]) == {
        "since": 10_000.0,
        "bootID": "boot-a",
        "uid": "uid-1",
        "providerID": "aws:///us-west-2a/i-0abc",
        "alerts": ["AccelGPUFellOffBus"],
        "rules": ["bus", "other"],
    }
    assert json.loads(out[HISTORY]) == [8_000.0, 9_000.0, 10_000.0]  # 100 left the window; 9000 once
    named_by_condition = quarantine_annotations(
        node, causes=[], now=10_000.0, window_seconds=5_000.0, reason="AccelGPUFellOffBus"
    )
    assert json.loads(named_by_condition[QUARANTINE])["alerts"] == ["AccelGPUFellOffBus"]


def test_the_history_keeps_at_most_the_newest_times_the_escalation_can_need() -> None:
    node = Node(name="gpu-1", annotations={HISTORY: json.dumps([float(t) for t in range(100)])})
    history = json.loads(quarantine_annotations(node, causes=[], now=100.0, window_seconds=1e9)[HISTORY])
    assert len(history) == HISTORY_CAP
    assert history[-2:] == [99.0, 100.0]


async def test_a_quarantine_gets_its_durable_copy_once_not_a_write_per_pass() -> None:
    clock = FakeClock(10_000.0)
    cluster = SnapshotCluster(nodes=[out_node()], pods=[], pdbs=[])
    loop, records = loop_over(cluster, ScriptedVerifier(), clock, firing=[cause()])
    await loop.reconcile()
    clock.now += 60
    await loop.reconcile()
    assert [(r.action, r.outcome) for r in records] == [("quarantine", "done")]
    assert cluster.quarantine_writes == ["save gpu-1"]
    node = cluster.nodes["gpu-1"]
    assert durable(cluster) == {
        "node": "gpu-1",
        "record": json.loads(node.annotations[QUARANTINE]),
        "history": [10_000.0],
        "escalated": False,
    }


async def test_a_quarantine_recorded_by_the_condition_write_gets_its_durable_copy_and_no_annotation() -> None:
    clock = FakeClock(10_000.0)
    written = quarantine_annotations(out_node(), causes=[cause()], now=clock.now, window_seconds=1000.0)
    cluster = SnapshotCluster(nodes=[out_node(annotations=written)], pods=[], pdbs=[])
    loop, records = loop_over(cluster, ScriptedVerifier(), clock, firing=[cause()])
    await loop.reconcile()
    assert cluster.mutations == []  # the record on the node is the engine's; nothing to add there
    assert cluster.quarantine_writes == ["save gpu-1"]
    assert durable(cluster)["record"] == json.loads(written[QUARANTINE])
    # The loop tells of the quarantine when it first sees it, whoever recorded it.
    assert [(r.action, r.outcome) for r in records] == [("quarantine", "done")]
    assert records[0].reason.startswith("quarantine 1 of 2 allowed within 1000 s")


async def test_the_durable_copy_stays_within_1_kib_with_a_full_history_and_long_names() -> None:
    copy = DurableQuarantine(
        node="n" * 253,
        record={
            "since": 1_764_063_123.123456,
            "bootID": "b" * 36,
            "uid": "u" * 36,
            "providerID": "aws:///us-west-2a/i-0123456789abcdef0",
            "alerts": [f"AccelSomeVeryLongAlertName{i}" for i in range(20)],
            "rules": ["drain"],
        },
        history=tuple(1_764_063_123.123456 + i for i in range(HISTORY_CAP)),
        escalated=True,
    )
    doc = copy.document()
    assert len(json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()) <= DURABLE_MAX_BYTES
    assert doc["record"]["rules"] == ["drain"]  # what the checks are chosen by is kept
    assert doc["record"]["alerts"][0] == "AccelSomeVeryLongAlertName0"
    assert doc["history"][-1] == copy.history[-1]  # the newest times are kept
    assert DurableQuarantine.from_document(copy.node, doc) is not None


@pytest.mark.parametrize("text", ["r" * 2000, "\u00fc" * 2000])
def test_even_absurdly_long_names_leave_the_durable_copy_within_1_kib(text: str) -> None:
    record = {
        "since": 1.0,
        "uid": text,
        "bootID": text,
        "providerID": text,
        "alerts": [text],
        "rules": [text],
    }
    doc = DurableQuarantine(node="n" * 253, record=record, history=(1.0, 2.0)).document()
    assert len(json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()) <= DURABLE_MAX_BYTES
    assert doc["history"] == [2.0]


async def test_a_recreated_node_under_a_quarantined_name_is_held_by_the_startup_taint_until_verified() -> (
    None
):
    clock = FakeClock(10_000.0)
    cluster = SnapshotCluster(nodes=[out_node()], pods=[], pdbs=[])
    verifier = ScriptedVerifier(Verification("fail", failing=(("pciebw", "5 GB/s"),)), Verification("pass"))
    loop, records = loop_over(cluster, verifier, clock, firing=[cause()])
    await loop.reconcile()  # quarantined
    cluster.replace_node(fresh_node())  # the cloud replaced the machine and kept the name
    loop, records = loop_over(cluster, verifier, clock)  # a new leader: it reads the durable copies
    await loop.reconcile()
    node = cluster.nodes["gpu-1"]
    assert STARTUP_TAINT in node.taints  # it takes no work
    assert json.loads(node.annotations[QUARANTINE])["uid"] == "uid-1"  # the old object's record
    assert [(r.action, r.outcome) for r in records] == [("hold_unverified", "done"), ("verify", "failed")]
    assert records[1].reason.startswith("a new node object under the same name, but check pciebw")
    assert loop.status.quarantined == {"gpu-1"}
    await loop.reconcile()  # one verification per boot
    assert len(verifier.asked) == 1
    cluster.rebooted("gpu-1", "boot-newer")
    await loop.reconcile()
    node = cluster.nodes["gpu-1"]
    assert node.taints == ()
    assert QUARANTINE not in node.annotations
    assert "gpu-1" not in cluster.quarantines
    assert records[-1].action == "return_to_pool"
    assert "startup taint accel-health.io/unverified removed" in records[-1].reason
    assert [e["reason"] for e in cluster.events][-3:] == [
        "AccelUnverifiedNodeHeld",
        "AccelRepairCheckFailed",
        "AccelReturnedToPool",
    ]


async def test_a_replacement_that_registered_with_the_startup_taint_is_held_by_one_write() -> None:
    cluster = SnapshotCluster(nodes=[out_node()], pods=[], pdbs=[])
    clock = FakeClock(10_000.0)
    loop, _ = loop_over(cluster, ScriptedVerifier(), clock, firing=[cause()])
    await loop.reconcile()
    cluster.replace_node(fresh_node(startup=True))
    cluster.mutations.clear()
    await loop.reconcile()  # still firing: held, not verified
    assert cluster.mutations == [
        "hold gpu-1 accel-health.io/unverified:NoSchedule",
        "event gpu-1 Normal AccelUnverifiedNodeHeld",
    ]
    assert cluster.nodes["gpu-1"].taints == (STARTUP_TAINT,)


async def test_escalation_counts_the_quarantines_of_a_name_across_node_objects() -> None:
    clock = FakeClock(10_000.0)
    cluster = SnapshotCluster(nodes=[out_node()], pods=[], pdbs=[])
    firing = [cause()]
    loop, records = loop_over(cluster, ScriptedVerifier(Verification("pass")), clock, firing=firing)
    await loop.reconcile()  # quarantine 1 of 2, on the first object
    cluster.replace_node(fresh_node())
    firing.clear()
    clock.now += 100
    await loop.reconcile()  # the replacement is held, verified and returned
    assert not unverified(cluster.nodes["gpu-1"])
    assert json.loads(cluster.nodes["gpu-1"].annotations[HISTORY]) == [10_000.0]  # the history came along
    fault = NodeCondition("AcceleratorHealthy", "False", "AccelGPUFellOffBus")
    cluster.replace_node(Node(**{**cluster.nodes["gpu-1"].__dict__, "conditions": (fault,)}))
    firing.append(cause())
    clock.now += 100
    await loop.reconcile()  # quarantine 2 of 2, on the second object: escalated
    assert [(r.action, r.outcome) for r in records] == [
        ("quarantine", "done"),
        ("hold_unverified", "done"),
        ("return_to_pool", "done"),
        ("escalate", "done"),
    ]
    assert cluster.nodes["gpu-1"].labels["accel-health.io/needs-human"] == "true"
    assert durable(cluster)["escalated"] is True


async def test_a_replacement_quarantined_before_the_loop_saw_it_counts_the_earlier_quarantine() -> None:
    clock = FakeClock(10_000.0)
    cluster = SnapshotCluster(nodes=[out_node()], pods=[], pdbs=[])
    loop, records = loop_over(cluster, ScriptedVerifier(), clock, firing=[cause()])
    await loop.reconcile()
    clock.now += 100
    # The replacement faults at once; the condition's write records the quarantine from what the
    # new object knows (no history) before the loop's next pass.
    replacement = fresh_node()
    written = quarantine_annotations(replacement, causes=[cause()], now=clock.now, window_seconds=1000.0)
    fault = NodeCondition("AcceleratorHealthy", "False", "AccelGPUFellOffBus")
    cluster.replace_node(dataclasses.replace(replacement, annotations=written, conditions=(fault,)))
    await loop.reconcile()
    assert [(r.action, r.outcome) for r in records] == [("quarantine", "done"), ("escalate", "done")]
    assert json.loads(cluster.nodes["gpu-1"].annotations[HISTORY]) == [10_000.0, 10_100.0]
    assert durable(cluster)["history"] == [10_000.0, 10_100.0]


async def test_an_escalated_quarantine_is_inherited_by_the_replacement_until_a_human_removes_the_label() -> (
    None
):
    clock = FakeClock(10_000.0)
    history = json.dumps([clock.now - 500])
    cluster = SnapshotCluster(nodes=[out_node(annotations={HISTORY: history})], pods=[], pdbs=[])
    verifier = ScriptedVerifier(Verification("pass"))
    loop, records = loop_over(cluster, verifier, clock, firing=[cause()])
    await loop.reconcile()  # escalated
    cluster.replace_node(fresh_node())
    loop, records = loop_over(cluster, verifier, clock)
    await loop.reconcile()
    node = cluster.nodes["gpu-1"]
    assert node.labels["accel-health.io/needs-human"] == "true"
    assert unverified(node)
    assert verifier.asked == []
    assert loop.status.escalated == {"gpu-1"}
    await cluster.label_node("gpu-1", {"accel-health.io/needs-human": None})  # a human hands it back
    await loop.reconcile()
    assert not unverified(cluster.nodes["gpu-1"])
    assert records[-1].action == "return_to_pool"


async def test_a_new_node_with_the_startup_taint_and_no_quarantine_under_its_name_is_admitted_at_once() -> (
    None
):
    cluster = SnapshotCluster(nodes=[fresh_node(startup=True)], pods=[], pdbs=[])
    verifier = ScriptedVerifier()
    loop, records = loop_over(cluster, verifier, FakeClock())
    await loop.reconcile()
    assert cluster.nodes["gpu-1"].taints == ()
    assert verifier.asked == []
    assert [(r.action, r.outcome) for r in records] == [("admit", "done")]
    assert loop.status.results == {"admitted": 1}
    assert cluster.quarantine_writes == []


async def test_with_verify_new_nodes_a_new_node_is_admitted_only_once_its_checks_pass() -> None:
    policy = POLICY.replace("window_seconds: 1000}", "window_seconds: 1000, verify_new_nodes: true}")
    cluster = SnapshotCluster(nodes=[fresh_node(startup=True)], pods=[], pdbs=[])
    verifier = ScriptedVerifier(
        Verification("error", error="connection refused"),
        Verification("fail", failing=(("remapped", "pending row remap"),)),
        Verification("pass"),
    )
    records: list[DecisionRecord] = []
    loop = RepairLoop(
        policy=parse_policy(policy),
        cluster=cluster,
        verifier=verifier,
        firing=lambda _node: [],
        publish=records.append,
        clock=FakeClock(),
    )
    await loop.reconcile()  # not answering yet
    await loop.reconcile()  # a check fails: kept out
    await loop.reconcile()  # once per boot
    assert unverified(cluster.nodes["gpu-1"])
    assert loop.status.check_failed == {"gpu-1": "remapped"}
    cluster.rebooted("gpu-1", "boot-2")
    await loop.reconcile()
    assert not unverified(cluster.nodes["gpu-1"])
    assert REPAIR_FAILED not in cluster.nodes["gpu-1"].annotations
    assert [(r.action, r.outcome) for r in records] == [("verify", "failed"), ("admit", "done")]
    assert verifier.asked == [("gpu-1", ("remapped",))] * 3


async def test_a_returned_or_handed_back_node_loses_its_durable_copy() -> None:
    clock = FakeClock(10_000.0)
    cluster = SnapshotCluster(nodes=[out_node(), out_node("gpu-2")], pods=[], pdbs=[])
    loop, _ = loop_over(cluster, ScriptedVerifier(Verification("pass")), clock, firing=[cause()])
    await loop.reconcile()
    assert set(cluster.quarantines) == {"gpu-1", "gpu-2"}
    loop, _ = loop_over(cluster, ScriptedVerifier(Verification("pass")), clock)
    cluster.rebooted("gpu-1", "boot-b")  # repaired: returned
    healthy = NodeCondition("AcceleratorHealthy", "True", "FixedByHand")
    cluster.replace_node(Node(**{**cluster.nodes["gpu-2"].__dict__, "conditions": (healthy,)}))  # by hand
    await loop.reconcile()
    assert cluster.quarantines == {}
    assert loop.status.results == {"returned": 1, "handed_back": 1}


async def test_a_name_no_node_has_had_for_a_whole_window_is_forgotten() -> None:
    clock = FakeClock(10_000.0)
    cluster = SnapshotCluster(nodes=[out_node()], pods=[], pdbs=[])
    loop, _ = loop_over(cluster, ScriptedVerifier(), clock, firing=[cause()])
    await loop.reconcile()
    del cluster.nodes["gpu-1"]  # scaled in; its replacement got another name
    clock.now += 999
    await loop.reconcile()
    assert "gpu-1" in cluster.quarantines  # it may still come back under its name
    clock.now += 1
    await loop.reconcile()
    assert cluster.quarantines == {}


async def test_a_dry_run_holds_nothing_and_writes_no_durable_copy() -> None:
    quarantine = json.dumps(
        {"bootID": "boot-a", "uid": "uid-1", "rules": ["bus"], "alerts": ["X"], "since": 1.0}
    )
    cluster = SnapshotCluster(nodes=[fresh_node(startup=True), out_node("gpu-2")], pods=[], pdbs=[])
    cluster.quarantines["gpu-1"] = json.dumps(
        {"node": "gpu-1", "record": json.loads(quarantine), "history": [1.0]}
    )
    loop, records = loop_over(cluster, ScriptedVerifier(Verification("pass")), FakeClock(), dry_run=True)
    await loop.reconcile()
    await loop.reconcile()
    assert (cluster.mutations, cluster.quarantine_writes) == ([], [])
    assert [(r.node, r.action, r.outcome) for r in records] == [
        ("gpu-1", "hold_unverified", "planned"),
        ("gpu-1", "return_to_pool", "planned"),
        ("gpu-2", "quarantine", "planned"),
    ]


async def test_the_quarantined_gauge_shows_a_quarantine_before_the_loops_next_pass() -> None:
    cluster = SnapshotCluster(nodes=[fresh_node("gpu-2", uid="uid-9")], pods=[], pdbs=[])
    loop, _ = loop_over(cluster, ScriptedVerifier(), FakeClock())
    await loop.reconcile()
    registry = CollectorRegistry()
    registry.register(RepairCollector(loop))
    assert registry.get_sample_value("accel_remediator_quarantined_nodes") == 0
    await cluster.set_condition("gpu-2", NodeCondition("AcceleratorHealthy", "False", "AccelGPUFellOffBus"))
    assert registry.get_sample_value("accel_remediator_quarantined_nodes") == 1  # no pass in between
    assert loop.status.quarantined == set()
