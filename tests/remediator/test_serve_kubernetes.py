"""`accel-health-remediator serve` over the Kubernetes executor, as a process, against the fake API.

The service is started with a kubeconfig that points at the HTTP-level fake API server: it takes
the leader Lease, becomes ready, turns a webhook delivery into a condition and a cordon on the
node, and hands the Lease back when it is stopped with SIGTERM.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import sys
import time
from pathlib import Path

import aiohttp

from tests.remediator.conftest import payload
from tests.remediator.fake_apiserver import node, serve


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _kubeconfig(path: Path, server: str) -> Path:
    path.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: fake\n"
        f"clusters: [{{name: fake, cluster: {{server: '{server}'}}}}]\n"
        "users: [{name: remediator, user: {token: not-checked}}]\n"
        "contexts: [{name: fake, context: {cluster: fake, user: remediator}}]\n"
    )
    return path


async def test_the_service_leads_acts_on_the_cluster_and_hands_the_lease_back(tmp_path: Path) -> None:
    async with serve() as (api, url):
        api.add(node("gpu-node-1"))
        port = _free_port()
        body = payload("gpu-fatal-xid")
        body["alerts"][0]["labels"]["remediation"] = "cordon"
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "remediator.cli", "serve", "--insecure-no-auth",
            f"--listen=127.0.0.1:{port}",
            f"--kubeconfig={_kubeconfig(tmp_path / 'kubeconfig', url)}", "--leader-election-namespace=ops",
            "--lease-name=remediator", "--lease-duration=3",
            stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        try:
            async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as http:
                deadline = time.monotonic() + 20
                while True:
                    try:
                        async with http.get("/readyz") as resp:
                            if resp.status == 200:
                                break
                    except aiohttp.ClientConnectionError:
                        pass
                    if time.monotonic() > deadline:
                        proc.kill()
                        _, err = await proc.communicate()
                        raise AssertionError(f"the remediator did not become ready (leader):\n{err.decode()}")
                    await asyncio.sleep(0.1)
                lease = api.stored("leases", "remediator", "ops")
                assert lease is not None
                assert lease["spec"]["holderIdentity"]
                async with http.post("/alerts", json=body) as resp:
                    assert resp.status == 200
            proc.send_signal(signal.SIGTERM)
            _, err = await asyncio.wait_for(proc.communicate(), timeout=15)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.communicate()
    assert proc.returncode == 0, err.decode()
    obj = api.stored("nodes", "gpu-node-1")
    assert obj is not None
    assert obj["spec"]["unschedulable"] is True
    assert [c["type"] for c in obj["status"]["conditions"]] == ["Ready", "AcceleratorHealthy"]
    assert "leader election on Lease ops/remediator" in err.decode()
    assert api.stored("leases", "remediator", "ops")["spec"].get("holderIdentity") is None  # type: ignore[index]  # exists
