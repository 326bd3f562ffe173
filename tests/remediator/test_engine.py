"""The decision engine over an in-memory cluster, on an injected clock: dry-run versus live (calls
counted at the Cluster seam), what it must remember rebuilt from the nodes after a restart, the storm
breaker, pause, rate limits, percentage budgets, budgets following the nodes, reversal of only what
this service did, and what happens to deferred actions."""

from __future__ import annotations

import dataclasses
from typing import Any

from remediator.cluster import BackendUnavailable, Node, NodeCondition, Pod, Taint
from remediator.executors.snapshot import RecordingAws, SnapshotCluster
from remediator.intake.payload import WebhookPayload, parse_payload
from remediator.lifecycle.engine import Engine
from remediator.lifecycle.model import EngineSettings
from remediator.lifecycle.record import RecordChange
from remediator.policy import Policy, load_policy, parse_policy
from tests.remediator.conftest import SNAPSHOT, CountingCluster, FakeClock, payload

CORDON = "rules:\n  - name: c\n    actions: [cordon]\n"


GPU = ("nvidia.com/gpu",)


def cluster_of(count: int, *, pods_per_node: int = 0) -> SnapshotCluster:
    nodes = [
        Node(name=f"n{i}", provider_id=f"aws:///us-west-2a/i-{i:017x}", accelerators=GPU)
        for i in range(count)
    ]
    pods = [
        Pod(namespace="ml", name=f"p{i}-{j}", node_name=f"n{i}", phase="Running")
        for i in range(count)
        for j in range(pods_per_node)
    ]
    return SnapshotCluster(nodes=nodes, pods=pods, pdbs=[])


def alert(node: str, *, status: str = "firing", fp: str | None = None, **labels: str) -> dict[str, Any]:
    return {
        "status": status,
        "labels": {"alertname": "AccelGPUFatalXid", "node": node, **labels},
        "startsAt": "2025-11-22T20:00:00Z",
        "fingerprint": fp or f"fp-{node}",
    }


def webhook(*alerts: dict[str, Any]) -> WebhookPayload:
    return parse_payload({"version": "4", "status": "firing", "alerts": list(alerts)})


def engine_over(
    cluster: SnapshotCluster | CountingCluster,
    policy: Policy | str,
    *,
    clock: FakeClock,
    dry_run: bool = False,
    aws: RecordingAws | None = None,
) -> Engine:
    return Engine(
        policy=parse_policy(policy) if isinstance(policy, str) else policy,
        cluster=cluster,
        aws=aws or RecordingAws(),
        settings=EngineSettings(dry_run=dry_run),
        clock=clock,
    )


def outcomes(engine: Engine) -> list[tuple[str | None, str, str, str | None]]:
    return [(r.node, r.action, r.outcome, r.gate) for r in engine.log.records()]


# -- dry-run -----------------------------------------------------------------------------------


REVERSIBLE = """
safety: {max_disrupted_nodes: 1}
rules:
  - name: all
    actions: [condition, cordon, {type: taint, key: accel-health.io/unhealthy}, drain, event,
              aws_set_unhealthy, cloudwatch_metric]
    on_resolved: [uncordon, untaint, condition, event]
"""


async def _scenario(engine: Engine) -> None:
    firing = payload("gpu-fatal-xid")
    neuron = payload("neuron-hw-error")
    for _ in range(3):
        await engine.handle(parse_payload(firing))
        await engine.drained()
        await engine.handle(parse_payload(neuron))
        await engine.drained()
    resolved = payload("gpu-fatal-xid")
    resolved["alerts"][0]["status"] = "resolved"
    await engine.handle(parse_payload(resolved))
    await engine.set_paused(True, "test")
    await engine.set_paused(False)


