"""What one evaluation of a fatal rule's expression costs per node, and which forms cost less (issue 24).

`bench/bench_fleet.py` shows the 1-s fatal groups limiting one Prometheus: they read every fast-path
series of every node each second. This bench isolates the expressions: real Prometheus scrapes N
simulated 8-GPU, 8-port nodes (bench/fleet.py, the real exporter's output, shipped scrape
configuration) with no rules at all, and after `--soak` seconds each expression below is run as an
instant query `--rounds` times through the HTTP API with `stats=all`. Printed per expression: the
median and minimum of Prometheus's own evaluation time (`evalTotalSeconds`), the samples it read,
and the time per series read.

What it showed on 2 cores at N = 250 (7-minute soak, 11-28): an instant read of a series scraped every
2 s costs 12-20 µs (Prometheus decodes the samples of its five-minute lookback), a
`last_over_time(X[5s])` about half of that, and the InfiniBand rule's `X - min_over_time(X[10m])`
30-50 µs, [1m] or [30s] windows about two thirds of that. No form of the expression brings the fatal
groups' ~90 fast series per node read every second under 100 ms at 2,000 nodes in one Prometheus:
that takes fewer series per Prometheus (shards).

Since then the fast path holds only series that exist where something is wrong (exporter/paths.py):
a healthy node gives the fatal groups nothing to read, and the cost above is paid per fault series
(an InfiniBand port's rises, a lost GPU, a fatal AER count), not per node. The expressions below are
the forms measured then, on the raw series (now on the slow path, or absent while zero).

    python bench/bench_fatal_queries.py [--nodes 250] [--soak 420] [--rounds 15]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fleet import (
    FleetServer,
    Prometheus,
    exporter_jobs,
    exporter_template,
    load_bodies,
    load_config,
    prometheus_config,
    write_file_sd,
)

from examples.pipeline import free_port

IB = "accel_infiniband_port_link_downed_total"
REMAP = "accel_gpu_remapped_rows_failure"
QUERIES = {
    "instant (as the memory and PCIe fatal rules read)": f"{REMAP} > 0",
    "last_over_time [5s]": f"last_over_time({REMAP}[5s]) > 0",
    "InfiniBand before, min_over_time [10m]": f"{IB} - min_over_time({IB}[10m]) > 0",
    "InfiniBand, min_over_time [1m]": f"{IB} - min_over_time({IB}[1m]) > 0",
    "InfiniBand, min_over_time [30s]": f"{IB} - min_over_time({IB}[30s]) > 0",
    "InfiniBand, instant": f"{IB} > 0",
}


def evaluate(url: str, query: str) -> tuple[float, int]:
    """(Prometheus's evaluation seconds, samples read) of one instant query."""
    target = f"{url}/api/v1/query?" + urllib.parse.urlencode({"query": query, "stats": "all"})
    with urllib.request.urlopen(target, timeout=60) as response:  # noqa: S310  loopback only
        body = json.load(response)
    stats = body["data"].get("stats", {})
    seconds = float(stats.get("timings", {}).get("evalTotalSeconds", 0.0))
    samples = int(stats.get("samples", {}).get("totalQueryableSamples", 0))
    return seconds, samples


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=250)
    parser.add_argument("--soak", type=float, default=420.0, help="seconds of scraping before the queries")
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    if not shutil.which("prometheus") or not shutil.which("kubectl"):
        print("skipped: prometheus and kubectl are needed (scripts/install-tools.sh)")
        return 0
    config, template = load_config(), exporter_template()
    jobs = exporter_jobs(config, template)
    bodies = load_bodies(jobs)
    with (
        tempfile.TemporaryDirectory(prefix="accel-health-fatal-") as tmp,
        FleetServer(bodies, args.nodes) as server,
    ):
        sd = write_file_sd(Path(tmp) / "sd", config, server.pods(template, jobs)[: args.nodes])
        scrape_only = prometheus_config(config, sd_files=sd, rule_files=[], extra_jobs=[])
        with Prometheus(Path(tmp) / "prometheus", scrape_only, port=free_port()) as prometheus:
            print(
                f"{args.nodes} nodes scraped for {args.soak:g} s, no rules; then {args.rounds} rounds",
                flush=True,
            )
            time.sleep(args.soak)
            seen: dict[str, list[tuple[float, int]]] = {name: [] for name in QUERIES}
            for _ in range(args.rounds):
                for name, query in QUERIES.items():
                    seen[name].append(evaluate(prometheus.url, query))
    print(f"{'expression':50s} {'median':>10s} {'min':>10s} {'samples':>9s} {'per series':>11s}")
    series = args.nodes * 8  # 8 GPUs, or 8 ports, a node
    for name, runs in seen.items():
        times = [t for t, _ in runs]
        median = statistics.median(times)
        print(
            f"{name:50s} {median * 1e3:8.2f}ms {min(times) * 1e3:8.2f}ms {runs[-1][1]:9d} "
            f"{median / series * 1e6:9.1f}µs"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
