"""End to end: active checks on the demo's GPU node, from `accel-health check` to a remediation decision.

The demo's pipeline (examples/pipeline.py): gpu-node-1's real exporter on simulated NVML and CUDA
(examples/fake_gpus.py), real Prometheus with the rules in alerts/, real Alertmanager with
examples/alertmanager.yaml, the real remediator in dry-run. `accel-health check` runs as its own
process, as an operator would run it. A GPU whose PCIe link moves a tenth of its neighbours' rate must
fail the check, fire AccelCheckPCIeBandwidthBelowNodeMedian through Prometheus, and make the
remediator plan the policy's `taint` actions for the node.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from examples.pipeline import DEMO_GPUS, GPU_NODE, Pipeline, SimulatedGpus, scratch_dir

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        not (shutil.which("prometheus") and shutil.which("prometheus-alertmanager")),
        reason="needs Prometheus and Alertmanager (make test installs them)",
    ),
]

SLOW_GPU = 2
SLOW_GBPS = 5.3
"""The seed's own figure: 5.3 GB/s where the neighbours move ~54 (Gen5 x16 here, 12.3 there)."""


@dataclass
class Degraded:
    pipeline: Pipeline
    check: subprocess.CompletedProcess[str]
    firing: list[dict[str, str]]
    decisions: list[dict[str, Any]]
    pcie_series: list[dict[str, Any]]
    seconds_to_decision: float


def _table_rows(stdout: str) -> dict[str, list[str]]:
    """The table's GPU cells (GPU0..GPU7) by row: its quantity label (``h2d GB/s`` ...) or check name."""
    lines = stdout.splitlines()
    header = next(line for line in lines if line.startswith("NODE"))
    starts = [header.index(f"GPU{i}") for i in range(8)]
    rows: dict[str, list[str]] = {}
    for line in lines[lines.index(header) + 1 :]:
        label = next((q for q in ("h2d GB/s", "d2h GB/s", "mem GB/s") if q in line), None)
        label = label or next((c for c in ("remapped", "power") if f" {c} " in line), None)
        if label is not None:
            rows[label] = [line[start:].split(maxsplit=1)[0] for start in starts]
    return rows


@pytest.fixture(scope="module")
def healthy() -> Iterator[tuple[Pipeline, subprocess.CompletedProcess[str]]]:
    with scratch_dir() as workdir:
        pipeline = Pipeline(workdir=workdir, gpus=DEMO_GPUS)
        try:
            pipeline.start()
            yield pipeline, pipeline.run_checks()
        finally:
            pipeline.stop()


@pytest.fixture(scope="module")
def degraded() -> Iterator[Degraded]:
    with scratch_dir() as workdir:
        pipeline = Pipeline(
            workdir=workdir, gpus=SimulatedGpus(slow_pcie={SLOW_GPU: SLOW_GBPS}, busy=DEMO_GPUS.busy)
        )
        try:
            pipeline.start()
            began = time.monotonic()
            check = pipeline.run_checks("--check", "pciebw")
            pipeline.wait_until(
                "the remediator to decide on the PCIe alert",
                lambda: any(
                    d.get("alertname") == "AccelCheckPCIeBandwidthBelowNodeMedian"
                    and d.get("action") == "taint"
                    for d in pipeline.decisions()
                ),
                timeout=90.0,
            )
            seconds = time.monotonic() - began
            yield Degraded(
                pipeline,
                check,
                pipeline.firing_alerts(),
                pipeline.decisions(),
                pipeline.query("accel_check_pcie_bandwidth_bytes_per_second"),
                seconds,
            )
        finally:
            pipeline.stop()


