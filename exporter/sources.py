"""Wires readers to collectors: the named sources one exporter process runs, and its registry.

Xid counts have two possible sources and one family, ``accel_gpu_xid_errors_total``: the kernel log
(since boot, the normal case) and NVML's event API (since the exporter began watching), used only
while the kernel log cannot be read. One exposition must never hold the family twice, and one Xid must
never be counted twice, so exactly one source publishes it per scrape; see :class:`XidOwnership`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from exporter.collectors.framework import (
    HardwareAbsentError,
    Source,
    SourcesCollector,
    SourceUnavailableError,
)
from exporter.collectors.infiniband import infiniband_metrics
from exporter.collectors.kmsg import kmsg_metrics
from exporter.collectors.neuron import neuron_metrics
from exporter.collectors.nvml import nvml_identity_metrics, nvml_metrics, nvml_xid_metrics
from exporter.collectors.pci import pci_metrics
from exporter.evidence import EvidenceStore
from exporter.metric import CollectorRegistry, CounterMetricFamily, Metric
from exporter.paths import FAST_INFINIBAND_COUNTERS, PathCollector, ScrapePath
from exporter.readers.kmsg import BOOT_ID_PATH, KmsgFollower
from exporter.readers.nvml import DEFAULT_TIMEOUT, NvmlReader
from exporter.readers.sysfs import (
    PciIdentity,
    nvidia_gpu_indices,
    read_infiniband_devices,
    read_infiniband_ports,
    read_neuron_devices,
    read_pci_accelerators,
)
from exporter.rises import CounterRises
from exporter.statefile import damaged_counts

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
    nvml_timeout: float = DEFAULT_TIMEOUT
    """Seconds one NVML read may take, all GPUs together; calls still running then are abandoned."""
    nvlink_per_link: bool = False
    """Also publish each NVLink's own series (90 a GPU; per GPU, all links together, is the default)."""


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


class _PciState:
    """What the ``pci`` source learnt in the latest scrape, for the sources that run after it.

    Replaced whole, never mutated in place, so a concurrent scrape sees one scrape's map or another's,
    never a half-built one.
    """

    def __init__(self) -> None:
        self.gpu_indices: Mapping[str, int] = {}
        """pci_bus_id -> GPU index, from the PCI bus."""


