"""Kernel-log reader: /dev/kmsg records (or a file in the same format) to accelerator fault counts.

Record format (Documentation/ABI/testing/dev-kmsg): ``PRIORITY,SEQ,TS_usec,FLAGS;message`` followed by
optional continuation lines that start with a space (`` SUBSYSTEM=pci``). Plain-text lines without the
prefix are accepted too; the whole line is then the message.

Which lines count. A record counts only when its message IS the driver's line: the driver's words
(``NVRM: Xid (``, ``nvidia-nvswitchN: SXid (``, ``NVRM: GPU ... has fallen off the bus``) from its first
character. In a plain-text line (a file of ``dmesg`` or syslog output) a ``[ 123.456]`` timestamp and a
syslog header ending in ``kernel:`` may come first. Text that merely quotes such a line is not counted:
a health check or a job that logs an earlier Xid, forwarded to the kernel log by journald
(``ForwardToKMsg``), arrives as ``somecheck[1234]: ... NVRM: Xid (...)``, with the sender's tag first.

The record's facility says who wrote it: 0 (kernel) only for the kernel's own messages; a process
writing to /dev/kmsg always gets another (the kernel gives it 1, user, when the text has no ``<N>``
prefix or one naming facility 0). A fault injection written the way NVIDIA's and peers' guides show
it (``echo "NVRM: Xid (PCI:0000:3b:00): 79, ..." > /dev/kmsg``) is therefore a facility-1 record in
the driver's exact shape, and it counts; the exporter's log says which Xids came from a process, so
an injected fault can be told from a real one. NEURON_HW_ERR keeps matching anywhere in a message:
AWS's own test line is ``test NEURON_HW_ERR=DMA_ERROR test``.

One fault, one count: an NVSwitch error is a header record and then ``Severity ... Engine
instance ...`` and ``Data {...}`` records under the same SXid: only the header counts. A GPU that has
fallen off the bus counts once however many lines the driver prints about it, until the driver names
the GPU again (``NVRM: GPU at PCI:...: GPU-<uuid>``).

Layers, from pure to impure:

- :func:`parse_record` and :func:`parse_message` are pure functions of one line.
- :class:`KmsgDecoder` adds the little state the driver's three-line "fallen off the bus" message needs.
- :class:`KmsgTally` counts records, sequence gaps and events (no I/O, not thread-safe).
- :class:`KmsgFollower` owns a background thread that reads the device or follows the file, updating a
  tally under a lock; :meth:`KmsgFollower.snapshot` hands out an immutable copy.
"""

from __future__ import annotations

import errno
import functools
import json
import logging
import os
import re
import select
import stat
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Literal, Protocol, TypeVar

from exporter.privileges import Capability, raised
from exporter.statefile import BootStateFile

logger = logging.getLogger(__name__)

_PCI = r"[0-9a-fA-F]{1,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}(?:\.[0-7])?"
_PLAIN_PREFIX = re.compile(r"(?:<\d{1,3}>)?(?:(?:\S*[^\s:]\s+){1,4}kernel:\s+)?(?:\[\s*\d+\.\d+\]\s*)?")
"""What may precede the driver's words in plain text: ``/proc/kmsg``'s ``<N>``, a syslog header whose tag
is ``kernel:`` (up to four fields before it, none ending in a colon, so ``somecheck[1234]:`` is no such
header) and a dmesg timestamp. Matched at the start of the message only."""
_XID = re.compile(
    r"NVRM: Xid \((?:PCI:)?(?P<pci>" + _PCI + r")"
    r"(?: GPU-I:(?P<gi>\d+))?(?: GPU-CI:(?P<ci>\d+))?\):\s*(?P<xid>\d+)(?:,\s*(?P<rest>.*))?"
)
_SXID = re.compile(
    r"(?:nvidia-nvswitch\d+: )?SXid \((?:PCI:)?(?P<pci>" + _PCI + r")\):\s*(?P<sxid>\d+)(?:,\s*(?P<rest>.*))?"
)
_SXID_CONTINUATION = re.compile(r"Severity \d+ Engine instance|Data \{")
"""The records the NVSwitch driver prints after an error's header, under the same SXid."""
_NEURON = re.compile(r"NEURON_HW_ERR=(?P<error>[A-Za-z0-9_]+)")
_NEURON_DEVICE = re.compile(r"\bnd-id=(?P<nd>\d+)")
_GPU_UUID = re.compile(r"NVRM: GPU at PCI:(?P<pci>" + _PCI + r"):\s*(?P<uuid>GPU-[0-9a-fA-F-]+)")
_FELL_OFF_FIRST = re.compile(r"NVRM: The NVIDIA GPU (?P<pci>" + _PCI + r")")
_FELL_OFF_LAST = "fallen off the bus and is not responding"
_FELL_OFF_LINE = re.compile(
    r"NVRM: GPU (?:at )?(?:PCI:)?(?P<pci>" + _PCI + r"):? (?:GPU )?has fallen off the bus"
)
"""One line without an Xid: ``NVRM: GPU at 0000:01:00.0 has fallen off the bus.`` (older drivers) and
``NVRM: GPU 0000:01:00.0: GPU has fallen off the bus.`` (current ones, after their Xid 79)."""
_CAUSED_BY = re.compile(r"caused by previous Xid (\d+)")
_AER_FATAL = re.compile(r"AER: .*\(Fatal\)|PCIe Bus Error: severity=Uncorrect\w* \(Fatal\)")
"""A fatal AER line of the kernel's PCIe AER driver: ``pcieport 0000:00:03.0: AER: Uncorrected (Fatal)
error received: 0000:91:00.0`` (``Uncorrectable (Fatal) error message received from ...`` in newer
kernels) and ``nvidia 0000:91:00.0: AER: PCIe Bus Error: severity=Uncorrected (Fatal), type=...``."""
_AER_SOURCE = re.compile(r"received(?: from)?:? (?P<pci>" + _PCI + r")")
_PCI_ANYWHERE = re.compile(r"\b(?P<pci>" + _PCI + r")\b")
_DMESG_TIMESTAMP = re.compile(r"\[\s*(?P<s>\d+)\.(?P<frac>\d{1,6})\]")
FATAL_MARK = "(Fatal)"
"""The substring every fatal AER line holds (looked for only where a :class:`FaultSink` listens)."""

