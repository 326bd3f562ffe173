"""``GET /checks`` on the exporter's real HTTP server, and ``accel-health check`` fanning out to several.

Each node is the exporter's own HTTP handler on a loopback port, with checks on fake NVML and fake
CUDA; the CLI talks to them over real HTTP with the bearer token, exactly as to exporter pods.
"""

from __future__ import annotations

import io
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest

from exporter.checks.base import CheckResult, DeviceResult
from exporter.checks.endpoint import ChecksEndpoint
from exporter.checks.fanout import NodeAnswer, main, render
from exporter.cli import checks_source, make_handler
from exporter.sources import build_registry
from tests.checks.fake_cuda import FakeGpu, h100x8
from tests.checks.helpers import fake_dcgmi, make_runner

TOKEN = "s3cret-token"


@contextmanager
def node(gpus: list[FakeGpu] | None = None, *, dcgmi: str = "dcgmi-not-installed") -> Iterator[str]:
    """A node's exporter HTTP server; yields its base URL."""
    runner, _, _ = make_runner(
        gpus=gpus, names=("pciebw", "gpumem", "remapped", "power", "dcgm"), dcgmi=dcgmi
    )
    endpoint = ChecksEndpoint(runner, TOKEN, node="n")
    server = ThreadingHTTPServer(
        ("127.0.0.1", 0), make_handler(build_registry([checks_source(runner, None)]), endpoint)
    )
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def get(url: str, token: str | None = TOKEN) -> tuple[int, dict[str, object]]:
    request = urllib.request.Request(  # noqa: S310 -- loopback URL
        url, headers={"Authorization": f"Bearer {token}"} if token else {}
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:  # noqa: S310 -- loopback URL
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_the_endpoint_runs_the_asked_checks_and_answers_json() -> None:
    with node(h100x8(**{"4": {"host_to_device": 5.3e9}})) as url:
        status, body = get(f"{url}/checks?check=pciebw,power")
    assert status == 200
    assert body["verdict"] == "fail"
    results = body["results"]
    assert isinstance(results, list)
    assert [r["check"] for r in results] == ["pciebw", "power"]
    assert [d["device"] for d in results[0]["devices"] if d["verdict"] == "fail"] == ["4"]


@pytest.mark.parametrize(
    ("query", "token", "status", "error"),
    [
        ("check=pciebw", None, 401, "missing or wrong bearer token"),
        ("check=pciebw", "wrong", 401, "missing or wrong bearer token"),
        (
            "check=nosuch",
            TOKEN,
            400,
            "unknown check 'nosuch' (this node runs: dcgm, gpumem, pciebw, power, remapped)",
        ),
        ("check=dcgm&r=7", TOKEN, 400, "r='7': dcgmi diag runs levels 1, 2, 3 or 4"),
    ],
)
def test_the_endpoint_refuses_bad_requests_and_runs_nothing(
    query: str, token: str | None, status: int, error: str
) -> None:
    with node() as url:
        code, body = get(f"{url}/checks?{query}", token)
        assert (code, body) == (status, {"error": error})
        with urllib.request.urlopen(f"{url}/metrics", timeout=5) as response:  # noqa: S310 -- loopback URL
            metrics = response.read().decode()
    assert "accel_check_runs_total{" not in metrics


def test_the_cli_prints_a_table_per_node_and_fails_when_one_node_fails(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    seed = h100x8(**{"4": {"host_to_device": 5.3e9}})
    for gpu in seed:
        gpu.device_to_host = 12.3e9
        if gpu.host_to_device != 5.3e9:
            gpu.host_to_device = 12.3e9
    with node(seed) as one, node() as two:
        out = io.StringIO()
        status = main(
            [
                "check",
                "--endpoints",
                f"gpu-node-1={one},gpu-node-2={two}",
                "--check",
                "pciebw",
                "--token-file",
                str(token_file),
                "--batch",
                "1",
            ],
            out=out,
        )
        table = out.getvalue()
        ok = io.StringIO()
        only_two = main(
            [
                "check",
                "--endpoints",
                f"gpu-node-1={one},gpu-node-2={two}",
                "--host",
                "gpu-node-2",
                "--check",
                "pciebw",
                "--token-file",
                str(token_file),
            ],
            out=ok,
        )
    assert status == 1
    lines = table.splitlines()
    assert lines[0].split() == ["NODE", "CHECK", "VERDICT", *(f"GPU{i}" for i in range(8)), "NOTE"]
    assert lines[1].split()[:12] == [
        "gpu-node-1",
        "pciebw",
        "h2d",
        "GB/s",
        "FAIL",
        "12.3",
        "12.3",
        "12.3",
        "12.3",
        "5.3!",
        "12.3",
        "12.3",
    ]
    assert lines[2].split()[:4] == ["d2h", "GB/s", "12.3", "12.3"]
    assert lines[3].split()[:6] == ["gpu-node-2", "pciebw", "h2d", "GB/s", "PASS", "53.5"]
    assert table.endswith("2 node(s) checked, 1 failed: gpu-node-1 (pciebw)\n")
    assert only_two == 0
    assert "gpu-node-1" not in ok.getvalue()


def test_the_cli_checks_at_most_batch_nodes_at_once(tmp_path: Path) -> None:
    dcgmi = fake_dcgmi(tmp_path, "dcgm3-r1-pass.txt", sleep=0.4)
    with node(dcgmi=str(dcgmi)) as a, node(dcgmi=str(dcgmi)) as b, node(dcgmi=str(dcgmi)) as c:
        endpoints = f"a={a},b={b},c={c}"
        timings = {}
        for batch in ("1", "3"):
            token = tmp_path / "token"
            token.write_text(TOKEN)
            began = time.monotonic()
            status = main(
                [
                    "check",
                    "--endpoints",
                    endpoints,
                    "--check",
                    "dcgm",
                    "--batch",
                    batch,
                    "--token-file",
                    str(token),
                ],
                out=io.StringIO(),
            )
            timings[batch] = time.monotonic() - began
            assert status == 0
    assert timings["1"] >= 1.2
    assert timings["3"] < 1.0


def test_an_unreachable_node_or_a_wrong_token_is_a_failed_node_not_a_crash(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("wrong")
    with node() as up:
        out = io.StringIO()
        status = main(
            [
                "check",
                "--endpoints",
                f"a={up},b=http://127.0.0.1:9",
                "--token-file",
                str(token),
                "--check",
                "power",
            ],
            out=out,
        )
    assert status == 1
    text = out.getvalue()
    assert "HTTP 401" in text
    assert "2 node(s) checked, 2 failed: a (unreachable), b (unreachable)" in text


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["check", "--endpoints", "gpu-node-1"], "expected node=http://host:port"),
        (["check", "--endpoints", "a=http://127.0.0.1:1", "--host", "b"], "no exporter found on node(s) b"),
        (["check", "--endpoints", "a=http://127.0.0.1:1", "--param", "r"], "expected KEY=VALUE"),
    ],
)
def test_usage_errors_exit_2_with_the_reason(
    argv: list[str], error: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv, out=io.StringIO()) == 2
    assert error in capsys.readouterr().err