def build_sources(
    settings: ExporterSettings,
    *,
    kmsg: KmsgFollower | None,
    nvml: NvmlReader | None,
    brief: bool = False,
    evidence: EvidenceStore | None = None,
    rises: CounterRises | None = None,
) -> list[Source]:
    """The sources, in scrape order; ``kmsg``/``nvml`` None leaves that source out.

    The ``pci`` source runs first and reads the PCI bus once per scrape; the ``kmsg`` source labels
    its series with the GPU indices from that same read. ``brief`` sources (the fast path's, see
    :mod:`exporter.paths`) read only what that path serves: NVML's count, lost GPUs and row-remap
    state, the InfiniBand counters of :data:`FAST_INFINIBAND_COUNTERS` (their rises). ``evidence`` is
    handed every InfiniBand port reading (a ``link_downed`` increase is evidence), and so is ``rises``
    (hand the fast and the full sources the same one; None: one of their own, in memory).
    """
    root = settings.sysfs_root
    pci_state = _PciState()
    identities: dict[str, PciIdentity] = {}

    def collect_pci() -> list[Metric]:
        devices = read_pci_accelerators(root, identities=identities)
        pci_state.gpu_indices = nvidia_gpu_indices(devices)  # one reference swap: concurrent scrapes
        if not devices:
            raise HardwareAbsentError(f"no NVIDIA or Neuron devices under {root}/bus/pci/devices")
        uuids = kmsg.snapshot().gpu_uuids if kmsg is not None else {}
        return pci_metrics(devices, gpu_uuids=uuids)

    def collect_neuron() -> list[Metric]:
        devices = read_neuron_devices(root)
        if not devices:
            raise HardwareAbsentError(f"no Neuron devices under {root}/devices/virtual/neuron_device")
        return neuron_metrics(devices)

    sources = [
        Source("pci", collect_pci),
        _infiniband_source(root, brief=brief, evidence=evidence, rises=rises),
        Source("neuron", collect_neuron),
    ]
    xids = XidOwnership()
    if kmsg is not None:
        follower = kmsg

        def collect_kmsg() -> list[Metric]:
            xids.record(published=False)
            snapshot = follower.snapshot()
            if snapshot.error is not None:
                raise SourceUnavailableError(snapshot.error)
            families = kmsg_metrics(snapshot, gpu_indices=pci_state.gpu_indices)
            xids.record(published=True)
            return [*families, *state_file_metrics()]

        sources.insert(1, Source("kmsg", collect_kmsg))
    if nvml is not None:
        reader = nvml

        def collect_nvml() -> list[Metric]:
            snapshot = reader.read(brief=brief)
            if not snapshot.available and settings.nvml == "auto":
                # No usable NVIDIA driver on this node: absent hardware, not a failure. Rules compare
                # the GPUs on the PCI bus with NVML's to catch a GPU node whose driver is gone.
                raise HardwareAbsentError(f"NVML unavailable: {snapshot.reason}")
            bus_ids: Mapping[int, str] = {}
            uuids: Mapping[str, str] = {}
            if any(not gpu.pci_bus_id or not gpu.uuid for gpu in snapshot.gpus):
                bus_ids = {index: pci for pci, index in pci_state.gpu_indices.items()}
                uuids = kmsg.snapshot().gpu_uuids if kmsg is not None else {}
            families = nvml_metrics(snapshot, bus_ids=bus_ids, uuids=uuids, per_link=settings.nvlink_per_link)
            if not xids.kmsg_published():
                families.extend(nvml_xid_metrics(reader.xid_events()))
            if not brief:  # identity is read once and kept: the info series costs no NVML call
                families.extend(nvml_identity_metrics(reader.identity()))
            return families

        sources.append(Source("nvml", collect_nvml))
    return sources


def state_file_metrics() -> list[Metric]:
    """``accel_exporter_state_file_damaged_total{file}``: reads of a state file (``--state-dir``) that
    found it damaged, this process; the family appears with the first damaged read."""
    damaged = damaged_counts()
    if not damaged:
        return []
    family = CounterMetricFamily(
        "accel_exporter_state_file_damaged",
        "Reads of a state file in --state-dir that found it damaged (not JSON, cut short, malformed); "
        "the store went on without it.",
        labels=["file"],
    )
    for name, count in sorted(damaged.items()):
        family.add_metric([name], count)
    return [family]


def _infiniband_source(
    root: Path, *, brief: bool, evidence: EvidenceStore | None, rises: CounterRises | None
) -> Source:
    watched = rises if rises is not None else CounterRises(FAST_INFINIBAND_COUNTERS, directory=None)

    def collect_infiniband() -> list[Metric]:
        begun = time.monotonic()
        ports = read_infiniband_ports(root, counters=FAST_INFINIBAND_COUNTERS if brief else None)
        if not ports:
            raise HardwareAbsentError(f"no InfiniBand ports under {root}/class/infiniband")
        if evidence is not None:
            evidence.observe_infiniband(ports)
        seen = watched.observe(ports, read_at=begun)
        devices = () if brief else read_infiniband_devices(root)
        return infiniband_metrics(devices, ports, seen, ages=watched.ages(), brief=brief)

    return Source("infiniband", collect_infiniband)


def build_registry(sources: list[Source], path: ScrapePath = "all") -> CollectorRegistry:
    """A fresh registry holding only the exporter's own collector, serving ``path`` of it: the fast
    path's sources are brief ones (see :func:`build_sources`) and report no health of their own."""
    registry = CollectorRegistry()
    registry.register(PathCollector(SourcesCollector(sources, health=path != "fast"), path))
    return registry
