"""NVML reader: an interface, and an implementation over pynvml that degrades to "unavailable".

pynvml is imported lazily inside :meth:`PynvmlReader.read`, so importing this module never needs the
library or a driver. Metrics from NVML (ECC, remapped rows, PCIe replays, NVLink) come in a later
change; for now the reader reports whether NVML works and which GPUs it sees.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from typing import Any, Protocol

from exporter.readers.kmsg import normalise_pci_bus_id

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class NvmlGpu:
    """One GPU as NVML enumerates it."""

    index: int
    uuid: str
    pci_bus_id: str
    """Normalised ``0000:91:00`` (NVML's own busId reads ``00000000:91:00.0``)."""


@dataclass(frozen=True)
class NvmlReading:
    """The outcome of one NVML read."""

    available: bool
    reason: str = ""
    """Why NVML is unavailable; empty when it is available."""
    gpus: tuple[NvmlGpu, ...] = ()


class NvmlReader(Protocol):
    """What the NVML collector needs; tests use a fake, production :class:`PynvmlReader`."""

    def read(self) -> NvmlReading: ...

    def close(self) -> None: ...


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class PynvmlReader:
    """NVML through ``pynvml`` (nvidia-ml-py). Initialises on first use; retries while unavailable."""

    def __init__(self) -> None:
        self._nvml: Any = None

    def _initialised(self) -> Any:
        if self._nvml is None:
            nvml = importlib.import_module("pynvml")
            nvml.nvmlInit()
            self._nvml = nvml
        return self._nvml

    def read(self) -> NvmlReading:
        try:
            nvml = self._initialised()
        except ImportError as exc:
            return NvmlReading(available=False, reason=f"pynvml is not installed: {exc}")
        except Exception as exc:  # any NVMLError (no library, no driver) means unavailable
            return NvmlReading(available=False, reason=f"NVML init failed: {exc}")
        gpus: list[NvmlGpu] = []
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            uuid = _text(nvml.nvmlDeviceGetUUID(handle))
            bus_id = normalise_pci_bus_id(_text(nvml.nvmlDeviceGetPciInfo(handle).busId))
            gpus.append(NvmlGpu(index=index, uuid=uuid, pci_bus_id=bus_id))
        return NvmlReading(available=True, gpus=tuple(gpus))

    def close(self) -> None:
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception as exc:  # shutting down; nothing left to do but say so
                logger.warning("nvml: shutdown failed: %s", exc)
            self._nvml = None
