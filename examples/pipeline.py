"""The whole accel-health pipeline on loopback, with nothing faked in the chain.

Two simulated nodes (an exporter process each, reading a kernel-log file and a sysfs fixture tree;
gpu-node-1's also serves active checks on simulated GPUs, see examples/fake_gpus.py), real Prometheus
loading the rule files from alerts/, real Alertmanager routing with
examples/alertmanager.yaml, and the remediator in dry-run mode against the cluster snapshot in
examples/. `make demo` prints what this module observes; tests/test_e2e.py asserts on it.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import random
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
NODES_DIR = REPO / "examples" / "nodes"
SNAPSHOT = REPO / "examples" / "cluster-snapshot.yaml"
ALERTMANAGER_CONFIG = REPO / "examples" / "alertmanager.yaml"
RULES_DIR = REPO / "alerts"
GPU_NODE = "gpu-node-1"
CHECKS = ("pciebw", "gpumem", "remapped", "power")
"""The checks gpu-node-1 offers: all but ``dcgm``, which needs DCGM installed."""

_PR_SET_PDEATHSIG = 1
_RECORD_PREFIX = re.compile(r"^\d+,(\d+),(\d+),")


@dataclass(frozen=True)
class Fault:
    """One kernel-log line the demo writes on a node, and what the pipeline should make of it."""

    node: str
    """Node whose kernel log receives the line."""
    message: str
    """The kernel message, as the driver prints it."""
    title: str
    """How the timeline names this fault."""
    query: str
    """PromQL selecting the series the exporter must publish for it."""
    alert_labels: dict[str, str]
    """Labels identifying the alert it must raise; empty when it must raise none."""


DEMO_FAULTS: tuple[Fault, ...] = (
    Fault(
        node="gpu-node-1",
        message=(
            "NVRM: Xid (PCI:0000:9d:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
        ),
        title="Xid 79 on GPU 4 (0000:9d:00): fallen off the bus",
        query='accel_gpu_xid_errors_total{node="gpu-node-1",pci_bus_id="0000:9d:00",xid="79"}',
        alert_labels={"alertname": "AccelGPUFatalXid", "node": "gpu-node-1", "xid": "79"},
    ),
    Fault(
        node="gpu-node-1",
        message=(
            "NVRM: Xid (PCI:0000:43:00): 13, pid=48213, name=python3, Graphics Exception: "
            "ESR 0x404600=0x80000002"
        ),
        title="Xid 13 on GPU 1 (0000:43:00): application error",
        query='accel_gpu_xid_errors_total{node="gpu-node-1",pci_bus_id="0000:43:00",xid="13"}',
        alert_labels={},
    ),
    Fault(
        node="trn-node-1",
        message=(
            "NEURON_HW_ERR=DMA_ERROR instance-id=i-0a1b2c3d4e5f60002 hostname=trn-node-1 nd-id=0 "
            "nc-id=0 serial-num=0x4f2a action=TERMINATE_INSTANCE"
        ),
        title="NEURON_HW_ERR=DMA_ERROR on neuron device 0",
        query='accel_neuron_hw_errors_total{node="trn-node-1",error="DMA_ERROR"}',
        alert_labels={"alertname": "AccelNeuronHardwareError", "node": "trn-node-1"},
    ),
)


@dataclass(frozen=True)
class SimulatedGpus:
    """How gpu-node-1's eight simulated H100s behave under active checks (examples/fake_gpus.py)."""

    slow_pcie: Mapping[int, float] = field(default_factory=dict)
    """GPU index -> GB/s it moves over PCIe each way (healthy ones move ~54)."""
    busy: tuple[int, ...] = ()
    """GPUs with a process on them: invasive checks leave them alone."""

    def arguments(self) -> list[str]:
        slow = [f"--fake-slow-pcie={gpu}={gbps:g}" for gpu, gbps in sorted(self.slow_pcie.items())]
        return slow + [f"--fake-busy={gpu}" for gpu in self.busy]


