"""The Grafana dashboards: their structure (stable uids, a Prometheus datasource variable, node and
GPU variables, only series that exist), and every panel's queries run against real Prometheus
scraping the exporters on the fixture nodes, the remediator and the NVML and checks fixtures, after
an on-demand `accel-health check` and with a fault injected: a query error or a panel without data
fails the test."""

from __future__ import annotations

import json
import re
import shutil
import threading
import time
import urllib.error
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from examples.pipeline import DEMO_FAULTS, Fault, Pipeline, PipelineError, http_get, scratch_dir
from exporter.exposition import generate_text
from exporter.metric import Metric
from exporter.paths import cut
from tests.exporter.helpers import exporter_metric

REPO = Path(__file__).resolve().parent.parent.parent
DASHBOARDS = {"fleet-overview.json": "accel-health-fleet", "node-detail.json": "accel-health-node"}
NVML_FIXTURE = REPO / "tests" / "fixtures" / "dashboards" / "nvml-gpu-node-1.prom"
CHECKS_FIXTURE = REPO / "tests" / "fixtures" / "dashboards" / "checks-gpu-node-1.prom"
"""The dcgm, ping and iperf series, which the demo's GPU node (no DCGM, no secondary network) lacks;
its pciebw, gpumem, remapped and power series come from a real `accel-health check` run."""
GOLDEN = REPO / "tests" / "fixtures" / "golden"
PENDING_METRICS = {"accel_remediator_breaker_open": "the storm breaker's gauge, with the breaker itself"}
"""Metrics a panel shows that no component exports yet. A panel made of these alone may be empty,
but only while the remediator really lacks them; its queries must still run without error."""
REMEDIATOR_METRICS = {
    "accel_remediator_actions_total",
    "accel_remediator_webhooks_total",
    "accel_remediator_nodes_disrupted",
    "accel_remediator_nodes_in_phase",
}
SUBSTITUTIONS = {"$__rate_interval": "20s", "$__interval": "2s", "$__range": "60s"}
"""What Grafana would put there for the test's 1 s scrape interval and a one-minute view."""
FAULTS = (
    *DEMO_FAULTS,  # Xid 79 on GPU 4 and Xid 13 on GPU 1 of gpu-node-1, a DMA error on trn-node-1
    *(
        Fault(node="gpu-node-1", message=line, title="GPU 5 fell off the bus", query="", alert_labels={})
        for line in (
            "NVRM: The NVIDIA GPU 0000:c3:00.0",
            "NVRM: (PCI ID: 10de:2330) installed in this system has",
            "NVRM: fallen off the bus and is not responding to commands.",
        )
    ),
    Fault(
        node="gpu-node-1",
        message="nvidia-nvswitch2: SXid (PCI:0000:07:00.0): 20034, Fatal, Link 04 LTSSM Fault Up",
        title="NVSwitch SXid 20034",
        query="",
        alert_labels={},
    ),
)
"""What the kernel logs of the fixture nodes get, written once Prometheus scrapes them."""
_METRIC = re.compile(r"\b(accel_[a-z0-9_]+|ALERTS|up)\b")


def load(name: str) -> dict[str, Any]:
    dashboard: dict[str, Any] = json.loads((REPO / "dashboards" / name).read_text())
    return dashboard


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            out.extend(panel.get("panels", []))
        else:
            out.append(panel)
    return out


def variables(dashboard: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in dashboard["templating"]["list"]}


def known_series() -> set[str]:
    """Every name the exporter's golden output and the NVML fixture hold or declare: a family that
    exists only where something is wrong (a lost GPU, a Neuron error kind) is declared by its TYPE
    line with no samples on a healthy node."""
    names = {"ALERTS", "up"} | REMEDIATOR_METRICS | set(PENDING_METRICS)
    for path in [*GOLDEN.glob("*.prom"), NVML_FIXTURE]:
        for line in path.read_text().splitlines():
            if line.startswith("# TYPE "):
                _, _, name, kind = line.split(maxsplit=3)
                names.add(name + "_total" if kind == "counter" and not name.endswith("_total") else name)
            elif line and not line.startswith("#"):
                names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


