"""Sysfs readers: accelerator PCI devices, InfiniBand ports, Neuron hardware counters.

Every function takes the sysfs root as a parameter, so tests point it at a fixture tree. A missing
directory means the hardware is absent: an empty result, not an error. A file that cannot be read or
parsed is skipped with a log line; the rest of the device is still reported.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Literal

from exporter import problems
from exporter.readers.kmsg import normalise_pci_bus_id

logger = logging.getLogger(__name__)

NVIDIA_VENDOR_ID = 0x10DE
AMAZON_VENDOR_ID = 0x1D0F
NVIDIA_GPU_CLASSES = frozenset({0x0300, 0x0302})
"""PCI base class and subclass (``class >> 8``): VGA-compatible and 3D controllers."""
NEURON_DEVICE_IDS = frozenset({0x7064, 0x7065, 0x7066, 0x7067, 0x7164, 0x7264, 0x7364})
"""Amazon's Inferentia and Trainium devices (the vendor id also covers ENA, EFA and EBS NVMe)."""

AcceleratorKind = Literal["nvidia", "neuron"]


_READ_SIZE = 8192
"""Larger than any attribute read here; sysfs hands a whole attribute to one read()."""


def _read_text(path: str) -> str | None:
    """The file's stripped text; None when it is missing (silently) or unreadable (with a log line).

    Plain os.open/os.read: a scrape reads hundreds of tiny files, and this is several times cheaper
    than Path.read_text's buffered text layer.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        problems.note(logger, "sysfs: cannot read %s: %s", path, exc.strerror or exc)
        return None
    try:
        chunks = [os.read(fd, _READ_SIZE)]
        while len(chunks[-1]) == _READ_SIZE:
            chunks.append(os.read(fd, _READ_SIZE))
    except OSError as exc:
        problems.note(logger, "sysfs: cannot read %s: %s", path, exc.strerror or exc)
        return None
    finally:
        os.close(fd)
    return b"".join(chunks).decode(errors="replace").strip()


def _names(directory: str) -> list[str] | None:
    """The sorted entry names of ``directory``; None when it is missing or not a directory."""
    try:
        return sorted(os.listdir(directory))
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        problems.note(logger, "sysfs: cannot list %s: %s", directory, exc.strerror or exc)
        return None


def _read_hex(path: str) -> int | None:
    text = _read_text(path)
    if text is None:
        return None
    try:
        return int(text, 16)
    except ValueError:
        problems.note(logger, "sysfs: %s is not a hex number: %r", path, text[:80])
        return None


def _read_int(path: str) -> int | None:
    text = _read_text(path)
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        problems.note(logger, "sysfs: %s is not an integer: %r", path, text[:80])
        return None


def _leading_number(path: str) -> int | None:
    """``4: ACTIVE`` -> 4."""
    text = _read_text(path)
    if text is None:
        return None
    head = text.split(":", 1)[0].strip()
    if not head.isdigit():
        problems.note(logger, "sysfs: %s does not start with a number: %r", path, text[:80])
        return None
    return int(head)


# -- PCI ----------------------------------------------------------------------------------------------

_LINK_SPEED = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*GT/s")


def link_encoding_efficiency(speed_gts: float) -> float:
    """Payload bits per line bit: 8b/10b up to 5 GT/s, 128b/130b for 8-32 GT/s, 242/256 FLIT from 64."""
    if speed_gts <= 5.0:
        return 8 / 10
    if speed_gts < 64.0:
        return 128 / 130
    return 242 / 256


@dataclass(frozen=True)
class PcieLink:
    """A link's negotiated (current) or supported (max) speed and width."""

    speed_gts: float | None
    """Giga-transfers per second per lane; None when unknown (e.g. ``Unknown`` on a down link)."""
    width: int | None
    """Lanes; None when unknown."""

    @property
    def bandwidth_bytes_per_second(self) -> float | None:
        """Payload bandwidth of the link in one direction, after line encoding."""
        if self.speed_gts is None or self.width is None:
            return None
        return self.speed_gts * 1e9 * self.width * link_encoding_efficiency(self.speed_gts) / 8


@dataclass(frozen=True)
class AerCounters:
    """One ``aer_dev_{correctable,nonfatal,fatal}`` file."""

    severity: str
    """``correctable``, ``nonfatal`` or ``fatal``."""
    errors: Mapping[str, int]
    """Error name (``RxErr``, ``BadTLP`` ...) -> count."""
    total: int | None
    """The ``TOTAL_ERR_*`` line: error reports, which can carry several error bits each."""


