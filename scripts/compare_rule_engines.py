"""Runs every promtool test of alerts/tests through promtool and VictoriaMetrics' vmalert-tool.

A VictoriaMetrics user who installs the shipped PrometheusRule runs the rules, unchanged, on MetricsQL
and vmalert (the VictoriaMetrics operator converts the object by itself). The rules are meant to give
the same verdicts there, so each test group of each promtool test file runs through both runners
(``promtool test rules`` and ``vmalert-tool unittest --disableAlertgroupLabel``), one group at a time,
and every check (an alert at an evaluation time) that passes on one runner and fails on the other is
a difference. A difference fails this command unless alerts/README.md lists it, with its reason, in
the table headed ``| test file | test group | alert | at | reason |``; a listed difference that no
longer occurs fails it too, so the list stays true.

    python -m scripts.compare_rule_engines [--jobs N] [--readme FILE] [TEST_FILE ...]

vmalert-tool comes from scripts/install-victoria-metrics.sh (pinned; ``make tools``). It serves its
storage on the fixed port 8880 and keeps it under $TMPDIR/vmalert-unittest, so each run gets its own
TMPDIR and, where unprivileged namespaces allow, its own network namespace (``unshare -rn``); where
they do not, runs take turns under a lock file and the port must be free.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
TESTS_DIR = REPO / "alerts" / "tests"
README = REPO / "alerts" / "README.md"
INSTALLER = REPO / "scripts" / "install-victoria-metrics.sh"
TABLE_HEADER = ("test file", "test group", "alert", "at", "reason")
GROUP_ERROR = "(group)"
"""The alert column of a difference that is the whole group's (a runner could not run it at all)."""

_FAILURE = re.compile(r"alertname: (?P<alert>[^,\s]+), time: (?P<at>[0-9a-zµ.]+),")
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|µs|us|ns|h|m|s|d|w|y)")
_UNIT_SECONDS = {
    "ns": 1e-9,
    "us": 1e-6,
    "µs": 1e-6,
    "ms": 1e-3,
    "s": 1.0,
    "m": 60.0,
    "h": 3600.0,
    "d": 86400.0,
    "w": 604800.0,
    "y": 31536000.0,
}


def duration_seconds(text: str) -> float:
    """``1h35m``, ``1m0s``, ``90s``, ``0s`` (Go's and Prometheus' spellings) in seconds."""
    text = text.strip()
    parts = _DURATION_PART.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"not a duration: {text!r}")
    return sum(float(n) * _UNIT_SECONDS[u] for n, u in parts)


def format_seconds(seconds: float) -> str:
    """The shortest Prometheus spelling of a whole number of seconds: ``1h35m``, ``30s``, ``0s``."""
    whole = int(seconds)
    if whole != seconds:
        return f"{seconds:g}s"
    if whole == 0:
        return "0s"
    out = ""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if whole >= size:
            out += f"{whole // size}{unit}"
            whole %= size
    return out


@dataclass(frozen=True, order=True)
class Check:
    """One alert checked at one evaluation time in one test group (or the whole group)."""

    test_file: str
    """The test file's name in alerts/tests, e.g. ``gpu-xid_test.yaml``."""
    group: str
    """The test group's ``name``."""
    alert: str
    """The alert checked, or GROUP_ERROR when the runner could not run the group."""
    at: float
    """The evaluation time of the check, seconds from the start of the test (-1 for GROUP_ERROR)."""

    def describe(self) -> str:
        at = "" if self.alert == GROUP_ERROR else f" at {format_seconds(self.at)}"
        return f"{self.test_file}: {self.group!r}: {self.alert}{at}"


@dataclass
class GroupRun:
    """What each runner said about one test group."""

    test_file: str
    group: str
    failures: dict[str, set[Check]] = field(default_factory=dict)
    """Runner name -> the checks that failed on it."""
    outputs: dict[str, str] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    def differences(self) -> set[Check]:
        promtool, vm = self.failures["promtool"], self.failures["vmalert-tool"]
        return promtool ^ vm


# -- reading the test files and the list ------------------------------------------------------------


