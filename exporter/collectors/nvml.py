"""NVML snapshot -> per-GPU health series (ECC, remapped rows, PCIe, NVLink, throttling, lost GPUs).

Every per-GPU series carries ``gpu`` (NVML index), ``uuid``, ``pci_bus_id`` (``0000:91:00``) and
``model``. A field the GPU does not support, or whose call failed, has no series (never a zero); a GPU
that is lost, timed out or stuck has only ``accel_gpu_nvml_up 0`` (and ``accel_gpu_lost 1`` or
``accel_gpu_nvml_call_stuck_seconds``). Values are raw: which counts matter is for the rules.
"""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from exporter.collectors.framework import SourceUnavailableError
from exporter.readers.nvml import NvmlGpuHealth, NvmlSnapshot, NvmlXidCounts

GPU_LABELS = ("gpu", "uuid", "pci_bus_id", "model")

_THROTTLE_REASONS = (
    "hw_slowdown",
    "hw_thermal_slowdown",
    "hw_power_brake",
    "sw_thermal_slowdown",
    "sw_power_cap",
)
_NVLINK_ERRORS = ("crc_flit", "crc_data", "replay", "recovery")


def _gauge(name: str, documentation: str, *extra: str) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, labels=[*GPU_LABELS, *extra])


def _counter(name: str, documentation: str, *extra: str) -> CounterMetricFamily:
    return CounterMetricFamily(name, documentation, labels=[*GPU_LABELS, *extra])


def _labels(gpu: NvmlGpuHealth, bus_ids: Mapping[int, str], uuids: Mapping[str, str]) -> list[str]:
    pci_bus_id = gpu.pci_bus_id or bus_ids.get(gpu.index, "")
    uuid = gpu.uuid or uuids.get(pci_bus_id, "")
    return [str(gpu.index), uuid, pci_bus_id, gpu.model]


def _put(family: GaugeMetricFamily | CounterMetricFamily, labels: list[str], value: float | None) -> None:
    if value is not None:
        family.add_metric(labels, value)


class _Families:
    """The per-GPU families of one scrape, filled one GPU at a time."""

    def __init__(self) -> None:
        self.up = _gauge(
            "accel_gpu_nvml_up", "Whether NVML answered for the GPU in this scrape (1) or not (0)."
        )
        self.lost = _gauge("accel_gpu_lost", "1 for a GPU NVML reports as lost (NVML_ERROR_GPU_IS_LOST).")
        self.stuck = _gauge(
            "accel_gpu_nvml_call_stuck_seconds",
            "How long an NVML call for the GPU has been outstanding after it exceeded a scrape's bound.",
            "call",
        )
        self.ecc = _gauge(
            "accel_gpu_ecc_errors",
            "ECC error counts; volatile since driver load, aggregate over the GPU's life (both can reset).",
            "error_type",
            "counter_type",
        )
        self.remapped = _gauge(
            "accel_gpu_remapped_rows", "Rows remapped, by the kind of error that caused it.", "cause"
        )
        self.remap_pending = _gauge(
            "accel_gpu_remapped_rows_pending", "1 while a row remap waits for a GPU reset."
        )
        self.remap_failure = _gauge("accel_gpu_remapped_rows_failure", "1 when a row remap failed.")
        self.retired = _gauge("accel_gpu_retired_pages", "Memory pages retired, by cause.", "cause")
        self.retired_pending = _gauge(
            "accel_gpu_retired_pages_pending", "1 while retired pages wait for the next driver reload."
        )
        self.generation = _gauge(
            "accel_gpu_pcie_link_generation", "PCIe link generation as NVML reports it.", "link"
        )
        self.width = _gauge(
            "accel_gpu_pcie_link_width", "PCIe link width (lanes) as NVML reports it.", "link"
        )
        self.replays = _counter("accel_gpu_pcie_replay_errors", "PCIe replays since the driver was loaded.")
        self.throughput = _gauge(
            "accel_gpu_pcie_throughput_bytes_per_second",
            "PCIe throughput NVML sampled over about 20 ms.",
            "direction",
        )
        self.nvlink_up = _gauge(
            "accel_gpu_nvlink_up", "Whether the NVLink link is active (1) or not (0).", "link"
        )
        self.nvlink_errors = _counter(
            "accel_gpu_nvlink_errors", "NVLink data-link error counters, by error.", "link", "error"
        )
        self.throttle = _gauge(
            "accel_gpu_clock_throttle_active",
            "1 while the clock-throttle (clocks-event) reason holds clocks down; supported reasons only.",
            "reason",
        )
        self.temperature = _gauge("accel_gpu_temperature_celsius", "GPU core temperature.")
        self.power = _gauge("accel_gpu_power_watts", "Board power draw.")

    def all(self) -> list[Metric]:
        return [
            self.up,
            self.lost,
            self.stuck,
            self.ecc,
            self.remapped,
            self.remap_pending,
            self.remap_failure,
            self.retired,
            self.retired_pending,
            self.generation,
            self.width,
            self.replays,
            self.throughput,
            self.nvlink_up,
            self.nvlink_errors,
            self.throttle,
            self.temperature,
            self.power,
        ]

    def add(self, gpu: NvmlGpuHealth, labels: list[str]) -> None:
        self.up.add_metric(labels, 1 if gpu.status == "ok" else 0)
        if gpu.status == "lost":
            self.lost.add_metric(labels, 1)
        _put(self.stuck, [*labels, gpu.stuck_call], gpu.stuck_seconds)
        self._memory(gpu, labels)
        self._pcie(gpu, labels)
        for nvlink in gpu.nvlinks:
            link = [*labels, str(nvlink.link)]
            _put(self.nvlink_up, link, None if nvlink.up is None else int(nvlink.up))
            for error in _NVLINK_ERRORS:
                _put(self.nvlink_errors, [*link, error], getattr(nvlink, error))
        if (reasons := gpu.clock_throttle) is not None:
            for reason in _THROTTLE_REASONS:
                active = getattr(reasons, reason)
                _put(self.throttle, [*labels, reason], None if active is None else int(active))
        _put(self.temperature, labels, gpu.temperature_celsius)
        _put(self.power, labels, gpu.power_watts)

    def _memory(self, gpu: NvmlGpuHealth, labels: list[str]) -> None:
        if (ecc := gpu.ecc) is not None:
            _put(self.ecc, [*labels, "corrected", "volatile"], ecc.volatile_corrected)
            _put(self.ecc, [*labels, "uncorrected", "volatile"], ecc.volatile_uncorrected)
            _put(self.ecc, [*labels, "corrected", "aggregate"], ecc.aggregate_corrected)
            _put(self.ecc, [*labels, "uncorrected", "aggregate"], ecc.aggregate_uncorrected)
        if (rows := gpu.remapped_rows) is not None:
            self.remapped.add_metric([*labels, "correctable"], rows.correctable)
            self.remapped.add_metric([*labels, "uncorrectable"], rows.uncorrectable)
            self.remap_pending.add_metric(labels, int(rows.pending))
            self.remap_failure.add_metric(labels, int(rows.failure))
        if (pages := gpu.retired_pages) is not None:
            _put(self.retired, [*labels, "single_bit_ecc"], pages.single_bit_ecc)
            _put(self.retired, [*labels, "double_bit_ecc"], pages.double_bit_ecc)
            _put(self.retired_pending, labels, None if pages.pending is None else int(pages.pending))

    def _pcie(self, gpu: NvmlGpuHealth, labels: list[str]) -> None:
        if (pcie := gpu.pcie) is None:
            return
        _put(self.generation, [*labels, "current"], pcie.current_generation)
        _put(self.generation, [*labels, "max"], pcie.max_generation)
        _put(self.width, [*labels, "current"], pcie.current_width)
        _put(self.width, [*labels, "max"], pcie.max_width)
        _put(self.replays, labels, pcie.replay_errors)
        _put(self.throughput, [*labels, "tx"], pcie.tx_bytes_per_second)
        _put(self.throughput, [*labels, "rx"], pcie.rx_bytes_per_second)


