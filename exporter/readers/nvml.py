"""NVML reader: per-GPU health through pynvml, every call bounded, every failure a value.

This is the only module that touches pynvml, and it imports it lazily (``importlib``), so importing
this module needs neither the library nor a driver. Readings are frozen dataclasses; a field is None
when the GPU does not support it or its call failed.

NVML errors map to values:

- ``NOT_SUPPORTED`` (and ``INVALID_ARGUMENT`` for an NVLink index the GPU does not have): the field is
  None; nothing is counted, because the field does not exist on that GPU.
- ``GPU_IS_LOST``: the GPU's status is ``lost``; its other fields are dropped for that read.
- any other error: the field is None and ``(call, error)`` is counted in ``field_errors``.

Bounded calls: NVML can block for minutes on a wedged GPU (the calling thread sits in D state). Every
call therefore runs on a worker thread: one thread, the *system lane*, for initialisation and
enumeration, and a pool of workers for the GPUs. A read waits for its GPUs until a single deadline
(``timeout`` seconds after it started) and abandons the jobs still running: their current call is
counted in ``call_timeouts`` and their GPU reported ``timeout``. An abandoned call keeps its worker,
and later reads report that GPU ``stuck`` (naming the call and how long it has been outstanding)
instead of starting another read of it; once the call returns, the worker takes work again. A wedged
GPU therefore costs one thread, not one per scrape.

The GPUs of one read form a batch that workers take in turn (see :class:`_Batch`): one worker reads
them one after another, and more join only where waiting would hold the others up, before NVML's 20 ms
throughput sampling and once a read has waited ``patience`` seconds. Most NVML calls return in
microseconds; eight threads taking turns for the GIL around every one of them cost more than they
overlap, while the sampling, and a GPU that does not answer, must not hold the others up.

Xid events: :meth:`PynvmlReader.xid_events` starts, on first use, a thread waiting on NVML's event API
(``nvmlEventTypeXidCriticalError``) and returns the counts seen since then. The exporter uses them only
where the kernel log cannot be read (see ``exporter.sources``).
"""

from __future__ import annotations

import collections
import ctypes
import functools
import importlib
import logging
import queue
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Generic, Literal, NamedTuple, Protocol, TypeVar

from exporter.readers.kmsg import normalise_pci_bus_id

logger = logging.getLogger(__name__)

GpuStatus = Literal["ok", "lost", "timeout", "stuck", "error"]
"""``ok``: NVML answered for the GPU (some fields may still have failed); ``lost``: NVML says the GPU
is lost (fell off the bus); ``timeout``: a call for it did not return within this read's bound;
``stuck``: a call abandoned by an earlier read has still not returned, so the GPU was skipped;
``error``: no handle for it (the error is counted)."""

DEFAULT_TIMEOUT = 2.0
"""Seconds one read may take, all GPUs together."""

NVML_LIBRARY = "libnvidia-ml.so.1"
"""The driver's NVML library, as pynvml loads it on Linux."""

_MAX_TALLIES = 256
"""GPUs whose NVLink readings a reader keeps; past that it starts again (totals then restart at the
links' sums, which Prometheus may read as one counter reset)."""

DEFAULT_PATIENCE = 0.02
"""Seconds a read lets one worker read its GPUs one after another before it gives every GPU not yet
begun a worker of its own (see :class:`_Batch`)."""

_EMPTY: Mapping[Any, int] = MappingProxyType({})


@dataclass(frozen=True)
class EccErrors:
    """ECC error counts (``nvmlDeviceGetTotalEccErrors``); None where the GPU reports none."""

    volatile_corrected: int | None = None
    """Corrected errors since the driver was last loaded."""
    volatile_uncorrected: int | None = None
    """Uncorrected errors since the driver was last loaded."""
    aggregate_corrected: int | None = None
    """Corrected errors over the GPU's life (kept in its infoROM; an operator can clear it)."""
    aggregate_uncorrected: int | None = None
    """Uncorrected errors over the GPU's life (kept in its infoROM; an operator can clear it)."""


@dataclass(frozen=True)
class RemappedRows:
    """Row remapping, Ampere and later (``nvmlDeviceGetRemappedRows``)."""

    correctable: int
    """Rows remapped because of correctable errors."""
    uncorrectable: int
    """Rows remapped because of uncorrectable errors."""
    pending: bool
    """A remap is waiting for the next GPU reset."""
    failure: bool
    """A remap failed (no spare rows left): the GPU needs replacing."""


@dataclass(frozen=True)
class RetiredPages:
    """Dynamic page retirement, GPUs before Ampere; None where the GPU does not report a field."""

    single_bit_ecc: int | None = None
    """Pages retired for multiple single-bit ECC errors."""
    double_bit_ecc: int | None = None
    """Pages retired for a double-bit ECC error."""
    pending: bool | None = None
    """Pages wait to be retired at the next driver reload (``nvmlDeviceGetRetiredPagesPendingStatus``)."""


@dataclass(frozen=True)
class PcieStatus:
    """The GPU's PCIe link as NVML sees it; None where unsupported or failed."""

    current_generation: int | None = None
    """Negotiated PCIe generation (e.g. 5)."""
    max_generation: int | None = None
    """Highest generation the GPU and its slot support together."""
    current_width: int | None = None
    """Negotiated lanes."""
    max_width: int | None = None
    """Most lanes the GPU and its slot support together."""
    replay_errors: int | None = None
    """PCIe replay counter since the driver was loaded."""
    tx_bytes_per_second: float | None = None
    """Transmit throughput sampled by NVML over about 20 ms (NVML reports KiB/s)."""
    rx_bytes_per_second: float | None = None
    """Receive throughput sampled by NVML over about 20 ms (NVML reports KiB/s)."""


class NvLink(NamedTuple):
    """One NVLink link of a GPU (a named tuple: a GPU read makes 18 of them per GPU)."""

    link: int
    """Link index, 0-based."""
    up: bool | None = None
    """Whether the link is active (``nvmlDeviceGetNvLinkState``)."""
    crc_flit: int | None = None
    """Data-link flit CRC errors (``NVML_NVLINK_ERROR_DL_CRC_FLIT``)."""
    crc_data: int | None = None
    """Data-link data CRC errors (``NVML_NVLINK_ERROR_DL_CRC_DATA``)."""
    replay: int | None = None
    """Data-link replays (``NVML_NVLINK_ERROR_DL_REPLAY``)."""
    recovery: int | None = None
    """Data-link recoveries (``NVML_NVLINK_ERROR_DL_RECOVERY``)."""


NVLINK_ERROR_NAMES = ("crc_flit", "crc_data", "replay", "recovery")
""":class:`NvLink`'s counter fields, in order."""