@dataclass(frozen=True)
class PciDevice:
    """An accelerator on the PCI bus."""

    address: str
    """Full address as sysfs names it, ``0000:91:00.0``."""
    pci_bus_id: str
    """Normalised ``0000:91:00``."""
    kind: AcceleratorKind
    vendor_id: int
    device_id: int
    class_code: int
    current_link: PcieLink
    max_link: PcieLink
    aer: tuple[AerCounters, ...] = field(default=())


def _read_link_speed(path: str) -> float | None:
    text = _read_text(path)
    if text is None:
        return None
    match = _LINK_SPEED.match(text)
    if match:
        return float(match.group(1))
    if not text.lower().startswith("unknown"):
        problems.note(logger, "sysfs: %s is not a link speed: %r", path, text[:80])
    return None


def _read_aer(path: str, severity: str) -> AerCounters | None:
    text = _read_text(path)
    if text is None:
        return None
    errors: dict[str, int] = {}
    total: int | None = None
    for line in text.splitlines():
        name, _, value = line.strip().partition(" ")
        try:
            number = int(value.strip())
        except ValueError:
            problems.note(logger, "sysfs: %s has a line that is not 'NAME value': %r", path, line[:80])
            continue
        if name.startswith("TOTAL_ERR_"):
            total = number
        else:
            errors[name] = number
    return AerCounters(severity=severity, errors=MappingProxyType(errors), total=total)


def _accelerator_kind(vendor: int, device: int, class_code: int) -> AcceleratorKind | None:
    if vendor == NVIDIA_VENDOR_ID and class_code >> 8 in NVIDIA_GPU_CLASSES:
        return "nvidia"
    if vendor == AMAZON_VENDOR_ID and device in NEURON_DEVICE_IDS:
        return "neuron"
    return None


PciIdentity = tuple[int, int, int]
"""(vendor, device, class) of one PCI address; (vendor, 0, 0) for vendors that make no accelerator."""


def _pci_identity(entry: str) -> PciIdentity | None:
    vendor = _read_hex(f"{entry}/vendor")
    if vendor is None:
        return None
    if vendor not in (NVIDIA_VENDOR_ID, AMAZON_VENDOR_ID):
        return (vendor, 0, 0)
    device = _read_hex(f"{entry}/device")
    class_code = _read_hex(f"{entry}/class")
    if device is None or class_code is None:
        return None
    return (vendor, device, class_code)


def read_pci_accelerators(
    sysfs_root: Path, *, identities: dict[str, PciIdentity] | None = None
) -> tuple[PciDevice, ...]:
    """NVIDIA GPUs and Neuron devices under ``<root>/bus/pci/devices``, sorted by address.

    ``identities``, when given, caches each address's vendor, device and class between calls (they
    cannot change while the address exists): a node has a hundred PCI devices or more, and only the
    accelerators' changing attributes are then read on every scrape. Addresses that disappear from the
    bus are dropped from it; unreadable identities are not cached.
    """
    devices_dir = f"{sysfs_root}/bus/pci/devices"
    names = _names(devices_dir)
    if names is None:
        return ()
    cache: dict[str, PciIdentity] = {} if identities is None else identities
    for gone in cache.keys() - set(names):
        del cache[gone]
    found: list[PciDevice] = []
    for name in sorted(names, key=str.lower):
        entry = f"{devices_dir}/{name}"
        identity = cache.get(name)
        if identity is None:
            identity = _pci_identity(entry)
            if identity is None:
                continue
            cache[name] = identity
        vendor, device, class_code = identity
        kind = _accelerator_kind(vendor, device, class_code)
        if kind is None:
            continue
        try:
            pci_bus_id = normalise_pci_bus_id(name)
        except ValueError:
            problems.note(logger, "sysfs: %s is not named like a PCI address", entry)
            continue
        aer = tuple(
            counters
            for severity in ("correctable", "nonfatal", "fatal")
            if (counters := _read_aer(f"{entry}/aer_dev_{severity}", severity)) is not None
        )
        found.append(
            PciDevice(
                address=name.lower(),
                pci_bus_id=pci_bus_id,
                kind=kind,
                vendor_id=vendor,
                device_id=device,
                class_code=class_code,
                current_link=PcieLink(
                    speed_gts=_read_link_speed(f"{entry}/current_link_speed"),
                    width=_read_int(f"{entry}/current_link_width"),
                ),
                max_link=PcieLink(
                    speed_gts=_read_link_speed(f"{entry}/max_link_speed"),
                    width=_read_int(f"{entry}/max_link_width"),
                ),
                aer=aer,
            )
        )
    return tuple(found)


