"""Runs named sources on every scrape and reports each one's health.

For every source the framework, never the source itself, reports:

- ``accel_exporter_collector_up{collector}``: 1 when the source read its hardware completely; 0 when
  the hardware is absent, the source is unavailable, it raised, or it skipped anything it could not
  read or parse (the series it could read are still exported).
- ``accel_exporter_collector_hardware_present{collector}``: 0 only when the source found none of its
  hardware (no InfiniBand on a GPU node, no NVIDIA driver on a CPU node), so rules can tell "nothing
  to read here" from "broken".
- ``accel_exporter_collector_errors{collector}``: problems met in this scrape (unreadable or garbage
  files, an unavailable source, an exception).
- ``accel_exporter_collector_duration_seconds{collector}``.

Reasons are logged when a source goes down, and again when it recovers.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from exporter import problems
from exporter.metric import Collector, GaugeMetricFamily, Metric

logger = logging.getLogger(__name__)


class SourceUnavailableError(RuntimeError):
    """A source cannot produce its series right now (device file unreadable, driver broken)."""


class HardwareAbsentError(SourceUnavailableError):
    """The node has none of the hardware this source reads: up 0, hardware_present 0, no error."""


@dataclass(frozen=True)
class Source:
    """A named producer of metric families."""

    name: str
    """The ``collector`` label, e.g. ``kmsg``, ``pci``."""
    collect: Callable[[], Iterable[Metric]]
    """Reads its data and returns fresh metric families; raises to report a failure."""


@dataclass(frozen=True)
class _Outcome:
    families: list[Metric]
    present: bool
    errors: int
    reason: str | None
    """Why the source is down; None while it is up."""


def _gauge(name: str, help_text: str) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, help_text, labels=["collector"])


class SourcesCollector(Collector):
    """A prometheus_client collector running each source, with health series per source."""

    def __init__(
        self,
        sources: Sequence[Source],
        *,
        clock: Callable[[], float] = time.perf_counter,
        health: bool = True,
    ) -> None:
        self._sources = tuple(sources)
        self._clock = clock
        self._health = health
        """False: only the sources' own families, no health series and no log lines (the fast path's
        brief reads; the full collection reports the health of the same hardware)."""
        self._down: set[str] = set()

    def collect(self) -> Iterator[Metric]:
        up = _gauge(
            "accel_exporter_collector_up",
            "1 when the collector read its hardware completely in this scrape; 0 when the hardware is "
            "absent, the source failed, or anything had to be skipped.",
        )
        present = _gauge(
            "accel_exporter_collector_hardware_present",
            "0 when the collector found none of the hardware it reads on this node.",
        )
        errors = _gauge(
            "accel_exporter_collector_errors",
            "Problems (unreadable or malformed input, failures) the collector met in this scrape.",
        )
        duration = _gauge(
            "accel_exporter_collector_duration_seconds", "Time the collector took in this scrape."
        )
        if not self._health:
            for source in self._sources:
                yield from self._run(source, log=False).families
            return
        for source in self._sources:
            started = self._clock()
            outcome = self._run(source)
            duration.add_metric([source.name], self._clock() - started)
            up.add_metric([source.name], 0.0 if outcome.reason else 1.0)
            present.add_metric([source.name], 1.0 if outcome.present else 0.0)
            errors.add_metric([source.name], outcome.errors)
            self._note(source.name, outcome)
            yield from outcome.families
        yield from (up, present, errors, duration)

    @staticmethod
    def _run(source: Source, *, log: bool = True) -> _Outcome:
        with problems.recording(quiet=not log) as found:
            try:
                families = list(source.collect())
            except HardwareAbsentError as exc:
                return _Outcome([], present=False, errors=len(found), reason=f"no hardware: {exc}")
            except SourceUnavailableError as exc:
                return _Outcome([], present=True, errors=len(found) + 1, reason=str(exc))
            except Exception as exc:  # one broken source must not break the scrape; up 0 + log
                if log:
                    logger.exception("collector %s failed", source.name)
                return _Outcome(
                    [], present=True, errors=len(found) + 1, reason=f"{type(exc).__name__}: {exc}"
                )
        if found:
            reason = f"{len(found)} problem(s), first: {found[0]}"
            return _Outcome(families, present=True, errors=len(found), reason=reason)
        return _Outcome(families, present=True, errors=0, reason=None)

    def _note(self, name: str, outcome: _Outcome) -> None:
        reason = outcome.reason
        if reason is not None and name not in self._down:
            self._down.add(name)
            # Absent hardware is a normal state of a node, not something to warn about.
            log = logger.warning if outcome.present else logger.info
            log("collector %s is down: %s", name, reason)
        elif reason is None and name in self._down:
            self._down.discard(name)
            logger.info("collector %s is up again", name)
