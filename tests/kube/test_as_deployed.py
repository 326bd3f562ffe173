"""accel-health as deployed: deploy/overlays/enforce applied to a real API server, the exporter
DaemonSet and both remediator replicas running with the rendered containers' own args, env, volumes
and ServiceAccount (so the shipped RBAC is what the API server enforces), real Prometheus with the
shipped scrape configuration and rules, real Alertmanager with the shipped routing.

A fatal Xid written to a node's kernel log must end, with nothing else in between, in a cordoned node
with its AcceleratorHealthy condition False, its pods evicted through the Eviction API under the
PodDisruptionBudgets the disruption controller enforces, DaemonSet and mirror pods left alone, and
Events telling the story; killing the leader mid-drain must not stop the drain nor repeat any of it.
Before the drain, the node's evidence is fetched from its exporter with the checks token the operator
set and stored in one immutable ConfigMap. A quarantine's durable copy (a ConfigMap) is deleted when a
human hands the node back, and every shipped RBAC rule is used, none refused.
The leader reads every member of the Alertmanager cluster the manifests name, and honours a silence.
The exporters, attached to a secondary network as a user's Multus annotation attaches them, ping and
iperf each other on demand.
"""

from __future__ import annotations

import json
import logging
import time
import urllib.request
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from kubernetes.aio import client as k8s

from remediator.evidence.store import DATA_KEY, EVIDENCE_LABEL, NODE_LABEL
from remediator.executors.kubernetes import KubernetesCluster
from tests.alertmanager_process import rfc3339
from tests.exporter import stub_driver
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
from tests.kube.kubelet import KubeletSettings
from tests.kube.rest import Obj

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

logger = logging.getLogger(__name__)
SA_USER = f"system:serviceaccount:{NAMESPACE}:{REMEDIATOR}"
XID_79 = "NVRM: Xid (PCI:0000:9d:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."


@pytest.fixture(scope="module")
def cluster(workdir: Path) -> Iterator[Deployment]:
    reason = deployed_skip_reason()
    if reason:
        pytest.skip(reason)
    # Replacement pods take 2 s to become Ready, so a drain under a PDB takes seconds per pod and the
    # leader can be killed in the middle of one.
    # The NVIDIA runtime's NVML library in the exporters: the stub of 8 healthy H100s (a C compiler
    # builds it; without one the repair scenario skips and the exporters run without NVML).
    (workdir / "nvidia").mkdir(parents=True, exist_ok=True)
    built = stub_driver.build(workdir / "nvidia")
    with Deployment(
        workdir=workdir,
        overlay="enforce",
        gpu_nodes=3,
        kubelet_settings=KubeletSettings(
            start_delay=2.0, nvidia_library=None if built is None else built / "libnvidia-ml.so.1"
        ),
        exporter_networks=("rdma-0",),
    ) as deployment:
        add_training(deployment, replicas=6, mirror_pods_on=("gpu-node-1", "gpu-node-2"))
        deployment.wait_ready()
        yield deployment


def _audit(d: Deployment) -> list[Obj]:
    """What the remediator's ServiceAccount asked of the API server, per the server's audit log."""
    assert d.plane is not None
    return d.plane.audit(user=SA_USER)


def _ready(pod: Obj) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def _on(d: Deployment, node: str, namespace: str | None = None) -> list[Obj]:
    pods = d.admin.items("/api/v1/pods", fieldSelector=f"spec.nodeName={node}")
    return [p for p in pods if namespace is None or p["metadata"]["namespace"] == namespace]


def _condition(node: Obj, kind: str) -> dict[str, Any] | None:
    return next((c for c in node["status"].get("conditions", []) if c["type"] == kind), None)


def _drained(d: Deployment, node: str) -> bool:
    return d.node(node)["spec"].get("unschedulable") is True and not _on(d, node, WORK_NS)


def test_the_remediator_starts_as_the_manifest_starts_it_and_one_replica_leads(cluster: Deployment) -> None:
    pods = cluster.remediator_pods()
    assert len(pods) == 2
    args = pods[0]["spec"]["containers"][0]["args"]
    assert "--in-cluster" not in args
    assert not any(a.startswith(("--kubeconfig", "--lease-duration")) for a in args)
    leader = cluster.leader()
    assert leader is not None
    assert sum(_ready(p) for p in pods) == 1
    assert _ready(leader)


