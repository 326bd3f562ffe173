"""The demo's pipeline scraped with the shipped scrape configuration, on Prometheus or VictoriaMetrics.

examples/pipeline.py runs the demo on Prometheus with a scrape configuration of its own (every second).
Here the exporters are scraped as deploy/prometheus/prometheus.yaml scrapes them: its jobs, intervals,
relabeling and metric relabeling verbatim, with only the Kubernetes service discovery replaced by
static targets that carry the labels discovery would give a pod (name, node, namespace, app label,
container port name). The rules of alerts/ then run either in Prometheus or, as a VictoriaMetrics user
runs them, in vmalert against a single-node VictoriaMetrics that scrapes the targets itself; both send
to the shipped Alertmanager routing (examples/alertmanager.yaml) and the remediator.

`roll_out(node)` plays a DaemonSet roll-out on one node: the exporter pod is replaced by one with a new
name and a new address, and the scrape configuration is reloaded, as discovery would.
"""

from __future__ import annotations

import json
import signal
import subprocess
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from examples.pipeline import RULES_DIR, Pipeline, free_port, http_get
from scripts.compare_rule_engines import victoria_metrics_bin

REPO = Path(__file__).resolve().parent.parent
SHIPPED_SCRAPE_CONFIG = REPO / "deploy" / "prometheus" / "prometheus.yaml"
NAMESPACE = "accel-health"
ENGINES = ("prometheus", "victoriametrics")

VM_LATENCY = ("-search.latencyOffset=1s", "-rule.evalDelay=1s")
"""What a VictoriaMetrics user sets for the latency budget of alerts/README.md (its section on
VictoriaMetrics says why): VictoriaMetrics hides the last 30 s of samples from queries by default, and
vmalert evaluates 30 s in the past to match."""


@dataclass(frozen=True)
class PodTarget:
    """A pod as Kubernetes service discovery would present it to the scrape configuration."""

    name: str
    app: str
    port_name: str
    node: str
    address: str

    def discovered_labels(self) -> dict[str, str]:
        return {
            "__meta_kubernetes_namespace": NAMESPACE,
            "__meta_kubernetes_pod_name": self.name,
            "__meta_kubernetes_pod_node_name": self.node,
            "__meta_kubernetes_pod_label_app_kubernetes_io_name": self.app,
            "__meta_kubernetes_pod_container_port_name": self.port_name,
        }


def shipped_scrape_configs(targets: list[PodTarget]) -> list[dict[str, Any]]:
    """deploy/prometheus/prometheus.yaml's scrape jobs, each offered every target (its own relabeling
    keeps the pods it selects), Kubernetes discovery replaced by the targets' discovered labels."""
    config = yaml.safe_load(SHIPPED_SCRAPE_CONFIG.read_text())
    jobs = []
    for shipped in config["scrape_configs"]:
        job = dict(shipped)
        (sd,) = job.pop("kubernetes_sd_configs")
        assert sd["role"] == "pod", sd
        job["static_configs"] = [{"targets": [t.address], "labels": t.discovered_labels()} for t in targets]
        jobs.append(job)
    return jobs


