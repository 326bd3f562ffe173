"""The Prometheus text format (version 0.0.4) of the exporter's registry, cheaply.

prometheus_client's ``generate_latest`` validates and escapes every label name of every sample; on a
GPU node with a thousand label-heavy series that is most of a scrape's cost. The exporter only ever
publishes gauges and counters with legacy-valid names and no timestamps, so this encoder writes those
directly and produces the same bytes as ``generate_latest`` (tests hold it to that). Anything outside
that shape (another metric type, a timestamp, an exemplar, a name needing escaping: none of the
exporter's own families, but any prometheus_client family handed in) goes to ``generate_latest``
unchanged, and only then is prometheus_client imported (see :mod:`exporter.metric`).

Collectors with many series of a fixed shape (NVML: a thousand per 8-GPU node) build :class:`Family`
objects from a :class:`FamilySpec` made once at import. A family holds label-value rows rather than
samples, and its spec remembers each label set's rendered ``name{...}``, so a series
already written in an earlier scrape costs one dictionary lookup. A collector may hand a family the very
rows (an immutable tuple) it handed over in the previous scrape, when nothing in them changed: the spec
then gives back that scrape's text without writing it again. Its ``samples`` are still there for any
other reader (built on demand), and its text is the same bytes ``generate_latest`` writes.

The exporter serves this format whatever the scraper's Accept header asks for, as node_exporter does by
default; every Prometheus version parses it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal, Protocol

from exporter.metric import Metric, Sample

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LEGACY_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_SIMPLE_TYPES = {"gauge": "gauge", "counter": "counter"}


def go_float(value: float) -> str:
    """A sample value as Prometheus's Go code writes it (prometheus_client's ``floatToGoString``)."""
    if type(value) is int and -(10**15) < value < 1_000_000:  # exact as a float, written without exponent
        return f"{value}.0"
    number = float(value)
    if number == math.inf:
        return "+Inf"
    if number == -math.inf:
        return "-Inf"
    if math.isnan(number):
        return "NaN"
    text = repr(number)
    dot = text.find(".")
    if number > 0 and dot > 6:  # Go switches to an exponent sooner than Python
        mantissa = f"{text[0]}.{text[1:dot]}{text[dot + 1 :]}".rstrip("0.")
        return f"{mantissa}e+{dot - 1:02d}"
    return text


def _escape_value(value: str) -> str:
    if "\\" in value or '"' in value or "\n" in value:
        return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")
    return value


Kind = Literal["gauge", "counter"]
Row = tuple[tuple[str, ...], float]
"""One series of a :class:`Family`: its label values (in the spec's label-name order) and value."""


class FamilySpec:
    """What stays the same for a gauge or counter family from scrape to scrape: name, help, type, label
    names, and the rendered ``name{label="value",...} `` of every label set written so far.

    Raises ValueError for a name or label name prometheus_client would reject or would have to escape.
    The cache holds at most ``max_cached`` label sets; past that it starts again empty, so label values
    that keep changing cost rendering time, never unbounded memory.
    """

    def __init__(
        self, name: str, documentation: str, kind: Kind, labelnames: Sequence[str], *, max_cached: int = 8192
    ) -> None:
        if kind not in ("gauge", "counter"):
            raise ValueError(f"{name}: only gauges and counters, not {kind!r}")
        if not _LEGACY_NAME.match(name) or (kind == "counter" and name.endswith("_total")):
            raise ValueError(f"invalid family name {name!r} for a {kind}")
        for label in labelnames:
            if not _LEGACY_NAME.match(label) or ":" in label or label.startswith("__"):
                raise ValueError(f"{name}: invalid label name {label!r}")
        if len(set(labelnames)) != len(labelnames):
            raise ValueError(f"{name}: repeated label names {list(labelnames)}")
        self.name = name
        self.documentation = documentation
        self.kind: Kind = kind
        self.labelnames = tuple(labelnames)
        self.sample_name = f"{name}_total" if kind == "counter" else name
        """The series name: a counter's ends in ``_total``."""
        help_text = documentation.replace("\\", r"\\").replace("\n", r"\n")
        self.header = f"# HELP {self.sample_name} {help_text}\n# TYPE {self.sample_name} {kind}\n"
        self._order = sorted(range(len(self.labelnames)), key=self.labelnames.__getitem__)
        self._max_cached = max_cached
        self._prefixes: dict[tuple[str, ...], str] = {}
        self._written: tuple[tuple[Row, ...], str] | None = None
        """The last rows a family of this spec was given as a tuple, and their text."""

    def family(self, rows: tuple[Row, ...] = ()) -> Family:
        """A family of this kind for one scrape: empty, or holding ``rows``.

        ``rows`` is for a collector that hands over the same tuple again while its series are
        unchanged; a family holding the tuple last written is not written again.
        """
        return Family(self, rows)

    def prefix(self, values: tuple[str, ...]) -> str:
        """``name{label="value",...} `` for one label set (labels sorted by name, values escaped)."""
        prefix = self._prefixes.get(values)
        if prefix is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name}: {len(values)} label values, expected {self.labelnames}")
            names = self.labelnames
            labels = ",".join(f'{names[i]}="{_escape_value(values[i])}"' for i in self._order)
            prefix = f"{self.sample_name}{{{labels}}} " if labels else f"{self.sample_name} "
            if len(self._prefixes) >= self._max_cached:
                self._prefixes.clear()
            self._prefixes[values] = prefix
        return prefix


