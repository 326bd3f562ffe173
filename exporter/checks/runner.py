"""Runs checks: never two on one GPU at once, invasive ones only on idle GPUs, each within a deadline.

A run of an invasive check reserves the GPUs it measures: those NVML enumerates, that no usage probe
reports in use, and that no other check holds. GPUs it cannot have are listed in its result as
``skipped`` with the reason, and it costs them nothing: no CUDA call, no context, no memory. A check
with no GPU left to run on is ``skipped`` as a whole.

Each run happens on a thread of its own; the caller waits until the deadline. A run still going then
is reported ``error`` ("deadline exceeded") and keeps its GPUs until it really ends, so a wedged
measurement never lets a second one onto the same GPU. One check never runs twice at once.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from exporter.checks.base import (
    Check,
    CheckInputError,
    CheckRequest,
    CheckResult,
    DeviceResult,
    Gpu,
    worst,
)
from exporter.checks.usage import UsageProbe
from exporter.readers.nvml import NvmlReader

DEFAULT_DEADLINES = {True: 600.0, False: 60.0}
"""Default deadline in seconds, by invasiveness (``dcgmi diag -r 1`` takes about a minute, ``-r 3``
up to half an hour: raise it per check in the schedule)."""


class CheckRunner:
    """Runs named checks, keeps each one's latest result and counts runs by verdict."""

    def __init__(
        self,
        checks: Sequence[Check],
        *,
        nvml: NvmlReader | None,
        usage: Sequence[UsageProbe] = (),
        deadlines: Mapping[str, float] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.checks: dict[str, Check] = {check.name: check for check in checks}
        self._nvml = nvml
        self._usage = tuple(usage)
        self._deadlines = dict(deadlines or {})
        self._clock = clock
        self._lock = threading.Lock()
        self._held: dict[int, str] = {}
        """GPU index -> the check holding it."""
        self._running: set[str] = set()
        self._latest: dict[str, CheckResult] = {}
        self._runs: dict[str, Counter[str]] = {name: Counter() for name in self.checks}
        self._skipped_gpus: dict[str, int] = {}

    def deadline(self, name: str) -> float:
        return self._deadlines.get(name, DEFAULT_DEADLINES[self.checks[name].invasive])

    def set_deadline(self, name: str, seconds: float) -> None:
        self._deadlines[name] = seconds

    def validate(self, names: Sequence[str], params: Mapping[str, str]) -> None:
        """Raises :class:`CheckInputError` for an unknown check or parameters one cannot take."""
        for name in names:
            check = self.checks.get(name)
            if check is None:
                known = ", ".join(sorted(self.checks))
                raise CheckInputError(f"unknown check {name!r} (this node runs: {known})")
            check.validate(params)

    def latest(self) -> dict[str, CheckResult]:
        with self._lock:
            return dict(self._latest)

    def runs(self) -> dict[str, dict[str, int]]:
        with self._lock:
            return {name: dict(counts) for name, counts in self._runs.items()}

    def skipped_gpus(self) -> dict[str, int]:
        """GPUs each check's latest run had to leave out (in use, or held by another check)."""
        with self._lock:
            return dict(self._skipped_gpus)

    def run(self, name: str, params: Mapping[str, str] | None = None) -> CheckResult:
        params = dict(params or {})
        self.validate([name], params)
        check = self.checks[name]
        started = self._clock()
        with self._lock:
            if name in self._running:
                return CheckResult(name, "skipped", started, 0.0, message=f"{name} is already running")
            self._running.add(name)
        reserved: list[int] = []
        released = threading.Event()

        def release() -> None:
            with self._lock:
                for index in reserved:
                    self._held.pop(index, None)
                self._running.discard(name)
            released.set()

        try:
            gpus, skipped = self._reserve(check, reserved) if check.invasive else (None, ())
        except BaseException:
            release()
            raise
        if gpus is not None and not gpus:
            release()
            message = "no idle GPU: " + "; ".join(f"GPU {d.device}: {d.detail}" for d in skipped)
            return self._record(CheckResult(name, "skipped", started, 0.0, skipped, message), len(skipped))
        deadline = self.deadline(name)
        request = CheckRequest(gpus=gpus, params=params, deadline=deadline)
        box: list[CheckResult | BaseException] = []

        def work() -> None:
            try:
                box.append(check.run(request))
            except Exception as exc:  # a check's bug is that check's error, not the exporter's
                box.append(exc)
            finally:
                release()

        threading.Thread(target=work, name=f"check-{name}", daemon=True).start()
        if not released.wait(deadline):
            result = CheckResult(
                name,
                "error",
                started,
                deadline,
                message=f"deadline exceeded: still running after {deadline:g} s",
            )
        elif isinstance(box[0], BaseException):
            error = box[0]
            result = CheckResult(name, "error", started, 0.0, message=f"{type(error).__name__}: {error}")
        else:
            result = box[0]
        if skipped:
            measured = [d.verdict for d in result.devices]
            verdict = worst(measured, empty=result.verdict) if result.verdict != "error" else "error"
            result = replace(result, devices=result.devices + skipped, verdict=verdict)
        return self._record(result, len(skipped))

    def _reserve(self, check: Check, reserved: list[int]) -> tuple[tuple[Gpu, ...], tuple[DeviceResult, ...]]:
        """The GPUs this run may use (recorded in ``reserved``), and the others as skipped results."""
        if self._nvml is None:
            return (), (DeviceResult("", "skipped", detail="NVML is off: cannot tell which GPUs are idle"),)
        snapshot = self._nvml.read()
        if not snapshot.available:
            return (), (DeviceResult("", "skipped", detail=f"NVML unavailable: {snapshot.reason}"),)
        inventory = [Gpu(g.index, g.pci_bus_id) for g in snapshot.gpus if g.status == "ok"]
        busy: dict[int, str] = {}
        for probe in self._usage:
            for index, reason in probe.in_use(inventory).items():
                busy.setdefault(index, reason)
        free: list[Gpu] = []
        skipped: list[DeviceResult] = []
        with self._lock:
            for gpu in inventory:
                why = busy.get(gpu.index)
                holder = self._held.get(gpu.index)
                if why is None and holder is not None:
                    why = f"check {holder} is running on it"
                if why is not None:
                    skipped.append(DeviceResult(str(gpu.index), "skipped", {}, gpu.pci_bus_id, why))
                    continue
                self._held[gpu.index] = check.name
                reserved.append(gpu.index)
                free.append(gpu)
        return tuple(free), tuple(skipped)

    def _record(self, result: CheckResult, skipped: int) -> CheckResult:
        with self._lock:
            self._latest[result.check] = result
            self._runs.setdefault(result.check, Counter())[result.verdict] += 1
            self._skipped_gpus[result.check] = skipped
        return result