FaultKind = Literal["xid", "sxid", "fall_off", "neuron_hw", "aer_fatal", "ib_link_down"]
"""What a fault record reports; each kind raises a counter a shipped critical or warning rule reads."""


class FaultSink(Protocol):
    """Receives every fault record the tally counts (and fatal AER lines), with its raw line: the
    evidence store (:mod:`exporter.evidence`). Called with the follower's lock held: must not block."""

    def fault(
        self,
        kind: FaultKind,
        device: str,
        code: str | None,
        *,
        seq: int | None,
        timestamp_us: int | None,
        line: str,
    ) -> None: ...

    def flush(self) -> None:
        """Makes what was received durable; called just before the tally's own state is written."""
        ...


def parse_aer_fatal(message: str) -> str | None:
    """The normalised PCI address a fatal AER line names (the reported device, else the reporting
    one; "" when it names none), or None when ``message`` is no fatal AER line. Pure, never raises."""
    if FATAL_MARK not in message or _AER_FATAL.search(message) is None:
        return None
    match = _AER_SOURCE.search(message) or _PCI_ANYWHERE.search(message)
    if match is None:
        return ""
    try:
        return normalise_pci_bus_id(match.group("pci"))
    except ValueError:
        return ""


def dmesg_timestamp_us(message: str) -> int | None:
    """Microseconds since boot from a plain-text line's ``[ 123.456789]`` stamp; None without one."""
    match = _DMESG_TIMESTAMP.search(message, 0, 120)
    if match is None:
        return None
    return int(match.group("s")) * 1_000_000 + int(match.group("frac").ljust(6, "0"))


@functools.lru_cache(maxsize=1024)
def normalise_pci_bus_id(text: str) -> str:
    """``00000000:91:00.0``, ``0000:91:00``, ``91:00.0`` -> ``0000:91:00`` (domain:bus:device, lowercase).

    Raises ValueError when the text is not a PCI address.
    """
    address = text.strip().lower().split(".", 1)[0]
    parts = address.split(":")
    if len(parts) == 2:
        parts = ["0", *parts]
    if len(parts) != 3 or not all(parts):
        raise ValueError(f"not a PCI address: {text!r}")
    try:
        domain, bus, device = (int(part, 16) for part in parts)
    except ValueError:
        raise ValueError(f"not a PCI address: {text!r}") from None
    if domain > 0xFFFF or bus > 0xFF or device > 0x1F:
        raise ValueError(f"PCI address out of range: {text!r}")
    return f"{domain:04x}:{bus:02x}:{device:02x}"


@dataclass(frozen=True)
class KmsgRecord:
    """One kernel-log record."""

    message: str
    """The message text, without the record prefix and continuation lines."""
    priority: int | None = None
    """Syslog priority and facility, ``(facility << 3) | level``; None for plain-text lines."""
    seq: int | None = None
    """The kernel's 64-bit record sequence number; None for plain-text lines."""
    timestamp_us: int | None = None
    """Microseconds since boot (monotonic clock); None for plain-text lines."""

    @property
    def facility(self) -> int | None:
        """0 for the kernel's own messages, 1 (user) or more for text a process wrote to /dev/kmsg."""
        return None if self.priority is None else self.priority >> 3


def _split_prefix(line: str) -> tuple[list[str] | None, str]:
    head, sep, message = line.partition(";")
    if sep:
        fields = head.split(",", 4)
        if len(fields) >= 4 and fields[0].isdigit() and fields[1].isdigit() and fields[2].isdigit():
            return fields, message
    return None, line