async def test_dry_run_decides_exactly_like_live_and_makes_zero_mutating_calls_at_the_cluster_seam() -> None:
    dry_cluster = CountingCluster(SnapshotCluster.from_file(SNAPSHOT))
    dry_aws = RecordingAws()
    dry = engine_over(dry_cluster, REVERSIBLE, clock=FakeClock(), dry_run=True, aws=dry_aws)
    await _scenario(dry)

    live_cluster = CountingCluster(SnapshotCluster.from_file(SNAPSHOT))
    live = engine_over(live_cluster, REVERSIBLE, clock=FakeClock())
    await _scenario(live)

    assert dry_cluster.mutating_calls == 0
    assert dry_cluster.inner.mutations == []
    assert dry_cluster.inner.gates is None
    assert dry_cluster.inner.gates_saves == 0
    assert not any("accel-health.io/" in k for n in dry_cluster.inner.nodes.values() for k in n.annotations)
    assert dry_aws.calls == []
    assert live_cluster.mutating_calls > 10  # the same scenario does act when live
    as_live = {"planned": "done"}
    dry_decisions = [(n, a, as_live.get(o, o), g) for n, a, o, g in outcomes(dry)]
    # The only difference: a live drain runs in the background, so its start has a record of its own.
    live_decisions = [(n, a, o, g) for n, a, o, g in outcomes(live) if o != "started"]
    assert dry_decisions == live_decisions
    gpu_drain = [o for n, a, o, _ in outcomes(live) if (n, a) == ("gpu-node-1", "drain")]
    assert gpu_drain == ["started", "failed"]  # refused: the emptyDir pod needs a permission
    assert all(r.dry_run for r in dry.log.records())
    assert ("trn-node-1", "cordon", "deferred", "budget") in dry_decisions


async def test_a_dry_run_rule_in_a_live_service_uses_up_no_real_budget() -> None:
    policy = """
safety: {max_disrupted_nodes: 1}
rules:
  - {name: trial, match: ['alertname="Trial"'], actions: [cordon], dry_run: true}
  - {name: real, actions: [cordon]}
"""
    cluster = cluster_of(10)
    engine = engine_over(cluster, policy, clock=FakeClock())
    await engine.handle(webhook(alert("n1", alertname="Trial"), alert("n2", alertname="Trial")))
    await engine.handle(webhook(alert("n3")))
    assert outcomes(engine) == [
        ("n1", "cordon", "planned", None),
        ("n2", "cordon", "planned", None),
        ("n3", "cordon", "done", None),
    ]
    # The dry-run rule writes no Event either; the real cordon tells of the fault and of itself, in
    # one Event.
    assert cluster.mutations == ["cordon n3", "event n3 Warning AccelFaultDetected"]
    assert (
        cluster.events[0]["message"]
        == "AccelGPUFatalXid firing (rule real); cordoned (alert AccelGPUFatalXid)"
    )


# -- restart -----------------------------------------------------------------------------------


async def test_budget_idempotency_and_ownership_survive_a_restart_over_the_same_cluster() -> None:
    clock = FakeClock()
    cluster = cluster_of(10, pods_per_node=0)
    policy = (
        "safety: {max_disrupted_nodes: 1}\n"
        + "rules: [{name: c, actions: [cordon], on_resolved: [uncordon]}]"
    )
    first = engine_over(cluster, policy, clock=clock)
    await first.handle(webhook(alert("n1")))
    n1 = ["cordon n1", "event n1 Warning AccelFaultDetected"]
    assert cluster.mutations == n1
    assert cluster.gates_saves == 0  # what it must remember is on n1, written with the cordon

    clock.now += 60
    second = engine_over(cluster, policy, clock=clock)  # the process restarted
    await second.start()
    assert second.budget.in_use == 1
    for _ in range(50):
        await second.handle(webhook(alert("n1")))  # Alertmanager resends after the restart
    await second.handle(webhook(alert("n2")))
    # Nothing twice, not even the Event saying the fault was seen; n2's fault is seen, its cordon waits.
    assert cluster.mutations == [*n1, "event n2 Warning AccelFaultDetected"]
    assert outcomes(second) == [("n2", "cordon", "deferred", "budget")]
    assert "n1 for 60s" in second.log.records()[0].reason

    await second.handle(webhook(alert("n1", status="resolved")))
    assert "uncordon n1" in cluster.mutations  # it knew after the restart that it had cordoned n1
    assert second.budget.in_use == 0


