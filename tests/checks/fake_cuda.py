"""A stand-in for ``cuda.bindings.driver``: the functions the bandwidth checks call, on simulated GPUs.

It follows the bindings' documented calling convention: every function returns a tuple whose first
item is a ``CUresult`` (the real enum, imported from cuda-bindings, which needs no driver to import)
and then the outputs; ``cuDeviceGetPCIBusId`` answers NUL-padded bytes such as ``b"0000:1B:00.0"``.
Time is simulated per stream: an asynchronous copy of N bytes advances its stream's clock by
N / bandwidth (a device-to-device copy by 2N / bandwidth: it reads and writes every byte), an event
records its stream's clock, and ``cuEventElapsedTime`` answers the difference in milliseconds, as the
GPU's timer would. Per GPU, ``errors`` maps a call to the CUresult name it fails with and ``hang``
blocks a call until :attr:`FakeCuda.release` is set. Calls are counted in :attr:`FakeCuda.calls`.
"""

from __future__ import annotations

import itertools
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from cuda.bindings.driver import CUresult

SUCCESS = CUresult.CUDA_SUCCESS
Result = tuple[Any, ...]
"""What a binding returns: ``(CUresult, outputs...)``."""


@dataclass
class FakeGpu:
    bus_id: str
    """As CUDA prints it: ``0000:1B:00.0``."""
    host_to_device: float = 53.5e9
    device_to_host: float = 54.8e9
    device_to_device: float = 2.9e12
    errors: dict[str, str] = field(default_factory=dict)
    hang: set[str] = field(default_factory=set)


H100_BUS_IDS = ("1B", "43", "52", "61", "9D", "C3", "D1", "DF")


def h100x8(**degraded: dict[str, Any]) -> list[FakeGpu]:
    """The demo's gpu-node-1: 8 GPUs at PCIe Gen5 x16 rates; ``degraded={"4": {...}}`` overrides one."""
    gpus = [FakeGpu(f"0000:{bus}:00.0") for bus in H100_BUS_IDS]
    for index, changes in degraded.items():
        for key, value in changes.items():
            setattr(gpus[int(index)], key, value)
    return gpus


