"""What one Prometheus spends on a fleet of 8-GPU nodes with the shipped scrape configuration and rules,
and the largest fleet this machine's Prometheus sustains (issue 24).

Real Prometheus (scratch data folder, loopback) runs deploy/prometheus/prometheus.yaml as shipped,
pod discovery played through file_sd (bench/fleet.py), with the rules of alerts/, against N simulated
nodes (bench/fleet.py: every node serves what the real exporter serves on each scraped path, with GPU
identities of its own, from one thread of this process). One job is added: Prometheus scraping itself
every 3 s (the shipped configuration does not), which is where every figure below is read from.

Each N gets a fresh Prometheus. After every exporter target has been scraped once and a warm-up
(`--warmup`, default twice the longest scrape interval, at least 30 s), a window of `--minutes` (at
least three of the longest scrape interval) is measured:
- active series (prometheus_tsdb_head_series) and samples appended per second (rate of
  prometheus_tsdb_head_samples_appended_total), and per node and job the samples per second
  (samples per scrape after metric relabeling, divided by the job's interval);
- each rule group's evaluation time (prometheus_rule_group_last_duration_seconds sampled every 3 s:
  median and max over the window) against its interval, and the iterations it missed;
- scrape health: targets up (at the end, and never down in the window), scrape durations, the
  scrapes each target got against those its interval asks for, and Prometheus's own interval
  quantiles (prometheus_target_interval_length_seconds, p01 and p99, per interval);
- Prometheus's resident memory (max over the window) and CPU (rate of process_cpu_seconds_total),
  and the simulator's own CPU (its thread's CPU time).

N *sustains* when every exporter target is up throughout, every target got its scrapes with the
interval kept (p01 >= 0.9 and p99 <= 1.1 times the interval), no rule group missed an iteration, and
Prometheus used less than `--cpu-limit` cores (1.5 of this machine's 2).

Extrapolation to 2,000 and 10,000 nodes: series, samples/s, RSS and CPU are fitted by least squares
as a baseline plus a linear per-node growth over every measured N (the baseline run, N = 0, included
unless `--no-baseline`); each rule group's median and max evaluation time likewise over the measured
N (several N are needed: `--nodes 100 250 500`, or `--find-max`). Known limits: the simulated values
never change (they compress better than a real node's), and a few minutes of data underrate rules with
long ranges ([30m], [1h], [1d]) and memory that keeps growing until the head block is cut (2 h).

    python bench/bench_fleet.py --nodes 500 --minutes 3        # one N (and the baseline N = 0)
    python bench/bench_fleet.py --nodes 100 250 500 750        # several N, fitted
    python bench/bench_fleet.py --find-max                     # 100, 250, 500, ... until one fails

Other work on the machine (and the simulator itself, on the same 2 cores) makes figures noisy:
/proc/loadavg is printed with every window.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the harness lives in tests/

from fleet import (
    RULES,
    FleetServer,
    Prometheus,
    ScrapeJob,
    exporter_job_regex,
    exporter_jobs,
    exporter_template,
    format_duration,
    load_bodies,
    load_config,
    parse_duration,
    prometheus_config,
    write_file_sd,
)

from examples.pipeline import free_port
from tests.kube.controlplane import wait_for

SELF_JOB = "bench-fleet-prometheus"
SELF_INTERVAL = 3.0
"""Prometheus scraping itself: an interval none of the shipped jobs uses, so its interval quantiles
stay apart from theirs."""
SWEEP = (100, 250, 500, 750, 1000, 1500, 2000, 3000, 4000, 6000, 8000, 10000)
TARGETS = (2000, 10000)
SAMPLES_PER_NODE_GOAL = 40.0


_RANGE_SELECTOR = re.compile(
    r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(\{[^}]*\})?\s*\[\s*(\d+(?:ms|s|m|h|d|w|y))\s*(?::[^\]]*)?\]"
)


@dataclass(frozen=True)
class RangeRead:
    """A range selector of a rule (`name{matchers}[range]`): every evaluation reads its range."""

    group: str
    selector: str
    """`name{matchers}`."""
    seconds: float


def range_reads(rule_files: Sequence[Path]) -> list[RangeRead]:
    """The range selectors of every rule, by group (a PromQL-shaped regex: subqueries read as ranges)."""
    reads = []
    for path in rule_files:
        for group in (yaml.safe_load(path.read_text()) or {}).get("groups") or []:
            for rule in group.get("rules") or []:
                for match in _RANGE_SELECTOR.finditer(str(rule.get("expr", ""))):
                    selector = match.group(1) + (match.group(2) or "")
                    reads.append(RangeRead(group["name"], selector, parse_duration(match.group(3))))
    return reads


@dataclass(frozen=True)
class Group:
    """One rule group over the window."""

    interval: float
    median: float
    """Median of its evaluation time (seconds), sampled every SELF_INTERVAL."""
    worst: float
    missed: float
    """Iterations missed (prometheus_rule_group_iterations_missed_total)."""
    ran: float
    """Iterations run (scheduled less missed)."""


NO_GROUP = Group(math.nan, math.nan, math.nan, 0.0, 0.0)


@dataclass
class Run:
    """What one N measured."""

    nodes: int
    window: float
    series: float = 0.0
    samples_per_second: float = 0.0
    samples_per_node_job: dict[str, float] = field(default_factory=dict)
    """Job -> samples per second one node adds."""
    rss_bytes: float = 0.0
    cpu_cores: float = 0.0
    simulator_cores: float = 0.0
    up: dict[str, int] = field(default_factory=dict)
    down_in_window: int = 0
    scrapes: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Job -> (fewest scrapes a target got in the window, scrapes its interval asks for)."""
    scrape_p50: dict[str, float] = field(default_factory=dict)
    scrape_max: dict[str, float] = field(default_factory=dict)
    interval_quantiles: dict[str, tuple[float, float]] = field(default_factory=dict)
    """Interval label -> (p01 min, p99 max) over the window."""
    groups: dict[str, Group] = field(default_factory=dict)
    group_trend: dict[str, list[float]] = field(default_factory=dict)
    """Rule group -> median evaluation seconds per minute of the window."""
    reads: dict[str, tuple[float, float]] = field(default_factory=dict)
    """Rule group -> samples its range selectors read per evaluation (now, and once every range is
    full of data: series x samples per second x range)."""
    firing: list[str] = field(default_factory=list)
    loadavg: tuple[str, str] = ("", "")
    problems: list[str] = field(default_factory=list)

    @property
    def sustained(self) -> bool:
        return not self.problems