async def test_a_delivery_that_decides_nothing_writes_nothing() -> None:
    clock = FakeClock()
    counting = CountingCluster(cluster_of(10))
    policy = "safety: {alert_expiry_seconds: 1000}\nrules: [{name: c, actions: [cordon]}]"
    engine = engine_over(counting, policy, clock=clock)
    await engine.handle(webhook(alert("n1")))
    assert counting.mutating_calls == 2  # the cordon (which records the episode) and its Event
    for _ in range(30):  # resends, as a storm's groups and API reads bring them
        clock.now += 20
        await engine.handle(webhook(alert("n1")))
    assert counting.mutating_calls == 2
    assert counting.calls["save_gates"] == 0
    episode = alert("n1")
    episode["startsAt"] = "2025-11-22T21:00:00Z"  # a new episode of the same alert: n1 is cordoned
    await engine.handle(webhook(episode))
    assert counting.calls["cordon"] == 1  # already cordoned: skipped, no node written
    assert counting.calls["record_event"] == 2  # the new fault seen is told, once


async def test_a_new_leader_keeps_an_alert_its_nodes_record_firing_for_a_whole_expiry() -> None:
    clock = FakeClock()
    cluster = cluster_of(10)
    policy = "safety: {alert_expiry_seconds: 1000}\nrules: [{name: c, actions: [cordon]}]"
    engine = engine_over(cluster, policy, clock=clock)
    await engine.handle(webhook(alert("n1")))
    clock.now += 600
    successor = engine_over(cluster, policy, clock=clock)
    await successor.start()
    cause = successor.status().firing["n1"]["fp-n1"]
    assert cause["expires"] == clock.now + 1000  # from the successor's start: never shorter
    assert (cause["alertname"], cause["rule"], cause["startsAt"]) == (
        "AccelGPUFatalXid",
        "c",
        "2025-11-22T20:00:00Z",
    )
    assert cluster.gates is None  # nothing but the nodes was needed


async def test_an_open_breaker_and_a_pause_survive_a_restart() -> None:
    clock = FakeClock()
    cluster = cluster_of(10)
    first = engine_over(cluster, CORDON, clock=clock)
    await first.handle(webhook(*(alert(f"n{i}") for i in range(5))))
    await first.set_paused(True, "rack maintenance")
    second = engine_over(cluster, CORDON, clock=clock)
    await second.start()
    status = second.status()
    assert status.breaker_open
    assert status.breaker_trips == 1
    assert status.paused
    assert status.pause_reason == "rack maintenance"


async def test_an_unusable_stored_state_starts_the_service_paused_instead_of_with_an_empty_budget() -> None:
    cluster = cluster_of(3)
    cluster.gates = '{"version": 2, "breaker": {"open": "yesterday"}}'
    engine = engine_over(cluster, CORDON, clock=FakeClock())
    await engine.start()
    assert engine.status().paused
    assert "stored gate state unusable: breaker.open: expected true or false" in engine.status().pause_reason
    await engine.handle(webhook(alert("n1")))
    assert outcomes(engine) == [("n1", "cordon", "deferred", "pause")]
    assert "cordon n1" not in cluster.mutations


async def test_an_unreachable_cluster_propagates_so_that_the_webhook_answers_503() -> None:
    class Unreachable(SnapshotCluster):
        async def cordon(self, node: str, *, record: RecordChange | None = None) -> bool:
            raise BackendUnavailable("connection refused")

    engine = engine_over(Unreachable(nodes=[Node(name="n1")], pods=[], pdbs=[]), CORDON, clock=FakeClock())
    try:
        await engine.handle(webhook(alert("n1")))
    except BackendUnavailable:
        pass
    else:
        raise AssertionError("BackendUnavailable was swallowed")
    assert engine.log.records() == []  # nothing decided: the retry decides


async def test_an_executor_error_that_retrying_cannot_fix_is_recorded_as_failed() -> None:
    class Broken(SnapshotCluster):
        async def cordon(self, node: str, *, record: RecordChange | None = None) -> bool:
            raise ValueError("node name too long")

    engine = engine_over(Broken(nodes=[Node(name="n1")], pods=[], pdbs=[]), CORDON, clock=FakeClock())
    await engine.handle(webhook(alert("n1")))
    record = engine.log.records()[0]
    assert (record.outcome, record.reason) == ("failed", "ValueError: node name too long")