# -- structure -------------------------------------------------------------------------------------


def test_the_dashboard_files_are_the_expected_ones_with_stable_uids() -> None:
    assert {p.name for p in (REPO / "dashboards").glob("*.json")} == set(DASHBOARDS)
    for name, uid in DASHBOARDS.items():
        assert load(name)["uid"] == uid


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_every_panel_queries_the_datasource_variable(name: str) -> None:
    dashboard = load(name)
    datasource = variables(dashboard)["datasource"]
    assert (datasource["type"], datasource["query"]) == ("datasource", "prometheus")
    ids = [p["id"] for p in dashboard["panels"]] + [
        p["id"] for r in dashboard["panels"] for p in r.get("panels", [])
    ]
    assert len(ids) == len(set(ids))
    for panel in panels(dashboard):
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}"
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_node_and_gpu_variables_come_from_label_values(name: str) -> None:
    found = variables(load(name))
    assert found["node"]["definition"].startswith("label_values(")
    assert found["node"]["datasource"]["uid"] == "${datasource}"
    if name == "node-detail.json":
        assert found["gpu"]["definition"].startswith("label_values(")
        assert '"$node"' in found["gpu"]["definition"]
        assert found["gpu"]["includeAll"]
        assert found["gpu"]["allValue"] == ".*"


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_queries_name_only_series_that_exist(name: str) -> None:
    known = known_series()
    unknown = {
        (panel["title"], metric)
        for panel in panels(load(name))
        for target in panel["targets"]
        for metric in _METRIC.findall(target["expr"])
        if metric not in known
    }
    assert not unknown


# -- against real Prometheus -----------------------------------------------------------------------


class _Families:
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


def _serve_files(*paths: Path) -> ThreadingHTTPServer:
    """The files' series, split into the exporter's fast and slow paths as it serves them."""
    text = b"".join(path.read_bytes() for path in paths).decode()
    bodies = {
        f"/metrics/{part}": generate_text(
            _Families(list(cut(map(exporter_metric, text_string_to_metric_families(text)), part)))
        )
        for part in ("fast", "slow")
    }
    bodies["/metrics"] = text.encode()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = bodies[self.path]
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            del format, args

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, name="nvml-fixture", daemon=True).start()
    return server


@dataclass
class Live:
    pipeline: Pipeline

    def api(self, path: str, params: dict[str, str]) -> tuple[list[dict[str, Any]], str | None]:
        """(result, error) of a Prometheus HTTP API call."""
        url = f"http://127.0.0.1:{self.pipeline.prometheus_port}/api/v1/{path}?" + urllib.parse.urlencode(
            params
        )
        try:
            body = json.loads(http_get(url, timeout=10.0))
        except urllib.error.HTTPError as exc:
            return [], f"HTTP {exc.code}: {exc.read().decode(errors='replace')}"
        data = body["data"]
        return (data["result"] if isinstance(data, dict) else data), None

    def label_values(self, definition: str, scope: dict[str, str]) -> list[str]:
        match = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", definition)
        assert match, definition
        selector = substitute(match.group(1), scope)
        series, error = self.api("series", {"match[]": selector})
        assert error is None, error
        return sorted({s[match.group(2)] for s in series if s.get(match.group(2))})


def substitute(expr: str, scope: dict[str, str]) -> str:
    for name, value in {**SUBSTITUTIONS, **{f"${k}": v for k, v in scope.items()}}.items():
        expr = expr.replace(name, value)
    assert "$" not in expr, f"unsubstituted variable in {expr}"
    return expr


