"""A drain's reads against the real API server, counted in its audit log.

The remediator's client runs as a ServiceAccount of its own (through the policy/v1 skew proxy, as a
pod would reach a 1.20 server), with the node cache started as the service starts it. A node holds
six pods: four under a PodDisruptionBudget that allows one disruption at a time (so evictions are
answered 429 until each replacement is ready elsewhere) and two without one. Covered: the whole drain
(the engine's plan, the executor's plan, every eviction retry and the wait for evicted pods to go)
makes one LIST and one WATCH of the node's pods and one LIST and one WATCH of PodDisruptionBudgets,
however long the budget holds it back, and the watches end with the drain.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from remediator.cluster import DrainSettings
from remediator.executors.kubernetes import KubernetesCluster, KubernetesSettings
from remediator.executors.snapshot import RecordingAws
from remediator.intake.payload import parse_payload
from remediator.lifecycle.engine import Engine
from remediator.lifecycle.model import EngineSettings
from remediator.policy import parse_policy
from tests.kube.controlplane import ControlPlane, apply_objects, deployment, request_of, wait_for
from tests.kube.kubelet import FakeKubelet, KubeletSettings
from tests.kube.network import skew_proxy
from tests.kube.rest import Obj

NS = "accel-health"
WORK = "work"
SA = "drainer"
USER = f"system:serviceaccount:{NS}:{SA}"
NODES = ("gpu-0", "gpu-1", "gpu-2")
POOL = "accel-health.io/test-pool"
DRAIN = parse_policy(
    "safety: {max_disrupted_nodes: 2, storm_breaker: {enabled: false}}\n"
    "rules:\n"
    "  - name: replace\n"
    "    actions: [cordon, {type: drain, timeout_seconds: 120, on_timeout: stop}]\n"
)
PATIENT = DrainSettings(backoff_initial_seconds=0.2, backoff_max_seconds=1.0, poll_interval_seconds=0.2)
"""Short waits, so that a drain the budget holds back retries (and, before the cache, listed) often."""


@pytest.fixture(scope="module")
def token(plane: ControlPlane, workdir: Path) -> Iterator[str]:
    fake = FakeKubelet(plane=plane, workdir=workdir, settings=KubeletSettings(start_delay=0.3))
    for name in NODES:
        fake.add_node(name, labels={"pool": "gpu"}, capacity={"nvidia.com/gpu": "8"})
    apply_objects(plane.admin, [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": WORK}}])
    token = plane.cluster_admin_account(NS, SA)
    fake.start()
    yield token
    fake.stop()


@pytest.fixture(scope="module")
def proxy(plane: ControlPlane) -> Iterator[str]:
    with skew_proxy(plane) as url:
        yield url


def cluster_for(plane: ControlPlane, *, server: str, token: str) -> KubernetesCluster:
    settings = KubernetesSettings(state_namespace=NS, request_timeout_seconds=5.0, instance="test")
    return KubernetesCluster(api=plane.api_client(token=token, server=server), settings=settings)


def requests(plane: ControlPlane, since: int) -> dict[str, Obj]:
    """The ServiceAccount's requests after the first `since` audit events, by audit ID (a watch is
    logged when its answer starts and again when it ends: the later event wins)."""
    return {str(e["auditID"]): e for e in plane.audit(user=USER)[since:]}


def trainers(name: str, replicas: int) -> Obj:
    return deployment(name, WORK, node_selector={POOL: "yes"}, replicas=replicas)


def pods_on(plane: ControlPlane, node: str) -> list[Obj]:
    return plane.admin.items(f"/api/v1/namespaces/{WORK}/pods", fieldSelector=f"spec.nodeName={node}")


def ready(pod: Obj) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


async def test_a_drain_held_back_by_a_budget_lists_and_watches_pods_and_budgets_once(
    plane: ControlPlane, token: str, proxy: str
) -> None:
    # Every pod starts on gpu-0 (the only node of the pool); replacements go to gpu-1 once it joins.
    plane.admin.merge_patch("/api/v1/nodes/gpu-0", {"metadata": {"labels": {POOL: "yes"}}})
    budget: Obj = {
        "apiVersion": "policy/v1beta1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": "guarded", "namespace": WORK},
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": {"app": "guarded"}}},
    }
    apply_objects(plane.admin, [trainers("guarded", 4), trainers("free", 2), budget])
    wait_for("six ready pods on gpu-0", lambda: sum(map(ready, pods_on(plane, "gpu-0"))) == 6, timeout=60)
    pdb_path = f"/apis/policy/v1beta1/namespaces/{WORK}/poddisruptionbudgets/guarded"
    wait_for(
        "the budget to count four healthy pods",
        lambda: plane.admin.get(pdb_path).get("status", {}).get("currentHealthy") == 4,
        timeout=60,
    )
    plane.admin.merge_patch("/api/v1/nodes/gpu-1", {"metadata": {"labels": {POOL: "yes"}}})

    cluster = cluster_for(plane, server=proxy, token=token)
    settings = dataclasses.replace(EngineSettings(), drain=PATIENT)
    engine = Engine(policy=DRAIN, cluster=cluster, aws=RecordingAws(), settings=settings, clock=time.time)
    try:
        assert await cluster.start_cache(wait_seconds=20)
        await engine.start()
        before = len(plane.audit(user=USER))
        alert = {
            "labels": {"alertname": "AccelGPUFatalXid", "node": "gpu-0"},
            "startsAt": "2025-11-22T20:00:00Z",
        }
        await engine.handle(parse_payload({"version": "4", "alerts": [alert]}))
        await engine.drained()
        made = requests(plane, before)
        # The pod and budget watches end with the drain, while the client (and its node watch) go on.
        await asyncio.to_thread(
            wait_for, "the drain's watches to end", lambda: watches_ended(plane, before), timeout=10
        )
    finally:
        await cluster.close()
    drains = [(r.outcome, r.reason) for r in engine.log.records() if r.action == "drain"]
    assert [o for o, _ in drains] == ["started", "done"], drains
    assert [p for p in pods_on(plane, "gpu-0") if not p["metadata"].get("deletionTimestamp")] == []

    counts = Counter(request_of(e) for e in made.values())
    evictions = Counter(
        e["responseStatus"]["code"] for e in made.values() if request_of(e)[1] == "pods/eviction"
    )
    print(
        f"requests of one drain: {sorted(counts.items())}; evictions by answer: {sorted(evictions.items())}"
    )
    assert evictions[201] == 6
    assert evictions[429] >= 2  # the budget held the drain back for a few rounds
    assert counts["list", "pods"] == 1
    assert counts["watch", "pods"] == 1
    assert counts["list", "poddisruptionbudgets"] == 1
    assert counts["watch", "poddisruptionbudgets"] == 1
    assert counts["list", "nodes"] == 0  # nodes come from the node cache


def watches_ended(plane: ControlPlane, since: int) -> bool:
    """Every pod and PodDisruptionBudget watch made after `since` has ended (the server logged its end)."""
    watches = [
        e
        for e in requests(plane, since).values()
        if request_of(e) in (("watch", "pods"), ("watch", "poddisruptionbudgets"))
    ]
    return bool(watches) and all(e["stage"] == "ResponseComplete" for e in watches)
