"""Drains in the background: the webhook answers at once, the drain's end is recorded, and the alert's
later actions (marking the instance unhealthy) run when the drain ends, without a resend.

Over the Kubernetes executor against the HTTP-level fake API server (pods that take time to
terminate, PodDisruptionBudgets that answer 429, an API that fails for a while), and over the
in-memory snapshot backend for the same ordering rules: one drain per node however often the alert
is resent, a refused drain replaces nothing, an alert that resolves mid-drain lets the drain finish
but runs nothing after it, and a shutdown cancels a drain that the next delivery resumes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import pytest
from aiohttp.test_utils import TestClient
from kubernetes.aio import client as k8s

from remediator.cluster import DrainSettings, Node, OwnerReference, Pod
from remediator.executors.kubernetes import KubernetesCluster, KubernetesSettings
from remediator.executors.snapshot import RecordingAws, SnapshotCluster
from remediator.intake.app import create_app
from remediator.intake.payload import parse_payload
from remediator.lifecycle.engine import Engine
from remediator.lifecycle.model import EngineSettings
from remediator.lifecycle.record import DRAIN_STATUS
from remediator.policy import parse_policy
from tests.remediator.conftest import AUTH, TOKEN, AiohttpClient, CountingCluster, FakeClock
from tests.remediator.fake_apiserver import FakeApiServer, node, pdb, pod, serve, status_error

NODE = "gpu-node-1"
INSTANCE = "i-0123456789abcdef0"
FAST_API = KubernetesSettings(request_timeout_seconds=1.0, retry_base_seconds=0.01, instance="test-0")
FAST_DRAIN = DrainSettings(backoff_initial_seconds=0.05, backoff_max_seconds=0.2, poll_interval_seconds=0.05)


def replace_policy(timeout_seconds: int = 30, on_timeout: str = "stop") -> str:
    return f"""
safety: {{max_disrupted_nodes: 2}}
rules:
  - name: replace
    actions:
      - cordon
      - {{type: drain, timeout_seconds: {timeout_seconds}, on_timeout: {on_timeout}}}
      - aws_set_unhealthy
