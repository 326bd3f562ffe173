"""What one NVML read costs through pynvml's real wrappers, on a stub driver.

The exporter's fake NVML (tests/exporter/fake_nvml.py) is Python: its calls never release the GIL.
pynvml's calls go through ctypes, which releases the GIL around every C call, so worker threads reading
GPUs side by side hand the GIL to one another on every call. The reader therefore has one worker read
the GPUs one after another, and brings in more only before NVML's 20 ms throughput sampling or when
a GPU does not answer. This benchmark measures what that costs and saves: it builds
tests/exporter/nvml_stub.c, a libnvidia-ml.so.1 that does nothing and is shaped like a node of H100s,
and has the exporter's reader load it as it loads the real library (``pynvml`` with
``LD_LIBRARY_PATH``), in a child process per case.

Cases: the stub answering at once; the stub spending 10 µs of CPU per call, standing in for driver
time; and nvmlDeviceGetPcieThroughput sleeping 20 ms as the real one samples. Each is run with 8 GPUs
and with 1 GPU; eight times the 1-GPU read is what reading the GPUs strictly one after another would
cost. Prints median wall and CPU time per read. No target: the figures inform the threading design.
Needs a C compiler (``cc``); without one it says so and exits.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python bench/bench_nvml_threads.py`: the stub lives in the tests
    sys.path.insert(0, str(ROOT))
from tests.exporter import stub_driver  # noqa: E402 -- needs the path set up just above

CHILD = """
import json, statistics, sys, time
from exporter.readers.nvml import PynvmlReader
reader = PynvmlReader(timeout=10.0)
snapshot = reader.read()
assert snapshot.available and not snapshot.field_errors, snapshot
assert all(gpu.status == "ok" and len(gpu.nvlinks) == 18 for gpu in snapshot.gpus), snapshot
walls, cpus = [], []
for _ in range(int(sys.argv[1])):
    cpu, wall = time.process_time(), time.perf_counter()
    reader.read()
    walls.append(time.perf_counter() - wall)
    cpus.append(time.process_time() - cpu)
reader.close()
print(json.dumps({"wall": statistics.median(walls) * 1e3, "cpu": statistics.median(cpus) * 1e3}))
"""

CASES = (
    ("stub answers at once", 0, 0, 60),
    ("10 µs of CPU per call", 10_000, 0, 30),
    ("PCIe throughput sampled for 20 ms", 0, 20_000_000, 8),
)


def read_cost(library: Path, *, gpus: int, call_ns: int, sample_ns: int, reads: int) -> dict[str, float]:
    env = stub_driver.environment(library, gpus=gpus, call_ns=call_ns, sample_ns=sample_ns)
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(reads)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    with tempfile.TemporaryDirectory() as directory:
        library = stub_driver.build(Path(directory))
        if library is None:
            print("nvml threads: skipped, no C compiler to build tests/exporter/nvml_stub.c")
            return
        for name, call_ns, sample_ns, reads in CASES:
            eight = read_cost(library, gpus=8, call_ns=call_ns, sample_ns=sample_ns, reads=reads)
            one = read_cost(library, gpus=1, call_ns=call_ns, sample_ns=sample_ns, reads=reads)
            print(
                f"nvml read through pynvml, stub driver, {name}: 8 GPUs "
                f"{eight['wall']:.1f} ms wall, {eight['cpu']:.1f} ms CPU; 1 GPU {one['wall']:.2f} ms wall, "
                f"{one['cpu']:.2f} ms CPU (x8 = {8 * one['wall']:.1f} ms, one after another)"
            )


if __name__ == "__main__":
    main()
