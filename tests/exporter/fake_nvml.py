"""A stand-in for the ``pynvml`` module, driven by a JSON snapshot in ``tests/fixtures/nvml``.

It implements the pynvml functions :class:`exporter.readers.nvml.PynvmlReader` calls, so the reader's
own error mapping, bounding and caching run in tests exactly as on a GPU machine. Error classes and
constants are pynvml's own (forwarded from the installed package, which needs no driver to import),
so their values cannot drift from the real library; a function the fake lacks raises AttributeError.

Snapshot format: ``{"description", "defaults", "gpus": [...]}``; each GPU is ``defaults`` updated with
its own keys. Any value may instead be the name of an NVML error without its ``NVML_ERROR_`` prefix
(``"NOT_SUPPORTED"``, ``"UNKNOWN"`` ...), which the matching call raises. Per GPU, ``"lost": true``
makes every call on its handle raise GPU_IS_LOST, ``"hang": [call, ...]`` makes those calls block
until :attr:`FakeNvml.release` is set, ``"delay": {call: seconds}`` makes a call sleep that long (as
NVML's throughput sampling does), and ``"errors": {call: error}`` makes one call fail. A GPU
without ``"nvlink"`` has no NVLink. ``nvmlDeviceGetFieldValues`` answers only
``NVML_FI_DEV_NVLINK_GET_STATE`` (scoped by link), from ``nvlink.state``; ``"nvlink_state_field":
false`` makes it answer NOT_SUPPORTED for every link, as for GPUs before Hopper. ``"processes": [pid, ...]``
lists the compute processes on a GPU. Identity: ``serial``, ``board_part_number``, ``vbios_version``,
``inforom_image_version`` (NOT_SUPPORTED where absent), ``pci_device_id`` and ``pci_subsystem_id``
(integers in NVML's form) per GPU, ``driver_version`` and ``cuda_driver_version`` at the top.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pynvml  # only for its error classes and constants; importing it needs no driver

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "nvml"

_FORWARDED = ("NVML_", "NVMLError", "nvmlClocksEventReason", "nvmlClocksThrottleReason", "nvmlEventType")
_REASON_SUFFIXES = {
    "gpu_idle": "GpuIdle",
    "applications_clocks_setting": "ApplicationsClocksSetting",
    "sw_power_cap": "SwPowerCap",
    "hw_slowdown": "HwSlowdown",
    "sync_boost": "SyncBoost",
    "sw_thermal_slowdown": "SwThermalSlowdown",
    "hw_thermal_slowdown": "HwThermalSlowdown",
    "hw_power_brake": "HwPowerBrakeSlowdown",
    "display_clock_setting": "DisplayClockSetting",
}
_ECC_COUNTERS = {pynvml.NVML_VOLATILE_ECC: "volatile", pynvml.NVML_AGGREGATE_ECC: "aggregate"}
_ECC_TYPES = {
    pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED: "corrected",
    pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED: "uncorrected",
}
_RETIREMENT_CAUSES = {
    pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS: "single_bit_ecc",
    pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR: "double_bit_ecc",
}
_NVLINK_COUNTERS = {
    pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT: "crc_flit",
    pynvml.NVML_NVLINK_ERROR_DL_CRC_DATA: "crc_data",
    pynvml.NVML_NVLINK_ERROR_DL_REPLAY: "replay",
    pynvml.NVML_NVLINK_ERROR_DL_RECOVERY: "recovery",
}
_THROUGHPUT = {pynvml.NVML_PCIE_UTIL_TX_BYTES: "tx", pynvml.NVML_PCIE_UTIL_RX_BYTES: "rx"}


def nvml_error(name: str) -> pynvml.NVMLError:
    """pynvml's exception for ``NVML_ERROR_<name>`` (its NVMLError_* subclass, as the library raises)."""
    error: pynvml.NVMLError = pynvml.NVMLError(getattr(pynvml, f"NVML_ERROR_{name}"))
    return error


def _value(value: Any) -> Any:
    """``value``, or the NVML error it names (``"NOT_SUPPORTED"`` ...) raised."""
    if isinstance(value, str) and hasattr(pynvml, f"NVML_ERROR_{value}"):
        raise nvml_error(value)
    return value


def _reason_mask(names: list[str]) -> int:
    mask = 0
    for name in names:
        mask |= int(getattr(pynvml, "nvmlClocksThrottleReason" + _REASON_SUFFIXES[name]))
    return mask


@dataclass(frozen=True)
class FakeHandle:
    """A device handle: hashable, like the reader needs."""

    index: int