@pytest.fixture(scope="module")
def live() -> Iterator[Live]:
    if not (shutil.which("prometheus") and shutil.which("prometheus-alertmanager")):
        pytest.skip("needs Prometheus and Alertmanager (make test installs them)")
    server = _serve_files(NVML_FIXTURE, CHECKS_FIXTURE)
    try:
        with scratch_dir() as workdir:
            pipeline = Pipeline(
                workdir=workdir,
                extra_exporter_targets={"gpu-node-1": f"127.0.0.1:{server.server_address[1]}"},
            )
            try:
                pipeline.start()
                checked = pipeline.run_checks()  # the check panels' series, as an operator makes them
                assert checked.returncode == 0, checked.stdout + checked.stderr
                for fault in FAULTS:
                    pipeline.write_fault(fault)
                deadline = time.monotonic() + 40.0
                while not pipeline.query('sum(accel_remediator_actions_total{outcome!="ignored"}) > 0'):
                    if time.monotonic() > deadline:
                        raise PipelineError(
                            "no remediation decision reached Prometheus\n" + pipeline.log_tail()
                        )
                    time.sleep(0.2)
                yield Live(pipeline)
            finally:
                pipeline.stop()
    finally:
        server.shutdown()
        server.server_close()


def _panel_results(live: Live, panel: dict[str, Any], scope: dict[str, str]) -> tuple[int, list[str]]:
    """(series returned, query errors) for one panel in one variable scope."""
    series, errors = 0, []
    now = time.time()
    for target in panel["targets"]:
        expr = substitute(target["expr"], scope)
        if target.get("instant"):
            result, error = live.api("query", {"query": expr, "time": f"{now:.3f}"})
        else:
            params = {"query": expr, "start": f"{now - 60:.3f}", "end": f"{now:.3f}", "step": "2"}
            result, error = live.api("query_range", params)
        if error:
            errors.append(f"{target['refId']}: {expr}: {error}")
        series += len(result)
    return series, errors


def _scopes(live: Live, dashboard: dict[str, Any]) -> list[dict[str, str]]:
    found = variables(dashboard)
    nodes = live.label_values(found["node"]["definition"], {})
    assert set(nodes) == {"gpu-node-1", "trn-node-1"}
    if found["node"].get("includeAll"):
        return [{"node": found["node"]["allValue"], "gpu": ".*"}]
    scopes = []
    for node in nodes:
        scope = {"node": node, "gpu": ".*"}
        if "gpu" in found and node == "gpu-node-1":
            assert live.label_values(found["gpu"]["definition"], scope) == [str(i) for i in range(8)]
        scopes.append(scope)
    return scopes


@pytest.mark.e2e
@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_every_panel_has_data_and_no_query_fails(live: Live, name: str) -> None:
    dashboard = load(name)
    scopes = _scopes(live, dashboard)
    pending = {m for m in PENDING_METRICS if not live.pipeline.query(m)}
    deadline = time.monotonic() + 15.0
    while True:
        errors: list[str] = []
        empty: list[str] = []
        for panel in panels(dashboard):
            total = 0
            for scope in scopes:
                series, problems = _panel_results(live, panel, scope)
                total += series
                errors.extend(f"{panel['title']}: {p}" for p in problems)
            metrics = {m for t in panel["targets"] for m in _METRIC.findall(t["expr"])}
            if total == 0 and not (metrics and metrics <= pending):
                empty.append(panel["title"])
        # Rates need two samples after the fault: give the slowest panels a few scrapes.
        if errors or not empty or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    assert not errors, "\n".join(errors)
    assert not empty, f"panels without data in {name}: {empty}"


@pytest.mark.e2e
def test_the_injected_fault_shows_in_the_xid_and_action_panels(live: Live) -> None:
    scope = {"node": ".*", "gpu": ".*"}
    xids = live.api(
        "query",
        {"query": substitute('sum by (node, xid) (accel_gpu_xid_errors_total{node=~"$node"}) > 0', scope)},
    )[0]
    assert {"node": "gpu-node-1", "xid": "79"} in [r["metric"] for r in xids]
    value = next(float(r["value"][1]) for r in xids if r["metric"] == {"node": "gpu-node-1", "xid": "79"})
    assert value == 1
    actions = live.api("query", {"query": "sum by (action, dry_run) (accel_remediator_actions_total)"})[0]
    assert {"action": "cordon", "dry_run": "true"} in [r["metric"] for r in actions]
