"""A node's lifecycle on the real API server: each scenario interrupts one node's life once, as issue 34
found them going wrong, and checks the node ends as an operator expects.

A bare control plane with the kubelet stand-in (pods Running and Ready, evicted pods terminated);
the engine runs over the real Kubernetes executor with a cluster-admin ServiceAccount (its requests
are told apart in the audit log) behind the policy/v1 proxy, with its node watch running, as the
service runs. Covered:

- a human's uncordon mid-drain (a PodDisruptionBudget keeps the drain retrying): no eviction is
  asked after the release is written, the drain is recorded `stopped`, nothing replaces the node,
  the budget slot is free before any delivery, the resend does not cordon it again, and the next
  fault elsewhere is acted on at once;
- a node held by a `taint` rule comes back from its repair without the taint (its exact value),
  the record, or the drain and ownership annotations;
- a leader killed mid-drain whose alert resolves before the next leader reads Alertmanager: the next
  leader ends the drain (`stopped`, nothing evicted for it), and a human's uncordon then frees the
  slot: the next fault is not deferred by "1 of 1 nodes already out of service";
- a drain left running by a dead leader is resumed by the next one with the rule its episode
  recorded, without Alertmanager (the shipped policy matches on the `remediation` label, which the
  record does not keep).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from remediator.cluster import DrainSettings
from remediator.desired.alertmanager import AlertmanagerView
from remediator.executors.kubernetes import KubernetesCluster, KubernetesSettings
from remediator.executors.snapshot import RecordingAws
from remediator.intake.payload import WebhookPayload, parse_payload
from remediator.lifecycle.engine import Engine
from remediator.lifecycle.model import EngineSettings
from remediator.lifecycle.record import CORDONED_BY, DRAIN_STATUS, EPISODES, TAINTS_ADDED, read
from remediator.lifecycle.repair import RepairLoop, Verification
from remediator.policy import Policy, load_policy, parse_policy
from tests.kube.controlplane import (
    ADMIN_USER,
    ControlPlane,
    apply_objects,
    cordoned,
    deployment,
    eventually,
    forget_remediation,
    request_of,
    wait_for,
)
from tests.kube.kubelet import FakeKubelet, KubeletSettings
from tests.kube.network import skew_proxy
from tests.kube.rest import ApiError, Obj

NS = "accel-health"
WORK = "work"
SA = "lifecycle-remediator"
USER = f"system:serviceaccount:{NS}:{SA}"
NODES = [f"gpu-{i}" for i in range(8)]
STATE_CM = "accel-health-remediator-gates"
PATIENT = DrainSettings(backoff_initial_seconds=0.2, backoff_max_seconds=1.0, poll_interval_seconds=0.2)
"""A drain a budget holds back asks again often: an eviction after the release would show."""

REPLACE = parse_policy(
    "safety: {max_disrupted_nodes: 1, storm_breaker: {enabled: false}}\n"
    "rules:\n"
    "  - name: replace\n"
    "    actions: [cordon, {type: drain, timeout_seconds: 600, on_timeout: stop}, aws_set_unhealthy]\n"
)
TAINT = parse_policy(
    "safety: {max_disrupted_nodes: 2, storm_breaker: {enabled: false}}\n"
    "repair: {checks: [remapped], interval_seconds: 3600}\n"
    "rules:\n"
    "  - name: taint\n"
    "    actions:\n"
    "      - {type: condition, condition_type: AcceleratorHealthy}\n"
    "      - {type: taint, key: accel-health.io/unhealthy, value: 'true', effect: NoSchedule}\n"
)


@pytest.fixture(scope="module")
def kubelet(plane: ControlPlane, workdir: Path) -> Iterator[FakeKubelet]:
    fake = FakeKubelet(plane=plane, workdir=workdir, settings=KubeletSettings(start_delay=0.2))
    for i, name in enumerate(NODES):
        fake.add_node(
            name,
            labels={"pool": "gpu"},
            capacity={"nvidia.com/gpu": "8"},
            provider_id=f"aws:///us-east-1a/i-{i:017x}",
        )
    namespaces = [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": n}} for n in (NS, WORK)]
    apply_objects(plane.admin, namespaces)
    fake.start()
    yield fake
    fake.stop()


@pytest.fixture(scope="module")
def token(plane: ControlPlane, kubelet: FakeKubelet) -> str:
    return plane.cluster_admin_account(NS, SA)


@pytest.fixture(scope="module")
def proxy(plane: ControlPlane) -> Iterator[str]:
    with skew_proxy(plane) as url:
        yield url


@pytest.fixture
def fresh(plane: ControlPlane, kubelet: FakeKubelet) -> Iterator[None]:
    forget_remediation(plane, namespace=NS, state_configmap=STATE_CM)
    yield
    forget_remediation(plane, namespace=NS, state_configmap=STATE_CM)
    for path in (
        f"/apis/apps/v1/namespaces/{WORK}/deployments/guarded",
        f"/apis/policy/v1beta1/namespaces/{WORK}/poddisruptionbudgets/guarded",
    ):
        with contextlib.suppress(ApiError):  # absent: nothing to clean
            plane.admin.delete(path)


def cluster_for(plane: ControlPlane, *, server: str, token: str) -> KubernetesCluster:
    settings = KubernetesSettings(
        state_namespace=NS, request_timeout_seconds=5.0, retry_base_seconds=0.05, instance="test"
    )
    return KubernetesCluster(api=plane.api_client(token=token, server=server), settings=settings)


def engine_over(cluster: KubernetesCluster, policy: Policy, *, aws: RecordingAws | None = None) -> Engine:
    settings = dataclasses.replace(EngineSettings(), drain=PATIENT)
    return Engine(
        policy=policy, cluster=cluster, aws=aws or RecordingAws(), settings=settings, clock=time.time
    )


def alert(node: str, *, status: str = "firing", remediation: str = "") -> dict[str, Any]:
    labels = {"alertname": "AccelGPUFatalXid", "node": node}
    if remediation:
        labels["remediation"] = remediation
    return {
        "status": status,
        "labels": labels,
        "startsAt": "2026-11-28T10:00:00Z",
        "fingerprint": f"xid-{node}",
    }


def webhook(*alerts: dict[str, Any]) -> WebhookPayload:
    return parse_payload({"version": "4", "status": "firing", "alerts": list(alerts)})


def node_annotations(plane: ControlPlane, node: str) -> dict[str, str]:
    return dict(plane.admin.get(f"/api/v1/nodes/{node}")["metadata"].get("annotations") or {})


def decisions(engine: Engine, node: str) -> list[tuple[str, str]]:
    return [(r.action, r.outcome) for r in engine.log.records() if r.node == node]


def guarded_pods(plane: ControlPlane, node: str, *, replicas: int = 2) -> None:
    """`replicas` trainer pods on `node` under a budget that lets none go: a drain retries for ever."""
    budget: Obj = {
        "apiVersion": "policy/v1beta1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": "guarded", "namespace": WORK},
        "spec": {"minAvailable": replicas, "selector": {"matchLabels": {"app": "guarded"}}},
    }
    trainers = deployment("guarded", WORK, node_selector={"kubernetes.io/hostname": node}, replicas=replicas)
    apply_objects(plane.admin, [trainers, budget])
    path = f"/apis/policy/v1beta1/namespaces/{WORK}/poddisruptionbudgets/guarded"
    wait_for(
        "the budget to count its healthy pods",
        lambda: plane.admin.get(path).get("status", {}).get("currentHealthy") == replicas,
        timeout=60,
    )


def requests_since(plane: ControlPlane, since: int) -> list[Obj]:
    return plane.audit(user=USER)[since:]


def evictions(events: Sequence[Obj]) -> list[Obj]:
    return [e for e in events if request_of(e) == ("create", "pods/eviction")]


# -- a human wins ----------------------------------------------------------------------------------


async def test_a_humans_uncordon_mid_drain_stops_the_evictions_and_frees_the_budget_at_once(
    plane: ControlPlane, token: str, proxy: str, fresh: None
) -> None:
    guarded_pods(plane, "gpu-1")
    aws = RecordingAws()
    cluster = cluster_for(plane, server=proxy, token=token)
    engine = engine_over(cluster, REPLACE, aws=aws)
    before = len(plane.audit(user=USER))
    try:
        assert await cluster.start_cache(wait_seconds=20)
        await engine.start()
        await engine.handle(webhook(alert("gpu-1")))
        assert decisions(engine, "gpu-1") == [("cordon", "done"), ("drain", "started")]
        await eventually(lambda: _true(len(evictions(requests_since(plane, before))) >= 2), seconds=30)
        assert engine.budget.in_use == 1

        plane.admin.merge_patch("/api/v1/nodes/gpu-1", {"spec": {"unschedulable": None}})  # kubectl uncordon
        await eventually(lambda: _true(engine.budget.in_use == 0 and "gpu-1" not in engine.drains.running))
        await engine.queue.idle()
        await engine.drained()
        # The budget's slot went back with the watch, before any delivery: the next fault acts now.
        await engine.handle(webhook(alert("gpu-2")))
        assert decisions(engine, "gpu-2")[:2] == [("cordon", "done"), ("drain", "started")]
        await engine.handle(webhook(alert("gpu-1")))  # the released episode resent: nothing again
        await engine.queue.idle()
    finally:
        await engine.stop()
        await cluster.close()
    assert ("release", "done") in decisions(engine, "gpu-1")
    assert ("drain", "stopped") in decisions(engine, "gpu-1")
    assert ("aws_set_unhealthy", "skipped") in decisions(engine, "gpu-1")
    assert not [c for c in aws.calls if "i-0000000000000001" in json.dumps(c)]  # gpu-1 never replaced
    assert "gpu-1" not in cordoned(plane)
    marks = node_annotations(plane, "gpu-1")
    assert marks[DRAIN_STATUS] == "stopped"
    assert CORDONED_BY not in marks
    record = read(marks)
    assert record.phase == "released"
    assert all(e.released for e in record.episodes.values())
    # No eviction of gpu-1's pods was asked after the release was written (the server's own clock
    # and order): the human's uncordon, then this service's one write on gpu-1 after it.
    events = requests_since(plane, before)
    cordoned_at = min(
        e["requestReceivedTimestamp"]
        for e in events
        if request_of(e) == ("patch", "nodes") and _name(e) == "gpu-1"
    )
    uncordoned = min(
        e["requestReceivedTimestamp"]
        for e in plane.audit(user=ADMIN_USER)
        if request_of(e) == ("patch", "nodes")
        and _name(e) == "gpu-1"
        and e["requestReceivedTimestamp"] > cordoned_at
    )
    released = min(
        e["requestReceivedTimestamp"]
        for e in events
        if request_of(e) == ("patch", "nodes")
        and _name(e) == "gpu-1"
        and e["requestReceivedTimestamp"] > uncordoned
    )
    asked = [e["requestReceivedTimestamp"] for e in evictions(events) if _name(e).startswith("guarded-")]
    assert asked  # the drain had been asking, 429 after 429
    assert max(asked) <= released


def _name(event: Obj) -> str:
    return str((event.get("objectRef") or {}).get("name", ""))


def _true(value: bool) -> Any:
    async def check() -> bool:
        return value

    return check()


# -- the way back ------------------------------------------------------------------------------------


class Passing:
    """The node's checks pass (the checks' own HTTP path is tests/kube/test_repair.py's)."""

    async def verify(self, node: str, checks: Sequence[str]) -> Verification:
        del node, checks
        return Verification("pass")