def test_accel_health_check_prints_every_gpu_of_the_demo_node_and_exits_zero(
    healthy: tuple[Pipeline, subprocess.CompletedProcess[str]],
) -> None:
    _, check = healthy
    assert check.returncode == 0, check.stdout + check.stderr
    assert "GPU7" in check.stdout
    rows = _table_rows(check.stdout)
    busy = DEMO_GPUS.busy[0]
    for label in ("h2d GB/s", "d2h GB/s"):
        cells = rows[label]
        assert cells[busy] == "busy"
        measured = [float(cell) for i, cell in enumerate(cells[:8]) if i != busy]
        assert all(50 < value < 60 for value in measured), cells
    assert rows["remapped"] == ["ok"] * 8
    assert "1 node(s) checked, 0 failed" in check.stdout


def test_a_busy_gpu_gets_no_measurement_and_the_healthy_node_fires_nothing(
    healthy: tuple[Pipeline, subprocess.CompletedProcess[str]],
) -> None:
    pipeline, _ = healthy
    pipeline.wait_until(
        "Prometheus to scrape the check's series",
        lambda: len(pipeline.query("accel_check_pcie_bandwidth_bytes_per_second")) == 14,
        timeout=20.0,
    )
    gpus = {s["metric"]["gpu"] for s in pipeline.query("accel_check_pcie_bandwidth_bytes_per_second")}
    assert gpus == {str(i) for i in range(8)} - {str(DEMO_GPUS.busy[0])}
    skipped = pipeline.query('accel_check_gpus_skipped{check="pciebw"}')
    assert [float(s["value"][1]) for s in skipped] == [1.0]
    time.sleep(3)  # a few evaluation rounds (1 s in the demo)
    assert [a for a in pipeline.firing_alerts() if a["alertname"].startswith("AccelCheck")] == []


def test_the_slow_gpu_fails_the_check_and_the_cli_exits_one(degraded: Degraded) -> None:
    assert degraded.check.returncode == 1, degraded.check.stdout + degraded.check.stderr
    rows = _table_rows(degraded.check.stdout)
    assert rows["h2d GB/s"][SLOW_GPU] == f"{SLOW_GBPS}!"
    assert rows["d2h GB/s"][SLOW_GPU] == f"{SLOW_GBPS}!"
    assert f"1 node(s) checked, 1 failed: {GPU_NODE} (pciebw)" in degraded.check.stdout


def test_the_slow_gpu_fires_the_pcie_alert_for_that_gpu_only(degraded: Degraded) -> None:
    pcie = [a for a in degraded.firing if a["alertname"].startswith("AccelCheckPCIe")]
    assert sorted((a["alertname"], a["gpu"], a["direction"]) for a in pcie) == [
        ("AccelCheckPCIeBandwidthBelowNodeMedian", str(SLOW_GPU), "device_to_host"),
        ("AccelCheckPCIeBandwidthBelowNodeMedian", str(SLOW_GPU), "host_to_device"),
    ]
    assert {a["node"] for a in pcie} == {GPU_NODE}
    assert {a["pci_bus_id"] for a in pcie} == {"0000:52:00"}
    assert {a["remediation"] for a in pcie} == {"taint"}


def test_the_remediator_plans_the_taint_policy_for_the_node_in_dry_run(degraded: Degraded) -> None:
    records = [d for d in degraded.decisions if d["alertname"] == "AccelCheckPCIeBandwidthBelowNodeMedian"]
    assert {r["node"] for r in records} == {GPU_NODE}
    assert {r["action"] for r in records} == {"condition", "taint"}
    assert all(r["dry_run"] for r in records)
    assert {r["outcome"] for r in records} == {"planned"}


def test_the_measured_rates_reach_prometheus_with_the_slow_one_among_them(degraded: Degraded) -> None:
    by_gpu = {
        (s["metric"]["gpu"], s["metric"]["direction"]): float(s["value"][1]) for s in degraded.pcie_series
    }
    assert by_gpu[(str(SLOW_GPU), "host_to_device")] == pytest.approx(SLOW_GBPS * 1e9)
    assert by_gpu[("0", "host_to_device")] == pytest.approx(53.5e9)
    assert (str(DEMO_GPUS.busy[0]), "host_to_device") not in by_gpu
    # Alertmanager holds a warning's first notification for the route's 30 s group_wait.
    assert degraded.seconds_to_decision < 60
