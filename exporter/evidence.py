"""The evidence of this boot: the fault records' own lines, the devices' identity, the checks' verdicts.

When a node is rebooted or replaced, what proved its fault goes with it (the kernel ring buffer is
cleared, a replaced instance's disks are gone). The exporter therefore keeps, for every record that
raised a counter a shipped critical or warning rule reads, the record's line with its kernel timestamp,
and serves it with the devices' identity (serial numbers, UUIDs, firmware) and the latest active-check
results as one JSON document on ``GET /evidence`` (see :func:`evidence_document`); the remediator
fetches it before anything disruptive.

Bounded, whatever the kernel log holds. Records are grouped by (kind, device, code); a group keeps its
first and its last :attr:`EvidenceLimits.per_group` records and counts the rest as ``dropped``. A
device keeps at most :attr:`EvidenceLimits.codes_per_device` codes of one kind in groups of their own;
further codes share one group whose ``code`` is null (each line still names its code). Past
:attr:`EvidenceLimits.groups` groups, records of new groups are only counted (``records_overflow``).
Lines are cut to :attr:`EvidenceLimits.line_chars`. So the document of a node with 8 GPUs stays under
256 KiB however long a storm (``bench/bench_evidence.py`` measures it).

Kept across restarts within one boot, like the kernel-log counts: ``<state-dir>/evidence.json``,
tagged with the boot id (a file from another boot is ignored), written atomically (a temporary file
renamed over the old one) at most once a second while records arrive, and always just before the
kernel-log counts are written (:meth:`EvidenceStore.flush`), so saved evidence never lags the saved
counts; records it already holds (by sequence number) are not taken twice when the ring buffer is read
again after a restart.

Where each kind comes from: ``xid``, ``sxid``, ``fall_off``, ``neuron_hw`` are the kernel-log records
the ``kmsg`` source counts; ``aer_fatal`` are the kernel's fatal AER lines (the series count the
sysfs ``aer_dev_fatal`` reports); ``ib_link_down`` is an increase of a port's sysfs
``counters/link_downed`` as the ``infiniband`` source read it (no kernel line reports it reliably),
recorded with ``source`` ``sysfs``, the port as ``code`` and no sequence number.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from http import HTTPStatus
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

from exporter.auth import BearerToken
from exporter.readers.kmsg import BOOT_ID_PATH, FaultKind, read_boot_id
from exporter.readers.nvml import GpuIdentity, NvmlIdentity, NvmlReader
from exporter.readers.sysfs import (
    InfinibandPort,
    nvidia_gpu_indices,
    read_hca_identities,
    read_neuron_devices,
    read_pci_accelerators,
    read_pci_subsystem,
)
from exporter.statefile import BootStateFile

logger = logging.getLogger(__name__)

SCHEMA = "accel-health.io/evidence/v1"
EXPORTER_VERSION = "0.1.0"
"""The package's version (pyproject.toml); not read from its metadata, which would load ``email``."""
STATE_FILE_NAME = "evidence.json"
FAULT_KINDS: tuple[FaultKind, ...] = ("xid", "sxid", "fall_off", "neuron_hw", "aer_fatal", "ib_link_down")
_STATE_VERSION = 1
_LINK_DOWNED = "link_downed"

Record = tuple[int | None, int | None, str, str]
"""(seq, monotonic_us, line, source): one kept record; a tuple, since a storm makes millions."""
GroupKey = tuple[str, str, str | None]
"""(kind, device, code)."""


@dataclass(frozen=True)
class EvidenceLimits:
    """How much evidence is kept; the defaults keep an 8-GPU node's document under 256 KiB."""

    per_group: int = 5
    """Records kept at each end of a group: its first N and its last N."""
    codes_per_device: int = 4
    """Codes of one kind one device keeps in groups of their own; more share a group with code null."""
    groups: int = 48
    """Groups in all; records of a group past this are only counted (``records_overflow``)."""
    line_chars: int = 320
    """Characters of a line kept (an Xid line is about 150, a kernel record at most ~1000)."""


