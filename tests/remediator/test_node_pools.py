"""Policy rules that select nodes by label, through the engine over an in-memory cluster: two node
pools treated differently (one drained, one only tainted), a rule's own budget deferring the next node
of its pool while another pool still acts (the global budget still applying too), a node the engine
cannot see, a resolve decided under the rule its alert fired under, dry-run counting what a live
service would have disrupted, and the per-rule budgets in GET /state and /metrics."""

from __future__ import annotations

import dataclasses
from typing import Any

from remediator.cluster import Node
from remediator.executors.snapshot import RecordingAws, SnapshotCluster
from remediator.intake.payload import WebhookPayload, parse_payload
from remediator.lifecycle.engine import Engine
from remediator.lifecycle.model import EngineSettings
from remediator.policy import parse_policy
from tests.remediator.conftest import AUTH, AiohttpClient, FakeClock, Service

GPU = ("nvidia.com/gpu",)
POOL = "karpenter.sh/nodepool"

POOLS = """
safety: {max_disrupted_nodes: 10, storm_breaker: {enabled: false}}
rules:
  - name: drain-p5
    match: ['remediation="drain"']
    nodes: {matchLabels: {karpenter.sh/nodepool: p5}}
    max_disrupted_nodes: 1
    actions: [cordon, drain]
    on_resolved: [uncordon]
  - name: taint-g5
    match: ['remediation="drain"']
    nodes:
      matchExpressions: [{key: karpenter.sh/nodepool, operator: In, values: [g5]}]
    actions: [{type: taint, key: accel-health.io/unhealthy, effect: NoSchedule}]
"""


def pools(*, p5: int = 4, g5: int = 4) -> SnapshotCluster:
    nodes = [Node(name=f"p5-{i}", labels={POOL: "p5"}, accelerators=GPU) for i in range(p5)]
    nodes += [Node(name=f"g5-{i}", labels={POOL: "g5"}, accelerators=GPU) for i in range(g5)]
    return SnapshotCluster(nodes=nodes, pods=[], pdbs=[])


def alert(node: str, *, status: str = "firing") -> dict[str, Any]:
    return {
        "status": status,
        "labels": {"alertname": "AccelGPUFatalXid", "node": node, "remediation": "drain"},
        "startsAt": "2025-11-22T20:00:00Z",
        "fingerprint": f"fp-{node}",
    }


def webhook(*alerts: dict[str, Any]) -> WebhookPayload:
    return parse_payload({"version": "4", "status": "firing", "alerts": list(alerts)})


def engine_over(cluster: SnapshotCluster, policy: str = POOLS, *, dry_run: bool = False) -> Engine:
    return Engine(
        policy=parse_policy(policy),
        cluster=cluster,
        aws=RecordingAws(),
        settings=EngineSettings(dry_run=dry_run),
        clock=FakeClock(),
    )


def decisions(engine: Engine) -> list[tuple[str | None, str | None, str, str, str | None]]:
    return [(r.node, r.rule, r.action, r.outcome, r.gate) for r in engine.log.records()]


async def test_one_cluster_drains_one_pool_and_only_taints_the_other() -> None:
    cluster = pools()
    engine = engine_over(cluster)
    await engine.handle(webhook(alert("p5-0"), alert("g5-0")))
    await engine.drained()
    assert decisions(engine) == [
        ("p5-0", "drain-p5", "cordon", "done", None),
        ("p5-0", "drain-p5", "drain", "started", None),
        ("g5-0", "taint-g5", "taint", "done", None),
        ("p5-0", "drain-p5", "drain", "done", None),
    ]
    assert cluster.nodes["p5-0"].unschedulable
    assert not cluster.nodes["p5-0"].taints
    assert not cluster.nodes["g5-0"].unschedulable
    assert [(t.key, t.effect) for t in cluster.nodes["g5-0"].taints] == [
        ("accel-health.io/unhealthy", "NoSchedule")
    ]


async def test_a_pools_budget_defers_its_next_node_while_the_other_pool_still_acts() -> None:
    cluster = pools()
    engine = engine_over(cluster)
    await engine.handle(webhook(alert("p5-0"), alert("p5-1"), alert("g5-0"), alert("g5-1")))
    await engine.drained()
    got = decisions(engine)
    assert ("p5-1", "drain-p5", "cordon", "deferred", "budget") in got
    assert ("p5-1", "drain-p5", "drain", "deferred", "order") in got
    assert [d for d in got if d[0] in ("g5-0", "g5-1")] == [
        ("g5-0", "taint-g5", "taint", "done", None),
        ("g5-1", "taint-g5", "taint", "done", None),
    ]
    [deferral] = [r for r in engine.log.records() if (r.node, r.action) == ("p5-1", "cordon")]
    assert deferral.reason.startswith(
        "rule 'drain-p5' budget exhausted: 1 of 1 among 4 nodes karpenter.sh/nodepool=p5 already out of "
        "service "
        "(p5-0 held by accel-health (cordon, drain))"
    )
    assert not cluster.nodes["p5-1"].unschedulable
    # A human gives p5-0 back: the pool's slot is free again, and the resend acts on p5-1.
    cluster.nodes["p5-0"] = dataclasses.replace(cluster.nodes["p5-0"], unschedulable=False)
    await engine.handle(webhook(alert("p5-1")))
    await engine.drained()
    assert cluster.nodes["p5-1"].unschedulable


