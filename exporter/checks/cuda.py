"""Copy bandwidth through the CUDA driver API, with NVIDIA's own bindings (``cuda-bindings``).

This is the only module that touches CUDA. It imports ``cuda.bindings.driver`` lazily, so the exporter
runs without the optional ``[checks]`` extra and without a driver; the bindings load the driver's
``libcuda.so.1`` and need no CUDA toolkit.

A measurement follows NVIDIA's ``bandwidthTest``: on the device's primary context, one warm-up copy,
then ``repeats`` asynchronous copies of ``size`` bytes on one stream between two events;
``cuEventElapsedTime`` gives the time on the GPU's own clock. Host memory is page-locked
(``cuMemAllocHost``), so a host<->device copy runs at the link's DMA rate. A device-to-device copy reads
and writes every byte, so, as ``bandwidthTest`` does, it counts twice the bytes copied.

Every binding returns ``(CUresult, value...)``; any result but ``CUDA_SUCCESS`` becomes
:class:`CudaError` naming the call and the error (``CUDA_ERROR_ECC_UNCORRECTABLE`` ...).
"""

from __future__ import annotations

import importlib
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from exporter.readers.kmsg import normalise_pci_bus_id

Direction = Literal["host_to_device", "device_to_host", "device_to_device"]


class CudaError(RuntimeError):
    """A CUDA call failed, or CUDA cannot be used at all (no bindings, no driver)."""


@dataclass(frozen=True)
class CudaDevice:
    ordinal: int
    """CUDA's device ordinal (``cuDeviceGet``)."""
    pci_bus_id: str
    """Normalised ``0000:1b:00``."""


class CudaDriver(Protocol):
    """What the bandwidth checks need from CUDA; production uses :class:`CudaBindingsDriver`."""

    def devices(self) -> list[CudaDevice]:
        """The GPUs CUDA sees; raises :class:`CudaError` when CUDA is unusable."""
        ...

    def copy_bandwidth(self, ordinal: int, direction: Direction, *, size: int, repeats: int) -> float:
        """Bytes per second of ``repeats`` copies of ``size`` bytes; raises :class:`CudaError`."""
        ...


class CudaBindingsDriver:
    """:class:`CudaDriver` over ``cuda.bindings.driver`` (or a stand-in module with its functions)."""

    def __init__(self, *, library: Any = None) -> None:
        self._library = library
        self._cuda: Any = None
        self._lock = threading.Lock()

    def _driver(self) -> Any:
        with self._lock:
            if self._cuda is None:
                cuda = self._library
                if cuda is None:
                    # CUDA numbers devices fastest-first by default; PCI order matches NVML's indices.
                    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
                    try:
                        cuda = importlib.import_module("cuda.bindings.driver")
                    except ImportError as exc:
                        raise CudaError(
                            f"cuda-bindings is not installed (pip install 'accel-health[checks]'): {exc}"
                        ) from exc
                try:
                    (result,) = cuda.cuInit(0)
                except Exception as exc:  # the bindings raise when libcuda.so.1 cannot be loaded
                    raise CudaError(f"cuInit: {type(exc).__name__}: {exc}") from exc
                _check(cuda, "cuInit", result)
                self._cuda = cuda
            return self._cuda

    def devices(self) -> list[CudaDevice]:
        cuda = self._driver()
        count = _call(cuda, "cuDeviceGetCount")
        found = []
        for ordinal in range(count):
            device = _call(cuda, "cuDeviceGet", ordinal)
            raw = _call(cuda, "cuDeviceGetPCIBusId", 32, device)
            text = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
            found.append(CudaDevice(ordinal, normalise_pci_bus_id(text.split("\x00", 1)[0])))
        return found

    def copy_bandwidth(self, ordinal: int, direction: Direction, *, size: int, repeats: int) -> float:
        if size <= 0 or repeats <= 0:
            raise ValueError("size and repeats must be positive")
        cuda = self._driver()
        with _context(cuda, ordinal), _resources(cuda) as keep:
            stream = keep(_call(cuda, "cuStreamCreate", 0), "cuStreamDestroy")
            start = keep(_call(cuda, "cuEventCreate", 0), "cuEventDestroy")
            stop = keep(_call(cuda, "cuEventCreate", 0), "cuEventDestroy")
            device = keep(_call(cuda, "cuMemAlloc", size), "cuMemFree")
            if direction == "device_to_device":
                other = keep(_call(cuda, "cuMemAlloc", size), "cuMemFree")
                copy = ("cuMemcpyDtoDAsync", other, device)
            else:
                host = keep(_call(cuda, "cuMemAllocHost", size), "cuMemFreeHost")
                copy = (
                    ("cuMemcpyHtoDAsync", device, host)
                    if direction == "host_to_device"
                    else ("cuMemcpyDtoHAsync", host, device)
                )
            name, destination, source = copy
            _call(cuda, name, destination, source, size, stream)  # warm-up: first-touch costs
            _call(cuda, "cuEventRecord", start, stream)
            for _ in range(repeats):
                _call(cuda, name, destination, source, size, stream)
            _call(cuda, "cuEventRecord", stop, stream)
            _call(cuda, "cuEventSynchronize", stop)
            milliseconds = float(_call(cuda, "cuEventElapsedTime", start, stop))
        if milliseconds <= 0:
            raise CudaError(f"cuEventElapsedTime: {milliseconds} ms for {repeats} copies")
        moved = size * repeats * (2 if direction == "device_to_device" else 1)
        return moved / (milliseconds / 1000.0)


def _check(cuda: Any, call: str, result: Any) -> None:
    if result != cuda.CUresult.CUDA_SUCCESS:
        name = getattr(result, "name", None) or str(result)
        raise CudaError(f"{call}: {name}")


def _call(cuda: Any, call: str, *args: Any) -> Any:
    """The value of a binding that returns ``(CUresult, value)`` or just ``(CUresult,)``."""
    returned = getattr(cuda, call)(*args)
    _check(cuda, call, returned[0])
    return returned[1] if len(returned) > 1 else None


@contextmanager
def _context(cuda: Any, ordinal: int) -> Iterator[None]:
    device = _call(cuda, "cuDeviceGet", ordinal)
    context = _call(cuda, "cuDevicePrimaryCtxRetain", device)
    try:
        _call(cuda, "cuCtxSetCurrent", context)
        yield
    finally:
        cuda.cuDevicePrimaryCtxRelease(device)


@contextmanager
def _resources(cuda: Any) -> Iterator[Callable[[Any, str], Any]]:
    """Frees what was allocated, in reverse order, however the measurement ends."""
    kept: list[tuple[Any, str]] = []

    def keep(handle: Any, release: str) -> Any:
        kept.append((handle, release))
        return handle

    try:
        yield keep
    finally:
        for handle, release in reversed(kept):
            getattr(cuda, release)(handle)