DEMO_GPUS = SimulatedGpus(busy=(6,))
"""The demo's GPUs: all healthy, a training process on GPU 6."""


@dataclass(frozen=True)
class Event:
    """One line of the timeline."""

    at: float
    """Seconds since the faults were written."""
    kind: str
    """fault written | series visible | alert firing | webhook received | decision"""
    text: str


@dataclass
class Outcome:
    """What the pipeline did with the faults."""

    events: list[Event] = field(default_factory=list)
    decisions: list[dict[str, Any]] = field(default_factory=list)
    """The remediator's decision records (GET /actions), in order."""
    firing: list[dict[str, str]] = field(default_factory=list)
    """Label sets of the alerts Prometheus had firing at the end."""
    webhook_alerts: dict[str, int] = field(default_factory=dict)
    """Alert names the remediator received, with how many decision records each produced."""
    startup_seconds: float = 0.0
    detection_seconds: float = 0.0


class PipelineError(RuntimeError):
    """A part of the pipeline did not start or did not do its job in time."""


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (the source ports of outgoing connections)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A loopback port nothing is bound to now, from the 12,000 below the ephemeral range: a port the
    kernel hands out for `bind(0)` is an ephemeral one, which any outgoing connection may take as its
    source port before the server meant for it binds it ("address already in use"); ports below the
    range are only ever taken by a bind. Picked at random, so that test workers rarely try the same."""
    low = _ephemeral_low()
    for _ in range(100):
        port = random.randrange(max(1024, low - 12000), low)  # noqa: S311 -- not a secret
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:  # everything there taken: any port
        sock.bind(("127.0.0.1", 0))
        found: int = sock.getsockname()[1]
        return found


def port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


def die_with_parent() -> None:
    """Runs in each child before exec: the kernel sends it SIGTERM if the demo itself dies."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def http_get(url: str, *, timeout: float = 2.0, token: str | None = None) -> bytes:
    request = urllib.request.Request(url)  # noqa: S310 -- loopback URLs built by this module
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310 -- as above
        body: bytes = response.read()
        return body


def _last_sequence(kmsg: Path) -> tuple[int, int]:
    """The last record's sequence number and timestamp in a kmsg-format file."""
    seq, ts = 0, 0
    for line in kmsg.read_text().splitlines():
        match = _RECORD_PREFIX.match(line)
        if match:
            seq, ts = int(match.group(1)), int(match.group(2))
    return seq, ts


@dataclass
class _Process:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    ports: tuple[int, ...]