def parse_record(text: str) -> KmsgRecord:
    """Parses one record as read() returns it from /dev/kmsg (continuation lines are dropped)."""
    line = text.split("\n", 1)[0].rstrip("\r")
    fields, message = _split_prefix(line)
    if fields is None:
        return KmsgRecord(message=line)
    return KmsgRecord(
        message=message, priority=int(fields[0]), seq=int(fields[1]), timestamp_us=int(fields[2])
    )


@dataclass(frozen=True)
class XidEvent:
    """``NVRM: Xid (PCI:0000:91:00[ GPU-I:01[ GPU-CI:02]]): 79, pid=..., name=..., text``."""

    pci_bus_id: str
    """Normalised ``0000:91:00``."""
    xid: int
    gpu_instance: int | None = None
    """MIG GPU instance id (``GPU-I:``), None outside MIG."""
    compute_instance: int | None = None
    """MIG compute instance id (``GPU-CI:``), None when absent."""
    pid: str | None = None
    """As printed, quotes removed (``<unknown>`` stays); None when the driver printed no pid."""
    process_name: str | None = None
    detail: str = ""
    """The free text after the pid/name fields."""
    caused_by_xid: int | None = None
    """For chained records: the Xid named in ``caused by previous Xid N``."""


@dataclass(frozen=True)
class SxidEvent:
    """NVSwitch ``SXid (PCI:0000:05:00.0): 12028, ...``."""

    pci_bus_id: str
    sxid: int
    detail: str = ""


@dataclass(frozen=True)
class NeuronHwErrorEvent:
    """``NEURON_HW_ERR=<KIND> ... nd-id=N ...``."""

    error: str
    neuron_device: str
    """The ``nd-id`` value, empty when the line names none (the AWS test line)."""


@dataclass(frozen=True)
class FallenOffBusEvent:
    """A "has fallen off the bus" message without an Xid number: the driver's three-line message, or
    the single line ``NVRM: GPU at 0000:01:00.0 has fallen off the bus.``"""

    pci_bus_id: str
    """Normalised, empty if the first line of the message was never seen."""


@dataclass(frozen=True)
class GpuUuidEvent:
    """``NVRM: GPU at PCI:0000:91:00: GPU-<uuid>``, printed once per GPU at driver load."""

    pci_bus_id: str
    uuid: str


KmsgEvent = XidEvent | SxidEvent | NeuronHwErrorEvent | FallenOffBusEvent | GpuUuidEvent


def _parse_xid(match: re.Match[str]) -> XidEvent:
    rest = (match.group("rest") or "").strip()
    pid: str | None = None
    name: str | None = None
    if rest.startswith("pid="):
        pid, _, rest = rest[4:].partition(",")
        pid = pid.strip().strip("'\"")
        rest = rest.strip()
    if rest.startswith("name="):
        name, _, rest = rest[5:].partition(",")
        name = name.strip()
        rest = rest.strip()
    caused = _CAUSED_BY.search(rest)
    gi, ci = match.group("gi"), match.group("ci")
    return XidEvent(
        pci_bus_id=normalise_pci_bus_id(match.group("pci")),
        xid=int(match.group("xid")),
        gpu_instance=int(gi) if gi is not None else None,
        compute_instance=int(ci) if ci is not None else None,
        pid=pid,
        process_name=name,
        detail=rest,
        caused_by_xid=int(caused.group(1)) if caused else None,
    )


def _parse_nvrm(text: str) -> XidEvent | GpuUuidEvent | FallenOffBusEvent | None:
    match = _XID.match(text)
    if match:
        return _parse_xid(match)
    uuid = _GPU_UUID.match(text)
    if uuid:
        return GpuUuidEvent(pci_bus_id=normalise_pci_bus_id(uuid.group("pci")), uuid=uuid.group("uuid"))
    fell_off = _FELL_OFF_LINE.match(text)
    if fell_off:
        return FallenOffBusEvent(pci_bus_id=normalise_pci_bus_id(fell_off.group("pci")))
    return None


def _parse_sxid(text: str) -> SxidEvent | None:
    match = _SXID.match(text)
    if match is None:
        return None
    detail = (match.group("rest") or "").strip()
    if _SXID_CONTINUATION.match(detail):
        return None  # part of the error whose header was counted
    return SxidEvent(
        pci_bus_id=normalise_pci_bus_id(match.group("pci")), sxid=int(match.group("sxid")), detail=detail
    )


def _parse_neuron(message: str) -> NeuronHwErrorEvent | None:
    match = _NEURON.search(message)
    if match is None:
        return None
    device = _NEURON_DEVICE.search(message)
    return NeuronHwErrorEvent(error=match.group("error"), neuron_device=device.group("nd") if device else "")


_DRIVER_STARTS = ("NVRM: ", "nvidia-nvswitch", "SXid ")


