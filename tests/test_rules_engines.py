"""The rules give the same verdicts on Prometheus and on VictoriaMetrics (vmalert, MetricsQL).

Every promtool test file runs through both engines' own rule test runners
(scripts/compare_rule_engines.py, one test per file here; `make rules-engines` runs them all alone).
The other tests cover what that comparison relies on: the
comparison itself finds an engine difference and holds it against the list in alerts/README.md (real
promtool and vmalert-tool on a small rule that differs); the list names checks that exist; the Xid
numbers that gpu-xid.yaml repeats outside its class table (so that no rule reads a class recorded in
its own group, which vmalert shows one evaluation late) are the table's; no other rule reads a series
recorded in its own group unless its difference is listed.
"""

from __future__ import annotations

import contextlib
import io
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from scripts.compare_rule_engines import (
    GROUP_ERROR,
    TESTS_DIR,
    Check,
    duration_seconds,
    format_seconds,
    listed_differences,
    parse_failures,
    split_groups,
    victoria_metrics_bin,
)
from scripts.compare_rule_engines import main as compare_engines

REPO = Path(__file__).resolve().parent.parent
ALERTS = REPO / "alerts"
XID_RULES = ALERTS / "gpu-xid.yaml"
_XID_SELECTOR = re.compile(r'accel_gpu_xid_errors_total\{xid(=~|=|!~)"([^"]*)"\}')


def _numbers(regex: str) -> set[int]:
    return {int(n) for n in regex.split("|")}


def _selectors(expr: str) -> list[tuple[str, set[int]]]:
    return [(op, _numbers(numbers)) for op, numbers in _XID_SELECTOR.findall(expr)]


