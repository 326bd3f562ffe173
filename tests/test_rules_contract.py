"""Invariants of the alert rules in alerts/ and the Alertmanager example that routes them.

Every alert has a severity, a remediation the default policy maps to actions, a summary, a description
and a runbook section; every alert has promtool tests that make it fire and keep it silent; fatal
alerts have no `for:`, so the documented latency budget (alerts/README.md) holds with the shipped
intervals and the example routing; the generated contract test is up to date.
"""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from remediator.policy import Drain, load_policy
from tests.contract_rule_test import OUTPUT as CONTRACT_TEST
from tests.contract_rule_test import render

REPO = Path(__file__).resolve().parent.parent
ALERTS = REPO / "alerts"
RUNBOOK = ALERTS / "runbook.md"
ALERTMANAGER = REPO / "examples" / "alertmanager.yaml"
RUNBOOK_URL = "https://github.com/accel-health/accel-health/blob/main/alerts/runbook.md#"

SEVERITIES = {"critical", "warning", "info"}
NODE_ACTIONS = {"drain", "replace", "cordon", "taint"}
FATAL = {"drain", "replace"}
"""Remediations of faults that kill jobs: with severity critical they must fire without `for:`."""

# The latency budget (alerts/README.md#latency-budget), seconds. The scrape and evaluation intervals
# are read from what ships (deploy/prometheus, the ServiceMonitor, the rule groups' own `interval`).
KMSG_FOLLOW = 1
SCRAPE_DURATION = 1
PROMETHEUS_TO_ALERTMANAGER = 1
WEBHOOK = 1
BUDGET = 30


@dataclass(frozen=True)
class Alert:
    file: str
    name: str
    rule: dict[str, Any]

    @property
    def labels(self) -> dict[str, str]:
        labels: dict[str, str] = self.rule.get("labels", {})
        return labels

    @property
    def annotations(self) -> dict[str, str]:
        annotations: dict[str, str] = self.rule.get("annotations", {})
        return annotations


def _load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def _alerts() -> list[Alert]:
    found: list[Alert] = []
    for path in sorted(ALERTS.glob("*.yaml")):
        for group in _load_yaml(path)["groups"]:
            found.extend(Alert(path.name, rule["alert"], rule) for rule in group["rules"] if "alert" in rule)
    return found


ALL_ALERTS = _alerts()
ALERT_IDS = [a.name for a in ALL_ALERTS]


def _seconds(duration: str | None) -> int:
    """A Prometheus duration (`5m`, `1h30m`, `0s`) in seconds; None is 0."""
    if not duration:
        return 0
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}
    parts = re.findall(r"(\d+)(ms|[smhdwy])", duration)
    assert "".join(n + u for n, u in parts) == duration, f"not a duration: {duration!r}"
    return int(sum(int(n) * units[u] for n, u in parts))


def _anchors(markdown: str) -> set[str]:
    """GitHub's anchors for the markdown's headings."""
    anchors = set()
    for heading in re.findall(r"^#+\s+(.+?)\s*$", markdown, flags=re.MULTILINE):
        anchor = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        anchors.add(anchor)
    return anchors


@functools.cache
def _runbook_sections() -> dict[str, str]:
    """`## Name` -> the text of its section."""
    text = RUNBOOK.read_text()
    parts = re.split(r"^## (.+?)\s*$", text, flags=re.MULTILINE)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts), 2)}


@functools.cache
def _promtool_checks() -> tuple[dict[str, Any], ...]:
    """Every alert_rule_test entry in alerts/tests/*.yaml."""
    checks: list[dict[str, Any]] = []
    for path in sorted((ALERTS / "tests").glob("*.yaml")):
        for test in _load_yaml(path)["tests"]:
            checks.extend(test.get("alert_rule_test", []))
    return tuple(checks)


