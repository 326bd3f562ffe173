"""Evidence captured on the real API server (issue 26), with deploy/'s RBAC as shipped: the engine's
`evidence` step, run over the real Kubernetes executor as the remediator's ServiceAccount, stores one
immutable ConfigMap per capture in its namespace (the API server refuses to change it), annotates the
Node with where it is and writes the AccelEvidenceCaptured Event; a resend captures nothing more; a
node whose exporter does not answer gets a capture with the error and an AccelEvidenceCaptureFailed
Event, and its cordon still runs. The retention, as the same ServiceAccount: the newest three per
node, a total, an age (only list, create and delete are used). `accel-health evidence NODE` reads
the newest capture once the Node is gone."""

from __future__ import annotations

import asyncio
import io
import json
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from kubernetes.aio import client as k8s

from remediator.evidence import cli as evidence_cli
from remediator.evidence.bundle import ANNOTATION
from remediator.evidence.fetch import ExporterEvidence
from remediator.evidence.store import DATA_KEY, EVIDENCE_LABEL, ConfigMapEvidenceStore, EvidenceRetention
from remediator.executors.kubernetes import KubernetesCluster, KubernetesSettings
from remediator.executors.snapshot import RecordingAws
from remediator.intake.payload import WebhookPayload, parse_payload
from remediator.lifecycle.engine import Engine
from remediator.lifecycle.model import EngineSettings
from remediator.lifecycle.repair import url_template_endpoint
from remediator.policy import parse_policy
from tests.kube.controlplane import ControlPlane, apply_objects, shipped_remediator_account
from tests.kube.kubelet import FakeKubelet, KubeletSettings
from tests.kube.rest import ApiError
from tests.remediator.conftest import FakeClock
from tests.remediator.evidence_server import GPU4_SERIAL, TOKEN, XID_LINE, EvidenceServer

NS = "accel-health"
REMEDIATOR = "accel-health-remediator"
NODES = ("gpu-0", "gpu-1", "gpu-gone")
POLICY = """
safety: {max_disrupted_nodes: 10, storm_breaker: {enabled: false}}
rules:
  - name: cordon
    actions: [condition, cordon, {type: evidence, timeout_seconds: 3}]
"""
AiohttpServer = Callable[[web.Application], Awaitable[TestServer]]


@pytest.fixture(scope="module")
def kubelet(plane: ControlPlane, workdir: Path) -> Iterator[FakeKubelet]:
    fake = FakeKubelet(plane=plane, workdir=workdir, settings=KubeletSettings(start_delay=0.2))
    for i, name in enumerate(NODES):
        fake.add_node(name, capacity={"nvidia.com/gpu": "8"}, provider_id=f"aws:///us-east-1a/i-{i:017x}")
    apply_objects(plane.admin, [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}}])
    fake.start()
    yield fake
    fake.stop()


@pytest.fixture(scope="module")
def token(plane: ControlPlane, kubelet: FakeKubelet) -> str:
    """The remediator's ServiceAccount with deploy/'s RBAC as shipped; its token."""
    return shipped_remediator_account(plane, NS, REMEDIATOR)


def captures(plane: ControlPlane, node: str | None = None) -> list[dict[str, Any]]:
    selector = f"{EVIDENCE_LABEL}=true" + (f",accel-health.io/evidence-node={node}" if node else "")
    items: list[dict[str, Any]] = plane.admin.items(
        f"/api/v1/namespaces/{NS}/configmaps", labelSelector=selector
    )
    return items


def webhook(node: str) -> WebhookPayload:
    alert = {
        "status": "firing",
        "labels": {"alertname": "AccelGPUFatalXid", "node": node, "gpu": "4", "xid": "79"},
        "startsAt": "2025-11-22T20:31:07.412Z",
        "fingerprint": f"xid-{node}",
    }
    return parse_payload({"version": "4", "status": "firing", "alerts": [alert]})


def events(plane: ControlPlane, node: str, reason: str) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = [
        e
        for e in plane.admin.items("/api/v1/namespaces/default/events")
        if e["involvedObject"]["name"] == node and e["reason"] == reason
    ]
    return found


