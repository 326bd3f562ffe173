"""The Kubernetes executor against an HTTP-level fake API server (kmock plus a small object store).

Covers reads, cordon/taint ownership and conflict retries, conditions on the status subresource,
node Events (repeats counted, series forgotten after their window), the eviction contract the engine
relies on, kubectl-like drains (PDB 429s retried until the deadline, waiting for pods to go, bounded
concurrency, refusal with reasons, resumption from annotations), the API failing (500s, timeouts,
connection refused), and the webhook keeping the intent across an outage without doing anything twice.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from kubernetes.aio import client as k8s

from remediator.cluster import (
    BackendUnavailable,
    BlockedPod,
    DrainSettings,
    EvictionResult,
    NodeCondition,
    NotLeader,
    Taint,
    WriteRefused,
)
from remediator.executors.kubernetes import (
    BLOCKED_SHOWN,
    KubernetesCluster,
    KubernetesSettings,
    blocked_annotation,
    manages_unschedulable,
    trim_node,
)
from remediator.executors.snapshot import RecordingAws
from remediator.intake.app import create_app
from remediator.lifecycle.engine import Engine
from remediator.lifecycle.model import EngineSettings
from remediator.lifecycle.record import CORDONED_BY, DRAIN_BLOCKED, DRAIN_DEADLINE, DRAIN_STATUS, TAINTS_ADDED
from remediator.policy import load_policy
from tests.remediator.conftest import AUTH, TOKEN, AiohttpClient, payload
from tests.remediator.fake_apiserver import FakeApiServer, node, pdb, pod, serve, status_error

FAST = KubernetesSettings(request_timeout_seconds=1.0, retry_base_seconds=0.01, instance="test-0")
QUICK_DRAIN = DrainSettings(
    timeout_seconds=5, backoff_initial_seconds=0.05, backoff_max_seconds=0.2, poll_interval_seconds=0.05
)


def connect(url: str, *, should_act: Any = lambda: True) -> KubernetesCluster:
    return KubernetesCluster(
        api=k8s.ApiClient(k8s.Configuration(host=url)), settings=FAST, should_act=should_act
    )


@pytest.fixture
async def fake() -> AsyncIterator[tuple[FakeApiServer, KubernetesCluster]]:
    async with serve() as (api, url):
        cluster = connect(url)
        try:
            yield api, cluster
        finally:
            await cluster.close()


def node_obj(api: FakeApiServer, name: str = "gpu-1") -> dict[str, Any]:
    obj = api.stored("nodes", name)
    assert obj is not None
    return obj


def writes(api: FakeApiServer) -> list[Any]:
    return [r for r in api if str(r.method.value) in ("PATCH", "PUT", "POST", "DELETE")]


# -- reads -----------------------------------------------------------------------------------------


async def test_a_node_is_read_into_the_engines_view_and_a_missing_one_is_none(
    fake: tuple[FakeApiServer, KubernetesCluster],
) -> None:
    api, cluster = fake
    api.add(
        node("gpu-1", provider_id="aws:///us-west-2a/i-0abc", taints=[{"key": "a", "effect": "NoSchedule"}])
    )
    got = await cluster.get_node("gpu-1")
    assert got is not None
    assert got.provider_id == "aws:///us-west-2a/i-0abc"
    assert [t.key for t in got.taints] == ["a"]
    assert [c.type for c in got.conditions] == ["Ready"]
    assert await cluster.get_node("nope") is None


async def test_pods_are_listed_with_a_field_selector_on_the_node(
    fake: tuple[FakeApiServer, KubernetesCluster],
) -> None:
    api, cluster = fake
    api.add(pod("here", node_name="gpu-1"))
    api.add(pod("elsewhere", node_name="gpu-2"))
    assert [p.name for p in await cluster.list_pods("gpu-1")] == ["here"]
    listing = [r for r in api if r.resource is not None and r.resource.plural == "pods"][-1]
    assert listing.params["fieldSelector"] == "spec.nodeName=gpu-1"


# -- cordon and taints ---------------------------------------------------------------------------


async def test_cordon_sets_unschedulable_and_records_ownership_once(
    fake: tuple[FakeApiServer, KubernetesCluster],
) -> None:
    api, cluster = fake
    api.add(node("gpu-1"))
    await cluster.cordon("gpu-1")
    obj = node_obj(api)
    assert obj["spec"]["unschedulable"] is True
    assert obj["metadata"]["annotations"][CORDONED_BY] == "accel-health-remediator"
    assert obj["status"]["conditions"][0]["type"] == "Ready"  # the main resource leaves status alone
    before = len(writes(api))
    await cluster.cordon("gpu-1")
    assert len(writes(api)) == before  # already cordoned: nothing written


async def test_a_node_a_human_cordoned_is_not_claimed_and_not_uncordoned(
    fake: tuple[FakeApiServer, KubernetesCluster],
) -> None:
    api, cluster = fake
    api.add(node("gpu-1", unschedulable=True))
    await cluster.cordon("gpu-1")
    await cluster.uncordon("gpu-1")
    obj = node_obj(api)
    assert obj["spec"]["unschedulable"] is True
    assert CORDONED_BY not in obj["metadata"]["annotations"]
    assert writes(api) == []


async def test_uncordon_reverses_only_its_own_cordon_and_forgets_one_a_human_already_undid(
    fake: tuple[FakeApiServer, KubernetesCluster],
) -> None:
    api, cluster = fake
    api.add(node("gpu-1"))
    api.add(node("gpu-2"))
    await cluster.cordon("gpu-1")
    await cluster.uncordon("gpu-1")
    assert node_obj(api)["spec"]["unschedulable"] is False
    assert CORDONED_BY not in node_obj(api)["metadata"]["annotations"]

    await cluster.cordon("gpu-2")
    node_obj(api, "gpu-2")["spec"]["unschedulable"] = False  # `kubectl uncordon` by a human
    await cluster.uncordon("gpu-2")
    obj = node_obj(api, "gpu-2")
    assert obj["spec"]["unschedulable"] is False
    assert CORDONED_BY not in obj["metadata"]["annotations"]


async def test_a_taint_is_added_beside_others_taints_after_a_conflict(
    fake: tuple[FakeApiServer, KubernetesCluster],
) -> None:
    api, cluster = fake
    api.add(node("gpu-1", taints=[{"key": "team", "value": "ml", "effect": "NoSchedule"}]))

    def concurrent_writer(_request: Any) -> None:
        api.touch_node("gpu-1", taint={"key": "other-controller", "effect": "NoExecute"})
        raise status_error(409, "Conflict", "the object has been modified")

    api["patch", api.resource("v1/nodes")][:1] << concurrent_writer
    await cluster.add_taint("gpu-1", Taint("accel-health.io/unhealthy", "true", "NoSchedule"))
    obj = node_obj(api)
    assert [t["key"] for t in obj["spec"]["taints"]] == [
        "team",
        "other-controller",
        "accel-health.io/unhealthy",
    ]
    assert obj["metadata"]["annotations"][TAINTS_ADDED] == '["accel-health.io/unhealthy:NoSchedule"]'
    patches = [r for r in api if str(r.method.value) == "PATCH"]
    assert len(patches) == 2
    assert all(r.data["metadata"]["resourceVersion"] for r in patches)  # every write is conditional


async def test_only_taints_this_service_added_are_removed(
    fake: tuple[FakeApiServer, KubernetesCluster],
) -> None:
    api, cluster = fake
    human = {"key": "accel-health.io/unhealthy", "value": "true", "effect": "NoExecute"}
    api.add(node("gpu-1", taints=[human]))
    ours = Taint("accel-health.io/unhealthy", "true", "NoSchedule")
    await cluster.add_taint("gpu-1", ours)
    await cluster.remove_taint("gpu-1", ours)
    await cluster.remove_taint("gpu-1", Taint("accel-health.io/unhealthy", "true", "NoExecute"))
    obj = node_obj(api)
    assert obj["spec"]["taints"] == [human]
    assert TAINTS_ADDED not in obj["metadata"]["annotations"]


async def test_a_conflict_that_never_ends_becomes_backend_unavailable(
    fake: tuple[FakeApiServer, KubernetesCluster],
) -> None:
    api, cluster = fake
    api.add(node("gpu-1"))
    api["patch", api.resource("v1/nodes")] << (
        lambda: (_ for _ in ()).throw(status_error(409, "Conflict", "busy"))
    )
    with pytest.raises(BackendUnavailable, match="409"):
        await cluster.add_taint("gpu-1", Taint("k", "v", "NoSchedule"))
    assert node_obj(api)["spec"] == {}


# -- conditions and events -----------------------------------------------------------------------


async def test_a_condition_goes_to_the_status_subresource_beside_the_kubelets(
    fake: tuple[FakeApiServer, KubernetesCluster],
) -> None:
    api, cluster = fake
    api.add(node("gpu-1"))
    cond = NodeCondition("AcceleratorHealthy", "False", "GpuFatalXid", "GPU 0 fell off the bus")
    await cluster.set_condition("gpu-1", cond)
    first = node_obj(api)["status"]["conditions"]
    assert [c["type"] for c in first] == ["Ready", "AcceleratorHealthy"]
    assert first[1]["reason"] == "GpuFatalXid"
    assert first[1]["message"] == "GPU 0 fell off the bus"
    patch = next(r for r in api if str(r.method.value) == "PATCH")
    assert patch.subresource == "status"
    assert patch.headers["Content-Type"].startswith("application/strategic-merge-patch+json")

    first[1]["lastTransitionTime"] = "2020-01-01T00:00:00Z"
    await cluster.set_condition("gpu-1", cond)  # same status: the transition time stays
    assert node_obj(api)["status"]["conditions"][1]["lastTransitionTime"] == "2020-01-01T00:00:00Z"
    got = await cluster.get_node("gpu-1")
    assert got is not None
    assert cond in got.conditions


async def test_events_name_the_node_like_the_kubelets_and_repeats_are_counted(
    fake: tuple[FakeApiServer, KubernetesCluster],
) -> None:
    api, cluster = fake
    api.add(node("gpu-1"))
    for _ in range(3):
        await cluster.record_event(node="gpu-1", reason="GpuFatalXid", message="Xid 79", type_="Warning")
    events = [obj for (plural, _, _), obj in api.store.items() if plural == "events"]
    assert len(events) == 1
    event = events[0]
    assert event["metadata"]["namespace"] == "default"
    assert event["involvedObject"] == {"apiVersion": "v1", "kind": "Node", "name": "gpu-1", "uid": "gpu-1"}
    assert (event["reason"], event["type"], event["count"]) == ("GpuFatalXid", "Warning", 3)
    assert event["source"] == {"component": "accel-health-remediator"}


async def test_event_series_older_than_ten_minutes_are_forgotten_not_kept_forever() -> None:
    now = [1_700_000_000.0]
    async with serve() as (api, url):
        cluster = KubernetesCluster(
            api=k8s.ApiClient(k8s.Configuration(host=url)), settings=FAST, clock=lambda: now[0]
        )
        try:
            for i in range(20):  # a storm's Events, one series per node
                api.add(node(f"gpu-{i}"))
                await cluster.record_event(
                    node=f"gpu-{i}", reason="AccelCordoned", message="m", type_="Normal"
                )
            assert cluster.event_series == 20
            now[0] += 300
            await cluster.record_event(node="gpu-0", reason="AccelCordoned", message="m", type_="Normal")
            now[0] += 301  # the other 19 series are now older than the window; gpu-0's is not
            await cluster.record_event(node="gpu-1", reason="AccelCordoned", message="m", type_="Normal")
            assert cluster.event_series == 2
            await cluster.record_event(node="gpu-0", reason="AccelCordoned", message="m", type_="Normal")
        finally:
            await cluster.close()
    counts = sorted(obj["count"] for (plural, _, _), obj in api.store.items() if plural == "events")
    assert counts == [1] * 20 + [3]  # gpu-0's series still counted; gpu-1's old one left, a new one made


# -- eviction contract ---------------------------------------------------------------------------


async def test_evict_pod_answers_evicted_refused_or_gone_and_passes_the_grace_period(
    fake: tuple[FakeApiServer, KubernetesCluster],
) -> None:
    api, cluster = fake
    api.add(pod("free", node_name="gpu-1", labels={"app": "a"}))
    api.add(pod("guarded", node_name="gpu-1", labels={"app": "b"}))
    api.add(pdb("b-pdb", match={"app": "b"}, allowed=0))
    evict = cluster.evict_pod
    assert await evict(namespace="training", name="free", grace_period_seconds=30) is EvictionResult.EVICTED
    assert await evict(namespace="training", name="guarded", grace_period_seconds=None) is (
        EvictionResult.REFUSED_BY_PDB
    )
    assert await evict(namespace="training", name="free", grace_period_seconds=None) is EvictionResult.GONE
    body = next(r for r in api if r.subresource == "eviction").data
    assert body["deleteOptions"] == {"gracePeriodSeconds": 30}
    assert body["metadata"] == {"name": "free", "namespace": "training"}


# -- drain ---------------------------------------------------------------------------------------


async def test_a_drain_evicts_like_kubectl_and_waits_until_the_pods_are_gone() -> None:
    async with serve(termination_seconds=0.3) as (api, url):
        cluster = connect(url)
        api.add(node("gpu-1"))
        for i in range(4):
            api.add(pod(f"worker-{i}", node_name="gpu-1"))
        api.add(pod("dcgm", node_name="gpu-1", owner=("DaemonSet", "dcgm-exporter")))
        api.add(
            pod("kube-proxy", node_name="gpu-1", owner=None, annotations={"kubernetes.io/config.mirror": "x"})
        )
        api.add(pod("done", node_name="gpu-1", owner=None, phase="Succeeded"))
        started = time.monotonic()
        outcome = await cluster.drain("gpu-1", QUICK_DRAIN)
        elapsed = time.monotonic() - started
        await cluster.close()
    assert outcome.completed, outcome.summary()
    assert sorted(outcome.evicted) == ["training/done", *(f"training/worker-{i}" for i in range(4))]
    assert sorted(outcome.skipped) == ["training/dcgm", "training/kube-proxy"]
    assert elapsed >= 0.3  # it waited for the terminating pods
    left = sorted(name for (plural, _, name) in api.store if plural == "pods")
    assert left == ["dcgm", "kube-proxy"]
    obj = node_obj(api)
    assert obj["spec"]["unschedulable"] is True  # cordoned first
    assert obj["metadata"]["annotations"][DRAIN_STATUS] == "done"


async def test_a_pdb_429_is_retried_with_backoff_until_the_budget_allows(
    fake: tuple[FakeApiServer, KubernetesCluster],
) -> None:
    api, cluster = fake
    api.add(node("gpu-1"))
    api.add(pod("guarded", node_name="gpu-1", labels={"app": "db"}))
    api.add(pdb("db", match={"app": "db"}, allowed=0))
    loop = asyncio.get_running_loop()
    loop.call_later(0.6, api.set_disruptions_allowed, "training", "db", 1)
    outcome = await cluster.drain("gpu-1", QUICK_DRAIN)
    assert outcome.completed
    statuses = [status for _, _, status in api.evictions]
    assert statuses[-1] == 201
    assert 2 <= statuses.count(429) <= 12  # backed off: not a hot loop over 0.6 s


async def test_a_drain_that_cannot_finish_names_each_blocking_pod_and_why(
    fake: tuple[FakeApiServer, KubernetesCluster],
) -> None:
    api, cluster = fake
    api.add(node("gpu-1"))
    api.add(pod("guarded", node_name="gpu-1", labels={"app": "db"}))
    api.add(pod("free", node_name="gpu-1"))
    api.add(pdb("db", match={"app": "db"}, allowed=0))
    settings = DrainSettings(timeout_seconds=0.5, backoff_initial_seconds=0.05, poll_interval_seconds=0.05)
    outcome = await cluster.drain("gpu-1", settings)
    assert outcome.timed_out
    assert not outcome.completed
    assert outcome.evicted == ("training/free",)
    [blocked] = outcome.blocked
    assert (blocked.namespace, blocked.name) == ("training", "guarded")
    assert "429" in blocked.reason
    assert "disruption budget db" in blocked.reason
    annotations = node_obj(api)["metadata"]["annotations"]
    assert annotations[DRAIN_STATUS] == "timed-out"
    assert annotations[DRAIN_BLOCKED] == "training/guarded"
    assert not [obj for (plural, _, _), obj in api.store.items() if plural == "events"]  # the engine's


async def test_pods_that_need_permission_refuse_the_whole_drain_before_any_eviction(
    fake: tuple[FakeApiServer, KubernetesCluster],
) -> None:
    api, cluster = fake
    api.add(node("gpu-1"))
    api.add(pod("bare", node_name="gpu-1", owner=None))
    api.add(pod("scratch", node_name="gpu-1", emptydir=True))
    api.add(pod("fine", node_name="gpu-1"))
    outcome = await cluster.drain("gpu-1", QUICK_DRAIN)
    assert not outcome.completed
    assert not outcome.timed_out
    reasons = {b.name: b.reason for b in outcome.blocked}
    assert "not managed by a controller" in reasons["bare"]
    assert "emptyDir" in reasons["scratch"]
    assert api.evictions == []
    permitted = DrainSettings(
        timeout_seconds=5, delete_emptydir_data=True, force_bare_pods=True, poll_interval_seconds=0.05
    )
    assert (await cluster.drain("gpu-1", permitted)).completed


async def test_a_pod_replaced_under_the_same_name_counts_as_gone() -> None:
    async with serve(termination_seconds=0.1, replace_evicted=True) as (api, url):
        cluster = connect(url)
        api.add(node("gpu-1"))
        api.add(pod("db-0", node_name="gpu-1", owner=("StatefulSet", "db")))
        old_uid = api.stored("pods", "db-0", "training")["metadata"]["uid"]  # type: ignore[index]  # just added
        outcome = await cluster.drain("gpu-1", QUICK_DRAIN)
        await cluster.close()
        assert outcome.completed
        assert api.stored("pods", "db-0", "training")["metadata"]["uid"] != old_uid  # type: ignore[index]  # replaced
    assert [status for *_, status in api.evictions] == [201]


async def test_evictions_in_flight_never_exceed_the_concurrency() -> None:
    async with serve(latency_seconds=0.02) as (api, url):
        cluster = connect(url)
        api.add(node("gpu-1"))
        for i in range(30):
            api.add(pod(f"w-{i}", node_name="gpu-1"))
        outcome = await cluster.drain("gpu-1", DrainSettings(concurrency=4, poll_interval_seconds=0.05))
        await cluster.close()
    assert outcome.completed
    assert api.max_evictions_in_flight == 4


async def test_a_drain_started_earlier_resumes_with_its_original_deadline(
    fake: tuple[FakeApiServer, KubernetesCluster],
) -> None:
    api, cluster = fake
    deadline = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 120))
    api.add(
        node("gpu-1", unschedulable=True, annotations={DRAIN_STATUS: "in-progress", DRAIN_DEADLINE: deadline})
    )
    api.add(pod("w", node_name="gpu-1"))
    outcome = await cluster.drain("gpu-1", QUICK_DRAIN)
    assert outcome.resumed
    assert outcome.completed
    assert time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(outcome.deadline)) == deadline
    assert node_obj(api)["metadata"]["annotations"][DRAIN_DEADLINE] == deadline


# -- the API failing -----------------------------------------------------------------------------


async def test_a_few_500s_are_retried_and_persistent_ones_raise_backend_unavailable(
    fake: tuple[FakeApiServer, KubernetesCluster],
) -> None:
    api, cluster = fake
    api.add(node("gpu-1"))
    api["get", api.resource("v1/nodes")][:2] << 500
    assert await cluster.get_node("gpu-1") is not None
    api["get", api.resource("v1/nodes")] << 503
    with pytest.raises(BackendUnavailable, match="503"):
        await cluster.get_node("gpu-1")


async def test_a_hanging_api_times_out_into_backend_unavailable(
    fake: tuple[FakeApiServer, KubernetesCluster],
) -> None:
    api, cluster = fake
    api.add(node("gpu-1"))
    api["get", api.resource("v1/nodes")] << (lambda: asyncio.sleep(5))
    started = time.monotonic()
    with pytest.raises(BackendUnavailable, match="Timeout"):
        await cluster.get_node("gpu-1")
    assert time.monotonic() - started < 4.5  # 3 attempts of 1 s plus backoff


async def test_an_unreachable_api_raises_backend_unavailable() -> None:
    cluster = connect("http://127.0.0.1:9")  # discard port: nothing listens
    try:
        with pytest.raises(BackendUnavailable, match="read node"):
            await cluster.get_node("gpu-1")
    finally:
        await cluster.close()


async def test_a_replica_that_is_not_the_leader_writes_nothing() -> None:
    async with serve() as (api, url):
        cluster = connect(url, should_act=lambda: False)
        api.add(node("gpu-1"))
        api.add(pod("w", node_name="gpu-1"))
        with pytest.raises(NotLeader):
            await cluster.cordon("gpu-1")
        with pytest.raises(NotLeader):
            await cluster.drain("gpu-1", QUICK_DRAIN)
        with pytest.raises(NotLeader):
            await cluster.evict_pod(namespace="training", name="w", grace_period_seconds=None)
        await cluster.close()
    assert writes(api) == []


async def test_the_webhook_answers_503_while_the_api_fails_and_acts_once_when_it_is_back(
    aiohttp_client: AiohttpClient,
) -> None:
    async with serve() as (api, url):
        cluster = connect(url)
        api.add(node("gpu-node-1"))
        engine = Engine(
            policy=load_policy(),
            cluster=cluster,
            aws=RecordingAws(),
            settings=EngineSettings(),
            clock=time.time,
        )
        client = await aiohttp_client(create_app(engine=engine, token=TOKEN))
        body = payload("gpu-fatal-xid")
        body["alerts"][0]["labels"]["remediation"] = "cordon"
        down = {"now": True}
        api["patch", api.resource("v1/nodes")][lambda _request: down["now"]] << 500
        assert (await client.post("/alerts", json=body, headers=AUTH)).status == 503
        assert (await client.post("/alerts", json=body, headers=AUTH)).status == 503
        down["now"] = False  # the API is back
        seen = len(api)
        assert (await client.post("/alerts", json=body, headers=AUTH)).status == 200
        assert (await client.post("/alerts", json=body, headers=AUTH)).status == 200  # a resend
        await cluster.close()
    obj = node_obj(api, "gpu-node-1")
    assert obj["spec"]["unschedulable"] is True
    assert [c["type"] for c in obj["status"]["conditions"]] == ["Ready", "AcceleratorHealthy"]
    after = [(r.subresource, r.data) for r in list(api)[seen:] if str(r.method.value) == "PATCH"]
    assert [sub for sub, _ in after] == ["status", None]  # the condition and the cordon, once each
    assert after[1][1]["spec"] == {"unschedulable": True}


def test_the_node_cache_keeps_what_the_remediator_reads_and_not_a_nodes_image_list() -> None:
    obj = node("gpu-1")
    obj["status"]["images"] = [{"names": [f"registry/image-{i}:latest"], "sizeBytes": i} for i in range(500)]
    obj["metadata"]["managedFields"] = [
        {"manager": "kubelet", "operation": "Update", "fieldsV1": {"f:status": {"f:images": {}}}},
        {"manager": "accel-health-remediator", "fieldsV1": {"f:spec": {"f:unschedulable": {}}}},
    ]
    kept = trim_node(obj)
    assert "images" not in kept["status"]
    assert kept["status"]["conditions"] == obj["status"]["conditions"]
    assert len(json.dumps(kept)) < len(json.dumps(obj)) / 10
    # Who manages spec.unschedulable reads the same from what is kept.
    assert manages_unschedulable(kept, "accel-health-remediator")
    assert not manages_unschedulable(kept, "kubelet")
    assert manages_unschedulable(obj, "accel-health-remediator") == manages_unschedulable(
        kept, "accel-health-remediator"
    )
    assert "images" in obj["status"]  # the object read is not changed


# -- writes the API refuses for good, leadership lost between two attempts, bounded annotations --


async def test_a_write_the_api_refuses_as_invalid_is_a_failure_not_an_outage_retried_for_ever(
    fake: tuple[FakeApiServer, KubernetesCluster],
) -> None:
    api, cluster = fake
    api.add(node("gpu-1"))
    api["patch", api.resource("v1/nodes")] << (
        lambda: (_ for _ in ()).throw(status_error(422, "Invalid", "metadata.annotations: Too long"))
    )
    with pytest.raises(WriteRefused, match="422"):
        await cluster.cordon("gpu-1")
    assert len([r for r in api if str(r.method.value) == "PATCH"]) == 1  # asked once, not retried


async def test_through_the_engine_a_refused_write_is_recorded_failed_and_answered_200(
    aiohttp_client: AiohttpClient,
) -> None:
    async with serve() as (api, url):
        api.add(node("gpu-node-1"))
        api["patch", api.resource("v1/nodes")] << (
            lambda: (_ for _ in ()).throw(status_error(422, "Invalid", "metadata.annotations: Too long"))
        )
        cluster = connect(url)
        engine = Engine(
            policy=load_policy(),
            cluster=cluster,
            aws=RecordingAws(),
            settings=EngineSettings(),
            clock=time.time,
        )
        client = await aiohttp_client(create_app(engine=engine, token=TOKEN))
        try:
            response = await client.post("/alerts", json=payload("gpu-fatal-xid"), headers=AUTH)
            assert response.status == 200  # a 503 would have Alertmanager resend it for ever
            failed = [r for r in engine.log.records() if r.outcome == "failed"]
            assert failed
            assert "refused" in failed[0].reason
        finally:
            await cluster.close()


async def test_a_replica_that_lost_the_lease_during_a_conflict_does_not_write_again() -> None:
    leading = {"now": True}
    async with serve() as (api, url):
        api.add(node("gpu-1"))

        def conflict_and_lose_the_lease(_request: Any) -> None:
            leading["now"] = False  # another replica took over and wrote: that is the conflict
            raise status_error(409, "Conflict", "the object has been modified")

        api["patch", api.resource("v1/nodes")][:1] << conflict_and_lose_the_lease
        cluster = connect(url, should_act=lambda: leading["now"])
        try:
            with pytest.raises(NotLeader):
                await cluster.cordon("gpu-1")
        finally:
            await cluster.close()
    assert len([r for r in api if str(r.method.value) == "PATCH"]) == 1


def test_drain_blocked_names_at_most_twenty_pods_and_counts_the_rest() -> None:
    blocked = [BlockedPod("ml", f"p{i}", "PDB") for i in range(BLOCKED_SHOWN + 5)]
    text = blocked_annotation(blocked)
    assert text.count(",") == BLOCKED_SHOWN
    assert text.endswith(",+5 more")
    assert blocked_annotation(blocked[:2]) == "ml/p0,ml/p1"