class Pipeline:
    """Starts every part of the pipeline in a scratch directory and stops all of it again."""

    def __init__(
        self,
        *,
        workdir: Path,
        alertmanager_config: Path = ALERTMANAGER_CONFIG,
        extra_exporter_targets: Mapping[str, str] | None = None,
        gpus: SimulatedGpus = DEMO_GPUS,
        prometheus: str = "prometheus",
    ) -> None:
        self.workdir = workdir
        self.prometheus = prometheus
        """The Prometheus binary: the one on PATH, or a path (tests run 2.53 LTS beside 2.42)."""
        self.gpus = gpus
        self.alertmanager_config = alertmanager_config
        self.extra_exporter_targets = dict(extra_exporter_targets or {})
        """More targets of the exporter job, node -> HOST:PORT (tests serve fixture expositions)."""
        self.token = secrets.token_urlsafe(24)
        self.checks_token_file = workdir / "checks.token"
        """The bearer token gpu-node-1's ``GET /checks`` requires."""
        self.processes: list[_Process] = []
        self.exporter_ports: dict[str, int] = {}
        self.kmsg_files: dict[str, Path] = {}
        self.remediator_port = 0
        self.alertmanager_port = 0
        self.prometheus_port = 0

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self, *, on_started: Callable[[str, str], None] = lambda _name, _detail: None) -> None:
        bindir = Path(sys.executable).parent
        self.checks_token_file.write_text(secrets.token_urlsafe(24) + "\n")
        self.checks_token_file.chmod(0o600)
        for node in (GPU_NODE, "trn-node-1"):
            kmsg = self.workdir / f"{node}.kmsg"
            shutil.copyfile(NODES_DIR / node / "kmsg", kmsg)
            self.kmsg_files[node] = kmsg
            self._start_exporter(node)
        token_file = self.workdir / "remediator.token"
        token_file.write_text(self.token + "\n")
        token_file.chmod(0o600)
        self.remediator_port = free_port()
        self._spawn(
            "remediator",
            [
                str(bindir / "accel-health-remediator"),
                "--dry-run",
                f"--listen=127.0.0.1:{self.remediator_port}",
                f"--cluster-snapshot={SNAPSHOT}",
                f"--token-file={token_file}",
            ],
            ports=(self.remediator_port,),
        )
        self.alertmanager_port = free_port()
        am_config = self.workdir / "alertmanager.yaml"
        am_config.write_text(self._render_alertmanager_config(token_file))
        self._spawn(
            "alertmanager",
            [
                "prometheus-alertmanager",
                f"--config.file={am_config}",
                f"--storage.path={self.workdir / 'alertmanager-data'}",
                f"--web.listen-address=127.0.0.1:{self.alertmanager_port}",
                "--cluster.listen-address=",
            ],
            ports=(self.alertmanager_port,),
        )
        self._spawn_rule_engine()
        for node, port in self.exporter_ports.items():
            self._wait_http(f"exporter {node}", f"http://127.0.0.1:{port}/metrics")
            on_started(f"exporter {node}", f"http://127.0.0.1:{port}/metrics")
        self._wait_http("remediator", f"http://127.0.0.1:{self.remediator_port}/readyz")
        on_started("remediator", f"http://127.0.0.1:{self.remediator_port}/alerts (dry-run)")
        self._wait_http("alertmanager", f"http://127.0.0.1:{self.alertmanager_port}/-/ready")
        on_started("Alertmanager", f"http://127.0.0.1:{self.alertmanager_port} (examples/alertmanager.yaml)")
        self._wait_for_rule_engine(on_started)

    def _start_exporter(self, node: str) -> None:
        """Starts ``node``'s exporter on a new port (its kernel log and sysfs tree stay)."""
        bindir = Path(sys.executable).parent
        port = free_port()
        self.exporter_ports[node] = port
        common = [
            f"--listen=127.0.0.1:{port}",
            f"--kmsg={self.kmsg_files[node]}",
            f"--sysfs-root={NODES_DIR / node / 'sys'}",
        ]
        if node == GPU_NODE:
            # The real exporter on simulated NVML and CUDA, offering checks on demand only.
            argv = [
                sys.executable,
                "-m",
                "examples.fake_gpus",
                *self.gpus.arguments(),
                *common,
                "--nvml=on",
                f"--checks={','.join(CHECKS)}",
                f"--checks-token-file={self.checks_token_file}",
                "--checks-schedule=off",
                f"--node-name={node}",
            ]
            self._spawn(f"exporter {node}", argv, ports=(port,), env={"PYTHONPATH": str(REPO)})
        else:
            argv = [str(bindir / "accel-health-exporter"), *common, "--nvml=off"]
            self._spawn(f"exporter {node}", argv, ports=(port,))

    def _spawn_rule_engine(self) -> None:
        """Starts what scrapes the exporters and evaluates alerts/ (here Prometheus)."""
        self.prometheus_port = free_port()
        prom_config = self.workdir / "prometheus.yml"
        prom_config.write_text(self._render_prometheus_config())
        self._spawn(
            "prometheus",
            [
                self.prometheus,
                f"--config.file={prom_config}",
                f"--storage.tsdb.path={self.workdir / 'prometheus-data'}",
                f"--web.listen-address=127.0.0.1:{self.prometheus_port}",
            ],
            ports=(self.prometheus_port,),
        )

    def _wait_for_rule_engine(self, on_started: Callable[[str, str], None]) -> None:
        self._wait_http("prometheus", f"http://127.0.0.1:{self.prometheus_port}/-/ready")
        on_started("Prometheus", f"http://127.0.0.1:{self.prometheus_port} (rules from alerts/)")
        self._wait_for(
            "Prometheus to scrape every exporter target",
            lambda: (
                len(self.query('up{job=~"accel-health-exporter|accel-health-exporter-fast"} == 1'))
                == 2 * (len(self.exporter_ports) + len(self.extra_exporter_targets))
            ),
            timeout=30.0,
        )

    def stop(self) -> list[str]:
        """Stops every process (SIGTERM, then SIGKILL) and returns the problems seen while doing so."""
        problems: list[str] = []
        for proc in reversed(self.processes):
            if proc.popen.poll() is None:
                proc.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10.0
        for proc in reversed(self.processes):
            try:
                proc.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                problems.append(f"{proc.name} ignored SIGTERM and was killed")
                proc.popen.kill()
                proc.popen.wait()
        for proc in self.processes:
            for port in proc.ports:
                if not port_is_free(port):
                    problems.append(f"port {port} of {proc.name} still open")
        return problems

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- queries -------------------------------------------------------------------------------

    def query(self, promql: str) -> list[dict[str, Any]]:
        url = f"http://127.0.0.1:{self.prometheus_port}/api/v1/query?" + urllib.parse.urlencode(
            {"query": promql}
        )
        body = json.loads(http_get(url))
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def firing_alerts(self) -> list[dict[str, str]]:
        body = json.loads(http_get(f"http://127.0.0.1:{self.prometheus_port}/api/v1/alerts"))
        return [a["labels"] for a in body["data"]["alerts"] if a["state"] == "firing"]

    def decisions(self) -> list[dict[str, Any]]:
        body = http_get(f"http://127.0.0.1:{self.remediator_port}/actions", token=self.token)
        records = json.loads(body)
        if isinstance(records, dict):  # tolerate {"actions": [...]} as well as a bare list
            records = records.get("actions", [])
        result: list[dict[str, Any]] = records
        return result

    def log_tail(self, lines: int = 15) -> str:
        parts = []
        for proc in self.processes:
            text = proc.log.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {proc.name} (exit {proc.popen.poll()}) ---\n" + "\n".join(text))
        return "\n".join(parts)

    def check_command(self, *args: str) -> list[str]:
        """``accel-health check`` against the demo's GPU node (its exporter's ``GET /checks``)."""
        return [
            str(Path(sys.executable).parent / "accel-health"),
            "check",
            f"--endpoints={GPU_NODE}=http://127.0.0.1:{self.exporter_ports[GPU_NODE]}",
            f"--token-file={self.checks_token_file}",
            *args,
        ]

    def run_checks(self, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        """Runs ``accel-health check`` (a separate process, as an operator would) and returns its result."""
        return subprocess.run(
            self.check_command(*args), capture_output=True, text=True, timeout=timeout, check=False
        )

    def wait_until(self, what: str, check: Callable[[], bool], *, timeout: float) -> None:
        """Waits for ``check`` to hold; raises :class:`PipelineError` (with the logs) after ``timeout``."""
        self._wait_for(what, check, timeout=timeout)

    # -- fault injection -------------------------------------------------------------------------

    def write_fault(self, fault: Fault) -> None:
        """Appends one record, in /dev/kmsg format, to the node's kernel log."""
        kmsg = self.kmsg_files[fault.node]
        seq, ts = _last_sequence(kmsg)
        with kmsg.open("a") as out:
            out.write(f"3,{seq + 1},{ts + 1_000_000},-;{fault.message}\n")

    # -- internals -----------------------------------------------------------------------------

    def _spawn(
        self,
        name: str,
        argv: Sequence[str],
        *,
        ports: tuple[int, ...],
        env: Mapping[str, str] | None = None,
    ) -> None:
        log = self.workdir / f"{name.replace(' ', '-')}.log"
        with log.open("wb") as out:
            popen = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=self.workdir,
                env={**os.environ, **env} if env else None,
                # Own session: a Ctrl-C reaches the demo only, which then stops the parts in order.
                start_new_session=True,
                preexec_fn=die_with_parent,  # noqa: PLW1509 -- prctl only, no locks or threads touched
            )
        self.processes.append(_Process(name=name, popen=popen, log=log, ports=ports))

    def _wait_http(self, name: str, url: str, *, timeout: float = 30.0) -> None:
        def ready() -> bool:
            try:
                http_get(url, timeout=1.0, token=self.token)
            except (urllib.error.URLError, OSError):
                return False
            return True

        self._wait_for(f"{name} to answer {url}", ready, timeout=timeout)

    def _wait_for(self, what: str, check: Callable[[], bool], *, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for proc in self.processes:
                if proc.popen.poll() is not None:
                    raise PipelineError(f"{proc.name} exited with {proc.popen.returncode}\n{self.log_tail()}")
            if check():
                return
            time.sleep(0.1)
        raise PipelineError(f"timed out after {timeout:.0f}s waiting for {what}\n{self.log_tail()}")

    def _render_alertmanager_config(self, token_file: Path) -> str:
        """examples/alertmanager.yaml with only the webhook URL and the token path pointed here."""
        config = yaml.safe_load(self.alertmanager_config.read_text())
        for receiver in config.get("receivers", []):
            for hook in receiver.get("webhook_configs", []):
                hook["url"] = f"http://127.0.0.1:{self.remediator_port}/alerts"
                hook["http_config"]["authorization"]["credentials_file"] = str(token_file)
        rendered: str = yaml.safe_dump(config, sort_keys=False)
        return rendered

    def _render_prometheus_config(self) -> str:
        config = {
            # One-second intervals keep the demo short; the shipped manifests scrape the fast path every
            # 2 s and the slow one every 60 s (see alerts/README.md).
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(p) for p in sorted(RULES_DIR.glob("*.yaml"))],
            "alerting": {
                "alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{self.alertmanager_port}"]}]}]
            },
            "scrape_configs": [
                # The exporter's two paths as deploy/prometheus scrapes them (exporter/paths.py), both
                # every second here.
                {
                    "job_name": job,
                    "metrics_path": path,
                    "static_configs": [
                        # In a cluster the `node` label comes from the pod's node name (relabeling).
                        {"targets": [f"127.0.0.1:{port}"], "labels": {"node": node}}
                        for node, port in self.exporter_ports.items()
                    ]
                    + [
                        {"targets": [target], "labels": {"node": node}}
                        for node, target in self.extra_exporter_targets.items()
                    ],
                }
                for job, path in (
                    ("accel-health-exporter-fast", "/metrics/fast"),
                    ("accel-health-exporter", "/metrics/slow"),
                )
            ]
            + [
                {
                    # The remediator's own metrics (decisions, webhooks, budget), as its PodMonitor does.
                    "job_name": "accel-health-remediator",
                    "static_configs": [{"targets": [f"127.0.0.1:{self.remediator_port}"]}],
                },
            ],
        }
        rendered: str = yaml.safe_dump(config, sort_keys=False)
        return rendered


