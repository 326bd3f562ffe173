"""The remediator's gates reconciled from the real API server (issue 15's items 3 and 4, as scenarios).

A bare control plane holds ten accelerator nodes and thirty CPU-only ones; AWS is a moto server with
an Auto Scaling group and one instance outside any group (a Karpenter or self-managed node). The
engine runs over the real Kubernetes executor and the real AWS executor. Covered: a node in no Auto
Scaling group is recorded as not replaced, and its budget is given back once a human uncordons it,
so the next faulty node is acted on; a storm that keeps firing longer than window + cooldown without
a resend keeps the breaker open, CPU-only nodes not diluting it; nodes already cordoned by someone
else or NotReady count against the budget.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from remediator.executors.aws import AwsExecutor, AwsSettings
from remediator.executors.kubernetes import KubernetesCluster
from remediator.executors.snapshot import RecordingAws
from remediator.lifecycle.engine import Engine
from remediator.lifecycle.model import EngineSettings
from remediator.policy import Policy, parse_policy
from tests.kube.controlplane import ControlPlane, apply_objects, cordoned, forget_remediation
from tests.kube.kubelet import FakeKubelet
from tests.kube.test_reconcile import cluster_for, outcomes, webhook
from tests.remediator.test_aws_executor import REGION, aws_client, health, make_group, session

NS = "accel-health"
STATE_CM = "accel-health-remediator-gates"
GPUS = [f"gpu-{i}" for i in range(10)]


class Clock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def instances(moto_url: str) -> dict[str, str]:
    """Node name -> instance id: gpu-0 and gpu-1 in an Auto Scaling group, gpu-2 in none."""
    in_group = make_group(moto_url, size=2)
    ec2 = aws_client(moto_url, "ec2")
    alone = ec2.run_instances(ImageId="ami-12c6146b", MinCount=1, MaxCount=1, InstanceType="p5.48xlarge")
    return {"gpu-0": in_group[0], "gpu-1": in_group[1], "gpu-2": alone["Instances"][0]["InstanceId"]}


@pytest.fixture(scope="module")
def nodes(plane: ControlPlane, workdir: Path, instances: dict[str, str]) -> list[str]:
    fake = FakeKubelet(plane=plane, workdir=workdir)  # never started: the nodes' objects are enough
    for i, name in enumerate(GPUS):
        instance = instances.get(name, f"i-{i:017x}")
        fake.add_node(
            name,
            labels={"pool": "gpu"},
            capacity={"nvidia.com/gpu": "8"},
            provider_id=f"aws:///{REGION}a/{instance}",
        )
    for i in range(30):
        fake.add_node(f"cpu-{i}", labels={"pool": "cpu"})
    apply_objects(plane.admin, [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}}])
    return GPUS


@pytest.fixture
def fresh(plane: ControlPlane, nodes: list[str]) -> Iterator[None]:
    forget_remediation(plane, namespace=NS, state_configmap=STATE_CM)
    yield
    forget_remediation(plane, namespace=NS, state_configmap=STATE_CM)
    plane.admin.merge_patch("/api/v1/nodes/gpu-6/status", {"status": {"conditions": [ready("True")]}})


def ready(status: str) -> dict[str, str]:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return {
        "type": "Ready",
        "status": status,
        "reason": "KubeletReady" if status == "True" else "KubeletNotReady",
        "message": "set by the test",
        "lastHeartbeatTime": stamp,
        "lastTransitionTime": stamp,
    }


def alert(node: str, *, starts: str = "2025-11-22T20:00:00Z") -> dict[str, Any]:
    return {
        "status": "firing",
        "labels": {"alertname": "AccelGPUFatalXid", "node": node},
        "startsAt": starts,
        "fingerprint": f"fatal-{node}",
    }


def engine(plane: ControlPlane, policy: Policy, *, aws: Any = None, clock: Clock | None = None) -> Engine:
    return Engine(
        policy=policy,
        cluster=cluster_for(plane),
        aws=aws or RecordingAws(),
        settings=EngineSettings(),
        clock=clock or time.time,
    )


async def close(eng: Engine) -> None:
    await eng.stop()
    cluster = eng._cluster
    assert isinstance(cluster, KubernetesCluster)
    await cluster.close()


# -- 3: a node in no Auto Scaling group -----------------------------------------------------------

REPLACE = parse_policy(
    "safety: {max_disrupted_nodes: 1, storm_breaker: {enabled: false}}\n"
    "rules:\n  - {name: replace, actions: [cordon, aws_set_unhealthy]}\n"
)


async def test_a_karpenter_style_node_is_not_said_to_be_replaced_and_a_humans_uncordon_frees_its_budget(
    plane: ControlPlane, moto_url: str, instances: dict[str, str], fresh: None
) -> None:
    aws = AwsExecutor(settings=AwsSettings(region=REGION, endpoint_url=moto_url), session=session())
    eng = engine(plane, REPLACE, aws=aws)
    try:
        await eng.handle(webhook(alert("gpu-2")))
        skipped = eng.log.records()[-1]
        assert (skipped.action, skipped.outcome) == ("aws_set_unhealthy", "skipped")
        assert "no Auto Scaling group" in skipped.reason
        assert "will be replaced" not in skipped.reason
        assert cordoned(plane) == ["gpu-2"]

        await eng.handle(webhook(alert("gpu-2"), alert("gpu-0")))  # the budget of 1 is gpu-2's
        assert outcomes(eng)[-2:] == [
            ("gpu-0", "cordon", "deferred", "budget"),
            ("gpu-0", "aws_set_unhealthy", "deferred", "order"),
        ]
        assert health(moto_url, instances["gpu-0"]) == "Healthy"

        # A human puts gpu-2 back into service (Karpenter will not replace it, someone has to).
        plane.admin.merge_patch("/api/v1/nodes/gpu-2", {"spec": {"unschedulable": False}})
        await eng.handle(webhook(alert("gpu-2"), alert("gpu-0")))  # the next resend, nothing else
    finally:
        await close(eng)
    assert cordoned(plane) == ["gpu-0"]  # gpu-2 stays where the human put it
    assert health(moto_url, instances["gpu-0"]) == "Unhealthy"
    assert ("gpu-0", "aws_set_unhealthy", "done", None) in outcomes(eng)


# -- 4: a storm that keeps firing without resends -------------------------------------------------

STORM = parse_policy(
    "safety:\n"
    "  max_disrupted_nodes: 10\n"
    "  storm_breaker: {threshold_percent: 30, min_nodes: 3, cooldown_seconds: 900}\n"
    "rules:\n  - {name: c, actions: [cordon]}\n"
)


async def test_a_storm_firing_longer_than_window_and_cooldown_without_resends_keeps_the_breaker_open(
    plane: ControlPlane, fresh: None
) -> None:
    clock = Clock()
    eng = engine(plane, STORM, clock=clock)
    try:
        await eng.handle(webhook(*(alert(f"gpu-{i}") for i in range(4))))  # 4 of 10 GPU nodes, 4 of 40 nodes
        status = eng.status()
        assert (status.alerting_nodes, status.eligible_nodes, status.breaker_open) == (4, 10, True)
        window = STORM.safety.storm_breaker.window_seconds + STORM.safety.storm_breaker.cooldown_seconds
        clock.now += window + 299  # the shipped warning route resends every 30 minutes: none yet
        assert eng.status().breaker_open
        await eng.handle(webhook(alert("gpu-9")))  # another node's fault arrives meanwhile
    finally:
        await close(eng)
    assert outcomes(eng)[-1] == ("gpu-9", "cordon", "deferred", "breaker")
    assert cordoned(plane) == []


# -- 4: the budget counts nodes already out of service ---------------------------------------------

BUDGET = parse_policy(
    "safety: {max_disrupted_nodes: 3, storm_breaker: {enabled: false}}\n"
    "rules:\n  - {name: c, actions: [cordon]}\n"
)


async def test_nodes_cordoned_by_someone_else_or_not_ready_count_against_the_budget(
    plane: ControlPlane, fresh: None
) -> None:
    plane.admin.merge_patch("/api/v1/nodes/gpu-5", {"spec": {"unschedulable": True}})  # a human's cordon
    plane.admin.merge_patch("/api/v1/nodes/gpu-6/status", {"status": {"conditions": [ready("False")]}})
    plane.admin.merge_patch("/api/v1/nodes/cpu-3", {"spec": {"unschedulable": True}})  # not an accelerator
    eng = engine(plane, BUDGET)
    try:
        await eng.handle(webhook(alert("gpu-1"), alert("gpu-3")))
    finally:
        await close(eng)
    # Nodes are decided in parallel: one of the two takes the last slot (whichever reaches the
    # budget first), the other is deferred by it.
    decided = sorted((o[2], o[3] or "") for o in outcomes(eng))
    assert decided == [("deferred", "budget"), ("done", "")]
    assert {o[0] for o in outcomes(eng)} == {"gpu-1", "gpu-3"}
    reason = next(r.reason for r in eng.log.records() if r.outcome == "deferred")
    assert "gpu-5 unschedulable" in reason
    assert "gpu-6 NotReady" in reason
    assert "cpu-3" not in reason
    [acted] = [o[0] or "" for o in outcomes(eng) if o[3] is None]
    assert cordoned(plane) == sorted(["cpu-3", acted, "gpu-5"])