class ShippedScrapePipeline(Pipeline):
    """The demo's pipeline with the shipped scrape configuration, on ``engine``."""

    def __init__(self, *, workdir: Path, engine: str) -> None:
        super().__init__(workdir=workdir)
        if engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, not {engine!r}")
        self.engine = engine
        self.pod_names: dict[str, str] = {}
        self.retired: list[Any] = []
        """Processes stopped by a roll-out (their ports are checked at the end like the others')."""
        self.vmalert_port = 0
        self._rollouts = 0

    # -- what discovery would see ----------------------------------------------------------------

    def targets(self) -> list[PodTarget]:
        exporters = [
            PodTarget(
                name=self.pod_names.setdefault(node, f"accel-health-exporter-{node}-0"),
                app="accel-health-exporter",
                port_name="metrics",
                node=node,
                address=f"127.0.0.1:{port}",
            )
            for node, port in self.exporter_ports.items()
        ]
        remediator = PodTarget(
            name="accel-health-remediator-0",
            app="accel-health-remediator",
            port_name="http",
            node="control-plane-1",
            address=f"127.0.0.1:{self.remediator_port}",
        )
        return [*exporters, remediator]

    def _scrape_config(self) -> dict[str, Any]:
        shipped = yaml.safe_load(SHIPPED_SCRAPE_CONFIG.read_text())
        config: dict[str, Any] = {
            "global": shipped["global"],
            "scrape_configs": shipped_scrape_configs(self.targets()),
        }
        if self.engine == "victoriametrics":
            # vmalert takes the evaluation interval as a flag; the scraper knows only scrape settings.
            config["global"] = {k: v for k, v in shipped["global"].items() if k != "evaluation_interval"}
        else:
            config["rule_files"] = [str(p) for p in sorted(RULES_DIR.glob("*.yaml"))]
            config["alerting"] = {
                "alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{self.alertmanager_port}"]}]}]
            }
        return config

    def _write_scrape_config(self) -> Path:
        path = self.workdir / "scrape.yml"
        path.write_text(yaml.safe_dump(self._scrape_config(), sort_keys=False))
        return path

    # -- the rule engine ---------------------------------------------------------------------------

    def _spawn_rule_engine(self) -> None:
        config = self._write_scrape_config()
        self.prometheus_port = free_port()
        if self.engine == "prometheus":
            self._spawn(
                "prometheus",
                [
                    self.prometheus,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={self.workdir / 'prometheus-data'}",
                    f"--web.listen-address=127.0.0.1:{self.prometheus_port}",
                ],
                ports=(self.prometheus_port,),
            )
            return
        bindir = victoria_metrics_bin(install=False)
        if bindir is None:
            raise RuntimeError("VictoriaMetrics is not installed: run `make tools`")
        vm = f"http://127.0.0.1:{self.prometheus_port}"
        self._spawn(
            "victoria-metrics",
            [
                str(bindir / "victoria-metrics"),
                f"-promscrape.config={config}",
                f"-storageDataPath={self.workdir / 'victoria-metrics-data'}",
                f"-httpListenAddr=127.0.0.1:{self.prometheus_port}",
                VM_LATENCY[0],
            ],
            ports=(self.prometheus_port,),
        )
        shipped = yaml.safe_load(SHIPPED_SCRAPE_CONFIG.read_text())
        self.vmalert_port = free_port()
        self._spawn(
            "vmalert",
            [
                str(bindir / "vmalert"),
                *(f"-rule={p}" for p in sorted(RULES_DIR.glob("*.yaml"))),
                f"-datasource.url={vm}",
                f"-remoteWrite.url={vm}",
                f"-remoteRead.url={vm}",
                f"-notifier.url=http://127.0.0.1:{self.alertmanager_port}",
                f"-httpListenAddr=127.0.0.1:{self.vmalert_port}",
                f"-evaluationInterval={shipped['global']['evaluation_interval']}",
                VM_LATENCY[1],
            ],
            ports=(self.vmalert_port,),
        )

    def _wait_for_rule_engine(self, on_started: Callable[[str, str], None]) -> None:
        if self.engine == "prometheus":
            self._wait_http("prometheus", f"http://127.0.0.1:{self.prometheus_port}/-/ready")
            on_started("Prometheus", f"http://127.0.0.1:{self.prometheus_port} (rules from alerts/)")
        else:
            self._wait_http("victoria-metrics", f"http://127.0.0.1:{self.prometheus_port}/health")
            on_started("VictoriaMetrics", f"http://127.0.0.1:{self.prometheus_port} (shipped scrape config)")
            self._wait_http("vmalert", f"http://127.0.0.1:{self.vmalert_port}/health")
            on_started("vmalert", f"http://127.0.0.1:{self.vmalert_port} (rules from alerts/)")
        # The fast path is scraped every 2 s; the slow one every 60 s may take a minute to come.
        self.wait_until(
            "every exporter's fast path to be scraped",
            lambda: len(self.query('up{job="accel-health-exporter-fast"} == 1')) == len(self.exporter_ports),
            timeout=30.0,
        )

    def query(self, promql: str) -> list[dict[str, Any]]:
        url = f"http://127.0.0.1:{self.prometheus_port}/api/v1/query?" + urllib.parse.urlencode(
            {"query": promql}
        )
        result: list[dict[str, Any]] = json.loads(http_get(url))["data"]["result"]
        return result

    def firing_alerts(self) -> list[dict[str, str]]:
        """Firing alerts' labels; vmalert's `alertgroup` label (the rule group's name) left out."""
        port = self.prometheus_port if self.engine == "prometheus" else self.vmalert_port
        body = json.loads(http_get(f"http://127.0.0.1:{port}/api/v1/alerts"))
        return [
            {k: v for k, v in a["labels"].items() if k != "alertgroup"}
            for a in body["data"]["alerts"]
            if a["state"] == "firing"
        ]

    def stop(self) -> list[str]:
        """vmalert first: it flushes its remote writes into VictoriaMetrics as it stops, and would
        wait for them if VictoriaMetrics went first."""
        problems: list[str] = []
        for proc in [p for p in self.processes if p.name == "vmalert" and p.popen.poll() is None]:
            proc.popen.send_signal(signal.SIGTERM)
            try:
                proc.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                problems.append("vmalert ignored SIGTERM and was killed")
                proc.popen.kill()
                proc.popen.wait()
        return problems + super().stop()

    # -- a roll-out ----------------------------------------------------------------------------------

    def roll_out(self, node: str) -> str:
        """Replaces ``node``'s exporter pod by a new one (new name, new address) and reloads the
        scrape configuration as discovery would; returns the new pod's name."""
        name = f"exporter {node}"
        old = next(p for p in self.processes if p.name == name)
        old.popen.send_signal(signal.SIGTERM)
        old.popen.wait(timeout=10)
        self.processes.remove(old)
        self.retired.append(old)
        self._rollouts += 1
        self.pod_names[node] = f"accel-health-exporter-{node}-{self._rollouts}"
        self._start_exporter(node)
        self._wait_http(name, f"http://127.0.0.1:{self.exporter_ports[node]}/metrics")
        self._write_scrape_config()
        engine = next(p for p in self.processes if p.name in {"prometheus", "victoria-metrics"})
        engine.popen.send_signal(signal.SIGHUP)
        return self.pod_names[node]