class NvLinkTotals(NamedTuple):
    """A GPU's NVLink links taken together, as :class:`PynvmlReader` keeps them from read to read.

    The error totals are the sums of the links' counters (each counts since the driver loaded), made
    to behave as one counter: they never go down while the reader lives. A counter that cannot be read
    in one read keeps its last value in the sum, and a counter that went down (its link's counters
    were reset, or the driver reloaded) adds its new value rather than taking the old one away; a
    plain sum would drop then, and Prometheus would take the drop for a counter reset and count the
    whole total again as new errors.
    """

    links: int
    """Links the GPU has (those NVML enumerated at its first read)."""
    links_up: int
    """Links that are active. A link whose state could not be read in this read counts as it was last
    read; one never read does not count."""
    crc_flit: int | None
    """Data-link flit CRC errors, all links; None while no link ever reported the counter."""
    crc_data: int | None
    """Data-link data CRC errors, all links; None while no link ever reported the counter."""
    replay: int | None
    """Data-link replays, all links; None while no link ever reported the counter."""
    recovery: int | None
    """Data-link recoveries, all links; None while no link ever reported the counter."""


class _LinkTally:
    """One GPU's NVLink readings kept between reads, from which its :class:`NvLinkTotals` come."""

    def __init__(self) -> None:
        self.raw: dict[tuple[int, int], int] = {}
        """(link, counter position) -> the counter's value at its last successful read."""
        self.totals: list[int | None] = [None] * len(NVLINK_ERROR_NAMES)
        """The published totals, by counter position."""
        self.up: dict[int, bool] = {}
        """Link -> its state at its last successful read."""
        self.last: tuple[tuple[NvLink, ...], NvLinkTotals] | None = None
        """The links last added and the totals made of them."""

    def add(self, nvlinks: tuple[NvLink, ...]) -> NvLinkTotals:
        if (last := self.last) is not None and last[0] == nvlinks:  # the usual case: nothing moved
            return last[1]
        raw, totals, up = self.raw, self.totals, self.up
        for nvlink in nvlinks:
            if nvlink.up is not None:
                up[nvlink.link] = nvlink.up
            for position, value in enumerate(nvlink[2:]):
                if value is None:  # unreadable now: its last value stays in the total
                    continue
                before = raw.get((nvlink.link, position))
                # First sight: its whole count; a drop (a reset): counted again from zero.
                grown = value if before is None or value < before else value - before
                raw[nvlink.link, position] = value
                totals[position] = (totals[position] or 0) + grown
        made = NvLinkTotals(len(nvlinks), sum(1 for nvlink in nvlinks if up.get(nvlink.link)), *totals)
        self.last = (nvlinks, made)
        return made


@dataclass(frozen=True)
class ClockThrottle:
    """Active clock-throttle (clocks-event) reasons; None for a reason the GPU does not support."""

    hw_slowdown: bool | None = None
    """Hardware slowdown (set with thermal slowdown and power brake too, or on its own)."""
    hw_thermal_slowdown: bool | None = None
    """Hardware thermal slowdown: the GPU or its memory is too hot."""
    hw_power_brake: bool | None = None
    """External power brake asserted (e.g. by the power supply)."""
    sw_thermal_slowdown: bool | None = None
    """Driver-initiated thermal slowdown."""
    sw_power_cap: bool | None = None
    """The power limit holds clocks down."""


@dataclass(frozen=True)
class NvmlGpuHealth:
    """One GPU in one read. Identity fields are empty strings where unknown (e.g. a lost GPU)."""

    index: int
    """NVML index (PCI bus order)."""
    status: GpuStatus
    """See :data:`GpuStatus`; only ``ok`` GPUs carry health fields."""
    uuid: str = ""
    """``GPU-<uuid>``."""
    pci_bus_id: str = ""
    """Normalised ``0000:91:00`` (NVML's own busId reads ``00000000:91:00.0``)."""
    model: str = ""
    """``nvmlDeviceGetName``, e.g. ``NVIDIA H100 80GB HBM3``."""
    stuck_call: str = ""
    """For ``timeout``/``stuck``: the NVML call that did not return."""
    stuck_seconds: float | None = None
    """For ``timeout``/``stuck``: seconds since that call started."""
    ecc: EccErrors | None = None
    """None when ECC is off or unsupported."""
    remapped_rows: RemappedRows | None = None
    """None before Ampere."""
    retired_pages: RetiredPages | None = None
    """None from Ampere on (row remapping replaced page retirement)."""
    pcie: PcieStatus | None = None
    """None when NVML tells nothing about the link."""
    nvlinks: tuple[NvLink, ...] = ()
    """Links the GPU has, as read now; empty without NVLink."""
    nvlink_totals: NvLinkTotals | None = None
    """The links together, kept from read to read (see :class:`NvLinkTotals`); None without NVLink,
    in a brief read, and from readers that keep no totals."""
    clock_throttle: ClockThrottle | None = None
    """None when the GPU reports no clock-event reasons."""
    temperature_celsius: float | None = None
    """GPU core temperature."""
    power_watts: float | None = None
    """Board power draw (NVML reports milliwatts)."""


@dataclass(frozen=True)
class NvmlSnapshot:
    """The outcome of one NVML read."""

    available: bool
    """False when NVML cannot be used at all (no library, no driver, initialisation hangs)."""
    reason: str = ""
    """Why NVML is unavailable; empty when it is available."""
    gpu_count: int | None = None
    """GPUs NVML enumerates (``nvmlDeviceGetCount``), lost ones included."""
    gpus: tuple[NvmlGpuHealth, ...] = ()
    call_timeouts: Mapping[str, int] = field(default_factory=lambda: _EMPTY)
    """NVML call name -> calls abandoned for exceeding the bound, since the reader was created."""
    field_errors: Mapping[tuple[str, str], int] = field(default_factory=lambda: _EMPTY)
    """(NVML call name, error) -> failed calls since the reader was created; ``error`` is the NVML
    error in snake case (``unknown``, ``no_permission``, ``corrupted_inforom`` ...)."""


@dataclass(frozen=True)
class NvmlXidCounts:
    """Xid events NVML delivered since the reader began watching."""

    counts: Mapping[tuple[str, int], int] = field(default_factory=lambda: _EMPTY)
    """(pci_bus_id, xid) -> events."""
    gpu_indices: Mapping[str, int] = field(default_factory=lambda: _EMPTY)
    """pci_bus_id -> NVML index, for the GPUs being watched."""
    error: str | None = None
    """Why events are not (or not yet) being watched; None while they are."""


@dataclass(frozen=True)
class GpuIdentity:
    """What names one GPU to its vendor (an RMA) and to people; a field is None where NVML does not
    tell it (the call failed or is unsupported, or the GPU is lost)."""

    index: int
    """NVML index (PCI bus order)."""
    pci_bus_id: str = ""
    """Normalised ``0000:91:00``; empty when unknown."""
    uuid: str | None = None
    """``GPU-<uuid>`` (``nvmlDeviceGetUUID``)."""
    serial: str | None = None
    """The board's serial number (``nvmlDeviceGetSerial``), what an RMA names."""
    board_part_number: str | None = None
    """``nvmlDeviceGetBoardPartNumber``, e.g. ``692-2G520-0200-000``."""
    vbios_version: str | None = None
    """``nvmlDeviceGetVbiosVersion``, e.g. ``96.00.74.00.01``."""
    inforom_image_version: str | None = None
    """``nvmlDeviceGetInforomImageVersion``, e.g. ``G520.0200.00.05``."""
    name: str | None = None
    """``nvmlDeviceGetName``, e.g. ``NVIDIA H100 80GB HBM3``."""
    pci_device_id: str | None = None
    """``0x233010DE``: device id << 16 | vendor id, as nvidia-smi prints it."""
    pci_subsystem_id: str | None = None
    """``0x16C110DE``: subsystem device id << 16 | subsystem vendor id."""


