"""The closed loop on the real API server: a quarantined node comes back only repaired and verified.

A bare control plane with the kubelet stand-in's nodes (its `reboot` gives a node a new boot id, as
a real reboot does); the engine and the repair loop run over the real Kubernetes executor, the
post-repair checks are the exporter's own `GET /checks` handler over real HTTP (fake NVML and CUDA
behind it), and AWS is moto's server. Covered: reboot -> checks pass -> returned (and the time from
"repair done" to "back in the pool", printed); reboot -> a check fails -> kept out with the failing
check exported and an Event; the third quarantine within the window -> labelled for a human, not
returned; a human's re-cordon in between is kept; a Karpenter node gets the hand-over condition and
no Auto Scaling call; a fault that returns after the reboot escalates to a replacement.

A quarantine outlives the Node object, with the remediator's ServiceAccount bound to deploy/'s RBAC
as shipped: a quarantined node whose Node object is deleted and registered again under its name
(a new uid, nothing of the old object) is held with the startup taint, so a pod pinned to it stays
pending, until its checks pass; then it is returned and the pod runs. A new node that registered
with the startup taint of the Karpenter example, under a name with no quarantine, is admitted at
once. The third quarantine of a name
within the window escalates even though each came on another Node object. The quarantined gauge
reads the node cache at scrape time. The durable copies (ConfigMaps, hashed names for long node
names) are saved, replaced, read and deleted with no request refused.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import boto3
import pytest
import yaml
from prometheus_client import CollectorRegistry

from exporter.checks.endpoint import ChecksEndpoint
from exporter.cli import checks_source, make_handler
from exporter.sources import build_registry
from remediator.cluster import Aws
from remediator.executors.aws import AwsExecutor, AwsSettings
from remediator.executors.kubernetes import KubernetesCluster, quarantine_configmap_name
from remediator.executors.snapshot import RecordingAws
from remediator.intake.payload import WebhookPayload, parse_payload
from remediator.lifecycle.engine import Engine
from remediator.lifecycle.model import EngineSettings
from remediator.lifecycle.repair import (
    DURABLE_MAX_BYTES,
    HISTORY,
    OWN_ACTIONS,
    QUARANTINE,
    REBOOTED,
    STARTUP_TAINT,
    ExporterChecks,
    RepairCollector,
    RepairLoop,
    url_template_endpoint,
)
from remediator.lifecycle.repairservice import wants_a_look
from remediator.policy import Policy, parse_policy
from tests.checks.fake_cuda import FakeGpu, h100x8
from tests.checks.helpers import make_runner
from tests.kube.controlplane import (
    ControlPlane,
    apply_objects,
    eventually,
    shipped_remediator_account,
    wait_for,
)
from tests.kube.kubelet import FakeKubelet, KubeletSettings
from tests.kube.test_reconcile import cluster_for
from tests.remediator.test_aws_executor import CREDENTIALS, REGION, aws_client, health, make_group

NS = "accel-health"
TOKEN = "checks-token"
NODES = ("r-pass", "r-fail", "r-often", "r-human", "aws-asg", "aws-karp", "q-new", "q-often", "q-gauge")
POLICY = """
safety: {max_disrupted_nodes: 10, storm_breaker: {enabled: false}}
repair: {checks: [pciebw, power], escalate_after: 3, window_seconds: 3600, interval_seconds: 30}
rules:
  - name: reboot
    match: ['remediation="reboot"']
    actions:
      - {type: condition, condition_type: AcceleratorHealthy}
      - {type: cordon}
      - {type: aws_reboot, handover_condition: AcceleratedHardwareReady}
  - name: cordon
    match: []
    actions: [{type: condition, condition_type: AcceleratorHealthy}, {type: cordon}]
"""


@pytest.fixture(scope="module")
def kubelet(plane: ControlPlane, workdir: Path) -> FakeKubelet:
    fake = FakeKubelet(plane=plane, workdir=workdir, settings=KubeletSettings(start_delay=0.2))
    for name in NODES:
        labels = {"pool": "gpu", **({"karpenter.sh/nodepool": "gpu"} if name == "aws-karp" else {})}
        fake.add_node(name, labels=labels, capacity={"nvidia.com/gpu": "8"})
    apply_objects(plane.admin, [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}}])
    return fake


@contextmanager
def exporter(gpus: list[FakeGpu] | None = None) -> Iterator[str]:
    """A node's exporter (its real HTTP handler, checks on fake NVML/CUDA); yields the checks URL."""
    runner, _, _ = make_runner(gpus=gpus, names=("pciebw", "power"))
    endpoint = ChecksEndpoint(runner, TOKEN, node="n")
    server = ThreadingHTTPServer(
        ("127.0.0.1", 0), make_handler(build_registry([checks_source(runner, None)]), endpoint)
    )
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/checks"
    finally:
        server.shutdown()
        server.server_close()


