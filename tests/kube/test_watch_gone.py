"""The watch-backed caches meet `410 Gone` from the real API server, after a real etcd compaction.

The API server of this module runs without its watch cache, so a watch is served by etcd itself:
compacting etcd (through its v3 HTTP gateway, as the API server's own compactor does every few
minutes) makes every older resourceVersion too old, and a watch resumed from one is answered 410
Gone. The caches' watches end every two seconds (server-side timeout), so each resumes from the
version it last saw soon after the compaction. Covered: the node cache and the pod cache of a
draining node each list again once (counted in the audit log), and then keep following changes
(a human's cordon; a pod bound to the node, a pod deleted).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from remediator.executors.kubernetes import KubernetesCluster, KubernetesSettings
from tests.kube.conftest import control_plane_skip_reason
from tests.kube.controlplane import ControlPlane, apply_objects, compact_etcd, control_plane, request_of
from tests.kube.rest import Obj

NS = "accel-health"
SA = "watcher"
USER = f"system:serviceaccount:{NS}:{SA}"
NODES = ("gpu-0", "gpu-1")
WATCH_SECONDS = 2


@pytest.fixture(scope="module")
def plane(workdir: Path) -> Iterator[ControlPlane]:
    """A control plane whose watches are served by etcd, not the API server's watch cache."""
    reason = control_plane_skip_reason()
    if reason:
        pytest.skip(reason)
    with control_plane(workdir / "control-plane", apiserver_args=("--watch-cache=false",)) as started:
        yield started


@pytest.fixture(scope="module")
def token(plane: ControlPlane) -> str:
    apply_objects(plane.admin, [{"apiVersion": "v1", "kind": "Node", "metadata": {"name": n}} for n in NODES])
    return plane.cluster_admin_account(NS, SA)


def cluster_for(plane: ControlPlane, token: str) -> KubernetesCluster:
    settings = KubernetesSettings(
        state_namespace=NS, request_timeout_seconds=5.0, instance="test", watch_seconds=WATCH_SECONDS
    )
    return KubernetesCluster(api=plane.api_client(token=token), settings=settings)


def lists(plane: ControlPlane, resource: str) -> int:
    """LIST requests of the ServiceAccount for `resource`, per the audit log."""
    return sum(1 for e in plane.audit(user=USER) if request_of(e) == ("list", resource))


def move_etcd_on_and_compact(plane: ControlPlane) -> int:
    """Writes elsewhere move etcd's revision past every version the caches saw; then compaction
    forgets all of it. Returns the revision compacted to."""
    for i in range(3):
        apply_objects(
            plane.admin,
            [{"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"filler-{i}", "namespace": NS}}],
        )
        stamp = {"data": {"written": str(time.time_ns())}}  # a new value: a write, never a no-op
        plane.admin.merge_patch(f"/api/v1/namespaces/{NS}/configmaps/filler-{i}", stamp)
    return compact_etcd(plane)


async def eventually(check: Callable[[], bool], what: str, seconds: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while not check():
        if loop.time() > deadline:
            raise AssertionError(f"not within {seconds:.0f}s: {what}")
        await asyncio.sleep(0.1)


def bare_pod(name: str, node: str) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"nodeName": node, "containers": [{"name": "main", "image": "trainer:1"}]},
    }


async def test_the_node_cache_lists_again_after_410_gone_and_keeps_following_the_nodes(
    plane: ControlPlane, token: str
) -> None:
    cluster = cluster_for(plane, token)
    try:
        assert await cluster.start_cache(wait_seconds=20)
        seen = cluster.nodes.version
        compacted = move_etcd_on_and_compact(plane)
        assert int(seen) < compacted
        await eventually(lambda: cluster.nodes.expired >= 1, "a node watch answered 410 Gone")
        await eventually(lambda: cluster.nodes.lists == 2, "the node cache listed again")
        assert int(cluster.nodes.version) >= compacted

        plane.admin.merge_patch("/api/v1/nodes/gpu-1", {"spec": {"unschedulable": True}})

        def cordoned() -> bool:
            obj = cluster.nodes.get("gpu-1")
            return obj is not None and bool(obj["spec"].get("unschedulable"))

        await eventually(cordoned, "the cache saw the cordon made after the relist")
        assert cluster.nodes.expired == 1
        assert cluster.nodes.lists == 2
    finally:
        await cluster.close()
        plane.admin.merge_patch("/api/v1/nodes/gpu-1", {"spec": {"unschedulable": None}})
    assert lists(plane, "nodes") == 2  # the first LIST and the one after 410 Gone; nothing else


async def test_the_pod_cache_of_a_draining_node_lists_again_after_410_gone_and_keeps_following(
    plane: ControlPlane, token: str
) -> None:
    apply_objects(plane.admin, [bare_pod("early", "gpu-0"), bare_pod("elsewhere", "gpu-1")])
    before = lists(plane, "pods")
    cluster = cluster_for(plane, token)
    try:
        async with cluster.watching_pods("gpu-0") as pods:
            assert sorted(name for _, name in map(key_of, pods.objects())) == ["early"]
            seen = pods.version
            compacted = move_etcd_on_and_compact(plane)
            assert int(seen) < compacted
            await eventually(lambda: pods.expired >= 1, "a pod watch answered 410 Gone")
            await eventually(lambda: pods.lists == 2, "the pod cache listed again")
            assert int(pods.version) >= compacted

            apply_objects(plane.admin, [bare_pod("late", "gpu-0")])
            plane.admin.delete(f"/api/v1/namespaces/{NS}/pods/early", {"gracePeriodSeconds": 0})
            await eventually(
                lambda: sorted(name for _, name in map(key_of, pods.objects())) == ["late"],
                "the cache saw a pod arrive and one go after the relist",
            )
            assert pods.lists == 2
        assert cluster.pod_watches == {}  # the watch ended with the block
    finally:
        await cluster.close()
    assert lists(plane, "pods") - before == 2


def key_of(obj: Obj) -> tuple[str, str]:
    return str(obj["metadata"]["namespace"]), str(obj["metadata"]["name"])