def split_groups(test_file: Path) -> list[tuple[str, dict[str, Any]]]:
    """One stand-alone test file per test group: (group name, document), rule files made absolute."""
    doc = yaml.safe_load(test_file.read_text())
    rule_files = [str((test_file.parent / rf).resolve()) for rf in doc.get("rule_files", [])]
    head = {k: v for k, v in doc.items() if k != "tests"}
    head["rule_files"] = rule_files
    out = []
    for number, group in enumerate(doc.get("tests", []), start=1):
        name = str(group.get("name") or f"#{number}")
        out.append((name, {**head, "tests": [group]}))
    return out


def listed_differences(readme: Path = README) -> dict[Check, str]:
    """The differences alerts/README.md lists, with their reasons."""
    listed: dict[Check, str] = {}
    in_table = False
    for line in readme.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if not cells:
            in_table = False
            continue
        if tuple(c.lower() for c in cells[: len(TABLE_HEADER)]) == TABLE_HEADER:
            in_table = True
            continue
        if not in_table or set("".join(cells)) <= set("-: "):
            continue
        test_file, group, alert, at = (c.strip("`") for c in cells[:4])
        reason = " | ".join(cells[4:])
        seconds = -1.0 if alert == GROUP_ERROR else duration_seconds(at)
        if not reason:
            raise ValueError(f"alerts/README.md lists {test_file} {group!r} {alert} without a reason")
        listed[Check(test_file, group, alert, seconds)] = reason
    return listed


# -- the runners -------------------------------------------------------------------------------------


def parse_failures(test_file: str, group: str, output: str, returncode: int) -> set[Check]:
    """The failed checks in a runner's output; a failure it does not attribute fails the whole group."""
    failures = {
        Check(test_file, group, m["alert"], duration_seconds(m["at"])) for m in _FAILURE.finditer(output)
    }
    if returncode != 0 and not failures:
        failures.add(Check(test_file, group, GROUP_ERROR, -1.0))
    return failures


def victoria_metrics_bin(*, install: bool = True) -> Path | None:
    """The folder of VictoriaMetrics' binaries (scripts/install-victoria-metrics.sh, which installs
    them when missing, unless ``install`` is false); None where they are missing and not installed."""
    bash = shutil.which("bash") or "/bin/bash"
    argv = [bash, str(INSTALLER)] + ([] if install else ["--installed"])
    result = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=600)
    if result.returncode != 0:
        if not install:
            return None
        raise RuntimeError(f"scripts/install-victoria-metrics.sh failed:\n{result.stderr}")
    return Path(result.stdout.strip())


def private_network() -> list[str]:
    """A command prefix that runs a command in its own network namespace (loopback up), or []."""
    unshare, ip = shutil.which("unshare"), shutil.which("ip")
    if unshare is None or ip is None:
        return []
    prefix = [unshare, "-rn", "sh", "-c", f'{ip} link set lo up && exec "$@"', "sh"]
    probe = subprocess.run([*prefix, "true"], capture_output=True, check=False)
    return prefix if probe.returncode == 0 else []


@contextlib.contextmanager
def _turn(lock_path: Path) -> Iterator[None]:
    with lock_path.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


class Runners:
    def __init__(self, *, vmalert_tool: Path, promtool: str, netns_prefix: list[str]) -> None:
        self.vmalert_tool = vmalert_tool
        self.promtool = promtool
        self.netns_prefix = netns_prefix
        self.lock_path = Path(tempfile.gettempdir()) / "accel-health-vmalert-tool.lock"

    def run(self, runner: str, path: Path, workdir: Path) -> tuple[int, str]:
        if runner == "promtool":
            argv = [self.promtool, "test", "rules", str(path)]
            result = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=900)
            return result.returncode, result.stdout + result.stderr
        tmp = workdir / "tmp"
        tmp.mkdir(exist_ok=True)
        argv = [str(self.vmalert_tool), "unittest", "--disableAlertgroupLabel", f"--files={path}"]
        env = {**os.environ, "TMPDIR": str(tmp)}
        if self.netns_prefix:
            argv = [*self.netns_prefix, *argv]
            lock: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
        else:
            lock = _turn(self.lock_path)
        with lock:
            result = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=900, env=env)
        return result.returncode, result.stdout + result.stderr

    def run_group(self, test_file: str, group: str, doc: dict[str, Any]) -> GroupRun:
        run = GroupRun(test_file=test_file, group=group)
        with tempfile.TemporaryDirectory(prefix="accel-health-engines-") as scratch:
            workdir = Path(scratch)
            path = workdir / test_file
            path.write_text(yaml.safe_dump(doc, sort_keys=False, allow_unicode=True))
            for runner in ("promtool", "vmalert-tool"):
                started = time.monotonic()
                code, output = self.run(runner, path, workdir)
                run.seconds[runner] = time.monotonic() - started
                run.outputs[runner] = output
                run.failures[runner] = parse_failures(test_file, group, output, code)
        return run