async def test_a_node_held_by_a_taint_rule_comes_back_without_its_taint_or_any_mark(
    plane: ControlPlane, kubelet: FakeKubelet, token: str, proxy: str, fresh: None
) -> None:
    human = {"key": "accel-health.io/unhealthy", "value": "true", "effect": "NoExecute"}
    plane.admin.merge_patch("/api/v1/nodes/gpu-3", {"spec": {"taints": [human]}})  # someone else's
    cluster = cluster_for(plane, server=proxy, token=token)
    engine = engine_over(cluster, TAINT)
    loop = RepairLoop(
        policy=TAINT,
        cluster=cluster,
        verifier=Passing(),
        firing=engine.causes,
        publish=engine.publish,
        node_lock=engine.queue.lock,
    )
    try:
        assert await cluster.start_cache(wait_seconds=20)
        await engine.start()
        await engine.handle(webhook(alert("gpu-3")))
        await loop.reconcile()
        taints = plane.admin.get("/api/v1/nodes/gpu-3")["spec"]["taints"]
        assert {"key": "accel-health.io/unhealthy", "value": "true", "effect": "NoSchedule"} in [
            {k: t[k] for k in ("key", "value", "effect")} for t in taints
        ]
        boot = kubelet.reboot("gpu-3")
        await engine.handle(webhook(alert("gpu-3", status="resolved")))
        await eventually(lambda: _true(_boot_seen(cluster, "gpu-3", boot)))
        records = await loop.reconcile()
        await engine.queue.idle()
    finally:
        await engine.stop()
        await cluster.close()
    assert [(r.action, r.outcome) for r in records] == [("return_to_pool", "done")]
    node = plane.admin.get("/api/v1/nodes/gpu-3")
    assert node["spec"].get("taints") == [human]  # ours gone (by its value), the human's kept
    left = {k for k in node["metadata"].get("annotations") or {} if k.startswith("accel-health.io/")}
    assert left <= {"accel-health.io/quarantine-history"}  # no record, taints-added, drain, ownership
    assert EPISODES not in left
    assert TAINTS_ADDED not in left
    conditions = {c["type"]: c["status"] for c in node["status"]["conditions"]}
    assert conditions["AcceleratorHealthy"] == "True"


