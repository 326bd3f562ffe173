"""NVML reading -> series. For now only availability (through the framework's collector_up)."""

from __future__ import annotations

from prometheus_client.core import Metric

from exporter.collectors.framework import SourceUnavailableError
from exporter.readers.nvml import NvmlReading


def nvml_metrics(reading: NvmlReading) -> list[Metric]:
    """No series yet (a later change adds ECC, remapped rows, PCIe replays); raises when unavailable."""
    if not reading.available:
        raise SourceUnavailableError(f"NVML unavailable: {reading.reason}")
    return []