def test_network_checks_get_a_row_per_interface_and_peer_and_no_gpu_columns() -> None:
    ping = CheckResult(
        "ping",
        "fail",
        0.0,
        2.1,
        (
            DeviceResult("net1/gpu-node-2", "pass", {"reachable": 1.0, "rtt_seconds": 4.2e-5}),
            DeviceResult("net1/gpu-node-3", "fail", {"reachable": 0.0}, detail="10.219.7.3 unreachable"),
        ),
    )
    iperf = CheckResult(
        "iperf", "pass", 0.0, 5.2, (DeviceResult("net1/gpu-node-2", "pass", {"bytes_per_second": 1.17e10}),)
    )
    out = io.StringIO()
    render([NodeAnswer("gpu-node-1", "fail", (ping, iperf))], out)
    lines = out.getvalue().splitlines()
    assert "GPU" not in lines[0]
    assert lines[1].split()[:4] == ["gpu-node-1", "ping", "net1/gpu-node-2", "PASS"]
    assert lines[1].endswith("rtt 0.04 ms")
    assert lines[2].split() == ["net1/gpu-node-3", "FAIL", "10.219.7.3", "unreachable"]
    assert lines[3].split() == ["gpu-node-1", "iperf", "net1/gpu-node-2", "PASS", "93.60", "Gbit/s"]
    assert "1 node(s) checked, 1 failed: gpu-node-1 (ping)" in out.getvalue()
