"""The Prometheus text format (version 0.0.4) of the exporter's registry, cheaply.

prometheus_client's ``generate_latest`` validates and escapes every label name of every sample; on a
GPU node with a thousand label-heavy series that is most of a scrape's cost. The exporter only ever
publishes gauges and counters with legacy-valid names and no timestamps, so this encoder writes those
directly and produces the same bytes as ``generate_latest`` (tests hold it to that). Anything outside
that shape (another metric type, a timestamp, an exemplar, a name needing escaping) is handed to
``generate_latest`` unchanged.

The exporter serves this format whatever the scraper's Accept header asks for, as node_exporter does by
default; every Prometheus version parses it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

from prometheus_client import generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LEGACY_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_SIMPLE_TYPES = {"gauge": "gauge", "counter": "counter"}


def go_float(value: float) -> str:
    """A sample value as Prometheus's Go code writes it (prometheus_client's ``floatToGoString``)."""
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


def encode(families: Iterable[Metric]) -> bytes | None:
    """The text exposition of ``families``; None when one of them needs prometheus_client's encoder.

    Each distinct label-name set is validated and sorted once, and each distinct label value escaped
    once, per call: a GPU node's series repeat the same few names and values hundreds of times.
    """
    out: list[str] = []
    append = out.append
    orders: dict[tuple[str, ...], tuple[str, ...]] = {}
    escaped: dict[str, str] = {}
    for metric in families:
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


class _Replay(Collector):
    """One collection, handed to prometheus_client's encoder as it was collected."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return iter(self._families)


def generate_text(registry: Collector) -> bytes:
    """What ``generate_latest(registry)`` returns, from one collection of the registry."""
    families = list(registry.collect())
    encoded = encode(families)
    return encoded if encoded is not None else generate_latest(_Replay(families))
