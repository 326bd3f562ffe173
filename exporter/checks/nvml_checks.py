"""``remapped`` and ``power``: judgements of what NVML reports now, through the exporter's NVML reader.

Neither loads the GPU: they read the same :class:`~exporter.readers.nvml.NvmlReader` the ``nvml``
collector reads (bounded calls, a wedged GPU reported, never waited for), so they run on busy GPUs too.

- ``remapped`` fails a GPU with a row remap pending (it needs a reset to take effect) or a remap that
  failed (no spare rows left: the GPU needs replacing), as ``nvidia-smi -q -d ROW_REMAPPER`` shows them.
- ``power`` fails a GPU whose clocks are held down by the hardware: an external power brake, or
  hardware slowdown (set by the power brake, by thermal slowdown, or on its own).

A GPU NVML cannot read (lost, timed out, stuck) is an ``error`` for both; without NVML at all (no
NVIDIA driver on the node) both are ``skipped``, as invasive checks are.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from exporter.checks.base import CheckRequest, CheckResult, DeviceResult, Verdict, worst
from exporter.readers.nvml import NvmlGpuHealth, NvmlReader

_Judge = Callable[[NvmlGpuHealth], tuple[Verdict, dict[str, float], str]]


def _flag(value: bool | None) -> float:
    return 1.0 if value else 0.0


def _remapped(gpu: NvmlGpuHealth) -> tuple[Verdict, dict[str, float], str]:
    rows = gpu.remapped_rows
    if rows is None:
        return "skipped", {}, "no row remapping on this GPU (before Ampere)"
    values = {
        "remapped_rows_correctable": float(rows.correctable),
        "remapped_rows_uncorrectable": float(rows.uncorrectable),
        "remap_pending": _flag(rows.pending),
        "remap_failure": _flag(rows.failure),
    }
    problems = [
        text
        for flag, text in ((rows.failure, "a row remap failed"), (rows.pending, "a remap is pending a reset"))
        if flag
    ]
    return ("fail" if problems else "pass"), values, "; ".join(problems)


def _power(gpu: NvmlGpuHealth) -> tuple[Verdict, dict[str, float], str]:
    throttle = gpu.clock_throttle
    if throttle is None:
        return "skipped", {}, "the GPU reports no clock-event reasons"
    values = {
        "hw_slowdown": _flag(throttle.hw_slowdown),
        "hw_power_brake": _flag(throttle.hw_power_brake),
        "hw_thermal_slowdown": _flag(throttle.hw_thermal_slowdown),
        "sw_power_cap": _flag(throttle.sw_power_cap),
    }
    if gpu.power_watts is not None:
        values["power_watts"] = gpu.power_watts
    problems = [
        text
        for flag, text in (
            (throttle.hw_power_brake, "power brake asserted"),
            (throttle.hw_slowdown, "hardware slowdown"),
        )
        if flag
    ]
    return ("fail" if problems else "pass"), values, "; ".join(problems)


class _NvmlCheck:
    name = ""
    invasive = False
    _judge: _Judge

    def __init__(self, reader: NvmlReader) -> None:
        self._reader = reader

    def validate(self, params: Mapping[str, str]) -> None:
        """Takes no parameters; unknown ones are ignored like other checks' parameters."""

    def run(self, request: CheckRequest) -> CheckResult:
        started, begun = time.time(), time.monotonic()
        snapshot = self._reader.read()
        if not snapshot.available:
            # As the runner skips invasive checks without NVML: a node with no NVIDIA driver (a Trainium
            # node under the same DaemonSet) has nothing to check; a GPU node whose driver broke is
            # already reported by the NVML collector (accel_exporter_collector_up{collector="nvml"} 0).
            message = f"NVML unavailable: {snapshot.reason}"
            return CheckResult(self.name, "skipped", started, time.monotonic() - begun, message=message)
        devices = []
        for gpu in snapshot.gpus:
            if gpu.status != "ok":
                detail = f"NVML: GPU {gpu.status}" + (f" in {gpu.stuck_call}" if gpu.stuck_call else "")
                devices.append(DeviceResult(str(gpu.index), "error", {}, gpu.pci_bus_id, detail))
                continue
            verdict, values, detail = type(self)._judge(gpu)
            devices.append(DeviceResult(str(gpu.index), verdict, values, gpu.pci_bus_id, detail))
        judged = [d.verdict for d in devices if d.verdict != "skipped"]
        overall = worst(judged) if judged else "skipped"
        message = "; ".join(f"GPU {d.device}: {d.detail}" for d in devices if d.verdict in ("fail", "error"))
        return CheckResult(self.name, overall, started, time.monotonic() - begun, tuple(devices), message)


class RemappedRowsCheck(_NvmlCheck):
    """``remapped``: pending or failed row remaps per GPU."""

    name = "remapped"
    _judge = staticmethod(_remapped)


class PowerSlowdownCheck(_NvmlCheck):
    """``power``: power brake and hardware slowdown per GPU."""

    name = "power"
    _judge = staticmethod(_power)