def healthy() -> list[FakeGpu]:
    gpus = h100x8()
    for gpu in gpus:
        gpu.host_to_device = gpu.device_to_host = 24e9
    return gpus


class Loop:
    """The engine and the repair loop over the real executor, wired as the service wires them."""

    def __init__(
        self, plane: ControlPlane, checks_url: str, *, aws: Aws | None = None, token: str | None = None
    ) -> None:
        self.policy: Policy = parse_policy(POLICY)
        self.cluster: KubernetesCluster = cluster_for(plane, token=token)
        self.engine = Engine(
            policy=self.policy,
            cluster=self.cluster,
            aws=aws or RecordingAws(),
            settings=EngineSettings(),
            clock=time.time,
        )
        self.checks_url = checks_url
        self.repair = self.restart_repair()
        self.engine.subscribe(lambda record: self.repair.poke() if wants_a_look(record) else None)

    def restart_repair(self) -> RepairLoop:
        """A repair loop with nothing in memory (as after a restart or a fail-over)."""
        verifier = ExporterChecks(
            endpoint=url_template_endpoint(self.checks_url), token=TOKEN, timeout_seconds=30
        )
        self.repair = RepairLoop(
            policy=self.policy,
            cluster=self.cluster,
            verifier=verifier,
            firing=self.engine.causes,
            publish=self.engine.publish,
            node_lock=self.engine.queue.lock,
        )
        return self.repair

    async def fault(self, node: str, *, starts: str = "2025-11-22T20:00:00Z", remediation: str = "") -> None:
        await self.engine.handle(payload(node, starts=starts, remediation=remediation))
        await self.repair.reconcile()  # the loop's look after a delivery that took the node out

    async def resolved(
        self, node: str, *, starts: str = "2025-11-22T20:00:00Z", remediation: str = ""
    ) -> None:
        await self.engine.handle(payload(node, starts=starts, remediation=remediation, status="resolved"))

    def actions(self, node: str) -> list[tuple[str, str]]:
        return [(r.action, r.outcome) for r in self.engine.log.records() if r.node == node]


def payload(node: str, *, starts: str, remediation: str, status: str = "firing") -> WebhookPayload:
    labels = {"alertname": "AccelGPUFellOffBus", "node": node}
    if remediation:
        labels["remediation"] = remediation
    alert = {"status": status, "labels": labels, "startsAt": starts, "fingerprint": f"fell-{node}"}
    return parse_payload({"version": "4", "status": status, "alerts": [alert]})


def node_obj(plane: ControlPlane, name: str) -> dict[str, Any]:
    obj: dict[str, Any] = plane.admin.get(f"/api/v1/nodes/{name}")
    return obj


def condition(plane: ControlPlane, name: str, ctype: str = "AcceleratorHealthy") -> tuple[str, str] | None:
    for cond in node_obj(plane, name)["status"].get("conditions") or []:
        if cond["type"] == ctype:
            return cond["status"], cond["reason"]
    return None


def events(plane: ControlPlane, name: str) -> list[str]:
    return [
        e["reason"]
        for e in plane.admin.items("/api/v1/namespaces/default/events")
        if e["involvedObject"]["name"] == name
    ]


def unschedulable(plane: ControlPlane, name: str) -> bool:
    return bool(node_obj(plane, name)["spec"].get("unschedulable"))