# -- storm breaker -----------------------------------------------------------------------------


async def test_a_storm_stops_every_action_before_the_first_one_and_resumes_by_itself() -> None:
    clock = FakeClock()
    cluster = cluster_of(10)
    policy = "rules:\n  - {name: c, actions: [condition, cordon]}\n"
    engine = engine_over(cluster, policy, clock=clock)
    storm = webhook(*(alert(f"n{i}") for i in range(4)))  # 40% of 10 nodes in one delivery
    await engine.handle(storm)
    assert {(o, g) for _, _, o, g in outcomes(engine)} == {("deferred", "breaker")}
    assert cluster.mutations == []
    assert engine.status().deferred == {"breaker": 8}

    clock.now += 300
    await engine.handle(storm)  # still firing: still open, nothing new recorded
    assert len(engine.log) == 8
    assert all(p.evaluations == 2 for p in engine.pending.values())

    await engine.handle(webhook(*(alert(f"n{i}", status="resolved") for i in range(4))))
    assert engine.status().breaker_open  # the storm is over, the cooldown has just begun
    clock.now += 900
    assert not engine.status().breaker_open  # closed by itself, no manual reset

    await engine.handle(webhook(alert("n7")))
    assert outcomes(engine)[-2:] == [("n7", "condition", "done", None), ("n7", "cordon", "done", None)]


async def test_a_storm_still_firing_keeps_the_breaker_open_though_alertmanager_resends_rarely() -> None:
    """Issue 15 item 4: the breaker counted deliveries within a window, so a storm resent every
    30 minutes (longer than window + cooldown) closed it while every alert still fired."""
    clock = FakeClock()
    cluster = cluster_of(10)
    engine = engine_over(cluster, CORDON, clock=clock)
    await engine.handle(webhook(*(alert(f"n{i}") for i in range(4))))
    assert engine.status().breaker_open
    clock.now += 1_799  # the shipped warning route's repeat_interval is 30 min: no resend yet
    assert engine.status().breaker_open
    assert engine.status().alerting_nodes == 4
    await engine.handle(webhook(alert("n9")))  # a fifth node's fault arrives meanwhile
    assert outcomes(engine)[-1] == ("n9", "cordon", "deferred", "breaker")
    assert cluster.mutations == []


async def test_cpu_only_nodes_do_not_dilute_the_breaker_or_the_percentage_budget() -> None:
    gpu = [Node(name=f"n{i}", accelerators=GPU) for i in range(10)]
    cpu = [Node(name=f"cpu{i}") for i in range(30)]
    engine = engine_over(SnapshotCluster(nodes=[*gpu, *cpu], pods=[], pdbs=[]), CORDON, clock=FakeClock())
    await engine.handle(webhook(*(alert(f"n{i}") for i in range(4))))  # 4 of 10 GPU nodes, 10% of 40
    status = engine.status()
    assert (status.alerting_nodes, status.eligible_nodes) == (4, 10)
    assert status.breaker_open


async def test_nodes_already_unschedulable_or_not_ready_count_against_the_budget() -> None:
    nodes = [Node(name=f"n{i}", accelerators=GPU) for i in range(10)]
    nodes[5] = Node(name="n5", accelerators=GPU, unschedulable=True)  # cordoned by someone else
    nodes[6] = Node(name="n6", accelerators=GPU, conditions=(NodeCondition("Ready", "False"),))
    cluster = SnapshotCluster(nodes=nodes, pods=[], pdbs=[])
    engine = engine_over(cluster, "safety: {max_disrupted_nodes: 3}\n" + CORDON, clock=FakeClock())
    await engine.handle(webhook(alert("n1"), alert("n2")))
    assert outcomes(engine) == [("n1", "cordon", "done", None), ("n2", "cordon", "deferred", "budget")]
    reason = engine.log.records()[1].reason
    assert "3 of 3 nodes already out of service" in reason
    assert "n5 unschedulable" in reason
    assert "n6 NotReady" in reason


