"""The checks' series as Prometheus scrapes them, diffed with a golden exposition.

tests/fixtures/golden/checks.prom is the contract alerts/active-checks.yaml and the dashboards rely
on: every family after one run of each check on the demo's simulated node (GPU 2's PCIe link slow,
GPU 6 busy, DCGM 4.x failing a memory test) and a ping and an iperf run over two peers. Times are
fixed by the clock given to the runner; durations are set to 0. Regenerate on purpose, and review,
with ``ACCEL_HEALTH_UPDATE_GOLDEN=1``; ``promtool check metrics`` checks it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from exporter.checks.base import CheckRequest, CheckResult, DeviceResult, Verdict
from exporter.checks.catalog import build_checks
from exporter.checks.cuda import CudaBindingsDriver
from exporter.checks.metrics import check_metrics
from exporter.checks.runner import CheckRunner
from exporter.checks.usage import NvmlProcesses
from exporter.collectors.framework import Source
from exporter.exposition import generate_text
from exporter.readers.nvml import PynvmlReader
from exporter.sources import build_registry
from tests.checks.fake_cuda import FakeCuda, h100x8
from tests.checks.helpers import fake_dcgmi
from tests.exporter.fake_nvml import FakeNvml

GOLDEN = Path(__file__).resolve().parents[1] / "fixtures" / "golden" / "checks.prom"
UPDATE = os.environ.get("ACCEL_HEALTH_UPDATE_GOLDEN") == "1"
_DURATION = re.compile(r"^(accel_check_duration_seconds\{[^}]*\}) .*$", re.MULTILINE)
_STARTED = re.compile(r"^(accel_check_last_run_timestamp_seconds\{[^}]*\}) .*$", re.MULTILINE)


class _Recorded:
    """A network check that answers a fixed result (its real runs are in test_network.py)."""

    invasive = False

    def __init__(self, name: str, devices: Sequence[DeviceResult]) -> None:
        self.name = name
        self._devices = tuple(devices)

    def validate(self, params: Mapping[str, str]) -> None:
        del params

    def run(self, request: CheckRequest) -> CheckResult:
        del request
        verdict: Verdict = "fail" if any(d.verdict == "fail" for d in self._devices) else "pass"
        return CheckResult(self.name, verdict, 1_795_000_000.0, 2.0, self._devices)


def exposition(tmp_path: Path) -> str:
    nvml = FakeNvml.from_fixture("h100x8")
    nvml.gpus[6]["processes"] = [4248]
    dcgmi = str(fake_dcgmi(tmp_path, "dcgm4-r2-fail.json", status=226))
    cuda = FakeCuda(h100x8(**{"2": {"host_to_device": 5.3e9, "device_to_host": 5.3e9}}))
    reader = PynvmlReader(library=nvml, timeout=5.0)
    gpu_checks = build_checks(
        ("pciebw", "gpumem", "remapped", "power", "dcgm"),
        nvml=reader,
        cuda=CudaBindingsDriver(library=cuda),
        dcgmi=dcgmi,
    )
    network: list[Any] = [
        _Recorded(
            "ping",
            [
                DeviceResult("net1/gpu-node-2", "pass", {"reachable": 1.0, "rtt_seconds": 4.2e-5}),
                DeviceResult("net1/gpu-node-3", "fail", {"reachable": 0.0}, detail="unreachable"),
            ],
        ),
        _Recorded("iperf", [DeviceResult("net1/gpu-node-2", "pass", {"bytes_per_second": 1.17e10})]),
    ]
    combined = CheckRunner([*gpu_checks, *network], nvml=reader, usage=[NvmlProcesses(library=nvml)])
    for name in ("pciebw", "gpumem", "remapped", "power", "dcgm", "ping", "iperf"):
        combined.run(name)
    intervals = {
        name: 86400.0 if name in ("pciebw", "gpumem", "dcgm", "iperf") else 3600.0 for name in combined.checks
    }
    source = Source(
        "checks",
        lambda: check_metrics(combined.latest(), combined.runs(), combined.skipped_gpus(), intervals),
    )
    text = generate_text(build_registry([source])).decode()
    text = _DURATION.sub(r"\1 0.0", _STARTED.sub(r"\1 1.795e+09", text))
    lines = [
        line
        for line in text.splitlines()
        if line.startswith(("# HELP accel_check", "# TYPE accel_check", "accel_check"))
    ]
    return "\n".join(lines) + "\n"


def test_the_checks_exposition_matches_the_golden_file(tmp_path: Path) -> None:
    text = exposition(tmp_path)
    if UPDATE:
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text()


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not on PATH")
def test_the_golden_checks_exposition_passes_promtool() -> None:
    promtool = shutil.which("promtool")
    assert promtool is not None
    checked = subprocess.run(
        [promtool, "check", "metrics"], input=GOLDEN.read_bytes(), capture_output=True, check=False
    )
    assert checked.returncode == 0, checked.stdout.decode() + checked.stderr.decode()