def _xid_rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(XID_RULES.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def _classes() -> dict[str, dict[str, Any]]:
    """xid_class -> its recording rule (the class table at the top of gpu-xid.yaml)."""
    return {
        r["labels"]["xid_class"]: r
        for r in _xid_rules()
        if r.get("record") == "accel:gpu_xid_errors:by_class"
    }


def _members(rule: dict[str, Any]) -> set[int]:
    """A class's own numbers: its first selector (45, sorted by the rule's second part, aside)."""
    return _selectors(rule["expr"])[0][1]


def _alert(name: str) -> dict[str, Any]:
    return next(r for r in _xid_rules() if r.get("alert") == name)


# -- the Xid numbers repeated outside the class table ----------------------------------------------


def test_the_xid_classes_do_not_overlap() -> None:
    classes = {name: _members(rule) for name, rule in _classes().items()}
    assert set(classes) == {"reset", "support", "recovery_action", "application", "ignore"}
    seen: dict[int, str] = {}
    for name, members in classes.items():
        for xid in members:
            assert xid not in seen, f"Xid {xid} is in class {seen[xid]} and in class {name}"
            seen[xid] = name
    assert 45 not in seen, "45 is sorted by its own rule (application alone, ignore beside a fault)"


@pytest.mark.parametrize(
    ("alert", "xid_class"),
    [
        ("AccelGPUFatalXid", "reset"),
        ("AccelGPUXidNeedsSupport", "support"),
        ("AccelGPUXidRecoveryAction", "recovery_action"),
    ],
)
def test_an_alert_that_acts_at_once_names_exactly_its_class_numbers(alert: str, xid_class: str) -> None:
    rule = _alert(alert)
    selectors = _selectors(rule["expr"])
    assert len(selectors) == 1, rule["expr"]
    op, numbers = selectors[0]
    assert op in {"=~", "="}
    members = _members(_classes()[xid_class])
    assert numbers == members, (
        f"{alert} names {sorted(numbers - members)} that class {xid_class} lacks and lacks "
        f"{sorted(members - numbers)} that it has: copy the class's numbers into its expr"
    )
    assert rule["labels"]["xid_class"] == xid_class
    assert "accel:" not in rule["expr"], (
        "an alert that acts at once reads the counters, not a recorded series"
    )


@pytest.mark.parametrize("xid_class", ["application", "ignore"])
def test_45_is_sorted_by_the_numbers_of_the_classes_that_make_it_a_consequence(xid_class: str) -> None:
    classes = _classes()
    selectors = _selectors(classes[xid_class]["expr"])
    assert [op for op, _ in selectors] == ["=~", "=", "=~"], classes[xid_class]["expr"]
    assert selectors[1][1] == {45}
    faults = set().union(*(_members(classes[c]) for c in ("reset", "support", "recovery_action")))
    partner = selectors[2][1]
    assert partner == faults, (
        f"the {xid_class} rule sorts 45 by {sorted(partner - faults)} that are in no reset, support or "
        f"recovery_action class and misses {sorted(faults - partner)} that are"
    )
    assert "accel:" not in classes[xid_class]["expr"]


def test_the_unclassified_alert_excludes_exactly_the_classified_numbers() -> None:
    rule = _alert("AccelGPUXidUnclassified")
    selectors = _selectors(rule["expr"])
    assert [op for op, _ in selectors] == ["!~"], rule["expr"]
    classified = set().union(*(_members(r) for r in _classes().values())) | {45}
    excluded = selectors[0][1]
    assert excluded == classified, (
        f"AccelGPUXidUnclassified leaves out {sorted(excluded - classified)}, which no class has, and "
        f"reports {sorted(classified - excluded)}, which a class has"
    )
    assert "accel:" not in rule["expr"]


# -- recorded series read in their own group -------------------------------------------------------


_LAST_MINUTE = re.compile(r"max_over_time\((\w+)\[1m\]\)")


def _newest_minute_read_directly(recording: dict[str, Any], reader: dict[str, Any]) -> bool:
    """A per-minute maximum recorded in the group, whose reader also takes the newest minute from the
    recording's own source series: what vmalert has not shown it yet, it reads itself."""
    sources = _LAST_MINUTE.findall(recording["expr"])
    return bool(sources) and all(f"max_over_time({src}[1m])" in reader["expr"] for src in sources)


def _read_only_from_before_the_last_evaluation(recorded: str, reader: dict[str, Any], interval: str) -> bool:
    """Every read of ``recorded`` is shifted back (``offset``) by at least the group's interval: the
    evaluation vmalert has not shown yet is not in it on either engine."""
    reads = re.findall(rf"{re.escape(recorded)}\b(\[[^\]]+\])?(\s+offset\s+(\w+))?", reader["expr"])
    return bool(reads) and all(
        offset and duration_seconds(offset) >= duration_seconds(interval) for _, _, offset in reads
    )


def test_no_rule_reads_a_series_recorded_in_its_own_group_unless_its_difference_is_listed() -> None:
    listed_alerts = {check.alert for check in listed_differences()}
    offenders = []
    for path in sorted(ALERTS.glob("*.yaml")):
        for group in yaml.safe_load(path.read_text())["groups"]:
            recordings = {r["record"]: r for r in group["rules"] if "record" in r}
            interval = group.get("interval", "1m")
            for rule in group["rules"]:
                name = rule.get("alert") or rule.get("record")
                reads = [
                    recorded
                    for recorded, recording in recordings.items()
                    if re.search(rf"{re.escape(recorded)}\b", rule["expr"])
                    and not _newest_minute_read_directly(recording, rule)
                    and not _read_only_from_before_the_last_evaluation(recorded, rule, interval)
                ]
                if reads and name not in listed_alerts:
                    offenders.append(f"{path.name}: {group['name']}: {name} reads {sorted(reads)}")
    assert offenders == [], "vmalert shows a recorded series to its own group one evaluation late"


# -- the list in alerts/README.md ------------------------------------------------------------------


def test_every_listed_difference_names_a_test_group_and_a_check_in_it() -> None:
    listed = listed_differences()
    for check, reason in listed.items():
        path = TESTS_DIR / check.test_file
        assert path.exists(), check.describe()
        groups = dict(split_groups(path))
        assert check.group in groups, check.describe()
        if check.alert != GROUP_ERROR:
            tests = groups[check.group]["tests"][0]["alert_rule_test"]
            checked = {(t["alertname"], duration_seconds(str(t["eval_time"]))) for t in tests}
            assert (check.alert, check.at) in checked, check.describe()
        assert len(reason.split()) >= 8, f"{check.describe()}: say why, not just that"


def test_durations_read_as_both_runners_print_them() -> None:
    assert duration_seconds("1m0s") == duration_seconds("1m") == 60
    assert duration_seconds("1h35m0s") == duration_seconds("1h35m") == 5700
    assert duration_seconds("0s") == 0
    assert format_seconds(5700) == "1h35m"
    assert format_seconds(0) == "0s"
    with pytest.raises(ValueError, match="not a duration"):
        duration_seconds("soon")


def test_a_runner_that_fails_without_naming_a_check_fails_the_whole_group() -> None:
    failures = parse_failures("f.yaml", "g", "failed to parse input series value 4e9", 1)
    assert failures == {Check("f.yaml", "g", GROUP_ERROR, -1.0)}
    assert parse_failures("f.yaml", "g", "SUCCESS", 0) == set()


# -- the comparison on the real runners ------------------------------------------------------------

needs_runners = pytest.mark.skipif(
    shutil.which("promtool") is None or victoria_metrics_bin(install=False) is None,
    reason="needs promtool and vmalert-tool (make tools installs them)",
)

# A series label that the alert's own labels overwrite: Prometheus replaces it, vmalert keeps the
# series' value as exported_severity. The same rule, and a second alert on which both agree.
_RULES = """\
groups:
  - name: example
    rules:
      - alert: Conflicting
        expr: demo_errors_total > 0
        labels: {severity: critical}
      - alert: Agreeing
        expr: max without (severity) (demo_errors_total) > 0
        labels: {severity: critical}
"""
_TESTS = """\
rule_files: [rules.yaml]
evaluation_interval: 1m
tests:
  - name: a series label the alert overwrites
    interval: 1m
    input_series:
      - series: 'demo_errors_total{node="n1",severity="fatal"}'
        values: '1 1'
    alert_rule_test:
      - {eval_time: 1m, alertname: Conflicting, exp_alerts: [{exp_labels: {node: n1, severity: critical}}]}
      - {eval_time: 1m, alertname: Agreeing, exp_alerts: [{exp_labels: {node: n1, severity: critical}}]}
"""
_README = """\
| test file | test group | alert | at | reason |
|---|---|---|---|---|
{rows}
"""


def _compare(tmp_path: Path, rows: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "rules.yaml").write_text(_RULES)
    (tmp_path / "example_test.yaml").write_text(_TESTS)
    readme = tmp_path / "README.md"
    readme.write_text(_README.format(rows=rows))
    argv = [sys.executable, "-m", "scripts.compare_rule_engines", "--jobs=1", f"--readme={readme}"]
    return subprocess.run(
        [*argv, str(tmp_path / "example_test.yaml")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@needs_runners
def test_a_difference_between_the_engines_that_is_not_listed_fails(tmp_path: Path) -> None:
    result = _compare(tmp_path, "")
    assert result.returncode == 1, result.stdout + result.stderr
    assert (
        "NOT LISTED: example_test.yaml: 'a series label the alert overwrites': Conflicting at 1m "
        "fails on vmalert-tool" in result.stdout
    )
    assert 'exported_severity="fatal"' in result.stdout
    assert "Agreeing" not in result.stdout.split("NOT LISTED")[1]


@needs_runners
def test_a_listed_difference_passes_and_a_stale_entry_fails(tmp_path: Path) -> None:
    row = (
        "| example_test.yaml | a series label the alert overwrites | Conflicting | 1m | "
        "vmalert keeps the series' own severity as exported_severity |"
    )
    listed = _compare(tmp_path, row)
    assert listed.returncode == 0, listed.stdout + listed.stderr
    assert "0 of 1 test groups give the same verdict" in listed.stdout
    assert "listed: example_test.yaml" in listed.stdout

    stale = row.replace("| Conflicting | 1m |", "| Agreeing | 1m |")
    both = _compare(tmp_path, row + "\n" + stale)
    assert both.returncode == 1
    assert "LISTED BUT GONE: example_test.yaml: 'a series label the alert overwrites': Agreeing at 1m" in (
        both.stdout
    )


# -- the scrape configurations -----------------------------------------------------------------------


def test_the_exporter_series_carry_no_pod_name_in_either_shipped_scrape_configuration() -> None:
    """A DaemonSet roll-out renames every pod: with `pod` on the series, every series of every node
    would start over (old counts read as rises by MetricsQL's increase(), alerts with a new identity).
    The name stays on the target, so `up` still says which pod failed a scrape."""
    drop = {"action": "labeldrop", "regex": "pod"}
    plain = yaml.safe_load((REPO / "deploy" / "prometheus" / "prometheus.yaml").read_text())
    exporter_jobs = [j for j in plain["scrape_configs"] if j["job_name"].startswith("accel-health-exporter")]
    assert len(exporter_jobs) == 2
    for job in exporter_jobs:
        assert {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"} in job[
            "relabel_configs"
        ]
        assert drop in job["metric_relabel_configs"], job["job_name"]
    monitors = list(
        yaml.safe_load_all((REPO / "deploy/components/prometheus-operator/monitors.yaml").read_text())
    )
    service_monitors = [m for m in monitors if m["kind"] == "ServiceMonitor"]
    assert len(service_monitors) == 2
    for monitor in service_monitors:
        for endpoint in monitor["spec"]["endpoints"]:
            assert drop in endpoint["metricRelabelings"], monitor["metadata"]["name"]


# -- every promtool test file on both engines ------------------------------------------------------


@pytest.mark.parametrize("test_file", sorted(p.name for p in TESTS_DIR.glob("*.yaml")))
def test_promtool_and_vmalert_tool_give_the_same_verdicts_on(test_file: str) -> None:
    """Each test group of the file through promtool and vmalert-tool: a verdict that differs fails
    unless alerts/README.md lists it with its reason, and a listed one that no longer occurs fails."""
    if not shutil.which("promtool") or victoria_metrics_bin(install=False) is None:
        pytest.skip("needs promtool and vmalert-tool (make tools installs them)")
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = compare_engines([str(TESTS_DIR / test_file), "--jobs", "2"])
    assert code == 0, out.getvalue()