async def test_a_storm_of_alerts_on_nodes_that_may_not_be_touched_trips_nothing() -> None:
    nodes = [Node(name=f"cp{i}", labels={"node-role.kubernetes.io/control-plane": ""}) for i in range(5)]
    cluster = SnapshotCluster(nodes=[*nodes, Node(name="gpu")], pods=[], pdbs=[])
    engine = engine_over(cluster, CORDON, clock=FakeClock())
    await engine.handle(webhook(*(alert(f"cp{i}") for i in range(5)), alert("gpu")))
    assert not engine.status().breaker_open
    assert outcomes(engine)[-1] == ("gpu", "cordon", "done", None)


# -- pause, rate limits, budgets ---------------------------------------------------------------


async def test_pause_defers_everything_and_resume_lets_the_next_resend_act() -> None:
    cluster = cluster_of(3)
    engine = engine_over(cluster, CORDON, clock=FakeClock())
    await engine.set_paused(True, "investigating")
    await engine.handle(webhook(alert("n1")))
    assert outcomes(engine) == [("n1", "cordon", "deferred", "pause")]
    assert "investigating" in engine.log.records()[0].reason
    await engine.set_paused(False)
    await engine.handle(webhook(alert("n1")))
    assert outcomes(engine)[-1] == ("n1", "cordon", "done", None)
    assert engine.pending == {}


async def test_a_rate_limit_defers_the_next_drain_until_the_window_slides() -> None:
    clock = FakeClock()
    policy = """
safety:
  max_disrupted_nodes: 10
  rate_limits: {drain: {max_actions: 1, window_seconds: 3600}}
  storm_breaker: {enabled: false}
rules:
  - {name: d, actions: [drain]}
"""
    engine = engine_over(cluster_of(10), policy, clock=clock)
    await engine.handle(webhook(alert("n1"), alert("n2")))
    await engine.drained()
    assert outcomes(engine) == [
        ("n1", "drain", "started", None),
        ("n2", "drain", "deferred", "rate_limit"),
        ("n1", "drain", "done", None),
    ]
    clock.now += 3600
    await engine.handle(webhook(alert("n1"), alert("n2")))
    await engine.drained()
    assert outcomes(engine)[-2:] == [("n2", "drain", "started", None), ("n2", "drain", "done", None)]


async def test_a_percentage_budget_counts_only_eligible_nodes() -> None:
    nodes = [Node(name=f"n{i}", accelerators=GPU) for i in range(20)]
    nodes += [
        Node(name=f"opt{i}", labels={"accel-health.io/opt-out": "true"}, accelerators=GPU) for i in range(20)
    ]
    engine = engine_over(
        SnapshotCluster(nodes=nodes, pods=[], pdbs=[]),
        "safety: {max_disrupted_nodes: 10, max_disrupted_percent: 10, storm_breaker: {enabled: false}}\n"
        + CORDON[CORDON.index("rules") :],
        clock=FakeClock(),
    )
    await engine.handle(webhook(*(alert(f"n{i}") for i in range(4))))
    assert [o for _, _, o, _ in outcomes(engine)] == ["done", "done", "deferred", "deferred"]
    assert "2 of 2 (10% of 20 eligible nodes, rounded down)" in engine.log.records()[2].reason


async def test_a_node_someone_else_uncordoned_gives_its_budget_back() -> None:
    cluster = cluster_of(5)
    engine = engine_over(cluster, "safety: {max_disrupted_nodes: 1}\n" + CORDON, clock=FakeClock())
    await engine.handle(webhook(alert("n1")))
    await engine.handle(webhook(alert("n2")))
    assert outcomes(engine)[-1] == ("n2", "cordon", "deferred", "budget")
    await cluster.uncordon("n1")  # a human put n1 back into service
    await engine.handle(webhook(alert("n2")))
    assert outcomes(engine)[-1] == ("n2", "cordon", "done", None)
    assert set(engine.budget.holders()) == {"n2"}