async def test_a_capture_is_one_immutable_configmap_the_node_names_and_a_resend_adds_none(
    plane: ControlPlane, token: str, aiohttp_server: AiohttpServer, tmp_path: Path
) -> None:
    exporter = EvidenceServer()
    server = await aiohttp_server(exporter.app())
    base = str(server.make_url("")).rstrip("/")
    api = plane.api_client(token=token)
    cluster = KubernetesCluster(api=api, settings=KubernetesSettings(state_namespace=NS))
    store = ConfigMapEvidenceStore(core=k8s.CoreV1Api(api), namespace=NS, clock=time.time)

    def engine() -> Engine:
        endpoint = url_template_endpoint(base + "/{node}/evidence")
        return Engine(
            policy=parse_policy(POLICY),
            cluster=cluster,
            aws=RecordingAws(),
            settings=EngineSettings(),
            clock=time.time,
            evidence_fetcher=ExporterEvidence(endpoint=endpoint, token=TOKEN),
            evidence_store=store,
        )

    try:
        first = engine()
        began = time.monotonic()
        await first.handle(webhook("gpu-0"))
        took = time.monotonic() - began
        [rec] = [r for r in first.log.records() if r.action == "evidence"]
        assert rec.outcome == "done", rec.reason
        [cm] = captures(plane, "gpu-0")
        name = cm["metadata"]["name"]
        assert rec.details["location"] == f"configmap/{NS}/{name}"
        assert cm["immutable"] is True
        doc = json.loads(cm["data"][DATA_KEY])
        assert doc["node_evidence"]["gpus"][4]["serial"] == GPU4_SERIAL
        assert doc["kubernetes"]["provider_id"] == "aws:///us-east-1a/i-00000000000000000"
        node = plane.admin.get("/api/v1/nodes/gpu-0")
        assert node["metadata"]["annotations"][ANNOTATION] == rec.details["location"]
        [event] = events(plane, "gpu-0", "AccelEvidenceCaptured")
        assert name in event["message"]
        print(f"capture as part of a delivery: {took:.3f} s (condition, cordon, evidence)")

        # Written once, never rewritten: the API server itself refuses a change.
        changed = {**cm, "data": {DATA_KEY: "{}"}}
        with pytest.raises(ApiError) as refused:
            plane.admin.request("PUT", f"/api/v1/namespaces/{NS}/configmaps/{name}", body=changed)
        assert refused.value.status == 422

        # A resend, and a new leader reading the node's record: no second capture.
        await first.handle(webhook("gpu-0"))
        second = engine()
        await second.start()
        await second.handle(webhook("gpu-0"))
        assert len(captures(plane, "gpu-0")) == 1
        assert exporter.requests == ["gpu-0"]

        # A node whose exporter does not answer: captured without its part, visibly; cordoned anyway.
        broken = Engine(
            policy=parse_policy(POLICY),
            cluster=cluster,
            aws=RecordingAws(),
            settings=EngineSettings(),
            clock=time.time,
            evidence_fetcher=ExporterEvidence(
                endpoint=url_template_endpoint("http://127.0.0.1:9/{node}/evidence"), token=TOKEN
            ),
            evidence_store=store,
        )
        await broken.handle(webhook("gpu-1"))
        outcomes = {r.action: r.outcome for r in broken.log.records()}
        assert outcomes == {"condition": "done", "cordon": "done", "evidence": "failed"}
        [cm1] = captures(plane, "gpu-1")
        assert json.loads(cm1["data"][DATA_KEY])["fetch"]["ok"] is False
        [failed] = events(plane, "gpu-1", "AccelEvidenceCaptureFailed")
        assert failed["type"] == "Warning"
        assert plane.admin.get("/api/v1/nodes/gpu-1")["spec"]["unschedulable"] is True

        # The capture outlives the Node: `accel-health evidence NODE` reads it once the node is gone.
        await engine().handle(webhook("gpu-gone"))
        plane.admin.delete("/api/v1/nodes/gpu-gone")
        out = io.StringIO()
        argv = ["gpu-gone", "--kubeconfig", str(plane.kubeconfig), "--namespace", NS]
        assert await asyncio.to_thread(evidence_cli.main, argv, out=out) == 0
        report = out.getvalue()
        assert GPU4_SERIAL in report
        assert XID_LINE in report
        assert f"configmap/{NS}/accel-health-evidence-gpu-gone-" in report
    finally:
        await cluster.close()


async def test_the_retention_keeps_the_newest_per_node_and_in_all_and_deletes_the_old(
    plane: ControlPlane, token: str
) -> None:
    api = plane.api_client(token=token)
    clock = FakeClock(1_763_000_000.0)
    store = ConfigMapEvidenceStore(
        core=k8s.CoreV1Api(api),
        namespace=NS,
        retention=EvidenceRetention(per_node=3, total=5, max_age_seconds=30 * 86400.0),
        clock=clock,
    )
    for cm in captures(plane):  # the first test's captures: this test counts its own
        plane.admin.delete(f"/api/v1/namespaces/{NS}/configmaps/{cm['metadata']['name']}")
    try:
        body = json.dumps({"node_evidence": None}).encode()
        for _ in range(5):
            clock.now += 1
            await store.put(node="node-a", captured_at=clock.now, alertname="X", body=body)
        names_a = sorted(c["metadata"]["name"] for c in captures(plane, "node-a"))
        assert len(names_a) == 3  # the newest three of node-a
        for _ in range(3):
            clock.now += 1
            await store.put(node="node-b", captured_at=clock.now, alertname="X", body=body)
        assert len(captures(plane, "node-b")) == 3
        assert len(captures(plane, "node-a")) == 2  # five in all: node-a's oldest went
        assert sorted(c["metadata"]["name"] for c in captures(plane, "node-a")) == names_a[1:]
        clock.now += 31 * 86400  # a month later: everything before is past the retention
        await store.put(node="node-c", captured_at=clock.now, alertname="X", body=body)
        assert [c["metadata"]["annotations"]["accel-health.io/evidence-node"] for c in captures(plane)] == [
            "node-c"
        ]
        assert store.deleted == 8
        assert store.prune_errors == 0
    finally:
        await api.close()  # type: ignore[no-untyped-call]  # untyped upstream
