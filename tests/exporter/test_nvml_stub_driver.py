"""The NVML reader through the real pynvml, on a C stub of libnvidia-ml (nvml_stub.c beside this file).

The fake NVML stands in for pynvml; these tests keep pynvml itself and replace only the driver library,
so ctypes structures (field values, PCI info), pynvml's error mapping and a call that blocks in C with
the GIL released are what the reader meets on a GPU machine. Each read runs in a child process, which
loads the stub the way the exporter loads the real library (``LD_LIBRARY_PATH``). Skips without a C
compiler.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from exporter.readers.nvml import DEFAULT_PATIENCE
from tests.exporter import stub_driver

ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import json, os, sys, time
from exporter.readers.nvml import PynvmlReader
reader = PynvmlReader(timeout=float(sys.argv[1]), patience=float(sys.argv[3]))
reads = []
for _ in range(int(sys.argv[2])):
    started = time.monotonic()
    snapshot = reader.read()
    reads.append({
        "seconds": time.monotonic() - started,
        "available": snapshot.available,
        "gpu_count": snapshot.gpu_count,
        "field_errors": sorted("/".join(key) for key in snapshot.field_errors),
        "call_timeouts": dict(snapshot.call_timeouts),
        "gpus": [
            {
                "status": gpu.status,
                "pci_bus_id": gpu.pci_bus_id,
                "uuid": gpu.uuid,
                "model": gpu.model,
                "links": [list(link) for link in gpu.nvlinks],
                "pcie": None if gpu.pcie is None else [gpu.pcie.current_generation, gpu.pcie.max_width],
                "retired_pages": gpu.retired_pages is not None,
                "ecc": gpu.ecc and [gpu.ecc.volatile_corrected, gpu.ecc.aggregate_uncorrected],
                "power_watts": gpu.power_watts,
                "stuck_call": gpu.stuck_call,
            }
            for gpu in snapshot.gpus
        ],
    })
print(json.dumps(reads))
sys.stdout.flush()
os._exit(0)  # without waiting for a thread still blocked in the wedged call
"""


@pytest.fixture(scope="module")
def stub_library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = stub_driver.build(tmp_path_factory.mktemp("nvml-stub"))
    if directory is None:
        pytest.skip("no C compiler to build the stub libnvidia-ml")
    return directory


def read_through_stub(
    library: Path, *, timeout: float, reads: int, patience: float = DEFAULT_PATIENCE, **stub: str
) -> list[dict[str, Any]]:
    env = stub_driver.environment(library, **stub)
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(timeout), str(reads), str(patience)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    result: list[dict[str, Any]] = json.loads(done.stdout)
    return result


def test_the_reader_reads_eight_gpus_through_pynvml_and_a_c_library(stub_library: Path) -> None:
    (snapshot,) = read_through_stub(stub_library, timeout=5.0, reads=1, state_call_fails="1")
    assert snapshot["available"]
    assert snapshot["gpu_count"] == 8
    assert snapshot["field_errors"] == []  # every ctypes structure read as pynvml hands it over
    gpus = snapshot["gpus"]
    assert [gpu["status"] for gpu in gpus] == ["ok"] * 8
    assert [gpu["pci_bus_id"] for gpu in gpus[:2]] == ["0000:18:00", "0000:28:00"]
    assert gpus[5]["uuid"] == "GPU-00000000-0000-0000-0000-000000000005"
    assert gpus[5]["model"] == "NVIDIA H100 80GB HBM3"
    # link states from nvmlDeviceGetFieldValues (asked link by link, they would be errors): 18 links
    # up, indices past 17 not there
    assert [link[:2] for link in gpus[0]["links"]] == [[index, True] for index in range(18)]
    assert gpus[0]["links"][17][2:] == [0, 0, 0, 0]
    assert gpus[0]["pcie"] == [5, 16]
    assert gpus[0]["ecc"] == [0, 0]
    assert gpus[0]["retired_pages"] is False  # NOT_SUPPORTED through pynvml: omitted, not an error
    assert gpus[0]["power_watts"] == 500.0


def test_a_call_blocked_in_the_c_library_times_out_that_gpu_alone(stub_library: Path) -> None:
    first, second = read_through_stub(stub_library, timeout=1.0, reads=2, hang_gpu="3")
    assert first["seconds"] < 3.0  # the bound holds although the call never returns
    statuses = [gpu["status"] for gpu in first["gpus"]]
    assert statuses == ["ok"] * 3 + ["timeout"] + ["ok"] * 4
    assert first["gpus"][3]["stuck_call"] == "nvmlDeviceGetPowerUsage"
    assert first["call_timeouts"] == {"nvmlDeviceGetPowerUsage": 1}
    assert second["seconds"] < 0.5  # the wedged GPU is skipped, not waited for again
    assert [gpu["status"] for gpu in second["gpus"]][3] == "stuck"
    assert second["gpus"][2]["status"] == "ok"


def test_the_throughput_sampling_of_every_gpu_overlaps_through_pynvml(stub_library: Path) -> None:
    """The stub sleeps 50 ms in C per throughput call, the GIL released, as NVML samples: 0.8 s for 8 GPUs
    one after another. Before sampling, each GPU hands the GPUs left to another worker; the patience is
    long here, so only that hand-over can make the read short."""
    _probe, read = read_through_stub(stub_library, timeout=5.0, reads=2, patience=1.0, sample_ns="50000000")
    assert [gpu["status"] for gpu in read["gpus"]] == ["ok"] * 8
    assert read["seconds"] < 0.45, read["seconds"]
