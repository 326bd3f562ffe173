"""accel-health as first installed: deploy/overlays/dry-run on a real API server. The same fault as in
test_as_deployed makes the leader record the same decisions (condition, cordon, drain with the pods it
would evict), marked dry-run, and the cluster is left exactly as it was: per the API server's audit
log the remediator's only writes are to its own leader Lease, though it reads Alertmanager's API.
Every container runs from the image as its manifest says (user, groups, capabilities, read-only
root), and the exporter's kernel-log counts survive a restart of its container through its state
hostPath, also when the ring buffer has moved past the record."""

from __future__ import annotations

import logging
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.request import urlopen

import pytest
from prometheus_client.parser import text_string_to_metric_families

from exporter.privileges import Capability
from exporter.readers.kmsg import STATE_FILE_NAME
from tests.image.oci import process_status
from tests.kube.conftest import deployed_skip_reason
from tests.kube.controlplane import wait_for
from tests.kube.deployed import (
    ALWAYS_CONNECTED,
    EXPORTER,
    NAMESPACE,
    REMEDIATOR,
    WORK_NS,
    Deployment,
    add_training,
    check_network_policies,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

logger = logging.getLogger(__name__)
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


def _root_mount_options(pid: int) -> list[str]:
    for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines():
        fields = line.split()
        if fields[4] == "/":
            return fields[5].split(",")
    raise AssertionError(f"no root mount for pid {pid}")


def test_every_container_runs_from_the_image_as_its_manifest_says(cluster: Deployment) -> None:
    """Both as uid 65532 on the image's read-only root. The remediator with its fsGroup, no capability,
    no privilege escalation. The exporter privileged (components/kmsg-privileged) yet holding no
    effective capability: CAP_SYSLOG only permitted, through its interpreter's file capability
    (CAP_CHOWN given up once its state hostPath was taken), with the pod's safe sysctl granting its
    group ICMP datagram sockets for ping."""
    assert cluster.kubelet is not None
    assert cluster.kubelet.image is not None
    rootfs = cluster.kubelet.image.rootfs
    pods = cluster.pods()
    assert {p["metadata"]["labels"]["app.kubernetes.io/name"] for p in pods} == {EXPORTER, REMEDIATOR}
    for pod in pods:
        name = pod["metadata"]["name"]
        pid = cluster.kubelet.container_pid(NAMESPACE, name)
        status = process_status(pid)
        assert "ro" in _root_mount_options(pid), name
        assert status["Uid"].split() == ["65532"] * 4, name
        assert status["Gid"].split() == ["65532"] * 4, name
        assert "65532" in status["Groups"].split(), name
        assert int(status["CapEff"], 16) == 0, name
        # The interpreter running is the image's file (the same inode, seen through the container's root).
        running = Path(f"/proc/{pid}/exe").stat()
        if pod["metadata"]["labels"]["app.kubernetes.io/name"] == REMEDIATOR:
            shipped = (rootfs / "usr" / "bin" / "python3.11").stat()
            assert int(status["CapPrm"], 16) == 0, name
            assert status["NoNewPrivs"] == "1", name
        else:
            shipped = (rootfs / "opt" / "accel-health" / "bin" / "exporter-python").stat()
            assert int(status["CapPrm"], 16) == 1 << Capability.SYSLOG, name
            # /proc/sys/net answers for the reader's network namespace: read it from the pod's.
            ping_groups = subprocess.run(
                [shutil.which("nsenter") or "/usr/bin/nsenter", f"--net=/proc/{pid}/ns/net",
                 shutil.which("sysctl") or "/usr/sbin/sysctl", "-n", "net.ipv4.ping_group_range"],
                capture_output=True, text=True, check=True, timeout=30,
            ).stdout.split()  # fmt: skip
            assert ping_groups == ["65532", "65532"], name
        assert (running.st_dev, running.st_ino) == (shipped.st_dev, shipped.st_ino), name


def _xid_79(url: str) -> float:
    with urlopen(url, timeout=5) as resp:  # noqa: S310 -- http to a pod of the harness
        text = resp.read().decode()
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "accel_gpu_xid_errors_total" and s.labels.get("xid") == "79"
    )


def test_the_exporters_counts_survive_a_restart_of_its_container_in_the_image(cluster: Deployment) -> None:
    """The state hostPath (/var/lib/accel-health), made by the kubelet as root and taken over by the
    container as the manifest runs it (uid 65532): after a SIGKILL and a restart, an Xid the ring
    buffer no longer holds still counts, once."""
    assert cluster.kubelet is not None
    node = "gpu-node-2"
    (pod,) = [
        p
        for p in cluster.pods(selector=f"app.kubernetes.io/name={EXPORTER}")
        if p["spec"]["nodeName"] == node
    ]
    name, url = pod["metadata"]["name"], f"http://{pod['status']['podIP']}:9835/metrics"
    before = _xid_79(url)
    cluster.write_fault(node, XID_79)
    wait_for("the Xid counted", lambda: _xid_79(url) == before + 1, timeout=30)
    state = cluster.kubelet.nodes[node] / "var" / "lib" / "accel-health" / STATE_FILE_NAME
    wait_for("the counts saved in the state hostPath", state.is_file, timeout=30)
    # The kubelet made the hostPath as root; the exporter (uid 65532) took it over and writes there.
    assert (state.parent.stat().st_uid, state.stat().st_uid) == (65532, 65532)
    # The ring buffer moves on: the Xid's record (and everything before) is overwritten.
    kmsg = cluster.kubelet.nodes[node] / "dev" / "kmsg"
    last = int(kmsg.read_text().splitlines()[-1].split(",")[1])
    kmsg.write_text(f"6,{last + 100},{(last + 100) * 1000},-;usb 1-1: a later record\n")
    cluster.kubelet.kill(NAMESPACE, name)

    def restarted() -> bool:
        statuses = cluster.admin.get(f"/api/v1/namespaces/{NAMESPACE}/pods/{name}")["status"]
        if statuses["containerStatuses"][0]["restartCount"] < 1:
            return False
        try:
            _xid_79(url)
        except OSError:
            return False
        return True

    wait_for("the exporter's container restarted and serving", restarted, timeout=60)
    assert _xid_79(url) == before + 1


def test_every_connection_the_pods_made_is_one_the_rendered_network_policies_allow(
    cluster: Deployment,
) -> None:
    """Last, after the scenarios above: each connection a pod opened or accepted, as its network
    namespace tracked it, is one the dry-run overlay's NetworkPolicies admit (no network plugin
    enforces them here), and the connections every run makes were seen, the Alertmanager webhooks
    of the fault included."""
    webhook = ("monitoring/alertmanager", f"{NAMESPACE}/{REMEDIATOR}", 9836, "TCP")
    flows = check_network_policies(cluster, expected=ALWAYS_CONNECTED | {webhook})
    logger.info("connections seen:\n%s", "\n".join(map(str, flows)))
