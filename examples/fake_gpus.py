"""The demo's gpu-node-1 exporter on simulated GPUs: the real exporter, with NVML and CUDA faked.

    python -m examples.fake_gpus [--fake-slow-pcie GPU=GBPS] [--fake-busy GPU] EXPORTER-ARGS...

Runs ``accel-health-exporter`` (``exporter.cli.main``) with the stand-ins the tests use in place of the
``pynvml`` module (``tests/exporter/fake_nvml.py``, the ``h100x8`` snapshot: eight H100s whose bus ids
match ``examples/nodes/gpu-node-1``) and of ``cuda.bindings.driver`` (``tests/checks/fake_cuda.py``:
copies at PCIe Gen5 x16 and HBM3 rates on a simulated GPU clock). Everything else is the production
code: the NVML collector, the checks, the runner, ``GET /checks``.

``--fake-slow-pcie 2=5.3`` makes GPU 2 move 5.3 GB/s over PCIe in both directions (a link trained
down); ``--fake-busy 6`` puts a process on GPU 6, so invasive checks leave it alone. Both repeat. Needs
the repository root on ``sys.path`` (the fakes live in the tests package) and ``cuda-bindings``
installed (for its ``CUresult`` enum; no driver needed).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from exporter import cli
from tests.checks.fake_cuda import FakeCuda, h100x8
from tests.exporter.fake_nvml import FakeNvml

GB = 1e9


def _slow(text: str) -> tuple[int, float]:
    gpu, sep, rate = text.partition("=")
    try:
        index, gbps = int(gpu), float(rate)
    except ValueError:
        index, gbps = -1, 0.0
    if not sep or not 0 <= index < 8 or not gbps > 0:
        raise argparse.ArgumentTypeError(f"expected GPU=GBPS with GPU 0..7, got {text!r}")
    return index, gbps


def _gpu(text: str) -> int:
    if not text.isdigit() or not 0 <= int(text) < 8:
        raise argparse.ArgumentTypeError(f"expected a GPU index 0..7, got {text!r}")
    return int(text)


def parse(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """This module's own options, and the exporter's arguments (everything else)."""
    parser = argparse.ArgumentParser(prog="python -m examples.fake_gpus", description=__doc__)
    parser.add_argument("--fake-slow-pcie", type=_slow, action="append", default=[], metavar="GPU=GBPS")
    parser.add_argument("--fake-busy", type=_gpu, action="append", default=[], metavar="GPU")
    return parser.parse_known_args(list(argv))


def main(argv: Sequence[str] | None = None) -> int:
    options, exporter_args = parse(sys.argv[1:] if argv is None else argv)
    degraded = {
        str(index): {"host_to_device": gbps * GB, "device_to_host": gbps * GB}
        for index, gbps in options.fake_slow_pcie
    }
    cuda = FakeCuda(h100x8(**degraded))
    nvml = FakeNvml.from_fixture("h100x8")
    for index in options.fake_busy:
        nvml.gpus[index]["processes"] = [4242 + index]
    return cli.main(exporter_args, nvml_library=nvml, cuda_library=cuda)


if __name__ == "__main__":
    sys.exit(main())
