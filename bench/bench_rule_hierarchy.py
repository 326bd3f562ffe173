"""What the day-long look-backs cost per evaluation, read raw and through the hourly maxima (issue 35).

`AccelInfinibandPortDown`, `AccelGPUNVLinkDown` and `AccelAcceleratorMissingFromPCIBus` ask "was it
up within the last day". Read raw, that is `max_over_time(X[1d])` over a series scraped once a
minute: 1,440 samples a series at each minute's evaluation. Read through the recording hierarchy of
alerts/ (`accel-infiniband-hourly`, `accel-pcie-nvlink-hourly`), it is the last hour raw (60 samples)
and the day of hourly maxima (24).

A full day of history is backfilled, not waited for: `promtool tsdb create-blocks-from openmetrics`
writes `--nodes` nodes' worth of the slow-path series (8 InfiniBand ports and 8 GPUs a node, a
sample a minute for 25 hours) and the hourly maxima the rules record, and real Prometheus opens the
blocks. Each "within the last day" part of the three rules is then run as an instant query at the
end of the day, `--rounds` times through the HTTP API with `stats=all`, in the shipped form and in
the raw form it replaces. Printed per expression: the median of Prometheus's own evaluation time
(evalTotalTime), the samples it read, and both per 1,000 nodes (linear in nodes: one series per port
or GPU); then the ratio.

What it showed on 2 cores at 200 nodes (11-29, Prometheus 2.42): per 1,000 nodes the InfiniBand
"active within the day" read 11.5 M samples in 684 ms raw and 0.69 M in 421 ms shipped, the NVLink
one 707 ms and 523 ms: 6 % of the samples, 62 % and 74 % of the time (a chunk is decoded whole, so
the hour's raw samples cost more than their count), the same series answered.

    python bench/bench_rule_hierarchy.py [--nodes 100] [--rounds 9]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fleet import Prometheus

PORTS = 8
GPUS = 8
HOURS = 25
STEP = 60

RAW = {
    "InfiniBand port active within the day": (
        "max by (node, device, port) (max_over_time(accel_infiniband_port_state[1d])) >= 4",
        "max by (node, device, port) (max_over_time(accel_infiniband_port_state[1h])) >= 4"
        " or max by (node, device, port) (max_over_time(accel:infiniband_port_state:max1h[1d])) >= 4",
    ),
    "NVLink links up within the day": (
        "max by (node, pci_bus_id) (max_over_time(accel_gpu_nvlink_links_up[1d]))",
        "max by (node, pci_bus_id) ("
        'label_replace(max_over_time(accel_gpu_nvlink_links_up[1h]), "window", "1h", "", "")'
        ' or label_replace(max_over_time(accel:gpu_nvlink_links_up:max1h[1d]), "window", "1d", "", ""))',
    ),
}


def openmetrics(path: Path, *, nodes: int, end: int) -> int:
    """Writes the series and their hourly maxima for `nodes` nodes up to `end` (Unix seconds);
    returns the samples written."""
    start = end - HOURS * 3600
    minutes = range(start, end + 1, STEP)
    hours = range(start + 3600, end + 1, 3600)
    count = 0
    with path.open("w") as out:
        out.write("# TYPE accel_infiniband_port_state gauge\n")
        for n in range(nodes):
            for p in range(PORTS):
                labels = f'node="n{n}",device="mlx5_{p}",port="1",instance="10.0.{n // 250}.{n % 250}:9835"'
                out.writelines(f"accel_infiniband_port_state{{{labels}}} 4 {t}\n" for t in minutes)
                count += len(minutes)
        out.write("# TYPE accel_gpu_nvlink_links_up gauge\n")
        for n in range(nodes):
            for g in range(GPUS):
                instance = f"10.0.{n // 250}.{n % 250}:9835"
                labels = f'node="n{n}",pci_bus_id="0000:{g:02x}:00",gpu="{g}",instance="{instance}"'
                out.writelines(f"accel_gpu_nvlink_links_up{{{labels}}} 18 {t}\n" for t in minutes)
                count += len(minutes)
        recorded = (
            ("accel:infiniband_port_state:max1h", 4, [f'device="mlx5_{p}",port="1"' for p in range(PORTS)]),
            ("accel:gpu_nvlink_links_up:max1h", 18, [f'pci_bus_id="0000:{g:02x}:00"' for g in range(GPUS)]),
        )
        for name, value, keys in recorded:  # as the hourly groups record them: by node and device
            for n in range(nodes):
                for key in keys:
                    out.writelines(f'{name}{{node="n{n}",{key}}} {value} {t}\n' for t in hours)
                    count += len(hours)
        out.write("# EOF\n")
    return count


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--workdir", help="keep the data and logs here")
    args = parser.parse_args()
    for tool in ("promtool", "prometheus"):
        if shutil.which(tool) is None:
            print(f"{tool} not found (make tools installs it)", file=sys.stderr)
            return 2
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="accel-health-hierarchy-"))
    end = (int(time.time()) // 3600) * 3600 - 7200  # whole hours, older than the head block's range
    source = workdir / "series.om"
    began = time.monotonic()
    samples = openmetrics(source, nodes=args.nodes, end=end)
    data = workdir / "prom" / "data"
    data.mkdir(parents=True, exist_ok=True)
    promtool = shutil.which("promtool") or "promtool"
    subprocess.run(
        [promtool, "tsdb", "create-blocks-from", "openmetrics", str(source), str(data)],
        check=True,
        capture_output=True,
    )
    source.unlink()
    print(f"{args.nodes} nodes: {samples:,} samples backfilled in {time.monotonic() - began:.0f} s")
    config = {"global": {"scrape_interval": "1m"}, "scrape_configs": []}
    ok = True
    with Prometheus(
        workdir=workdir / "prom", config=config, args=("--storage.tsdb.retention.time=30d",)
    ) as prom:
        for what, (raw, shipped) in RAW.items():
            results = {}
            for form, expr in (("raw [1d]", raw), ("shipped", shipped)):
                got = prom.query(expr, at=end)
                seconds, read = [], 0.0
                for _ in range(args.rounds):
                    s, read = prom.query_stats(expr, at=end)
                    seconds.append(s)
                median = statistics.median(seconds)
                results[form] = (median, read, len(got))
                per_k = 1000 / args.nodes
                print(
                    f"  {what:40s} {form:9s}: {median * 1e3:7.1f} ms, {read:>12,.0f} samples,"
                    f" {len(got)} series; per 1,000 nodes {median * per_k * 1e3:7.1f} ms,"
                    f" {read * per_k:>13,.0f} samples"
                )
            (raw_s, raw_read, raw_n), (new_s, new_read, new_n) = results["raw [1d]"], results["shipped"]
            same = raw_n == new_n
            ok = ok and same
            print(
                f"  {what:40s} shipped/raw: time {new_s / raw_s:.2f}, samples {new_read / raw_read:.3f};"
                f" same series answered: {same}"
            )
    if not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