def _probe(member: int) -> dict[str, Any]:
    now = time.time()
    return {
        "labels": {
            "alertname": "AccelHarnessProbe",
            "probe": str(member),
            "node": "cpu-node-1",
            "remediation": "cordon",
            "severity": "warning",
        },
        "annotations": {"summary": f"held by Alertmanager member {member} alone"},
        "startsAt": rfc3339(now - 1),
        "endsAt": rfc3339(now + 3600),
        "generatorURL": "http://prometheus/graph",
    }


def _probes_on(d: Deployment, member: int) -> dict[str, str]:
    """probe label -> fingerprint of the probe alerts a member shows."""
    shown = d.alertmanager_api(member, "GET", '/alerts?filter=alertname="AccelHarnessProbe"')
    return {a["labels"]["probe"]: a["fingerprint"] for a in shown}


def test_the_leader_reads_each_alertmanager_the_manifest_names_and_a_silence_stops_it(
    cluster: Deployment,
) -> None:
    """deploy/components/alertmanager-api as rendered: the leader reads GET /api/v2/alerts of every
    member of the (kube-prometheus) Alertmanager cluster. Each member alone holds one alert (alerts
    are not gossiped; Prometheus posts to each member), silenced cluster-wide, so no webhook carries
    any of them: the leader records each as silenced, and does nothing to the node."""
    members = range(len(cluster.alertmanagers))
    silence = cluster.alertmanager_api(
        0,
        "POST",
        "/silences",
        {
            "matchers": [
                {"name": "alertname", "value": "AccelHarnessProbe", "isRegex": False, "isEqual": True}
            ],
            "startsAt": rfc3339(time.time() - 1),
            "endsAt": rfc3339(time.time() + 3600),
            "createdBy": "tests",
            "comment": "leave cpu-node-1 alone",
        },
    )["silenceID"]
    wait_for(
        "the silence gossiped to every member",
        lambda: all(
            any(s["id"] == silence for s in cluster.alertmanager_api(m, "GET", "/silences")) for m in members
        ),
        timeout=30,
    )
    for member in members:
        cluster.alertmanager_api(member, "POST", "/alerts", [_probe(member)])
    held = {m: _probes_on(cluster, m) for m in members}
    assert all(set(held[m]) == {str(m)} for m in members), held  # each member holds its own alone
    fingerprints = {held[m][str(m)] for m in members}

    def recorded() -> dict[str, str]:
        leader = cluster.leader()
        actions = cluster.remediator_get(leader, "/actions") if leader is not None else []
        records = actions.get("actions", []) if isinstance(actions, dict) else actions
        return {r["fingerprint"]: r["reason"] for r in records if r.get("fingerprint") in fingerprints}

    try:
        # The leader reads every 30 s (--alertmanager-interval's default).
        wait_for("every probe recorded by the leader", lambda: set(recorded()) == fingerprints, timeout=90)
        reasons = recorded()
        assert all(f"silenced in Alertmanager by {silence}" in r for r in reasons.values()), reasons
        assert not cluster.node("cpu-node-1")["spec"].get("unschedulable")
        leader = cluster.leader()
        assert leader is not None
        ok = cluster.remediator_metric(leader, "accel_remediator_alertmanager_polls_total", {"result": "ok"})
        assert ok is not None
        assert ok >= 1
    finally:
        # Resolved before the silence ends, so that nothing is ever acted on for them.
        for member in members:
            cluster.alertmanager_api(
                member, "POST", "/alerts", [{**_probe(member), "endsAt": rfc3339(time.time() - 1)}]
            )
        wait_for("the probes resolved", lambda: not any(_probes_on(cluster, m) for m in members), timeout=30)
        cluster.alertmanager_api(0, "DELETE", f"/silence/{silence}")
    assert not cluster.node("cpu-node-1")["spec"].get("unschedulable")