def _boot_seen(cluster: KubernetesCluster, name: str, boot: str) -> bool:
    """The node watch has the boot id the machine came back with."""
    cached = cluster.nodes.get(name) or {}
    return bool(cached.get("status", {}).get("nodeInfo", {}).get("bootID") == boot)


# -- a leader dies mid-drain -----------------------------------------------------------------------


async def test_a_drain_a_dead_leader_left_whose_alert_resolved_is_ended_and_a_humans_uncordon_frees_it(
    plane: ControlPlane, token: str, proxy: str, fresh: None
) -> None:
    guarded_pods(plane, "gpu-4")
    first = cluster_for(plane, server=proxy, token=token)
    dead = engine_over(first, REPLACE)
    try:
        assert await first.start_cache(wait_seconds=20)
        await dead.start()
        await dead.handle(webhook(alert("gpu-4")))
        assert node_annotations(plane, "gpu-4")[DRAIN_STATUS] == "in-progress"
    finally:
        await dead.stop()  # killed: what is on the node is all a next leader finds
        await first.close()
    assert node_annotations(plane, "gpu-4")[DRAIN_STATUS] == "in-progress"

    second = cluster_for(plane, server=proxy, token=token)
    leader = engine_over(second, REPLACE)

    async def resolved_meanwhile() -> AlertmanagerView:
        return AlertmanagerView(alerts={}, reached=("http://alertmanager.test",))

    leader.alertmanager = resolved_meanwhile
    try:
        assert await second.start_cache(wait_seconds=20)
        await leader.sync()
        await leader.queue.idle()
        assert node_annotations(plane, "gpu-4")[DRAIN_STATUS] == "stopped"
        assert leader.budget.in_use == 1  # still cordoned: held by that cordon until its repair
        plane.admin.merge_patch("/api/v1/nodes/gpu-4", {"spec": {"unschedulable": None}})
        await eventually(lambda: _true(leader.budget.in_use == 0))
        await leader.handle(webhook(alert("gpu-5")))  # budget 1: not "1 of 1 already out of service"
        await leader.queue.idle()
    finally:
        await leader.stop()
        await second.close()
    assert ("drain", "stopped") in decisions(leader, "gpu-4")
    assert decisions(leader, "gpu-5")[0] == ("cordon", "done")
    pods = plane.admin.items(f"/api/v1/namespaces/{WORK}/pods", labelSelector="app=guarded")
    assert len(pods) == 2  # nothing evicted for an alert that no longer fires