@dataclass(frozen=True)
class NvmlIdentity:
    """The driver's and every GPU's identity, read rarely (:meth:`NvmlReader.identity`)."""

    available: bool
    """False when NVML cannot be used at all; nothing else is then known."""
    reason: str = ""
    """Why NVML is unavailable; empty when it is available."""
    driver_version: str | None = None
    """``nvmlSystemGetDriverVersion``, e.g. ``535.129.03``."""
    cuda_driver_version: str | None = None
    """``nvmlSystemGetCudaDriverVersion`` as ``12.2``."""
    gpus: tuple[GpuIdentity, ...] = ()


class NvmlReader(Protocol):
    """What the NVML source needs; production uses :class:`PynvmlReader`."""

    def read(self, *, brief: bool = False) -> NvmlSnapshot:
        """Every GPU's health; ``brief``: only what the fast path serves (count, lost GPUs,
        remapped-row state)."""
        ...

    def xid_events(self) -> NvmlXidCounts: ...

    def identity(self, *, refresh: bool = False) -> NvmlIdentity:
        """The driver's and the GPUs' identity: read on first use and when ``refresh`` asks, else the
        last read's (identity does not change while the driver stays loaded)."""
        ...

    def close(self) -> None: ...


# -- worker threads -----------------------------------------------------------------------------------

T = TypeVar("T")


class _Countdown:
    """Set once its ``count`` jobs have all finished, so a reader waits once rather than on each job
    (every wait that wakes is a thread switch)."""

    def __init__(self, count: int) -> None:
        self._left = count
        self._lock = threading.Lock()
        self.done = threading.Event()
        if count <= 0:
            self.done.set()

    def finished(self) -> None:
        with self._lock:
            self._left -= 1
            if self._left == 0:
                self.done.set()


class _Job(Generic[T]):
    """One unit of work for a worker thread; ``call`` names the NVML call in progress."""

    def __init__(self, work: Callable[[_Job[T]], T], countdown: _Countdown | None = None) -> None:
        self.work = work
        self.countdown = countdown
        self.done = threading.Event()
        self.call = ""
        self.call_started = time.monotonic()
        self.result: T | None = None
        self.error: BaseException | None = None
        self.learnt: Any = None
        """What the job learnt before finishing (a GPU job: the GPU's identity), for a reader that
        gives up waiting."""
        self.hand_on: Callable[[], None] | None = None
        """Called before a call that blocks for a while, so that other work need not wait for it."""

    def run(self) -> None:
        try:
            self.result = self.work(self)
        except BaseException as exc:  # handed to the reader, which reports it
            self.error = exc
        finally:
            self.done.set()
            if self.countdown is not None:
                self.countdown.finished()


class _Lane:
    """A daemon thread running one job at a time. A job stuck in NVML keeps its lane busy."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._jobs: queue.SimpleQueue[_Job[Any] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self.current: _Job[Any] | None = None

    def busy(self) -> _Job[Any] | None:
        """The job still running, if any."""
        job = self.current
        return job if job is not None and not job.done.is_set() else None

    def submit(self, job: _Job[T]) -> _Job[T]:
        """Queues the job; raises RuntimeError where the lane's thread cannot be started."""
        if self._thread is None:
            thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            thread.start()
            self._thread = thread
        job.call_started = time.monotonic()
        self.current = job
        self._jobs.put(job)
        return job

    def stop(self) -> None:
        if self._thread is not None:
            self._jobs.put(None)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            job.run()