def nvml_metrics(
    snapshot: NvmlSnapshot,
    *,
    bus_ids: Mapping[int, str] | None = None,
    uuids: Mapping[str, str] | None = None,
) -> list[Metric]:
    """Metric families for one snapshot; raises :class:`SourceUnavailableError` when NVML is unavailable.

    ``bus_ids`` (GPU index -> pci_bus_id, from sysfs) and ``uuids`` (pci_bus_id -> uuid, from the
    driver's kernel-log lines) only fill labels NVML could not tell, e.g. for a GPU lost since boot.
    """
    if not snapshot.available:
        raise SourceUnavailableError(f"NVML unavailable: {snapshot.reason}")
    gpus = GaugeMetricFamily("accel_nvml_gpus", "GPUs NVML enumerates, lost ones included.")
    _put(gpus, [], snapshot.gpu_count)
    families = _Families()
    for gpu in snapshot.gpus:
        families.add(gpu, _labels(gpu, bus_ids or {}, uuids or {}))
    timeouts = CounterMetricFamily(
        "accel_nvml_call_timeouts",
        "NVML calls abandoned because they exceeded the scrape's bound (--nvml-timeout), since start.",
        labels=["call"],
    )
    for call, count in sorted(snapshot.call_timeouts.items()):
        timeouts.add_metric([call], count)
    field_errors = CounterMetricFamily(
        "accel_nvml_field_errors",
        "NVML calls that failed with an error other than NOT_SUPPORTED or GPU_IS_LOST, since start.",
        labels=["call", "error"],
    )
    for (call, error), count in sorted(snapshot.field_errors.items()):
        field_errors.add_metric([call, error], count)
    return [gpus, *families.all(), timeouts, field_errors]


def nvml_xid_metrics(xids: NvmlXidCounts) -> list[Metric]:
    """``accel_gpu_xid_errors_total`` from NVML's event API: the kernel-log family's name and labels.

    Counts start when the exporter began watching (not at boot, unlike the kernel-log counts).
    """
    family = CounterMetricFamily(
        "accel_gpu_xid_errors",
        "NVIDIA Xid events from NVML's event API since the exporter began watching (kernel log unreadable).",
        labels=["pci_bus_id", "gpu", "xid"],
    )
    for (pci_bus_id, xid), count in sorted(xids.counts.items()):
        index = xids.gpu_indices.get(pci_bus_id)
        family.add_metric([pci_bus_id, "" if index is None else str(index), str(xid)], count)
    return [family]
