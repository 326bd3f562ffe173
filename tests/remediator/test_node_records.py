"""What the remediator must remember lives on the nodes it acts on (issue 23), over the in-memory
cluster on an injected clock; each test stands for a defect of the gate-state document it replaced.

- A restart (or fail-over) right after an action finds it recorded on the node: a cordon or a
  taint-only hold is still this service's, still counted in the budget, released on resolve; an
  Auto Scaling call whose intent was recorded is not made again when the instance shows it was.
- An episode that resolved is not acted on again by the next leader when a view of Alertmanager read
  before the resolve is reconciled after it.
- A resolved episode stays on its node until the write that releases its last hold: a leader that
  dies between the uncordon and the untaint leaves a taint that still names its episode, and the
  next leader releases it from what Alertmanager shows.
- A live service without AWS calls (no --aws) says so instead of claiming a replacement, and holds no
  budget for it; a node handed to its provisioner gives its slot back when a human un-cordons it; the
  budget follows a human's uncordon at once (GET /state), not at the next delivery.
- An older release's document is moved onto the nodes once and deleted.
- The gates document: written only when the pause or the breaker's latch change; a second writer's
  change is read again and re-applied, never merged into a union.
- The nodes held are listed from the nodes alone (`accel-health-remediator holds`, GET /state).
"""

from __future__ import annotations

import io
import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from remediator import cli, fleet_cli
from remediator.cluster import BackendUnavailable, Node, Taint
from remediator.desired.alertmanager import AlertmanagerView, ShownAlert
from remediator.executors.snapshot import AwsOff, RecordingAws, SnapshotCluster
from remediator.intake.app import create_app
from remediator.intake.payload import WebhookPayload, parse_payload
from remediator.lifecycle.engine import Engine
from remediator.lifecycle.model import EngineSettings
from remediator.lifecycle.record import (
    CORDONED_BY,
    EPISODES,
    MANAGER,
    Episode,
    RecordChange,
    episode_start,
    read,
)
from remediator.policy import parse_policy
from tests.remediator.conftest import AUTH, TOKEN, AiohttpClient, CountingCluster, FakeClock

GPU = ("nvidia.com/gpu",)
STARTS = "2025-11-22T20:00:00Z"


def cluster_of(count: int) -> SnapshotCluster:
    nodes = [
        Node(name=f"n{i}", provider_id=f"aws:///us-west-2a/i-{i:017x}", accelerators=GPU)
        for i in range(count)
    ]
    return SnapshotCluster(nodes=nodes, pods=[], pdbs=[])


def alert(node: str, *, status: str = "firing", name: str = "AccelGPUFatalXid") -> dict[str, Any]:
    return {
        "status": status,
        "labels": {"alertname": name, "node": node},
        "startsAt": STARTS,
        "fingerprint": f"{name}-{node}",
    }


def webhook(*alerts: dict[str, Any]) -> WebhookPayload:
    return parse_payload({"version": "4", "status": "firing", "alerts": list(alerts)})


def engine_over(
    cluster: SnapshotCluster | CountingCluster,
    policy: str,
    *,
    clock: FakeClock,
    aws: RecordingAws | AwsOff | None = None,
) -> Engine:
    return Engine(
        policy=parse_policy(policy),
        cluster=cluster,
        aws=aws if aws is not None else RecordingAws(),
        settings=EngineSettings(),
        clock=clock,
    )


def outcomes(engine: Engine) -> list[tuple[str | None, str, str]]:
    return [(r.node, r.action, r.outcome) for r in engine.log.records()]


TAINT = """
safety: {max_disrupted_nodes: 1}
rules:
  - name: t
    actions: [{type: taint, key: accel-health.io/unhealthy, value: "true", effect: NoSchedule}]
    on_resolved: [untaint]
"""


