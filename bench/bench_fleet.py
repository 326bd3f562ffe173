"""What one Prometheus spends on a fleet of 8-GPU nodes with the shipped scrape configuration and rules,
and the largest fleet this machine's Prometheus sustains (issue 24).

Real Prometheus (scratch data folder, loopback) runs deploy/prometheus/prometheus.yaml as shipped,
pod discovery played through file_sd (bench/fleet.py), with the rules of alerts/, against N simulated
nodes (bench/fleet.py: every node serves what the real exporter serves on each scraped path, with GPU
identities of its own, from one thread of this process). One job is added: Prometheus scraping itself
every 3 s (the shipped configuration does not), which is where most figures below are read from.

Each N gets a fresh Prometheus. After every exporter target has been scraped once and a warm-up
(`--warmup`, default twice the longest scrape interval, at least 30 s), a window of `--minutes` (at
least three of the longest scrape interval) is measured:
- active series (prometheus_tsdb_head_series), samples appended per second (rate of
  prometheus_tsdb_head_samples_appended_total), and per node and scrape job the samples per second
  (samples per scrape after metric relabeling, divided by the job's interval);
- each rule group's evaluation time (prometheus_rule_group_last_duration_seconds, sampled every 3 s:
  median and max over the window, and the median of each minute) against its interval
  (prometheus_rule_group_interval_seconds), and the iterations it missed
  (prometheus_rule_group_iterations_missed_total) or did not run;
- scrape health: targets up (at the end, and never down in the window), scrape durations (median and
  max), the scrapes each target got against those its interval asks for, and the intervals between a
  target's scrapes (the timestamps of its `up` samples in the window: p01, p50, p99, max per job);
- Prometheus's resident memory (max over the window) and CPU (rate of process_cpu_seconds_total),
  and the simulator's own CPU (its thread's CPU time).

N *sustains* when every exporter target is up throughout and got its scrapes, the intervals are kept
(p99 of the intervals at most `--interval-slack` above the job's interval, p01 at most that much
below), no rule group missed an iteration, and Prometheus used less than `--cpu-limit` cores (1.5 of
this machine's 2).

Extrapolation to 2,000 and 10,000 nodes:
- series, samples/s, RSS and CPU: least squares over every measured N (the baseline N = 0 included
  unless `--no-baseline`), a baseline plus a linear per-node growth;
- each rule group's median and max evaluation time: least squares over the measured N > 0 (several N
  are needed: `--nodes 100 250 500`, or `--find-max`);
- rules with long ranges: a few minutes of data underrate them, since every evaluation reads its
  ranges ([5m], [30m], [1h], [1d]) and those fill for up to a day. For each group the samples its range
  selectors read per evaluation are counted, at the end of the window and once every range is full
  (series x samples per second x range); what one more sample costs a query is measured at the end
  (every selector of the rules as max_over_time over 30 s and over all the data there is: the
  difference in time over the difference in samples); the median evaluation time plus that cost for
  the samples full ranges add is printed as an estimate, at the N measured and scaled linearly in N.
Other known limits: the simulated values never change (they compress better than a real node's), and
memory keeps growing until the head block is cut (2 h).

A healthy node serves nothing on the fast path, so the fatal groups' cost is in the faults a fleet
carries: `--faulty 0.1` makes every tenth node serve what the real exporter serves after every one of
its InfiniBand ports had a link-down, integrity errors and buffer overruns this boot (24 fast series
a node, the most one node's InfiniBand faults make; bench/fleet.py `capture(faulted=True)`).

    python bench/bench_fleet.py --nodes 500 --minutes 5        # one N (and the baseline N = 0)
    python bench/bench_fleet.py --nodes 100 250 500 750        # several N, fitted
    python bench/bench_fleet.py --find-max                     # 100, 250, 500, ... until one fails
    python bench/bench_fleet.py --nodes 1000 --faulty 0.1      # a tenth of the nodes after a storm

Other work on the machine (and the simulator itself, on the same 2 cores) makes figures noisy:
/proc/loadavg is printed with every window.
"""

from __future__ import annotations