def test_there_is_one_rule_file_per_area() -> None:
    files = {path.name for path in ALERTS.glob("*.yaml")}
    assert files == {
        "gpu-xid.yaml",
        "gpu-memory.yaml",
        "pcie-nvlink.yaml",
        "neuron.yaml",
        "infiniband.yaml",
        "exporter.yaml",
        "active-checks.yaml",
        "remediator.yaml",
    }
    assert len(ALERT_IDS) == len(set(ALERT_IDS)), "alert names must be unique"


@pytest.mark.parametrize("alert", ALL_ALERTS, ids=ALERT_IDS)
def test_every_alert_has_severity_remediation_and_text(alert: Alert) -> None:
    assert alert.name.startswith("Accel")
    assert alert.labels.get("severity") in SEVERITIES
    assert alert.labels.get("remediation") in NODE_ACTIONS | {"none"}
    assert alert.annotations.get("summary", "").strip()
    assert "{{" in alert.annotations.get("description", ""), "the description should carry values"


@pytest.mark.parametrize("alert", ALL_ALERTS, ids=ALERT_IDS)
def test_every_alert_links_to_its_own_runbook_section(alert: Alert) -> None:
    url = alert.annotations.get("runbook_url", "")
    assert url == RUNBOOK_URL + alert.name.lower()
    assert alert.name.lower() in _anchors(RUNBOOK.read_text())
    section = _runbook_sections()[alert.name]
    for part in ("**Meaning.**", "**Remediator.**", "**Next.**"):
        assert part in section, f"{alert.name}: runbook section lacks {part}"
    assert f"remediation={alert.labels['remediation']}" in section


def test_the_runbook_has_no_section_without_an_alert() -> None:
    assert set(_runbook_sections()) == set(ALERT_IDS)


@pytest.mark.parametrize("alert", ALL_ALERTS, ids=ALERT_IDS)
def test_the_default_policy_maps_every_remediation_to_its_rule(alert: Alert) -> None:
    policy = load_policy()
    labels = {"alertname": alert.name, **alert.labels}
    rule = policy.first_match(labels)
    assert rule is not None
    assert rule.name == alert.labels["remediation"]
    assert (rule.actions == ()) == (alert.labels["remediation"] == "none")


@pytest.mark.parametrize("alert", ALL_ALERTS, ids=ALERT_IDS)
def test_every_alert_has_promtool_tests_that_fire_it_and_keep_it_silent(alert: Alert) -> None:
    checks = [c for c in _promtool_checks() if c["alertname"] == alert.name]
    assert any(c.get("exp_alerts") for c in checks), f"no promtool test makes {alert.name} fire"
    assert any(not c.get("exp_alerts") for c in checks), f"no promtool test keeps {alert.name} silent"
    for check in checks:
        for expected in check.get("exp_alerts") or []:
            assert expected["exp_labels"]["severity"] == alert.labels["severity"]
            assert expected["exp_labels"]["remediation"] == alert.labels["remediation"]
            assert set(expected["exp_annotations"]) == {"summary", "description", "runbook_url"}


@pytest.mark.parametrize("alert", ALL_ALERTS, ids=ALERT_IDS)
def test_alerts_keep_the_node_label(alert: Alert) -> None:
    """Aggregations must keep `node`; only the cluster-wide "no targets at all" alert has none."""
    expr = str(alert.rule["expr"])
    for clause in re.findall(r"\b(?:by|on)\s*\(([^)]*)\)", expr):
        assert "node" in [label.strip() for label in clause.split(",")], f"{alert.name}: ({clause})"
    fired_labels = [
        e["exp_labels"]
        for c in _promtool_checks()
        if c["alertname"] == alert.name
        for e in c.get("exp_alerts") or []
    ]
    if alert.name != "AccelExporterTargetsAbsent":
        assert all("node" in labels for labels in fired_labels)


@pytest.mark.parametrize(
    "alert",
    [a for a in ALL_ALERTS if a.labels["severity"] == "critical" and a.labels["remediation"] in FATAL],
    ids=lambda a: a.name,
)
def test_fatal_alerts_fire_on_the_first_evaluation(alert: Alert) -> None:
    assert _seconds(alert.rule.get("for")) == 0
    assert _seconds(alert.rule.get("keep_firing_for")) > 0, "an exporter restart must not end the episode"