async def test_a_taint_only_hold_is_still_counted_and_still_ours_after_a_restart() -> None:
    clock = FakeClock()
    cluster = cluster_of(4)
    first = engine_over(cluster, TAINT, clock=clock)
    await first.handle(webhook(alert("n1")))
    record = read(cluster.nodes["n1"].annotations)
    assert list(record.episodes) == ["AccelGPUFatalXid-n1"]  # written with the taint, in one write

    clock.now += 30
    second = engine_over(cluster, TAINT, clock=clock)  # the process died right after the taint
    await second.start()
    assert second.budget.holders()["n1"].kinds == {"taint"}
    assert second.budget.holders()["n1"].since == first.budget.holders()["n1"].since
    await second.handle(webhook(alert("n2")))
    assert outcomes(second) == [("n2", "taint", "deferred")]  # the budget of 1 is still taken
    await second.handle(webhook(alert("n1", status="resolved")))
    assert cluster.nodes["n1"].taints == ()  # it knew the taint was its own
    assert EPISODES not in cluster.nodes["n1"].annotations  # the episode ended with the untaint
    assert second.budget.in_use == 0


REPLACE = """
safety: {max_disrupted_nodes: 2}
rules:
  - {name: r, actions: [cordon, aws_set_unhealthy], on_resolved: []}
"""


async def test_an_auto_scaling_call_asked_for_before_a_failover_is_not_made_again() -> None:
    clock = FakeClock()
    cluster = cluster_of(4)
    aws = RecordingAws()  # AWS itself: what it was told outlives the remediator's processes
    first = engine_over(cluster, REPLACE, clock=clock, aws=aws)
    await first.handle(webhook(alert("n1")))
    assert [op for op, _ in aws.calls] == ["SetInstanceHealth"]

    second = engine_over(cluster, REPLACE, clock=clock, aws=aws)  # a new leader, nothing in memory
    await second.start()
    for _ in range(3):
        await second.handle(webhook(alert("n1")))  # Alertmanager resends
    assert [op for op, _ in aws.calls] == ["SetInstanceHealth"]  # asked of AWS once, in all
    assert outcomes(second) == [("n1", "aws_set_unhealthy", "done")]
    assert "asked for before a fail-over" in second.log.records()[0].reason


async def test_an_intent_recorded_whose_call_never_went_out_is_made_by_the_next_leader() -> None:
    clock = FakeClock()
    cluster = cluster_of(4)
    await cluster.cordon("n1")
    policy = parse_policy(REPLACE)
    # The write that recorded the intent went through; the process died before the call.
    intent = RecordChange(
        episodes=(
            Episode(
                fingerprint="AccelGPUFatalXid-n1",
                rule=policy.rules[0].name,
                alertname="AccelGPUFatalXid",
                start=episode_start(STARTS),
                steps=0b11,
            ),
        ),
        kind="aws_set_unhealthy",
        at=int(clock.now),
    )
    await cluster.annotate_node("n1", {}, record=intent)
    aws = RecordingAws()
    engine = engine_over(cluster, REPLACE, clock=clock, aws=aws)
    await engine.handle(webhook(alert("n1")))
    assert [op for op, _ in aws.calls] == ["SetInstanceHealth"]  # the instance was Healthy: asked now
    await engine.handle(webhook(alert("n1")))
    assert [op for op, _ in aws.calls] == ["SetInstanceHealth"]


async def test_without_aws_calls_a_live_service_says_so_and_claims_no_replacement() -> None:
    clock = FakeClock()
    cluster = cluster_of(4)
    policy = "safety: {max_disrupted_nodes: 1}\nrules:\n  - {name: r, actions: [aws_set_unhealthy]}\n"
    engine = engine_over(cluster, policy, clock=clock, aws=AwsOff())
    await engine.handle(webhook(alert("n1")))
    [record] = engine.log.records()
    assert (record.action, record.outcome) == ("aws_set_unhealthy", "skipped")
    assert "AWS calls are off" in record.reason
    assert "nothing replaces the node" in record.reason
    assert not [e for e in cluster.events if e["reason"] == "AccelInstanceMarkedUnhealthy"]
    assert engine.budget.in_use == 0  # no slot held for a replacement that never comes
    await engine.handle(webhook(alert("n2")))
    assert outcomes(engine)[-1] == ("n2", "aws_set_unhealthy", "skipped")  # not deferred by budget


