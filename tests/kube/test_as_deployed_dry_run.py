"""accel-health as first installed: deploy/overlays/dry-run on a real API server. The same fault as in
test_as_deployed makes the leader record the same decisions (condition, cordon, drain with the pods it
would evict), marked dry-run, and the cluster is left exactly as it was: per the API server's audit
log the remediator's only writes are to its own leader Lease, though it reads Alertmanager's API."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.kube.conftest import deployed_skip_reason
from tests.kube.controlplane import wait_for
from tests.kube.deployed import NAMESPACE, REMEDIATOR, WORK_NS, Deployment, add_training

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

SA_USER = f"system:serviceaccount:{NAMESPACE}:{REMEDIATOR}"
XID_79 = "NVRM: Xid (PCI:0000:9d:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
MUTATING = {"create", "update", "patch", "delete", "deletecollection"}


@pytest.fixture(scope="module")
def cluster(workdir: Path) -> Iterator[Deployment]:
    reason = deployed_skip_reason()
    if reason:
        pytest.skip(reason)
    with Deployment(workdir=workdir, overlay="dry-run", gpu_nodes=2, cpu_nodes=2) as deployment:
        add_training(deployment, replicas=4)
        deployment.wait_ready()
        yield deployment


def _decisions(d: Deployment) -> list[dict[str, Any]]:
    leader = d.leader()
    if leader is None:
        return []
    records = d.remediator_get(leader, "/actions")
    result: list[dict[str, Any]] = records.get("actions", []) if isinstance(records, dict) else records
    return result


def test_the_dry_run_overlay_reads_alertmanagers_api(cluster: Deployment) -> None:
    """The rendered --alertmanager-url reaches the harness's Alertmanager members (what the leader
    reads writes nothing: the next test's audit covers it)."""

    def polled() -> bool:
        leader = cluster.leader()
        if leader is None:
            return False
        ok = cluster.remediator_metric(leader, "accel_remediator_alertmanager_polls_total", {"result": "ok"})
        return ok is not None and ok >= 1

    wait_for("a read of Alertmanager's API by the leader", polled, timeout=60)


def test_the_dry_run_overlay_records_every_decision_and_changes_nothing(cluster: Deployment) -> None:
    assert cluster.plane is not None
    node = "gpu-node-1"
    nodes_before = {
        n["metadata"]["name"]: n["metadata"]["resourceVersion"] for n in cluster.admin.items("/api/v1/nodes")
    }
    pods_before = {p["metadata"]["uid"]: p["metadata"]["resourceVersion"] for p in cluster.pods(WORK_NS)}
    cluster.write_fault(node, XID_79)

    def decided() -> bool:
        actions = {r["action"] for r in _decisions(cluster) if r.get("node") == node}
        return {"condition", "cordon", "drain"} <= actions

    wait_for("the dry-run decisions for the node", decided, timeout=120, interval=0.5)
    records = [r for r in _decisions(cluster) if r.get("node") == node]
    assert all(r["dry_run"] is True for r in records), records
    assert {r["alertname"] for r in records} == {"AccelGPUFatalXid"}
    after = {
        n["metadata"]["name"]: n["metadata"]["resourceVersion"] for n in cluster.admin.items("/api/v1/nodes")
    }
    assert after == nodes_before
    assert not cluster.node(node)["spec"].get("unschedulable")
    pods_after = {p["metadata"]["uid"]: p["metadata"]["resourceVersion"] for p in cluster.pods(WORK_NS)}
    assert pods_after == pods_before
    writes = {
        (e["verb"], e["objectRef"].get("resource"), e["objectRef"].get("name"))
        for e in cluster.plane.audit(user=SA_USER)
        if e["verb"] in MUTATING
    }
    assert writes, "the remediator never wrote its Lease: it cannot have led"
    assert {resource for _verb, resource, _name in writes} == {"leases"}, writes
