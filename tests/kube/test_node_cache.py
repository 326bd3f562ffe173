"""The executor's watch-backed node cache against the real API server, requests counted in its audit log.

The remediator's client runs as a ServiceAccount of its own so that the audit log tells its requests
apart. Covered: one LIST then a WATCH, a human's cordon seen through the watch; reading every node
again converts only the nodes that changed; a firing delivery makes no LIST and no GET and, per
action, one PATCH (which records the episode too) and its Event; a resend makes no request at all.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from remediator.executors.kubernetes import KubernetesCluster, KubernetesSettings
from remediator.executors.snapshot import RecordingAws
from remediator.intake.payload import parse_payload
from remediator.lifecycle.engine import Engine
from remediator.lifecycle.model import EngineSettings
from remediator.lifecycle.record import EPISODES
from remediator.policy import parse_policy
from tests.kube.controlplane import ControlPlane, eventually, request_of
from tests.kube.kubelet import FakeKubelet, KubeletSettings

NS = "accel-health"
SA = "counted"
USER = f"system:serviceaccount:{NS}:{SA}"
NODES = [f"gpu-{i}" for i in range(5)]
CORDON = parse_policy(
    "safety: {max_disrupted_nodes: 3, storm_breaker: {enabled: false}}\n"
    "rules:\n  - {name: c, actions: [cordon], on_resolved: [uncordon]}\n"
)


@pytest.fixture(scope="module")
def token(plane: ControlPlane, workdir: Path) -> Iterator[str]:
    fake = FakeKubelet(plane=plane, workdir=workdir, settings=KubeletSettings(start_delay=0.2))
    for name in NODES:
        fake.add_node(name, labels={"pool": "gpu"}, capacity={"nvidia.com/gpu": "8"})
    token = plane.cluster_admin_account(NS, SA)
    fake.start()
    yield token
    fake.stop()


def cluster_for(plane: ControlPlane, token: str) -> KubernetesCluster:
    settings = KubernetesSettings(state_namespace=NS, request_timeout_seconds=5.0, instance="test")
    return KubernetesCluster(api=plane.api_client(token=token), settings=settings)


def requests(plane: ControlPlane, since: int = 0) -> list[tuple[str, str]]:
    """(verb, resource) of the ServiceAccount's requests, after the first `since` ones."""
    return [request_of(e) for e in plane.audit(user=USER)[since:]]


async def test_the_cache_lists_once_then_follows_a_humans_cordon_through_the_watch(
    plane: ControlPlane, token: str
) -> None:
    cluster = cluster_for(plane, token)
    try:
        assert await cluster.start_cache(wait_seconds=20)
        assert {n.name for n in await cluster.list_nodes()} >= set(NODES)
        plane.admin.merge_patch("/api/v1/nodes/gpu-4", {"spec": {"unschedulable": True}})

        async def cordoned() -> bool:
            node = await cluster.get_node("gpu-4")
            return node is not None and node.unschedulable

        await eventually(cordoned)
        assert (cluster.nodes.lists, cluster.nodes.watches) == (1, 1)
    finally:
        await cluster.close()
        plane.admin.merge_patch("/api/v1/nodes/gpu-4", {"spec": {"unschedulable": None}})


async def test_reading_every_node_converts_only_the_nodes_changed_since_the_last_read(
    plane: ControlPlane, token: str
) -> None:
    cluster = cluster_for(plane, token)
    try:
        assert await cluster.start_cache(wait_seconds=20)
        first = {n.name: n for n in await cluster.list_nodes()}
        again = {n.name: n for n in await cluster.list_nodes()}
        assert all(again[name] is node for name, node in first.items())  # nothing converted anew
        plane.admin.merge_patch("/api/v1/nodes/gpu-3", {"spec": {"unschedulable": True}})

        async def seen() -> bool:
            return any(n.name == "gpu-3" and n.unschedulable for n in await cluster.list_nodes())

        await eventually(seen)
        after = {n.name: n for n in await cluster.list_nodes()}
        assert [name for name in first if after[name] is not first[name]] == ["gpu-3"]
    finally:
        await cluster.close()
        plane.admin.merge_patch("/api/v1/nodes/gpu-3", {"spec": {"unschedulable": None}})


async def test_a_firing_delivery_makes_one_write_per_action_and_a_resend_none(
    plane: ControlPlane, token: str
) -> None:
    cluster = cluster_for(plane, token)
    engine = Engine(
        policy=CORDON, cluster=cluster, aws=RecordingAws(), settings=EngineSettings(), clock=time.time
    )
    try:
        assert await cluster.start_cache(wait_seconds=20)
        await engine.start()
        before = len(plane.audit(user=USER))
        alerts = [
            {"labels": {"alertname": "AccelGPUFatalXid", "node": n}, "startsAt": "2025-11-22T20:00:00Z"}
            for n in ("gpu-0", "gpu-1")
        ]
        await engine.handle(parse_payload({"version": "4", "alerts": alerts}))
        assert [r.outcome for r in engine.log.records()] == ["done", "done"]
        made = requests(plane, before)
        again = len(plane.audit(user=USER))
        for _ in range(5):
            await engine.handle(parse_payload({"version": "4", "alerts": alerts}))  # resends
        resent = requests(plane, again)
        stored = {
            n: plane.admin.get(f"/api/v1/nodes/{n}")["metadata"]["annotations"] for n in ("gpu-0", "gpu-1")
        }
    finally:
        await cluster.close()
        for n in ("gpu-0", "gpu-1"):
            patch = {"spec": {"unschedulable": None}, "metadata": {"annotations": {EPISODES: None}}}
            plane.admin.merge_patch(f"/api/v1/nodes/{n}", patch)
    # Per action one PATCH of the node, with the episode that asked for it; its Event (the fault seen
    # and the cordon done, in one). Nothing else: no read, no other object.
    assert sorted(made) == [("create", "events")] * 2 + [("patch", "nodes")] * 2
    assert all(EPISODES in annotations for annotations in stored.values())
    assert resent == []
