"""The executor's watch-backed caches of pods and PodDisruptionBudgets during drains, against the
HTTP-level fake API server (which serves watches, and answers 410 Gone after `compact()`).

Covers: a drain lists its node's pods and the budgets once and follows them through watches that
end with it; the LIST a plan made moments before is where the drain's watch starts (one LIST for
plan and drain), and a pod bound to the node after that LIST is evicted too; a drain running
beside another shares the budgets' watch; an eviction a budget refused is retried as soon as the
watched budget allows one, not after the backoff; a watch whose version was compacted away lists
again and keeps following; the wait for evicted pods wakes at each change the watch delivers.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from kubernetes.aio import client as k8s

from remediator.cluster import DrainSettings
from remediator.executors.kubernetes import KubernetesCluster, KubernetesSettings
from tests.remediator.fake_apiserver import FakeApiServer, node, pdb, pod, serve

FAST = KubernetesSettings(request_timeout_seconds=1.0, retry_base_seconds=0.01, instance="test-0")
QUICK_DRAIN = DrainSettings(
    timeout_seconds=5, backoff_initial_seconds=0.05, backoff_max_seconds=0.2, poll_interval_seconds=0.05
)


def connect(url: str, settings: KubernetesSettings = FAST) -> KubernetesCluster:
    return KubernetesCluster(api=k8s.ApiClient(k8s.Configuration(host=url)), settings=settings)


@pytest.fixture
async def fake() -> AsyncIterator[tuple[FakeApiServer, KubernetesCluster]]:
    async with serve(termination_seconds=0.2) as (api, url):
        cluster = connect(url)
        try:
            yield api, cluster
        finally:
            await cluster.close()


def reads(api: FakeApiServer, plural: str) -> list[str]:
    """`list` or `watch` for every collection GET of `plural`, in order."""
    out = []
    for request in api:
        res = request.resource
        if res is None or res.plural != plural or request.name is not None:
            continue
        if str(request.method.value).upper() == "GET":
            out.append("watch" if request.params.get("watch") == "true" else "list")
    return out


async def test_a_drain_lists_pods_and_budgets_once_and_its_watches_end_with_it(
    fake: tuple[FakeApiServer, KubernetesCluster],
) -> None:
    api, cluster = fake
    api.add(node("gpu-1"))
    for i in range(5):
        api.add(pod(f"worker-{i}", node_name="gpu-1"))
    api.add(pdb("workers", match={"app": "trainer"}, allowed=5))
    outcome = await cluster.drain("gpu-1", QUICK_DRAIN)
    assert outcome.completed, outcome.summary()
    assert len(outcome.evicted) == 5
    assert reads(api, "pods") == ["list", "watch"]
    assert reads(api, "poddisruptionbudgets") == ["list", "watch"]
    assert cluster.pod_watches == {}
    assert cluster.pdb_watches == {}


async def test_the_plans_list_seeds_the_drain_and_a_pod_bound_after_it_is_evicted_too(
    fake: tuple[FakeApiServer, KubernetesCluster],
) -> None:
    api, cluster = fake
    api.add(node("gpu-1"))
    api.add(pod("early", node_name="gpu-1"))
    planned = await cluster.list_pods("gpu-1")  # the engine's plan
    await cluster.list_pdbs()
    assert [p.name for p in planned] == ["early"]
    api.add(pod("late", node_name="gpu-1"))  # bound between the plan's LIST and the cordon
    outcome = await cluster.drain("gpu-1", QUICK_DRAIN)
    assert outcome.completed, outcome.summary()
    assert sorted(outcome.evicted) == ["training/early", "training/late"]
    assert reads(api, "pods") == ["list", "watch"]
    assert reads(api, "poddisruptionbudgets") == ["list", "watch"]


async def test_a_plans_list_older_than_a_few_seconds_is_not_used(
    fake: tuple[FakeApiServer, KubernetesCluster],
) -> None:
    api, url_cluster = fake
    now = [1000.0]
    cluster = KubernetesCluster(api=url_cluster.api, settings=FAST, clock=lambda: now[0])
    api.add(node("gpu-1"))
    api.add(pod("w", node_name="gpu-1"))
    await cluster.list_pods("gpu-1")
    now[0] += 60
    async with cluster.watching_pods("gpu-1") as pods:
        assert names(pods.objects()) == ["w"]
    assert reads(api, "pods").count("list") == 2  # the plan's, then the drain's own


async def test_drains_running_at_once_share_one_watch_of_the_budgets() -> None:
    async with serve(termination_seconds=0.5) as (api, url):
        cluster = connect(url)
        try:
            for name in ("gpu-1", "gpu-2"):
                api.add(node(name))
                api.add(pod(f"w-{name}", node_name=name))
            one, two = await asyncio.gather(
                cluster.drain("gpu-1", QUICK_DRAIN), cluster.drain("gpu-2", QUICK_DRAIN)
            )
        finally:
            await cluster.close()
    assert one.completed
    assert two.completed
    assert reads(api, "pods") == ["list", "list", "watch", "watch"]
    assert reads(api, "poddisruptionbudgets") == ["list", "watch"]


async def test_an_eviction_a_budget_refused_goes_through_as_soon_as_the_watched_budget_allows(
    fake: tuple[FakeApiServer, KubernetesCluster],
) -> None:
    api, cluster = fake
    api.add(node("gpu-1"))
    api.add(pod("guarded", node_name="gpu-1", labels={"app": "db"}))
    api.add(pdb("db", match={"app": "db"}, allowed=0))
    patient = DrainSettings(timeout_seconds=20, backoff_initial_seconds=8, poll_interval_seconds=0.05)
    asyncio.get_running_loop().call_later(0.3, api.set_disruptions_allowed, "training", "db", 1)
    started = time.monotonic()
    outcome = await cluster.drain("gpu-1", patient)
    took = time.monotonic() - started
    assert outcome.completed
    assert [status for *_, status in api.evictions] == [429, 201]
    assert took < 3  # woken by the budget's change, not after the 4 s or more the backoff says


async def test_the_wait_for_evicted_pods_is_woken_by_the_watch_not_by_the_poll_interval() -> None:
    async with serve() as (api, url):  # an evicted pod is gone at once: its DELETED races the answer
        cluster = connect(url)
        try:
            api.add(node("gpu-1"))
            for i in range(20):
                api.add(pod(f"w-{i}", node_name="gpu-1"))
            slow_poll = DrainSettings(timeout_seconds=60, concurrency=1, poll_interval_seconds=30)
            started = time.monotonic()
            outcome = await cluster.drain("gpu-1", slow_poll)
            took = time.monotonic() - started
        finally:
            await cluster.close()
    assert outcome.completed
    assert len(outcome.evicted) == 20
    assert took < 10  # a single change missed would have cost the 30 s poll interval


async def test_a_watch_whose_version_was_compacted_lists_again_and_keeps_following(
    fake: tuple[FakeApiServer, KubernetesCluster],
) -> None:
    api, cluster = fake
    api.add(node("gpu-1"))
    api.add(pod("a", node_name="gpu-1"))
    async with cluster.watching_pods("gpu-1") as pods:
        api.add(pod("b", node_name="gpu-1"))
        await wait_for(lambda: pods.get(("training", "b")) is not None)
        api.compact()
        api.end_watches()  # the watch is resumed from a version etcd no longer has
        await wait_for(lambda: pods.expired == 1 and pods.lists == 2)
        api.remove("pods", "a", "training")
        await wait_for(lambda: pods.get(("training", "a")) is None)
        assert names(pods.objects()) == ["b"]
    assert reads(api, "pods") == ["list", "watch", "watch", "list", "watch"]


def names(objs: list[dict[str, Any]]) -> list[str]:
    return sorted(str(o["metadata"]["name"]) for o in objs)


async def wait_for(check: Callable[[], bool], seconds: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while not check():
        if loop.time() > deadline:
            raise AssertionError(f"not within {seconds}s")
        await asyncio.sleep(0.02)
