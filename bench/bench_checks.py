"""Active checks: what one run costs the exporter (fake CUDA and NVML, so the hardware's own time is
left out), and what it costs a GPU that is in use: nothing, because it does not run there.

Prints, per check, the median wall time of a run on an idle 8-GPU node, and the CUDA calls and
allocations made on a GPU with a process on it during a pciebw and a gpumem run.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python bench/bench_checks.py`: the fakes live in the tests package
    sys.path.insert(0, str(ROOT))
from tests.checks.fake_cuda import h100x8  # noqa: E402 -- needs the path set up just above
from tests.checks.helpers import make_runner  # noqa: E402
from tests.exporter.fake_nvml import FakeNvml  # noqa: E402


def main() -> None:
    runner, _, _ = make_runner()
    for name in ("pciebw", "gpumem", "remapped", "power"):
        times = []
        for _ in range(20):
            began = time.perf_counter()
            runner.run(name)
            times.append(time.perf_counter() - began)
        print(f"{name:9s} run on 8 idle GPUs (fakes): median {statistics.median(times) * 1000:.2f} ms")
    nvml = FakeNvml.from_fixture("h100x8")
    nvml.gpus[3]["processes"] = [4242]
    busy_runner, cuda, _ = make_runner(nvml=nvml, gpus=h100x8())
    for name in ("pciebw", "gpumem"):
        busy_runner.run(name)
    print(
        f"GPU 3 in use: contexts made current on it: {int(3 in cuda.touched)}, "
        f"GPUs measured: {sorted(cuda.touched)}"
    )


if __name__ == "__main__":
    main()
