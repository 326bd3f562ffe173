"""End to end on VictoriaMetrics: the demo's faults give the same decisions as on Prometheus.

The same pipeline runs twice (tests/rule_engine_pipelines.py): real exporters scraped with the shipped
scrape configuration (deploy/prometheus/prometheus.yaml: both jobs, their intervals, relabeling and
metric relabeling), the rules of alerts/ evaluated by Prometheus, then by vmalert against a single-node
VictoriaMetrics that does the scraping, the shipped Alertmanager routing and the dry-run remediator.
After the faults, gpu-node-1's exporter is rolled out (a new pod name and address, the configuration
reloaded as service discovery would): on neither engine may that change a decision or an alert.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

from examples.pipeline import Outcome, observe, port_is_free, scratch_dir
from scripts.compare_rule_engines import victoria_metrics_bin
from tests.rule_engine_pipelines import ENGINES, ShippedScrapePipeline

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        not (shutil.which("prometheus") and shutil.which("prometheus-alertmanager"))
        or victoria_metrics_bin(install=False) is None,
        reason="needs Prometheus, Alertmanager and VictoriaMetrics (make tools installs them)",
    ),
]

FAST_JOB = "accel-health-exporter-fast"
SETTLE = 15.0
"""Seconds watched after the rolled-out exporter is scraped: the fast rule groups run 15 times."""


@dataclass
class EngineRun:
    engine: str
    outcome: Outcome
    new_pod: str = ""
    decisions_after_rollout: list[dict[str, Any]] = field(default_factory=list)
    firing_after_rollout: list[dict[str, str]] = field(default_factory=list)
    up_after_rollout: list[dict[str, str]] = field(default_factory=list)
    series_after_rollout: list[dict[str, str]] = field(default_factory=list)
    stop_problems: list[str] = field(default_factory=list)
    ports: list[int] = field(default_factory=list)


def _run(engine: str) -> EngineRun:
    with scratch_dir() as workdir:
        pipeline = ShippedScrapePipeline(workdir=workdir, engine=engine)
        try:
            pipeline.start()
            run = EngineRun(engine=engine, outcome=observe(pipeline, timeout=60.0))
            run.new_pod = pipeline.roll_out("gpu-node-1")
            pipeline.wait_until(
                "the rolled-out exporter to be scraped",
                lambda: bool(
                    pipeline.query(f'up{{job="accel-health-exporter-fast",pod="{run.new_pod}"}} == 1')
                ),
                timeout=30.0,
            )
            time.sleep(SETTLE)
            run.decisions_after_rollout = pipeline.decisions()
            run.firing_after_rollout = pipeline.firing_alerts()
            run.up_after_rollout = [
                r["metric"] for r in pipeline.query('up{job="accel-health-exporter-fast"}')
            ]
            run.series_after_rollout = [
                r["metric"] for r in pipeline.query('accel_gpu_xid_errors_total{node="gpu-node-1"}')
            ]
        finally:
            problems = pipeline.stop()
        run.stop_problems = problems
        run.ports = [port for proc in [*pipeline.processes, *pipeline.retired] for port in proc.ports]
        return run


@pytest.fixture(scope="module")
def runs() -> dict[str, EngineRun]:
    return {engine: _run(engine) for engine in ENGINES}


def _decisions(records: list[dict[str, Any]]) -> list[tuple[str, str, str, str, bool]]:
    return sorted(
        (r["node"], r["action"], r["alertname"], str(r["outcome"]), bool(r["dry_run"])) for r in records
    )


def _alerts(labels: list[dict[str, str]]) -> list[tuple[tuple[str, str], ...]]:
    return sorted(tuple(sorted(a.items())) for a in labels)


def test_victoriametrics_makes_the_same_decisions_as_prometheus(runs: dict[str, EngineRun]) -> None:
    prometheus, vm = runs["prometheus"].outcome, runs["victoriametrics"].outcome
    assert _decisions(vm.decisions) == _decisions(prometheus.decisions)
    assert {(d[0], d[2]) for d in _decisions(vm.decisions)} == {
        ("gpu-node-1", "AccelGPUFatalXid"),
        ("trn-node-1", "AccelNeuronHardwareError"),
    }
    actions = {d[1] for d in _decisions(vm.decisions) if d[0] == "gpu-node-1"}
    assert {"cordon", "drain"} <= actions
    assert "aws_set_unhealthy" in {d[1] for d in _decisions(vm.decisions) if d[0] == "trn-node-1"}


def test_the_same_alerts_fire_with_the_same_labels(runs: dict[str, EngineRun]) -> None:
    prometheus, vm = runs["prometheus"].outcome, runs["victoriametrics"].outcome
    assert _alerts(vm.firing) == _alerts(prometheus.firing)
    fatal = [a for a in vm.firing if a["alertname"] == "AccelGPUFatalXid"]
    assert [(a["node"], a["xid"], a["xid_class"], a["severity"]) for a in fatal] == [
        ("gpu-node-1", "79", "reset", "critical")
    ]


@pytest.mark.parametrize("engine", ENGINES)
def test_the_application_xid_is_counted_and_raises_nothing(runs: dict[str, EngineRun], engine: str) -> None:
    outcome = runs[engine].outcome
    assert any(e.kind == "series visible" and 'xid="13"' in e.text for e in outcome.events)
    assert [a for a in outcome.firing if a.get("xid") == "13"] == []


@pytest.mark.parametrize("engine", ENGINES)
def test_an_exporter_roll_out_changes_no_decision_and_no_alert(
    runs: dict[str, EngineRun], engine: str
) -> None:
    run = runs[engine]
    assert run.decisions_after_rollout == run.outcome.decisions
    assert _alerts(run.firing_after_rollout) == _alerts(run.outcome.firing)
    assert all("pod" not in a for a in run.firing_after_rollout)


@pytest.mark.parametrize("engine", ENGINES)
def test_up_keeps_the_pod_name_and_the_exporter_series_do_not(
    runs: dict[str, EngineRun], engine: str
) -> None:
    run = runs[engine]
    pods = {u["pod"] for u in run.up_after_rollout if u.get("node") == "gpu-node-1"}
    assert run.new_pod in pods
    assert run.series_after_rollout
    assert all("pod" not in s for s in run.series_after_rollout)
    assert {s["instance"] for s in run.series_after_rollout} == {"gpu-node-1"}


def test_a_fault_reaches_a_decision_within_the_budget_on_both(runs: dict[str, EngineRun]) -> None:
    for engine, run in runs.items():
        assert run.outcome.detection_seconds < 30.0, (engine, run.outcome.detection_seconds)


@pytest.mark.parametrize("engine", ENGINES)
def test_every_process_stops_and_every_port_is_released(runs: dict[str, EngineRun], engine: str) -> None:
    run = runs[engine]
    assert run.stop_problems == []
    assert all(port_is_free(port) for port in run.ports)
