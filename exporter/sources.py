"""Wires readers to collectors: the named sources one exporter process runs, and its registry."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric

from exporter.collectors.framework import Source, SourcesCollector, SourceUnavailableError
from exporter.collectors.infiniband import infiniband_metrics
from exporter.collectors.kmsg import kmsg_metrics
from exporter.collectors.neuron import neuron_metrics
from exporter.collectors.nvml import nvml_metrics
from exporter.collectors.pci import pci_metrics
from exporter.readers.kmsg import KmsgFollower
from exporter.readers.nvml import NvmlReader
from exporter.readers.sysfs import (
    nvidia_gpu_indices,
    read_infiniband_ports,
    read_neuron_devices,
    read_pci_accelerators,
)

NvmlMode = Literal["auto", "on", "off"]


@dataclass(frozen=True)
class ExporterSettings:
    """What one exporter process reads."""

    kmsg_path: Path = Path("/dev/kmsg")
    """Kernel log: the /dev/kmsg device, or a regular file in its record format (followed)."""
    sysfs_root: Path = Path("/sys")
    """Root of the sysfs tree; tests and the demo point it at a fixture tree."""
    nvml: NvmlMode = "auto"
    """``off``: no NVML collector; ``auto``/``on``: collector up 0 while NVML is unavailable."""


def build_sources(
    settings: ExporterSettings, *, kmsg: KmsgFollower | None, nvml: NvmlReader | None
) -> list[Source]:
    """The sources, in scrape order; ``kmsg``/``nvml`` None leaves that source out."""
    root = settings.sysfs_root

    def collect_pci() -> list[Metric]:
        uuids = kmsg.snapshot().gpu_uuids if kmsg is not None else {}
        return pci_metrics(read_pci_accelerators(root), gpu_uuids=uuids)

    sources = [
        Source("pci", collect_pci),
        Source("infiniband", lambda: infiniband_metrics(read_infiniband_ports(root))),
        Source("neuron", lambda: neuron_metrics(read_neuron_devices(root))),
    ]
    if kmsg is not None:
        follower = kmsg

        def collect_kmsg() -> list[Metric]:
            snapshot = follower.snapshot()
            if snapshot.error is not None:
                raise SourceUnavailableError(snapshot.error)
            return kmsg_metrics(snapshot, gpu_indices=nvidia_gpu_indices(read_pci_accelerators(root)))

        sources.insert(0, Source("kmsg", collect_kmsg))
    if nvml is not None:
        reader = nvml
        sources.append(Source("nvml", lambda: nvml_metrics(reader.read())))
    return sources


def build_registry(sources: list[Source]) -> CollectorRegistry:
    """A fresh registry holding only the exporter's own collector."""
    registry = CollectorRegistry()
    registry.register(SourcesCollector(sources))
    return registry