def _loadavg() -> str:
    return Path("/proc/loadavg").read_text().strip()


@dataclass(frozen=True)
class Bench:
    """What every N is measured with."""

    server: FleetServer
    jobs: Sequence[ScrapeJob]
    config: dict[str, Any]
    """The shipped configuration."""
    template: dict[str, Any]
    """The exporter DaemonSet's pod template."""
    workdir: Path
    minutes: float
    warmup: float | None
    """Seconds after every target's first scrape; None: twice the longest interval, at least 30."""
    cpu_limit: float

    def measure(self, nodes: int) -> Run:
        longest = max(j.interval for j in self.jobs)
        window = max(self.minutes * 60, 3 * longest)
        warm = self.warmup if self.warmup is not None else max(30.0, 2 * longest)
        folder = self.workdir / f"n{nodes}"
        sd = write_file_sd(folder / "sd", self.config, self.server.pods(self.template, self.jobs)[:nodes])
        port = free_port()
        itself = {
            "job_name": SELF_JOB,
            "scrape_interval": f"{SELF_INTERVAL:g}s",
            "static_configs": [{"targets": [f"127.0.0.1:{port}"]}],
        }
        config = prometheus_config(self.config, sd_files=sd, extra_jobs=[itself])
        regex = exporter_job_regex(self.jobs)
        run = Run(nodes=nodes, window=window)
        with Prometheus(folder / "prometheus", config, port=port) as prometheus:

            def scraped() -> bool:
                targets = prometheus.value(f'count(up{{job=~"{regex}"}}) or vector(0)') or 0
                return targets >= nodes * len(self.jobs) and prometheus.value(f'up{{job="{SELF_JOB}"}}') == 1

            wait_for(
                f"every target of {nodes} nodes scraped once", scraped, timeout=2 * longest + 120, interval=1
            )
            time.sleep(warm)
            load0, cpu0, t0 = _loadavg(), self.server.cpu_seconds(), time.time()
            time.sleep(window)
            load1, cpu1, t1 = _loadavg(), self.server.cpu_seconds(), time.time()
            run.loadavg = (load0, load1)
            run.simulator_cores = (cpu1 - cpu0) / (t1 - t0)
            _read(run, prometheus, self.jobs, at=t1, window=int(t1 - t0))
        _judge(run, self.jobs, self.cpu_limit)
        shutil.rmtree(folder, ignore_errors=True)
        return run