async def test_a_rebooted_node_whose_checks_pass_is_verified_and_returned_to_the_pool(
    plane: ControlPlane, kubelet: FakeKubelet
) -> None:
    with exporter(healthy()) as url:
        loop = Loop(plane, url)
        runner = asyncio.create_task(loop.repair.run())
        try:
            await loop.fault("r-pass")
            assert unschedulable(plane, "r-pass")
            assert condition(plane, "r-pass") == ("False", "AccelGPUFellOffBus")
            assert QUARANTINE in node_obj(plane, "r-pass")["metadata"]["annotations"]
            await loop.repair.reconcile()  # not rebooted yet: nothing changes
            assert unschedulable(plane, "r-pass")
            kubelet.reboot("r-pass")
            await loop.repair.reconcile()  # rebooted, but the alert still fires: still out
            assert unschedulable(plane, "r-pass")
            await loop.resolved("r-pass")  # repair done: new boot id, alert resolved
            repaired = time.monotonic()
            # The node lives in the API server, not in this process: polled, as kubectl would.
            while unschedulable(plane, "r-pass") and time.monotonic() - repaired < 20:  # noqa: ASYNC110
                await asyncio.sleep(0.01)
            back = time.monotonic() - repaired
            returned = ("return_to_pool", "done")
            while returned not in loop.actions("r-pass") and time.monotonic() - repaired < 20:  # noqa: ASYNC110
                await asyncio.sleep(0.01)
        finally:
            runner.cancel()
            await loop.cluster.close()
    print(f"\nrepair done (boot id changed, alerts resolved) -> back in the pool: {back * 1000:.0f} ms")
    assert not unschedulable(plane, "r-pass")
    assert condition(plane, "r-pass") == ("True", "RepairVerified")
    annotations = node_obj(plane, "r-pass")["metadata"].get("annotations") or {}
    assert QUARANTINE not in annotations
    assert "accel-health.io/cordoned-by" not in annotations
    assert ("return_to_pool", "done") in loop.actions("r-pass")
    assert "AccelReturnedToPool" in events(plane, "r-pass")


async def test_a_rebooted_node_whose_check_fails_stays_out_with_the_failing_check_alerted(
    plane: ControlPlane, kubelet: FakeKubelet
) -> None:
    slow = h100x8(**{"4": {"host_to_device": 5.3e9}})
    with exporter(slow) as url:
        loop = Loop(plane, url)
        try:
            await loop.fault("r-fail")
            kubelet.reboot("r-fail")
            await loop.resolved("r-fail")
            await loop.repair.reconcile()
            await loop.repair.reconcile()  # one verification per boot: not run again
        finally:
            await loop.cluster.close()
    assert unschedulable(plane, "r-fail")
    assert condition(plane, "r-fail") == ("False", "AccelGPUFellOffBus")
    assert loop.actions("r-fail").count(("verify", "failed")) == 1
    assert events(plane, "r-fail").count("AccelRepairCheckFailed") == 1
    registry = CollectorRegistry()
    registry.register(RepairCollector(loop.repair))
    labels = {"node": "r-fail", "check": "pciebw"}
    assert registry.get_sample_value("accel_remediator_repair_check_failed", labels) == 1
    assert registry.get_sample_value("accel_remediator_repairs_total", {"result": "check_failed"}) == 1


async def test_the_third_quarantine_within_the_window_is_escalated_and_not_returned(
    plane: ControlPlane, kubelet: FakeKubelet
) -> None:
    with exporter(healthy()) as url:
        loop = Loop(plane, url)
        try:
            for i in range(3):
                starts = f"2025-11-22T2{i}:00:00Z"
                await loop.fault("r-often", starts=starts)
                kubelet.reboot("r-often")
                await loop.resolved("r-often", starts=starts)
                await loop.repair.reconcile()
                if i < 2:
                    assert not unschedulable(plane, "r-often"), f"quarantine {i + 1} was returned"
        finally:
            await loop.cluster.close()
    obj = node_obj(plane, "r-often")
    assert obj["spec"].get("unschedulable") is True
    assert obj["metadata"]["labels"]["accel-health.io/needs-human"] == "true"
    assert len(json.loads(obj["metadata"]["annotations"][HISTORY])) == 3
    assert loop.actions("r-often").count(("return_to_pool", "done")) == 2
    assert ("escalate", "done") in loop.actions("r-often")
    assert "AccelRepeatedFaultsEscalated" in events(plane, "r-often")
    registry = CollectorRegistry()
    registry.register(RepairCollector(loop.repair))
    assert registry.get_sample_value("accel_remediator_node_escalated", {"node": "r-often"}) == 1


async def test_a_humans_recordon_in_between_is_kept_when_the_node_is_returned(
    plane: ControlPlane, kubelet: FakeKubelet
) -> None:
    with exporter(healthy()) as url:
        loop = Loop(plane, url)
        try:
            await loop.fault("r-human")
            plane.admin.merge_patch("/api/v1/nodes/r-human", {"spec": {"unschedulable": None}})
            plane.admin.merge_patch("/api/v1/nodes/r-human", {"spec": {"unschedulable": True}})
            kubelet.reboot("r-human")
            await loop.resolved("r-human")
            await loop.repair.reconcile()
        finally:
            await loop.cluster.close()
    assert unschedulable(plane, "r-human")  # the human's cordon stays
    assert condition(plane, "r-human") == ("True", "RepairVerified")  # the accelerators are fine
    record = next(r for r in loop.engine.log.records() if r.action == "return_to_pool")
    assert "cordon kept" in record.reason