# -- the comparison ----------------------------------------------------------------------------------


@dataclass
class Report:
    runs: list[GroupRun]
    listed: dict[Check, str]
    unlisted: list[Check] = field(default_factory=list)
    stale: list[Check] = field(default_factory=list)
    promtool_failures: list[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.unlisted or self.stale or self.promtool_failures)


def compare(runs: Sequence[GroupRun], listed: dict[Check, str], *, test_files: set[str]) -> Report:
    report = Report(runs=list(runs), listed=listed)
    seen: set[Check] = set()
    for run in runs:
        report.promtool_failures.extend(sorted(run.failures["promtool"]))
        for check in sorted(run.differences()):
            seen.add(check)
            if check not in listed:
                report.unlisted.append(check)
    report.stale = sorted(c for c in listed if c.test_file in test_files and c not in seen)
    return report


def print_report(report: Report, out: Any = sys.stdout) -> None:
    by_file: dict[str, list[GroupRun]] = {}
    for run in report.runs:
        by_file.setdefault(run.test_file, []).append(run)
    same = sum(1 for run in report.runs if not run.differences())
    for test_file, runs in sorted(by_file.items()):
        print(f"{test_file}", file=out)
        for run in runs:
            diffs = sorted(run.differences())
            verdict = "same" if not diffs else f"{len(diffs)} difference(s)"
            times = "  ".join(f"{r} {s:.1f}s" for r, s in run.seconds.items())
            print(f"  {verdict:<17} {run.group}   ({times})", file=out)
            for check in diffs:
                where = "listed" if check in report.listed else "NOT LISTED"
                failing = [r for r, f in run.failures.items() if check in f]
                print(f"      {where}: {check.describe()} fails on {', '.join(failing)}", file=out)
    print(
        f"\n{same} of {len(report.runs)} test groups give the same verdict on promtool and vmalert-tool; "
        f"{len(report.listed)} difference(s) listed in alerts/README.md",
        file=out,
    )
    for check in report.promtool_failures:
        print(f"promtool fails {check.describe()} (make rules says why)", file=out)
    for check in report.unlisted:
        group_run = next(r for r in report.runs if (r.test_file, r.group) == (check.test_file, check.group))
        runner = next(r for r, f in group_run.failures.items() if check in f)
        output = group_run.outputs[runner]
        print(f"\nNOT LISTED: {check.describe()} fails on {runner} only:\n{output}", file=out)
    for check in report.stale:
        print(f"LISTED BUT GONE: {check.describe()}: remove it from alerts/README.md", file=out)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", type=Path, help="test files (default: alerts/tests/*.yaml)")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="groups run at once")
    parser.add_argument("--readme", type=Path, default=README, help="where the differences are listed")
    args = parser.parse_args(argv)
    files: list[Path] = args.files or sorted(TESTS_DIR.glob("*.yaml"))
    promtool = shutil.which("promtool")
    if promtool is None:
        print("promtool is missing: run `make tools`", file=sys.stderr)
        return 2
    bin_dir = victoria_metrics_bin()
    if bin_dir is None:
        return 2
    netns = private_network()
    runners = Runners(vmalert_tool=bin_dir / "vmalert-tool", promtool=promtool, netns_prefix=netns)
    work = [(f.name, name, doc) for f in files for name, doc in split_groups(f)]
    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        runs = list(pool.map(lambda item: runners.run_group(*item), work))
    report = compare(runs, listed_differences(args.readme), test_files={f.name for f in files})
    print_report(report)
    print(f"({time.monotonic() - started:.0f}s, {args.jobs} at a time)")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