async def test_a_replaced_node_stays_in_the_budget_until_it_is_gone() -> None:
    cluster = cluster_of(5)
    policy = "safety: {max_disrupted_nodes: 1}\nrules:\n  - {name: r, actions: [aws_set_unhealthy]}\n"
    engine = engine_over(cluster, policy, clock=FakeClock())
    await engine.handle(webhook(alert("n1")))
    await engine.handle(webhook(alert("n2")))
    assert outcomes(engine)[-1] == ("n2", "aws_set_unhealthy", "deferred", "budget")
    del cluster.nodes["n1"]  # the Auto Scaling group terminated it
    await engine.handle(webhook(alert("n2")))
    assert outcomes(engine)[-1] == ("n2", "aws_set_unhealthy", "done", None)


# -- reversal and deferred actions -------------------------------------------------------------


TAINT_POLICY = """
rules:
  - name: t
    actions: [{type: taint, key: accel-health.io/unhealthy, value: "true", effect: NoSchedule}]
    on_resolved: [untaint]
"""


async def test_untaint_on_resolve_removes_only_the_taint_this_service_added() -> None:
    cluster = cluster_of(3)
    engine = engine_over(cluster, TAINT_POLICY, clock=FakeClock())
    await engine.handle(webhook(alert("n1")))
    await engine.handle(webhook(alert("n1", status="resolved")))
    assert "untaint n1 accel-health.io/unhealthy:NoSchedule" in cluster.mutations
    assert cluster.nodes["n1"].taints == ()
    assert engine.budget.in_use == 0


async def test_a_taint_someone_changed_since_is_left_alone_on_resolve() -> None:
    cluster = cluster_of(3)
    engine = engine_over(cluster, TAINT_POLICY, clock=FakeClock())
    await engine.handle(webhook(alert("n1")))
    await cluster.add_taint("n1", Taint("accel-health.io/unhealthy", "keep-out", "NoSchedule"))
    await engine.handle(webhook(alert("n1", status="resolved")))
    assert not [m for m in cluster.mutations if m.startswith("untaint")]
    assert outcomes(engine)[-1][2] == "skipped"
    assert "changed by someone else" in engine.log.records()[-1].reason


async def test_a_taint_that_was_already_there_is_never_removed() -> None:
    cluster = cluster_of(3)
    theirs = Taint("accel-health.io/unhealthy", "true", "NoSchedule")  # put there by someone else
    cluster.nodes["n1"] = dataclasses.replace(cluster.nodes["n1"], taints=(theirs,))
    engine = engine_over(cluster, TAINT_POLICY, clock=FakeClock())
    await engine.handle(webhook(alert("n1")))
    await engine.handle(webhook(alert("n1", status="resolved")))
    assert [o for _, _, o, _ in outcomes(engine)] == ["skipped", "skipped"]
    assert cluster.nodes["n1"].taints


async def test_a_deferred_action_whose_alert_resolves_is_closed_with_a_record_not_dropped() -> None:
    engine = engine_over(cluster_of(5), "safety: {max_disrupted_nodes: 0}\n" + CORDON, clock=FakeClock())
    await engine.handle(webhook(alert("n1")))
    assert len(engine.pending) == 1
    await engine.handle(webhook(alert("n1", status="resolved")))
    await engine.handle(webhook(alert("n1", status="resolved")))
    assert engine.pending == {}
    assert outcomes(engine) == [
        ("n1", "cordon", "deferred", "budget"),
        ("n1", "cordon", "skipped", "budget"),
        ("n1", "none", "ignored", None),
    ]
    assert "alert resolved while the action was deferred by gate budget" in engine.log.records()[1].reason


async def test_the_default_policy_acts_on_the_example_cluster_as_the_demo_expects() -> None:
    engine = engine_over(SnapshotCluster.from_file(SNAPSHOT), load_policy(), clock=FakeClock(), dry_run=True)
    await engine.handle(parse_payload(payload("gpu-fatal-xid")))
    await engine.handle(parse_payload(payload("neuron-hw-error")))
    assert not engine.status().breaker_open
    assert {(n, a) for n, a, o, _ in outcomes(engine) if o == "planned"} >= {
        ("gpu-node-1", "drain"),
        ("trn-node-1", "aws_set_unhealthy"),
    }
