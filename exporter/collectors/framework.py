"""Runs named sources on every scrape and reports each one's success and duration.

Every source reports ``accel_exporter_collector_up{collector}`` (1 or 0) and
``accel_exporter_collector_duration_seconds{collector}``; the sources themselves never do. A source
that raises contributes no series of its own that scrape (up 0); the reason is logged when the source
goes down, and again when it recovers.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

logger = logging.getLogger(__name__)


class SourceUnavailableError(RuntimeError):
    """A source cannot produce its series right now (no device file, no driver): up 0, no traceback."""


@dataclass(frozen=True)
class Source:
    """A named producer of metric families."""

    name: str
    """The ``collector`` label, e.g. ``kmsg``, ``pci``."""
    collect: Callable[[], Iterable[Metric]]
    """Reads its data and returns fresh metric families; raises to report a failure."""


class SourcesCollector(Collector):
    """A prometheus_client collector running each source, with up/duration series per source."""

    def __init__(self, sources: Sequence[Source], *, clock: Callable[[], float] = time.perf_counter) -> None:
        self._sources = tuple(sources)
        self._clock = clock
        self._down: set[str] = set()

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily(
            "accel_exporter_collector_up",
            "Whether the collector produced its series in this scrape (1) or failed (0).",
            labels=["collector"],
        )
        duration = GaugeMetricFamily(
            "accel_exporter_collector_duration_seconds",
            "Time the collector took in this scrape.",
            labels=["collector"],
        )
        for source in self._sources:
            started = self._clock()
            families, error = self._run(source)
            duration.add_metric([source.name], self._clock() - started)
            up.add_metric([source.name], 0.0 if error else 1.0)
            self._note(source.name, error)
            yield from families
        yield up
        yield duration

    @staticmethod
    def _run(source: Source) -> tuple[list[Metric], str | None]:
        try:
            return list(source.collect()), None
        except SourceUnavailableError as exc:
            return [], str(exc)
        except Exception as exc:  # one broken source must not break the scrape; up 0 + log
            logger.exception("collector %s failed", source.name)
            return [], f"{type(exc).__name__}: {exc}"

    def _note(self, name: str, error: str | None) -> None:
        if error is not None and name not in self._down:
            self._down.add(name)
            logger.warning("collector %s is down: %s", name, error)
        elif error is None and name in self._down:
            self._down.discard(name)
            logger.info("collector %s is up again", name)
