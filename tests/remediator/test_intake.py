"""The webhook service end to end in-process: auth, input validation, idempotency, dry-run, gates.

Each test drives the real app (pytest-aiohttp) over the real snapshot backend from
examples/cluster-snapshot.yaml; the backend records every mutating call, so dry-run can be checked
to make none.
"""

from __future__ import annotations

import base64
import io
from typing import Any

from remediator.cluster import BackendUnavailable
from remediator.executors.snapshot import SnapshotCluster
from remediator.policy import parse_policy
from tests.remediator.conftest import AUTH, SNAPSHOT, AiohttpClient, Service, payload


async def _actions(client: Any) -> list[dict[str, Any]]:
    resp = await client.get("/actions", headers=AUTH)
    assert resp.status == 200
    records: list[dict[str, Any]] = await resp.json()
    return records


async def test_a_delivery_without_or_with_a_wrong_token_is_refused(
    aiohttp_client: AiohttpClient, dry_service: Service
) -> None:
    client = await aiohttp_client(dry_service.app)
    assert (await client.post("/alerts", json=payload("gpu-fatal-xid"))).status == 401
    wrong = {"Authorization": "Bearer nope"}
    assert (await client.post("/alerts", json=payload("gpu-fatal-xid"), headers=wrong)).status == 401
    assert (await client.get("/actions")).status == 401
    assert dry_service.engine.log.records() == []


async def test_bad_input_gets_a_400_naming_the_field_and_changes_nothing(
    aiohttp_client: AiohttpClient, dry_service: Service
) -> None:
    client = await aiohttp_client(dry_service.app)
    cases = {
        b"not json": "not valid JSON",
        b"[]": "expected a JSON object",
        b"{}": "alerts: required field is missing",
        b'{"alerts": {}}': "alerts: expected an array",
        b'{"alerts": [{"labels": {"node": 3}}]}': "alerts[0].labels.node: expected a string",
        b'{"alerts": [{"labels": {}, "status": "maybe", "startsAt": "t"}]}': "alerts[0].status",
        b'{"alerts": [], "truncatedAlerts": "x"}': "truncatedAlerts",
        b'{"version": "5", "alerts": []}': 'version: expected "4"',
        b'{"alerts": [{"labels": {"node": "n"}}]}': "alerts[0].startsAt: required field is missing",
        # What would make a node write fail (422) later: said at the door, nothing done.
        (
            b'{"alerts": [{"labels": {"alertname": "'
            + b"A" * 129
            + b'", "node": "n"}, "startsAt": "2026-11-28T10:00:00Z", "fingerprint": "f1"}]}'
        ): "alerts[0].labels.alertname: 129 characters, at most 128",
        (
            b'{"alerts": [{"labels": {"node": "n"}, "startsAt": "2026-11-28T10:00:00Z", "fingerprint": "'
            + b"f" * 65
            + b'"}]}'
        ): "alerts[0].fingerprint: expected 1 to 64 letters",
        (
            b'{"alerts": [{"labels": {"node": "n"}, "startsAt": "2026-11-28T10:00:00Z", '
            b'"fingerprint": "a\\"b"}]}'
        ): "alerts[0].fingerprint",
    }
    for body, message in cases.items():
        resp = await client.post("/alerts", data=body, headers=AUTH)
        assert resp.status == 400, body
        assert message in (await resp.json())["error"], body
    assert dry_service.engine.log.records() == []
    assert dry_service.cluster.mutations == []


async def test_a_body_over_one_mebibyte_gets_413(aiohttp_client: AiohttpClient, dry_service: Service) -> None:
    client = await aiohttp_client(dry_service.app)
    big = b'{"alerts": [], "pad": "' + b"x" * (1024 * 1024) + b'"}'
    resp = await client.post("/alerts", data=io.BytesIO(big), headers=AUTH)
    assert resp.status == 413


async def test_unknown_paths_are_404_and_probes_answer(
    aiohttp_client: AiohttpClient, dry_service: Service
) -> None:
    client = await aiohttp_client(dry_service.app)
    assert (await client.get("/nope")).status == 404
    assert (await client.get("/healthz")).status == 200
    assert (await client.get("/readyz")).status == 200


