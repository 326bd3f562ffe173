"""Metric families, collectors and a registry in prometheus_client's shape, without prometheus_client.

Collectors build fresh families on every scrape as prometheus_client's custom collectors do
(``GaugeMetricFamily``, ``CounterMetricFamily``, ``add_metric``), and tests read a registry as they
would read prometheus_client's (``get_sample_value``). The exporter does not import prometheus_client
itself: its package imports, with its data model, its HTTP and WSGI servers and push-gateway client,
and with them ``ssl``, ``http.client``, ``email`` and ``urllib.request``: about 12 MB of resident
memory, more than everything else the exporter holds (issue 24: the exporter is to stay within 1.25
times node_exporter's 20 MB). The data model is all it needs, and it is this module:

- the same class, attribute and method names, so code moves between the two by changing an import;
- :class:`Sample` is a named tuple with prometheus_client's fields in its order, so families read the
  same to prometheus_client's encoder and parser (``tests/exporter/test_exposition.py`` holds the
  exporter's encoder to ``generate_latest`` byte for byte, on families of both kinds).

Only what the exporter publishes: gauges and counters whose names need no escaping in the text format.
prometheus_client stays a dependency (the remediator's metrics, the tests' parser and reference
encoder) and is imported only for a family this encoder cannot write (see :mod:`exporter.exposition`).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import NamedTuple, Protocol

_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
TYPES = ("gauge", "counter")


class Sample(NamedTuple):
    """One series of a family: prometheus_client's ``Sample`` fields, in the same order."""

    name: str
    labels: dict[str, str]
    value: float
    timestamp: float | None = None
    exemplar: None = None
    native_histogram: None = None


class Metric:
    """A family of series of one name and type; its ``samples`` are its series."""

    def __init__(self, name: str, documentation: str, typ: str, unit: str = "") -> None:
        if unit and not name.endswith("_" + unit):
            name += "_" + unit
        if not _NAME.match(name):
            raise ValueError(f"invalid metric name {name!r}")
        if typ not in TYPES:
            raise ValueError(f"{name}: only gauges and counters, not {typ!r}")
        self.name = name
        self.documentation = documentation
        self.unit = unit
        self.type = typ
        self.samples: list[Sample] = []

    def add_sample(self, name: str, labels: dict[str, str], value: float) -> None:
        """One series under its full name (a counter's ends in ``_total``)."""
        self.samples.append(Sample(name, labels, value))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Metric) and (
            self.name,
            self.documentation,
            self.type,
            self.unit,
            self.samples,
        ) == (other.name, other.documentation, other.type, other.unit, other.samples)

    __hash__ = None  # type: ignore[assignment]  # mutable, compared by value: unhashable, as upstream

    def __repr__(self) -> str:
        return f"Metric({self.name}, {self.documentation}, {self.type}, {self.unit}, {self.samples})"


class GaugeMetricFamily(Metric):
    """A gauge family; ``value`` makes its one series without labels."""

    def __init__(
        self,
        name: str,
        documentation: str,
        value: float | None = None,
        labels: Sequence[str] | None = None,
        unit: str = "",
    ) -> None:
        super().__init__(name, documentation, "gauge", unit)
        if labels is not None and value is not None:
            raise ValueError("Can only specify at most one of value and labels.")
        self._labelnames = tuple(labels or ())
        if value is not None:
            self.add_metric([], value)

    def add_metric(self, labels: Sequence[str], value: float) -> None:
        """One series: label values in the order of the family's label names."""
        self.samples.append(Sample(self.name, dict(zip(self._labelnames, labels, strict=False)), value))


class CounterMetricFamily(Metric):
    """A counter family (its name without ``_total``; its series' names end in it)."""

    def __init__(
        self,
        name: str,
        documentation: str,
        value: float | None = None,
        labels: Sequence[str] | None = None,
        unit: str = "",
    ) -> None:
        super().__init__(name.removesuffix("_total"), documentation, "counter", unit)
        if labels is not None and value is not None:
            raise ValueError("Can only specify at most one of value and labels.")
        self._labelnames = tuple(labels or ())
        if value is not None:
            self.add_metric([], value)

    def add_metric(self, labels: Sequence[str], value: float) -> None:
        """One series: label values in the order of the family's label names."""
        labelled = dict(zip(self._labelnames, labels, strict=False))
        self.samples.append(Sample(self.name + "_total", labelled, value))


class Collector(Protocol):
    """Anything with ``collect()``: prometheus_client's collector protocol."""

    def collect(self) -> Iterable[Metric]:
        """Fresh families for one scrape."""
        ...


class CollectorRegistry:
    """The collectors one endpoint serves, collected in the order registered."""

    def __init__(self) -> None:
        self._collectors: list[Collector] = []
        self._lock = threading.Lock()

    def register(self, collector: Collector) -> None:
        with self._lock:
            if any(known is collector for known in self._collectors):
                raise ValueError(f"collector already registered: {collector!r}")
            self._collectors.append(collector)

    def unregister(self, collector: Collector) -> None:
        with self._lock:
            self._collectors = [known for known in self._collectors if known is not collector]

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            collectors = tuple(self._collectors)
        for collector in collectors:
            yield from collector.collect()

    def get_sample_value(self, name: str, labels: Mapping[str, str] | None = None) -> float | None:
        """The value of the series ``name`` with exactly ``labels``; None when there is none (tests)."""
        wanted = dict(labels or {})
        for metric in self.collect():
            for sample in metric.samples:
                if sample.name == name and sample.labels == wanted:
                    return sample.value
        return None
