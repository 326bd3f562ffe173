"""Active checks: what one run costs the exporter (fake CUDA and NVML, so the hardware's own time is
left out), and what it costs a GPU that is in use: nothing, because it does not run there.

Prints, per check, the median wall time of a run on an idle 8-GPU node (``dcgm`` through a ``dcgmi``
that prints a recorded DCGM 3.x answer), then, with a process on GPU 3, what a pciebw, gpumem and dcgm
run did to GPU 3: the CUDA contexts made current on it and whether dcgmi was given it.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python bench/bench_checks.py`: the fakes live in the tests package
    sys.path.insert(0, str(ROOT))
from tests.checks.fake_cuda import h100x8  # noqa: E402 -- needs the path set up just above
from tests.checks.helpers import fake_dcgmi, make_runner  # noqa: E402
from tests.exporter.fake_nvml import FakeNvml  # noqa: E402

CHECKS = ("pciebw", "gpumem", "remapped", "power", "dcgm")
RUNS = 20


def main() -> None:
    with tempfile.TemporaryDirectory() as scratch:
        dcgmi = str(fake_dcgmi(Path(scratch), "dcgm3-r1-pass.txt"))
        runner, _, _ = make_runner(names=CHECKS, dcgmi=dcgmi)
        print(f"one run of each check on 8 idle GPUs (fake NVML/CUDA/dcgmi), median of {RUNS}:")
        for name in CHECKS:
            times = []
            for _ in range(RUNS):
                began = time.perf_counter()
                result = runner.run(name)
                times.append(time.perf_counter() - began)
            print(f"  {name:9s} {statistics.median(times) * 1000:7.2f} ms  ({result.verdict})")
        nvml = FakeNvml.from_fixture("h100x8")
        nvml.gpus[3]["processes"] = [4242]
        busy_runner, cuda, _ = make_runner(nvml=nvml, gpus=h100x8(), names=CHECKS, dcgmi=dcgmi)
        left_out = {name: busy_runner.run(name) for name in ("pciebw", "gpumem", "dcgm")}
        argv = (Path(scratch) / "dcgmi.args").read_text().splitlines()[-1]
        dcgm_gpus = argv.split("-i", 1)[1].split()[0].split(",") if "-i" in argv else ["all"]
    print("GPU 3 in use (a process on it), after a pciebw, a gpumem and a dcgm run:")
    touched = sorted(cuda.touched)
    print(f"  CUDA contexts made current on GPU 3: {int(3 in touched)} (GPUs measured: {touched})")
    given = "included" if "3" in dcgm_gpus else "left out"
    print(f"  dcgmi diag given GPUs {','.join(dcgm_gpus)}: GPU 3 {given}")
    for name, result in left_out.items():
        busy = [d.detail for d in result.devices if d.device == "3" and d.verdict == "skipped"]
        print(f"  {name}: GPU 3 reported skipped: {busy[0] if busy else 'NOT REPORTED'}")
    cost = int(3 in touched) + int("3" in dcgm_gpus)
    print(f"  cost to the GPU in use: {cost} CUDA contexts or diagnostics run on it (0: checks skip it)")


if __name__ == "__main__":
    main()