def test_a_fatal_xid_cordons_and_drains_its_node_through_the_whole_chain(cluster: Deployment) -> None:
    node = "gpu-node-1"
    before_other = {
        n: cluster.node(n)["metadata"]["resourceVersion"] for n in ("control-plane-1", "cpu-node-1")
    }
    kept = {p["metadata"]["name"] for p in _on(cluster, node) if p["metadata"]["namespace"] != WORK_NS}
    trainers = {p["metadata"]["name"] for p in _on(cluster, node, WORK_NS)}
    assert trainers, "the scenario needs trainer pods on the node"
    cluster.write_fault(node, XID_79)
    wait_for("the node drained", lambda: _drained(cluster, node), timeout=120, interval=0.5)

    obj = cluster.node(node)
    condition = _condition(obj, "AcceleratorHealthy")
    assert condition is not None
    assert condition["status"] == "False"
    # DaemonSet and mirror pods stay; the trainers were evicted and run elsewhere.
    assert {p["metadata"]["name"] for p in _on(cluster, node)} == kept
    wait_for("6 trainers ready again", lambda: sum(_ready(p) for p in cluster.pods(WORK_NS)) == 6, timeout=60)
    # Nothing else was touched.
    for other in ("gpu-node-2", "gpu-node-3", "cpu-node-1", "control-plane-1"):
        assert not cluster.node(other)["spec"].get("unschedulable"), other
    for name, version in before_other.items():
        assert cluster.node(name)["metadata"]["resourceVersion"] == version, name
    evictions = [e for e in _audit(cluster) if e["objectRef"].get("subresource") == "eviction"]
    assert {e["objectRef"]["name"] for e in evictions if e["responseStatus"]["code"] == 201} == trainers


def test_the_nodes_evidence_is_fetched_from_its_exporter_and_stored_before_the_drain(
    cluster: Deployment,
) -> None:
    """The shipped default policy's evidence step, as deployed: the leader fetches the node's
    exporter's /evidence with the checks token the operator set in `accel-health-checks-token` (mounted
    into both the exporter and the remediator from the image), and stores it, with its own part, in one
    immutable ConfigMap before the drain starts."""
    node = "gpu-node-1"
    wait_for("the capture's Event", lambda: _has_reason(cluster, node, "AccelEvidenceCaptured"), timeout=60)
    reasons = [e["reason"] for e in cluster.events(node)]
    assert "AccelEvidenceCaptureFailed" not in reasons, reasons
    captures = cluster.admin.items(
        f"/api/v1/namespaces/{NAMESPACE}/configmaps",
        labelSelector=f"{EVIDENCE_LABEL}=true,{NODE_LABEL}={node}",
    )
    assert len(captures) == 1, [c["metadata"]["name"] for c in captures]
    [capture] = captures
    assert capture.get("immutable") is True
    doc = json.loads(capture["data"][DATA_KEY])
    exporter_part = doc["node_evidence"]
    assert exporter_part is not None, doc.get("notes")
    assert exporter_part["node"] == node
    lines = [r["line"] for group in exporter_part["records"] for r in group["first"]]
    assert any("Xid (PCI:0000:9d:00): 79" in line for line in lines), lines
    assert any(a["alertname"] == "AccelGPUFatalXid" for a in doc["alerts"]), doc["alerts"]
    # Captured before the drain began: the drain's first eviction comes after the ConfigMap's creation.
    created = _parse(capture["metadata"]["creationTimestamp"])
    evictions = [
        _parse(e["requestReceivedTimestamp"])
        for e in _audit(cluster)
        if e["objectRef"].get("subresource") == "eviction" and e["objectRef"].get("namespace") == WORK_NS
    ]
    assert evictions
    assert created <= min(evictions), (created, evictions)