async def test_a_node_handed_over_gives_its_slot_back_when_a_human_uncordons_it(
    aiohttp_client: AiohttpClient,
) -> None:
    clock = FakeClock()
    cluster = cluster_of(4)
    for name in ("n1", "n2"):
        labels = {"karpenter.sh/nodepool": "p5"}
        cluster.nodes[name] = Node(
            name=name, labels=labels, provider_id=cluster.nodes[name].provider_id, accelerators=GPU
        )
    policy = (
        "safety: {max_disrupted_nodes: 1}\n"
        "rules:\n  - {name: r, actions: [cordon, {type: aws_set_unhealthy, handover_condition: X}]}\n"
    )
    engine = engine_over(cluster, policy, clock=clock)
    client = await aiohttp_client(create_app(engine=engine, token=TOKEN))
    await engine.handle(webhook(alert("n1")))
    assert ("X", "False") in [(c.type, c.status) for c in cluster.nodes["n1"].conditions]
    state = await (await client.get("/state", headers=AUTH)).json()
    assert state["budget"]["in_use"] == 1

    await cluster.uncordon("n1")  # a human put it back into service
    state = await (await client.get("/state", headers=AUTH)).json()  # no delivery in between
    assert state["budget"]["in_use"] == 0
    await engine.handle(webhook(alert("n2")))
    assert outcomes(engine)[-2:] == [("n2", "cordon", "done"), ("n2", "aws_set_unhealthy", "done")]


async def test_an_older_releases_document_is_moved_onto_the_nodes_once_and_deleted() -> None:
    clock = FakeClock()
    cluster = cluster_of(4)
    await cluster.cordon("n1")  # what the older release did: the cordon and its ownership annotation
    assert cluster.nodes["n1"].annotations[CORDONED_BY] == MANAGER
    cluster.legacy_state = json.dumps(
        {
            "version": 1,
            "pause": {"paused": True, "since": 5.0, "reason": "from the old release"},
            "breaker": {"open": False, "opened_at": 0, "trips": 2, "eligible": 4, "alerting": 1},
            "budget": {"n1": {"since": 1_700_000_000.0, "kinds": ["cordon"]}},
            "cordoned": ["n1"],
            "decided": ["0123456789abcdef"],
            "firing": {
                "n1": {
                    "AccelGPUFatalXid-n1": {
                        "alertname": "AccelGPUFatalXid",
                        "rule": "c",
                        "holds": ["cordon"],
                        "expires": 1_700_009_999.0,
                        "labels": {"alertname": "AccelGPUFatalXid", "node": "n1"},
                        "startsAt": "2025-11-22T20:00:00.000Z",
                    }
                }
            },
        }
    )
    policy = "rules: [{name: c, actions: [condition, cordon], on_resolved: [uncordon]}]"
    engine = engine_over(cluster, policy, clock=clock)
    await engine.start()
    assert await cluster.load_legacy_state() is None  # read once, then deleted
    record = read(cluster.nodes["n1"].annotations)
    assert record.episodes["AccelGPUFatalXid-n1"].steps == 0b11  # cordon shown, so the condition before it
    assert engine.status().paused  # the switch moved to the gates document
    assert json.loads(cluster.gates or "{}")["breaker"]["trips"] == 2
    await engine.set_paused(False)
    await engine.handle(webhook(alert("n1")))  # a resend: nothing twice
    assert [m for m in cluster.mutations if m.startswith(("cordon", "condition"))] == ["cordon n1"]
    await engine.handle(webhook(alert("n1", status="resolved")))
    assert not cluster.nodes["n1"].unschedulable


async def test_the_gates_are_written_only_when_they_change_and_a_conflict_reapplies_the_change() -> None:
    clock = FakeClock()
    cluster = cluster_of(10)
    counting = CountingCluster(cluster)
    engine = engine_over(counting, "rules: [{name: c, actions: [cordon]}]", clock=clock)
    await engine.handle(webhook(*(alert(f"n{i}") for i in range(4))))  # 40 %: the breaker opens
    assert counting.calls["save_gates"] == 1
    for _ in range(20):
        await engine.handle(webhook(*(alert(f"n{i}") for i in range(4))))
    assert counting.calls["save_gates"] == 1  # still open: nothing to write
    await engine.set_paused(True, "one")
    await engine.set_paused(True, "one again")  # already paused: the reason is not worth a write
    assert counting.calls["save_gates"] == 2
    assert len(cluster.gates or "") <= 1024

    other = engine_over(cluster, "rules: [{name: c, actions: [cordon]}]", clock=clock)
    await other.start()
    assert other.status().paused
    assert other.status().breaker_open
    await other.set_paused(False)  # an operator resumes through the other replica
    doc = json.loads(cluster.gates or "{}")
    assert doc["pause"]["paused"] is False
    assert doc["breaker"]["open"] is True  # the latch it found is kept, not replaced by a stale one


