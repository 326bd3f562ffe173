"""Accelerator PCI devices -> device counts, GPU info, PCIe link and AER series."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from exporter.exposition import FamilySpec
from exporter.metric import Metric
from exporter.readers.sysfs import PciDevice, nvidia_gpu_indices

_DEVICE_LABELS = ("pci_bus_id", "gpu", "vendor")


def _gauge(name: str, help_text: str) -> FamilySpec:
    return FamilySpec(name, help_text, "gauge", _DEVICE_LABELS)


COUNT = FamilySpec(
    "accel_pci_devices", "Accelerator devices on the PCI bus, by vendor.", "gauge", ("vendor",)
)
INFO = FamilySpec(
    "accel_gpu_info",
    "1 for each NVIDIA GPU known from sysfs or the driver's kernel-log lines; uuid empty if unknown.",
    "gauge",
    ("pci_bus_id", "gpu", "uuid"),
)
SPEED = {
    "current": _gauge(
        "accel_pcie_current_link_speed_transfers_per_second", "Negotiated PCIe speed per lane."
    ),
    "max": _gauge("accel_pcie_max_link_speed_transfers_per_second", "Maximum PCIe speed per lane."),
}
WIDTH = {
    "current": _gauge("accel_pcie_current_link_width", "Negotiated PCIe lanes."),
    "max": _gauge("accel_pcie_max_link_width", "Maximum PCIe lanes."),
}
BANDWIDTH = {
    "current": _gauge(
        "accel_pcie_current_link_bandwidth_bytes_per_second",
        "Payload bandwidth of the negotiated link, one direction, after line encoding.",
    ),
    "max": _gauge(
        "accel_pcie_max_link_bandwidth_bytes_per_second",
        "Payload bandwidth of the link at its maximum speed and width, one direction.",
    ),
}
AER = FamilySpec(
    "accel_pcie_aer_errors",
    "PCIe AER error counts by severity and error name (aer_dev_* files); a name is exported once "
    "its count is above 0, the per-severity totals always.",
    "counter",
    (*_DEVICE_LABELS, "severity", "error"),
)
AER_REPORTS = FamilySpec(
    "accel_pcie_aer_error_reports",
    "PCIe AER error reports by severity (TOTAL_ERR_* lines); the fatal count is exported once above 0.",
    "counter",
    (*_DEVICE_LABELS, "severity"),
)


def pci_metrics(devices: Sequence[PciDevice], *, gpu_uuids: Mapping[str, str]) -> list[Metric]:
    """Metric families for the accelerators found; ``gpu_uuids`` maps pci_bus_id to ``GPU-<uuid>``."""
    indices = nvidia_gpu_indices(devices)
    count = COUNT.family()
    for vendor in ("nvidia", "neuron"):
        found = sum(1 for device in devices if device.kind == vendor)
        if found:
            count.add((vendor,), found)

    info = INFO.family()
    for pci in sorted(set(indices) | set(gpu_uuids)):
        index = indices.get(pci)
        info.add((pci, "" if index is None else str(index), gpu_uuids.get(pci, "")), 1)

    speed = {which: spec.family() for which, spec in SPEED.items()}
    width = {which: spec.family() for which, spec in WIDTH.items()}
    bandwidth = {which: spec.family() for which, spec in BANDWIDTH.items()}
    aer, aer_reports = AER.family(), AER_REPORTS.family()
    for device in devices:
        index = indices.get(device.pci_bus_id)
        labels = (device.pci_bus_id, "" if index is None else str(index), device.kind)
        for which, link in (("current", device.current_link), ("max", device.max_link)):
            if link.speed_gts is not None:
                speed[which].add(labels, link.speed_gts * 1e9)
            if link.width is not None:
                width[which].add(labels, link.width)
            if (bytes_per_second := link.bandwidth_bytes_per_second) is not None:
                bandwidth[which].add(labels, bytes_per_second)
        for counters in device.aer:
            for error, value in sorted(counters.errors.items()):
                if value:  # ~44 names per device, nearly always 0: a name appears with its first error
                    aer.add((*labels, counters.severity, error), value)
            # The fatal count is on the fast path, read every 2 s on every node: a series only where a
            # fatal report was counted (AccelPCIeFatalAERError fires on any), as with Xids.
            if counters.total is not None and (counters.total or counters.severity != "fatal"):
                aer_reports.add((*labels, counters.severity), counters.total)
    return [count, info, *speed.values(), *width.values(), *bandwidth.values(), aer, aer_reports]