def driver_text(message: str) -> str:
    """The message without what plain text may put before the driver's words (see the module doc)."""
    if message.startswith(_DRIVER_STARTS):  # the common case, without a regex
        return message
    return message[_PLAIN_PREFIX.match(message).end() :]  # type: ignore[union-attr]  # always matches


@functools.lru_cache(maxsize=4096)
def parse_message(message: str) -> KmsgEvent | None:
    """The event one message line reports, or None. Pure (events are frozen, so results are cached: a
    storm of one repeated line is parsed once); never raises on any text.

    Xid, SXid and fallen-off-the-bus lines count only as the driver's own line, not where a longer
    text quotes them (see the module doc).
    """
    try:
        if "NVRM" in message:
            return _parse_nvrm(driver_text(message))
        if "SXid" in message:
            return _parse_sxid(driver_text(message))
        if "NEURON_HW_ERR" in message:
            return _parse_neuron(message)
    except ValueError as exc:  # a PCI address out of range, e.g. device 0xff
        logger.info("kmsg: ignoring a malformed line (%s): %.200r", exc, message)
    return None


class KmsgDecoder:
    """Turns messages into events, joining the driver's multi-line "fallen off the bus" message."""

    def __init__(self) -> None:
        self._pending_fell_off: str | None = None

    def feed(self, message: str) -> KmsgEvent | None:
        """The event this message completes, or None."""
        event = parse_message(message)
        if event is not None or "NVRM" not in message:
            return event
        text = driver_text(message)
        first = _FELL_OFF_FIRST.match(text)
        if first:
            try:
                pci = normalise_pci_bus_id(first.group("pci"))
            except ValueError as exc:
                logger.info("kmsg: ignoring a malformed line (%s): %.200r", exc, message)
                pci = ""
            if _FELL_OFF_LAST in text:  # one record, its lines joined (/dev/kmsg escapes them as \x0a)
                return FallenOffBusEvent(pci_bus_id=pci)
            self._pending_fell_off = pci
            return None
        if text.startswith("NVRM: ") and _FELL_OFF_LAST in text:
            pci, self._pending_fell_off = self._pending_fell_off or "", None
            return FallenOffBusEvent(pci_bus_id=pci)
        return None


@dataclass(frozen=True)
class KmsgSnapshot:
    """Counts since the reader started at the oldest record (that is: since boot, for /dev/kmsg)."""

    records: int
    """Records read (continuation lines are part of their record)."""
    missed: int
    """Records the kernel overwrote before they were read (gaps in the sequence numbers)."""
    xid: Mapping[XidKey, int]
    """(pci_bus_id, xid, gpu_instance, compute_instance) -> records; MIG ids are "" outside MIG."""
    fallen_off_bus: Mapping[str, int]
    """pci_bus_id -> multi-line "fallen off the bus" messages."""
    sxid: Mapping[tuple[str, int], int]
    """(pci_bus_id, sxid) -> records."""
    neuron_hw_errors: Mapping[tuple[str, str], int]
    """(neuron_device, error kind) -> records."""
    gpu_uuids: Mapping[str, str]
    """pci_bus_id -> ``GPU-<uuid>`` from the driver's load-time lines."""
    error: str | None = None
    """Why the source cannot be read right now; None while it is read normally."""


XidKey = tuple[str, int, str, str]
"""(pci_bus_id, xid, gpu_instance, compute_instance); the MIG instance ids are "" outside MIG."""


_K = TypeVar("_K")


def _note_writer(fields: list[str] | None, what: str) -> None:
    """Logs a first count that came from a record a process wrote (facility not 0): an injection."""
    if fields is None or not fields[0].isdigit():
        return
    facility = int(fields[0]) >> 3
    if facility != 0:
        logger.info(
            "kmsg: %s was written to the kernel log by a process (facility %d), not by the driver; "
            "counted as a fault injection in the driver's format",
            what,
            facility,
        )


def _bump(counts: dict[_K, int], key: _K) -> None:
    counts[key] = counts.get(key, 0) + 1


def _whole(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"expected a non-negative integer, got {value!r}")
    return value


_LINE_BREAKS = re.compile(r"\n[ \n]")
"""Newlines starting a continuation line, or an empty line (which sends a chunk the slow way)."""
_KEYWORDS = ("NVRM", "SXid", "NEURON_HW_ERR")
"""Substrings every line of interest holds; nothing else is parsed."""


def _keyword_line_starts(text: str, keywords: tuple[str, ...] = _KEYWORDS) -> list[int]:
    """Start offsets, in order, of the lines in ``text`` holding one of the keywords."""
    starts: set[int] = set()
    for keyword in keywords:
        found = text.find(keyword)
        while found >= 0:
            line_start = text.rfind("\n", 0, found) + 1
            starts.add(line_start)
            line_end = text.find("\n", found)
            if line_end < 0:
                break
            found = text.find(keyword, line_end)
    return sorted(starts)