def _read(run: Run, p: Prometheus, jobs: Sequence[ScrapeJob], *, at: float, window: int) -> None:
    w, me = f"[{window}s]", f'job="{SELF_JOB}"'
    regex = exporter_job_regex(jobs)
    exporters = f'job=~"{regex}"'
    run.series = p.value(f"prometheus_tsdb_head_series{{{me}}}", at=at) or 0.0
    run.samples_per_second = (
        p.value(f"sum(rate(prometheus_tsdb_head_samples_appended_total{{{me}}}{w}))", at=at) or 0
    )
    run.rss_bytes = p.value(f"max_over_time(process_resident_memory_bytes{{{me}}}{w})", at=at) or 0.0
    run.cpu_cores = p.value(f"rate(process_cpu_seconds_total{{{me}}}{w})", at=at) or 0.0
    if run.nodes:
        per_scrape = p.by(
            "job",
            f"avg by (job) (avg_over_time(scrape_samples_post_metric_relabeling{{{exporters}}}{w}))",
            at=at,
        )
        run.samples_per_node_job = {j.name: per_scrape.get(j.name, 0.0) / j.interval for j in jobs}
        run.up = {
            k: int(v) for k, v in p.by("job", f"count by (job) (up{{{exporters}}} == 1)", at=at).items()
        }
        run.down_in_window = int(p.value(f"count(min_over_time(up{{{exporters}}}{w}) < 1)", at=at) or 0)
        fewest = p.by("job", f"min by (job) (count_over_time(up{{{exporters}}}{w}))", at=at)
        run.scrapes = {j.name: (int(fewest.get(j.name, 0)), int(window // j.interval)) for j in jobs}
        run.scrape_p50 = p.by(
            "job", f"quantile by (job) (0.5, avg_over_time(scrape_duration_seconds{{{exporters}}}{w}))", at=at
        )
        run.scrape_max = p.by(
            "job", f"max by (job) (max_over_time(scrape_duration_seconds{{{exporters}}}{w}))", at=at
        )
    low = p.by(
        "interval",
        f'min_over_time(prometheus_target_interval_length_seconds{{{me},quantile="0.01"}}{w})',
        at=at,
    )
    high = p.by(
        "interval",
        f'max_over_time(prometheus_target_interval_length_seconds{{{me},quantile="0.99"}}{w})',
        at=at,
    )
    run.interval_quantiles = {k: (low[k], high.get(k, math.nan)) for k in low}
    g = "rule_group"
    interval = p.by(g, f"prometheus_rule_group_interval_seconds{{{me}}}", at=at)
    median = p.by(
        g, f"quantile_over_time(0.5, prometheus_rule_group_last_duration_seconds{{{me}}}{w})", at=at
    )
    worst = p.by(g, f"max_over_time(prometheus_rule_group_last_duration_seconds{{{me}}}{w})", at=at)
    missed = p.by(g, f"increase(prometheus_rule_group_iterations_missed_total{{{me}}}{w})", at=at)
    scheduled = p.by(g, f"increase(prometheus_rule_group_iterations_total{{{me}}}{w})", at=at)
    run.groups = {
        _group_name(k): Group(
            interval=interval[k],
            median=median.get(k, math.nan),
            worst=worst.get(k, math.nan),
            missed=missed.get(k, 0.0),
            ran=scheduled.get(k, 0.0) - missed.get(k, 0.0),
        )
        for k in interval
    }
    minutes = int(window // 60)
    if minutes >= 2:
        trend = p.query_range(
            f"quantile_over_time(0.5, prometheus_rule_group_last_duration_seconds{{{me}}}[60s])",
            start=at - (minutes - 1) * 60,
            end=at,
            step=60,
        )
        run.group_trend = {_group_name(r["metric"][g]): [float(v) for _, v in r["values"]] for r in trend}
    for read in range_reads(sorted(RULES.glob("*.yaml"))) if run.nodes else []:
        # Samples in the last minute, and in the range now: the data is only minutes old.
        minute = p.value(f"sum(count_over_time({read.selector}[60s]))", at=at) or 0.0
        now = p.value(f"sum(count_over_time({read.selector}[{format_duration(read.seconds)}]))", at=at) or 0.0
        before = run.reads.get(read.group, (0.0, 0.0))
        run.reads[read.group] = (before[0] + now, before[1] + minute / 60 * read.seconds)
    run.firing = sorted(
        f"{r['metric'].get('alertname')}x{int(float(r['value'][1]))}"
        for r in p.query('count by (alertname) (ALERTS{alertstate="firing"})', at=at)
    )


def _group_name(rule_group: str) -> str:
    """`/path/alerts/gpu-xid.yaml;accel-gpu-xid` -> `accel-gpu-xid`."""
    return rule_group.rpartition(";")[2]


def _judge(run: Run, jobs: Sequence[ScrapeJob], cpu_limit: float) -> None:
    if not run.nodes:
        return
    for job in jobs:
        if run.up.get(job.name, 0) != run.nodes:
            run.problems.append(f"{job.name}: {run.up.get(job.name, 0)} of {run.nodes} targets up")
        fewest, asked = run.scrapes.get(job.name, (0, 0))
        if fewest < asked - 1:  # one scrape more or less: where the window's ends fall
            run.problems.append(f"{job.name}: a target got {fewest} of the {asked} scrapes its interval asks")
        label = _interval_label(job.interval)
        low, high = run.interval_quantiles.get(label, (math.nan, math.nan))
        if not (0.9 * job.interval <= low and high <= 1.1 * job.interval):
            run.problems.append(
                f"{job.name}: scrape interval p01 {low:.2f} s, p99 {high:.2f} s (not {label})"
            )
    if run.down_in_window:
        run.problems.append(f"{run.down_in_window} targets down during the window")
    for name, group in run.groups.items():
        if group.missed > 0 or group.ran < run.window / group.interval - 2:
            run.problems.append(
                f"rule group {name} missed {group.missed:.0f} iterations (ran {group.ran:.0f} in "
                f"{run.window:.0f} s at {group.interval:g} s)"
            )
    if run.cpu_cores > cpu_limit:
        run.problems.append(f"Prometheus used {run.cpu_cores:.2f} cores (limit {cpu_limit:g})")


def _interval_label(seconds: float) -> str:
    """Prometheus's rendering of a scrape interval (the `interval` label): 5s, 1m0s, 1m30s, 500ms."""
    if seconds < 1:
        return f"{round(seconds * 1000)}ms"
    minutes, rest = divmod(seconds, 60)
    hours, minutes = divmod(int(minutes), 60)
    text = f"{rest:g}s"
    if minutes or hours:
        text = f"{minutes}m" + text
    if hours:
        text = f"{hours}h" + text
    return text


# -- report -------------------------------------------------------------------------------------------


def _fit(points: Sequence[tuple[float, float]]) -> tuple[float, float] | None:
    """Least squares (intercept, slope) of y over x; None with fewer than two distinct x."""
    clean = [(x, y) for x, y in points if not math.isnan(y)]
    if len({x for x, _ in clean}) < 2:
        return None
    slope, intercept = statistics.linear_regression([x for x, _ in clean], [y for _, y in clean])
    return intercept, slope


def report(runs: Sequence[Run], jobs: Sequence[ScrapeJob]) -> None:
    print(
        f"\nmachine: {os.cpu_count()} cores; the exporter's scrape jobs in deploy/prometheus/prometheus.yaml:"
    )
    for job in jobs:
        print(f"  {job.name}: {job.metrics_path} every {job.interval:g} s (timeout {job.timeout:g} s)")
    _print_totals(runs)
    measured = [r for r in runs if r.nodes]
    _print_per_node(measured)
    _print_scrapes(measured, jobs)
    groups = sorted({g for r in runs for g in r.groups})
    _print_groups(runs, groups)
    firing = [f"N={r.nodes}: {', '.join(r.firing)}" for r in runs if r.firing]
    print("\nalerts firing at the end: " + ("; ".join(firing) if firing else "none"))
    for r in runs:
        for problem in r.problems:
            print(f"  N={r.nodes} does not sustain: {problem}")
    _print_reads(measured)
    _extrapolate(runs, groups)


def _print_reads(measured: Sequence[Run]) -> None:
    if not measured:
        return
    r = max(measured, key=lambda run: run.nodes)
    print(
        f"\nrange selectors at N={r.nodes}: samples read per evaluation now and once every range is full "
        "(per node), and the evaluation time that would take if reading ranges is what costs "
        "(median now x full / now), at this N and linearly at" + "".join(f" {n}" for n in TARGETS) + " nodes:"
    )
    for g, (now, full) in sorted(r.reads.items()):
        interval, median = r.groups.get(g, NO_GROUP).interval, r.groups.get(g, NO_GROUP).median
        estimate = median * max(1.0, full / now) if now else math.nan
        scaled = "".join(f" {estimate * n / r.nodes:10.1f} s" for n in TARGETS)
        print(
            f"  {g + f' ({interval:g} s)':34} {now / r.nodes:10.0f} now {full / r.nodes:12.0f} full"
            f"   ~{estimate:9.2f} s{scaled}" + ("   > interval" if estimate > interval else "")
        )


def _print_totals(runs: Sequence[Run]) -> None:
    print(
        f"\n{'N':>6} {'series':>10} {'samples/s':>10} {'RSS MiB':>8} {'CPU':>5} {'sim CPU':>7} "
        f"{'node samples/s':>14}  sustains  loadavg (start | end)"
    )
    for r in runs:
        per_node = sum(r.samples_per_node_job.values())
        print(
            f"{r.nodes:6d} {r.series:10.0f} {r.samples_per_second:10.0f} {r.rss_bytes / 2**20:8.0f} "
            f"{r.cpu_cores:5.2f} {r.simulator_cores:7.3f} {per_node:14.1f}  "
            f"{'yes' if r.sustained else 'NO ':3}       {r.loadavg[0]} | {r.loadavg[1]}"
        )


def _print_per_node(measured: Sequence[Run]) -> None:
    print(
        "\nsamples/s per node and scrape job (samples per scrape after relabeling / interval), "
        f"goal <= {SAMPLES_PER_NODE_GOAL:g} per 8-GPU node:"
    )
    for r in measured:
        parts = ", ".join(f"{job} {v:.1f}" for job, v in r.samples_per_node_job.items())
        total = sum(r.samples_per_node_job.values())
        verdict = "meets" if total <= SAMPLES_PER_NODE_GOAL else "exceeds"
        print(f"  N={r.nodes}: {parts}; total {total:.1f} ({verdict} the goal)")


def _print_scrapes(measured: Sequence[Run], jobs: Sequence[ScrapeJob]) -> None:
    print(
        "\nscrape health (per job: targets up at the end, fewest scrapes a target got / scrapes asked, "
        "duration p50 | max; then interval p01 | p99 per interval):"
    )
    for r in measured:
        parts = []
        for j in jobs:
            fewest, asked = r.scrapes.get(j.name, (0, 0))
            p50, worst = r.scrape_p50.get(j.name, math.nan), r.scrape_max.get(j.name, math.nan)
            parts.append(
                f"{j.name} {r.up.get(j.name, 0)}/{r.nodes} up, {fewest}/{asked} scrapes, "
                f"{p50 * 1000:.1f} | {worst * 1000:.1f} ms"
            )
        quantiles = ", ".join(
            f"{k}: {lo:.3f} | {hi:.3f} s" for k, (lo, hi) in sorted(r.interval_quantiles.items())
        )
        print(f"  N={r.nodes}: " + "; ".join(parts) + f"; down in window {r.down_in_window}; {quantiles}")


def _print_groups(runs: Sequence[Run], groups: Sequence[str]) -> None:
    print("\nrule groups: evaluation seconds, median | max over the window (! : missed iterations):")
    print(f"  {'group (interval)':34}" + "".join(f"{'N=' + str(r.nodes):>20}" for r in runs))
    for g in groups:
        cells = []
        for r in runs:
            group = r.groups.get(g, NO_GROUP)
            cells.append(f"{group.median:.4f} | {group.worst:.4f}" + ("!" if group.missed else " "))
        interval = next((r.groups[g].interval for r in runs if g in r.groups), math.nan)
        print(f"  {g + f' ({interval:g} s)':34}" + "".join(f"{c:>20}" for c in cells))
    trends = [r for r in runs if r.group_trend]
    if trends:
        r = trends[-1]
        print(f"\nmedian evaluation seconds per minute of the window at N={r.nodes} (rising: data in range):")
        for g, values in sorted(r.group_trend.items()):
            print(f"  {g:34} " + " ".join(f"{v:.4f}" for v in values))


FIGURES: dict[str, Callable[[Run], float]] = {
    "series": lambda r: r.series,
    "samples/s": lambda r: r.samples_per_second,
    "RSS MiB": lambda r: r.rss_bytes / 2**20,
    "Prometheus CPU cores": lambda r: r.cpu_cores,
    "simulator CPU cores": lambda r: r.simulator_cores,
}


def _extrapolate(runs: Sequence[Run], groups: Sequence[str]) -> None:
    at = "".join(f"{'N=' + str(n):>14}" for n in TARGETS)
    print(f"\nextrapolation (least squares, baseline + per-node slope, over N = {[r.nodes for r in runs]}):")
    print(f"  {'figure':34} {'baseline':>12} {'per node':>12}{at}")
    for name, get in FIGURES.items():
        fit = _fit([(r.nodes, get(r)) for r in runs])
        if fit is None:
            print(f"  {name:34} (needs two N)")
            continue
        a, b = fit
        print(f"  {name:34} {a:12.3f} {b:12.5f}" + "".join(f"{a + b * n:14.1f}" for n in TARGETS))
    measured = [r for r in runs if r.nodes]
    if len({r.nodes for r in measured}) < 2:
        print("  rule groups: measure several N (--nodes 100 250 500, or --find-max) to extrapolate them")
        return
    print(f"  rule group evaluation seconds over the measured N > 0 (median, max){at}")
    for g in groups:
        interval = next(r.groups[g].interval for r in measured if g in r.groups)
        for what in ("median", "worst"):
            fit = _fit([(r.nodes, getattr(r.groups[g], what)) for r in measured if g in r.groups])
            if fit is None:
                continue
            a, b = fit
            cells = "".join(f"{a + b * n:13.3f}" + ("!" if a + b * n > interval else " ") for n in TARGETS)
            print(f"  {g + f' ({interval:g} s) ' + what:34} {a:12.4f} {b:12.7f}{cells}")
    print("  (! : longer than the group's interval, so iterations would be missed)")


# -- main ---------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[500], metavar="N")
    parser.add_argument("--find-max", action="store_true", help=f"measure {SWEEP} until one does not sustain")
    parser.add_argument(
        "--sweep", type=int, nargs="+", default=list(SWEEP), metavar="N", help="--find-max's N"
    )
    parser.add_argument("--minutes", type=float, default=3.0, help="measured window per N")
    parser.add_argument(
        "--warmup", type=float, default=None, help="seconds after every target's first scrape"
    )
    parser.add_argument("--cpu-limit", type=float, default=1.5, help="cores Prometheus may use and sustain")
    parser.add_argument("--no-baseline", action="store_true", help="skip N = 0 (Prometheus with rules only)")
    args = parser.parse_args(argv)
    if not shutil.which("prometheus") or not shutil.which("kubectl"):
        print("skipped: prometheus and kubectl are needed (scripts/install-tools.sh)")
        return 0
    counts = sorted(args.sweep if args.find_max else args.nodes)
    config, template = load_config(), exporter_template()
    jobs = exporter_jobs(config, template)
    print(f"loadavg {_loadavg()}; capturing the real exporter's bodies ...", flush=True)
    bodies = load_bodies(jobs)
    runs: list[Run] = []
    with (
        tempfile.TemporaryDirectory(prefix="accel-health-fleet-") as tmp,
        FleetServer(bodies, max(counts)) as server,
    ):
        bench = Bench(
            server=server,
            jobs=jobs,
            config=config,
            template=template,
            workdir=Path(tmp),
            minutes=args.minutes,
            warmup=args.warmup,
            cpu_limit=args.cpu_limit,
        )
        if not args.no_baseline:
            print(f"N=0 (baseline) ... (loadavg {_loadavg()})", flush=True)
            runs.append(bench.measure(0))
        for n in counts:
            print(f"N={n} ... (loadavg {_loadavg()})", flush=True)
            run = bench.measure(n)
            runs.append(run)
            verdict = "sustains" if run.sustained else f"does not sustain ({'; '.join(run.problems)})"
            print(
                f"  {run.series:.0f} series, {run.samples_per_second:.0f} samples/s, "
                f"CPU {run.cpu_cores:.2f}, RSS {run.rss_bytes / 2**20:.0f} MiB: {verdict}",
                flush=True,
            )
            if args.find_max and not run.sustained:
                break
    report(runs, jobs)
    sustained = [r.nodes for r in runs if r.nodes and r.sustained]
    largest = max(sustained) if sustained else "none"
    print(f"\nlargest N sustained: {largest} (of {[r.nodes for r in runs if r.nodes]})")
    return 0 if sustained and max(sustained) >= max(min(counts), 1) else 1


if __name__ == "__main__":
    sys.exit(main())
