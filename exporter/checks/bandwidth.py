"""``pciebw`` and ``gpumem``: copy bandwidth per GPU, measured through :mod:`exporter.checks.cuda`.

``pciebw`` measures host->device and device->host with page-locked host memory: a link that trained
down to fewer lanes or a lower generation, or a GPU behind a struggling switch, moves a fraction of
what its neighbours move (the classic case: 5.3 GB/s where the other seven GPUs of the node move
12.3). ``gpumem`` measures device->device copies, which HBM that passes ECC but runs degraded fails.

Verdicts, for the on-demand answer: a GPU fails in one direction when it moves less than
``floor_gbps`` (pciebw only) or less than ``median_ratio`` times the median of the node's GPUs. The
defaults are the thresholds of ``alerts/active-checks.yaml`` (a test holds them equal); the alerts,
not these verdicts, decide what happens to a node on a schedule.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

from exporter.checks.base import (
    CheckRequest,
    CheckResult,
    DeviceResult,
    Gpu,
    Verdict,
    below_node_median,
    float_param,
    worst,
)
from exporter.checks.cuda import CudaDevice, CudaDriver, CudaError, Direction

GB = 1e9

PCIE_FLOOR_GBPS = 4.0
"""Default absolute floor per direction, GB/s (``AccelCheckPCIeBandwidthBelowFloor``)."""
MEDIAN_RATIO = 0.5
"""Default fraction of the node's median below which a GPU fails (the ``BelowNodeMedian`` alerts)."""
MiB = 1 << 20


@dataclass(frozen=True)
class _Plan:
    quantities: tuple[tuple[str, Direction], ...]
    size: int
    repeats: int
    floor: float | None


def _targets(driver: CudaDriver, gpus: tuple[Gpu, ...] | None) -> list[tuple[Gpu, CudaDevice | None]]:
    """Each GPU to measure with its CUDA device (None where CUDA does not see it)."""
    devices = driver.devices()
    by_bus = {device.pci_bus_id: device for device in devices}
    if gpus is None:
        ordered = sorted(devices, key=lambda d: d.pci_bus_id)
        gpus = tuple(Gpu(index, device.pci_bus_id) for index, device in enumerate(ordered))
    return [(gpu, by_bus.get(gpu.pci_bus_id)) for gpu in gpus]


class _CopyCheck:
    name = ""
    invasive = True
    _defaults: tuple[int, int] = (64 * MiB, 20)

    def __init__(self, driver: CudaDriver) -> None:
        self._driver = driver

    def validate(self, params: Mapping[str, str]) -> None:
        self._plan(params)

    def _plan(self, params: Mapping[str, str]) -> _Plan:
        raise NotImplementedError

    def _ratio(self, params: Mapping[str, str]) -> float:
        return float_param(params, "median_ratio", MEDIAN_RATIO, low=0.0, high=1.0)

    def _size_repeats(self, params: Mapping[str, str]) -> tuple[int, int]:
        size_mib = float_param(params, "size_mib", self._defaults[0] / MiB, low=1, high=8192)
        repeats = float_param(params, "repeats", self._defaults[1], low=1, high=1000)
        return int(size_mib * MiB), int(repeats)

    def run(self, request: CheckRequest) -> CheckResult:
        started, begun = time.time(), time.monotonic()
        plan = self._plan(request.params)
        ratio = self._ratio(request.params)
        try:
            targets = _targets(self._driver, request.gpus)
        except CudaError as exc:
            return CheckResult(self.name, "error", started, time.monotonic() - begun, message=str(exc))
        measured: dict[str, dict[str, float]] = {}
        problems: dict[str, str] = {}
        for gpu, device in targets:
            key = str(gpu.index)
            if device is None:
                problems[key] = "CUDA does not see this GPU"
                continue
            values = measured.setdefault(key, {})
            for quantity, direction in plan.quantities:
                try:
                    values[quantity] = self._driver.copy_bandwidth(
                        device.ordinal, direction, size=plan.size, repeats=plan.repeats
                    )
                except CudaError as exc:
                    problems[key] = str(exc)
                    break
        failures: dict[str, list[str]] = {}
        for quantity, _ in plan.quantities:
            column = {key: values[quantity] for key, values in measured.items() if quantity in values}
            for key in below_node_median(column, ratio=ratio):
                failures.setdefault(key, []).append(f"{quantity} below {ratio:g}x the node's median")
            if plan.floor is not None:
                for key, value in column.items():
                    if value < plan.floor * GB:
                        failures.setdefault(key, []).append(f"{quantity} below {plan.floor:g} GB/s")
        devices = []
        for gpu, _ in targets:
            key = str(gpu.index)
            verdict: Verdict = "error" if key in problems else "fail" if key in failures else "pass"
            detail = problems.get(key) or "; ".join(failures.get(key, []))
            devices.append(DeviceResult(key, verdict, measured.get(key, {}), gpu.pci_bus_id, detail))
        overall = worst([d.verdict for d in devices])
        message = "; ".join(f"GPU {d.device}: {d.detail}" for d in devices if d.detail)
        return CheckResult(self.name, overall, started, time.monotonic() - begun, tuple(devices), message)


class PcieBandwidthCheck(_CopyCheck):
    """``pciebw``: host<->device bandwidth per GPU over pinned memory."""

    name = "pciebw"

    def _plan(self, params: Mapping[str, str]) -> _Plan:
        size, repeats = self._size_repeats(params)
        floor = float_param(params, "floor_gbps", PCIE_FLOOR_GBPS, low=0.0, high=1000.0)
        self._ratio(params)
        quantities: tuple[tuple[str, Direction], ...] = (
            ("host_to_device", "host_to_device"),
            ("device_to_host", "device_to_host"),
        )
        return _Plan(quantities, size, repeats, floor)


class MemoryBandwidthCheck(_CopyCheck):
    """``gpumem``: device memory bandwidth per GPU (device-to-device copies; bytes read plus written)."""

    name = "gpumem"
    _defaults = (512 * MiB, 20)

    def _plan(self, params: Mapping[str, str]) -> _Plan:
        size, repeats = self._size_repeats(params)
        self._ratio(params)
        return _Plan((("device_to_device", "device_to_device"),), size, repeats, None)