async def test_a_fatal_xid_in_dry_run_plans_condition_cordon_drain_and_mutates_nothing(
    aiohttp_client: AiohttpClient, dry_service: Service
) -> None:
    client = await aiohttp_client(dry_service.app)
    resp = await client.post("/alerts", json=payload("gpu-fatal-xid"), headers=AUTH)
    assert resp.status == 200
    records = await _actions(client)
    assert [r["action"] for r in records] == ["condition", "cordon", "evidence", "drain"]
    # This service was given no evidence store (the command's services always have one): skipped.
    assert [r["outcome"] for r in records] == ["planned", "planned", "skipped", "planned"]
    assert all(r["dry_run"] is True and r["node"] == "gpu-node-1" and r["rule"] == "drain" for r in records)
    drain = records[3]
    assert set(drain) == {
        "time", "node", "action", "alertname", "fingerprint", "starts_at", "status",
        "rule", "dry_run", "outcome", "reason", "gate", "details",
    }  # fmt: skip
    evicted = {(p["namespace"], p["name"]) for p in drain["details"]["evict"]}
    assert ("ml-team", "llama-pretrain-worker-0") in evicted
    assert drain["details"]["blocked"] == [
        {
            "namespace": "ml-team",
            "name": "llama-pretrain-worker-1",
            "reason": "blocked by PodDisruptionBudget ml-team/llama-pretrain (disruptionsAllowed=0)",
        }
    ]
    skipped = {p["name"]: p["reason"] for p in drain["details"]["skip"]}
    assert "DaemonSet" in skipped["accel-health-exporter-7x2kp"]
    assert dry_service.cluster.mutations == []
    assert dry_service.aws.calls == []


async def test_the_same_payload_delivered_fifty_times_acts_once(
    aiohttp_client: AiohttpClient, live_service: Service
) -> None:
    client = await aiohttp_client(live_service.app)
    body = payload("neuron-hw-error")
    for _ in range(50):
        assert (await client.post("/alerts", json=body, headers=AUTH)).status == 200
    await live_service.engine.drained()
    records = await _actions(client)
    assert [(r["action"], r["outcome"]) for r in records] == [
        ("condition", "done"),
        ("cordon", "done"),
        ("evidence", "skipped"),  # this service has no evidence store
        ("drain", "started"),
        ("drain", "done"),
        ("aws_set_unhealthy", "done"),
    ]
    assert live_service.counting.calls["drain"] == 1
    assert live_service.aws.calls == [
        ("SetInstanceHealth", {"InstanceId": "i-0a1b2c3d4e5f60002", "HealthStatus": "Unhealthy"})
    ]
    assert live_service.cluster.mutations.count("cordon trn-node-1") == 1
    assert live_service.cluster.nodes["trn-node-1"].unschedulable
    assert not [p for p in live_service.cluster.pods.values() if p.name.startswith("bert-large")]
    metrics = await (await client.get("/metrics")).text()
    assert 'accel_remediator_webhooks_total{code="200"} 50.0' in metrics
    assert "accel_remediator_nodes_disrupted 1.0" in metrics
    assert 'accel_remediator_actions_total{action="drain",dry_run="false",outcome="done"} 1.0' in metrics


async def test_a_drain_a_pdb_blocks_ends_failed_naming_the_pod_and_is_not_started_again(
    aiohttp_client: AiohttpClient, live_service: Service
) -> None:
    client = await aiohttp_client(live_service.app)
    body = payload("gpu-fatal-xid")
    await client.post("/alerts", json=body, headers=AUTH)
    await live_service.engine.drained()
    await client.post("/alerts", json=body, headers=AUTH)  # a resend after the drain ended
    await live_service.engine.drained()
    records = await _actions(client)
    assert [(r["action"], r["outcome"]) for r in records] == [
        ("condition", "done"),
        ("cordon", "done"),
        ("evidence", "skipped"),  # this service has no evidence store
        ("drain", "started"),
        ("drain", "failed"),
    ]
    [blocked] = records[4]["details"]["blocked"]
    assert (blocked["namespace"], blocked["name"]) == ("ml-team", "llama-pretrain-worker-1")
    assert "429" in blocked["reason"]
    assert "PodDisruptionBudget" in blocked["reason"]
    assert records[4]["details"]["timed_out"] is True
    assert live_service.counting.calls["drain"] == 1
    evictions = [m for m in live_service.cluster.mutations if m.startswith("evict")]
    assert "evict ml-team/llama-pretrain-worker-0" in evictions
    assert ("ml-team", "llama-pretrain-worker-1") in live_service.cluster.pods
    state = await (await client.get("/state", headers=AUTH)).json()
    assert state["pending"] == []
    assert state["drains"] == {}