def test_the_fatal_alerts_are_the_ones_the_end_to_end_test_relies_on() -> None:
    by_name = {a.name: a for a in ALL_ALERTS}
    assert by_name["AccelGPUFatalXid"].labels == {"severity": "critical", "remediation": "drain"}
    assert by_name["AccelNeuronHardwareError"].labels == {"severity": "critical", "remediation": "replace"}


def _critical_route(config: dict[str, Any]) -> dict[str, Any]:
    routes: list[dict[str, Any]] = config["route"]["routes"]
    return next(r for r in routes if 'severity="critical"' in r.get("matchers", []))


def _shipped_scrape_interval() -> int:
    """The fast path's scrape interval (the series fatal alerts read), which the plain config and the
    ServiceMonitor must agree on."""
    prometheus = _load_yaml(REPO / "deploy" / "prometheus" / "prometheus.yaml")
    job = next(j for j in prometheus["scrape_configs"] if j["job_name"] == "accel-health-exporter-fast")
    assert job["metrics_path"] == "/metrics/fast"
    plain = _seconds(job.get("scrape_interval", prometheus["global"]["scrape_interval"]))
    monitors = yaml.safe_load_all(
        (REPO / "deploy" / "components" / "prometheus-operator" / "monitors.yaml").read_text()
    )
    monitor = next(m for m in monitors if m["metadata"]["name"] == "accel-health-exporter-fast")
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics/fast"
    assert _seconds(endpoint["interval"]) == plain
    return plain


def _fatal_evaluation_interval() -> int:
    """The slowest evaluation interval of a rule group holding a fatal alert: each such group sets its
    own, so the budget does not depend on a Prometheus's global setting."""
    intervals = []
    for path in sorted(ALERTS.glob("*.yaml")):
        for group in _load_yaml(path)["groups"]:
            fatal = [
                r
                for r in group["rules"]
                if "alert" in r
                and r.get("labels", {}).get("severity") == "critical"
                and r.get("labels", {}).get("remediation") in FATAL
            ]
            if fatal:
                assert "interval" in group, (
                    f"{path.name}: group {group['name']} holds fatal alerts: set its interval"
                )
                intervals.append(_seconds(group["interval"]))
    assert intervals
    return max(intervals)


def test_the_worst_case_latency_of_a_fatal_fault_is_within_30_seconds() -> None:
    route = _critical_route(_load_yaml(ALERTMANAGER))
    alertmanager_wait = max(_seconds(route["group_wait"]), _seconds(route["group_interval"]))
    to_firing = KMSG_FOLLOW + _shipped_scrape_interval() + SCRAPE_DURATION + _fatal_evaluation_interval()
    total = to_firing + PROMETHEUS_TO_ALERTMANAGER + alertmanager_wait + WEBHOOK
    assert to_firing == 5
    assert total <= BUDGET
    readme = (ALERTS / "README.md").read_text()
    assert f"**{to_firing} s**" in readme
    assert f"**{total} s**" in readme


def test_the_example_routing_groups_by_node_and_authenticates_with_a_token_file() -> None:
    config = _load_yaml(ALERTMANAGER)
    route = _critical_route(config)
    assert route["group_by"] == ["node"]
    assert route["receiver"] == "accel-health-remediator"
    receiver = next(r for r in config["receivers"] if r["name"] == "accel-health-remediator")
    authorization = receiver["webhook_configs"][0]["http_config"]["authorization"]
    assert authorization["type"] == "Bearer"
    assert authorization["credentials_file"].startswith("/")
    inhibit = config["inhibit_rules"][0]
    assert inhibit["equal"] == ["node"]


def test_the_policy_drains_for_drain_and_replace() -> None:
    policy = load_policy()
    for remediation in FATAL:
        rule = policy.first_match({"remediation": remediation})
        assert rule is not None
        assert any(isinstance(action, Drain) for action in rule.actions)


AMTOOL = shutil.which("amtool")