async def test_a_node_condition_false_is_written_with_the_quarantine_record_in_one_write() -> None:
    clock = FakeClock()
    cluster = cluster_of(3)
    counting = CountingCluster(cluster)
    engine = engine_over(counting, "rules: [{name: c, actions: [condition, cordon]}]", clock=clock)
    await engine.handle(webhook(alert("n1")))
    node = cluster.nodes["n1"]
    assert ("AcceleratorHealthy", "False") in [(c.type, c.status) for c in node.conditions]
    assert json.loads(node.annotations["accel-health.io/quarantine"])["alerts"] == ["AccelGPUFatalXid"]
    assert counting.calls["annotate_node"] == 0  # the condition's own write carried it
    assert counting.calls["set_condition"] == 1


async def test_the_nodes_held_are_listed_from_the_nodes_alone_by_the_command_and_the_state(
    aiohttp_client: AiohttpClient, tmp_path: Path
) -> None:
    clock = FakeClock()
    cluster = cluster_of(4)
    policy = "rules: [{name: c, actions: [condition, cordon, event]}]"
    engine = engine_over(cluster, policy, clock=clock)
    await engine.handle(webhook(alert("n1")))
    client = await aiohttp_client(create_app(engine=engine, token=TOKEN))
    state = await (await client.get("/state", headers=AUTH)).json()
    assert state["holds"] == {
        "n1": {
            "since": "2023-11-14T22:13:20Z",
            "marks": ["cordon"],
            "episodes": [
                {
                    "alertname": "AccelGPUFatalXid",
                    "fingerprint": "AccelGPUFatalXid-n1",
                    "rule": "c",
                    "startsAt": "2025-11-22T20:00:00Z",
                    "done": ["condition", "cordon"],  # the event is not recorded: it writes no node
                    "next": "event",
                }
            ],
        }
    }
    # The command reads the nodes only: a snapshot of them, as `kubectl get nodes -o yaml` gives.
    items = [_node_object(n) for n in cluster.nodes.values()]
    snapshot = tmp_path / "nodes.yaml"
    snapshot.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": items}))
    (tmp_path / "policy.yaml").write_text(policy)
    out = io.StringIO()
    args = ["--cluster-snapshot", str(snapshot), "--config", str(tmp_path / "policy.yaml")]
    assert cli.holds(args, out=out) == 0
    assert out.getvalue() == (
        "n1  since 2023-11-14T22:13:20Z  [cordon]\n"
        "  AccelGPUFatalXid (rule c, started 2025-11-22T20:00:00Z, AccelGPUFatalXid-n1): done condition, "
        "cordon; next event\n"
    )
    out = io.StringIO()
    assert cli.holds([*args, "--json"], out=out) == 0
    assert json.loads(out.getvalue()) == state["holds"]


