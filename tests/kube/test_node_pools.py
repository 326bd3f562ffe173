"""Policy rules selecting node pools by label, against the real API server.

A bare control plane with the kubelet stand-in: two node pools told apart by their nodes' own labels
(Karpenter's node-pool label, the instance type), a training pod on one node of each, and a CPU-only
node in the p5 pool. The engine runs over the real Kubernetes executor with its watch-backed node
cache (policy/v1 through the version-skew proxy), so what a rule selects is what the API server
says the node's labels are. Covered: a fault on each pool, the p5 node cordoned and drained and the
g5 node only tainted (its pod left running); the p5 rule's percentage budget counting a p5 node a
human already cordoned (and not the CPU-only one), deferring the next p5 node while g5 still acts
and letting it go once the human uncordons; an alert for a node the cluster does not have matching
no rule with a selector.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from remediator.executors.kubernetes import KubernetesCluster, KubernetesSettings
from remediator.executors.snapshot import RecordingAws
from remediator.lifecycle.engine import Engine
from remediator.lifecycle.model import EngineSettings
from remediator.policy import parse_policy
from tests.kube.controlplane import ControlPlane, apply_objects, cordoned, deployment, eventually, wait_for
from tests.kube.kubelet import FakeKubelet, KubeletSettings
from tests.kube.network import skew_proxy
from tests.kube.rest import Obj
from tests.kube.test_reconcile import node_obj, webhook

NS = "accel-health"
WORK = "work"
POOL = "karpenter.sh/nodepool"
TYPE = "node.kubernetes.io/instance-type"
P5 = [f"p5-{i}" for i in range(4)]
G5 = [f"g5-{i}" for i in range(2)]

POLICY = parse_policy(
    """
safety: {max_disrupted_nodes: 10, storm_breaker: {enabled: false}}
rules:
  - name: drain-p5
    match: ['alertname="AccelGPUFatalXid"']
    nodes: {matchLabels: {karpenter.sh/nodepool: p5}}
    max_disrupted_percent: 50
    actions: [cordon, {type: drain, timeout_seconds: 60}]
  - name: taint-g5
    match: ['alertname="AccelGPUFatalXid"']
    nodes:
      matchExpressions: [{key: node.kubernetes.io/instance-type, operator: In, values: [g5.48xlarge]}]
    actions: [{type: taint, key: accel-health.io/unhealthy, effect: NoSchedule}]
