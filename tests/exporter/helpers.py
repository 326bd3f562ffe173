"""Shared paths and small helpers for the exporter tests (no fixtures with side effects)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

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


GPU_BUS_PATHS = tuple(f"bus/pci/devices/{bus}.0" for bus in GPU_NODE_BUS_IDS)
"""Each GPU's directory relative to the sysfs root, through the bus symlink (as real sysfs has it)."""