async def test_a_drain_a_dead_leader_left_is_resumed_with_its_recorded_rule_without_alertmanager(
    plane: ControlPlane, token: str, proxy: str, fresh: None
) -> None:
    shipped = load_policy()  # its rules match on the `remediation` label, which no record keeps
    guarded_pods(plane, "gpu-6")
    first = cluster_for(plane, server=proxy, token=token)
    dead = engine_over(first, shipped)
    try:
        assert await first.start_cache(wait_seconds=20)
        await dead.start()
        await dead.handle(webhook(alert("gpu-6", remediation="drain")))
        assert ("drain", "started") in decisions(dead, "gpu-6")
    finally:
        await dead.stop()
        await first.close()
    # The budget lets the pods go now; no Alertmanager answers the next leader.
    plane.admin.delete(f"/apis/policy/v1beta1/namespaces/{WORK}/poddisruptionbudgets/guarded")
    second = cluster_for(plane, server=proxy, token=token)
    leader = engine_over(second, shipped)
    try:
        assert await second.start_cache(wait_seconds=20)
        await leader.sync()
        await leader.queue.idle()
        await leader.drained()
    finally:
        await leader.stop()
        await second.close()
    assert decisions(leader, "gpu-6") == [("drain", "started"), ("drain", "done")]
    assert node_annotations(plane, "gpu-6")[DRAIN_STATUS] == "done"
    assert read(node_annotations(plane, "gpu-6")).phase == "repair"