"""
)


@pytest.fixture(scope="module")
def kubelet(plane: ControlPlane, workdir: Path) -> Iterator[FakeKubelet]:
    fake = FakeKubelet(plane=plane, workdir=workdir, settings=KubeletSettings(start_delay=0.2))
    gpu = {"nvidia.com/gpu": "8"}
    for name in P5:
        fake.add_node(name, labels={POOL: "p5", TYPE: "p5.48xlarge"}, capacity=gpu)
    for name in G5:
        fake.add_node(name, labels={POOL: "g5", TYPE: "g5.48xlarge"}, capacity=gpu)
    fake.add_node("p5-cpu", labels={POOL: "p5", TYPE: "m7i.4xlarge"})  # in the pool, no accelerator
    namespaces = [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": n}} for n in (NS, WORK)]
    apply_objects(plane.admin, namespaces)
    fake.start()
    yield fake
    fake.stop()


def cluster_for(plane: ControlPlane, server: str) -> KubernetesCluster:
    settings = KubernetesSettings(
        state_namespace=NS, request_timeout_seconds=5.0, retry_base_seconds=0.05, instance="test"
    )
    return KubernetesCluster(api=plane.api_client(server=server), settings=settings)


def trainer(node: str) -> Obj:
    return deployment(f"trainer-{node}", WORK, node_selector={"kubernetes.io/hostname": node})


def running_on(plane: ControlPlane, node: str) -> list[str]:
    pods = plane.admin.items(f"/api/v1/namespaces/{WORK}/pods", fieldSelector=f"spec.nodeName={node}")
    return sorted(
        p["metadata"]["name"]
        for p in pods
        if (p.get("status") or {}).get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")
    )


def taints(plane: ControlPlane, name: str) -> list[tuple[str, str]]:
    return [(t["key"], t["effect"]) for t in node_obj(plane, name)["spec"].get("taints") or []]


def alert(node: str) -> dict[str, object]:
    return {
        "status": "firing",
        "labels": {"alertname": "AccelGPUFatalXid", "node": node},
        "startsAt": "2025-11-22T20:00:00Z",
        "fingerprint": f"xid-{node}",
    }


async def test_two_pools_one_drained_one_only_tainted_under_a_pool_budget_that_counts_a_humans_cordon(
    plane: ControlPlane, kubelet: FakeKubelet
) -> None:
    apply_objects(plane.admin, [trainer("p5-0"), trainer("g5-0")])
    wait_for(
        "a trainer on p5-0 and g5-0", lambda: all(running_on(plane, n) for n in ("p5-0", "g5-0")), timeout=60
    )
    p5_pod, g5_pod = running_on(plane, "p5-0"), running_on(plane, "g5-0")
    plane.admin.merge_patch("/api/v1/nodes/p5-3", {"spec": {"unschedulable": True}})  # a human's cordon
    plane.admin.merge_patch(
        "/api/v1/nodes/p5-cpu", {"spec": {"unschedulable": True}}
    )  # CPU-only: not counted
    with skew_proxy(plane) as proxy:
        cluster = cluster_for(plane, proxy)
        engine = Engine(
            policy=POLICY, cluster=cluster, aws=RecordingAws(), settings=EngineSettings(), clock=time.time
        )
        try:
            assert await cluster.start_cache(wait_seconds=20)
            await engine.start()
            await engine.handle(webhook(*(alert(n) for n in ("p5-0", "p5-1", "g5-0", "g5-1", "gpu-ghost"))))
            await engine.drained()
            first = [(r.node, r.rule, r.action, r.outcome, r.gate) for r in engine.log.records()]
            budgets = engine.status().as_json()["budget"]["rules"]

            # The human gives p5-3 back; the watch shows it, and the resend of p5-1 now acts.
            plane.admin.merge_patch("/api/v1/nodes/p5-3", {"spec": {"unschedulable": None}})

            async def seen_uncordoned() -> bool:
                node = await cluster.get_node("p5-3")
                return node is not None and not node.unschedulable

            await eventually(seen_uncordoned)
            await engine.handle(webhook(alert("p5-1")))
            await engine.drained()
        finally:
            await cluster.close()

    assert ("p5-0", "drain-p5", "cordon", "done", None) in first
    assert ("p5-0", "drain-p5", "drain", "done", None) in first
    assert ("p5-1", "drain-p5", "cordon", "deferred", "budget") in first
    assert sorted(d for d in first if d[0] in G5) == [  # nodes are decided in parallel
        ("g5-0", "taint-g5", "taint", "done", None),
        ("g5-1", "taint-g5", "taint", "done", None),
    ]
    [deferral] = [
        r for r in engine.log.records() if (r.node, r.action, r.outcome) == ("p5-1", "cordon", "deferred")
    ]
    assert (
        "rule 'drain-p5' budget exhausted: 2 of 2 (50% of 4 nodes karpenter.sh/nodepool=p5" in deferral.reason
    )
    assert "p5-3 unschedulable" in deferral.reason
    assert "p5-cpu" not in deferral.reason
    [ghost] = [r for r in engine.log.records() if r.node == "gpu-ghost"]
    assert ghost.outcome == "ignored"
    assert "node gpu-ghost is not in the observed nodes" in ghost.reason
    assert budgets["drain-p5"]["in_use"] == 2
    assert budgets["drain-p5"]["covered_nodes"] == 4
    assert budgets["drain-p5"]["disrupted"] == {
        "p5-0": "held by accel-health (cordon, drain)",
        "p5-3": "unschedulable",
    }

    # The API server's view: p5 nodes out (p5-0 drained, its trainer evicted), g5 nodes only tainted.
    assert cordoned(plane) == ["p5-0", "p5-1", "p5-cpu"]
    [drained] = [
        r for r in engine.log.records() if (r.node, r.action, r.outcome) == ("p5-0", "drain", "done")
    ]
    assert drained.details["evicted"] == [{"namespace": WORK, "name": p5_pod[0]}]
    assert p5_pod[0] not in running_on(plane, "p5-0")
    assert running_on(plane, "g5-0") == g5_pod  # a NoSchedule taint leaves the running trainer alone
    for name in G5:
        assert taints(plane, name) == [("accel-health.io/unhealthy", "NoSchedule")]
    assert taints(plane, "p5-0") == []
    assert [(r.action, r.outcome) for r in engine.log.records() if r.node == "p5-1"][-3:] == [
        ("cordon", "done"),
        ("drain", "started"),
        ("drain", "done"),
    ]
