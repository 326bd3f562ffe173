"""What the `evidence` step adds to a remediation (issue 26: goal <= 1 s).

The exporter is a local HTTP server (aiohttp on loopback) serving an 8-GPU evidence document of about
200 KiB, bearer token checked; the capture is stored as the service stores it: an immutable ConfigMap
on the real API server of tests/kube when its binaries are there (`make control-plane`), else in S3
(moto's server). Each run is one webhook delivery for a fresh node through the whole engine, over
the real Kubernetes executor (or the in-memory cluster with S3): `condition, cordon` against
`condition, cordon, evidence` (fetch, store, retention, the Node annotation with the step's record,
the Event). Prints p50 and max of the delivery with and without the step, of the difference, and
of the step's own fetch+store; exits non-zero when the added p50 is over 1 s.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

from aiohttp import web
from kubernetes.aio import client as k8s

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the control-plane harness lives in tests/kube

from remediator.cluster import Cluster, Node  # noqa: E402  after sys.path
from remediator.evidence.fetch import ExporterEvidence  # noqa: E402  after sys.path
from remediator.evidence.store import (  # noqa: E402  after sys.path
    ConfigMapEvidenceStore,
    EvidenceStore,
    S3EvidenceStore,
    s3_client,
)
from remediator.executors.kubernetes import KubernetesCluster, KubernetesSettings  # noqa: E402
from remediator.executors.snapshot import RecordingAws, SnapshotCluster  # noqa: E402  after sys.path
from remediator.intake.payload import parse_payload  # noqa: E402  after sys.path
from remediator.lifecycle.engine import Engine  # noqa: E402  after sys.path
from remediator.lifecycle.model import EngineSettings  # noqa: E402  after sys.path
from remediator.lifecycle.repair import url_template_endpoint  # noqa: E402  after sys.path
from remediator.policy import parse_policy  # noqa: E402  after sys.path
from tests.kube.conftest import control_plane_skip_reason  # noqa: E402  after sys.path
from tests.kube.controlplane import ControlPlane, apply_objects, control_plane  # noqa: E402
from tests.remediator.evidence_server import TOKEN, EvidenceServer  # noqa: E402  after sys.path

NS = "accel-health"
SAFETY = "safety: {max_disrupted_nodes: 100000, storm_breaker: {enabled: false}}\n"
WITH = SAFETY + "rules: [{name: r, actions: [condition, cordon, {type: evidence, timeout_seconds: 10}]}]"
WITHOUT = SAFETY + "rules: [{name: r, actions: [condition, cordon]}]"
GOAL_SECONDS = 1.0
PADDING = 1100
"""Extra record lines in the served document: about 200 KiB with the 8 GPUs."""


def payload(node: str) -> Any:
    alert = {
        "status": "firing",
        "labels": {"alertname": "AccelGPUFatalXid", "node": node, "gpu": "4", "xid": "79"},
        "startsAt": "2025-11-22T20:31:07.412Z",
        "fingerprint": f"xid-{node}",
    }
    return parse_payload({"version": "4", "status": "firing", "alerts": [alert]})


@contextlib.asynccontextmanager
async def exporter() -> AsyncIterator[str]:
    runner = web.AppRunner(EvidenceServer(padding=PADDING).app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]  # a TCP site has one
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def deliveries(
    cluster: Cluster, store: EvidenceStore, url: str, *, nodes: list[str], evidence: bool
) -> list[float]:
    """One delivery per node through a fresh engine; seconds each."""
    engine = Engine(
        policy=parse_policy(WITH if evidence else WITHOUT),
        cluster=cluster,
        aws=RecordingAws(),
        settings=EngineSettings(),
        clock=time.time,
        evidence_fetcher=ExporterEvidence(
            endpoint=url_template_endpoint(url + "/{node}/evidence"), token=TOKEN
        ),
        evidence_store=store,
    )
    took = []
    for node in nodes:
        began = time.perf_counter()
        await engine.handle(payload(node))
        took.append(time.perf_counter() - began)
    steps = [r for r in engine.log.records() if r.action == "evidence"]
    if evidence:
        bad = [r.reason for r in steps if r.outcome != "done"]
        if bad:
            raise SystemExit(f"a capture failed: {bad[0]}")
        sizes = [r.details["bytes"] for r in steps]
        own = [r.details["seconds"] for r in steps]
        print(
            f"  step's own fetch+store: p50 {statistics.median(own):.3f} s, max {max(own):.3f} s; "
            f"capture {statistics.median(sizes) / 1024:.0f} KiB"
        )
    return took


def report(name: str, values: list[float]) -> None:
    print(f"  {name:<28} p50 {statistics.median(values):.3f} s   max {max(values):.3f} s")


async def measure(cluster: Cluster, store: EvidenceStore, *, runs: int, prefix: str) -> float:
    async with exporter() as url:
        base = await deliveries(
            cluster, store, url, nodes=[f"{prefix}base-{i}" for i in range(runs)], evidence=False
        )
        withe = await deliveries(
            cluster, store, url, nodes=[f"{prefix}ev-{i}" for i in range(runs)], evidence=True
        )
    report("delivery without evidence", base)
    report("delivery with evidence", withe)
    added = [w - b for w, b in zip(sorted(withe), sorted(base), strict=True)]
    report("added by the evidence step", added)
    return statistics.median(added)


@contextlib.contextmanager
def moto_s3() -> Iterator[Any]:
    from moto.server import ThreadedMotoServer  # noqa: PLC0415  only without a control plane

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto's request log
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        os.environ.setdefault(key, "testing")  # moto accepts any
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        client = s3_client(region="us-west-2", endpoint_url=f"http://{host}:{port}")
        client.create_bucket(Bucket="evidence", CreateBucketConfiguration={"LocationConstraint": "us-west-2"})
        yield client
    finally:
        server.stop()


def node_object(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {"node.kubernetes.io/instance-type": "p5.48xlarge"}},
        "spec": {"providerID": f"aws:///us-west-2a/i-{abs(hash(name)) % 10**17:017d}"},
    }


async def on_api_server(plane: ControlPlane, runs: int) -> float:
    names = [f"{p}-{i}" for p in ("base", "ev") for i in range(runs)]
    apply_objects(plane.admin, [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}}])
    apply_objects(plane.admin, [node_object(n) for n in names])
    api = plane.api_client()
    cluster = KubernetesCluster(api=api, settings=KubernetesSettings(state_namespace=NS))
    store = ConfigMapEvidenceStore(core=k8s.CoreV1Api(api), namespace=NS, clock=time.time)
    try:
        return await measure(cluster, store, runs=runs, prefix="")
    finally:
        await cluster.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20, help="deliveries with and without the step")
    parser.add_argument("--s3", action="store_true", help="store in S3 (moto) even with a control plane")
    args = parser.parse_args()
    reason = None if args.s3 else control_plane_skip_reason()
    if reason is None and not args.s3:
        print(f"evidence capture: ConfigMaps on the real API server, {args.runs} deliveries each")
        with (
            tempfile.TemporaryDirectory(prefix="accel-health-bench-") as tmp,
            control_plane(Path(tmp) / "cp") as plane,
        ):
            added = asyncio.run(on_api_server(plane, args.runs))
    else:
        print(f"evidence capture: S3 (moto server), in-memory cluster{f' ({reason})' if reason else ''}")
        nodes = [
            Node(name=f"{p}-{i}", accelerators=("nvidia.com/gpu",))
            for p in ("base", "ev")
            for i in range(args.runs)
        ]
        with moto_s3() as client:
            store = S3EvidenceStore(bucket="evidence", client=client)
            added = asyncio.run(
                measure(SnapshotCluster(nodes=nodes, pods=[], pdbs=[]), store, runs=args.runs, prefix="")
            )
    verdict = "OK" if added <= GOAL_SECONDS else "OVER"
    print(f"added p50 {added:.3f} s (goal <= {GOAL_SECONDS:.0f} s): {verdict}")
    return 0 if added <= GOAL_SECONDS else 1


if __name__ == "__main__":
    sys.exit(main())
