"""The two scrape paths: the few series that act on a node, and everything else.

A node with 8 GPUs and 8 InfiniBand ports publishes several hundred series. Only a handful of them
carry a fault that a shipped critical rule acts on at once (an Xid, a GPU off the bus or lost, a fatal
AER report, an InfiniBand link that went down): those must be seen within seconds; counters, clocks,
temperatures, device counts, port states and link widths can wait a minute. The exporter therefore
serves

- ``/metrics/fast``: the series listed in :data:`FAST` and nothing else (no collector health), read
  with each source's brief read (NVML: lost GPUs and remapped-row state only; InfiniBand: the
  counters of :data:`FAST_INFINIBAND_COUNTERS`, whose rises it serves). Scraped every 2 s as shipped.
- ``/metrics/slow``: every other series, the collectors' health series included. Scraped every 60 s.
- ``/metrics``: both together, for a single scrape job or a look with curl. Never scrape it next to
  the other two: each series would be stored twice.

The partition is by family and, for a few families, by row (the fatal AER reports of a device go fast,
its non-fatal and correctable ones slow), so a series is on exactly one of the two paths and the rules
read it under one ``job``. Adding a series to :data:`FAST` costs one sample per node every 2 s, and
one read per node every second in the rule group that watches it (about 20 microseconds each: at
2,000 nodes, 16 series a node are a third of a second of every second). So every fast family exists
only where something is wrong: an Xid, SXid or Neuron kernel-log count from its first record, a lost
GPU or a failed row remap from the read that saw it, a fatal AER count or a Neuron
uncorrectable-error kind from its first error, an InfiniBand counter's rises from its first rise. A
healthy node serves nothing there (its fast scrape is Prometheus' own five series); keep it so.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Literal

from exporter.exposition import Family
from exporter.metric import Collector, Metric, Sample

ScrapePath = Literal["all", "fast", "slow"]
PATHS: tuple[ScrapePath, ...] = ("all", "fast", "slow")

Labels = Mapping[str, str]
RowFilter = Callable[[Labels], bool] | None
"""Which series of a fast family are fast; None: all of them."""

FAST_NEURON_KINDS = frozenset(
    {"mem_ecc_uncorrected", "sram_ecc_uncorrected", "mem_ecc_repairable_uncorrected"}
)
"""The Neuron sysfs error kinds alerts/neuron.yaml reads."""

FAST_INFINIBAND_COUNTERS = frozenset(
    {"link_downed", "local_link_integrity_errors", "excessive_buffer_overrun_errors"}
)
"""sysfs port counters (``counters/<name>``) whose first increase cordons a node (alerts/infiniband.yaml):
the fast path serves their rises (:mod:`exporter.rises`), the slow path the counters themselves."""

FAST: Mapping[str, RowFilter] = {
    # Kernel log (already in memory: free to serve every scrape).
    "accel_gpu_xid_errors_total": None,
    "accel_gpu_fallen_off_bus_total": None,
    "accel_nvswitch_sxid_errors_total": None,
    "accel_neuron_hw_errors_total": None,
    # Neuron sysfs: the uncorrectable and repairable ECC kinds (from their first error).
    "accel_neuron_sysfs_hardware_errors_total": lambda labels: labels.get("kind") in FAST_NEURON_KINDS,
    # PCI bus: fatal AER reports (a device's series from its first one).
    "accel_pcie_aer_error_reports_total": lambda labels: labels.get("severity") == "fatal",
    # NVML: lost GPUs, failed row remaps (a GPU's series only while it is so).
    "accel_gpu_lost": None,
    "accel_gpu_remapped_rows_failure": None,
    # InfiniBand: the rises of the counters whose first increase cordons (from the first rise).
    "accel_infiniband_port_events_seen_total": None,
    "accel_infiniband_port_events_last_rise_age_seconds": None,
}
"""Series name -> which of its series are on the fast path (every one when None)."""


def is_fast(name: str, labels: Labels) -> bool:
    """Whether the series ``name{labels}`` is served on the fast path."""
    if name not in FAST:
        return False
    row_filter = FAST[name]
    return row_filter is None or row_filter(labels)


def _sample_names(metric: Metric) -> set[str]:
    if isinstance(metric, Family):
        return {metric.spec.sample_name}
    base = metric.name + "_total" if metric.type == "counter" else metric.name
    return {base}


def _keep(metric: Metric, fast: bool) -> Metric | None:
    """``metric`` cut to its fast (``fast``) or slow series; None when none are left."""
    (name,) = _sample_names(metric)
    if name not in FAST:
        return None if fast else metric
    row_filter = FAST[name]
    if row_filter is None:
        return metric if fast else None
    if isinstance(metric, Family):
        labelnames = metric.spec.labelnames
        rows = tuple(
            (values, value)
            for values, value in metric.rows
            if row_filter(dict(zip(labelnames, values, strict=True))) == fast
        )
        return metric.spec.family(rows) if rows else None
    kept = Metric(metric.name, metric.documentation, metric.type, metric.unit)
    samples: list[Sample] = [sample for sample in metric.samples if row_filter(sample.labels) == fast]
    if not samples:
        return None
    kept.samples = samples
    return kept


def cut(families: Iterable[Metric], path: ScrapePath) -> Iterator[Metric]:
    """The families (or the part of them) ``path`` serves."""
    if path == "all":
        yield from families
        return
    fast = path == "fast"
    for metric in families:
        kept = _keep(metric, fast)
        if kept is not None:
            yield kept


class PathCollector(Collector):
    """What one path serves of another collector's families."""

    def __init__(self, collector: Collector, path: ScrapePath) -> None:
        self._collector = collector
        self.path: ScrapePath = path

    def collect(self) -> Iterator[Metric]:
        return cut(self._collector.collect(), self.path)