def read_pci_subsystem(sysfs_root: Path, address: str) -> tuple[int | None, int | None]:
    """(subsystem vendor, subsystem device) of ``<root>/bus/pci/devices/<address>``; None where
    unreadable. Read on request (the evidence document), not per scrape."""
    entry = f"{sysfs_root}/bus/pci/devices/{address}"
    return _read_hex(f"{entry}/subsystem_vendor"), _read_hex(f"{entry}/subsystem_device")


def nvidia_gpu_indices(devices: Sequence[PciDevice]) -> dict[str, int]:
    """pci_bus_id -> GPU index: position among NVIDIA GPUs sorted by PCI address (NVML's default order)."""
    gpus = sorted((d for d in devices if d.kind == "nvidia"), key=lambda d: d.address)
    return {gpu.pci_bus_id: index for index, gpu in enumerate(gpus)}


# -- InfiniBand ---------------------------------------------------------------------------------------

_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*Gb/sec")
_WORD_COUNTERS = frozenset({"port_rcv_data", "port_xmit_data"})
"""Counters the hardware keeps in 4-byte words; reported in bytes."""


@dataclass(frozen=True)
class InfinibandPort:
    """One port of an InfiniBand (or RoCE) device."""

    device: str
    """``mlx5_0``."""
    port: str
    """Port number as named in sysfs, ``1``."""
    state: int | None
    """1 down, 2 init, 3 armed, 4 active, 5 active-defer."""
    physical_state: int | None
    """E.g. 5 LinkUp, 3 Disabled, 2 Polling."""
    rate_bytes_per_second: float | None
    link_layer: str | None
    """``InfiniBand`` or ``Ethernet``."""
    counters: Mapping[str, int]
    """Counter file name -> value; data counters already converted from 4-byte words to bytes.
    Counters reading ``N/A (no PMA)`` are left out."""
    hw_counters: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    """The driver's own counters (``hw_counters/``, e.g. mlx5's ``out_of_buffer``), by file name."""


@dataclass(frozen=True)
class InfinibandDevice:
    """An InfiniBand (or RoCE) adapter's identity, for the info series."""

    device: str
    """``mlx5_0``."""
    fw_ver: str
    """Firmware version, ``28.39.1002``; empty when unreadable."""
    board_id: str
    """Board (PSID), ``MT_0000000838``; empty when unreadable."""
    hca_type: str
    """Adapter type, ``MT4129``; empty when unreadable."""


def _read_rate(path: str) -> float | None:
    text = _read_text(path)
    if text is None:
        return None
    match = _RATE.match(text)
    if not match:
        problems.note(logger, "sysfs: %s is not a rate in Gb/sec: %r", path, text[:80])
        return None
    return float(match.group(1)) * 1e9 / 8


def _read_port_counters(directory: str, *, words: frozenset[str] = _WORD_COUNTERS) -> Mapping[str, int]:
    counters: dict[str, int] = {}
    for name in _names(directory) or ():
        path = f"{directory}/{name}"
        text = _read_text(path)
        if text is None:
            continue
        if text.startswith("N/A"):
            logger.debug("sysfs: %s is not available: %r", path, text)
            continue
        try:
            value = int(text)
        except ValueError:
            problems.note(logger, "sysfs: %s is not a counter: %r", path, text[:80])
            continue
        counters[name] = value * 4 if name in words else value
    return MappingProxyType(counters)


def _read_named_counters(directory: str, names: frozenset[str]) -> Mapping[str, int]:
    """The counters ``names`` of ``directory`` that exist and read as numbers (see
    :func:`_read_port_counters`, which reads every file)."""
    counters: dict[str, int] = {}
    for name in sorted(names):
        path = f"{directory}/{name}"
        text = _read_text(path)
        if text is None or text.startswith("N/A"):
            continue
        try:
            value = int(text)
        except ValueError:
            problems.note(logger, "sysfs: %s is not a counter: %r", path, text[:80])
            continue
        counters[name] = value * 4 if name in _WORD_COUNTERS else value
    return MappingProxyType(counters)