class Family(Metric):
    """One scrape's series of a :class:`FamilySpec`, kept as (label values, value) rows.

    ``samples`` builds samples on demand, for readers other than :func:`encode`.
    """

    def __init__(self, spec: FamilySpec, rows: tuple[Row, ...] = ()) -> None:
        self.spec = spec
        self.rows: list[Row] | tuple[Row, ...] = rows if rows else []
        """The series; a tuple when handed over whole (see :meth:`FamilySpec.family`)."""
        super().__init__(spec.name, spec.documentation, spec.kind)

    def add(self, values: tuple[str, ...], value: float) -> None:
        """One series: label values in the spec's label-name order."""
        if len(values) != len(self.spec.labelnames):
            raise ValueError(f"{self.spec.name}: {len(values)} label values, expected {self.spec.labelnames}")
        rows = self.rows
        if isinstance(rows, tuple):  # handed-over rows stay as they were; this family gets its own
            rows = self.rows = list(rows)
        rows.append((values, value))

    @property
    def samples(self) -> list[Sample]:
        name, labelnames = self.spec.sample_name, self.spec.labelnames
        rows = self.rows
        return [Sample(name, dict(zip(labelnames, values, strict=True)), value) for values, value in rows]

    @samples.setter
    def samples(self, samples: list[Sample]) -> None:
        if samples:  # Metric.__init__ assigns an empty list; anything else would be lost
            raise TypeError("add series to a Family with add()")

    def text(self) -> str:
        """The family in the text format."""
        spec, rows = self.spec, self.rows
        written = spec._written  # the spec is this module's own class
        if written is not None and written[0] is rows:  # the same immutable rows as last written
            return written[1]
        cached, prefix = spec._prefixes.get, spec.prefix
        lines = [spec.header]
        for values, value in rows:
            line = cached(values) or prefix(values)
            if type(value) is int and 0 <= value < 1_000_000:  # most counts: go_float's fast case, inline
                lines.append(f"{line}{value}.0\n")
            else:
                lines.append(f"{line}{go_float(value)}\n")
        text = "".join(lines)
        if isinstance(rows, tuple) and rows:
            spec._written = (rows, text)
        return text


class SampleLike(Protocol):
    """A sample as :func:`encode` reads it: this package's :class:`~exporter.metric.Sample` or
    prometheus_client's."""

    @property
    def name(self) -> str: ...
    @property
    def labels(self) -> Mapping[str, str]: ...
    @property
    def value(self) -> float: ...
    @property
    def timestamp(self) -> object: ...
    @property
    def exemplar(self) -> object: ...
    @property
    def native_histogram(self) -> object: ...


class MetricLike(Protocol):
    """A family as :func:`encode` reads it: this package's :class:`~exporter.metric.Metric` or
    prometheus_client's."""

    @property
    def name(self) -> str: ...
    @property
    def documentation(self) -> str: ...
    @property
    def type(self) -> str: ...
    @property
    def samples(self) -> Sequence[SampleLike]: ...


def encode(families: Iterable[MetricLike]) -> bytes | None:
    """The text exposition of ``families``; None when one of them needs prometheus_client's encoder.

    Each distinct label-name set is validated and sorted once, and each distinct label value escaped
    once, per call: a GPU node's series repeat the same few names and values hundreds of times.
    """
    out: list[str] = []
    append = out.append
    orders: dict[tuple[str, ...], tuple[str, ...]] = {}
    escaped: dict[str, str] = {}
    for metric in families:
        if isinstance(metric, Family):
            append(metric.text())
            continue
        kind = _SIMPLE_TYPES.get(metric.type)
        if kind is None or not _LEGACY_NAME.match(metric.name):
            return None
        name = metric.name + "_total" if metric.type == "counter" else metric.name
        help_text = metric.documentation.replace("\\", r"\\").replace("\n", r"\n")
        append(f"# HELP {name} {help_text}\n# TYPE {name} {kind}\n")
        checked_name = ""
        for sample in metric.samples:
            if (
                sample.timestamp is not None
                or sample.exemplar is not None
                or sample.native_histogram is not None
            ):
                return None
            if sample.name != checked_name:
                if sample.name.endswith("_created") or not _LEGACY_NAME.match(sample.name):
                    return None
                checked_name = sample.name
            labels = sample.labels
            if not labels:
                append(f"{sample.name} {go_float(sample.value)}\n")
                continue
            keys = tuple(labels)
            order = orders.get(keys)
            if order is None:
                if not all(_LEGACY_NAME.match(key) for key in keys):
                    return None
                order = orders[keys] = tuple(sorted(keys))
            parts = []
            for key in order:
                value = labels[key]
                text = escaped.get(value)
                if text is None:
                    text = escaped[value] = _escape_value(value)
                parts.append(f'{key}="{text}"')
            append(f"{sample.name}{{{','.join(parts)}}} {go_float(sample.value)}\n")
    return "".join(out).encode("utf-8")


class _Replay:
    """One collection, handed to prometheus_client's encoder as it was collected."""

    def __init__(self, families: list[MetricLike]) -> None:
        self._families = families

    def collect(self) -> Iterator[Any]:  # prometheus_client reads either kind of family alike
        return iter(self._families)


class _Collects(Protocol):
    def collect(self) -> Iterable[MetricLike]: ...


def generate_text(registry: _Collects) -> bytes:
    """What prometheus_client's ``generate_latest(registry)`` returns, from one collection of the
    registry; prometheus_client itself is imported only for a family :func:`encode` cannot write."""
    families = list(registry.collect())
    encoded = encode(families)
    if encoded is not None:
        return encoded
    from prometheus_client import exposition  # noqa: PLC0415  12 MB the exporter's own families never need

    return exposition.generate_latest(_Replay(families))