async def test_status_says_each_nodes_phase_since_alerts_next_step_and_what_it_waits_on(
    aiohttp_client: AiohttpClient, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    clock = FakeClock()
    cluster = cluster_of(6)
    policy = "safety: {max_disrupted_nodes: 1}\nrules: [{name: c, actions: [condition, cordon]}]"
    engine = engine_over(cluster, policy, clock=clock)
    await engine.handle(webhook(alert("n1")))
    await engine.handle(webhook(alert("n2")))  # the budget of 1 is taken by n1: deferred
    client = await aiohttp_client(create_app(engine=engine, token=TOKEN))
    state = await (await client.get("/state", headers=AUTH)).json()
    n1, n2 = state["nodes"]["n1"], state["nodes"]["n2"]
    assert (n1["phase"], n1["since"], n1["alerts"]) == ("held", "2023-11-14T22:13:20Z", ["AccelGPUFatalXid"])
    assert n1["next"] == "verification once repaired and its alerts resolved, then the return to the pool"
    assert n1["waits_on"].startswith("a repair: a reboot, a new node or instance")
    assert n2["phase"] == "held"  # its condition is set: out of the pool, the cordon deferred
    assert n2["next"] == "cordon"
    assert n2["waits_on"].startswith("gate budget: disruption budget exhausted")
    assert state["phases"]["held"] == 2
    metrics = await (await client.get("/metrics")).text()
    assert 'accel_remediator_nodes_in_phase{phase="held"} 2.0' in metrics
    assert 'accel_remediator_nodes_in_phase{phase="draining"} 0.0' in metrics
    # The operator's command, from the nodes alone: the same phases, no gate (no remediator asked).
    items = [_node_object(n) for n in cluster.nodes.values()]
    snapshot = tmp_path / "nodes.yaml"
    snapshot.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": items}))
    (tmp_path / "policy.yaml").write_text(policy)
    args = ["status", "--cluster-snapshot", str(snapshot), "--config", str(tmp_path / "policy.yaml")]
    assert fleet_cli.main(args) == 0
    text = capsys.readouterr().out
    assert "n1  held since 2023-11-14T22:13:20Z  [cordon]" in text
    assert "n2  held since 2023-11-14T22:13:20Z  [nothing on the node now]" in text
    assert "  next: cordon\n" in text
    assert fleet_cli.main([*args, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["n2"]["waits_on"] == ""  # only a running remediator knows its deferrals
    assert {k: v["phase"] for k, v in shown.items()} == {"n1": "held", "n2": "held"}


def _node_object(node: Node) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": node.name, "annotations": dict(node.annotations), "labels": dict(node.labels)},
        "spec": {"unschedulable": node.unschedulable, "providerID": node.provider_id},
        "status": {"capacity": {"nvidia.com/gpu": "8"}},
    }


async def test_a_delivery_whose_actions_were_done_is_answered_200_even_when_the_gates_cannot_be_written(
    aiohttp_client: AiohttpClient,
) -> None:
    """Issue 23: a failed save of the old document turned a delivery whose cordons already ran into a
    503 (and every later one). Now the record is the action's own write; the gates document (here:
    the breaker opening) is saved with the next change when it cannot be now."""

    class GatesDown(SnapshotCluster):
        async def save_gates(self, document: Mapping[str, Any]) -> None:
            raise BackendUnavailable("etcd quota exceeded")

    nodes = [Node(name=f"n{i}", accelerators=GPU) for i in range(10)]
    cluster = GatesDown(nodes=nodes, pods=[], pdbs=[])
    policy = "rules: [{name: c, actions: [cordon]}]"
    engine = engine_over(cluster, policy, clock=FakeClock())
    client = await aiohttp_client(create_app(engine=engine, token=TOKEN))
    first = {"version": "4", "status": "firing", "alerts": [alert("n1")]}
    assert (await client.post("/alerts", json=first, headers=AUTH)).status == 200
    assert cluster.nodes["n1"].unschedulable
    storm = {"version": "4", "status": "firing", "alerts": [alert(f"n{i}") for i in range(2, 6)]}
    assert (await client.post("/alerts", json=storm, headers=AUTH)).status == 200  # the breaker opens
    assert engine.status().breaker_open
    assert (await client.post("/alerts", json=first, headers=AUTH)).status == 200  # and after it too


async def test_idempotency_outlives_the_processes_memory_the_node_remembers_the_steps() -> None:
    """Issue 23: the idempotency keys were an LRU of 20,000, so keys of a long episode fell out and
    were decided again after a fail-over. The steps are on the node now, whatever memory forgot."""
    clock = FakeClock()
    cluster = cluster_of(4)
    counting = CountingCluster(cluster)
    engine = engine_over(counting, "rules: [{name: c, actions: [condition, cordon, event]}]", clock=clock)
    await engine.handle(webhook(alert("n1")))
    engine.decided._keys.clear()  # the process forgot every key (an LRU overflowing, a restart)
    calls = dict(counting.calls)
    await engine.handle(webhook(alert("n1")))
    assert counting.calls["set_condition"] == calls["set_condition"] == 1
    assert counting.calls["cordon"] == calls["cordon"] == 1
    # The fault seen is not told again (the node records the episode it was told with); the event
    # action, the one step the node does not record, runs again.
    assert counting.calls["record_event"] == calls["record_event"] + 1


GIVE_BACK = """
safety: {max_disrupted_nodes: 2}
rules:
  - name: f
    actions: [cordon, {type: taint, key: accel-health.io/unhealthy, value: "true", effect: NoSchedule}]
    on_resolved: [uncordon, {type: untaint, key: accel-health.io/unhealthy}]
"""


class GoneAfterUncordon(SnapshotCluster):
    """The leader dies (or the API goes away) after the uncordon's write, before the untaint's."""

    gone = False

    async def remove_taint(self, node: str, taint: Taint, *, record: RecordChange | None = None) -> None:
        if self.gone:
            raise BackendUnavailable("the leader died before this write")
        await super().remove_taint(node, taint, record=record)


async def test_a_resolved_episode_names_its_taint_until_the_write_that_removes_it() -> None:
    clock = FakeClock()
    cluster = GoneAfterUncordon(nodes=list(cluster_of(4).nodes.values()), pods=[], pdbs=[])
    first = engine_over(cluster, GIVE_BACK, clock=clock)
    await first.handle(webhook(alert("n1")))
    cluster.gone = True
    with pytest.raises(BackendUnavailable):
        await first.handle(webhook(alert("n1", status="resolved")))
    node = cluster.nodes["n1"]
    assert not node.unschedulable
    assert [t.key for t in node.taints] == ["accel-health.io/unhealthy"]
    assert list(read(node.annotations).episodes) == ["AccelGPUFatalXid-n1"]  # the taint names its episode

    cluster.gone = False
    clock.now += 10
    second = engine_over(cluster, GIVE_BACK, clock=clock)  # the next leader
    await second.start()
    await second.reconcile(AlertmanagerView(alerts={}, reached=("http://alertmanager:9093",)))
    node = cluster.nodes["n1"]
    assert node.taints == ()  # Alertmanager shows it no more: released
    assert EPISODES not in node.annotations  # and forgotten by the write that released it
    assert second.budget.in_use == 0


async def test_a_view_read_before_a_delivery_does_not_resolve_what_the_delivery_said_fires() -> None:
    """An Alertmanager read is sent, a webhook says a new alert fires, then the read's answer (from
    before that alert) comes back without it: not a resolve. A read begun after the delivery is."""
    clock = FakeClock()
    cluster = cluster_of(4)
    engine = engine_over(cluster, GIVE_BACK, clock=clock)
    await engine.start()
    read_began = time.monotonic()
    await engine.handle(webhook(alert("n1")))
    await engine.reconcile(
        AlertmanagerView(alerts={}, reached=("http://alertmanager:9093",), read_at=read_began)
    )

    def held() -> bool:
        return cluster.nodes["n1"].unschedulable

    assert held()  # still held: the answer predates the delivery
    assert [name for name, _ in engine.firing.all()] == ["n1"]
    later = AlertmanagerView(alerts={}, reached=("http://alertmanager:9093",), read_at=time.monotonic())
    await engine.reconcile(later)
    assert not held()  # a read begun after it shows it no more: resolved
    assert engine.firing.all() == []


async def test_a_view_read_before_a_resolve_does_not_act_again_on_the_next_leader() -> None:
    clock = FakeClock()
    cluster = cluster_of(4)
    first = engine_over(cluster, GIVE_BACK, clock=clock)
    await first.handle(webhook(alert("n1")))  # cordoned and tainted by the first leader
    counting = CountingCluster(cluster)
    second = engine_over(counting, GIVE_BACK, clock=clock)  # the next leader
    await second.start()
    firing = webhook(alert("n1")).alerts[0]
    stale = AlertmanagerView(
        alerts={firing.fingerprint: ShownAlert(alert=firing, suppressed="")},
        reached=("http://alertmanager:9093",),
    )
    await second.handle(webhook(alert("n1", status="resolved")))
    node = cluster.nodes["n1"]
    assert not node.unschedulable
    assert node.taints == ()
    await second.reconcile(stale)  # Alertmanager read before the resolve, reconciled after it
    node = cluster.nodes["n1"]
    assert not node.unschedulable  # the episode ended: not cordoned again
    assert node.taints == ()
    assert counting.calls["cordon"] == 0
    assert counting.calls["add_taint"] == 0
