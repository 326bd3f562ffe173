"""Wires readers to collectors: the named sources one exporter process runs, and its registry."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric

from exporter.collectors.framework import (
    HardwareAbsentError,
    Source,
    SourcesCollector,
    SourceUnavailableError,
)
from exporter.collectors.infiniband import infiniband_metrics
from exporter.collectors.kmsg import kmsg_metrics
from exporter.collectors.neuron import neuron_metrics
from exporter.collectors.nvml import nvml_metrics
from exporter.collectors.pci import pci_metrics
from exporter.readers.kmsg import BOOT_ID_PATH, KmsgFollower
from exporter.readers.nvml import NvmlReader
from exporter.readers.sysfs import (
    PciIdentity,
    nvidia_gpu_indices,
    read_infiniband_devices,
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
    state_dir: Path | None = None
    """Where kernel-log counts survive a restart within one boot (a hostPath); None: memory only."""
    boot_id_path: Path = BOOT_ID_PATH
    """The file naming the current boot; state saved in another boot is ignored."""


def build_sources(
    settings: ExporterSettings, *, kmsg: KmsgFollower | None, nvml: NvmlReader | None
) -> list[Source]:
    """The sources, in scrape order; ``kmsg``/``nvml`` None leaves that source out.

    The ``pci`` source runs first and reads the PCI bus once per scrape; the ``kmsg`` source labels
    its series with the GPU indices from that same read.
    """
    root = settings.sysfs_root
    gpu_indices: dict[str, int] = {}
    identities: dict[str, PciIdentity] = {}

    def collect_pci() -> list[Metric]:
        devices = read_pci_accelerators(root, identities=identities)
        gpu_indices.clear()
        gpu_indices.update(nvidia_gpu_indices(devices))
        if not devices:
            raise HardwareAbsentError(f"no NVIDIA or Neuron devices under {root}/bus/pci/devices")
        uuids = kmsg.snapshot().gpu_uuids if kmsg is not None else {}
        return pci_metrics(devices, gpu_uuids=uuids)

    def collect_infiniband() -> list[Metric]:
        ports = read_infiniband_ports(root)
        if not ports:
            raise HardwareAbsentError(f"no InfiniBand ports under {root}/class/infiniband")
        return infiniband_metrics(read_infiniband_devices(root), ports)

    def collect_neuron() -> list[Metric]:
        devices = read_neuron_devices(root)
        if not devices:
            raise HardwareAbsentError(f"no Neuron devices under {root}/devices/virtual/neuron_device")
        return neuron_metrics(devices)

    sources = [
        Source("pci", collect_pci),
        Source("infiniband", collect_infiniband),
        Source("neuron", collect_neuron),
    ]
    if kmsg is not None:
        follower = kmsg

        def collect_kmsg() -> list[Metric]:
            snapshot = follower.snapshot()
            if snapshot.error is not None:
                raise SourceUnavailableError(snapshot.error)
            return kmsg_metrics(snapshot, gpu_indices=gpu_indices)

        sources.insert(1, Source("kmsg", collect_kmsg))
    if nvml is not None:
        reader = nvml
        sources.append(Source("nvml", lambda: nvml_metrics(reader.read())))
    return sources


def build_registry(sources: list[Source]) -> CollectorRegistry:
    """A fresh registry holding only the exporter's own collector."""
    registry = CollectorRegistry()
    registry.register(SourcesCollector(sources))
    return registry