def aws_executor(url: str, calls: list[str]) -> AwsExecutor:
    return AwsExecutor(
        settings=AwsSettings(region=REGION, endpoint_url=url),
        session=boto3.Session(region_name=REGION, **CREDENTIALS),
        on_call=lambda op, outcome: calls.append(f"{op}:{outcome}"),
    )


def set_provider_id(plane: ControlPlane, node: str, instance: str) -> None:
    plane.admin.merge_patch(f"/api/v1/nodes/{node}", {"spec": {"providerID": f"aws:///{REGION}a/{instance}"}})


async def test_a_karpenter_node_gets_the_handover_condition_and_no_auto_scaling_call(
    plane: ControlPlane, kubelet: FakeKubelet, moto: str
) -> None:
    made = aws_client(moto, "ec2").run_instances(ImageId="ami-12c6146b", MinCount=1, MaxCount=1)
    instance = made["Instances"][0]["InstanceId"]
    set_provider_id(plane, "aws-karp", instance)
    calls: list[str] = []
    with exporter(healthy()) as url:
        loop = Loop(plane, url, aws=aws_executor(moto, calls))
        try:
            await loop.fault("aws-karp", remediation="reboot")  # reboot first
            assert calls == ["RebootInstances:ok"]
            kubelet.reboot("aws-karp")
            await loop.resolved("aws-karp", remediation="reboot")
            await loop.repair.reconcile()
            assert not unschedulable(plane, "aws-karp")
            await loop.fault("aws-karp", starts="2025-11-22T21:00:00Z", remediation="reboot")  # it returns
        finally:
            await loop.cluster.close()
    assert calls == ["RebootInstances:ok"]  # no DescribeAutoScalingInstances, no SetInstanceHealth
    assert condition(plane, "aws-karp", "AcceleratedHardwareReady") == ("False", "AccelGPUFellOffBus")
    record = [r for r in loop.engine.log.records() if r.action == "aws_reboot"][-1]
    assert record.outcome == "done"
    assert "came back" in record.reason
    assert "handed over" in record.reason


async def test_a_fault_that_returns_after_the_reboot_escalates_to_a_replacement(
    plane: ControlPlane, kubelet: FakeKubelet, moto: str
) -> None:
    instance = make_group(moto, size=1)[0]
    set_provider_id(plane, "aws-asg", instance)
    calls: list[str] = []
    with exporter(healthy()) as url:
        loop = Loop(plane, url, aws=aws_executor(moto, calls))
        try:
            await loop.fault("aws-asg", remediation="reboot")
            await loop.fault("aws-asg", remediation="reboot")  # a resend while the reboot is under way
            assert calls == ["RebootInstances:ok"]
            assert REBOOTED in node_obj(plane, "aws-asg")["metadata"]["annotations"]
            assert health(moto, instance) == "Healthy"
            kubelet.reboot("aws-asg")
            await loop.resolved("aws-asg", remediation="reboot")
            await loop.repair.reconcile()
            assert not unschedulable(plane, "aws-asg")
            await loop.fault("aws-asg", starts="2025-11-22T21:00:00Z", remediation="reboot")
        finally:
            await loop.cluster.close()
    # The group and its health read once (the instance was Healthy), then marked.
    assert calls == ["RebootInstances:ok", "DescribeAutoScalingInstances:ok", "SetInstanceHealth:ok"]
    assert health(moto, instance) == "Unhealthy"
    record = [r for r in loop.engine.log.records() if r.action == "aws_reboot"][-1]
    assert record.outcome == "done"
    assert "escalated to a replacement" in record.reason


# -- a quarantine outlives the Node object ---------------------------------------------------------

REPO = Path(__file__).resolve().parents[2]
REMEDIATOR = "accel-health-remediator"
STARTUP = {"key": STARTUP_TAINT.key, "value": STARTUP_TAINT.value, "effect": STARTUP_TAINT.effect}


@pytest.fixture(scope="module")
def shipped_rbac(plane: ControlPlane, kubelet: FakeKubelet) -> str:
    """The remediator's ServiceAccount with deploy/'s RBAC, as shipped; its token."""
    return shipped_remediator_account(plane, NS, REMEDIATOR)