def read_infiniband_ports(
    sysfs_root: Path, *, counters: frozenset[str] | None = None
) -> tuple[InfinibandPort, ...]:
    """Ports under ``<root>/class/infiniband/<device>/ports/<n>``, sorted by device and port.

    ``counters``, when given, makes the read brief: each port's logical state and those counters only
    (files under ``counters/``), nothing else.
    """
    class_dir = f"{sysfs_root}/class/infiniband"
    ports: list[InfinibandPort] = []
    for device_name in _names(class_dir) or ():
        device = f"{class_dir}/{device_name}"
        ports_dir = f"{device}/ports"
        for port_name in sorted(_names(ports_dir) or (), key=lambda name: (len(name), name)):
            port = f"{ports_dir}/{port_name}"
            if counters is not None:
                ports.append(
                    InfinibandPort(
                        device=device_name,
                        port=port_name,
                        state=_leading_number(f"{port}/state"),
                        physical_state=None,
                        rate_bytes_per_second=None,
                        link_layer=None,
                        counters=_read_named_counters(f"{port}/counters", counters),
                    )
                )
                continue
            ports.append(
                InfinibandPort(
                    device=device_name,
                    port=port_name,
                    state=_leading_number(f"{port}/state"),
                    physical_state=_leading_number(f"{port}/phys_state"),
                    rate_bytes_per_second=_read_rate(f"{port}/rate"),
                    link_layer=_read_text(f"{port}/link_layer"),
                    counters=_read_port_counters(f"{port}/counters"),
                    hw_counters=_read_port_counters(f"{port}/hw_counters", words=frozenset()),
                )
            )
    return tuple(ports)


def read_infiniband_devices(sysfs_root: Path) -> tuple[InfinibandDevice, ...]:
    """Adapters under ``<root>/class/infiniband``, sorted by name."""
    class_dir = f"{sysfs_root}/class/infiniband"
    devices: list[InfinibandDevice] = []
    for name in _names(class_dir) or ():
        device = f"{class_dir}/{name}"
        devices.append(
            InfinibandDevice(
                device=name,
                fw_ver=_read_text(f"{device}/fw_ver") or "",
                board_id=_read_text(f"{device}/board_id") or "",
                hca_type=_read_text(f"{device}/hca_type") or "",
            )
        )
    return tuple(devices)


@dataclass(frozen=True)
class HcaIdentity:
    """An InfiniBand (or RoCE) adapter's identity for the evidence document; None where unreadable."""

    device: str
    """``mlx5_0``."""
    board_id: str | None
    """Board (PSID), ``MT_0000000838``."""
    fw_ver: str | None
    """Firmware version, ``28.39.1002``."""
    node_guid: str | None
    """``b8ce:f603:00a1:b2c4``."""


def read_hca_identities(sysfs_root: Path) -> tuple[HcaIdentity, ...]:
    """Adapters under ``<root>/class/infiniband``, sorted by name (read on request, not per scrape)."""
    class_dir = f"{sysfs_root}/class/infiniband"
    return tuple(
        HcaIdentity(
            device=name,
            board_id=_read_text(f"{class_dir}/{name}/board_id") or None,
            fw_ver=_read_text(f"{class_dir}/{name}/fw_ver") or None,
            node_guid=_read_text(f"{class_dir}/{name}/node_guid") or None,
        )
        for name in _names(class_dir) or ()
    )


# -- Neuron -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NeuronDevice:
    """Hardware error counters of one Neuron device (``neuronN``)."""

    neuron_device: str
    """The device index N, as the kernel log's ``nd-id`` names it."""
    hardware_errors: Mapping[str, int]
    """Counter (``mem_ecc_uncorrected``, ``sram_ecc_uncorrected`` ...) -> its ``total``."""


def read_neuron_devices(sysfs_root: Path) -> tuple[NeuronDevice, ...]:
    """Devices under ``<root>/devices/virtual/neuron_device/neuronN``, sorted by index."""
    base = f"{sysfs_root}/devices/virtual/neuron_device"
    devices: list[NeuronDevice] = []
    for name in _names(base) or ():
        index = name.removeprefix("neuron")
        if not index.isdigit():
            continue
        hardware = f"{base}/{name}/stats/hardware"
        errors: dict[str, int] = {}
        for counter_name in _names(hardware) or ():
            value = _read_int(f"{hardware}/{counter_name}/total")
            if value is not None:
                errors[counter_name] = value
        devices.append(NeuronDevice(neuron_device=index, hardware_errors=MappingProxyType(errors)))
    return tuple(sorted(devices, key=lambda d: int(d.neuron_device)))