async def test_the_global_budget_still_applies_and_the_tighter_one_names_itself() -> None:
    cluster = pools()
    engine = engine_over(cluster, POOLS.replace("max_disrupted_nodes: 10", "max_disrupted_nodes: 1"))
    await engine.handle(webhook(alert("g5-0"), alert("p5-0")))
    [deferral] = [r for r in engine.log.records() if r.action == "cordon"]
    assert (deferral.node, deferral.outcome, deferral.gate) == ("p5-0", "deferred", "budget")
    assert deferral.reason.startswith("disruption budget exhausted: 1 of 1 nodes already out of service")


async def test_a_pools_budget_counts_a_node_of_that_pool_already_out_of_service() -> None:
    cluster = pools()
    cluster.nodes["p5-3"] = dataclasses.replace(cluster.nodes["p5-3"], unschedulable=True)  # a human's cordon
    cluster.nodes["g5-3"] = dataclasses.replace(cluster.nodes["g5-3"], unschedulable=True)  # another pool's
    engine = engine_over(cluster, POOLS.replace("max_disrupted_nodes: 1\n", "max_disrupted_percent: 50\n"))
    await engine.handle(webhook(alert("p5-0"), alert("p5-1")))
    await engine.drained()
    # 50% of the 4 p5 nodes is 2: p5-3 (cordoned by a human) and p5-0; p5-1 waits.
    assert [(n, a, o, g) for n, _, a, o, g in decisions(engine) if a == "cordon"] == [
        ("p5-0", "cordon", "done", None),
        ("p5-1", "cordon", "deferred", "budget"),
    ]
    [deferral] = [r for r in engine.log.records() if r.outcome == "deferred" and r.action == "cordon"]
    assert "2 of 2 (50% of 4 nodes karpenter.sh/nodepool=p5, rounded down)" in deferral.reason
    assert "p5-3 unschedulable" in deferral.reason
    assert "g5-3" not in deferral.reason


async def test_a_node_the_engine_cannot_see_matches_no_rule_with_a_selector_and_says_why() -> None:
    cluster = pools()
    engine = engine_over(cluster)
    [plan] = await engine.handle(webhook(alert("ghost-0")))
    assert plan.rule is None
    [record] = engine.log.records()
    assert (record.node, record.action, record.outcome) == ("ghost-0", "none", "ignored")
    assert record.reason.startswith("no policy rule matches this alert; rule 'drain-p5' selects nodes")
    assert "node ghost-0 is not in the observed nodes" in record.reason
    assert "rule 'taint-g5' selects nodes (karpenter.sh/nodepool in (g5))" in record.reason
    assert cluster.mutations == []


async def test_a_resolve_runs_the_on_resolved_actions_of_the_rule_its_alert_fired_under() -> None:
    cluster = pools()
    engine = engine_over(cluster, POOLS.replace("actions: [cordon, drain]", "actions: [cordon]"))
    await engine.handle(webhook(alert("p5-0")))
    assert cluster.nodes["p5-0"].unschedulable
    # Relabelled into the other pool while the alert fired: its resolve still belongs to drain-p5.
    cluster.nodes["p5-0"] = dataclasses.replace(cluster.nodes["p5-0"], labels={POOL: "g5"})
    await engine.handle(webhook(alert("p5-0", status="resolved")))
    assert decisions(engine)[-1] == ("p5-0", "drain-p5", "uncordon", "done", None)
    assert not cluster.nodes["p5-0"].unschedulable


async def test_dry_run_counts_what_a_live_service_would_have_disrupted_in_each_pool() -> None:
    dry_cluster = pools()
    dry = engine_over(dry_cluster, dry_run=True)
    live = engine_over(pools())
    for engine in (dry, live):
        await engine.handle(webhook(alert("p5-0"), alert("g5-0")))
        await engine.drained()
        await engine.handle(webhook(alert("p5-1"), alert("g5-1")))
        await engine.drained()
    as_live = {"planned": "done"}
    dry_decisions = [(n, r, a, as_live.get(o, o), g) for n, r, a, o, g in decisions(dry)]
    live_decisions = [d for d in decisions(live) if d[3] != "started"]
    assert sorted(dry_decisions, key=str) == sorted(live_decisions, key=str)  # a live drain ends later
    assert ("p5-1", "drain-p5", "cordon", "done", None) not in live_decisions
    assert dry_cluster.mutations == []
    assert dry.status().as_json()["budget"]["rules"]["drain-p5"]["in_use"] == 1


async def test_the_state_shows_each_rules_budget_in_use(aiohttp_client: AiohttpClient) -> None:
    cluster = pools()
    cluster.nodes["p5-3"] = dataclasses.replace(cluster.nodes["p5-3"], unschedulable=True)
    service = Service(
        dry_run=False,
        policy=parse_policy(POOLS.replace("max_disrupted_nodes: 1\n", "max_disrupted_nodes: 3\n")),
        cluster=cluster,
    )
    client = await aiohttp_client(service.app)
    await client.post(
        "/alerts", json={"version": "4", "status": "firing", "alerts": [alert("p5-0")]}, headers=AUTH
    )
    await service.engine.drained()
    state = await (await client.get("/state", headers=AUTH)).json()
    assert state["budget"]["rules"] == {
        "drain-p5": {
            "selector": "karpenter.sh/nodepool=p5",
            "max_disrupted_nodes": 3,
            "max_disrupted_percent": None,
            "covered_nodes": 4,
            "in_use": 2,
            "capacity": 3,
            # The drain ended: p5-0 is held by the cordon this service made, as the node shows.
            "disrupted": {"p5-0": "held by accel-health (cordon)", "p5-3": "unschedulable"},
        }
    }
    metrics = await (await client.get("/metrics")).text()
    assert 'accel_remediator_rule_nodes_disrupted{rule="drain-p5"} 2.0' in metrics
    assert 'accel_remediator_rule_disruption_budget_nodes{rule="drain-p5"} 3.0' in metrics