def stored_quarantine(plane: ControlPlane, node: str) -> dict[str, Any] | None:
    path = f"/api/v1/namespaces/{NS}/configmaps/{quarantine_configmap_name(node)}"
    if not plane.admin.exists(path):
        return None
    obj: dict[str, Any] = plane.admin.get(path)
    return obj


def recreate(plane: ControlPlane, kubelet: FakeKubelet, node: str, *, startup_taint: bool = False) -> str:
    """The cloud's repair: the Node object deleted and registered again under its name; its new uid."""
    old = node_obj(plane, node)["metadata"]["uid"]
    plane.admin.delete(f"/api/v1/nodes/{node}")
    wait_for("the old node object gone", lambda: not plane.admin.exists(f"/api/v1/nodes/{node}"), timeout=10)
    created = kubelet.add_node(
        node,
        labels={"pool": "gpu"},
        capacity={"nvidia.com/gpu": "8"},
        taints=[STARTUP] if startup_taint else None,
    )
    uid = str(created["metadata"]["uid"])
    assert uid != old
    return uid


def pinned_pod(plane: ControlPlane, name: str, node: str) -> None:
    """A pod only `node` may run (it waits while the node does not fit)."""
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": node},
            "containers": [{"name": "train", "image": "trainer:1"}],
        },
    }
    plane.admin.create("/api/v1/namespaces/default/pods", pod)


def bound_node(plane: ControlPlane, pod: str) -> str:
    return str(plane.admin.get(f"/api/v1/namespaces/default/pods/{pod}")["spec"].get("nodeName") or "")


def startup_tainted(plane: ControlPlane, node: str) -> bool:
    return any(t["key"] == STARTUP_TAINT.key for t in node_obj(plane, node)["spec"].get("taints") or [])


def forbidden(plane: ControlPlane) -> list[str]:
    user = f"system:serviceaccount:{NS}:{REMEDIATOR}"
    return [
        f"{e['verb']} {e['requestURI']}" for e in plane.audit(user=user) if e["responseStatus"]["code"] == 403
    ]


async def test_a_node_recreated_under_its_quarantined_name_takes_no_pods_until_its_checks_pass(
    plane: ControlPlane, kubelet: FakeKubelet, shipped_rbac: str
) -> None:
    with exporter(healthy()) as url:
        loop = Loop(plane, url, token=shipped_rbac)
        try:
            old_uid = node_obj(plane, "q-new")["metadata"]["uid"]
            await loop.fault("q-new")
            stored = stored_quarantine(plane, "q-new")
            assert stored is not None, "no durable copy of the quarantine"
            assert stored["metadata"]["labels"] == {
                "app.kubernetes.io/managed-by": REMEDIATOR,
                "accel-health.io/quarantine": "true",
            }
            text = stored["data"]["quarantine.json"]
            assert len(text.encode()) <= DURABLE_MAX_BYTES
            assert json.loads(text)["record"]["uid"] == old_uid
            recreate(plane, kubelet, "q-new")  # registers without the startup taint: the loop adds it
            assert stored_quarantine(plane, "q-new") is not None  # the Node's deletion did not take it
            pinned_pod(plane, "q-new-trainer", "q-new")
            loop.restart_repair()  # nothing in memory: what it knows it reads from the cluster
            await loop.repair.reconcile()  # the alert still fires: held, not verified
            assert startup_tainted(plane, "q-new")
            held = node_obj(plane, "q-new")["metadata"]["annotations"]
            assert json.loads(held[QUARANTINE])["uid"] == old_uid
            kubelet.sync()  # the scheduler stand-in: the pod does not tolerate the startup taint
            assert bound_node(plane, "q-new-trainer") == ""
            await loop.resolved("q-new")  # repaired: the new machine's alerts resolved
            await loop.repair.reconcile()
        finally:
            await loop.cluster.close()
    assert not startup_tainted(plane, "q-new")
    assert QUARANTINE not in (node_obj(plane, "q-new")["metadata"].get("annotations") or {})
    assert stored_quarantine(plane, "q-new") is None
    repair = [a for a in loop.actions("q-new") if a[0] in OWN_ACTIONS]
    assert repair == [("quarantine", "done"), ("hold_unverified", "done"), ("return_to_pool", "done")]
    assert {"AccelUnverifiedNodeHeld", "AccelReturnedToPool"} <= set(events(plane, "q-new"))
    kubelet.sync()
    assert bound_node(plane, "q-new-trainer") == "q-new"  # verified: it takes work again
    assert forbidden(plane) == []  # the shipped RBAC allows every request made


