"""End to end: a fault written to a kernel log reaches a dry-run remediation decision.

Real exporter processes, real Prometheus with the rules in alerts/, real Alertmanager with
examples/alertmanager.yaml, and the real remediator (dry-run, cluster snapshot) — the same pipeline
`make demo` runs. Any broken link (exporter parsing, a rule, a route, the webhook, the policy) makes
these tests fail.

The main run (the ``run`` fixture and the tests reading it) runs on both Prometheus releases
`make test` covers: the ``prometheus`` on PATH (Debian bookworm's 2.42) and 2.53, the LTS most fleets
run (scripts/install-prometheus-lts.sh, pinned; skipped where it is not installed). The other tests,
which start the demo or a broken pipeline of their own, run on PATH's only: one more run of each would
add a minute to the suite and cover nothing the main run does not.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from examples.pipeline import (
    DEMO_FAULTS,
    Outcome,
    Pipeline,
    PipelineError,
    http_get,
    observe,
    port_is_free,
    scratch_dir,
)

REPO = Path(__file__).resolve().parent.parent
LTS_INSTALLER = REPO / "scripts" / "install-prometheus-lts.sh"

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        not (shutil.which("prometheus") and shutil.which("prometheus-alertmanager")),
        reason="needs Prometheus and Alertmanager (make test installs them)",
    ),
]


def prometheus_lts_bin() -> Path | None:
    """The folder of Prometheus 2.53 (prometheus, promtool) that `make tools` installs; None where it
    is not installed (the script's ``--installed`` mode installs nothing)."""
    bash = shutil.which("bash") or "/bin/bash"
    result = subprocess.run(
        [bash, str(LTS_INSTALLER), "--installed"], capture_output=True, text=True, check=False, timeout=60
    )
    return Path(result.stdout.strip()) if result.returncode == 0 else None


ON_PATH = "PATH"
PROMETHEUS_RELEASES = (ON_PATH, "2.53")
"""The Prometheus releases the main run covers: the one on PATH (Debian bookworm's 2.42) and the LTS."""


def prometheus_binary(release: str) -> str:
    """The ``prometheus`` to run for ``release``; skips the test where that release is missing."""
    if release == ON_PATH:
        return "prometheus"
    bindir = prometheus_lts_bin()
    if bindir is None:
        pytest.skip(
            f"Prometheus {release} is not installed "
            "(make tools installs it: scripts/install-prometheus-lts.sh)"
        )
    return str(bindir / "prometheus")


class Run:
    def __init__(
        self,
        pipeline: Pipeline,
        outcome: Outcome,
        stop_problems: list[str],
        *,
        release: str,
        version: str,
    ) -> None:
        self.pipeline = pipeline
        self.outcome = outcome
        self.stop_problems = stop_problems
        self.release = release
        """The release asked for (``PROMETHEUS_RELEASES``)."""
        self.version = version
        """The version the running Prometheus reported (its /api/v1/status/buildinfo)."""

    def decisions_for(self, node: str) -> list[dict[str, Any]]:
        return [d for d in self.outcome.decisions if d.get("node") == node]


@pytest.fixture(scope="module", params=PROMETHEUS_RELEASES, ids=lambda r: f"prometheus-{r}")
def run(request: pytest.FixtureRequest) -> Run:
    release: str = request.param
    with scratch_dir() as workdir:
        pipeline = Pipeline(workdir=workdir, prometheus=prometheus_binary(release))
        try:
            pipeline.start()
            outcome = observe(pipeline, timeout=45.0)
            buildinfo = json.loads(
                http_get(f"http://127.0.0.1:{pipeline.prometheus_port}/api/v1/status/buildinfo")
            )
        finally:
            problems = pipeline.stop()
    return Run(pipeline, outcome, problems, release=release, version=buildinfo["data"]["version"])


def test_the_run_is_on_the_prometheus_release_it_names(run: Run) -> None:
    if run.release == ON_PATH:
        reported = subprocess.run(
            [str(shutil.which("prometheus")), "--version"],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        )
        assert f"version {run.version} " in reported.stdout + reported.stderr
    else:
        assert run.version.startswith(f"{run.release}."), run.version


def demo_env(tmp_path: Path) -> tuple[dict[str, str], str]:
    """An environment for one demo run: its own TMPDIR and a marker every child process inherits."""
    marker = f"accel-health-test-{uuid.uuid4()}"
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    return {**os.environ, "TMPDIR": str(tmpdir), "ACCEL_HEALTH_TEST_RUN": marker}, marker


def processes_of(marker: str) -> list[int]:
    """Live processes started under ``marker`` (the demo and everything it spawned, orphans too)."""
    needle = f"ACCEL_HEALTH_TEST_RUN={marker}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in environ.split(b"\0") and state != "Z":
            pids.append(int(entry.name))
    return pids


def _cmdline(pid: int) -> str:
    try:
        raw = (Path("/proc") / str(pid) / "cmdline").read_bytes()
    except OSError:
        return "(gone)"
    return raw.replace(b"\0", b" ").decode(errors="replace")


def test_the_fatal_xid_fires_its_alert_with_the_gpu_labels(run: Run) -> None:
    fatal = [a for a in run.outcome.firing if a["alertname"] == "AccelGPUFatalXid"]
    assert len(fatal) == 1
    assert fatal[0]["node"] == "gpu-node-1"
    assert fatal[0]["pci_bus_id"] == "0000:9d:00"
    assert fatal[0]["gpu"] == "4"
    assert fatal[0]["xid"] == "79"
    assert fatal[0]["severity"] == "critical"
    assert fatal[0]["remediation"] == "drain"


def test_the_neuron_error_fires_its_alert_on_the_trainium_node(run: Run) -> None:
    neuron = [a for a in run.outcome.firing if a["alertname"] == "AccelNeuronHardwareError"]
    assert [(a["node"], a["neuron_device"], a["error"]) for a in neuron] == [("trn-node-1", "0", "DMA_ERROR")]
    assert neuron[0]["remediation"] == "replace"


def test_the_application_xid_is_counted_but_raises_nothing(run: Run) -> None:
    xid13 = next(f for f in DEMO_FAULTS if "Xid 13" in f.title)
    assert any(e.kind == "series visible" and xid13.query in e.text for e in run.outcome.events)
    assert [a for a in run.outcome.firing if a.get("xid") == "13"] == []
    assert [a for a in run.outcome.firing if a["alertname"] == "AccelGPUApplicationXidRepeated"] == []
    assert set(run.outcome.webhook_alerts) <= {"AccelGPUFatalXid", "AccelNeuronHardwareError"}


def test_the_gpu_node_is_cordoned_and_drained_in_dry_run(run: Run) -> None:
    records = run.decisions_for("gpu-node-1")
    actions = [r["action"] for r in records]
    assert "cordon" in actions
    assert "drain" in actions
    assert actions.index("cordon") < actions.index("drain")
    assert all(r["dry_run"] is True for r in records)
    assert all(r["alertname"] == "AccelGPUFatalXid" for r in records)
    drain = next(r for r in records if r["action"] == "drain")
    evicted = {f"{p['namespace']}/{p['name']}" for p in drain["details"]["evict"]}
    assert "ml-team/llama-pretrain-worker-0" in evicted
    skipped = {f"{p['namespace']}/{p['name']}": p["reason"] for p in drain["details"]["skip"]}
    daemonset_pods = [name for name in skipped if name.startswith("accel-health/accel-health-exporter")]
    assert daemonset_pods, skipped
    assert "DaemonSet" in skipped[daemonset_pods[0]]
    # Nothing may be evicted that kubectl drain would leave alone.
    assert not evicted & set(skipped)


def test_the_trainium_node_is_marked_for_replacement_in_dry_run(run: Run) -> None:
    records = run.decisions_for("trn-node-1")
    actions = [r["action"] for r in records]
    assert "aws_set_unhealthy" in actions
    assert "drain" in actions
    assert actions.index("drain") < actions.index("aws_set_unhealthy")
    assert all(r["dry_run"] is True for r in records)


def test_no_node_without_a_fault_is_touched(run: Run) -> None:
    assert {r["node"] for r in run.outcome.decisions} == {"gpu-node-1", "trn-node-1"}


def test_the_timeline_shows_each_stage_in_order(run: Run) -> None:
    kinds = [e.kind for e in run.outcome.events]
    stages = ["fault written", "series visible", "alert firing", "webhook received", "decision"]
    firsts = [kinds.index(stage) for stage in stages]
    assert firsts == sorted(firsts)
    times = {stage: next(e.at for e in run.outcome.events if e.kind == stage) for stage in stages}
    assert times["fault written"] <= times["series visible"] <= times["alert firing"]
    assert times["alert firing"] <= times["webhook received"] + 1.0  # clocks of two processes
    assert run.outcome.detection_seconds < 30.0


def test_every_process_stops_and_every_port_is_released(run: Run) -> None:
    assert run.stop_problems == []
    for proc in run.pipeline.processes:
        assert proc.popen.returncode is not None, proc.name
        for port in proc.ports:
            assert port_is_free(port), (proc.name, port)


def test_make_demo_prints_the_timeline_and_the_dry_run_decision(tmp_path: Path) -> None:
    env, marker = demo_env(tmp_path)
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "examples.demo"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    elapsed = time.monotonic() - started
    assert result.returncode == 0, result.stdout + result.stderr
    assert elapsed < 90.0
    out = result.stdout
    for stage in ("fault written", "series visible", "alert firing", "webhook received", "decision"):
        assert stage in out
    assert "DRY RUN" in out
    assert "gpu-node-1" in out
    assert "trn-node-1" in out
    assert "ml-team/llama-pretrain-worker-0" in out
    assert "DaemonSet" in out
    assert "Xid 13" in out
    assert "no alert fired" in out
    # The closed loop shows gpu-node-1's evidence report, captured before the reboot.
    report = out.index("Evidence for node gpu-node-1")
    assert report < out.index("reboot    (in the snapshot)")
    evidence = out[report : out.index("reboot    (in the snapshot)")]
    assert "NVRM: Xid (PCI:0000:9d:00): 79, pid='<unknown>'" in evidence
    assert "1654923000004  GPU-575a9c5f-780e-558f-99bc-3b0f90f7dbd5" in evidence
    assert processes_of(marker) == []
    assert list((tmp_path / "tmp").iterdir()) == []


def test_ctrl_c_during_the_demo_stops_every_part(tmp_path: Path) -> None:
    env, marker = demo_env(tmp_path)
    demo = subprocess.Popen(
        [sys.executable, "-m", "examples.demo"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert demo.stdout is not None
    deadline = time.monotonic() + 60
    seen = ""
    while time.monotonic() < deadline:
        line = demo.stdout.readline()
        seen += line
        if "Prometheus is scraping" in line or not line:
            break
    assert "Prometheus is scraping" in seen, seen
    assert len(processes_of(marker)) >= 6, "the demo and its five parts should be running now"
    demo.send_signal(signal.SIGINT)
    rest, _ = demo.communicate(timeout=30)
    assert demo.returncode == 130, seen + rest
    assert "interrupted" in rest
    # A part that got SIGKILL a moment ago may still be leaving the process table (seen once on a loaded
    # machine); one left behind after seconds is a leak, named by its command line.
    deadline = time.monotonic() + 5.0
    while processes_of(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert {pid: _cmdline(pid) for pid in processes_of(marker)} == {}
    assert list((tmp_path / "tmp").iterdir()) == []


def test_a_broken_route_makes_the_pipeline_fail(tmp_path: Path) -> None:
    """The observer is not fooled: with the route to the remediator broken, no decision arrives."""
    config = yaml.safe_load((REPO / "examples" / "alertmanager.yaml").read_text())
    for route in config["route"]["routes"]:
        route["matchers"] = [
            m.replace("remediation=~", "remediation_typo=~") for m in route.get("matchers", [])
        ]
    broken = tmp_path / "alertmanager.yaml"
    broken.write_text(yaml.safe_dump(config))
    with scratch_dir() as workdir:
        pipeline = Pipeline(workdir=workdir, alertmanager_config=broken)
        try:
            pipeline.start()
            with pytest.raises(PipelineError, match="expected decisions for"):
                observe(pipeline, timeout=15.0)
            # Every other link still worked: the series and the alerts were there.
            firing = {a["alertname"] for a in pipeline.firing_alerts()}
            assert {"AccelGPUFatalXid", "AccelNeuronHardwareError"} <= firing
            assert pipeline.decisions() == []
        finally:
            assert pipeline.stop() == []