@dataclass(frozen=True)
class FakeEventData:
    """What ``nvmlEventSetWait`` returns (``c_nvmlEventData_t``'s fields)."""

    device: FakeHandle
    eventType: int
    eventData: int


class FakeNvml:
    """The pynvml functions the reader uses, answering from a snapshot; mutate :attr:`gpus` freely."""

    def __init__(self, snapshot: dict[str, Any]) -> None:
        defaults = snapshot.get("defaults", {})
        self.description: str = snapshot.get("description", "")
        self.gpus: list[dict[str, Any]] = [{**defaults, **gpu} for gpu in snapshot["gpus"]]
        self.driver_version: str = snapshot.get("driver_version", "NOT_SUPPORTED")
        """What ``nvmlSystemGetDriverVersion`` answers (an error name raises it)."""
        self.cuda_driver_version: int | str = snapshot.get("cuda_driver_version", "NOT_SUPPORTED")
        """What ``nvmlSystemGetCudaDriverVersion`` answers, e.g. 12020 (an error name raises it)."""
        self.init_error: str | None = snapshot.get("init_error")
        """An NVML error name nvmlInit raises (e.g. ``LIBRARY_NOT_FOUND``), or None."""
        self.init_hangs = False
        """Whether nvmlInit blocks until :attr:`release` is set."""
        self.release = threading.Event()
        """Set it to let hanging calls return."""
        self._log: list[str] = []
        """Every call's function name, in order (appending is atomic, so worker threads need no lock)."""
        self.initialised = 0
        """nvmlInit calls minus nvmlShutdown calls."""
        self.registered: set[int] = set()
        self._events: queue.SimpleQueue[FakeEventData] = queue.SimpleQueue()

    @property
    def calls(self) -> Counter[str]:
        """Calls made so far, by function name."""
        return Counter(self._log)

    @classmethod
    def from_fixture(cls, name: str) -> FakeNvml:
        snapshot: dict[str, Any] = json.loads((FIXTURES / f"{name}.json").read_text())
        return cls(snapshot)

    def __getattr__(self, name: str) -> Any:
        if name.startswith(_FORWARDED):
            return getattr(pynvml, name)
        raise AttributeError(f"the fake NVML has no {name}")

    def emit_xid(self, index: int, xid: int) -> None:
        """Delivers an Xid event for GPU ``index`` to ``nvmlEventSetWait``."""
        self._events.put(
            FakeEventData(
                device=FakeHandle(index), eventType=pynvml.nvmlEventTypeXidCriticalError, eventData=xid
            )
        )

    def _count(self, call: str) -> None:
        self._log.append(call)

    def _gpu(self, handle: FakeHandle, call: str) -> dict[str, Any]:
        """The GPU's snapshot for one call: counts it, and applies ``hang``, ``errors`` and ``lost``.

        Kept about as cheap as pynvml's own wrapper around a C call (a microsecond or so), so the
        benchmark's read cost is the reader's, not the stand-in's.
        """
        self._log.append(call)
        if self.initialised <= 0:
            raise nvml_error("UNINITIALIZED")
        gpu = self.gpus[handle.index]
        if "hang" in gpu and call in gpu["hang"]:
            self.release.wait(timeout=60)
        if "delay" in gpu and (seconds := gpu["delay"].get(call)) is not None:
            time.sleep(seconds)
        if "errors" in gpu and (error := gpu["errors"].get(call)) is not None:
            raise nvml_error(error)
        if gpu.get("lost"):
            raise nvml_error("GPU_IS_LOST")
        return gpu

    # -- library ------------------------------------------------------------------------------------

    def nvmlInit(self) -> None:
        self._count("nvmlInit")
        if self.init_hangs:
            self.release.wait(timeout=60)
        if self.init_error is not None:
            raise nvml_error(self.init_error)
        self.initialised += 1

    def nvmlShutdown(self) -> None:
        self._count("nvmlShutdown")
        self.initialised -= 1

    def nvmlDeviceGetCount(self) -> int:
        self._count("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeHandle:
        self._count("nvmlDeviceGetHandleByIndex")
        if (error := self.gpus[index].get("errors", {}).get("nvmlDeviceGetHandleByIndex")) is not None:
            raise nvml_error(error)
        return FakeHandle(index)

    # -- identity -----------------------------------------------------------------------------------

    def nvmlDeviceGetUUID(self, handle: FakeHandle) -> bytes:
        return str(_value(self._gpu(handle, "nvmlDeviceGetUUID")["uuid"])).encode()

    def nvmlDeviceGetName(self, handle: FakeHandle) -> str:
        return str(_value(self._gpu(handle, "nvmlDeviceGetName")["name"]))

    def nvmlDeviceGetPciInfo(self, handle: FakeHandle) -> SimpleNamespace:
        gpu = self._gpu(handle, "nvmlDeviceGetPciInfo")
        bus_id = str(_value(gpu["bus_id"]))
        return SimpleNamespace(
            busId=bus_id.encode(),
            pciDeviceId=int(gpu.get("pci_device_id", 0)),
            pciSubSystemId=int(gpu.get("pci_subsystem_id", 0)),
        )

    def _identity(self, handle: FakeHandle, call: str, key: str) -> str:
        """An identity string; a snapshot without ``key`` answers NOT_SUPPORTED."""
        return str(_value(self._gpu(handle, call).get(key, "NOT_SUPPORTED")))

    def nvmlDeviceGetSerial(self, handle: FakeHandle) -> str:
        return self._identity(handle, "nvmlDeviceGetSerial", "serial")

    def nvmlDeviceGetBoardPartNumber(self, handle: FakeHandle) -> str:
        return self._identity(handle, "nvmlDeviceGetBoardPartNumber", "board_part_number")

    def nvmlDeviceGetVbiosVersion(self, handle: FakeHandle) -> str:
        return self._identity(handle, "nvmlDeviceGetVbiosVersion", "vbios_version")

    def nvmlDeviceGetInforomImageVersion(self, handle: FakeHandle) -> str:
        return self._identity(handle, "nvmlDeviceGetInforomImageVersion", "inforom_image_version")

    def nvmlSystemGetDriverVersion(self) -> str:
        self._count("nvmlSystemGetDriverVersion")
        return str(_value(self.driver_version))

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        self._count("nvmlSystemGetCudaDriverVersion")
        return int(_value(self.cuda_driver_version))

    # -- memory -------------------------------------------------------------------------------------

    def nvmlDeviceGetTotalEccErrors(self, handle: FakeHandle, error_type: int, counter_type: int) -> int:
        ecc = _value(self._gpu(handle, "nvmlDeviceGetTotalEccErrors")["ecc"])
        return int(_value(ecc[_ECC_COUNTERS[counter_type]][_ECC_TYPES[error_type]]))

    def nvmlDeviceGetRemappedRows(self, handle: FakeHandle) -> tuple[int, int, int, int]:
        correctable, uncorrectable, pending, failure = _value(
            self._gpu(handle, "nvmlDeviceGetRemappedRows")["remapped_rows"]
        )
        return (correctable, uncorrectable, pending, failure)

    def nvmlDeviceGetRetiredPages(self, handle: FakeHandle, cause: int) -> list[int]:
        pages = _value(self._gpu(handle, "nvmlDeviceGetRetiredPages")["retired_pages"])
        return list(_value(pages[_RETIREMENT_CAUSES[cause]]))

    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle: FakeHandle) -> int:
        return int(
            _value(self._gpu(handle, "nvmlDeviceGetRetiredPagesPendingStatus")["retired_pages_pending"])
        )

    # -- PCIe ---------------------------------------------------------------------------------------

    def _pcie(self, handle: FakeHandle, call: str) -> dict[str, Any]:
        pcie: dict[str, Any] = _value(self._gpu(handle, call)["pcie"])
        return pcie

    def nvmlDeviceGetCurrPcieLinkGeneration(self, handle: FakeHandle) -> int:
        return int(_value(self._pcie(handle, "nvmlDeviceGetCurrPcieLinkGeneration")["generation"]["current"]))

    def nvmlDeviceGetMaxPcieLinkGeneration(self, handle: FakeHandle) -> int:
        return int(_value(self._pcie(handle, "nvmlDeviceGetMaxPcieLinkGeneration")["generation"]["max"]))

    def nvmlDeviceGetCurrPcieLinkWidth(self, handle: FakeHandle) -> int:
        return int(_value(self._pcie(handle, "nvmlDeviceGetCurrPcieLinkWidth")["width"]["current"]))

    def nvmlDeviceGetMaxPcieLinkWidth(self, handle: FakeHandle) -> int:
        return int(_value(self._pcie(handle, "nvmlDeviceGetMaxPcieLinkWidth")["width"]["max"]))

    def nvmlDeviceGetPcieReplayCounter(self, handle: FakeHandle) -> int:
        return int(_value(self._pcie(handle, "nvmlDeviceGetPcieReplayCounter")["replay_counter"]))

    def nvmlDeviceGetPcieThroughput(self, handle: FakeHandle, counter: int) -> int:
        return int(
            _value(self._pcie(handle, "nvmlDeviceGetPcieThroughput")["throughput_kib"][_THROUGHPUT[counter]])
        )

    # -- NVLink -------------------------------------------------------------------------------------

    def _nvlink(self, handle: FakeHandle, call: str, link: int) -> dict[str, Any]:
        nvlink: dict[str, Any] = self._gpu(handle, call).get("nvlink", "NOT_SUPPORTED")
        if type(nvlink) is not dict:
            nvlink = _value(nvlink)  # an error name: raises
        if not 0 <= link < len(nvlink["state"]):
            raise nvml_error("INVALID_ARGUMENT")
        return nvlink

    def nvmlDeviceGetNvLinkState(self, handle: FakeHandle, link: int) -> int:
        return int(_value(self._nvlink(handle, "nvmlDeviceGetNvLinkState", link)["state"][link]))

    def nvmlDeviceGetFieldValues(self, handle: FakeHandle, field_ids: list[Any]) -> list[SimpleNamespace]:
        """pynvml's ``nvmlDeviceGetFieldValues``: ``field_ids`` are ids or (id, scope id) pairs; each
        value carries its own ``nvmlReturn``."""
        gpu = self._gpu(handle, "nvmlDeviceGetFieldValues")
        results = []
        for field_id in field_ids:
            field, scope = field_id if isinstance(field_id, tuple) else (field_id, 0)
            code, value = pynvml.NVML_ERROR_NOT_SUPPORTED, 0
            nvlink = gpu.get("nvlink")
            if (
                field == pynvml.NVML_FI_DEV_NVLINK_GET_STATE
                and isinstance(nvlink, dict)
                and gpu.get("nvlink_state_field", True)
                and scope < len(nvlink["state"])
            ):
                state = nvlink["state"][scope]
                if isinstance(state, str):
                    code = getattr(pynvml, f"NVML_ERROR_{state}")
                else:
                    code, value = pynvml.NVML_SUCCESS, int(state)
            results.append(
                SimpleNamespace(
                    fieldId=field, scopeId=scope, nvmlReturn=code, value=SimpleNamespace(uiVal=value)
                )
            )
        return results

    def nvmlDeviceGetNvLinkErrorCounter(self, handle: FakeHandle, link: int, counter: int) -> int:
        errors = self._nvlink(handle, "nvmlDeviceGetNvLinkErrorCounter", link)["errors"]
        counts = errors[_NVLINK_COUNTERS[counter]]
        value = (counts if type(counts) is list else _value(counts))[link]
        return value if type(value) is int else int(_value(value))

    # -- clocks, temperature, power -----------------------------------------------------------------

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: FakeHandle) -> int:
        reasons = _value(self._gpu(handle, "nvmlDeviceGetCurrentClocksEventReasons")["clocks_event_reasons"])
        return _reason_mask(reasons["active"])

    def nvmlDeviceGetSupportedClocksEventReasons(self, handle: FakeHandle) -> int:
        reasons = _value(
            self._gpu(handle, "nvmlDeviceGetSupportedClocksEventReasons")["clocks_event_reasons"]
        )
        return _reason_mask(reasons["supported"])

    def nvmlDeviceGetTemperature(self, handle: FakeHandle, sensor: int) -> int:
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        return int(_value(self._gpu(handle, "nvmlDeviceGetTemperature")["temperature_c"]))

    def nvmlDeviceGetPowerUsage(self, handle: FakeHandle) -> int:
        return int(_value(self._gpu(handle, "nvmlDeviceGetPowerUsage")["power_mw"]))

    # -- events -------------------------------------------------------------------------------------

    def nvmlDeviceGetComputeRunningProcesses(self, handle: FakeHandle) -> list[SimpleNamespace]:
        gpu = self._gpu(handle, "nvmlDeviceGetComputeRunningProcesses")
        return [SimpleNamespace(pid=pid, usedGpuMemory=1 << 30) for pid in _value(gpu.get("processes", []))]

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: FakeHandle) -> list[SimpleNamespace]:
        self._gpu(handle, "nvmlDeviceGetGraphicsRunningProcesses")
        return []

    def nvmlEventSetCreate(self) -> object:
        self._count("nvmlEventSetCreate")
        return object()

    def nvmlDeviceRegisterEvents(self, handle: FakeHandle, event_types: int, event_set: object) -> None:
        self._gpu(handle, "nvmlDeviceRegisterEvents")
        assert event_types & pynvml.nvmlEventTypeXidCriticalError
        self.registered.add(handle.index)

    def nvmlEventSetWait(self, event_set: object, timeout_ms: int) -> FakeEventData:
        self._count("nvmlEventSetWait")
        try:
            return self._events.get(timeout=timeout_ms / 1000)
        except queue.Empty:
            raise nvml_error("TIMEOUT") from None

    def nvmlEventSetFree(self, event_set: object) -> None:
        self._count("nvmlEventSetFree")
