"""The command line: `explain` prints the plan, `serve` refuses unsafe or impossible start-ups (exit 2)
and, when it starts, logs where it listens and exits 0 on SIGTERM."""

from __future__ import annotations

import http.client
import json
import shutil
import signal
import ssl
import subprocess
import sys
import time
from pathlib import Path

import pytest

from examples.pipeline import free_port
from remediator import fleet_cli
from remediator.cli import main
from remediator.executors.snapshot import SnapshotCluster, SnapshotError
from tests.remediator.conftest import PAYLOADS, SNAPSHOT


def test_explain_prints_rule_gates_and_what_happens_to_which_pods(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        ["explain", "--alerts", str(PAYLOADS / "gpu-fatal-xid.json"), "--cluster-snapshot", str(SNAPSHOT)]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "alert AccelGPUFatalXid (firing) on node gpu-node-1" in out
    assert "rule 'drain' (rules[0]) matched: remediation=\"drain\"" in out
    assert "protected-node check: passed" in out
    assert "budget: 1 of 2 nodes" in out
    assert "pause: off" in out
    assert "storm breaker closed: 1 of 3 eligible nodes with a fault firing now" in out
    assert "gates afterwards: budget 1 of 2 nodes" in out
    assert "-> cordon: planned" in out
    assert "evict   ml-team/llama-pretrain-worker-0  (PyTorchJob/llama-pretrain)" in out
    assert (
        "blocked ml-team/llama-pretrain-worker-1  (blocked by PodDisruptionBudget ml-team/llama-pretrain"
        in out
    )


def test_explain_of_the_neuron_payload_ends_with_the_instance_replacement(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = main(
        ["explain", "--alerts", str(PAYLOADS / "neuron-hw-error.json"), "--cluster-snapshot", str(SNAPSHOT)]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "-> aws_set_unhealthy: planned: would mark i-0a1b2c3d4e5f60002 Unhealthy" in out


def test_serve_refuses_to_start_without_auth(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--cluster-snapshot", str(SNAPSHOT)]) == 2
    assert "refusing to start without authentication" in capsys.readouterr().err


def test_serve_without_a_snapshot_needs_a_kubernetes_configuration(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "absent"))
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    assert main(["serve", "--insecure-no-auth", "--listen=127.0.0.1:0"]) == 2
    err = capsys.readouterr().err
    assert "cannot load Kubernetes client configuration; tried --kubeconfig (not given); $KUBECONFIG" in err
    assert "--cluster-snapshot" in err


@pytest.mark.parametrize(
    ("value", "message"),
    [("15.0", "expected a whole number of seconds, got '15.0'"), ("2", "must be at least 3 seconds")],
)
def test_a_lease_duration_that_is_not_whole_seconds_of_at_least_3_is_refused(
    value: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--insecure-no-auth", f"--lease-duration={value}"])
    assert exited.value.code == 2
    assert f"--lease-duration: {message}" in capsys.readouterr().err


def test_an_invalid_policy_stops_start_up_with_its_problems(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "policy.yaml"
    bad.write_text("rules:\n  - name: x\n    actions: [{type: nuke}]\n")
    assert main(["--insecure-no-auth", "--config", str(bad), "--cluster-snapshot", str(SNAPSHOT)]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err
    assert "rules[0] (x).actions[0].type: unknown action type 'nuke'" in err


def test_a_malformed_snapshot_names_the_file_and_the_item(tmp_path: Path) -> None:
    snap = tmp_path / "snap.yaml"
    snap.write_text(
        "kind: List\nitems:\n"
        "- kind: Node\n  metadata: {name: ok}\n"
        "- kind: Pod\n  metadata: {name: p, labels: 3}\n"
    )
    with pytest.raises(
        SnapshotError, match=r"snap\.yaml: items\[1\] \(Pod p\): metadata.labels: expected a mapping"
    ):
        SnapshotCluster.from_file(snap)
    snap.write_text("just: a mapping\n")
    with pytest.raises(SnapshotError, match="kubectl get nodes,pods,poddisruptionbudgets"):
        SnapshotCluster.from_file(snap)


def test_serve_refuses_contradicting_or_broken_auth_and_tls_options(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    basic = tmp_path / "basic"
    basic.write_text("no-colon\n")
    snap = f"--cluster-snapshot={SNAPSHOT}"
    cases = {
        ("--insecure-no-auth", f"--token-file={token}", snap): "contradicts",
        (f"--basic-auth-file={basic}", snap): "expected USER:PASSWORD",
        (f"--token-file={token}", f"--tls-cert-file={token}", snap): "go together",
        (f"--token-file={token}", f"--tls-cert-file={token}", f"--tls-key-file={token}", snap): "cannot load",
        (f"--token-file={token}", "--max-body-bytes=10", snap): "at least 1024",
    }
    for argv, message in cases.items():
        assert main(list(argv)) == 2, argv
        assert message in capsys.readouterr().err, argv


def test_serve_logs_where_it_listens_and_exits_cleanly_on_sigterm(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "remediator.cli", "--dry-run", f"--listen=127.0.0.1:{port}",
         f"--cluster-snapshot={SNAPSHOT}", f"--token-file={token}"],
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        _wait_ready(port, proc=proc)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0
    assert f"listening on 127.0.0.1:{port} (dry-run)" in err


def _get(port: int, path: str, *, context: ssl.SSLContext | None = None, auth: str = "") -> tuple[int, bytes]:
    conn: http.client.HTTPConnection = (
        http.client.HTTPSConnection("127.0.0.1", port, timeout=2, context=context)
        if context is not None
        else http.client.HTTPConnection("127.0.0.1", port, timeout=2)
    )
    try:
        conn.request("GET", path, headers={"Authorization": auth} if auth else {})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _wait_ready(port: int, context: ssl.SSLContext | None = None, *, proc: subprocess.Popen[str]) -> None:
    """Until /readyz says 200, or the process exited. The limit is only a backstop for a hang: a
    start-up on a loaded 2-core machine (a test suite beside this one) took over 10 s."""
    deadline = time.monotonic() + 120
    while True:
        try:
            if _get(port, "/readyz", context=context)[0] == 200:
                return
        except OSError:
            pass
        assert proc.poll() is None, f"the remediator exited with {proc.returncode} before it was ready"
        assert time.monotonic() < deadline, "remediator did not become ready"
        time.sleep(0.05)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl to make a test certificate")
def test_serve_speaks_tls_with_basic_auth_and_can_start_paused(tmp_path: Path) -> None:
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    subprocess.run(
        [str(shutil.which("openssl")), "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )  # fmt: skip
    basic = tmp_path / "basic"
    basic.write_text("alertmanager:pa55\n")
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "remediator.cli", f"--listen=127.0.0.1:{port}",
         f"--cluster-snapshot={SNAPSHOT}", f"--basic-auth-file={basic}", f"--tls-cert-file={cert}",
         f"--tls-key-file={key}", "--paused"],
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    context = ssl.create_default_context(cafile=str(cert))
    try:
        _wait_ready(port, context, proc=proc)
        assert _get(port, "/state", context=context)[0] == 401
        status, body = _get(port, "/state", context=context, auth="Basic YWxlcnRtYW5hZ2VyOnBhNTU=")
        assert status == 200  # alertmanager:pa55
        state = json.loads(body)
        assert state["paused"] is True
        assert state["pause_reason"] == "started with --paused"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0
    assert f"listening on 127.0.0.1:{port} (https)" in err


def test_the_operators_command_explains_and_pauses_and_resumes_the_running_remediator(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        fleet_cli.main(
            ["explain", "--alerts", str(PAYLOADS / "gpu-fatal-xid.json"), "--cluster-snapshot", str(SNAPSHOT)]
        )
        == 0
    )
    assert "rule 'drain' (rules[0]) matched" in capsys.readouterr().out
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "remediator.cli", f"--listen=127.0.0.1:{port}",
         f"--cluster-snapshot={SNAPSHOT}", f"--token-file={token}"],
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(port, proc=proc)
        switch = ["--remediator", url, "--token-file", str(token)]
        assert fleet_cli.main(["pause", *switch, "--reason", "rack r2 maintenance"]) == 0
        assert capsys.readouterr().out == "remediator paused\n"
        state = json.loads(_get(port, "/state", auth="Bearer s3cret")[1])
        assert (state["paused"], state["pause_reason"]) == (True, "rack r2 maintenance")
        assert fleet_cli.main(["resume", *switch]) == 0
        assert capsys.readouterr().out == "remediator acting\n"
        assert fleet_cli.main(["resume", *switch]) == 0
        assert capsys.readouterr().out == "remediator acting (it was already)\n"
        assert fleet_cli.main(["pause", "--remediator", url]) == 1  # no token: refused, said so
        assert "answered 401" in capsys.readouterr().err
    finally:
        proc.terminate()
        proc.communicate(timeout=30)