class KmsgTally:
    """Counts records, sequence gaps and events. No I/O, not thread-safe."""

    def __init__(self) -> None:
        self.records = 0
        self.missed = 0
        self._last_seq: int | None = None
        self._decoder = KmsgDecoder()
        self._xid: dict[XidKey, int] = {}
        self._sxid: dict[tuple[str, int], int] = {}
        self._neuron: dict[tuple[str, str], int] = {}
        self._fell_off: dict[str, int] = {}
        self._fallen: set[str] = set()
        """GPUs whose fall-off was counted and that the driver has not named again since."""
        self._uuids: dict[str, str] = {}
        self.sink: FaultSink | None = None
        """Where each counted fault record goes with its raw line (the evidence store); None: nowhere."""
        self.replay = False
        """Hand the sink again the fault records counted before (a re-read of the ring buffer after a
        restart that resumed the counts): the evidence of this boot was lost (its file damaged or
        gone) while the counts were kept. The sink takes each record once (by sequence number)."""
        self._replay_decoder = KmsgDecoder()
        self._replay_fallen: set[str] = set()

    def add_lines(self, lines: Iterable[str]) -> None:
        """Adds records one line at a time; lines starting with a space continue the previous record."""
        records, last_seq, missed = 0, self._last_seq, 0
        skipping = False
        for line in lines:
            if not line or line[0] == " ":
                continue
            fields, message = _split_prefix(line)
            if fields is not None:
                seq = int(fields[1])
                if last_seq is not None and seq <= last_seq:
                    # Counted before: a re-read after a restart that resumed from saved state.
                    skipping = True
                    if self.replay and self.sink is not None:
                        self._witness_again(fields, message)
                    continue
                skipping = False
                # The first record's number says how many went before it (from 0 at boot).
                gap = seq if last_seq is None else seq - last_seq - 1
                if gap > 0:
                    missed += gap
                last_seq = seq
            elif skipping:
                continue  # a plain line can't be placed; it follows a record already counted
            records += 1
            if "NVRM" in message or "SXid" in message or "NEURON_HW_ERR" in message:
                self._apply(self._decoder.feed(message), fields, message)
            elif self.sink is not None and FATAL_MARK in message:
                self._aer(fields, message)
        self.records += records
        self.missed += missed
        self._last_seq = last_seq

    def add_text(self, text: str) -> None:
        """Adds complete lines joined by newlines; same counts as ``add_lines(text.split("\\n"))``.

        The fast path for floods: records are counted with ``str.count`` and sequence gaps from the
        first and last record alone (exact while sequence numbers increase); only lines holding one of
        the keywords are looked at one by one. Anything unusual takes the line-by-line path.
        """
        if not text:
            return
        first_end = text.find("\n")
        first = text if first_end < 0 else text[:first_end]
        last = text[text.rfind("\n") + 1 :]
        first_fields, _ = _split_prefix(first)
        last_fields, _ = _split_prefix(last)
        breaks = _LINE_BREAKS.findall(text)
        if first_fields is None or last_fields is None or "\n\n" in breaks:
            self.add_lines(text.split("\n"))
            return
        records = text.count("\n") + 1 - len(breaks)
        first_seq, last_seq = int(first_fields[1]), int(last_fields[1])
        previous = self._last_seq
        if (previous is not None and first_seq <= previous) or last_seq - first_seq + 1 < records:
            self.add_lines(text.split("\n"))
            return
        gap_before = first_seq if previous is None else first_seq - previous - 1
        self.missed += gap_before + (last_seq - first_seq + 1 - records)
        self.records += records
        self._last_seq = last_seq
        keywords = _KEYWORDS if self.sink is None else (*_KEYWORDS, FATAL_MARK)
        for start in _keyword_line_starts(text, keywords):
            end = text.find("\n", start)
            line = text[start:] if end < 0 else text[start:end]
            if line[:1] != " ":
                fields, message = _split_prefix(line)
                if "NVRM" in message or "SXid" in message or "NEURON_HW_ERR" in message:
                    self._apply(self._decoder.feed(message), fields, message)
                elif self.sink is not None:
                    self._aer(fields, message)

    def add_missed(self, count: int) -> None:
        """Records lost without a sequence number to show it."""
        self.missed += count

    def _witness(
        self, kind: FaultKind, device: str, code: str | None, fields: list[str] | None, message: str
    ) -> None:
        """Hands one counted record to the sink, if any, with its sequence number and timestamp."""
        sink = self.sink
        if sink is None:
            return
        seq: int | None = None
        timestamp_us: int | None
        if fields is not None:
            seq, timestamp_us = int(fields[1]), int(fields[2])
        else:
            timestamp_us = dmesg_timestamp_us(message)
        sink.fault(kind, device, code, seq=seq, timestamp_us=timestamp_us, line=message)

    def _witness_again(self, fields: list[str], message: str) -> None:
        """Hands the sink a record counted before, counting nothing (see :attr:`replay`)."""
        if FATAL_MARK in message:
            self._aer(fields, message)
            return
        if "NVRM" not in message and "SXid" not in message and "NEURON_HW_ERR" not in message:
            return
        match self._replay_decoder.feed(message):
            case XidEvent(pci_bus_id=pci, xid=xid):
                self._witness("xid", pci, str(xid), fields, message)
            case SxidEvent(pci_bus_id=pci, sxid=sxid):
                self._witness("sxid", pci, str(sxid), fields, message)
            case NeuronHwErrorEvent(neuron_device=device, error=error):
                self._witness("neuron_hw", device, error, fields, message)
            case FallenOffBusEvent(pci_bus_id=pci):
                if pci not in self._replay_fallen:
                    self._replay_fallen.add(pci)
                    self._witness("fall_off", pci, None, fields, message)
            case GpuUuidEvent(pci_bus_id=pci):
                self._replay_fallen.discard(pci)
            case None:
                pass

    def _aer(self, fields: list[str] | None, message: str) -> None:
        """A fatal AER line goes to the sink (the sysfs AER counters count it, not the kernel log)."""
        device = parse_aer_fatal(message)
        if device is not None:
            self._witness("aer_fatal", device, None, fields, message)

    def _apply(self, event: KmsgEvent | None, fields: list[str] | None, message: str = "") -> None:
        """Counts one record's event; ``fields`` is the record's prefix (None for plain text)."""
        match event:
            case XidEvent(pci_bus_id=pci, xid=xid, gpu_instance=gi, compute_instance=ci):
                key = (pci, xid, "" if gi is None else str(gi), "" if ci is None else str(ci))
                if key not in self._xid:
                    _note_writer(fields, f"Xid {xid} for {pci}")
                _bump(self._xid, key)
                self._witness("xid", pci, str(xid), fields, message)
            case SxidEvent(pci_bus_id=pci, sxid=sxid):
                if (pci, sxid) not in self._sxid:
                    _note_writer(fields, f"SXid {sxid} for {pci}")
                _bump(self._sxid, (pci, sxid))
                self._witness("sxid", pci, str(sxid), fields, message)
            case NeuronHwErrorEvent(neuron_device=device, error=error):
                _bump(self._neuron, (device, error))
                self._witness("neuron_hw", device, error, fields, message)
            case FallenOffBusEvent(pci_bus_id=pci):
                if pci not in self._fallen:  # later lines about the same fall-off add nothing
                    self._fallen.add(pci)
                    _bump(self._fell_off, pci)
                    self._witness("fall_off", pci, None, fields, message)
            case GpuUuidEvent(pci_bus_id=pci, uuid=uuid):
                self._uuids[pci] = uuid
                self._fallen.discard(pci)  # the driver names it again: a new fall-off counts anew
            case None:
                pass

    def to_state(self) -> dict[str, object]:
        """Everything needed to resume counting in the same boot, as JSON-ready data."""
        return {
            "records": self.records,
            "missed": self.missed,
            "last_seq": self._last_seq,
            "xid": [[*key, count] for key, count in sorted(self._xid.items())],
            "sxid": [[*key, count] for key, count in sorted(self._sxid.items())],
            "neuron_hw_errors": [[*key, count] for key, count in sorted(self._neuron.items())],
            "fallen_off_bus": dict(sorted(self._fell_off.items())),
            "fallen_now": sorted(self._fallen),
            "gpu_uuids": dict(sorted(self._uuids.items())),
        }

    @classmethod
    def from_state(cls, state: Mapping[str, object]) -> KmsgTally:
        """The tally :meth:`to_state` described; raises ValueError (or TypeError) on malformed data."""

        def rows(name: str, width: int) -> list[list[object]]:
            value = state.get(name, [])
            if not isinstance(value, list) or not all(isinstance(r, list) and len(r) == width for r in value):
                raise ValueError(f"{name}: expected rows of {width} fields")
            return value

        def table(name: str) -> dict[str, object]:
            value = state.get(name, {})
            if not isinstance(value, dict):
                raise ValueError(f"{name}: expected an object")
            return value

        tally = cls()
        tally.records = _whole(state.get("records", 0))
        tally.missed = _whole(state.get("missed", 0))
        last_seq = state.get("last_seq")
        tally._last_seq = None if last_seq is None else _whole(last_seq)
        tally._xid = {
            (str(pci), _whole(xid), str(gi), str(ci)): _whole(n) for pci, xid, gi, ci, n in rows("xid", 5)
        }
        tally._sxid = {(str(pci), _whole(sxid)): _whole(n) for pci, sxid, n in rows("sxid", 3)}
        tally._neuron = {(str(dev), str(err)): _whole(n) for dev, err, n in rows("neuron_hw_errors", 3)}
        tally._fell_off = {str(pci): _whole(n) for pci, n in table("fallen_off_bus").items()}
        tally._uuids = {str(pci): str(uuid) for pci, uuid in table("gpu_uuids").items()}
        fallen = state.get("fallen_now", [])
        if not isinstance(fallen, list):
            raise ValueError("fallen_now: expected a list")
        tally._fallen = {str(pci) for pci in fallen}
        return tally

    def snapshot(self, *, error: str | None = None) -> KmsgSnapshot:
        """An immutable copy of the counts."""
        return KmsgSnapshot(
            records=self.records,
            missed=self.missed,
            xid=MappingProxyType(dict(self._xid)),
            fallen_off_bus=MappingProxyType(dict(self._fell_off)),
            sxid=MappingProxyType(dict(self._sxid)),
            neuron_hw_errors=MappingProxyType(dict(self._neuron)),
            gpu_uuids=MappingProxyType(dict(self._uuids)),
            error=error,
        )


