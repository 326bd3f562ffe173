"""The decision engine over the real Kubernetes executor, counted at the HTTP level.

Dry-run makes the same decisions as a live run and not one mutating request; what the service must
remember lives on the node it acted on (its record, written with each action), so a restarted
service (a second engine over a new client) derives the budget and the idempotency from the node and
writes no other object; a gates ConfigMap holding garbage starts the service paused instead of with
the gates open.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from kubernetes.aio import client as k8s

from remediator.executors.kubernetes import GATES_KEY, KubernetesCluster, KubernetesSettings
from remediator.executors.snapshot import RecordingAws
from remediator.intake.app import create_app
from remediator.lifecycle.engine import Engine
from remediator.lifecycle.model import EngineSettings
from remediator.lifecycle.record import EPISODES
from remediator.policy import load_policy
from tests.remediator.conftest import AUTH, TOKEN, AiohttpClient, payload
from tests.remediator.fake_apiserver import FakeApiServer, node, pod, serve

SETTINGS = KubernetesSettings(
    request_timeout_seconds=1.0, retry_base_seconds=0.01, instance="test-0", state_namespace="accel-health"
)
MUTATING = ("PATCH", "PUT", "POST", "DELETE")


def cluster_at(url: str) -> KubernetesCluster:
    return KubernetesCluster(api=k8s.ApiClient(k8s.Configuration(host=url)), settings=SETTINGS)


def populate(api: FakeApiServer) -> None:
    for name in ("gpu-node-1", "gpu-node-2", "gpu-node-3", "trn-node-1"):
        api.add(node(name, provider_id=f"aws:///us-east-1a/i-{name}"))
    api.add(pod("trainer-0", node_name="gpu-node-1"))
    api.add(pod("trainer-1", node_name="gpu-node-1", owner=("StatefulSet", "trainer")))
    api.add(pod("exporter-x", node_name="gpu-node-1", namespace="accel-health", owner=("DaemonSet", "exp")))


def mutating(api: FakeApiServer) -> list[tuple[str, str]]:
    return [(str(r.method.value), str(r.url)) for r in api if str(r.method.value) in MUTATING]


@pytest.fixture
async def api_url() -> AsyncIterator[tuple[FakeApiServer, str]]:
    async with serve() as (api, url):
        populate(api)
        yield api, url


async def post(client: Any, body: dict[str, Any]) -> int:
    response = await client.post("/alerts", json=body, headers=AUTH)
    return int(response.status)


def engine_over(cluster: KubernetesCluster, *, dry_run: bool) -> Engine:
    return Engine(
        policy=load_policy(),
        cluster=cluster,
        aws=RecordingAws(),
        settings=EngineSettings(dry_run=dry_run),
        clock=time.time,
    )


def decisions(engine: Engine) -> list[tuple[str | None, str, str]]:
    return [(r.node, r.action, r.outcome) for r in engine.log.records()]


async def run_delivery(url: str, aiohttp_client: AiohttpClient, *, dry_run: bool) -> Engine:
    cluster = cluster_at(url)
    engine = engine_over(cluster, dry_run=dry_run)
    client = await aiohttp_client(create_app(engine=engine, token=TOKEN))
    try:
        assert await post(client, payload("gpu-fatal-xid")) == 200
        assert await post(client, payload("gpu-fatal-xid")) == 200  # Alertmanager resends
        await engine.drained()
    finally:
        await cluster.close()
    return engine


async def test_dry_run_decides_like_a_live_run_and_sends_no_mutating_request(
    aiohttp_client: AiohttpClient,
) -> None:
    async with serve() as (dry_api, dry_url):
        populate(dry_api)
        dry = await run_delivery(dry_url, aiohttp_client, dry_run=True)
        assert mutating(dry_api) == []
        assert len(list(dry_api)) > 0  # it did read the cluster
    async with serve() as (live_api, live_url):
        populate(live_api)
        live = await run_delivery(live_url, aiohttp_client, dry_run=False)
        assert mutating(live_api) != []
    dry_records, live_records = decisions(dry), decisions(live)
    # A live drain runs in the background: its start has a record of its own, its end another.
    ended = [(n, a) for n, a, o in live_records if o != "started"]
    assert [(n, a) for n, a, _ in dry_records] == ended
    assert ("gpu-node-1", "drain", "started") in live_records
    assert ("gpu-node-1", "drain", "done") in live_records
    assert {o for _, _, o in dry_records} <= {"planned", "deferred", "skipped", "failed"}
    assert all(r.dry_run for r in dry.log.records())
    assert not any(r.dry_run for r in live.log.records())
    assert ("gpu-node-1", "cordon", "planned") in dry_records
    assert ("gpu-node-1", "cordon", "done") in live_records


async def test_what_it_must_remember_survives_a_restart_on_the_node_it_acted_on(
    api_url: tuple[FakeApiServer, str], aiohttp_client: AiohttpClient
) -> None:
    api, url = api_url
    first = await run_delivery(url, aiohttp_client, dry_run=False)
    assert first.budget.in_use == 1
    assert api.stored("configmaps", "accel-health-remediator-gates", "accel-health") is None
    assert not [r for r in mutating(api) if "/configmaps" in r[1]]  # nothing but nodes and Events
    stored = api.stored("nodes", "gpu-node-1")
    assert stored is not None
    record = json.loads(stored["metadata"]["annotations"][EPISODES])
    [(fingerprint, (rule, alertname, _start, steps))] = record["e"].items()
    assert (rule, alertname, steps) == (
        "drain",
        "AccelGPUFatalXid",
        0b1111,
    )  # condition, cordon, evidence, drain
    cordons = [r for r in mutating(api) if r[0] == "PATCH" and "/nodes/gpu-node-1" in r[1]]

    # A new replica (new client, new engine) takes over and gets the same delivery again.
    second = await run_delivery(url, aiohttp_client, dry_run=False)
    assert second.budget.in_use == 1
    again = [r for r in mutating(api) if r[0] == "PATCH" and "/nodes/gpu-node-1" in r[1]]
    assert again == cordons  # nothing done twice, nothing written again
    assert all(outcome != "done" for _, _, outcome in decisions(second))
    assert fingerprint == payload("gpu-fatal-xid")["alerts"][0]["fingerprint"]


async def test_a_gates_configmap_holding_garbage_starts_the_service_paused(
    api_url: tuple[FakeApiServer, str], aiohttp_client: AiohttpClient
) -> None:
    api, url = api_url
    api.add(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "accel-health-remediator-gates", "namespace": "accel-health"},
            "data": {GATES_KEY: "{not json"},
        }
    )
    engine = await run_delivery(url, aiohttp_client, dry_run=False)
    assert engine.gates.pause.paused
    assert "stored gate state unusable" in engine.gates.pause.reason
    assert [r for r in mutating(api) if "/nodes/" in r[1]] == []
    assert {outcome for _, _, outcome in decisions(engine)} <= {"deferred", "skipped"}


async def test_every_node_is_listed_for_the_budget_and_the_breaker(
    api_url: tuple[FakeApiServer, str],
) -> None:
    _api, url = api_url
    cluster = cluster_at(url)
    try:
        names = sorted(n.name for n in await cluster.list_nodes())
    finally:
        await cluster.close()
    assert names == ["gpu-node-1", "gpu-node-2", "gpu-node-3", "trn-node-1"]