class FakeCuda:
    CUresult: Any = CUresult

    def __init__(self, gpus: list[FakeGpu], *, init_error: str | None = None) -> None:
        self.gpus = gpus
        self.init_error = init_error
        self.release = threading.Event()
        self.calls: Counter[str] = Counter()
        self.touched: set[int] = set()
        """Ordinals on which a context was made current (a GPU the check used)."""
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._current = threading.local()
        self._streams: dict[int, float] = {}
        self._events: dict[int, tuple[int, float]] = {}
        self._allocated: dict[int, str] = {}
        self._contexts: Counter[int] = Counter()

    # -- helpers ------------------------------------------------------------------------------------

    def _enter(self, call: str, ordinal: int | None = None) -> Any:
        self.calls[call] += 1
        if ordinal is None:
            ordinal = getattr(self._current, "ordinal", None)
        if ordinal is None:
            return None
        gpu = self.gpus[ordinal]
        if call in gpu.hang:
            self.release.wait()
        name = gpu.errors.get(call)
        return getattr(CUresult, name) if name else None

    def _new(self) -> int:
        with self._lock:
            return next(self._ids)

    def live_allocations(self) -> int:
        return len(self._allocated)

    def held_contexts(self) -> int:
        return sum(self._contexts.values())

    # -- initialisation and devices -----------------------------------------------------------------

    def cuInit(self, flags: int) -> Result:
        self.calls["cuInit"] += 1
        return (getattr(CUresult, self.init_error) if self.init_error else SUCCESS,)

    def cuDeviceGetCount(self) -> Result:
        self.calls["cuDeviceGetCount"] += 1
        return SUCCESS, len(self.gpus)

    def cuDeviceGet(self, ordinal: int) -> Result:
        self.calls["cuDeviceGet"] += 1
        if not 0 <= ordinal < len(self.gpus):
            return CUresult.CUDA_ERROR_INVALID_DEVICE, 0
        return SUCCESS, ordinal

    def cuDeviceGetPCIBusId(self, length: int, device: int) -> Result:
        error = self._enter("cuDeviceGetPCIBusId", device)
        if error:
            return error, b""
        return SUCCESS, self.gpus[device].bus_id.encode().ljust(length, b"\x00")

    def cuDevicePrimaryCtxRetain(self, device: int) -> Result:
        error = self._enter("cuDevicePrimaryCtxRetain", device)
        if error:
            return error, 0
        self._contexts[device] += 1
        return SUCCESS, 1000 + device

    def cuDevicePrimaryCtxRelease(self, device: int) -> Result:
        self.calls["cuDevicePrimaryCtxRelease"] += 1
        self._contexts[device] -= 1
        return (SUCCESS,)

    def cuCtxSetCurrent(self, context: int) -> Result:
        ordinal = context - 1000
        self._current.ordinal = ordinal
        self.touched.add(ordinal)
        error = self._enter("cuCtxSetCurrent", ordinal)
        return (error or SUCCESS,)

    # -- memory, streams, events --------------------------------------------------------------------

    def _alloc(self, call: str, kind: str) -> Result:
        error = self._enter(call)
        if error:
            return error, 0
        handle = self._new()
        self._allocated[handle] = kind
        return SUCCESS, handle

    def cuMemAlloc(self, size: int) -> Result:
        return self._alloc("cuMemAlloc", "device")

    def cuMemAllocHost(self, size: int) -> Result:
        return self._alloc("cuMemAllocHost", "host")

    def cuMemFree(self, pointer: int) -> Result:
        self.calls["cuMemFree"] += 1
        return (
            SUCCESS if self._allocated.pop(pointer, None) == "device" else CUresult.CUDA_ERROR_INVALID_VALUE,
        )

    def cuMemFreeHost(self, pointer: int) -> Result:
        self.calls["cuMemFreeHost"] += 1
        return (
            SUCCESS if self._allocated.pop(pointer, None) == "host" else CUresult.CUDA_ERROR_INVALID_VALUE,
        )

    def cuStreamCreate(self, flags: int) -> Result:
        error = self._enter("cuStreamCreate")
        if error:
            return error, 0
        stream = self._new()
        self._streams[stream] = 0.0
        return SUCCESS, stream

    def cuStreamDestroy(self, stream: int) -> Result:
        self.calls["cuStreamDestroy"] += 1
        self._streams.pop(stream, None)
        return (SUCCESS,)

    def cuEventCreate(self, flags: int) -> Result:
        self.calls["cuEventCreate"] += 1
        event = self._new()
        self._events[event] = (0, -1.0)
        return SUCCESS, event

    def cuEventDestroy(self, event: int) -> Result:
        self.calls["cuEventDestroy"] += 1
        self._events.pop(event, None)
        return (SUCCESS,)

    def cuEventRecord(self, event: int, stream: int) -> Result:
        error = self._enter("cuEventRecord")
        if error:
            return (error,)
        self._events[event] = (stream, self._streams[stream])
        return (SUCCESS,)

    def cuEventSynchronize(self, event: int) -> Result:
        return (self._enter("cuEventSynchronize") or SUCCESS,)

    def cuEventElapsedTime(self, start: int, end: int) -> Result:
        error = self._enter("cuEventElapsedTime")
        if error:
            return error, 0.0
        (_, began), (_, ended) = self._events[start], self._events[end]
        if began < 0 or ended < 0:
            return CUresult.CUDA_ERROR_INVALID_HANDLE, 0.0
        return SUCCESS, (ended - began) * 1000.0

    def _copy(self, call: str, size: int, stream: int, rate: str, factor: int) -> Result:
        error = self._enter(call)
        if error:
            return (error,)
        gpu = self.gpus[self._current.ordinal]
        self._streams[stream] += factor * size / getattr(gpu, rate)
        return (SUCCESS,)

    def cuMemcpyHtoDAsync(self, dst: int, src: int, size: int, stream: int) -> Result:
        return self._copy("cuMemcpyHtoDAsync", size, stream, "host_to_device", 1)

    def cuMemcpyDtoHAsync(self, dst: int, src: int, size: int, stream: int) -> Result:
        return self._copy("cuMemcpyDtoHAsync", size, stream, "device_to_host", 1)

    def cuMemcpyDtoDAsync(self, dst: int, src: int, size: int, stream: int) -> Result:
        return self._copy("cuMemcpyDtoDAsync", size, stream, "device_to_device", 2)