async def test_a_resolved_alert_is_never_destructive(
    aiohttp_client: AiohttpClient, live_service: Service
) -> None:
    client = await aiohttp_client(live_service.app)
    body = payload("gpu-fatal-xid")
    for alert in body["alerts"]:
        alert["status"] = "resolved"
        alert["endsAt"] = "2025-11-22T21:00:00Z"
    assert (await client.post("/alerts", json=body, headers=AUTH)).status == 200
    records = await _actions(client)
    assert [(r["action"], r["outcome"], r["status"]) for r in records] == [("none", "ignored", "resolved")]
    assert live_service.cluster.mutations == []


async def test_uncordon_on_resolve_only_touches_nodes_this_service_cordoned(
    aiohttp_client: AiohttpClient,
) -> None:
    policy = parse_policy(
        "rules:\n  - name: c\n    match: []\n    actions: [cordon]\n    on_resolved: [uncordon]\n"
    )
    service = Service(dry_run=False, policy=policy)
    client = await aiohttp_client(service.app)
    firing = payload("gpu-fatal-xid")
    await client.post("/alerts", json=firing, headers=AUTH)
    resolved = payload("gpu-fatal-xid")
    resolved["alerts"][0]["status"] = "resolved"
    await client.post("/alerts", json=resolved, headers=AUTH)
    assert service.cluster.mutations == [
        "cordon gpu-node-1",
        "event gpu-node-1 Warning AccelFaultDetected",  # the fault seen, and the cordon done for it
        "uncordon gpu-node-1",
        "event gpu-node-1 Normal AccelUncordoned",
    ]
    assert service.engine.budget.in_use == 0


async def test_alerts_without_a_node_label_or_with_remediation_none_are_recorded_as_ignored(
    aiohttp_client: AiohttpClient, dry_service: Service
) -> None:
    client = await aiohttp_client(dry_service.app)
    body = payload("gpu-fatal-xid")
    no_node = dict(body["alerts"][0], labels={"alertname": "X"}, fingerprint="f1")
    ignored = dict(body["alerts"][0], fingerprint="f2")
    ignored["labels"] = dict(ignored["labels"], remediation="none")
    body["alerts"] = [no_node, ignored]
    assert (await client.post("/alerts", json=body, headers=AUTH)).status == 200
    records = await _actions(client)
    assert [(r["action"], r["outcome"]) for r in records] == [("none", "ignored"), ("none", "ignored")]
    assert "no 'node' label" in records[0]["reason"]
    assert records[0]["node"] is None


async def test_control_plane_and_opted_out_nodes_are_skipped_with_the_reason(
    aiohttp_client: AiohttpClient, live_service: Service
) -> None:
    client = await aiohttp_client(live_service.app)
    body = payload("gpu-fatal-xid")
    body["alerts"][0]["labels"]["node"] = "cp-1"
    await client.post("/alerts", json=body, headers=AUTH)
    records = await _actions(client)
    assert {r["outcome"] for r in records} == {"skipped"}
    assert "control-plane" in records[0]["reason"]
    assert live_service.cluster.mutations == []


async def test_the_budget_defers_the_third_node_with_gate_budget(aiohttp_client: AiohttpClient) -> None:
    policy = parse_policy("safety: {max_disrupted_nodes: 1}\nrules:\n  - name: c\n    actions: [cordon]\n")
    service = Service(dry_run=True, policy=policy)
    client = await aiohttp_client(service.app)
    await client.post("/alerts", json=payload("gpu-fatal-xid"), headers=AUTH)
    await client.post("/alerts", json=payload("neuron-hw-error"), headers=AUTH)
    await client.post("/alerts", json=payload("neuron-hw-error"), headers=AUTH)  # re-evaluated, still held
    records = await _actions(client)
    assert [(r["node"], r["outcome"], r["gate"]) for r in records] == [
        ("gpu-node-1", "planned", None),
        ("trn-node-1", "deferred", "budget"),
    ]
    assert "re-evaluated when Alertmanager resends" in records[1]["reason"]
    assert service.cluster.mutations == []
    metrics = await (await client.get("/metrics")).text()
    assert 'accel_remediator_deferred_actions{gate="budget"} 1.0' in metrics
    assert 'accel_remediator_actions_total{action="cordon",dry_run="true",outcome="deferred"} 1.0' in metrics


async def test_a_rule_with_dry_run_only_plans_even_when_the_service_acts(
    aiohttp_client: AiohttpClient,
) -> None:
    policy = parse_policy("rules:\n  - name: c\n    actions: [cordon, event]\n    dry_run: true\n")
    service = Service(dry_run=False, policy=policy)
    client = await aiohttp_client(service.app)
    await client.post("/alerts", json=payload("gpu-fatal-xid"), headers=AUTH)
    records = await _actions(client)
    assert [(r["outcome"], r["dry_run"]) for r in records] == [("planned", True), ("planned", True)]
    assert service.cluster.mutations == []


