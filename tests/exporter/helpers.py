"""Shared paths and small helpers for the exporter tests (no fixtures with side effects)."""

from __future__ import annotations

import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import prometheus_client
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample as ClientSample

from exporter.metric import Metric, Sample

EXPORTER = Path(sys.executable).parent / "accel-health-exporter"
_LISTENING = re.compile(r"listening on (127\.0\.0\.1:\d+)")

NODES = Path(__file__).resolve().parents[2] / "examples" / "nodes"
GPU_NODE = NODES / "gpu-node-1"
TRN_NODE = NODES / "trn-node-1"

GPU_NODE_BUS_IDS = (
    "0000:1b:00",
    "0000:43:00",
    "0000:52:00",
    "0000:61:00",
    "0000:9d:00",
    "0000:c3:00",
    "0000:d1:00",
    "0000:df:00",
)
"""The DGX-H100-like node's GPUs, in index order."""


def wait_until(predicate: Callable[[], bool], *, timeout: float = 3.0, interval: float = 0.01) -> bool:
    """Polls ``predicate`` until it holds or ``timeout`` seconds pass; returns its last value."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
    return True


def sample_value(exposition: str, name: str, labels: Mapping[str, str] | None = None) -> float | None:
    """The value of one sample in a text exposition, None when absent."""
    wanted = dict(labels or {})
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if sample.name == name and sample.labels == wanted:
                return float(sample.value)
    return None


def client_metric(family: Metric) -> prometheus_client.Metric:
    """The same family as prometheus_client's own ``Metric``, sample by sample."""
    converted = prometheus_client.Metric(family.name, family.documentation, family.type, family.unit)
    converted.samples = [ClientSample(s.name, dict(s.labels), s.value, s.timestamp) for s in family.samples]
    return converted


def exporter_metric(family: prometheus_client.Metric) -> Metric:
    """A family prometheus_client parsed, as the exporter's own ``Metric``, sample by sample."""
    converted = Metric(family.name, family.documentation, family.type, family.unit)
    converted.samples = [Sample(s.name, dict(s.labels), s.value) for s in family.samples]
    return converted


class _ClientFamilies:
    def __init__(self, families: Iterable[Metric]) -> None:
        self.families = [client_metric(family) for family in families]

    def collect(self) -> list[prometheus_client.Metric]:
        return self.families


def client_text(families: Iterable[Metric]) -> str:
    """prometheus_client's ``generate_latest`` of the exporter's families: the reference encoder the
    exporter's own is held to."""
    registry = prometheus_client.CollectorRegistry(auto_describe=False)
    registry.register(_ClientFamilies(families))
    return prometheus_client.generate_latest(registry).decode()


GPU_BUS_PATHS = tuple(f"bus/pci/devices/{bus}.0" for bus in GPU_NODE_BUS_IDS)
"""Each GPU's directory relative to the sysfs root, through the bus symlink (as real sysfs has it)."""


@dataclass(frozen=True)
class Running:
    """A running ``accel-health-exporter`` process."""

    process: subprocess.Popen[bytes]
    url: str
    kmsg: Path
    log: Path

    def scrape(self, path: str = "/metrics") -> str:
        with urllib.request.urlopen(self.url + path, timeout=5) as response:  # noqa: S310 -- loopback URL
            body: bytes = response.read()
            return body.decode()


def spawn_exporter(*, kmsg: Path, sysfs_root: Path, log: Path, flags: Sequence[str]) -> Running:
    """Starts the real exporter on a free loopback port and waits until it listens.

    Output is appended to ``log``, so one log can follow an exporter across restarts: this waits for
    the new process's own "listening on" line.
    """
    before = len(_LISTENING.findall(log.read_text())) if log.exists() else 0
    with log.open("ab") as out:
        process = subprocess.Popen(
            [str(EXPORTER), "--listen=127.0.0.1:0", f"--kmsg={kmsg}", f"--sysfs-root={sysfs_root}", *flags],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    found: list[str] = []

    def listening() -> bool:
        found[:] = _LISTENING.findall(log.read_text())
        return len(found) > before or process.poll() is not None

    assert wait_until(listening, timeout=10), log.read_text()
    assert len(found) > before, log.read_text()
    return Running(process=process, url=f"http://{found[-1]}", kmsg=kmsg, log=log)