BOOT_ID_PATH = Path("/proc/sys/kernel/random/boot_id")
STATE_FILE_NAME = "kmsg-state.json"


def read_boot_id(path: Path = BOOT_ID_PATH) -> str | None:
    """The current boot's id (``/proc/sys/kernel/random/boot_id``); None (logged) when unreadable."""
    try:
        text = path.read_text().strip()
    except OSError as exc:
        logger.warning("kmsg: cannot read the boot id from %s: %s", path, exc.strerror or exc)
        return None
    return text or None


class KmsgStateStore:
    """Keeps a tally in ``<directory>/kmsg-state.json``, tagged with the boot it belongs to.

    On a node the directory is a hostPath, so a restarted exporter resumes the counts of the same boot,
    including events the ring buffer has overwritten since; a state file from another boot is ignored
    (counts start from zero again). Writes are atomic (a temporary file renamed over the old one).
    """

    def __init__(self, directory: Path, *, boot_id_path: Path = BOOT_ID_PATH) -> None:
        self.path = directory / STATE_FILE_NAME
        self.boot_id_path = boot_id_path
        self._file = BootStateFile(self.path, logger=logger, prefix="kmsg", other_boot="counting from zero")
        self._boot: tuple[str | None] | None = None
        """The boot id read by :meth:`load` (a boot cannot change under a running process)."""

    def boot_id(self) -> str | None:
        return read_boot_id(self.boot_id_path)

    def _current_boot(self) -> str | None:
        if self._boot is None:
            self._boot = (self.boot_id(),)
        return self._boot[0]

    def load(self) -> KmsgTally | None:
        """The tally saved during this boot; None when there is none, it is from another boot, or bad.

        Reads the boot id afresh; :meth:`save` then uses it.
        """
        self._boot = None
        boot_id = self._current_boot()
        if boot_id is None:
            return None
        state = self._file.read(boot_id)
        if state is None:
            return None
        try:
            tally = KmsgTally.from_state(state)
        except (ValueError, TypeError) as exc:
            self._file.malformed(exc)
            return None
        logger.info(
            "kmsg: resuming this boot's counts from %s (%d records, last sequence %s)",
            self.path,
            tally.records,
            state.get("last_seq"),
        )
        return tally

    def save(self, state: Mapping[str, object], *, generation: int | None = None) -> bool:
        """Writes ``state`` (:meth:`KmsgTally.to_state`) for this boot unless a newer ``generation``
        was written already; False (logged once) on failure."""
        boot_id = self._current_boot()
        if boot_id is None:
            return False
        return self._file.write(json.dumps({"boot_id": boot_id, **state}), generation=generation)


