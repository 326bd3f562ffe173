"""`accel-health-remediator serve` over the Kubernetes executor, as a process, against the fake API.

The service is started with a kubeconfig that points at the HTTP-level fake API server: it takes
the leader Lease, becomes ready, turns a webhook delivery into a condition and a cordon on the
node, and hands the Lease back when it is stopped with SIGTERM. And it is started exactly as the
rendered enforce Deployment starts it, in a pod's view (service-account token and CA, the
KUBERNETES_SERVICE_HOST/PORT variables, the API over TLS): with no flag added, it finds the
in-cluster credentials, leads with the default lease timing and acts.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import ssl
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from examples.pipeline import free_port
from tests.deploy.kube import DEPLOY, containers, expanded_args, find, kubectl_problem, render
from tests.remediator.conftest import payload
from tests.remediator.fake_apiserver import node, serve


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
        port = free_port()
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


# Run the console script's main() with the service-account mount at another path: the only change
# to the pod's view (the test cannot write /var/run/secrets). Everything after the path is argv.
AS_IN_A_POD = (
    "import pathlib, sys; import remediator.executors.kubernetes.api as k; "
    "k.SERVICE_ACCOUNT_DIR = pathlib.Path(sys.argv[1]); "
    "from remediator.cli import main; sys.exit(main(sys.argv[2:]))"
)


def _certificate(tmp_path: Path) -> tuple[Path, Path]:
    openssl = shutil.which("openssl")
    assert openssl is not None
    cert, key = tmp_path / "apiserver.crt", tmp_path / "apiserver.key"
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=kubernetes",
         "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return cert, key


def _as_deployed(overlay: str, tmp_path: Path) -> tuple[list[str], dict[str, str]]:
    """The remediator container's argv (mounted files moved under tmp_path) and its fieldRef env."""
    objects = render(DEPLOY / "overlays" / overlay)
    deployment = find(objects, "Deployment", "accel-health-remediator")
    (container,) = [c for w, c in containers([deployment]) if c["name"] == "remediator"]
    assert container["command"] == ["accel-health-remediator"]
    policy = find(objects, "ConfigMap", "accel-health-remediator-policy")["data"]["policy.yaml"]
    mounts = {
        "/etc/accel-health/token/token": "s3cret-token\n",
        "/etc/accel-health/policy/policy.yaml": policy,
    }
    argv = []
    for arg in expanded_args(objects, container):  # $(VAR) from the rendered ConfigMaps, as the kubelet
        name, _, value = arg.partition("=")
        if value in mounts:
            moved = tmp_path / Path(value).name
            moved.write_text(mounts[value])
            argv.append(f"{name}={moved}")
        else:
            argv.append(arg)
    env = {
        e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"]
        for e in container.get("env", [])
        if "fieldRef" in e.get("valueFrom", {})
    }
    return argv, env


async def _wait_ready(http: aiohttp.ClientSession, proc: Any, limit: float) -> None:
    deadline = time.monotonic() + limit
    while True:
        try:
            async with http.get("/readyz") as resp:
                if resp.status == 200:
                    return
        except aiohttp.ClientConnectionError:
            pass
        if time.monotonic() > deadline or proc.returncode is not None:
            if proc.returncode is None:
                proc.kill()
            _, err = await proc.communicate()
            raise AssertionError(f"the remediator did not become ready (leader):\n{err.decode()}")
        await asyncio.sleep(0.1)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl to make the API's certificate")
@pytest.mark.skipif(kubectl_problem() is not None, reason=str(kubectl_problem()))
async def test_started_as_the_enforce_deployment_starts_it_it_finds_in_cluster_credentials_leads_and_acts(
    tmp_path: Path,
) -> None:
    argv, pod_env = _as_deployed("enforce", tmp_path)
    assert not any(a.startswith(("--kubeconfig", "--in-cluster", "--lease-duration")) for a in argv)
    listen = next(a for a in argv if a.startswith("--listen="))
    port = free_port()
    argv[argv.index(listen)] = f"--listen=127.0.0.1:{port}"  # the pod's 0.0.0.0:9836, on a free port
    cert, key = _certificate(tmp_path)
    sa_dir = tmp_path / "serviceaccount"
    sa_dir.mkdir()
    (sa_dir / "token").write_text("service-account-token")
    (sa_dir / "ca.crt").write_bytes(cert.read_bytes())
    (sa_dir / "namespace").write_text("accel-health")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    async with serve(tls=context) as (api, url):
        api.add(node("gpu-node-1"))
        api_port = url.rsplit(":", 1)[1]
        env = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "POD_NAMESPACE", "POD_NAME")}
        env |= {
            "HOME": str(tmp_path),  # no ~/.kube/config
            "KUBERNETES_SERVICE_HOST": "127.0.0.1",
            "KUBERNETES_SERVICE_PORT": api_port,
            "POD_NAME": "accel-health-remediator-abc12" if "POD_NAME" in pod_env else "",
            "POD_NAMESPACE": "accel-health" if "POD_NAMESPACE" in pod_env else "",
        }
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", AS_IN_A_POD, str(sa_dir), *argv, env=env, stderr=asyncio.subprocess.PIPE
        )
        try:
            headers = {"Authorization": "Bearer s3cret-token"}
            async with aiohttp.ClientSession(f"http://127.0.0.1:{port}", headers=headers) as http:
                await _wait_ready(http, proc, limit=120)  # a backstop: a loaded machine took over 20 s
                async with http.post("/alerts", json=payload("gpu-fatal-xid")) as resp:
                    assert resp.status == 200, await resp.text()
                deadline = time.monotonic() + 10

                def finished() -> bool:
                    # The drain's Event is written after the node's drain-status: wait for both.
                    node = api.stored("nodes", "gpu-node-1") or {}
                    done = node.get("metadata", {}).get("annotations", {}).get("accel-health.io/drain-status")
                    events = {
                        o["reason"] for (plural, _, _), o in list(api.store.items()) if plural == "events"
                    }
                    return done == "done" and "AccelDrainFinished" in events

                while not finished():
                    assert time.monotonic() < deadline, "the drain did not finish"
                    await asyncio.sleep(0.1)
            proc.send_signal(signal.SIGTERM)
            _, err = await asyncio.wait_for(proc.communicate(), timeout=15)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.communicate()
        lease = api.stored("leases", "accel-health-remediator", "accel-health")
        requests = list(api)
        reasons = {obj["reason"] for (plural, _, _), obj in api.store.items() if plural == "events"}
    log = err.decode()
    assert proc.returncode == 0, log
    assert "Kubernetes credentials: in-cluster service account" in log
    assert lease is not None
    assert lease["spec"]["leaseDurationSeconds"] == 15
    obj = api.stored("nodes", "gpu-node-1")
    assert obj is not None
    assert obj["spec"]["unschedulable"] is True
    assert [c["type"] for c in obj["status"]["conditions"]] == ["Ready", "AcceleratorHealthy"]
    assert {"AccelFaultDetected", "AccelCordoned", "AccelDrainStarted", "AccelDrainFinished"} <= reasons
    assert all(r.headers.get("Authorization", "").lower() == "bearer service-account-token" for r in requests)