def rfc3339(seconds: float) -> str:
    """Unix time -> ``2025-01-25T10:34:54.859532Z``."""
    return datetime.fromtimestamp(seconds, UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


class _Group:
    """One (kind, device, code)'s records: the first N, the last N, and how many were seen."""

    __slots__ = ("first", "last", "seen")

    def __init__(self, per_group: int) -> None:
        self.first: list[Record] = []
        self.last: deque[Record] = deque(maxlen=per_group)
        self.seen = 0


class FaultRecords:
    """The bounded record groups (no I/O, not thread-safe): see the module doc for the bounds."""

    def __init__(self, limits: EvidenceLimits) -> None:
        self.limits = limits
        self.groups: dict[GroupKey, _Group] = {}
        self.codes: dict[tuple[str, str], set[str]] = {}
        """(kind, device) -> the codes with a group of their own."""
        self.overflow = 0
        """Records of groups past :attr:`EvidenceLimits.groups`, counted and not kept."""

    def add(self, kind: str, device: str, code: str | None, record: Record) -> None:
        group = self.groups.get((kind, device, code))
        if group is None:
            group = self._new_group(kind, device, code)
            if group is None:
                self.overflow += 1
                return
        group.seen += 1
        if len(group.first) < self.limits.per_group:
            group.first.append(record)
        else:
            group.last.append(record)

    def _new_group(self, kind: str, device: str, code: str | None) -> _Group | None:
        if code is not None:
            codes = self.codes.setdefault((kind, device), set())
            if len(codes) >= self.limits.codes_per_device:
                code = None  # the device's shared group for further codes
                if (group := self.groups.get((kind, device, None))) is not None:
                    return group
            else:
                if len(self.groups) >= self.limits.groups:
                    return None
                codes.add(code)
        if len(self.groups) >= self.limits.groups:
            return None
        group = self.groups[kind, device, code] = _Group(self.limits.per_group)
        return group

    def to_state(self) -> dict[str, object]:
        return {
            "groups": [
                [
                    kind,
                    device,
                    code,
                    group.seen,
                    [list(r) for r in group.first],
                    [list(r) for r in group.last],
                ]
                for (kind, device, code), group in sorted(self.groups.items(), key=_group_order)
            ],
            "overflow": self.overflow,
        }

    @classmethod
    def from_state(cls, state: Mapping[str, object], limits: EvidenceLimits) -> FaultRecords:
        """The records :meth:`to_state` described; raises ValueError, TypeError or KeyError when bad."""
        records = cls(limits)
        rows = state.get("groups", [])
        if not isinstance(rows, list):
            raise ValueError("groups: expected a list")
        for kind, device, code, seen, first, last in rows:
            if kind not in FAULT_KINDS or not isinstance(device, str):
                raise ValueError(f"not a record group: {kind!r} {device!r}")
            group = _Group(limits.per_group)
            group.seen = int(seen)
            group.first = [_record(r) for r in first][: limits.per_group]
            group.last.extend(_record(r) for r in last)
            key = (str(kind), device, None if code is None else str(code))
            records.groups[key] = group
            if code is not None:
                records.codes.setdefault((str(kind), device), set()).add(str(code))
        overflow = state.get("overflow", 0)
        records.overflow = overflow if isinstance(overflow, int) and overflow >= 0 else 0
        return records

    def to_json(self, boot_time: float) -> list[dict[str, object]]:
        """The ``records`` of the evidence document; ``boot_time`` is the boot's Unix time."""

        def rec(record: Record) -> dict[str, object]:
            seq, monotonic_us, line, source = record
            when = None if monotonic_us is None else rfc3339(boot_time + monotonic_us / 1e6)
            return {"seq": seq, "monotonic_us": monotonic_us, "time": when, "line": line, "source": source}

        return [
            {
                "kind": kind,
                "device": device,
                "code": code,
                "seen": group.seen,
                "dropped": group.seen - len(group.first) - len(group.last),
                "first": [rec(r) for r in group.first],
                "last": [rec(r) for r in group.last],
            }
            for (kind, device, code), group in sorted(self.groups.items(), key=_group_order)
        ]


def _group_order(item: tuple[GroupKey, _Group]) -> tuple[int, str, bool, str]:
    (kind, device, code), _group = item
    return (FAULT_KINDS.index(kind), device, code is None, code or "")


def _record(row: object) -> Record:
    if not isinstance(row, list) or len(row) != 4:
        raise ValueError(f"not a record: {row!r}")
    seq, monotonic_us, line, source = row
    if seq is not None and not isinstance(seq, int):
        raise ValueError(f"seq: {seq!r}")
    if monotonic_us is not None and not isinstance(monotonic_us, int):
        raise ValueError(f"monotonic_us: {monotonic_us!r}")
    return (seq, monotonic_us, str(line), str(source))


_IDENTITY_FIELDS = (
    "uuid",
    "serial",
    "board_part_number",
    "vbios_version",
    "inforom_image_version",
    "name",
    "pci_device_id",
    "pci_subsystem_id",
)


class EvidenceStore:
    """This boot's fault records and the GPUs' last known identity; thread-safe.

    A :class:`~exporter.readers.kmsg.FaultSink` for the kernel-log follower; the ``infiniband`` source
    hands it each port reading (:meth:`observe_infiniband`). ``directory`` None keeps everything in
    memory only.
    """

    def __init__(
        self,
        *,
        directory: Path | None,
        boot_id_path: Path = BOOT_ID_PATH,
        limits: EvidenceLimits = EvidenceLimits(),
        save_interval: float = 1.0,
        wall_clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = None if directory is None else directory / STATE_FILE_NAME
        self._file = (
            None
            if self.path is None
            else BootStateFile(
                self.path, logger=logger, prefix="evidence", other_boot="keeping this boot's from now"
            )
        )
        self.limits = limits
        self.save_interval = save_interval
        """Seconds between writes while records arrive (a flush writes at once)."""
        self._monotonic = monotonic
        self.boot_id = read_boot_id(boot_id_path)
        """This boot's id; None when unreadable (then nothing is saved or loaded)."""
        self.boot_time = wall_clock() - monotonic()
        """Unix time of the boot: a record's wall-clock time is this plus its kernel timestamp."""
        self._lock = threading.Lock()
        self._records = FaultRecords(limits)
        self._last_seq: int | None = None
        self._link_downed: dict[str, int] = {}
        """``device/port`` -> link_downed as last read."""
        self._gpus: dict[str, dict[str, Any]] = {}
        """pci_bus_id -> the GPU's identity fields as last known (a lost GPU's serial stays known)."""
        self._dirty = False
        self._saved_at = -float("inf")
        self._generation = 0
        """Counts the states built for saving (under the lock): a save older than the one written
        last is dropped (exporter/statefile.py)."""

    # -- receiving ------------------------------------------------------------------------------------

    def fault(
        self,
        kind: FaultKind,
        device: str,
        code: str | None,
        *,
        seq: int | None,
        timestamp_us: int | None,
        line: str,
    ) -> None:
        """One fault record (see :class:`~exporter.readers.kmsg.FaultSink`)."""
        with self._lock:
            if seq is not None:
                if self._last_seq is not None and seq <= self._last_seq:
                    return  # kept before a restart, read again from the ring buffer
                self._last_seq = seq
            self._records.add(kind, device, code, (seq, timestamp_us, line[: self.limits.line_chars], "kmsg"))
            self._dirty = True

    def flush(self) -> None:
        self.save(force=True)

    def observe_infiniband(self, ports: Iterable[InfinibandPort]) -> None:
        """Records each port whose ``link_downed`` counter went up since its last reading (or that reads
        above 0 at the first reading of this boot: the counter counts since the driver loaded)."""
        now_us = int(self._monotonic() * 1e6)
        changed = False
        with self._lock:
            for port in ports:
                value = port.counters.get(_LINK_DOWNED)
                if value is None:
                    continue
                key = f"{port.device}/{port.port}"
                before = self._link_downed.get(key)
                self._link_downed[key] = value
                if before == value:
                    continue
                changed = True
                if (before is None and value == 0) or (before is not None and value < before):
                    continue  # nothing went down, or the counters were reset
                went = f"{before} -> {value}" if before is not None else f"{value} at the first reading"
                line = f"{port.device} port {port.port}: counters/{_LINK_DOWNED} {went}, state {port.state}"
                record = (None, now_us, line[: self.limits.line_chars], "sysfs")
                self._records.add("ib_link_down", port.device, port.port, record)
            self._dirty = self._dirty or changed
        if changed:
            self.save()

    def remember_gpus(self, gpus: Sequence[GpuIdentity]) -> list[dict[str, Any]]:
        """Merges a fresh identity read into what is known (a field NVML no longer answers keeps its
        last value) and returns every GPU known, by index."""
        with self._lock:
            for gpu in gpus:
                if not gpu.pci_bus_id:
                    continue
                known = self._gpus.setdefault(gpu.pci_bus_id, {"pci_bus_id": gpu.pci_bus_id})
                before = dict(known)
                known["index"] = gpu.index
                for name in _IDENTITY_FIELDS:
                    value = getattr(gpu, name)
                    if value is not None or name not in known:
                        known[name] = value
                self._dirty = self._dirty or known != before
            merged = [dict(gpu) for gpu in self._gpus.values()]
        return sorted(merged, key=lambda gpu: (gpu.get("index", 1 << 30), gpu["pci_bus_id"]))

    # -- reading --------------------------------------------------------------------------------------

    def records(self) -> tuple[list[dict[str, object]], int]:
        """The document's ``records`` and ``records_overflow``."""
        with self._lock:
            return self._records.to_json(self.boot_time), self._records.overflow

    # -- persistence ----------------------------------------------------------------------------------

    def load(self) -> bool:
        """Resumes this boot's evidence from the state directory; False when there is none to resume."""
        if self._file is None or self.boot_id is None:
            return False
        state = self._file.read(self.boot_id)
        if state is None:
            return False
        try:
            records = FaultRecords.from_state(state, self.limits)
            last_seq = state.get("last_seq")
            link_downed = {str(k): int(v) for k, v in dict(state.get("link_downed", {})).items()}
            gpus = {str(gpu["pci_bus_id"]): dict(gpu) for gpu in list(state.get("gpus", []))}
            boot_time = state.get("boot_time")
            if boot_time is not None and not isinstance(boot_time, (int, float)):
                raise ValueError(f"boot_time {boot_time!r} is not a number")
        except (ValueError, TypeError, KeyError) as exc:
            self._file.malformed(exc)
            return False
        with self._lock:
            self._records = records
            self._last_seq = last_seq if isinstance(last_seq, int) else None
            self._link_downed = link_downed
            self._gpus = gpus
            if boot_time is not None:
                # The boot's time as the first exporter of this boot computed it: a record's time is
                # the same in every /evidence of the boot, not off by the microsecond that two
                # processes' reading of the two clocks differs by.
                self.boot_time = float(boot_time)
        logger.info("evidence: resuming this boot's %d record groups from %s", len(records.groups), self.path)
        return True

    def save(self, *, force: bool = False) -> bool:
        """Writes the evidence when it changed, at most once per :attr:`save_interval` unless ``force``;
        True when the file holds everything received."""
        if self._file is None or self.boot_id is None:
            return False
        now = self._monotonic()
        with self._lock:
            if not self._dirty:
                return True
            if not force and now - self._saved_at < self.save_interval:
                return False
            self._generation += 1
            generation = self._generation
            text = json.dumps(
                {
                    "boot_id": self.boot_id,
                    "version": _STATE_VERSION,
                    "last_seq": self._last_seq,
                    "boot_time": self.boot_time,
                    **self._records.to_state(),
                    "link_downed": dict(self._link_downed),
                    "gpus": list(self._gpus.values()),
                },
                separators=(",", ":"),
            )
            self._dirty = False
            self._saved_at = now
        if not self._file.write(text, generation=generation):
            with self._lock:
                self._dirty = True
            return False
        return True


# -- the document ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class EvidenceSources:
    """What the evidence document is made of, besides the store."""

    sysfs_root: Path
    """Root of the sysfs tree (PCI ids, InfiniBand adapters, Neuron devices)."""
    nvml: NvmlReader | None
    """GPU identity; None where NVML is off."""
    node: str = ""
    """This node's name; empty: the host name."""
    checks: Callable[[], Sequence[Mapping[str, object]]] | None = None
    """The latest result of each active check (see :func:`check_summary`); None without checks."""


def check_summary(
    *,
    check: str,
    verdict: str,
    message: str,
    started: float,
    duration: float,
    devices: Sequence[Mapping[str, object]] = (),
) -> dict[str, object]:
    """One entry of the document's ``checks``: a check's latest result, with its failing devices."""
    return {
        "check": check,
        "verdict": verdict,
        "message": message or None,
        "started_at": rfc3339(started),
        "finished_at": rfc3339(started + duration),
        "devices": [
            {key: device.get(key) for key in ("device", "pci_bus_id", "verdict", "detail")}
            for device in devices
            if device.get("verdict") not in ("pass", "skipped")
        ],
    }


def _kernel_release() -> str | None:
    try:
        return os.uname().release
    except OSError:
        return None


def _gpu_entries(
    identity: NvmlIdentity | None, store: EvidenceStore, pci: Mapping[str, Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """The document's ``gpus``: NVML's identity merged with what was known, PCI ids from sysfs where
    NVML does not tell them, and GPUs on the PCI bus that NVML does not list."""
    known = store.remember_gpus(identity.gpus if identity is not None else ())
    listed = {gpu["pci_bus_id"] for gpu in known}
    unlisted = [
        {"pci_bus_id": bus_id, "index": entry["index"]}
        for bus_id, entry in sorted(pci.items())
        if bus_id not in listed and entry["kind"] == "nvidia"
    ]
    entries: list[dict[str, Any]] = []
    for gpu in [*known, *unlisted]:
        sysfs = pci.get(gpu["pci_bus_id"], {})
        entry: dict[str, Any] = {"index": gpu.get("index", sysfs.get("index"))}
        entry.update({name: gpu.get(name) for name in _IDENTITY_FIELDS})
        entry["pci_bus_id"] = gpu["pci_bus_id"]
        entry["pci_device_id"] = entry["pci_device_id"] or sysfs.get("pci_device_id")
        entry["pci_subsystem_id"] = entry["pci_subsystem_id"] or sysfs.get("pci_subsystem_id")
        entries.append(entry)
    return entries


def _nvml_id(device: int | None, vendor: int | None) -> str | None:
    """PCI ids in NVML's form: ``0x233010DE`` (device << 16 | vendor)."""
    return None if device is None or vendor is None else f"0x{device << 16 | vendor:08X}"


def _pci_ids(sysfs_root: Path) -> dict[str, dict[str, Any]]:
    """pci_bus_id -> the accelerator's kind, sysfs address, GPU index (PCI order, as NVML numbers
    them) and PCI ids in NVML's form, from sysfs."""
    devices = read_pci_accelerators(sysfs_root)
    indices = nvidia_gpu_indices(devices)
    found: dict[str, dict[str, Any]] = {}
    for device in devices:
        subsystem_vendor, subsystem_device = read_pci_subsystem(sysfs_root, device.address)
        found[device.pci_bus_id] = {
            "kind": device.kind,
            "address": device.address,
            "index": indices.get(device.pci_bus_id),
            "pci_device_id": _nvml_id(device.device_id, device.vendor_id),
            "pci_subsystem_id": _nvml_id(subsystem_device, subsystem_vendor),
        }
    return found


def evidence_document(
    store: EvidenceStore, sources: EvidenceSources, *, refresh: bool = False, now: float | None = None
) -> dict[str, object]:
    """The evidence document ``GET /evidence`` serves (schema ``accel-health.io/evidence/v1``).

    ``refresh`` reads the GPUs' identity from NVML again (bounded by the reader's timeout); otherwise
    the identity read at start serves.
    """
    identity = sources.nvml.identity(refresh=refresh) if sources.nvml is not None else None
    pci = _pci_ids(sources.sysfs_root)
    gpus = _gpu_entries(identity, store, pci)
    records, overflow = store.records()
    neuron_pci = [
        {
            "pci_bus_id": bus_id,
            "address": entry["address"],
            "pci_device_id": entry["pci_device_id"],
            "pci_subsystem_id": entry["pci_subsystem_id"],
        }
        for bus_id, entry in sorted(pci.items())
        if entry["kind"] == "neuron"
    ]
    neuron = [
        {"neuron_device": device.neuron_device, "hardware_errors": dict(device.hardware_errors)}
        for device in read_neuron_devices(sources.sysfs_root)
    ]
    return {
        "schema": SCHEMA,
        "node": sources.node or socket.gethostname(),
        "boot_id": store.boot_id or "",
        "collected_at": rfc3339(time.time() if now is None else now),
        "exporter_version": EXPORTER_VERSION,
        "boot_time": rfc3339(store.boot_time),
        "host": {
            "driver_version": identity.driver_version if identity is not None else None,
            "cuda_driver_version": identity.cuda_driver_version if identity is not None else None,
            "kernel": _kernel_release(),
            "nvml": None if identity is None else ("available" if identity.available else identity.reason),
        },
        "gpus": gpus,
        "neuron_devices": neuron,
        "neuron_pci_devices": neuron_pci,
        "hcas": [
            {"device": hca.device, "board_id": hca.board_id, "fw_ver": hca.fw_ver, "node_guid": hca.node_guid}
            for hca in read_hca_identities(sources.sysfs_root)
        ],
        "records": records,
        "records_overflow": overflow,
        "limits": {
            "per_group": store.limits.per_group,
            "codes_per_device": store.limits.codes_per_device,
            "groups": store.limits.groups,
            "line_chars": store.limits.line_chars,
        },
        "checks": list(sources.checks()) if sources.checks is not None else [],
    }


def encode_document(document: Mapping[str, object]) -> bytes:
    """The document as compact UTF-8 JSON with a final newline."""
    return (json.dumps(document, separators=(",", ":"), ensure_ascii=False) + "\n").encode()


@dataclass(frozen=True)
class EvidenceEndpoint:
    """``GET /evidence[?refresh=1]``: the document, behind the checks' bearer token.

    Answers 200 with the document; 401 without the right token; 503 while the token file is missing or
    empty; 404 where no token is configured and ``--checks-insecure-no-auth`` was not given (``auth``
    None): the evidence names serial numbers and the kernel's own lines, so it is never served open by
    accident.
    """

    store: EvidenceStore
    sources: EvidenceSources
    auth: BearerToken | None
    """The token requests must carry; ``BearerToken()`` requires none; None: not served (404)."""

    def handle(self, query: str, authorization: str | None) -> tuple[HTTPStatus, bytes]:
        if self.auth is None:
            return HTTPStatus.NOT_FOUND, encode_document(
                {"error": "GET /evidence needs --checks-token-file FILE (or --checks-insecure-no-auth)"}
            )
        refused = self.auth.refusal(authorization, what="GET /evidence is off")
        if refused is not None:
            return refused[0], encode_document({"error": refused[1]})
        try:
            fields = parse_qsl(query, keep_blank_values=True, max_num_fields=10)
        except ValueError as exc:
            return HTTPStatus.BAD_REQUEST, encode_document({"error": f"malformed query: {exc}"})
        refresh = any(key == "refresh" and value not in ("", "0", "false") for key, value in fields)
        document = evidence_document(self.store, self.sources, refresh=refresh)
        # What was served is on disk before it is answered: an exporter killed a moment later keeps
        # at least what the remediator stored as the node's evidence.
        self.store.flush()
        return HTTPStatus.OK, encode_document(document)
