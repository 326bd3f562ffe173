"""What a real GPU answered, recorded: the active checks on one NVIDIA H200 (driver 580.159.04, PCIe
Gen5 x16), asked through the exporter's GET /checks by scripts/gpu-node-check.sh on 2026-11-28
(tests/fixtures/gpu/h200/: the answer and the machine). The fake CUDA and NVML of the suite stand in
for this; here the real answer's shape is held to what the repair loop and `accel-health check` read,
and its figures to what a healthy H200 gives (55 GB/s each way over PCIe, 4.2 TB/s of HBM3e)."""

from __future__ import annotations

import io
import json
from pathlib import Path

from exporter.checks.base import CheckResult, worst
from exporter.checks.fanout import NodeAnswer, render

RECORDED = Path(__file__).resolve().parents[1] / "fixtures" / "gpu" / "h200"


def answer() -> NodeAnswer:
    body = json.loads((RECORDED / "checks.json").read_text())
    results = tuple(CheckResult.from_json(r) for r in body["results"])
    return NodeAnswer("h200", worst([r.verdict for r in results]), results)


def test_the_h200s_answer_reads_as_the_repair_loop_reads_it_and_passes() -> None:
    got = answer()
    assert got.verdict == "pass"
    assert [r.check for r in got.results] == ["remapped", "power", "pciebw", "gpumem"]
    by_check = {r.check: r.devices[0].values for r in got.results}
    assert by_check["remapped"]["remapped_rows_uncorrectable"] == 0
    assert 50e9 < by_check["pciebw"]["host_to_device"] < 64e9  # PCIe Gen5 x16: 64 GB/s raw
    assert 50e9 < by_check["pciebw"]["device_to_host"] < 64e9
    assert 3.5e12 < by_check["gpumem"]["device_to_device"] < 4.8e12  # HBM3e: 4.8 TB/s peak


def test_the_operators_table_shows_the_h200s_figures() -> None:
    out = io.StringIO()
    render([answer()], out)
    table = out.getvalue()
    assert "h200  pciebw    h2d GB/s  PASS     55.1" in table
    assert "h200  gpumem    mem GB/s  PASS     4201.8" in table
    assert "1 node(s) checked, 0 failed" in table
