"""NVML snapshot -> per-GPU health series (ECC, remapped rows, PCIe, NVLink, throttling, lost GPUs).

Every per-GPU series carries ``gpu`` (NVML index), ``uuid``, ``pci_bus_id`` (``0000:91:00``) and
``model``. A field the GPU does not support, or whose call failed, has no series (never a zero); a GPU
that is lost, timed out or stuck has only ``accel_gpu_nvml_up 0`` (and ``accel_gpu_lost 1`` or
``accel_gpu_nvml_call_stuck_seconds``). Values are raw: which counts matter is for the rules.

NVLink is published per GPU: ``accel_gpu_nvlink_links``, ``accel_gpu_nvlink_links_up`` and
``accel_gpu_nvlink_errors_total{error}``, all links together (the reader's
:class:`~exporter.readers.nvml.NvLinkTotals`: 6 series a GPU where per link there are 90, and the
rules and dashboards need no more). ``per_link`` (``--nvlink-per-link``) adds each link's own series,
under names of their own: ``accel_gpu_nvlink_link_up{link}`` and
``accel_gpu_nvlink_link_errors_total{link, error}``, the counters as NVML reports them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar, NamedTuple

from exporter.collectors.framework import SourceUnavailableError
from exporter.exposition import Family, FamilySpec, Row
from exporter.metric import Metric
from exporter.readers.nvml import (
    NVLINK_ERROR_NAMES,
    NvLink,
    NvmlGpuHealth,
    NvmlIdentity,
    NvmlSnapshot,
    NvmlXidCounts,
)

GPU_LABELS = ("gpu", "uuid", "pci_bus_id", "model")

_THROTTLE_REASONS = (
    "hw_slowdown",
    "hw_thermal_slowdown",
    "hw_power_brake",
    "sw_thermal_slowdown",
    "sw_power_cap",
)
Labels = tuple[str, ...]


def _gauge(name: str, documentation: str, *extra: str) -> FamilySpec:
    return FamilySpec(name, documentation, "gauge", (*GPU_LABELS, *extra))


def _counter(name: str, documentation: str, *extra: str) -> FamilySpec:
    return FamilySpec(name, documentation, "counter", (*GPU_LABELS, *extra))


UP = _gauge("accel_gpu_nvml_up", "Whether NVML answered for the GPU in this scrape (1) or not (0).")
LOST = _gauge(
    "accel_gpu_lost", "1 for a GPU NVML reports as lost (NVML_ERROR_GPU_IS_LOST); no series otherwise."
)
STUCK = _gauge(
    "accel_gpu_nvml_call_stuck_seconds",
    "How long an NVML call for the GPU has been outstanding after it exceeded a scrape's bound.",
    "call",
)
ECC = _gauge(
    "accel_gpu_ecc_errors",
    "ECC error counts; volatile since driver load, aggregate over the GPU's life (both can reset).",
    "error_type",
    "counter_type",
)
REMAPPED = _gauge("accel_gpu_remapped_rows", "Rows remapped, by the kind of error that caused it.", "cause")
REMAP_PENDING = _gauge("accel_gpu_remapped_rows_pending", "1 while a row remap waits for a GPU reset.")
REMAP_FAILURE = _gauge(
    "accel_gpu_remapped_rows_failure",
    "1 for a GPU whose row remap failed; no series while none failed (like accel_gpu_lost).",
)
RETIRED = _gauge("accel_gpu_retired_pages", "Memory pages retired, by cause.", "cause")
RETIRED_PENDING = _gauge(
    "accel_gpu_retired_pages_pending", "1 while retired pages wait for the next driver reload."
)
GENERATION = _gauge("accel_gpu_pcie_link_generation", "PCIe link generation as NVML reports it.", "link")
WIDTH = _gauge("accel_gpu_pcie_link_width", "PCIe link width (lanes) as NVML reports it.", "link")
REPLAYS = _counter("accel_gpu_pcie_replay_errors", "PCIe replays since the driver was loaded.")
THROUGHPUT = _gauge(
    "accel_gpu_pcie_throughput_bytes_per_second",
    "PCIe throughput NVML sampled over about 20 ms.",
    "direction",
)
NVLINK_LINKS = _gauge("accel_gpu_nvlink_links", "NVLink links the GPU has.")
NVLINK_LINKS_UP = _gauge(
    "accel_gpu_nvlink_links_up",
    "NVLink links of the GPU that are active (a link whose state could not be read counts as last read).",
)
NVLINK_ERRORS = _counter(
    "accel_gpu_nvlink_errors",
    "NVLink data-link errors of the GPU, all its links together, by error; never decreases while the "
    "exporter runs (a link's counter that is unreadable or reset keeps or adds to the total).",
    "error",
)
NVLINK_LINK_UP = _gauge(
    "accel_gpu_nvlink_link_up",
    "Whether the NVLink link is active (1) or not (0) (--nvlink-per-link).",
    "link",
)
NVLINK_LINK_ERRORS = _counter(
    "accel_gpu_nvlink_link_errors",
    "NVLink data-link error counters of one link, by error, as NVML reports them (--nvlink-per-link).",
    "link",
    "error",
)
THROTTLE = _gauge(
    "accel_gpu_clock_throttle_active",
    "1 while the clock-throttle (clocks-event) reason holds clocks down; supported reasons only.",
    "reason",
)
TEMPERATURE = _gauge("accel_gpu_temperature_celsius", "GPU core temperature.")
POWER = _gauge("accel_gpu_power_watts", "Board power draw.")
_PER_GPU = (
    UP,
    LOST,
    STUCK,
    ECC,
    REMAPPED,
    REMAP_PENDING,
    REMAP_FAILURE,
    RETIRED,
    RETIRED_PENDING,
    GENERATION,
    WIDTH,
    REPLAYS,
    THROUGHPUT,
    NVLINK_LINKS,
    NVLINK_LINKS_UP,
    NVLINK_ERRORS,
    THROTTLE,
    TEMPERATURE,
    POWER,
)
"""The per-GPU families, in exposition order."""

GPUS = FamilySpec("accel_nvml_gpus", "GPUs NVML enumerates, lost ones included.", "gauge", ())
CALL_TIMEOUTS = FamilySpec(
    "accel_nvml_call_timeouts",
    "NVML calls abandoned because they exceeded the scrape's bound (--nvml-timeout), since start.",
    "counter",
    ("call",),
)
FIELD_ERRORS = FamilySpec(
    "accel_nvml_field_errors",
    "NVML calls that failed with an error other than NOT_SUPPORTED or GPU_IS_LOST, since start.",
    "counter",
    ("call", "error"),
)
XIDS = FamilySpec(
    "accel_gpu_xid_errors",
    "NVIDIA Xid events from NVML's event API since the exporter began watching (kernel log unreadable).",
    "counter",
    ("pci_bus_id", "gpu", "xid"),
)

_ECC_SERIES = (
    ("volatile_corrected", ("corrected", "volatile")),
    ("volatile_uncorrected", ("uncorrected", "volatile")),
    ("aggregate_corrected", ("corrected", "aggregate")),
    ("aggregate_uncorrected", ("uncorrected", "aggregate")),
)
_PCIE_SERIES = (
    (GENERATION, "current_generation", ("current",)),
    (GENERATION, "max_generation", ("max",)),
    (WIDTH, "current_width", ("current",)),
    (WIDTH, "max_width", ("max",)),
    (REPLAYS, "replay_errors", ()),
    (THROUGHPUT, "tx_bytes_per_second", ("tx",)),
    (THROUGHPUT, "rx_bytes_per_second", ("rx",)),
)


def _labels(gpu: NvmlGpuHealth, bus_ids: Mapping[int, str], uuids: Mapping[str, str]) -> Labels:
    pci_bus_id = gpu.pci_bus_id or bus_ids.get(gpu.index, "")
    uuid = gpu.uuid or uuids.get(pci_bus_id, "")
    return (str(gpu.index), uuid, pci_bus_id, gpu.model)


def _put(family: Family, labels: Labels, value: float | None) -> None:
    if value is not None:
        family.add(labels, value)


class _Families:
    """The per-GPU families of one scrape: filled one GPU at a time, then (``per_link``) the per-link
    NVLink families for all GPUs at once."""

    last_nvlink_rows: ClassVar[_NvLinkRows | None] = None
    """The per-link NVLink rows built last, for any scrape in the process (replaced whole, never
    changed)."""

    def __init__(self, *, per_link: bool = False) -> None:
        specs = (*_PER_GPU, NVLINK_LINK_UP, NVLINK_LINK_ERRORS) if per_link else _PER_GPU
        self.by_spec = {spec: spec.family() for spec in specs}

    def all(self) -> list[Metric]:
        return list(self.by_spec.values())

    def add(self, gpu: NvmlGpuHealth, labels: Labels) -> None:
        families = self.by_spec
        families[UP].add(labels, 1 if gpu.status == "ok" else 0)
        if gpu.status == "lost":
            families[LOST].add(labels, 1)
        _put(families[STUCK], (*labels, gpu.stuck_call), gpu.stuck_seconds)
        self._memory(gpu, labels)
        if (pcie := gpu.pcie) is not None:
            for spec, attribute, extra in _PCIE_SERIES:
                _put(families[spec], labels + extra, getattr(pcie, attribute))
        if (reasons := gpu.clock_throttle) is not None:
            throttle = families[THROTTLE]
            for reason in _THROTTLE_REASONS:
                active = getattr(reasons, reason)
                if active is not None:
                    throttle.add((*labels, reason), int(active))
        _put(families[TEMPERATURE], labels, gpu.temperature_celsius)
        _put(families[POWER], labels, gpu.power_watts)
        if (totals := gpu.nvlink_totals) is not None:
            families[NVLINK_LINKS].add(labels, totals.links)
            families[NVLINK_LINKS_UP].add(labels, totals.links_up)
            errors = families[NVLINK_ERRORS]
            for error, value in zip(NVLINK_ERROR_NAMES, totals[2:], strict=True):
                _put(errors, (*labels, error), value)

    def _memory(self, gpu: NvmlGpuHealth, labels: Labels) -> None:
        families = self.by_spec
        if (ecc := gpu.ecc) is not None:
            for attribute, extra in _ECC_SERIES:
                _put(families[ECC], labels + extra, getattr(ecc, attribute))
        if (rows := gpu.remapped_rows) is not None:
            families[REMAPPED].add((*labels, "correctable"), rows.correctable)
            families[REMAPPED].add((*labels, "uncorrectable"), rows.uncorrectable)
            families[REMAP_PENDING].add(labels, int(rows.pending))
            if rows.failure:  # fast path, read every 2 s on every node: a series only where it failed
                families[REMAP_FAILURE].add(labels, 1)
        if (pages := gpu.retired_pages) is not None:
            _put(families[RETIRED], (*labels, "single_bit_ecc"), pages.single_bit_ecc)
            _put(families[RETIRED], (*labels, "double_bit_ecc"), pages.double_bit_ecc)
            if pages.pending is not None:
                families[RETIRED_PENDING].add(labels, int(pages.pending))

    def add_nvlinks(self, gpus: Sequence[tuple[NvmlGpuHealth, Labels]]) -> None:
        """Every GPU's per-link NVLink series, in GPU order. While no link of any GPU changed (the
        usual case: a healthy node's error counters stay put), the previous scrape's rows are handed
        over again, so neither they nor their text are built again."""
        links = tuple((labels, gpu.nvlinks) for gpu, labels in gpus if gpu.nvlinks)
        last = _Families.last_nvlink_rows
        if last is None or last.links != links:  # NvLink fields are ints, bools or None: == is exact
            last = _Families.last_nvlink_rows = _nvlink_rows(links)
        self.by_spec[NVLINK_LINK_UP] = NVLINK_LINK_UP.family(last.up)
        self.by_spec[NVLINK_LINK_ERRORS] = NVLINK_LINK_ERRORS.family(last.errors)


class _NvLinkRows(NamedTuple):
    """The NVLink rows of one scrape, and the links they were built from."""

    links: tuple[tuple[Labels, tuple[NvLink, ...]], ...]
    up: tuple[Row, ...]
    errors: tuple[Row, ...]


def _nvlink_rows(links: tuple[tuple[Labels, tuple[NvLink, ...]], ...]) -> _NvLinkRows:
    up: list[Row] = []
    errors: list[Row] = []
    for labels, nvlinks in links:
        for nvlink in nvlinks:
            key = (labels, nvlink.link)
            if (link_labels := _LINK_LABELS.get(key)) is None:
                link_labels = _link_labels(key)
            if nvlink.up is not None:
                up.append((link_labels[0], int(nvlink.up)))
            counts = (nvlink.crc_flit, nvlink.crc_data, nvlink.replay, nvlink.recovery)
            for error_labels, value in zip(link_labels[1:], counts, strict=True):
                if value is not None:
                    errors.append((error_labels, value))
    return _NvLinkRows(links, tuple(up), tuple(errors))


_LINK_LABELS: dict[tuple[Labels, int], tuple[Labels, ...]] = {}
"""(GPU labels, link) -> the link's label values for ``accel_gpu_nvlink_link_up``, then for each error
of ``accel_gpu_nvlink_link_errors``: a node's hundreds of per-link series keep the same labels scrape
after scrape."""


def _link_labels(key: tuple[Labels, int]) -> tuple[Labels, ...]:
    labels, link = key
    up = (*labels, str(link))
    if len(_LINK_LABELS) >= 4096:  # GPUs replaced over a long uptime: start again rather than grow
        _LINK_LABELS.clear()
    value = _LINK_LABELS[key] = (up, *((*up, error) for error in NVLINK_ERROR_NAMES))
    return value


def nvml_metrics(
    snapshot: NvmlSnapshot,
    *,
    bus_ids: Mapping[int, str] | None = None,
    uuids: Mapping[str, str] | None = None,
    per_link: bool = False,
) -> list[Metric]:
    """Metric families for one snapshot; raises :class:`SourceUnavailableError` when NVML is unavailable.

    ``bus_ids`` (GPU index -> pci_bus_id, from sysfs) and ``uuids`` (pci_bus_id -> uuid, from the
    driver's kernel-log lines) only fill labels NVML could not tell, e.g. for a GPU lost since boot.
    ``per_link`` adds each NVLink's own series (``--nvlink-per-link``).
    """
    if not snapshot.available:
        raise SourceUnavailableError(f"NVML unavailable: {snapshot.reason}")
    gpus = GPUS.family()
    _put(gpus, (), snapshot.gpu_count)
    families = _Families(per_link=per_link)
    labelled = [(gpu, _labels(gpu, bus_ids or {}, uuids or {})) for gpu in snapshot.gpus]
    for gpu, labels in labelled:
        families.add(gpu, labels)
    if per_link:
        families.add_nvlinks(labelled)
    timeouts = CALL_TIMEOUTS.family()
    for call, count in sorted(snapshot.call_timeouts.items()):
        timeouts.add((call,), count)
    field_errors = FIELD_ERRORS.family()
    for (call, error), count in sorted(snapshot.field_errors.items()):
        field_errors.add((call, error), count)
    return [gpus, *families.all(), timeouts, field_errors]


def nvml_xid_metrics(xids: NvmlXidCounts) -> list[Metric]:
    """``accel_gpu_xid_errors_total`` from NVML's event API: the kernel-log family's name and labels.

    Counts start when the exporter began watching (not at boot, unlike the kernel-log counts).
    """
    family = XIDS.family()
    for (pci_bus_id, xid), count in sorted(xids.counts.items()):
        index = xids.gpu_indices.get(pci_bus_id)
        family.add((pci_bus_id, "" if index is None else str(index), str(xid)), count)
    return [family]


IDENTITY = FamilySpec(
    "accel_gpu_identity_info",
    "1 for each GPU with what names it to its vendor (NVML, read at start and on GET /evidence?refresh=1; "
    "a label is empty where NVML does not tell it).",
    "gauge",
    (
        "gpu",
        "pci_bus_id",
        "uuid",
        "serial",
        "board_part_number",
        "vbios_version",
        "inforom_image_version",
        "driver_version",
    ),
)
"""On the slow path (not in :data:`exporter.paths.FAST`): identity does not change between scrapes."""


def nvml_identity_metrics(identity: NvmlIdentity) -> list[Metric]:
    """``accel_gpu_identity_info``; nothing while NVML is unavailable."""
    if not identity.available:
        return []
    family = IDENTITY.family()
    driver = identity.driver_version or ""
    for gpu in identity.gpus:
        family.add(
            (
                str(gpu.index),
                gpu.pci_bus_id,
                gpu.uuid or "",
                gpu.serial or "",
                gpu.board_part_number or "",
                gpu.vbios_version or "",
                gpu.inforom_image_version or "",
                driver,
            ),
            1,
        )
    return [family]
