"""How close a drain of a full node comes to the ideal, against a Kubernetes API with a set latency.

A node with 110 pods (the kubelet's default maximum) is drained through the Kubernetes executor
against the HTTP-level fake API server of the tests, run in a child process (so that the mock's own
CPU time does not count as the executor's) and answering every request after a fixed latency. The
ideal is the eviction requests alone, `concurrency` at a time: pods / concurrency x latency. A drain
also reads the node and lists its pods and PDBs, cordons and records its start, lists the pods once
more to see them gone, and records the result: four round trips of bookkeeping, whose share shrinks
as drains get longer. The client is warmed up first (one request of each kind), as in a running
service. Prints requests, drain time, ideal and ratio per configuration; stops by itself.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

from kubernetes.aio import client as k8s

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the fake API server lives in tests/

from remediator.cluster import DrainSettings  # noqa: E402  after sys.path
from remediator.executors.kubernetes import KubernetesCluster  # noqa: E402  after sys.path
from tests.remediator.fake_apiserver import node, pod, serve  # noqa: E402  after sys.path

PODS = 110
CONFIGS = ((10, 0.050), (10, 0.020), (25, 0.050), (1, 0.010))  # (concurrency, latency seconds)


async def api_server(latency: float) -> None:
    """Child process: serve a node with PODS pods; print the URL, then the request count on EOF."""
    async with serve(latency_seconds=latency) as (api, url):
        api.add(node("gpu-1"))
        api.add(node("warm-up"))
        for i in range(PODS):
            api.add(pod(f"worker-{i:03d}", node_name="gpu-1"))
        api.add(pod("dcgm-exporter", node_name="gpu-1", owner=("DaemonSet", "dcgm-exporter")))
        print(url, flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        print(len(api), flush=True)


async def drain_once(concurrency: int, latency: float) -> tuple[float, int]:
    """Seconds one drain took, and how many requests it made."""
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        __file__,
        "--serve",
        str(latency),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    assert child.stdin is not None
    assert child.stdout is not None
    try:
        url = (await asyncio.wait_for(child.stdout.readline(), timeout=30)).decode().strip()
        cluster = KubernetesCluster(api=k8s.ApiClient(k8s.Configuration(host=url)))
        settings = DrainSettings(concurrency=concurrency, timeout_seconds=60)
        try:
            await cluster.drain("warm-up", settings)  # connections and the client's validators
            await cluster.evict_pod(namespace="training", name="absent", grace_period_seconds=None)
            started = time.perf_counter()
            outcome = await cluster.drain("gpu-1", settings)
            elapsed = time.perf_counter() - started
        finally:
            await cluster.close()
        child.stdin.close()
        total = int((await asyncio.wait_for(child.stdout.readline(), timeout=30)).decode())
    finally:
        if child.returncode is None:
            child.kill()
        await child.wait()
    if not outcome.completed or len(outcome.evicted) != PODS:
        raise SystemExit(f"drain did not complete: {outcome.summary()}")
    warm_up_requests = 7  # the warm-up drain's read, 2 lists, cordon, list, annotate; one eviction
    return elapsed, total - warm_up_requests


async def main() -> int:
    print(f"drain of {PODS} pods (+1 DaemonSet pod skipped); ideal = pods / concurrency x latency")
    print(f"{'concurrency':>11} {'latency':>8} {'requests':>8} {'drain':>8} {'ideal':>8} {'ratio':>6}")
    for concurrency, latency in CONFIGS:
        elapsed, requests = await drain_once(concurrency, latency)
        ideal = PODS / concurrency * latency
        row = f"{concurrency:>11} {latency * 1000:>6.0f}ms {requests:>8} {elapsed:>7.3f}s {ideal:>7.3f}s"
        print(f"{row} {elapsed / ideal:>6.2f}")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        asyncio.run(api_server(float(sys.argv[2])))
        sys.exit(0)
    sys.exit(asyncio.run(main()))