async def test_a_new_node_registered_with_the_examples_startup_taint_takes_work_once_the_loop_lifts_it(
    plane: ControlPlane, kubelet: FakeKubelet, shipped_rbac: str
) -> None:
    example = yaml.safe_load((REPO / "examples/node-pools/karpenter-nodepool.yaml").read_text())
    (taint,) = example["spec"]["template"]["spec"]["startupTaints"]
    kubelet.add_node("q-fresh", labels={"pool": "gpu"}, capacity={"nvidia.com/gpu": "8"}, taints=[taint])
    pinned_pod(plane, "q-fresh-trainer", "q-fresh")
    kubelet.sync()
    assert bound_node(plane, "q-fresh-trainer") == ""
    loop = Loop(plane, "http://127.0.0.1:9/checks", token=shipped_rbac)  # no checks: none are asked
    try:
        await loop.repair.reconcile()
    finally:
        await loop.cluster.close()
    assert not startup_tainted(plane, "q-fresh")
    assert loop.actions("q-fresh") == [("admit", "done")]
    assert stored_quarantine(plane, "q-fresh") is None
    kubelet.sync()
    assert bound_node(plane, "q-fresh-trainer") == "q-fresh"
    assert forbidden(plane) == []


async def test_escalation_counts_the_quarantines_of_a_name_across_recreated_node_objects(
    plane: ControlPlane, kubelet: FakeKubelet, shipped_rbac: str
) -> None:
    with exporter(healthy()) as url:
        loop = Loop(plane, url, token=shipped_rbac)
        try:
            for i in range(3):
                starts = f"2025-11-23T0{i}:00:00Z"
                await loop.fault("q-often", starts=starts)
                if i == 2:
                    break
                recreate(plane, kubelet, "q-often", startup_taint=True)  # as the node-pool examples do
                await loop.resolved("q-often", starts=starts)
                await loop.repair.reconcile()
                assert not startup_tainted(plane, "q-often"), f"replacement {i + 1} was not returned"
        finally:
            await loop.cluster.close()
    obj = node_obj(plane, "q-often")
    assert obj["spec"].get("unschedulable") is True
    assert obj["metadata"]["labels"]["accel-health.io/needs-human"] == "true"
    assert len(json.loads(obj["metadata"]["annotations"][HISTORY])) == 3  # three objects' quarantines
    assert loop.actions("q-often").count(("return_to_pool", "done")) == 2
    assert ("escalate", "done") in loop.actions("q-often")
    stored = stored_quarantine(plane, "q-often")
    assert stored is not None
    doc = json.loads(stored["data"]["quarantine.json"])
    assert (len(doc["history"]), doc["escalated"]) == (3, True)
    assert forbidden(plane) == []


async def test_the_quarantined_gauge_reads_the_node_cache_at_scrape_time(
    plane: ControlPlane, kubelet: FakeKubelet
) -> None:
    loop = Loop(plane, "http://127.0.0.1:9/checks")
    registry = CollectorRegistry()
    registry.register(RepairCollector(loop.repair))
    try:
        assert await loop.cluster.start_cache(wait_seconds=20)
        before = registry.get_sample_value("accel_remediator_quarantined_nodes")
        assert before is not None
        await loop.engine.handle(payload("q-gauge", starts="2025-11-23T10:00:00Z", remediation=""))

        async def counted() -> bool:  # no repair pass in between
            return registry.get_sample_value("accel_remediator_quarantined_nodes") == before + 1

        await eventually(counted, seconds=5)
    finally:
        await loop.cluster.close()


async def test_durable_copies_of_long_node_names_are_saved_replaced_read_and_deleted_with_the_shipped_rbac(
    plane: ControlPlane, shipped_rbac: str
) -> None:
    node = ".".join(["a" * 62] * 4)  # 251 characters: the ConfigMap's name carries a hash
    assert len(quarantine_configmap_name(node)) <= 253
    cluster = cluster_for(plane, token=shipped_rbac)
    try:
        await cluster.save_quarantine(node, {"node": node, "history": [1.0]})
        await cluster.save_quarantine(node, {"node": node, "history": [1.0, 2.0]})  # replaced
        assert (await cluster.load_quarantines())[node] == {"node": node, "history": [1.0, 2.0]}
        await cluster.delete_quarantine(node)
        await cluster.delete_quarantine(node)  # gone already: nothing to do
        assert node not in await cluster.load_quarantines()
    finally:
        await cluster.close()
    assert forbidden(plane) == []
