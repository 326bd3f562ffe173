"""Building blocks for the active-check tests: a runner on fake NVML and fake CUDA, a fake dcgmi."""

from __future__ import annotations

import stat
from pathlib import Path
from typing import Any

from exporter.checks.catalog import build_checks
from exporter.checks.cuda import CudaBindingsDriver
from exporter.checks.runner import CheckRunner
from exporter.checks.usage import NvmlProcesses, UsageProbe
from exporter.readers.nvml import PynvmlReader
from tests.checks.fake_cuda import FakeCuda, FakeGpu, h100x8
from tests.exporter.fake_nvml import FakeNvml

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "checks"


def fake_dcgmi(directory: Path, fixture: str, *, status: int = 0, sleep: float = 0.0) -> Path:
    """An executable ``dcgmi`` that prints a fixture and exits ``status``; it logs its arguments."""
    script = directory / "dcgmi"
    log = directory / "dcgmi.args"
    script.write_text(
        "#!/bin/sh\n"
        f'echo "$@" >> {log}\n' + (f"sleep {sleep}\n" if sleep else "") + f"cat {FIXTURES / fixture}\n"
        f"exit {status}\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


def make_runner(
    *,
    gpus: list[FakeGpu] | None = None,
    nvml: FakeNvml | None = None,
    names: tuple[str, ...] = ("pciebw", "gpumem", "remapped", "power"),
    dcgmi: str = "dcgmi-not-installed",
    usage: list[UsageProbe] | None = None,
    deadlines: dict[str, float] | None = None,
) -> tuple[CheckRunner, FakeCuda, FakeNvml]:
    cuda = FakeCuda(gpus if gpus is not None else h100x8())
    fake_nvml = nvml or FakeNvml.from_fixture("h100x8")
    reader = PynvmlReader(library=fake_nvml, timeout=5.0)
    checks = build_checks(names, nvml=reader, cuda=CudaBindingsDriver(library=cuda), dcgmi=dcgmi)
    probes: list[UsageProbe] = [NvmlProcesses(library=fake_nvml)] if usage is None else usage
    return CheckRunner(checks, nvml=reader, usage=probes, deadlines=deadlines), cuda, fake_nvml


def values(result: Any, quantity: str) -> dict[str, float]:
    return {d.device: d.values[quantity] for d in result.devices if quantity in d.values}
