"""Kernel-log counts -> Xid, fallen-off-bus, SXid, NEURON_HW_ERR and record counters.

MIG: Xid records from MIG instances (``GPU-I:``/``GPU-CI:``) carry the instance ids as the labels
``gpu_instance`` and ``compute_instance``; other series have exactly the contract's labels
``{pci_bus_id, gpu, xid}``.
"""

from __future__ import annotations

from collections.abc import Mapping

from exporter.metric import CounterMetricFamily, Metric
from exporter.readers.kmsg import KmsgSnapshot


def _gpu(gpu_indices: Mapping[str, int], pci_bus_id: str) -> str:
    index = gpu_indices.get(pci_bus_id)
    return "" if index is None else str(index)


def kmsg_metrics(snapshot: KmsgSnapshot, *, gpu_indices: Mapping[str, int]) -> list[Metric]:
    """Metric families for one snapshot; ``gpu_indices`` maps pci_bus_id to the GPU index."""
    xid = CounterMetricFamily(
        "accel_gpu_xid_errors",
        "NVIDIA Xid records in the kernel log since boot.",
        labels=["pci_bus_id", "gpu", "xid"],
    )
    for (pci, number, gpu_instance, compute_instance), count in sorted(snapshot.xid.items()):
        labels = {"pci_bus_id": pci, "gpu": _gpu(gpu_indices, pci), "xid": str(number)}
        if gpu_instance:
            labels["gpu_instance"] = gpu_instance
        if compute_instance:
            labels["compute_instance"] = compute_instance
        xid.add_sample("accel_gpu_xid_errors_total", labels, count)
    fell_off = CounterMetricFamily(
        "accel_gpu_fallen_off_bus",
        "GPU fall-offs the driver reported without an Xid number, once per fall-off, since boot.",
        labels=["pci_bus_id", "gpu"],
    )
    for pci, count in sorted(snapshot.fallen_off_bus.items()):
        fell_off.add_metric([pci, _gpu(gpu_indices, pci)], count)
    sxid = CounterMetricFamily(
        "accel_nvswitch_sxid_errors",
        "NVSwitch SXid records in the kernel log since boot.",
        labels=["pci_bus_id", "sxid"],
    )
    for (pci, number), count in sorted(snapshot.sxid.items()):
        sxid.add_metric([pci, str(number)], count)
    neuron = CounterMetricFamily(
        "accel_neuron_hw_errors",
        "NEURON_HW_ERR records in the kernel log since boot (neuron_device empty when not named).",
        labels=["neuron_device", "error"],
    )
    for (device, error), count in sorted(snapshot.neuron_hw_errors.items()):
        neuron.add_metric([device, error], count)
    records = CounterMetricFamily("accel_kmsg_records", "Kernel-log records read.")
    records.add_metric([], snapshot.records)
    missed = CounterMetricFamily(
        "accel_kmsg_missed_records",
        "Kernel-log records overwritten in the ring buffer before the exporter could read them.",
    )
    missed.add_metric([], snapshot.missed)
    return [xid, fell_off, sxid, neuron, records, missed]
