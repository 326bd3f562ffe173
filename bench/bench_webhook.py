"""Sustained single-alert webhook load against the real service in dry-run.

Starts `accel-health-remediator --dry-run` (the console script's module, in a subprocess, on
127.0.0.1) over a synthetic 1,000-node cluster snapshot, then posts single-alert Alertmanager payloads
from a fixed pool of 1,000 alerts (one per node: what Alertmanager resends look like) with a few
concurrent connections for `--seconds` (default 25; `--seconds 300` for the five-minute memory
check). Prints requests/s, p50/p99 latency and the server's RSS after warm-up and at the end.

Target: >= 500 requests/s with p99 <= 50 ms, RSS flat (growth well under 10%).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import yaml

NODES = 1000
TOKEN = "bench-token-0123456789"  # noqa: S105  a throw-away token for a loopback-only server


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def snapshot() -> dict[str, object]:
    items: list[dict[str, object]] = []
    for i in range(NODES):
        name = f"gpu-{i:04d}"
        items.append(
            {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
                "spec": {"providerID": f"aws:///us-west-2a/i-{i:017x}"},
            }
        )
        items.append(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "namespace": "ml",
                    "name": f"train-{i:04d}",
                    "ownerReferences": [{"kind": "Job", "name": "train", "controller": True}],
                },
                "spec": {"nodeName": name},
                "status": {"phase": "Running"},
            }
        )
    return {"apiVersion": "v1", "kind": "List", "items": items}


def bodies() -> list[bytes]:
    out = []
    for i in range(NODES):
        alert = {
            "status": "firing",
            "labels": {"alertname": "AccelGPUFatalXid", "node": f"gpu-{i:04d}", "remediation": "drain"},
            "annotations": {"summary": "GPU has fallen off the bus"},
            "startsAt": "2025-11-22T20:00:00Z",
            "fingerprint": f"{i:016x}",
        }
        out.append(json.dumps({"version": "4", "status": "firing", "alerts": [alert]}).encode())
    return out


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


async def wait_ready(port: int) -> None:
    deadline = time.monotonic() + 30
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            try:
                async with session.get(f"http://127.0.0.1:{port}/readyz") as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    raise SystemExit("the remediator did not become ready")


async def load(port: int, *, seconds: float, concurrency: int, pid: int) -> None:
    pool = bodies()
    url = f"http://127.0.0.1:{port}/alerts"
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    latencies: list[float] = []
    errors = 0
    next_index = 0
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def worker(until: float, record: bool) -> None:
            nonlocal next_index, errors
            while time.monotonic() < until:
                body = pool[next_index % len(pool)]
                next_index += 1
                started = time.perf_counter()
                async with session.post(url, data=body, headers=headers) as resp:
                    await resp.read()
                    if resp.status != 200:
                        errors += 1
                if record:
                    latencies.append(time.perf_counter() - started)

        warm_until = time.monotonic() + 3
        await asyncio.gather(*(worker(warm_until, record=False) for _ in range(concurrency)))
        rss_start = rss_kib(pid)
        samples = [(0.0, rss_start)]
        started = time.monotonic()
        until = started + seconds

        async def sampler() -> None:
            while time.monotonic() < until:
                await asyncio.sleep(min(30.0, max(seconds / 5, 1.0)))
                samples.append((time.monotonic() - started, rss_kib(pid)))

        await asyncio.gather(sampler(), *(worker(until, record=True) for _ in range(concurrency)))
        elapsed = time.monotonic() - started
    rss_end = rss_kib(pid)
    latencies.sort()
    count = len(latencies)
    p50 = latencies[count // 2] * 1000
    p99 = latencies[min(count - 1, int(count * 0.99))] * 1000
    rps = count / elapsed
    growth = 100.0 * (rss_end - rss_start) / rss_start if rss_start else 0.0
    print(f"{count} requests in {elapsed:.1f} s with {concurrency} connections, {errors} non-200 answers")
    print(f"throughput: {rps:.0f} requests/s (target >= 500)")
    print(f"latency: p50 {p50:.1f} ms, p99 {p99:.1f} ms (target p99 <= 50 ms)")
    print("server RSS over the run: " + ", ".join(f"{t:.0f}s {kib / 1024:.1f} MiB" for t, kib in samples))
    print(
        f"server RSS: {rss_start / 1024:.1f} MiB after warm-up, "
        f"{rss_end / 1024:.1f} MiB at the end ({growth:+.1f}%)"
    )
    ok = rps >= 500 and p99 <= 50 and errors == 0
    print("ok" if ok else "BELOW TARGET")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--seconds", type=float, default=25.0, help="measured load duration (default 25)")
    parser.add_argument("--concurrency", type=int, default=4, help="concurrent connections (default 4)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="accel-health-bench-") as tmp:
        snap = Path(tmp) / "snapshot.yaml"
        snap.write_text(yaml.safe_dump(snapshot()))
        token = Path(tmp) / "token"
        token.write_text(TOKEN)
        port = free_port()
        server = subprocess.Popen(
            [sys.executable, "-m", "remediator.cli", "--dry-run", f"--listen=127.0.0.1:{port}",
             f"--cluster-snapshot={snap}", f"--token-file={token}"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
        try:
            asyncio.run(wait_ready(port))
            asyncio.run(load(port, seconds=args.seconds, concurrency=args.concurrency, pid=server.pid))
        finally:
            server.terminate()
            try:
                server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


if __name__ == "__main__":
    main()