import argparse
import glob
import itertools
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
    SHIPPED_CONFIG,
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
SWEEP = (100, 250, 500, 750, 1000, 1500, 2000, 3000, 4000, 6000, 8000, 10000)
TARGETS = (2000, 10000)
SAMPLES_PER_NODE_GOAL = 40.0
INTERVAL_SAMPLE_NODES = 1000
"""Above this many nodes, scrape intervals are read from every tenth node only (nodes named ...0)."""

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
    """The range selectors of every rule, by group (a PromQL-shaped regex; a subquery reads as a range)."""
    reads = []
    for path in rule_files:
        for group in (yaml.safe_load(path.read_text()) or {}).get("groups") or []:
            for rule in group.get("rules") or []:
                for match in _RANGE_SELECTOR.finditer(str(rule.get("expr", ""))):
                    selector = match.group(1) + (match.group(2) or "")
                    reads.append(RangeRead(group["name"], selector, parse_duration(match.group(3))))
    return reads


@dataclass
class Group:
    """One rule group over the window."""

    interval: float
    median: float
    """Median evaluation time (seconds), sampled every SELF_INTERVAL."""
    worst: float
    missed: float
    """Iterations missed (prometheus_rule_group_iterations_missed_total)."""
    ran: float
    """Iterations run (scheduled less missed)."""
    per_minute: list[float] = field(default_factory=list)
    """Median evaluation time in each minute of the window."""
    read_per_minute: list[float] = field(default_factory=list)
    """Samples its range selectors read per evaluation, at the end of each minute."""
    read_full: float = 0.0
    """Samples its range selectors read per evaluation once every range is full of data."""

    def at_full_ranges(self, seconds_per_sample: float) -> float:
        """Evaluation seconds once every range is full: the median now plus the marginal cost of the
        samples a full range adds."""
        now = self.read_per_minute[-1] if self.read_per_minute else 0.0
        return self.median + seconds_per_sample * max(0.0, self.read_full - now)


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
    intervals: dict[str, tuple[float, float, float, float]] = field(default_factory=dict)
    """Job -> seconds between a target's consecutive scrapes in the window: p01, p50, p99, max."""
    groups: dict[str, Group] = field(default_factory=dict)
    seconds_per_sample: float = math.nan
    """What reading one more sample of the rules' range selectors costs a query (marginal_cost)."""
    firing: list[str] = field(default_factory=list)
    loadavg: tuple[str, str] = ("", "")
    problems: list[str] = field(default_factory=list)

    @property
    def sustained(self) -> bool:
        return not self.problems

    @property
    def scraped_all(self) -> bool:
        """Every exporter target up throughout the window: its series and samples are the fleet's."""
        return not self.down_in_window and all(v == self.nodes for v in self.up.values())


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
    interval_slack: float
    rule_files: Sequence[Path]

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
        config = prometheus_config(
            self.config, sd_files=sd, rule_files=[str(f) for f in self.rule_files], extra_jobs=[itself]
        )
        regex = exporter_job_regex(self.jobs)
        run = Run(nodes=nodes, window=window)
        with Prometheus(folder / "prometheus", config, port=port) as prometheus:

            def scraped() -> bool:
                targets = prometheus.value(f'count(up{{job=~"{regex}"}}) or vector(0)') or 0
                return targets >= nodes * len(self.jobs) and prometheus.value(f'up{{job="{SELF_JOB}"}}') == 1

            wait_for(f"every target of {nodes} nodes scraped", scraped, timeout=2 * longest + 120, interval=1)
            time.sleep(warm)
            load0, cpu0, t0 = _loadavg(), self.server.cpu_seconds(), time.time()
            time.sleep(window)
            load1, cpu1, t1 = _loadavg(), self.server.cpu_seconds(), time.time()
            run.loadavg = (load0, load1)
            run.simulator_cores = (cpu1 - cpu0) / (t1 - t0)
            window_s = int(t1 - t0)
            _read_totals(run, prometheus, at=t1, window=window_s)
            if nodes:
                _read_scrapes(run, prometheus, self.jobs, at=t1, window=window_s)
            reads = range_reads(self.rule_files)
            _read_groups(run, prometheus, reads, at=t1, window=window_s)
            if nodes and reads:
                run.seconds_per_sample = marginal_cost(prometheus, reads, at=t1, age=window_s + warm)
        _judge(run, self.jobs, cpu_limit=self.cpu_limit, slack=self.interval_slack)
        shutil.rmtree(folder, ignore_errors=True)
        return run