class _Workers:
    """Daemon threads running functions from one shared queue. :meth:`run` hands a function to an idle
    thread, starting one where none is idle. A thread stuck in NVML is not idle, so it is never
    waited for; it takes work again once its call returns."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._work: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        """Threads waiting for work less work queued; below 0 where threads could not be started."""
        self._started = 0
        self._stopped = False

    def run(self, work: Callable[[], None]) -> None:
        with self._lock:
            start = self._idle <= 0 and not self._stopped  # below 0: work queued that no thread took
            if start:
                self._started += 1
            else:
                self._idle -= 1
            name = f"{self._name}-{self._started}"
        self._work.put(work)
        if start:
            try:
                threading.Thread(target=self._loop, name=name, daemon=True).start()
            except RuntimeError as exc:  # a limit on threads (pids cgroup): the work waits for an idle one
                with self._lock:
                    self._idle -= 1
                logger.warning("nvml: cannot start a worker thread: %s", exc)

    def stop(self) -> None:
        """Ends the idle threads, and every other one once its work returns."""
        with self._lock:
            self._stopped = True
            idle, self._idle = self._idle, 0
        for _ in range(max(idle, 0)):
            self._work.put(None)

    def _loop(self) -> None:
        while (work := self._work.get()) is not None:
            work()
            with self._lock:
                if self._stopped:
                    return
                self._idle += 1


class _Batch:
    """The GPU jobs of one read, each taken by the first worker free to take it.

    One worker starts, and reads the GPUs one after another. Another joins, to carry on with the GPUs
    left, when a job is about to block (:meth:`hand_on`: NVML samples PCIe throughput for 20 ms per
    direction), unless one has been asked for and not yet begun; so the sampling of every GPU overlaps
    while their short calls do not compete for the GIL. A read that has waited ``patience`` without
    its batch done calls :meth:`spread`: one more worker per job left, so a GPU wedged in any call
    holds up only itself. :meth:`withdraw` takes back, at the deadline, jobs no worker began.
    """

    def __init__(self, jobs: Sequence[_Job[Any]], workers: _Workers) -> None:
        self._pending = collections.deque(jobs)
        self._workers = workers
        self._asked = 0
        """Workers asked for by :meth:`hand_on` that have not yet begun."""
        self._lock = threading.Lock()
        for job in jobs:
            job.hand_on = self.hand_on

    def start(self) -> None:
        if self._pending:
            self._workers.run(self._drain)

    def hand_on(self) -> None:
        with self._lock:
            if not self._pending or self._asked:
                return
            self._asked += 1
        self._workers.run(self._joined)

    def spread(self) -> None:
        for _ in range(len(self._pending)):
            self._workers.run(self._drain)

    def withdraw(self) -> list[_Job[Any]]:
        withdrawn = []
        while True:
            try:
                withdrawn.append(self._pending.popleft())  # atomic: a job is withdrawn or taken, not both
            except IndexError:
                return withdrawn

    def _joined(self) -> None:
        with self._lock:
            self._asked -= 1
        self._drain()

    def _drain(self) -> None:
        pending = self._pending
        while True:
            try:
                job = pending.popleft()
            except IndexError:
                return
            job.run()


# -- NVML calls ---------------------------------------------------------------------------------------


class _GpuLostError(Exception):
    """NVML answered ``GPU_IS_LOST``."""


_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")


def _error_name(exc: BaseException) -> str:
    """``NVMLError_NoPermission`` -> ``no_permission``; other exceptions by their snake-cased type."""
    name = type(exc).__name__
    if name == "NVMLError":
        return f"nvml_error_{getattr(exc, 'value', 'unknown')}"
    return _CAMEL.sub("_", name.removeprefix("NVMLError_")).lower()


def _text(value: object) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


class _Calls:
    """Runs NVML calls for one job: names each call on the job, maps errors to values."""

    def __init__(self, nvml: Any, job: _Job[Any]) -> None:
        self._nvml = nvml
        self._job = job
        self._not_supported = nvml.NVML_ERROR_NOT_SUPPORTED
        self._lost = nvml.NVML_ERROR_GPU_IS_LOST
        self.errors: dict[tuple[str, str], int] = {}
        self.last_failed = False
        """Whether the last call failed (an error that was counted)."""

    def get(self, call: str, *args: object, absent: tuple[int, ...] = ()) -> Any:
        """The call's result; None when unsupported (or an ``absent`` error code) or failed (counted).

        Raises :class:`_GpuLostError` when NVML says the GPU is lost.
        """
        self._job.call = call
        self._job.call_started = time.monotonic()
        self.last_failed = False
        try:
            return getattr(self._nvml, call)(*args)
        except self._nvml.NVMLError as exc:
            self._account(call, exc, absent)
            return None
        except (AttributeError, TypeError, ValueError, OSError) as exc:  # an old pynvml or libnvidia-ml
            self.count(call, _error_name(exc))
            return None

    def each(self, call: str, handle: Any, arguments: Sequence[tuple[object, ...]]) -> list[Any]:
        """``get(call, handle, *args)`` for every ``args`` in ``arguments``, in order; cheaper per call
        (one lookup of the function), which matters for the hundreds of per-link NVLink calls."""
        job = self._job
        job.call = call
        try:
            function = getattr(self._nvml, call)
        except AttributeError as exc:  # an old pynvml
            self.count(call, _error_name(exc))
            return [None] * len(arguments)
        nvml_error = self._nvml.NVMLError
        monotonic = time.monotonic
        results: list[Any] = []
        for args in arguments:
            job.call_started = monotonic()
            try:
                results.append(function(handle, *args))
            except nvml_error as exc:
                self._account(call, exc, ())
                results.append(None)
            except (TypeError, ValueError, OSError) as exc:
                self.count(call, _error_name(exc))
                results.append(None)
        return results

    def blocking_ahead(self) -> None:
        """Says that the next calls block for a while, so other GPUs need not wait for them."""
        if (hand_on := self._job.hand_on) is not None:
            hand_on()

    def _account(self, call: str, exc: BaseException, absent: tuple[int, ...]) -> None:
        """Counts an NVML error unless it means unsupported (or is ``absent``); raises
        :class:`_GpuLostError` for a lost GPU."""
        code = getattr(exc, "value", None)
        if code == self._lost:
            raise _GpuLostError(call) from exc
        if code != self._not_supported and code not in absent:
            self.count(call, _error_name(exc))

    def get_failed(self, call: str, code: int, *, absent: tuple[int, ...] = ()) -> None:
        """Accounts for an NVML error code returned in a value (a field of ``nvmlDeviceGetFieldValues``)
        as :meth:`get` accounts for a raised one."""
        self.last_failed = False
        self._account(call, self._nvml.NVMLError(code), absent)

    def count(self, call: str, error: str) -> None:
        self.last_failed = True
        self.errors[call, error] = self.errors.get((call, error), 0) + 1


def _flag(value: Any) -> bool | None:
    return None if value is None else bool(value)


def _scaled(value: Any, factor: float) -> float | None:
    return None if value is None else float(value) * factor


@dataclass(frozen=True)
class _Identity:
    """What is known about a GPU that does not change while the driver stays loaded."""

    handle: Any = None
    """pynvml's device handle; valid until nvmlShutdown."""
    uuid: str = ""
    """Empty until NVML told it."""
    pci_bus_id: str = ""
    """Empty until NVML told it."""
    model: str = ""
    """Empty until NVML told it."""
    links: tuple[int, ...] | None = None
    """NVLink indices the GPU has, once a probe of every index succeeded."""
    batched_states: bool | None = None
    """Whether one ``nvmlDeviceGetFieldValues`` call reads the link states; None until tried."""


@dataclass(frozen=True)
class _GpuResult:
    """What one GPU job hands back to the reader."""

    health: NvmlGpuHealth
    """The GPU's reading."""
    identity: _Identity
    """What to remember about the GPU for later reads."""
    errors: Mapping[tuple[str, str], int]
    """(call, error) -> failures in this job."""


_THROTTLE_BITS = (
    ("hw_slowdown", "HwSlowdown"),
    ("hw_thermal_slowdown", "HwThermalSlowdown"),
    ("hw_power_brake", "HwPowerBrakeSlowdown"),
    ("sw_thermal_slowdown", "SwThermalSlowdown"),
    ("sw_power_cap", "SwPowerCap"),
)
"""ClockThrottle field -> suffix of pynvml's ``nvmlClocksEventReason*`` bit (``...ThrottleReason*``
in releases before the rename; the values are the same)."""


def _reason_bit(nvml: Any, suffix: str) -> int:
    for prefix in ("nvmlClocksEventReason", "nvmlClocksThrottleReason"):
        if (value := getattr(nvml, prefix + suffix, None)) is not None:
            return int(value)
    raise AttributeError(f"pynvml has no clock-event reason {suffix}")


