"""Events on the node: with the default policy every node action done for real leaves one core/v1
Event that `kubectl describe node` lists (the fault seen, with the first action done for it; cordoned,
drain started, drain finished or blocked and by what, instance marked for replacement), reported by
accel-health-remediator.

Over the engine and the Kubernetes executor against the HTTP-level fake API server. The policy's
`events` setting narrows them to failures or turns them off; a dry-run writes none and its decision
records list the Events a live run would write; an Event that cannot be written undoes nothing.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from importlib import resources
from typing import Any

import pytest
from kubernetes.aio import client as k8s

from remediator.executors.kubernetes import KubernetesCluster
from remediator.executors.snapshot import RecordingAws
from remediator.intake.payload import parse_payload
from remediator.lifecycle.engine import Engine
from remediator.lifecycle.model import EngineSettings
from remediator.policy import PolicyError, parse_policy
from tests.remediator.fake_apiserver import FakeApiServer, node, pdb, pod, serve, status_error
from tests.remediator.test_background_drain import FAST_API, FAST_DRAIN, INSTANCE, NODE, alert_body

DEFAULT_POLICY = resources.files("remediator").joinpath("default_policy.yaml").read_text(encoding="utf-8")


def replace_alert() -> dict[str, Any]:
    body = alert_body()
    body["alerts"][0]["labels"]["remediation"] = "replace"
    body["alerts"][0]["annotations"] = {"summary": "GPU 4 on gpu-node-1 reported fatal Xid 79"}
    return body


def events(api: FakeApiServer) -> list[dict[str, Any]]:
    """The Events stored, oldest first (their names end in a nanosecond clock)."""
    return sorted(
        (obj for (plural, _, _), obj in api.store.items() if plural == "events"),
        key=lambda e: int(e["metadata"]["name"].rsplit(".", 1)[1], 16),
    )


@pytest.fixture
async def cluster_api() -> AsyncIterator[tuple[FakeApiServer, KubernetesCluster]]:
    async with serve() as (api, url):
        api.add(node(NODE, provider_id=f"aws:///us-east-1a/{INSTANCE}"))
        api.add(pod("worker-0", node_name=NODE))
        cluster = KubernetesCluster(api=k8s.ApiClient(k8s.Configuration(host=url)), settings=FAST_API)
        try:
            yield api, cluster
        finally:
            await cluster.close()


async def run(
    cluster: KubernetesCluster, policy: str, body: dict[str, Any], *, dry_run: bool = False
) -> Engine:
    engine = Engine(
        policy=parse_policy(policy),
        cluster=cluster,
        aws=RecordingAws(),
        settings=EngineSettings(dry_run=dry_run, drain=FAST_DRAIN),
        clock=time.time,
    )
    await engine.handle(parse_payload(body))
    await engine.drained()
    return engine


async def test_with_the_default_policy_every_node_action_leaves_an_event_on_the_node(
    cluster_api: tuple[FakeApiServer, KubernetesCluster],
) -> None:
    api, cluster = cluster_api
    await run(cluster, DEFAULT_POLICY, replace_alert())
    written = events(api)
    assert [(e["type"], e["reason"]) for e in written] == [
        ("Warning", "AccelFaultDetected"),  # with the condition set for it: one Event per action
        ("Normal", "AccelCordoned"),
        ("Normal", "AccelDrainStarted"),
        ("Normal", "AccelDrainFinished"),
        ("Normal", "AccelInstanceMarkedUnhealthy"),
    ]
    for event in written:
        assert event["involvedObject"] == {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": NODE}
        assert event["metadata"]["namespace"] == "default"
        assert event["reportingComponent"] == "accel-health-remediator"
        assert event["source"] == {"component": "accel-health-remediator"}
        assert "AccelGPUFatalXid" in event["message"]
    by_reason = {e["reason"]: e["message"] for e in written}
    assert "GPU 4 on gpu-node-1 reported fatal Xid 79" in by_reason["AccelFaultDetected"]
    assert "AcceleratorHealthy=False" in by_reason["AccelFaultDetected"]
    assert "training/worker-0" in by_reason["AccelDrainStarted"]
    assert "1 evicted" in by_reason["AccelDrainFinished"]
    assert INSTANCE in by_reason["AccelInstanceMarkedUnhealthy"]


async def test_a_resend_writes_no_event_again(cluster_api: tuple[FakeApiServer, KubernetesCluster]) -> None:
    api, cluster = cluster_api
    engine = await run(cluster, DEFAULT_POLICY, replace_alert())
    before = [(e["reason"], e["count"]) for e in events(api)]
    await engine.handle(parse_payload(replace_alert()))
    await engine.drained()
    assert [(e["reason"], e["count"]) for e in events(api)] == before


BLOCKING = """
events: failures
rules:
  - name: replace
    actions: [condition, cordon, {type: drain, timeout_seconds: 1}, aws_set_unhealthy]