def _read_totals(run: Run, p: Prometheus, *, at: float, window: int) -> None:
    w, me = f"[{window}s]", f'job="{SELF_JOB}"'
    run.series = p.value(f"prometheus_tsdb_head_series{{{me}}}", at=at) or 0.0
    appended = f"sum(rate(prometheus_tsdb_head_samples_appended_total{{{me}}}{w}))"
    run.samples_per_second = p.value(appended, at=at) or 0.0
    run.rss_bytes = p.value(f"max_over_time(process_resident_memory_bytes{{{me}}}{w})", at=at) or 0.0
    run.cpu_cores = p.value(f"rate(process_cpu_seconds_total{{{me}}}{w})", at=at) or 0.0
    run.firing = sorted(
        f"{r['metric'].get('alertname')} x{int(float(r['value'][1]))}"
        for r in p.query('count by (alertname) (ALERTS{alertstate="firing"})', at=at)
    )


def _read_scrapes(run: Run, p: Prometheus, jobs: Sequence[ScrapeJob], *, at: float, window: int) -> None:
    w, exporters = f"[{window}s]", f'job=~"{exporter_job_regex(jobs)}"'
    per_scrape = p.by(
        "job", f"avg by (job) (avg_over_time(scrape_samples_post_metric_relabeling{{{exporters}}}{w}))", at=at
    )
    run.samples_per_node_job = {j.name: per_scrape.get(j.name, 0.0) / j.interval for j in jobs}
    run.up = {k: int(v) for k, v in p.by("job", f"count by (job) (up{{{exporters}}} == 1)", at=at).items()}
    run.down_in_window = int(p.value(f"count(min_over_time(up{{{exporters}}}{w}) < 1)", at=at) or 0)
    fewest = p.by("job", f"min by (job) (count_over_time(up{{{exporters}}}{w}))", at=at)
    run.scrapes = {j.name: (int(fewest.get(j.name, 0)), int(window // j.interval)) for j in jobs}
    durations = f"scrape_duration_seconds{{{exporters}}}{w}"
    run.scrape_p50 = p.by("job", f"quantile by (job) (0.5, avg_over_time({durations}))", at=at)
    run.scrape_max = p.by("job", f"max by (job) (max_over_time({durations}))", at=at)
    some = ',node=~".*0"' if run.nodes > INTERVAL_SAMPLE_NODES else ""
    for job in jobs:
        gaps: list[float] = []
        for series in p.query(f'up{{job="{job.name}"{some}}}{w}', at=at):
            stamps = [float(t) for t, _ in series["values"]]
            gaps += [b - a for a, b in itertools.pairwise(stamps)]
        if gaps:
            cuts = statistics.quantiles(gaps, n=100, method="inclusive")
            run.intervals[job.name] = (cuts[0], statistics.median(gaps), cuts[98], max(gaps))


def _read_groups(run: Run, p: Prometheus, reads: Sequence[RangeRead], *, at: float, window: int) -> None:
    w, me, g = f"[{window}s]", f'job="{SELF_JOB}"', "rule_group"
    last = f"prometheus_rule_group_last_duration_seconds{{{me}}}"
    interval = p.by(g, f"prometheus_rule_group_interval_seconds{{{me}}}", at=at)
    median = p.by(g, f"quantile_over_time(0.5, {last}{w})", at=at)
    worst = p.by(g, f"max_over_time({last}{w})", at=at)
    missed = p.by(g, f"increase(prometheus_rule_group_iterations_missed_total{{{me}}}{w})", at=at)
    scheduled = p.by(g, f"increase(prometheus_rule_group_iterations_total{{{me}}}{w})", at=at)
    for key, seconds in interval.items():
        run.groups[_group_name(key)] = Group(
            interval=seconds,
            median=median.get(key, math.nan),
            worst=worst.get(key, math.nan),
            missed=missed.get(key, 0.0),
            ran=scheduled.get(key, 0.0) - missed.get(key, 0.0),
        )
    minutes = int(window // 60)
    if minutes < 1:
        return
    start = at - (minutes - 1) * 60
    for r in p.query_range(f"quantile_over_time(0.5, {last}[60s])", start=start, end=at, step=60):
        if (group := run.groups.get(_group_name(r["metric"][g]))) is not None:
            group.per_minute = [float(v) for _, v in r["values"]]
    for read in reads:
        group = run.groups.get(read.group)
        if group is None:
            continue
        # Samples in the range at the end of each minute (the data is only minutes old), and per
        # second over the last minute (x range: what a full range holds).
        counted = f"sum(count_over_time({read.selector}[{format_duration(read.seconds)}])) or vector(0)"
        values = [
            float(v) for r in p.query_range(counted, start=start, end=at, step=60) for _, v in r["values"]
        ]
        if len(values) == minutes:
            group.read_per_minute = [
                a + b for a, b in zip(group.read_per_minute or [0.0] * minutes, values, strict=True)
            ]
        minute = p.value(f"sum(count_over_time({read.selector}[60s]))", at=at) or 0.0
        group.read_full += minute / 60 * read.seconds


def marginal_cost(
    p: Prometheus, reads: Sequence[RangeRead], *, at: float, age: float, rounds: int = 5
) -> float:
    """Seconds a query spends per sample read by the rules' range selectors: in each round, every
    selector queried as max_over_time over 30 s and over all the data there is (`age` seconds), the
    engine's own evaluation time and sample count (query stats); the difference in time over the
    difference in samples, median of the rounds. NaN when there is not data enough."""
    selectors = sorted({read.selector for read in reads})
    ratios = []
    for _ in range(rounds):
        spent, read = [], []
        for span in (30, max(60, int(age) - 5)):
            measured = [p.query_stats(f"count(max_over_time({s}[{span}s]))", at=at) for s in selectors]
            spent.append(sum(seconds for seconds, _ in measured))
            read.append(sum(samples for _, samples in measured))
        if read[1] > read[0]:
            ratios.append((spent[1] - spent[0]) / (read[1] - read[0]))
    return max(0.0, statistics.median(ratios)) if ratios else math.nan


def _group_name(rule_group: str) -> str:
    """`/path/alerts/gpu-xid.yaml;accel-gpu-xid` -> `accel-gpu-xid`."""
    return rule_group.rpartition(";")[2]


def _judge(run: Run, jobs: Sequence[ScrapeJob], *, cpu_limit: float, slack: float) -> None:
    for job in jobs if run.nodes else ():
        if run.up.get(job.name, 0) != run.nodes:
            run.problems.append(f"{job.name}: {run.up.get(job.name, 0)} of {run.nodes} targets up")
        fewest, asked = run.scrapes.get(job.name, (0, 0))
        if fewest < asked - 1:  # one more or one fewer: where the window's ends fall
            run.problems.append(f"{job.name}: a target got {fewest} of the {asked} scrapes its interval asks")
        low, _p50, high, _worst = run.intervals.get(job.name, (math.nan,) * 4)
        if not ((1 - slack) * job.interval <= low and high <= (1 + slack) * job.interval):
            run.problems.append(
                f"{job.name}: intervals between scrapes p01 {low:.2f} s, p99 {high:.2f} s "
                f"(interval {job.interval:g} s, slack {slack:.0%})"
            )
    if run.down_in_window:
        run.problems.append(f"{run.down_in_window} targets down during the window")
    for name, group in run.groups.items():
        if group.missed > 0 or group.ran < run.window / group.interval - 2:
            run.problems.append(
                f"rule group {name} missed {group.missed:.0f} iterations "
                f"(ran {group.ran:.0f} in {run.window:.0f} s at {group.interval:g} s)"
            )
    if run.cpu_cores > cpu_limit:
        run.problems.append(f"Prometheus used {run.cpu_cores:.2f} cores (limit {cpu_limit:g})")


# -- report -------------------------------------------------------------------------------------------


def _fit(points: Sequence[tuple[float, float]]) -> tuple[float, float] | None:
    """Least squares (intercept, slope) of y over x; None with fewer than two distinct x."""
    clean = [(x, y) for x, y in points if not (math.isnan(x) or math.isnan(y))]
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
    _extrapolate(runs, groups)
    _print_full_ranges(measured)


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
        "\nscrapes per job: targets up at the end; fewest scrapes a target got / scrapes asked; duration "
        "p50 | max; seconds between a target's scrapes p01 | p50 | p99 | max"
    )
    for r in measured:
        for j in jobs:
            fewest, asked = r.scrapes.get(j.name, (0, 0))
            p50, worst = r.scrape_p50.get(j.name, math.nan), r.scrape_max.get(j.name, math.nan)
            gaps = " | ".join(f"{v:.3f}" for v in r.intervals.get(j.name, (math.nan,) * 4))
            print(
                f"  N={r.nodes} {j.name}: {r.up.get(j.name, 0)}/{r.nodes} up ({r.down_in_window} down in "
                f"the window); {fewest}/{asked}; {p50 * 1000:.1f} | {worst * 1000:.1f} ms; {gaps} s"
            )


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


FIGURES: dict[str, Callable[[Run], float]] = {
    "series": lambda r: r.series,
    "samples/s": lambda r: r.samples_per_second,
    "RSS MiB": lambda r: r.rss_bytes / 2**20,
    "Prometheus CPU cores": lambda r: r.cpu_cores,
    "simulator CPU cores": lambda r: r.simulator_cores,
}


def _extrapolate(runs: Sequence[Run], groups: Sequence[str]) -> None:
    at = "".join(f"{'N=' + str(n):>14}" for n in TARGETS)
    complete = [r for r in runs if not r.nodes or r.scraped_all]
    print(
        "\nextrapolation (least squares, baseline + per-node slope, over the N whose targets were all up: "
        f"{[r.nodes for r in complete]}):"
    )
    print(f"  {'figure':40} {'baseline':>12} {'per node':>12}{at}")
    for name, get in FIGURES.items():
        fit = _fit([(r.nodes, get(r)) for r in complete])
        if fit is None:
            print(f"  {name:40} (needs two N)")
            continue
        a, b = fit
        print(f"  {name:40} {a:12.3f} {b:12.5f}" + "".join(f"{a + b * n:14.1f}" for n in TARGETS))
    measured = [r for r in runs if r.nodes]
    if len({r.nodes for r in measured}) < 2:
        print("  rule groups: measure several N (--nodes 100 250 500, or --find-max) to extrapolate them")
        return
    print(
        f"  rule-group evaluation seconds over every measured N > 0, {[r.nodes for r in measured]} "
        "(! : longer than the group's interval):"
    )
    for g in groups:
        interval = next(r.groups[g].interval for r in measured if g in r.groups)
        for what in ("median", "worst"):
            fit = _fit([(r.nodes, getattr(r.groups[g], what)) for r in measured if g in r.groups])
            if fit is None:
                continue
            a, b = fit
            cells = "".join(f"{a + b * n:13.3f}" + ("!" if a + b * n > interval else " ") for n in TARGETS)
            label = f"{g} ({interval:g} s) {'median' if what == 'median' else 'max'}"
            print(f"  {label:40} {a:12.4f} {b:12.7f}{cells}")


def _print_full_ranges(measured: Sequence[Run]) -> None:
    if not measured:
        return
    r = max(measured, key=lambda run: run.nodes)
    if not any(group.read_full for group in r.groups.values()):
        return
    cost = r.seconds_per_sample
    print(
        f"\nrange selectors at N={r.nodes}, per node: samples read per evaluation at the end of the window "
        "and once every range is full; evaluation seconds once every range is full (the median now "
        f"plus {cost * 1e9:.0f} ns per sample more, what one more sample cost a query here), at this N "
        "and scaled linearly (! : longer than the interval):"
    )
    print(
        f"  {'group (interval)':34} {'read now':>12} {'read full':>12} {'N=' + str(r.nodes):>11}"
        + "".join(f"{'N=' + str(n):>11}" for n in TARGETS)
    )
    for g, group in sorted(r.groups.items()):
        if not group.read_full:
            continue
        now = group.read_per_minute[-1] if group.read_per_minute else math.nan
        estimate = group.at_full_ranges(cost)
        cells = "".join(
            f"{v:10.2f}" + ("!" if v > group.interval else " ")
            for v in (estimate, *(estimate * n / r.nodes for n in TARGETS))
        )
        print(
            f"  {g + f' ({group.interval:g} s)':34} {now / r.nodes:12.0f} "
            f"{group.read_full / r.nodes:12.0f} {cells}"
        )
    print(f"\nmedian evaluation seconds in each minute of the window at N={r.nodes}:")
    for g, group in sorted(r.groups.items()):
        print(f"  {g:34} " + " ".join(f"{v:.3f}" for v in group.per_minute))


# -- main ---------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[500], metavar="N")
    parser.add_argument("--find-max", action="store_true", help=f"measure {SWEEP} until one does not sustain")
    parser.add_argument(
        "--sweep", type=int, nargs="+", default=list(SWEEP), metavar="N", help="--find-max's N"
    )
    parser.add_argument("--minutes", type=float, default=5.0, help="measured window per N")
    parser.add_argument(
        "--warmup", type=float, default=None, help="seconds after every target's first scrape"
    )
    parser.add_argument("--cpu-limit", type=float, default=1.5, help="cores Prometheus may use and sustain")
    parser.add_argument(
        "--interval-slack", type=float, default=0.25, help="how far p01/p99 of scrape intervals may stray"
    )
    parser.add_argument("--no-baseline", action="store_true", help="skip N = 0 (Prometheus with rules only)")
    parser.add_argument(
        "--faulty",
        type=float,
        default=0.0,
        metavar="SHARE",
        help="share of the nodes (0.1: every tenth) whose every InfiniBand port has had link-downs, "
        "integrity errors and buffer overruns this boot: the fast-path series a storm leaves behind",
    )
    parser.add_argument(
        "--config",
        type=Path,
        default=SHIPPED_CONFIG,
        help="another Prometheus configuration to read the scrape jobs from (a change under review); "
        "default: deploy/prometheus/prometheus.yaml",
    )
    parser.add_argument(
        "--rules",
        default=str(RULES / "*.yaml"),
        help="the rule files Prometheus loads (a glob; '' for none: what scraping alone costs); "
        "default: alerts/*.yaml",
    )
    args = parser.parse_args(argv)
    if not shutil.which("prometheus") or not shutil.which("kubectl"):
        print("skipped: prometheus and kubectl are needed (scripts/install-tools.sh)")
        return 0
    counts = sorted(args.sweep if args.find_max else args.nodes)
    config, template = load_config(args.config), exporter_template()
    jobs = exporter_jobs(config, template)
    print(f"loadavg {_loadavg()}; capturing the real exporter's bodies ...", flush=True)
    bodies = load_bodies(jobs)
    faulted = load_bodies(jobs, faulted=True) if args.faulty else {}
    runs: list[Run] = []
    with (
        tempfile.TemporaryDirectory(prefix="accel-health-fleet-") as tmp,
        FleetServer(bodies, max(counts), faulted=faulted, faulty=args.faulty) as server,
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
            interval_slack=args.interval_slack,
            rule_files=sorted(Path(f) for f in glob.glob(args.rules)) if args.rules else [],
        )
        for n in ([] if args.no_baseline else [0]) + counts:
            print(f"N={n} ... (loadavg {_loadavg()})", flush=True)
            run = bench.measure(n)
            runs.append(run)
            verdict = "sustains" if run.sustained else f"does not sustain ({'; '.join(run.problems)})"
            print(
                f"  {run.series:.0f} series, {run.samples_per_second:.0f} samples/s, "
                f"CPU {run.cpu_cores:.2f}, RSS {run.rss_bytes / 2**20:.0f} MiB: {verdict}",
                flush=True,
            )
            if args.find_max and n and not run.sustained:
                break
    report(runs, jobs)
    sustained = [r.nodes for r in runs if r.nodes and r.sustained]
    largest = max(sustained) if sustained else "none"
    print(f"\nlargest N sustained: {largest} (of {[r.nodes for r in runs if r.nodes]})")
    return 0 if sustained else 1


if __name__ == "__main__":
    sys.exit(main())