def _parse(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def test_kubectl_describe_node_tells_the_story_in_events(cluster: Deployment) -> None:
    node = "gpu-node-1"
    wait_for("the drain's end as an Event", lambda: _has_reason(cluster, node, "Drain"), timeout=60)
    events = cluster.events(node)
    ours = [
        e
        for e in events
        if (e.get("source") or {}).get("component") == REMEDIATOR or e.get("reportingComponent") == REMEDIATOR
    ]
    text = "\n".join(f"{e['reason']}: {e['message']}" for e in ours)
    assert ours, f"no Event from {REMEDIATOR}: {events}"
    described = cluster.plane.kubectl("describe", "node", node)  # type: ignore[union-attr]
    for event in ours:
        assert event["reason"] in described
    assert "Cordon" in text, text
    assert "Drain" in text, text


def _has_reason(d: Deployment, node: str, part: str) -> bool:
    return any(part in e["reason"] for e in d.events(node))


def test_a_rebooted_node_is_verified_by_its_exporter_and_returned_to_the_pool(cluster: Deployment) -> None:
    """The closed loop with every part from the image. A fatal-Xid alert for gpu-node-3, as Prometheus
    sends one, reaches the remediator through Alertmanager's shipped route and takes the node out
    (condition False, cordon, quarantine recorded, drained). The node then reboots (a new boot id)
    and the alert resolves, as a since-boot counter's does after a reboot (the harness cannot reboot
    the kernel the exporter reads, so the alert is the one part played at Alertmanager). The loop
    then runs the policy's checks (remapped, power) on gpu-node-3's exporter, GET /checks with the
    checks token, the exporter (uid 65532) reading NVML from the library the NVIDIA runtime stand-in
    mounts, and returns the node: condition True (RepairVerified), uncordoned, AccelReturnedToPool.
    Here, before the fail-over's fault on gpu-node-2: with gpu-node-1 still out, a third node with a
    fault firing would be a storm (3 of 3 accelerator nodes) and the breaker would hold it."""
    assert cluster.kubelet is not None
    if cluster.kubelet.settings.nvidia_library is None:
        pytest.skip("no C compiler to build the NVML stub (tests/exporter/nvml_stub.c)")
    node = "gpu-node-3"
    labels = {
        "alertname": "AccelGPUFatalXid",
        "node": node,
        "pci_bus_id": "0000:9d:00",
        "gpu": "4",
        "xid": "79",
        "xid_class": "reset",
        "severity": "critical",
        "remediation": "drain",
    }

    def send(ends: float) -> None:
        alert = {"labels": labels, "startsAt": rfc3339(started), "endsAt": rfc3339(ends)}
        for member in range(len(cluster.alertmanagers)):  # Prometheus sends to every member
            cluster.alertmanager_api(member, "POST", "/alerts", [alert])

    started = time.time()
    send(started + 3600)

    def out() -> bool:
        current = cluster.node(node)
        condition = _condition(current, "AcceleratorHealthy")
        return (
            condition is not None
            and condition["status"] == "False"
            and current["spec"].get("unschedulable") is True
            and "accel-health.io/quarantine" in current["metadata"].get("annotations", {})
        )

    try:
        wait_for(f"{node} taken out and its quarantine recorded", out, timeout=90, interval=0.5)
    except TimeoutError:
        leader = cluster.leader()
        actions = cluster.remediator_get(leader, "/actions") if leader is not None else []
        mine = [a for a in actions if a.get("node") == node]
        firing = [(a["alertname"], a.get("node")) for a in cluster.firing()]
        raise AssertionError(f"{node} not taken out; firing: {firing}; the leader decided: {mine}") from None
    # The operator reboots once the node is drained (a drain still running would keep the node held).
    wait_for(f"{node} drained", lambda: _drained(cluster, node), timeout=120, interval=0.5)
    send(time.time())
    cluster.kubelet.reboot(node)

    def returned() -> bool:
        current = cluster.node(node)
        condition = _condition(current, "AcceleratorHealthy")
        return (
            condition is not None
            and condition["status"] == "True"
            and condition["reason"] == "RepairVerified"
            and not current["spec"].get("unschedulable")
        )

    wait_for(f"{node} verified and returned to the pool", returned, timeout=120, interval=0.5)

    def told() -> list[Obj]:  # the Event is written after the node
        return [e for e in cluster.events(node) if e["reason"] == "AccelReturnedToPool"]

    wait_for("the AccelReturnedToPool Event", lambda: bool(told()), timeout=30, interval=0.5)
    (event,) = told()
    assert "remapped, power passed" in event["message"], event["message"]
    assert "AccelRepairCheckFailed" not in [e["reason"] for e in cluster.events(node)]


def test_killing_the_leader_mid_drain_fails_over_and_the_drain_finishes_once(cluster: Deployment) -> None:
    assert cluster.kubelet is not None
    assert cluster.plane is not None
    node = "gpu-node-2"
    trainers = {p["metadata"]["name"] for p in _on(cluster, node, WORK_NS)}
    assert len(trainers) >= 2, "the scenario needs two trainers on the node (one eviction at a time)"
    old = cluster.leader()
    assert old is not None
    cluster.write_fault(node, XID_79)

    def first_eviction() -> bool:
        return any(
            e["objectRef"].get("subresource") == "eviction"
            and e["objectRef"]["name"] in trainers
            and e["responseStatus"]["code"] == 201
            for e in _audit(cluster)
        )

    try:
        wait_for("the first eviction on the node", first_eviction, timeout=120, interval=0.2)
    except TimeoutError:
        leader = cluster.leader()
        actions = cluster.remediator_get(leader, "/actions") if leader is not None else []
        raise AssertionError(f"no eviction on {node}; the leader decided: {actions[-12:]}") from None
    assert not _drained(cluster, node), "the drain finished before the leader could be killed"
    cluster.kubelet.kill(NAMESPACE, old["metadata"]["name"])
    took = _time(
        lambda: (lead := cluster.leader()) is not None and lead["metadata"]["name"] != old["metadata"]["name"]
    )
    assert took <= 15 + 5, f"the other replica took {took:.1f}s to lead (lease 15 s)"
    wait_for("the node drained by the new leader", lambda: _drained(cluster, node), timeout=120, interval=0.5)
    codes: dict[str, list[int]] = {}
    for e in _audit(cluster):
        if e["objectRef"].get("subresource") == "eviction" and e["objectRef"]["name"] in trainers:
            codes.setdefault(e["objectRef"]["name"], []).append(e["responseStatus"]["code"])
    # Each trainer evicted exactly once (a 429 from the PDB is a wait, not an eviction).
    assert {name: c.count(201) for name, c in codes.items()} == dict.fromkeys(trainers, 1)


def _time(check: Any, timeout: float = 60.0) -> float:
    t0 = time.monotonic()
    wait_for("a new leader", check, timeout=timeout, interval=0.2)
    return time.monotonic() - t0


def test_a_leader_deleted_gracefully_hands_the_lease_over_at_once(cluster: Deployment) -> None:
    """A rolling restart (Recreate) or `kubectl delete pod`: SIGTERM, the Lease handed back, the
    standby leads within a retry period or two instead of a whole lease duration."""
    old = cluster.leader()
    assert old is not None
    name = old["metadata"]["name"]
    cluster.admin.delete(f"/api/v1/namespaces/{NAMESPACE}/pods/{name}")
    took = _time(lambda: (lead := cluster.leader()) is not None and lead["metadata"]["name"] != name)
    assert took < 8, f"the standby took {took:.1f}s to lead after a graceful hand-over"
    released = [
        e
        for e in _audit(cluster)
        if e["verb"] == "patch"
        and e["objectRef"].get("resource") == "leases"
        and e["responseStatus"]["code"] == 200
    ]
    assert released, "the old leader did not hand the Lease back"
    wait_for("a new standby replica", lambda: len(cluster.remediator_pods()) == 2, timeout=60)


async def test_a_repeated_event_is_aggregated_with_the_shipped_rbac(cluster: Deployment) -> None:
    """client-go's Event aggregation (a repeat bumps the count), as the remediator's ServiceAccount."""
    assert cluster.plane is not None
    assert cluster.skew is not None
    assert cluster.network is not None
    cfg = k8s.Configuration()
    cfg.host = f"https://{cluster.network.host_ip}:{cluster.skew.port}"
    cfg.ssl_ca_cert = str(cluster.plane.pki.ca_cert)
    cfg.api_key = {"authorization": "Bearer " + cluster.plane.service_account_token(NAMESPACE, REMEDIATOR)}
    backend = KubernetesCluster(api=k8s.ApiClient(cfg))
    try:
        for _ in range(2):
            await backend.record_event(
                node="cpu-node-2", reason="AccelTestRepeat", message="the same thing twice", type_="Normal"
            )
    finally:
        await backend.close()
    events = [e for e in cluster.events("cpu-node-2") if e["reason"] == "AccelTestRepeat"]
    assert [e["count"] for e in events] == [2]


def test_a_quarantine_handed_back_by_a_human_loses_its_durable_copy(cluster: Deployment) -> None:
    """The repair loop keeps a copy of each quarantine in a ConfigMap of its own namespace (it
    outlives the Node object); a human who sets the condition back ends the quarantine and the
    leader deletes the copy."""
    node = "gpu-node-1"
    path = f"/api/v1/namespaces/{NAMESPACE}/configmaps/accel-health-quarantine-{node}"
    wait_for("the quarantine's durable copy", lambda: cluster.admin.exists(path), timeout=60, interval=0.5)
    healthy = {"type": "AcceleratorHealthy", "status": "True", "reason": "FixedByHand", "message": "checked"}
    cluster.admin.strategic_patch(f"/api/v1/nodes/{node}/status", {"status": {"conditions": [healthy]}})

    def deleted() -> bool:
        return any(
            e["verb"] == "delete"
            and e["objectRef"].get("resource") == "configmaps"
            and e["objectRef"].get("name") == f"accel-health-quarantine-{node}"
            and e["responseStatus"]["code"] == 200
            for e in _audit(cluster)
        )

    wait_for("the durable copy deleted by the leader", deleted, timeout=60, interval=0.5)


def test_a_pause_survives_a_failover_in_the_gates_configmap(cluster: Deployment) -> None:
    """POST /pause on the leader writes the gates ConfigMap (the one object outside the nodes); the
    next leader reads it before it is ready and is paused too; POST /resume writes it again."""
    leader = cluster.leader()
    assert leader is not None
    answer = cluster.remediator_get(leader, "/pause", method="POST", body={"reason": "as-deployed test"})
    assert answer == {"paused": True, "changed": True}
    name = leader["metadata"]["name"]
    cluster.admin.delete(f"/api/v1/namespaces/{NAMESPACE}/pods/{name}")
    _time(lambda: (lead := cluster.leader()) is not None and lead["metadata"]["name"] != name)
    successor = cluster.leader()
    assert successor is not None
    state = cluster.remediator_get(successor, "/state")
    assert (state["paused"], state["pause_reason"]) == (True, "as-deployed test")
    assert cluster.remediator_get(successor, "/resume", method="POST") == {"paused": False, "changed": True}
    stored = cluster.admin.get(f"/api/v1/namespaces/{NAMESPACE}/configmaps/accel-health-remediator-gates")
    assert len(stored["data"]["gates.json"]) <= 1024
    assert '"paused":false' in stored["data"]["gates.json"]
    wait_for("a new standby replica", lambda: len(cluster.remediator_pods()) == 2, timeout=60)


def test_no_request_of_the_remediator_was_forbidden(cluster: Deployment) -> None:
    assert cluster.plane is not None
    forbidden = [
        f"{e['verb']} {e['requestURI']}" for e in _audit(cluster) if e["responseStatus"]["code"] == 403
    ]
    assert forbidden == []
    assert "forbidden" not in cluster.remediator_logs().lower()


def test_every_shipped_rbac_rule_of_the_remediator_is_used(cluster: Deployment) -> None:
    assert cluster.plane is not None
    used = {
        (
            e["objectRef"].get("apiGroup", ""),
            e["objectRef"]["resource"]
            + ("/" + e["objectRef"]["subresource"] if e["objectRef"].get("subresource") else ""),
            e["verb"],
            e["objectRef"].get("name", ""),
        )
        for e in _audit(cluster)
        if e.get("objectRef") and e["responseStatus"]["code"] < 400
    }
    unused = []
    for obj in cluster.objects:
        if obj["kind"] not in ("ClusterRole", "Role") or not obj["metadata"]["name"].startswith(REMEDIATOR):
            continue
        for rule in obj["rules"]:
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    for verb in rule["verbs"]:
                        names = rule.get("resourceNames") or [None]
                        for name in names:
                            if not any(
                                u[0] == group
                                and u[1] == resource
                                and u[2] == verb
                                and (name is None or u[3] == name)
                                for u in used
                            ):
                                unused.append(
                                    f"{obj['kind']} {obj['metadata']['name']}: {verb} {group}/{resource}"
                                    + (f" {name}" if name else "")
                                )
    assert unused == []


def test_the_exporters_ping_and_iperf_each_other_over_their_secondary_network(cluster: Deployment) -> None:
    """The active checks `ping` and `iperf` as the overlay ships them, on demand, on an exporter from
    the image (uid 65532): its peers are the other exporter pods, listed with the exporter's own RBAC,
    at their addresses on `rdma-0` from the Multus annotation; ping opens ICMP datagram sockets through
    the pod's ping_group_range sysctl (no capability), iperf3 measures to the `iperf3 -s` beside each
    peer with its stream files in the /tmp emptyDir. The module's last test holds these connections
    against the NetworkPolicies."""
    exporters = cluster.pods(selector=f"app.kubernetes.io/name={EXPORTER}")
    by_node = {p["spec"]["nodeName"]: p for p in exporters if _ready(p)}
    assert set(by_node) == {"gpu-node-1", "gpu-node-2", "gpu-node-3"}
    peers = {}
    for node, pod in by_node.items():
        status = json.loads(pod["metadata"]["annotations"]["k8s.v1.cni.cncf.io/network-status"])
        (secondary,) = [s for s in status if not s["default"]]
        assert (secondary["name"], secondary["interface"]) == (f"{NAMESPACE}/rdma-0", "net1")
        peers[node] = secondary["ips"][0]
    url = f"http://{by_node['gpu-node-2']['status']['podIP']}:9835/checks?check=ping,iperf&seconds=1"
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {cluster.checks_token}"})
    with urllib.request.urlopen(request, timeout=60) as response:  # noqa: S310 -- a pod of the harness
        answer = json.load(response)
    results = {r["check"]: r for r in answer["results"]}
    assert answer["verdict"] == "pass", answer
    # One result per (own interface, peer node): the two other nodes over net1.
    ping = {d["device"]: d for d in results["ping"]["devices"]}
    assert set(ping) == {"net1/gpu-node-1", "net1/gpu-node-3"}, ping
    assert all(d["verdict"] == "pass" and d["values"]["reachable"] == 1 for d in ping.values()), ping
    iperf = {d["device"]: d for d in results["iperf"]["devices"]}
    assert set(iperf) == set(ping), iperf
    assert all(d["verdict"] == "pass" and d["values"]["bytes_per_second"] > 0 for d in iperf.values()), iperf
    # Over rdma-0's addresses, not the cluster network's.
    assert len(set(peers.values())) == 3
    assert all(address.startswith("10.214.") for address in peers.values()), peers


def test_every_connection_the_pods_made_is_one_the_rendered_network_policies_allow(
    cluster: Deployment,
) -> None:
    """Last, after the scenarios above: each connection a pod opened or accepted, as its network
    namespace tracked it, is one the enforce overlay's NetworkPolicies admit (no network plugin
    enforces them here), and the connections every run makes were seen, the Alertmanager webhooks
    and the evidence step's fetch from the faulty node's exporter included."""
    webhook = ("monitoring/alertmanager", f"{NAMESPACE}/{REMEDIATOR}", 9836, "TCP")
    # The evidence step's GET /evidence on the faulty node's exporter pod.
    evidence = (f"{NAMESPACE}/{REMEDIATOR}", f"{NAMESPACE}/{EXPORTER}", 9835, "TCP")
    # The exporters' ping and iperf3 between each other (over rdma-0, judged as if policed there too).
    network_checks = {
        (f"{NAMESPACE}/{EXPORTER}", f"{NAMESPACE}/{EXPORTER}", 0, "ICMP"),
        (f"{NAMESPACE}/{EXPORTER}", f"{NAMESPACE}/{EXPORTER}", 5201, "TCP"),
    }
    flows = check_network_policies(cluster, expected=ALWAYS_CONNECTED | {webhook, evidence} | network_checks)
    logger.info("connections seen:\n%s", "\n".join(map(str, flows)))