async def test_basic_auth_is_accepted_with_the_right_user_and_password_only(
    aiohttp_client: AiohttpClient,
) -> None:
    service = Service(dry_run=True, basic_auth=("alertmanager", "pa:ss"))
    client = await aiohttp_client(service.app)

    def basic(text: str) -> dict[str, str]:
        return {"Authorization": "Basic " + base64.b64encode(text.encode()).decode()}

    body = payload("gpu-fatal-xid")
    assert (await client.post("/alerts", json=body, headers=basic("alertmanager:pa:ss"))).status == 200
    for wrong in ("alertmanager:pa", "other:pa:ss", "alertmanager", ""):
        assert (await client.post("/alerts", json=body, headers=basic(wrong))).status == 401
    bad = {"Authorization": "Basic %%%not-base64"}
    assert (await client.post("/alerts", json=body, headers=bad)).status == 401
    assert (await client.post("/alerts", json=body, headers=AUTH)).status == 200  # the token still works


async def test_pause_and_resume_over_http_hold_and_release_every_action(
    aiohttp_client: AiohttpClient, live_service: Service
) -> None:
    client = await aiohttp_client(live_service.app)
    assert (await client.post("/pause")).status == 401
    resp = await client.post("/pause", json={"reason": "GPU driver rollout"}, headers=AUTH)
    assert await resp.json() == {"paused": True, "changed": True}
    await client.post("/alerts", json=payload("gpu-fatal-xid"), headers=AUTH)
    records = await _actions(client)
    assert {(r["outcome"], r["gate"]) for r in records} == {("deferred", "pause")}
    assert "GPU driver rollout" in records[0]["reason"]
    assert live_service.cluster.mutations == []
    metrics = await (await client.get("/metrics")).text()
    assert "accel_remediator_paused 1.0" in metrics
    assert (await client.post("/pause", data=b"[1]", headers=AUTH)).status == 400

    assert (await (await client.post("/resume", headers=AUTH)).json())["changed"] is True
    await client.post("/alerts", json=payload("gpu-fatal-xid"), headers=AUTH)
    assert "cordon gpu-node-1" in live_service.cluster.mutations
    assert live_service.cluster.gates is not None  # the switch, kept in the cluster
    assert '"paused": false' in live_service.cluster.gates
    assert live_service.cluster.gates_saves == 2  # written when it changed, and only then


async def test_state_shows_the_gates_and_needs_credentials(
    aiohttp_client: AiohttpClient, dry_service: Service
) -> None:
    client = await aiohttp_client(dry_service.app)
    assert (await client.get("/state")).status == 401
    await client.post("/alerts", json=payload("gpu-fatal-xid"), headers=AUTH)
    state = await (await client.get("/state", headers=AUTH)).json()
    assert state["dry_run"] is True
    assert state["paused"] is False
    assert state["budget"]["in_use"] == 1
    assert state["budget"]["capacity"] == 2
    assert state["budget"]["holders"]["gpu-node-1"]["dry_run"] is True
    assert state["breaker"]["open"] is False
    assert state["breaker"]["eligible_nodes"] == 3
    metrics = await (await client.get("/metrics")).text()
    for line in (
        "accel_remediator_breaker_open 0.0",
        "accel_remediator_breaker_trips_total 0.0",
        "accel_remediator_nodes_disrupted 1.0",
        "accel_remediator_disruption_budget_nodes 2.0",
        "accel_remediator_eligible_nodes 3.0",
        "accel_remediator_alerting_nodes 1.0",
    ):
        assert line in metrics


async def test_an_unreachable_cluster_answers_503_so_that_alertmanager_retries(
    aiohttp_client: AiohttpClient,
) -> None:
    class Unreachable(SnapshotCluster):
        async def get_node(self, name: str) -> Any:
            raise BackendUnavailable("apiserver: connection refused")

    cluster = Unreachable.from_file(SNAPSHOT)
    service = Service(dry_run=False, cluster=cluster)
    client = await aiohttp_client(service.app)
    resp = await client.post("/alerts", json=payload("gpu-fatal-xid"), headers=AUTH)
    assert resp.status == 503
    assert "connection refused" in (await resp.json())["error"]
    metrics = await (await client.get("/metrics")).text()
    assert 'accel_remediator_webhooks_total{code="503"} 1.0' in metrics