"""


def alert_body(*, status: str = "firing", node_name: str = NODE, fingerprint: str = "fp-1") -> dict[str, Any]:
    return {
        "version": "4",
        "status": status,
        "alerts": [
            {
                "status": status,
                "labels": {"alertname": "AccelGPUFatalXid", "node": node_name},
                "startsAt": "2025-11-22T20:31:07.412Z",
                "fingerprint": fingerprint,
            }
        ],
    }


class OrderedAws(RecordingAws):
    """Records AWS calls together with the drain outcomes the engine had recorded at that moment."""

    def __init__(self) -> None:
        super().__init__()
        self.engine: Engine | None = None
        self.drain_outcomes_seen: list[list[str]] = []

    async def set_unhealthy(self, instance_id: str) -> bool:
        assert self.engine is not None
        self.drain_outcomes_seen.append([r.outcome for r in self.engine.log.records() if r.action == "drain"])
        return await super().set_unhealthy(instance_id)


async def wait_until(predicate: Callable[[], bool], *, limit: float = 10.0) -> float:
    """Poll every 20 ms; the seconds it took."""
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > limit:
            raise AssertionError(f"condition not met within {limit}s")
        await asyncio.sleep(0.02)
    return time.monotonic() - started


def drain_records(engine: Engine) -> list[tuple[str, str]]:
    return [(r.outcome, r.reason) for r in engine.log.records() if r.action == "drain"]


def actions(engine: Engine) -> list[tuple[str, str]]:
    return [(r.action, r.outcome) for r in engine.log.records()]


# -- over the Kubernetes executor ----------------------------------------------------------------


@dataclass
class Live:
    """An engine over the Kubernetes executor, served by the app, against a fake API server."""

    api: FakeApiServer
    cluster: KubernetesCluster
    engine: Engine
    aws: OrderedAws
    client: TestClient[Any, Any]

    async def post(self, body: dict[str, Any]) -> int:
        response = await self.client.post("/alerts", json=body, headers=AUTH)
        return int(response.status)

    def evictions_accepted(self) -> list[str]:
        return [name for _, name, status in self.api.evictions if status == 201]


async def start_live(api: FakeApiServer, url: str, aiohttp_client: AiohttpClient, policy: str) -> Live:
    cluster = KubernetesCluster(api=k8s.ApiClient(k8s.Configuration(host=url)), settings=FAST_API)
    aws = OrderedAws()
    engine = Engine(
        policy=parse_policy(policy),
        cluster=cluster,
        aws=aws,
        settings=EngineSettings(drain=FAST_DRAIN),
        clock=time.time,
    )
    aws.engine = engine
    client = await aiohttp_client(create_app(engine=engine, token=TOKEN))
    return Live(api=api, cluster=cluster, engine=engine, aws=aws, client=client)


@pytest.fixture
async def slow_pods() -> AsyncIterator[tuple[FakeApiServer, str]]:
    """A node with three pods that take 0.8 s to terminate once evicted."""
    async with serve(termination_seconds=0.8) as (api, url):
        api.add(node(NODE, provider_id=f"aws:///us-east-1a/{INSTANCE}"))
        for i in range(3):
            api.add(pod(f"worker-{i}", node_name=NODE))
        yield api, url


async def stop(live: Live) -> None:
    await live.client.close()  # shuts the app down: running drains are cancelled first
    await live.cluster.close()


async def test_the_webhook_answers_before_the_drain_ends_and_the_instance_is_marked_only_after_it(
    slow_pods: tuple[FakeApiServer, str], aiohttp_client: AiohttpClient
) -> None:
    api, url = slow_pods
    live = await start_live(api, url, aiohttp_client, replace_policy())
    try:
        started = time.monotonic()
        assert await live.post(alert_body()) == 200
        answered = time.monotonic() - started
        assert answered < 0.8  # the pods are still terminating
        assert [o for o, _ in drain_records(live.engine)] == ["started"]
        assert live.aws.calls == []
        state = await (await live.client.get("/state", headers=AUTH)).json()
        assert list(state["drains"]) == [NODE]
        assert state["drains"][NODE]["alerts"][0]["fingerprint"] == "fp-1"
        metrics = await (await live.client.get("/metrics")).text()
        assert "accel_remediator_drains_in_progress 1.0" in metrics

        await wait_until(lambda: bool(live.aws.calls))
    finally:
        await stop(live)
    assert actions(live.engine) == [
        ("cordon", "done"),
        ("drain", "started"),
        ("drain", "done"),
        ("aws_set_unhealthy", "done"),
    ]
    assert live.aws.drain_outcomes_seen == [["started", "done"]]  # marked after the drain's end
    assert live.aws.calls == [("SetInstanceHealth", {"InstanceId": INSTANCE, "HealthStatus": "Unhealthy"})]
    done = live.engine.log.records()[2]
    assert sorted(p["name"] for p in done.details["evicted"]) == ["worker-0", "worker-1", "worker-2"]
    assert not [key for key in api.store if key[0] == "pods"]  # every evicted pod is gone
    assert live.engine.status().drains == {}


@pytest.mark.parametrize("on_timeout", ["stop", "proceed"])
async def test_a_pdb_that_never_allows_fails_the_drain_at_its_deadline_and_replaces_only_if_the_rule_says(
    aiohttp_client: AiohttpClient, on_timeout: str
) -> None:
    async with serve() as (api, url):
        api.add(node(NODE, provider_id=f"aws:///us-east-1a/{INSTANCE}"))
        api.add(pod("free", node_name=NODE))
        api.add(pod("db-0", node_name=NODE, labels={"app": "db"}, owner=("StatefulSet", "db")))
        api.add(pdb("db", match={"app": "db"}, allowed=0))
        policy = replace_policy(timeout_seconds=1, on_timeout=on_timeout)
        live = await start_live(api, url, aiohttp_client, policy)
        try:
            started = time.monotonic()
            assert await live.post(alert_body()) == 200
            await wait_until(lambda: len(live.engine.log.records()) >= 4)
            waited = time.monotonic() - started
        finally:
            await stop(live)
    assert waited >= 0.8  # it waited for the deadline (1 s from the drain's start)
    last = "done" if on_timeout == "proceed" else "skipped"
    assert actions(live.engine) == [
        ("cordon", "done"),
        ("drain", "started"),
        ("drain", "failed"),
        ("aws_set_unhealthy", last),
    ]
    failed = live.engine.log.records()[2]
    assert "drain timed out" in failed.reason
    [blocked] = failed.details["blocked"]
    assert (blocked["namespace"], blocked["name"]) == ("training", "db-0")
    assert "429" in blocked["reason"]
    assert "disruption budget db" in blocked["reason"]
    if on_timeout == "proceed":
        assert live.aws.drain_outcomes_seen == [["started", "failed"]]
    else:  # the deadline does not override the PodDisruptionBudget: nothing replaces the node
        assert live.aws.calls == []
        assert "a human decides" in live.engine.log.records()[3].reason
    assert api.stored("nodes", NODE)["metadata"]["annotations"][DRAIN_STATUS] == "timed-out"  # type: ignore[index]  # exists


async def test_resends_during_a_drain_start_no_second_drain(
    slow_pods: tuple[FakeApiServer, str], aiohttp_client: AiohttpClient
) -> None:
    api, url = slow_pods
    live = await start_live(api, url, aiohttp_client, replace_policy())
    try:
        for _ in range(5):  # Alertmanager resends, and an HA peer duplicates
            assert await live.post(alert_body()) == 200
        await wait_until(lambda: bool(live.aws.calls))
        assert await live.post(alert_body()) == 200  # a resend after everything was decided
    finally:
        await stop(live)
    assert sorted(live.evictions_accepted()) == ["worker-0", "worker-1", "worker-2"]  # once each
    assert [o for o, _ in drain_records(live.engine)] == ["started", "done"]
    assert len(live.aws.calls) == 1


async def test_an_alert_that_resolves_mid_drain_lets_the_drain_finish_but_replaces_nothing(
    slow_pods: tuple[FakeApiServer, str], aiohttp_client: AiohttpClient
) -> None:
    api, url = slow_pods
    live = await start_live(api, url, aiohttp_client, replace_policy())
    try:
        assert await live.post(alert_body()) == 200
        assert await live.post(alert_body(status="resolved")) == 200
        await wait_until(lambda: live.engine.status().drains == {})
    finally:
        await stop(live)
    assert live.aws.calls == []
    assert sorted(live.evictions_accepted()) == ["worker-0", "worker-1", "worker-2"]  # not reversed
    assert api.stored("nodes", NODE)["spec"]["unschedulable"] is True  # type: ignore[index]  # exists
    records = live.engine.log.records()
    assert [(r.action, r.outcome, r.status) for r in records if r.action != "none"] == [
        ("cordon", "done", "firing"),
        ("drain", "started", "firing"),
        ("drain", "done", "resolved"),
        ("aws_set_unhealthy", "skipped", "resolved"),
    ]
    assert "alert resolved while the drain ran" in records[-1].reason


async def test_shutdown_cancels_a_running_drain_and_the_next_delivery_resumes_it(
    aiohttp_client: AiohttpClient,
) -> None:
    async with serve(termination_seconds=0.5) as (api, url):
        api.add(node(NODE, provider_id=f"aws:///us-east-1a/{INSTANCE}"))
        api.add(pod("free", node_name=NODE))
        api.add(pod("db-0", node_name=NODE, labels={"app": "db"}, owner=("StatefulSet", "db")))
        api.add(pdb("db", match={"app": "db"}, allowed=0))
        first = await start_live(api, url, aiohttp_client, replace_policy())
        assert await first.post(alert_body()) == 200
        await wait_until(lambda: len(api.evictions) >= 2)  # free evicted, db-0 refused
        await stop(first)  # the service shuts down mid-drain
        assert first.engine.status().drains == {}
        assert [o for o, _ in drain_records(first.engine)] == ["started"]  # not decided
        assert first.aws.calls == []
        assert api.stored("nodes", NODE)["metadata"]["annotations"][DRAIN_STATUS] == "in-progress"  # type: ignore[index]  # exists

        await wait_until(lambda: api.stored("pods", "free", "training") is None)  # it terminated
        api.set_disruptions_allowed("training", "db", 1)
        second = await start_live(api, url, aiohttp_client, replace_policy())  # a restart (or a new leader)
        try:
            assert await second.post(alert_body()) == 200  # Alertmanager's next delivery
            await wait_until(lambda: bool(second.aws.calls))
        finally:
            await stop(second)
    ended = second.engine.log.records()[-2]
    assert (ended.action, ended.outcome) == ("drain", "done")
    assert "resumed a drain started earlier" in ended.reason
    assert ended.details["resumed"] is True
    assert sorted(first.evictions_accepted()) == ["db-0", "free"]  # each once, across both services


async def test_an_api_outage_mid_drain_is_recorded_and_the_next_delivery_starts_it_again(
    aiohttp_client: AiohttpClient,
) -> None:
    async with serve(termination_seconds=0.3) as (api, url):
        api.add(node(NODE, provider_id=f"aws:///us-east-1a/{INSTANCE}"))
        api.add(pod("worker-0", node_name=NODE))
        down = {"now": False}
        api["get", api.resource("v1/pods")][lambda _request: down["now"]] << (
            lambda: status_error(503, "ServiceUnavailable", "etcd is down")
        )
        live = await start_live(api, url, aiohttp_client, replace_policy())
        try:
            assert await live.post(alert_body()) == 200
            down["now"] = True
            api.end_watches()  # the drain's watch of the pods breaks, and neither it nor a LIST comes back
            await wait_until(lambda: len(drain_records(live.engine)) == 2)
            assert live.aws.calls == []
            await wait_until(lambda: api.stored("pods", "worker-0", "training") is None)  # it terminated
            down["now"] = False
            assert await live.post(alert_body()) == 200  # the next delivery
            await wait_until(lambda: bool(live.aws.calls))
        finally:
            await stop(live)
    outcomes = [o for o, _ in drain_records(live.engine)]
    assert outcomes == ["started", "failed", "started", "done"]
    failed_reason = drain_records(live.engine)[1][1]
    assert "BackendUnavailable" in failed_reason
    assert "starts it again" in failed_reason
    assert live.evictions_accepted() == ["worker-0"]
    assert live.aws.drain_outcomes_seen == [outcomes]


# -- over the snapshot backend -------------------------------------------------------------------


def snapshot(*pods: Pod) -> SnapshotCluster:
    nodes = [Node(name=name, provider_id=f"aws:///us-west-2a/i-{name}") for name in ("n1", "n2", "n3")]
    return SnapshotCluster(nodes=nodes, pods=list(pods), pdbs=[])


def owned(name: str, node_name: str = "n1") -> Pod:
    return Pod(
        namespace="ml",
        name=name,
        node_name=node_name,
        owners=(OwnerReference(kind="ReplicaSet", name="rs", controller=True),),
    )


def engine_on(cluster: SnapshotCluster, policy: str, aws: RecordingAws) -> tuple[Engine, CountingCluster]:
    counting = CountingCluster(cluster)
    engine = Engine(
        policy=parse_policy(policy), cluster=counting, aws=aws, settings=EngineSettings(), clock=FakeClock()
    )
    return engine, counting


def firing(node_name: str, fingerprint: str, *, status: str = "firing") -> Any:
    return parse_payload(alert_body(status=status, node_name=node_name, fingerprint=fingerprint))


async def test_in_memory_the_instance_is_marked_only_when_the_drain_task_has_ended() -> None:
    aws = OrderedAws()
    cluster = snapshot(owned("a"), owned("b"))
    engine, counting = engine_on(cluster, replace_policy(), aws)
    aws.engine = engine
    await engine.handle(firing("n1", "fp-1"))
    assert actions(engine) == [("cordon", "done"), ("drain", "started")]
    assert aws.calls == []
    await engine.drained()
    assert actions(engine)[2:] == [("drain", "done"), ("aws_set_unhealthy", "done")]
    assert aws.drain_outcomes_seen == [["started", "done"]]
    assert not cluster.pods
    await engine.handle(firing("n1", "fp-1"))  # a resend after everything was decided
    await engine.drained()
    assert len(engine.log) == 4
    assert counting.calls["drain"] == 1


async def test_in_memory_a_second_alert_for_a_draining_node_joins_the_drain_and_continues_after_it() -> None:
    aws = RecordingAws()
    engine, counting = engine_on(snapshot(owned("a")), replace_policy(), aws)
    await engine.handle(firing("n1", "fp-1"))
    await engine.handle(firing("n1", "fp-1"))  # a resend while it runs
    await engine.handle(firing("n1", "fp-2"))  # another alert for the same node
    assert counting.calls["drain"] == 0  # nothing has yielded to the task yet
    await engine.drained()
    assert counting.calls["drain"] == 1
    by_alert = [(r.fingerprint, r.action, r.outcome) for r in engine.log.records()]
    assert by_alert == [
        ("fp-1", "cordon", "done"),
        ("fp-1", "drain", "started"),
        ("fp-2", "cordon", "skipped"),  # already cordoned
        ("fp-2", "drain", "started"),  # joined the running drain
        ("fp-1", "drain", "done"),
        ("fp-1", "aws_set_unhealthy", "done"),
        ("fp-2", "drain", "done"),
        ("fp-2", "aws_set_unhealthy", "skipped"),  # marked already, for fp-1
    ]
    assert "joins the drain of n1" in engine.log.records()[3].reason
    assert len(aws.calls) == 1


async def test_in_memory_a_drain_refused_for_a_bare_pod_replaces_nothing_even_after_resends() -> None:
    aws = RecordingAws()
    bare = Pod(namespace="ml", name="notebook", node_name="n1")
    cluster = snapshot(owned("a"), bare)
    engine, _ = engine_on(cluster, replace_policy(), aws)
    for _ in range(3):
        await engine.handle(firing("n1", "fp-1"))
        await engine.drained()
    assert actions(engine) == [
        ("cordon", "done"),
        ("drain", "started"),
        ("drain", "failed"),
        ("aws_set_unhealthy", "skipped"),
    ]
    refused, skipped = engine.log.records()[2:]
    assert "drain refused" in refused.reason
    assert refused.details["blocked"][0]["name"] == "notebook"
    assert "not managed by a controller" in refused.details["blocked"][0]["reason"]
    assert "a human decides" in skipped.reason
    assert aws.calls == []
    assert ("ml", "a") in cluster.pods  # refused before any eviction
    assert cluster.nodes["n1"].unschedulable


async def test_in_memory_an_uncordon_on_resolve_leaves_a_draining_node_alone() -> None:
    policy = """
rules:
  - name: drain
    actions: [cordon, drain]
    on_resolved: [uncordon]
"""
    cluster = snapshot(owned("a"))
    engine, _ = engine_on(cluster, policy, RecordingAws())
    await engine.handle(firing("n1", "fp-1"))
    await engine.handle(firing("n1", "fp-1", status="resolved"))
    await engine.drained()
    assert [(r.action, r.outcome, r.status) for r in engine.log.records()] == [
        ("cordon", "done", "firing"),
        ("drain", "started", "firing"),
        ("uncordon", "skipped", "resolved"),
        ("drain", "done", "resolved"),
    ]
    assert "never reverses a drain" in engine.log.records()[2].reason
    assert cluster.nodes["n1"].unschedulable