def _matches(labels: dict[str, str], wanted: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in wanted.items())


def _parse_time(value: str) -> float:
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def observe(
    pipeline: Pipeline,
    faults: Sequence[Fault] = DEMO_FAULTS,
    *,
    timeout: float = 45.0,
    on_event: Callable[[Event], None] = lambda _event: None,
) -> Outcome:
    """Writes the faults, then watches every stage until each expected decision has been made."""
    outcome = Outcome()

    def emit(at: float, kind: str, text: str) -> None:
        event = Event(at=at, kind=kind, text=text)
        outcome.events.append(event)
        on_event(event)

    t0_wall = time.time()
    t0 = time.monotonic()
    for fault in faults:
        pipeline.write_fault(fault)
        emit(time.monotonic() - t0, "fault written", f"{fault.node}: {fault.title}")

    seen_series: set[str] = set()
    seen_alerts: set[str] = set()
    seen_decisions = 0
    expected_nodes = {f.alert_labels["node"] for f in faults if f.alert_labels}
    deadline = t0 + timeout
    while True:
        now = time.monotonic() - t0
        for fault in faults:
            if fault.query not in seen_series:
                result = pipeline.query(fault.query)
                if result and float(result[0]["value"][1]) >= 1:
                    seen_series.add(fault.query)
                    emit(now, "series visible", f"{fault.query} = {result[0]['value'][1]}")
        for labels in pipeline.firing_alerts():
            key = json.dumps(labels, sort_keys=True)
            if key not in seen_alerts:
                seen_alerts.add(key)
                device = labels.get("gpu") or labels.get("neuron_device") or ""
                emit(
                    now,
                    "alert firing",
                    f"{labels['alertname']} node={labels.get('node')} device={device} "
                    f"severity={labels.get('severity')} remediation={labels.get('remediation')}",
                )
        records = pipeline.decisions()
        for record in records[seen_decisions:]:
            at = _parse_time(str(record["time"])) - t0_wall if record.get("time") else now
            alertname = str(record.get("alertname"))
            if alertname not in outcome.webhook_alerts:
                emit(at, "webhook received", f"{alertname} for {record.get('node')}")
            outcome.webhook_alerts[alertname] = outcome.webhook_alerts.get(alertname, 0) + 1
            verdict = (
                "DRY-RUN " + str(record.get("outcome")) if record.get("dry_run") else record.get("outcome")
            )
            emit(at, "decision", f"{record.get('node')}: {record.get('action')} -> {verdict}")
        seen_decisions = len(records)
        outcome.decisions = records
        decided_nodes = {str(r.get("node")) for r in records}
        if len(seen_series) == len(faults) and expected_nodes <= decided_nodes:
            # Every fault expected to act has acted: the application Xid had as long as they did.
            break
        if time.monotonic() > deadline:
            raise PipelineError(
                f"after {timeout:.0f}s: series seen {sorted(seen_series)}, alerts {sorted(seen_alerts)}, "
                f"decisions for {sorted(decided_nodes)}; expected decisions for {sorted(expected_nodes)}\n"
                + pipeline.log_tail()
            )
        time.sleep(0.1)
    outcome.detection_seconds = time.monotonic() - t0
    outcome.firing = pipeline.firing_alerts()
    return outcome


