"""Active checks: what one run costs the exporter (fake CUDA and NVML, so the hardware's own time is
left out), and what it costs a GPU that is in use: nothing, because it does not run there.

Prints, per check, the median wall time of a run on an idle 8-GPU node (``dcgm`` through a ``dcgmi``
that prints a recorded DCGM 3.x answer), then, with a process on GPU 3, what a pciebw, gpumem and dcgm
run did to GPU 3: the CUDA contexts made current on it and whether dcgmi was given it. Last, a ping
run to three peers and an iperf run to one over the loopback interface (real ping and iperf3, where
installed), as the network checks' own cost.
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python bench/bench_checks.py`: the fakes live in the tests package
    sys.path.insert(0, str(ROOT))
from exporter.checks.base import CheckRequest  # noqa: E402
from exporter.checks.network import IperfCheck, IperfServer, PingCheck  # noqa: E402
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


def _loopback_pods(peers: int) -> list[Mapping[str, Any]]:
    """Exporter pods whose secondary network is the loopback interface (addresses 127.0.0.N)."""
    return [
        {
            "metadata": {
                "annotations": {
                    "k8s.v1.cni.cncf.io/network-status": json.dumps(
                        [{"name": "bench/lo", "interface": "lo", "ips": [f"127.0.0.{n + 1}"]}]
                    )
                }
            },
            "spec": {"nodeName": f"node-{n}"},
        }
        for n in range(peers + 1)
    ]


def network() -> None:
    if shutil.which("ping") is None:
        print("ping: not installed, not measured")
        return
    pods = _loopback_pods(3)
    began = time.perf_counter()
    result = PingCheck(lambda: pods, node="node-0").run(CheckRequest(params={"count": "3"}))
    took = time.perf_counter() - began
    print(f"  ping      {took * 1000:7.2f} ms  ({result.verdict}; 3 peers, 3 pings each, 0.2 s apart)")
    if shutil.which("iperf3") is None:
        print("  iperf: iperf3 not installed, not measured")
        return
    server = IperfServer(port=15299)
    server.start()
    try:
        time.sleep(0.5)
        check = IperfCheck(lambda: pods[:2], node="node-0", port=15299)
        began = time.perf_counter()
        result = check.run(CheckRequest(params={"seconds": "1"}))
        took = time.perf_counter() - began
    finally:
        server.stop()
    rate = result.devices[0].values.get("bytes_per_second", 0.0) * 8 / 1e9 if result.devices else 0.0
    what = f"{result.verdict}; 1 peer for 1 s: {rate:.1f} Gbit/s on loopback"
    print(f"  iperf     {took * 1000:7.2f} ms  ({what})")


if __name__ == "__main__":
    main()
    print("network checks over the loopback interface:")
    network()