_DEVICE_READ_SIZE = 16384
"""Larger than any record (the kernel caps a record at about 8 KiB with its dictionary)."""
_FILE_READ_SIZE = 65536


class KmsgFollower:
    """Reads /dev/kmsg (one record per read) or follows a regular file (like ``tail -f``) in a thread.

    Starts at the oldest record. While the path cannot be opened, :meth:`snapshot` carries the reason
    in ``error`` and the thread retries every ``retry_interval`` seconds.
    """

    def __init__(
        self,
        path: Path,
        *,
        state_store: KmsgStateStore | None = None,
        sink: FaultSink | None = None,
        replay: bool = False,
        save_interval: float = 1.0,
        poll_interval: float = 0.05,
        retry_interval: float = 5.0,
    ) -> None:
        self.path = path
        self.state_store = state_store
        """Where the counts are kept across restarts in the same boot; None keeps them in memory only."""
        self.sink = sink
        """Receives every counted fault record with its line (the evidence store); flushed before each
        state write, so saved evidence never lags the saved counts."""
        self.replay = replay
        """True when the sink lost what it held of this boot (no evidence to resume): the records the
        resumed counts took before are handed to it again as the ring buffer is re-read (those the
        ring buffer still holds)."""
        self.save_interval = save_interval
        """Seconds between state writes while records arrive (and once more on stop)."""
        self.poll_interval = poll_interval
        """Seconds between looks at a followed file once its end is reached."""
        self.retry_interval = retry_interval
        """Seconds between attempts to open a path that cannot be opened."""
        self._lock = threading.Lock()
        self._tally = KmsgTally()
        self._tally.sink = sink
        self._saved_progress: tuple[int, int] | None = None
        self._saved_at = 0.0
        self._error: str | None = "not read yet"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self.state_store is not None:
            restored = self.state_store.load()
            if restored is not None:
                restored.sink = self.sink
                restored.replay = self.replay
                with self._lock:
                    self._tally = restored
                    self._saved_progress = (restored.records, restored.missed)
        self._thread = threading.Thread(target=self._run, name="kmsg-follower", daemon=True)
        self._thread.start()

    def stop(self, *, timeout: float = 1.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self._save(force=True)

    def _save(self, *, force: bool = False) -> None:
        """Writes the state when records arrived since the last write and the interval has passed."""
        if self.state_store is None:
            return
        now = time.monotonic()
        with self._lock:
            progress = (self._tally.records, self._tally.missed)
            if progress == self._saved_progress:
                return
            if not force and now - self._saved_at < self.save_interval:
                return
            state = self._tally.to_state()
        if self.sink is not None:
            self.sink.flush()  # first: saved evidence may run ahead of the saved counts, never behind
        # The follower's thread and stop() may save at once: the progress (records and gaps, which
        # only grow) orders their states.
        if self.state_store.save(state, generation=progress[0] + progress[1]):
            self._saved_progress, self._saved_at = progress, now

    def snapshot(self) -> KmsgSnapshot:
        with self._lock:
            return self._tally.snapshot(error=self._error)

    def _set_error(self, error: str | None) -> None:
        with self._lock:
            self._error = error

    def _run(self) -> None:
        last_logged: str | None = None
        while not self._stop.is_set():
            try:
                self._read_once()
            except OSError as exc:
                reason = f"cannot read {self.path}: {exc.strerror or exc}"
                self._set_error(reason)
                if reason != last_logged:
                    logger.warning("kmsg: %s; retrying every %.0f s", reason, self.retry_interval)
                    last_logged = reason
                self._stop.wait(self.retry_interval)

    def _read_once(self) -> None:
        """Reads until stopped; raises OSError when the path cannot be opened or read."""
        is_device = stat.S_ISCHR(os.stat(self.path).st_mode)
        flags = os.O_RDONLY | (os.O_NONBLOCK if is_device else 0)
        with raised(Capability.SYSLOG):  # what the kernel asks of an open where dmesg_restrict=1
            fd = os.open(self.path, flags)
        try:
            self._set_error(None)
            logger.info("kmsg: reading %s (%s)", self.path, "device" if is_device else "file, following")
            if is_device:
                self._read_device(fd)
            else:
                self._follow_file(fd)
        finally:
            os.close(fd)

    def _same_file(self, fd: int) -> bool:
        """Whether the path still names the open file; raises OSError when the path is gone."""
        path, opened = os.stat(self.path), os.fstat(fd)
        return (path.st_dev, path.st_ino) == (opened.st_dev, opened.st_ino)

    def _read_device(self, fd: int) -> None:
        while not self._stop.is_set():
            try:
                data = os.read(fd, _DEVICE_READ_SIZE)
            except BlockingIOError:
                select.select([fd], [], [], 0.25)
                continue
            except OSError as exc:
                if exc.errno != errno.EPIPE:
                    raise
                # Records were overwritten before we read them; the sequence gap counts them.
                logger.debug("kmsg: ring buffer overran the reader (EPIPE)")
                continue
            if not data:
                self._save()
                self._stop.wait(self.poll_interval)
                continue
            line = data.split(b"\n", 1)[0].decode("utf-8", errors="replace")
            with self._lock:
                self._tally.add_lines((line,))
            self._save()

    def _follow_file(self, fd: int) -> None:
        """Follows the file like ``tail -F``: a truncated file is read again from its start, a replaced
        one is reopened; sequence numbers keep records read twice from being counted twice."""
        pending = b""
        while not self._stop.is_set():
            data = os.read(fd, _FILE_READ_SIZE)
            if not data:
                self._save()
                self._stop.wait(self.poll_interval)
                if not self._same_file(fd):
                    logger.info("kmsg: %s was replaced; reopening it", self.path)
                    return
                if os.fstat(fd).st_size < os.lseek(fd, 0, os.SEEK_CUR):
                    logger.info("kmsg: %s was truncated; reading it from the start", self.path)
                    os.lseek(fd, 0, os.SEEK_SET)
                    pending = b""
                continue
            pending += data
            end = pending.rfind(b"\n")
            if end < 0:
                continue  # a partial last line: wait for its newline
            complete, pending = pending[:end], pending[end + 1 :]
            text = complete.decode("utf-8", errors="replace")
            with self._lock:
                self._tally.add_text(text)
            self._save()