@pytest.mark.skipif(AMTOOL is None, reason="needs amtool (make test installs it)")
@pytest.mark.parametrize(
    ("labels", "receivers"),
    [
        ({"severity": "critical", "remediation": "drain"}, "accel-health-remediator,humans"),
        ({"severity": "critical", "remediation": "replace"}, "accel-health-remediator,humans"),
        ({"severity": "warning", "remediation": "taint"}, "accel-health-remediator,humans"),
        ({"severity": "warning", "remediation": "none"}, "humans"),
        ({"severity": "info", "remediation": "none"}, "humans"),
    ],
)
def test_alertmanager_routes_node_actions_to_the_remediator(labels: dict[str, str], receivers: str) -> None:
    result = subprocess.run(
        [
            str(AMTOOL),
            "config",
            "routes",
            "test",
            f"--config.file={ALERTMANAGER}",
            "node=gpu-node-1",
            *(f"{key}={value}" for key, value in labels.items()),
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    assert result.stdout.strip() == receivers


def test_the_contract_test_is_generated_from_the_current_rules_and_fixtures() -> None:
    assert CONTRACT_TEST.read_text() == render(), (
        "alerts/tests/contract_test.yaml is stale: "
        ".venv/bin/python -m tests.contract_rule_test > alerts/tests/contract_test.yaml"
    )


# -- the fast path -------------------------------------------------------------------------------------

SLOW_ON_PURPOSE = {
    "AccelInfinibandSymbolErrorRateHigh": "an hour's errors over a threshold: a minute's scrape is noise",
    "AccelGPUFatalXidRepeated": "repeats over a day, read from the fast group's recorded classes",
    "AccelCheckDCGMDiagnosticFailed": "an active check's result: it exists minutes after the check ran",
}
"""Critical alerts without `for:` that are not on the fast path, and why."""


def _groups() -> list[tuple[str, dict[str, Any]]]:
    return [
        (path.name, group) for path in sorted(ALERTS.glob("*.yaml")) for group in _load_yaml(path)["groups"]
    ]


def _series_read(expr: str, records: dict[str, list[str]], seen: frozenset[str] = frozenset()) -> set[str]:
    """The exporter series an expression reads, through the recording rules it reads."""
    found: set[str] = set()
    for name in re.findall(r"\b(accel(?:_|:)[a-z0-9_:]+)\b", expr):
        if name in seen:
            continue
        if name in records:
            for recorded in records[name]:
                found |= _series_read(recorded, records, seen | {name})
        else:
            found.add(name)
    return found


def test_critical_alerts_that_act_at_once_read_the_fast_path_every_second() -> None:
    from exporter.paths import FAST  # noqa: PLC0415 -- the exporter's own list, only here

    records: dict[str, list[str]] = {}
    for _file, group in _groups():
        for rule in group["rules"]:
            if "record" in rule:
                records.setdefault(rule["record"], []).append(rule["expr"])
    checked = []
    for file, group in _groups():
        for rule in group["rules"]:
            labels = rule.get("labels", {})
            if "alert" not in rule or labels.get("severity") != "critical" or rule.get("for"):
                continue
            if rule["alert"] in SLOW_ON_PURPOSE:
                continue
            checked.append(rule["alert"])
            where = f"{file}: {rule['alert']}"
            assert _seconds(group.get("interval")) == 1, f"{where}: its group must run every second"
            read = _series_read(rule["expr"], records)
            assert read, where
            assert read <= set(FAST), f"{where} reads {sorted(read - set(FAST))}, not on the fast path"
    assert len(checked) >= 10


def test_rules_in_the_fast_groups_look_back_at_most_ten_minutes() -> None:
    for file, group in _groups():
        if _seconds(group.get("interval")) > 1:
            continue
        for rule in group["rules"]:
            for window in re.findall(r"\[(\d+[smhd])", rule["expr"]):
                assert _seconds(window) <= 600, (
                    f"{file}: {rule.get('alert') or rule.get('record')} [{window}]"
                )
