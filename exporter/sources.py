"""Wires readers to collectors: the named sources one exporter process runs, and its registry.

Xid counts have two possible sources and one family, ``accel_gpu_xid_errors_total``: the kernel log
(since boot, the normal case) and NVML's event API (since the exporter began watching), used only
while the kernel log cannot be read. One exposition must never hold the family twice, and one Xid must
never be counted twice, so exactly one source publishes it per scrape; see :class:`XidOwnership`.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric

from exporter.collectors.framework import Source, SourcesCollector, SourceUnavailableError
from exporter.collectors.infiniband import infiniband_metrics
from exporter.collectors.kmsg import kmsg_metrics
from exporter.collectors.neuron import neuron_metrics
from exporter.collectors.nvml import nvml_metrics, nvml_xid_metrics
from exporter.collectors.pci import pci_metrics
from exporter.readers.kmsg import KmsgFollower
from exporter.readers.nvml import DEFAULT_TIMEOUT, NvmlReader
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
    nvml_timeout: float = DEFAULT_TIMEOUT
    """Seconds one NVML read may take, all GPUs together; calls still running then are abandoned."""


class XidOwnership:
    """Records, per scrape, whether the kernel-log source published the Xid family.

    The kernel-log source runs first in every scrape and calls :meth:`record`; the NVML source
    publishes NVML's Xid counts only when :meth:`kmsg_published` is False. The record is kept per
    thread because concurrent scrapes run on separate threads: a shared flag could let one scrape act
    on another's record and publish the family twice (the kernel log can fail between the two).
    """

    def __init__(self) -> None:
        self._local = threading.local()

    def record(self, *, published: bool) -> None:
        self._local.published = published

    def kmsg_published(self) -> bool:
        """Whether the kernel-log source published the family in this thread's current scrape."""
        return bool(getattr(self._local, "published", False))


def _bus_ids_by_index(root: Path) -> Mapping[int, str]:
    return {index: pci for pci, index in nvidia_gpu_indices(read_pci_accelerators(root)).items()}


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
    xids = XidOwnership()
    if kmsg is not None:
        follower = kmsg

        def collect_kmsg() -> list[Metric]:
            xids.record(published=False)
            snapshot = follower.snapshot()
            if snapshot.error is not None:
                raise SourceUnavailableError(snapshot.error)
            families = kmsg_metrics(snapshot, gpu_indices=nvidia_gpu_indices(read_pci_accelerators(root)))
            xids.record(published=True)
            return families

        sources.insert(0, Source("kmsg", collect_kmsg))
    if nvml is not None:
        reader = nvml

        def collect_nvml() -> list[Metric]:
            snapshot = reader.read()
            bus_ids: Mapping[int, str] = {}
            uuids: Mapping[str, str] = {}
            if any(not gpu.pci_bus_id or not gpu.uuid for gpu in snapshot.gpus):
                bus_ids = _bus_ids_by_index(root)
                uuids = kmsg.snapshot().gpu_uuids if kmsg is not None else {}
            families = nvml_metrics(snapshot, bus_ids=bus_ids, uuids=uuids)
            if not xids.kmsg_published():
                families.extend(nvml_xid_metrics(reader.xid_events()))
            return families

        sources.append(Source("nvml", collect_nvml))
    return sources


def build_registry(sources: list[Source]) -> CollectorRegistry:
    """A fresh registry holding only the exporter's own collector."""
    registry = CollectorRegistry()
    registry.register(SourcesCollector(sources))
    return registry