@contextlib.contextmanager
def scratch_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="accel-health-demo-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


INTERRUPTED = threading.Event()
"""Set by the first SIGINT or SIGTERM: the demo stops, whatever part of it the signal landed in."""


def _signal_as_interrupt(_signum: int, _frame: object) -> None:
    INTERRUPTED.set()
    raise KeyboardInterrupt


def install_sigterm_handler() -> None:
    """SIGTERM and SIGINT (Ctrl-C) both stop the demo. SIGINT gets this handler too, not Python's
    default: asyncio.run() replaces the default one by its own, which only cancels its main task, and
    a part that swallows that cancellation would let the demo run on to its end after a Ctrl-C (seen
    once on a loaded machine). This one raises KeyboardInterrupt wherever the main thread is, and
    `INTERRUPTED` says so even if something swallowed it."""
    signal.signal(signal.SIGTERM, _signal_as_interrupt)
    signal.signal(signal.SIGINT, _signal_as_interrupt)


def fault_matches_alert(fault: Fault, labels: dict[str, str]) -> bool:
    return bool(fault.alert_labels) and _matches(labels, fault.alert_labels)


__all__ = [
    "CHECKS",
    "DEMO_FAULTS",
    "DEMO_GPUS",
    "GPU_NODE",
    "Event",
    "Fault",
    "Outcome",
    "Pipeline",
    "PipelineError",
    "SimulatedGpus",
    "die_with_parent",
    "fault_matches_alert",
    "free_port",
    "install_sigterm_handler",
    "observe",
    "port_is_free",
    "scratch_dir",
]