class _GpuReader:
    """Reads one GPU (on a worker thread): identity once, then every health field."""

    def __init__(self, nvml: Any) -> None:
        self.nvml = nvml
        self.max_links = int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18))
        self.invalid_argument = int(nvml.NVML_ERROR_INVALID_ARGUMENT)
        renamed = hasattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons")
        kind = "ClocksEvent" if renamed else "ClocksThrottle"
        self.throttle_call = f"nvmlDeviceGetCurrent{kind}Reasons"
        self.supported_throttle_call = f"nvmlDeviceGetSupported{kind}Reasons"
        self.throttle_bits = tuple((name, _reason_bit(nvml, suffix)) for name, suffix in _THROTTLE_BITS)
        self.ecc_kinds = (
            (nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, nvml.NVML_VOLATILE_ECC),
            (nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC),
            (nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, nvml.NVML_AGGREGATE_ECC),
            (nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_AGGREGATE_ECC),
        )
        """In the order of :class:`EccErrors`' fields."""
        self.nvlink_counters = (
            nvml.NVML_NVLINK_ERROR_DL_CRC_FLIT,
            nvml.NVML_NVLINK_ERROR_DL_CRC_DATA,
            nvml.NVML_NVLINK_ERROR_DL_REPLAY,
            nvml.NVML_NVLINK_ERROR_DL_RECOVERY,
        )
        """In the order of :class:`NvLink`'s counter fields."""
        self.state_field: int | None = getattr(nvml, "NVML_FI_DEV_NVLINK_GET_STATE", None)
        """The field id of a link's state (scoped by link index), where pynvml knows it."""
        self.success = int(nvml.NVML_SUCCESS)

    def read(self, job: _Job[_GpuResult], index: int, known: _Identity, *, brief: bool = False) -> _GpuResult:
        calls = _Calls(self.nvml, job)
        handle, uuid, pci_bus_id, model, links, batched = (
            known.handle,
            known.uuid,
            known.pci_bus_id,
            known.model,
            known.links,
            known.batched_states,
        )
        try:
            if handle is None:
                handle = calls.get("nvmlDeviceGetHandleByIndex", index)
            if handle is None:
                health = NvmlGpuHealth(index=index, status="error")
            else:
                uuid = uuid or _text(calls.get("nvmlDeviceGetUUID", handle) or "")
                pci_bus_id = pci_bus_id or self._bus_id(calls, handle)
                model = model or _text(calls.get("nvmlDeviceGetName", handle) or "")
                job.learnt = _Identity(
                    handle=handle,
                    uuid=uuid,
                    pci_bus_id=pci_bus_id,
                    model=model,
                    links=links,
                    batched_states=batched,
                )
                if brief:  # the fast path: lost or not, and the row-remap state
                    remapped = self._remapped_rows(calls, handle)
                    if remapped is None:  # before Ampere: one cheap call still tells a lost GPU
                        calls.get("nvmlDeviceGetTemperature", handle, self.nvml.NVML_TEMPERATURE_GPU)
                    return _GpuResult(
                        health=NvmlGpuHealth(
                            index=index,
                            status="ok",
                            uuid=uuid,
                            pci_bus_id=pci_bus_id,
                            model=model,
                            remapped_rows=remapped,
                        ),
                        identity=job.learnt,
                        errors=calls.errors,
                    )
                nvlinks, probed, batched = self._nvlinks(calls, handle, links, batched)
                links = links if links is not None else probed
                health = NvmlGpuHealth(
                    index=index,
                    status="ok",
                    uuid=uuid,
                    pci_bus_id=pci_bus_id,
                    model=model,
                    ecc=self._ecc(calls, handle),
                    remapped_rows=self._remapped_rows(calls, handle),
                    retired_pages=self._retired_pages(calls, handle),
                    pcie=self._pcie(calls, handle),
                    nvlinks=nvlinks,
                    clock_throttle=self._throttle(calls, handle),
                    temperature_celsius=_scaled(
                        calls.get("nvmlDeviceGetTemperature", handle, self.nvml.NVML_TEMPERATURE_GPU), 1.0
                    ),
                    power_watts=_scaled(calls.get("nvmlDeviceGetPowerUsage", handle), 1e-3),
                )
        except _GpuLostError:
            health = NvmlGpuHealth(index=index, status="lost", uuid=uuid, pci_bus_id=pci_bus_id, model=model)
        identity = _Identity(
            handle=handle,
            uuid=uuid,
            pci_bus_id=pci_bus_id,
            model=model,
            links=links,
            batched_states=batched,
        )
        return _GpuResult(health=health, identity=identity, errors=calls.errors)

    @staticmethod
    def _bus_id(calls: _Calls, handle: Any) -> str:
        info = calls.get("nvmlDeviceGetPciInfo", handle)
        if info is None:
            return ""
        try:
            return normalise_pci_bus_id(_text(info.busId))
        except ValueError:
            calls.count("nvmlDeviceGetPciInfo", "invalid_bus_id")
            return ""

    def _ecc(self, calls: _Calls, handle: Any) -> EccErrors | None:
        values = [
            calls.get("nvmlDeviceGetTotalEccErrors", handle, error_type, counter_type)
            for error_type, counter_type in self.ecc_kinds
        ]
        if all(value is None for value in values):
            return None
        return EccErrors(*(None if value is None else int(value) for value in values))

    @staticmethod
    def _remapped_rows(calls: _Calls, handle: Any) -> RemappedRows | None:
        rows = calls.get("nvmlDeviceGetRemappedRows", handle)
        if rows is None:
            return None
        correctable, uncorrectable, pending, failure = rows
        return RemappedRows(
            correctable=int(correctable),
            uncorrectable=int(uncorrectable),
            pending=bool(pending),
            failure=bool(failure),
        )

    def _retired_pages(self, calls: _Calls, handle: Any) -> RetiredPages | None:
        nvml = self.nvml
        single = calls.get(
            "nvmlDeviceGetRetiredPages",
            handle,
            nvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS,
        )
        double = calls.get(
            "nvmlDeviceGetRetiredPages", handle, nvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR
        )
        pending = calls.get("nvmlDeviceGetRetiredPagesPendingStatus", handle)
        if single is None and double is None and pending is None:
            return None
        return RetiredPages(
            single_bit_ecc=None if single is None else len(single),
            double_bit_ecc=None if double is None else len(double),
            pending=_flag(pending),
        )

    def _pcie(self, calls: _Calls, handle: Any) -> PcieStatus | None:
        nvml = self.nvml
        current_generation = calls.get("nvmlDeviceGetCurrPcieLinkGeneration", handle)
        max_generation = calls.get("nvmlDeviceGetMaxPcieLinkGeneration", handle)
        current_width = calls.get("nvmlDeviceGetCurrPcieLinkWidth", handle)
        max_width = calls.get("nvmlDeviceGetMaxPcieLinkWidth", handle)
        replay_errors = calls.get("nvmlDeviceGetPcieReplayCounter", handle)
        calls.blocking_ahead()  # NVML samples throughput for 20 ms per direction
        status = PcieStatus(
            current_generation=current_generation,
            max_generation=max_generation,
            current_width=current_width,
            max_width=max_width,
            replay_errors=replay_errors,
            tx_bytes_per_second=_scaled(
                calls.get("nvmlDeviceGetPcieThroughput", handle, nvml.NVML_PCIE_UTIL_TX_BYTES), 1024.0
            ),
            rx_bytes_per_second=_scaled(
                calls.get("nvmlDeviceGetPcieThroughput", handle, nvml.NVML_PCIE_UTIL_RX_BYTES), 1024.0
            ),
        )
        return None if status == PcieStatus() else status

    def _nvlinks(
        self, calls: _Calls, handle: Any, known: tuple[int, ...] | None, batched: bool | None
    ) -> tuple[tuple[NvLink, ...], tuple[int, ...] | None, bool | None]:
        """The links read; (on a first, complete probe) the link indices the GPU has; and whether the
        batched state read works on this GPU.

        Until the indices are known every index up to NVML's maximum is probed; an index the GPU does
        not have answers NOT_SUPPORTED or INVALID_ARGUMENT.
        """
        indices = tuple(range(self.max_links)) if known is None else known
        states = self._batched_states(calls, handle, indices) if batched is not False else None
        if states is None:
            if batched is None:
                batched = False
            states = {}
            for link in indices:
                state = calls.get("nvmlDeviceGetNvLinkState", handle, link, absent=(self.invalid_argument,))
                states[link] = (state, calls.last_failed)
        else:
            batched = True
        probe_failed = False
        present: list[int] = []
        for link in indices:
            state, failed = states[link]
            if state is None and known is None:
                probe_failed = probe_failed or failed
                continue
            present.append(link)
        arguments = [(link, counter) for link in present for counter in self.nvlink_counters]
        counts = calls.each("nvmlDeviceGetNvLinkErrorCounter", handle, arguments)
        links = tuple(
            NvLink(link, _flag(states[link][0]), *counts[4 * position : 4 * position + 4])
            for position, link in enumerate(present)
        )
        if known is not None or probe_failed:
            return links, None, batched
        return links, tuple(present), batched

    def _batched_states(
        self, calls: _Calls, handle: Any, indices: tuple[int, ...]
    ) -> dict[int, tuple[Any, bool]] | None:
        """Link index -> (state or None, whether it failed), from one ``nvmlDeviceGetFieldValues``
        call (``NVML_FI_DEV_NVLINK_GET_STATE`` scoped by link, as used for Hopper and later); None
        where that does not work here, so the caller asks link by link.

        A GPU that answers no link this way (before Hopper, or an old library) is asked link by link.
        """
        if self.state_field is None or not indices:
            return None
        call = "nvmlDeviceGetFieldValues"
        fields = [(self.state_field, link) for link in indices]
        values = calls.get(call, handle, fields, absent=(self.invalid_argument,))  # a driver without it
        if values is None or len(values) != len(indices):
            return None
        codes = [int(value.nvmlReturn) for value in values]
        if self.success not in codes:  # nothing answered: asked link by link instead, nothing counted
            return None
        states: dict[int, tuple[Any, bool]] = {}
        for link, value, code in zip(indices, values, codes, strict=True):
            if code == self.success:
                states[link] = (int(value.value.uiVal), False)
            else:
                calls.get_failed(call, code, absent=(self.invalid_argument,))
                states[link] = (None, calls.last_failed)
        return states

    def _throttle(self, calls: _Calls, handle: Any) -> ClockThrottle | None:
        active = calls.get(self.throttle_call, handle)
        if active is None:
            return None
        supported = calls.get(self.supported_throttle_call, handle)
        mask = -1 if supported is None else int(supported)
        reasons = {name: bool(int(active) & bit) for name, bit in self.throttle_bits if mask & bit}
        return ClockThrottle(**reasons)