"""


async def test_a_blocked_drain_names_the_pods_and_budgets_and_failures_mode_writes_only_that(
    cluster_api: tuple[FakeApiServer, KubernetesCluster],
) -> None:
    api, cluster = cluster_api
    api.add(pod("db-0", node_name=NODE, labels={"app": "db"}, owner=("StatefulSet", "db")))
    api.add(pdb("db", match={"app": "db"}, allowed=0))
    await run(cluster, BLOCKING, alert_body())
    [event] = events(api)
    assert (event["type"], event["reason"]) == ("Warning", "AccelDrainBlocked")
    assert "training/db-0" in event["message"]
    assert "disruption budget db" in event["message"]
    assert "drain timed out" in event["message"]


async def test_events_none_writes_no_event_while_the_actions_still_run(
    cluster_api: tuple[FakeApiServer, KubernetesCluster],
) -> None:
    api, cluster = cluster_api
    await run(cluster, "events: none\nrules: [{name: c, actions: [condition, cordon]}]", alert_body())
    assert events(api) == []
    assert api.stored("nodes", NODE)["spec"]["unschedulable"] is True  # type: ignore[index]  # exists


async def test_a_dry_run_writes_no_event_and_its_records_list_the_events_a_live_run_writes(
    cluster_api: tuple[FakeApiServer, KubernetesCluster],
) -> None:
    api, cluster = cluster_api
    engine = await run(cluster, DEFAULT_POLICY, replace_alert(), dry_run=True)
    assert events(api) == []
    listed = [(e["type"], e["reason"]) for r in engine.log.records() for e in r.details.get("events", [])]
    assert listed == [
        ("Warning", "AccelFaultDetected"),
        ("Normal", "AccelCordoned"),
        ("Normal", "AccelDrainStarted"),
        ("Normal", "AccelInstanceMarkedUnhealthy"),
    ]
    cordon = next(r for r in engine.log.records() if r.action == "cordon")
    assert cordon.details["events"] == [
        {"type": "Normal", "reason": "AccelCordoned", "message": "cordoned (alert AccelGPUFatalXid)"}
    ]


async def test_an_event_the_api_refuses_is_logged_and_undoes_nothing(
    cluster_api: tuple[FakeApiServer, KubernetesCluster], caplog: pytest.LogCaptureFixture
) -> None:
    api, cluster = cluster_api
    api["post", api.resource("v1/events")] << (lambda: status_error(403, "Forbidden", "events is forbidden"))
    engine = await run(cluster, "rules: [{name: c, actions: [cordon]}]", alert_body())
    assert [(r.action, r.outcome) for r in engine.log.records()] == [("cordon", "done")]
    assert api.stored("nodes", NODE)["spec"]["unschedulable"] is True  # type: ignore[index]  # exists
    assert "Event AccelFaultDetected not written" in caplog.text  # the fault seen, and the cordon


def test_an_unknown_events_setting_is_a_policy_error() -> None:
    with pytest.raises(PolicyError, match="events: expected one of all, failures, none, got 'sometimes'"):
        parse_policy("events: sometimes\nrules: []")