# -- Xid events ---------------------------------------------------------------------------------------


def _handle_key(handle: Any) -> object:
    """A hashable identity for a device handle: the pointer value of pynvml's ctypes handle."""
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value
    except (ctypes.ArgumentError, TypeError):
        return handle  # a stand-in library's own (hashable) handle


class _XidWatcher:
    """Waits on NVML's event API in a daemon thread and counts Xid events per GPU and Xid."""

    def __init__(self, nvml: Any, *, wait_ms: int) -> None:
        self._nvml = nvml
        self._wait_ms = wait_ms
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, int], int] = {}
        self._indices: dict[str, int] = {}
        self._error: str | None = "not watching yet"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nvml-xid-events", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, *, timeout: float) -> None:
        self._stop.set()
        self._thread.join(timeout)

    def counts(self) -> NvmlXidCounts:
        with self._lock:
            return NvmlXidCounts(
                counts=MappingProxyType(dict(self._counts)),
                gpu_indices=MappingProxyType(dict(self._indices)),
                error=self._error,
            )

    def _set_error(self, error: str | None) -> None:
        with self._lock:
            changed, self._error = self._error != error, error
        if changed and error is not None:
            logger.warning("nvml: Xid events: %s", error)

    def _run(self) -> None:
        nvml = self._nvml
        try:
            event_set = nvml.nvmlEventSetCreate()
        except nvml.NVMLError as exc:
            self._set_error(f"nvmlEventSetCreate failed: {exc}")
            return
        try:
            try:
                handles = self._register(event_set)
            except nvml.NVMLError as exc:
                self._set_error(f"enumerating GPUs failed: {exc}")
                return
            if not handles:
                self._set_error("no GPU accepts Xid event registration")
                return
            self._set_error(None)
            logger.info("nvml: watching Xid events of %d GPUs", len(handles))
            while not self._stop.is_set():
                self._wait_once(event_set, handles)
        finally:
            try:
                nvml.nvmlEventSetFree(event_set)
            except nvml.NVMLError as exc:
                logger.warning("nvml: nvmlEventSetFree failed: %s", exc)

    def _register(self, event_set: Any) -> dict[object, tuple[str, int]]:
        """Registers every GPU it can; handle key -> (pci_bus_id, index)."""
        nvml = self._nvml
        handles: dict[object, tuple[str, int]] = {}
        for index in range(nvml.nvmlDeviceGetCount()):
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                pci_bus_id = normalise_pci_bus_id(_text(nvml.nvmlDeviceGetPciInfo(handle).busId))
                nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, event_set)
            except (nvml.NVMLError, ValueError) as exc:
                logger.warning("nvml: GPU %d: no Xid events: %s", index, exc)
                continue
            handles[_handle_key(handle)] = (pci_bus_id, index)
            with self._lock:
                self._indices[pci_bus_id] = index
        return handles

    def _wait_once(self, event_set: Any, handles: Mapping[object, tuple[str, int]]) -> None:
        nvml = self._nvml
        try:
            data = nvml.nvmlEventSetWait(event_set, self._wait_ms)
        except nvml.NVMLError as exc:
            if getattr(exc, "value", None) == nvml.NVML_ERROR_TIMEOUT:
                self._set_error(None)
                return
            self._set_error(f"nvmlEventSetWait failed: {exc}")
            self._stop.wait(self._wait_ms / 1000)
            return
        if not int(data.eventType) & nvml.nvmlEventTypeXidCriticalError:
            return
        pci_bus_id, _index = handles.get(_handle_key(data.device), ("", -1))
        key = (pci_bus_id, int(data.eventData))
        with self._lock:
            self._counts[key] = self._counts.get(key, 0) + 1


# -- the reader ---------------------------------------------------------------------------------------


_IDENTITY_CALLS = (
    ("uuid", "nvmlDeviceGetUUID"),
    ("serial", "nvmlDeviceGetSerial"),
    ("board_part_number", "nvmlDeviceGetBoardPartNumber"),
    ("vbios_version", "nvmlDeviceGetVbiosVersion"),
    ("inforom_image_version", "nvmlDeviceGetInforomImageVersion"),
    ("name", "nvmlDeviceGetName"),
)
""":class:`GpuIdentity` field -> the NVML call that tells it (each takes the device handle alone)."""


_IdentityRead = tuple[NvmlIdentity, Mapping[tuple[str, str], int]]
"""What an identity job hands back: the identity, and (call, error) -> failures."""


def _optional_text(value: object) -> str | None:
    """NVML's string (``bytes`` in older pynvml) stripped; None for None or an empty string."""
    if value is None:
        return None
    return _text(value).strip() or None


def _pci_id(value: object) -> str | None:
    return f"0x{value:08X}" if isinstance(value, int) and not isinstance(value, bool) else None


def _bus_id_of(calls: _Calls, info: Any) -> str:
    try:
        return normalise_pci_bus_id(_text(info.busId))
    except (AttributeError, ValueError):
        calls.count("nvmlDeviceGetPciInfo", "invalid_bus_id")
        return ""


def _library_missing() -> str | None:
    """Why the driver's NVML library cannot be loaded; None when it can.

    Asked before pynvml is imported, on every read until NVML initialises: a node without an NVIDIA
    driver (a CPU or Trainium node, where the DaemonSet runs too) then never holds pynvml (4 MB), and
    pays a failed ``dlopen`` per scrape instead of a trip to the system lane. A driver installed later
    (the GPU Operator's driver container) is found on the next read. Where the library loads, this
    leaves it loaded: pynvml's own ``dlopen`` gets the same handle.
    """
    try:
        ctypes.CDLL(NVML_LIBRARY)
    except OSError as exc:
        return f"{NVML_LIBRARY} cannot be loaded: {exc}"
    return None


class PynvmlReader:
    """NVML through pynvml (nvidia-ml-py), every call bounded. Initialises on first read; retries
    initialisation on every read while NVML is unavailable. Until the driver's library loads,
    pynvml is not even imported (see :func:`_library_missing`).

    Reads are serialised: a scrape arriving while another reads waits for it (at most ``timeout``).
    """

    def __init__(
        self,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        library: Any = None,
        event_wait_ms: int = 500,
        patience: float = DEFAULT_PATIENCE,
    ) -> None:
        self.timeout = timeout
        """Seconds one read may take, all GPUs together."""
        self.patience = patience
        """Seconds a read waits for its GPUs to be read one after another before it gives every GPU
        not yet begun a worker of its own (at most a quarter of ``timeout``)."""
        self.event_wait_ms = event_wait_ms
        """How long the Xid watcher blocks in one ``nvmlEventSetWait`` (bounds how long stopping takes)."""
        self._library = library
        """The pynvml module or a stand-in with its functions and constants; None imports pynvml."""
        self._nvml: Any = None
        self._gpu_reader: _GpuReader | None = None
        self._read_lock = threading.Lock()
        self._system = _Lane("nvml")
        self._workers = _Workers("nvml-gpus")
        self._reading: dict[int, _Job[_GpuResult]] = {}
        """GPU index -> its latest job; one not done is stuck (later reads skip the GPU)."""
        self._known: dict[int, _Identity] = {}
        self._link_tallies: dict[str, _LinkTally] = {}
        """GPU UUID -> its NVLink readings, for :class:`NvLinkTotals`; kept across close()."""
        self._timeouts: dict[str, int] = {}
        self._errors: dict[tuple[str, str], int] = {}
        self._watch_lock = threading.Lock()
        self._watcher: _XidWatcher | None = None
        self._identity_lock = threading.Lock()
        self._identity_lane = _Lane("nvml-identity")
        """Identity calls run here, so one that hangs holds up no health read."""
        self._identity: NvmlIdentity | None = None

    def identity(self, *, refresh: bool = False) -> NvmlIdentity:
        with self._identity_lock:
            if self._identity is not None and self._identity.available and not refresh:
                return self._identity
            outcome = self._fresh_identity(time.monotonic() + self.timeout)
            if isinstance(outcome, str):
                return self._identity_or(outcome)
            self._identity = outcome
            return outcome

    def _identity_count(self, deadline: float) -> int | str:
        """GPU count for an identity read, initialising NVML if needed; or why NVML is unavailable."""
        with self._read_lock:
            if self._nvml is None and self._library is None and (missing := _library_missing()):
                return missing
            return self._enumerate(deadline)

    def _fresh_identity(self, deadline: float) -> NvmlIdentity | str:
        """The identity read now, on the identity lane, by ``deadline``; or why it could not be."""
        count = self._identity_count(deadline)
        if isinstance(count, str):
            return count
        if (busy := self._identity_lane.busy()) is not None:
            return f"{busy.call} has not returned for {time.monotonic() - busy.call_started:.0f} s"
        try:
            job: _Job[_IdentityRead] = self._identity_lane.submit(
                _Job(functools.partial(self._read_identity, count=count))
            )
        except RuntimeError as exc:  # a limit on threads (pids cgroup)
            return f"cannot start a thread for NVML: {exc}"
        if not job.done.wait(max(0.0, deadline - time.monotonic())):
            with self._read_lock:
                self._timed_out(job.call, "identity")
            return f"{job.call} did not return within {self.timeout:g} s"
        if job.error is not None or job.result is None:
            logger.error("nvml: reading the GPUs' identity failed", exc_info=job.error)
            return f"reading the identity failed: {job.error!r}"
        identity, errors = job.result
        with self._read_lock:
            self._count_errors(errors)
        return identity

    def _identity_or(self, reason: str) -> NvmlIdentity:
        """The last identity read, or an unavailable one saying ``reason``."""
        if self._identity is not None and self._identity.available:
            return self._identity
        return NvmlIdentity(available=False, reason=reason)

    def _read_identity(self, job: _Job[_IdentityRead], *, count: int) -> _IdentityRead:
        """Runs on the identity lane: the driver's versions, then each GPU's identity fields."""
        nvml = self._nvml
        calls = _Calls(nvml, job)
        driver = _optional_text(calls.get("nvmlSystemGetDriverVersion"))
        cuda = calls.get("nvmlSystemGetCudaDriverVersion")
        cuda_version = f"{int(cuda) // 1000}.{int(cuda) % 1000 // 10}" if isinstance(cuda, int) else None
        gpus: list[GpuIdentity] = []
        for index in range(count):
            known = self._known.get(index, _Identity())
            fields: dict[str, str | None] = {}
            pci_bus_id = known.pci_bus_id
            try:
                handle = known.handle or calls.get("nvmlDeviceGetHandleByIndex", index)
                if handle is not None:
                    for name, call in _IDENTITY_CALLS:
                        fields[name] = _optional_text(calls.get(call, handle))
                    info = calls.get("nvmlDeviceGetPciInfo", handle)
                    if info is not None:
                        pci_bus_id = pci_bus_id or _bus_id_of(calls, info)
                        fields["pci_device_id"] = _pci_id(getattr(info, "pciDeviceId", None))
                        fields["pci_subsystem_id"] = _pci_id(getattr(info, "pciSubSystemId", None))
            except _GpuLostError:
                pass  # what was read before NVML said the GPU is lost stays; the rest is None
            gpus.append(GpuIdentity(index=index, pci_bus_id=pci_bus_id, **fields))
        identity = NvmlIdentity(
            available=True, driver_version=driver, cuda_driver_version=cuda_version, gpus=tuple(gpus)
        )
        return identity, calls.errors

    def read(self, *, brief: bool = False) -> NvmlSnapshot:
        with self._read_lock:
            if self._nvml is None and self._library is None and (missing := _library_missing()):
                return self._snapshot(available=False, reason=missing)
            deadline = time.monotonic() + self.timeout
            count = self._enumerate(deadline)
            if isinstance(count, str):
                return self._snapshot(available=False, reason=count)
            gpus = self._read_gpus(count, deadline, brief=brief)
            return self._snapshot(available=True, count=count, gpus=gpus)

    def xid_events(self) -> NvmlXidCounts:
        nvml = self._nvml
        if nvml is None:
            return NvmlXidCounts(error="NVML is not initialised")
        with self._watch_lock:
            if self._watcher is None:
                self._watcher = _XidWatcher(nvml, wait_ms=self.event_wait_ms)
                self._watcher.start()
            return self._watcher.counts()

    def close(self) -> None:
        with self._watch_lock:
            if self._watcher is not None:
                self._watcher.stop(timeout=self.event_wait_ms / 1000 + 0.5)
                self._watcher = None
        with self._read_lock:
            stuck = sum(1 for job in self._reading.values() if not job.done.is_set())
            stuck += self._system.busy() is not None
            stuck += self._identity_lane.busy() is not None
            if self._nvml is not None and stuck:
                logger.warning("nvml: %d NVML calls still stuck; not calling nvmlShutdown", stuck)
            elif self._nvml is not None:
                self._shut_down()
            self._system.stop()
            self._workers.stop()
            self._identity_lane.stop()
            self._identity_lane = _Lane("nvml-identity")
            self._system = _Lane("nvml")
            self._workers = _Workers("nvml-gpus")
            self._reading = {}
            self._known = {}
            self._nvml = None

    def _shut_down(self) -> None:
        try:
            job = self._system.submit(_Job(self._shutdown))
        except RuntimeError as exc:  # a limit on threads (pids cgroup)
            logger.warning("nvml: cannot start a thread for nvmlShutdown: %s", exc)
            return
        if not job.done.wait(self.timeout):
            logger.warning("nvml: nvmlShutdown did not return within %g s", self.timeout)
        elif job.error is not None:
            logger.warning("nvml: shutdown failed: %s", job.error)

    def _shutdown(self, job: _Job[None]) -> None:
        job.call = "nvmlShutdown"
        self._nvml.nvmlShutdown()

    def _init_and_count(self, job: _Job[int]) -> int:
        """Runs on the system lane: nvmlInit once (until it succeeds), then nvmlDeviceGetCount."""
        if self._nvml is None:
            job.call = "import pynvml"
            nvml = self._library if self._library is not None else importlib.import_module("pynvml")
            gpu_reader = _GpuReader(nvml)
            job.call = "nvmlInit"
            nvml.nvmlInit()
            self._gpu_reader, self._nvml = gpu_reader, nvml
        job.call = "nvmlDeviceGetCount"
        return int(self._nvml.nvmlDeviceGetCount())

    def _enumerate(self, deadline: float) -> int | str:
        """GPU count, or why NVML is unavailable."""
        if (busy := self._system.busy()) is not None:
            return f"{busy.call} has not returned for {time.monotonic() - busy.call_started:.0f} s"
        try:
            job = self._system.submit(_Job(self._init_and_count))
        except RuntimeError as exc:  # a limit on threads (pids cgroup)
            return f"cannot start a thread for NVML: {exc}"
        if not job.done.wait(max(0.0, deadline - time.monotonic())):
            self._timed_out(job.call, "")
            return f"{job.call} did not return within {self.timeout:g} s"
        if job.error is not None:
            if isinstance(job.error, ImportError):
                return f"pynvml is not installed: {job.error}"
            return f"{job.call} failed: {job.error}"
        assert job.result is not None  # a job without an error has its result
        return job.result

    def _read_gpus(self, count: int, deadline: float, *, brief: bool = False) -> tuple[NvmlGpuHealth, ...]:
        gpu_reader = self._gpu_reader
        assert gpu_reader is not None  # set with self._nvml
        gpus: dict[int, NvmlGpuHealth] = {}
        for index in range(count):
            if (busy := self._reading.get(index)) is not None and not busy.done.is_set():
                gpus[index] = self._stalled(index, busy, "stuck")
        countdown = _Countdown(count - len(gpus))
        jobs: dict[int, _Job[_GpuResult]] = {}
        for index in range(count):
            if index not in gpus:
                known = self._known.get(index, _Identity())
                work = functools.partial(gpu_reader.read, index=index, known=known, brief=brief)
                jobs[index] = self._reading[index] = _Job(work, countdown)
        batch = _Batch(list(jobs.values()), self._workers)
        batch.start()
        patience = min(self.patience, self.timeout / 4)
        if not countdown.done.wait(max(0.0, min(patience, deadline - time.monotonic()))):
            batch.spread()
            countdown.done.wait(max(0.0, deadline - time.monotonic()))
        withdrawn = set(batch.withdraw())
        for index, job in jobs.items():
            if job in withdrawn:  # no worker began it: nothing is stuck
                logger.warning("nvml: GPU %d: no worker began its read within %g s", index, self.timeout)
                del self._reading[index]
                gpus[index] = self._stalled(index, job, "timeout", begun=False)
            elif not job.done.is_set():
                self._timed_out(job.call, f"GPU {index}")
                gpus[index] = self._stalled(index, job, "timeout")
            elif job.error is not None or job.result is None:
                # Not an NVML error (those are values): a fault in this module or the library.
                logger.error("nvml: reading GPU %d failed", index, exc_info=job.error)
                self._count_errors({(job.call, _error_name(job.error or RuntimeError())): 1})
                gpus[index] = NvmlGpuHealth(index=index, status="error")
            else:
                self._known[index] = job.result.identity
                self._count_errors(job.result.errors)
                gpus[index] = self._with_nvlink_totals(job.result.health)
        return tuple(gpus[index] for index in range(count))

    def _with_nvlink_totals(self, health: NvmlGpuHealth) -> NvmlGpuHealth:
        """``health`` with its links' totals, kept per GPU (by UUID) from read to read."""
        if not health.nvlinks:  # no NVLink, or a brief read: nothing to add, nothing to forget
            return health
        key = health.uuid or health.pci_bus_id or f"index {health.index}"
        tally = self._link_tallies.get(key)
        if tally is None:
            if len(self._link_tallies) >= _MAX_TALLIES:  # GPUs replaced over a long uptime
                self._link_tallies.clear()
            tally = self._link_tallies[key] = _LinkTally()
        return replace(health, nvlink_totals=tally.add(health.nvlinks))

    def _stalled(self, index: int, job: _Job[Any], status: GpuStatus, *, begun: bool = True) -> NvmlGpuHealth:
        """A GPU whose job has not finished; one no worker has ``begun`` names no call."""
        if isinstance(job.learnt, _Identity):
            self._known[index] = job.learnt
        known = self._known.get(index, _Identity())
        return NvmlGpuHealth(
            index=index,
            status=status,
            uuid=known.uuid,
            pci_bus_id=known.pci_bus_id,
            model=known.model,
            stuck_call=job.call if begun else "",
            stuck_seconds=time.monotonic() - job.call_started if begun else None,
        )

    def _timed_out(self, call: str, what: str) -> None:
        self._timeouts[call] = self._timeouts.get(call, 0) + 1
        logger.warning(
            "nvml: %s%s did not return within %g s; abandoned",
            f"{what}: " if what else "",
            call,
            self.timeout,
        )

    def _count_errors(self, errors: Mapping[tuple[str, str], int]) -> None:
        for key, count in errors.items():
            if key not in self._errors:
                logger.warning("nvml: %s failed: %s (counted from now on, logged once)", *key)
            self._errors[key] = self._errors.get(key, 0) + count

    def _snapshot(
        self,
        *,
        available: bool,
        reason: str = "",
        count: int | None = None,
        gpus: tuple[NvmlGpuHealth, ...] = (),
    ) -> NvmlSnapshot:
        return NvmlSnapshot(
            available=available,
            reason=reason,
            gpu_count=count,
            gpus=gpus,
            call_timeouts=MappingProxyType(dict(self._timeouts)),
            field_errors=MappingProxyType(dict(self._errors)),
        )
