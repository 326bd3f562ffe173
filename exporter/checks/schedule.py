"""Runs checks on a schedule: per check an interval, a deadline and parameters.

Defaults: checks that do not load the GPU (``remapped``, ``power``, ``ping``) hourly; invasive ones
(``pciebw``, ``gpumem``, ``dcgm``) and ``iperf``, which loads the network, daily. A schedule file
(YAML) changes them per check::

    checks:
      pciebw: {interval: 6h, deadline: 120s}
      dcgm:   {interval: 1d, params: {r: "2"}}
      iperf:  {enabled: false}

A node's first runs are spread over ``first_delay`` (a fraction of each interval, derived from the
node name), so a DaemonSet rollout does not measure every node's PCIe at the same instant.
:meth:`Scheduler.tick` does the work for one moment and is what tests drive; :meth:`Scheduler.start`
calls it from a thread.
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from exporter.checks.runner import CheckRunner

logger = logging.getLogger(__name__)

HOUR = 3600.0
DAY = 24 * HOUR
HEAVY = frozenset({"iperf"})
"""Not invasive to GPUs, but loads what it measures: scheduled daily like invasive checks."""

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(s|m|h|d)$")
_UNITS = {"s": 1.0, "m": 60.0, "h": HOUR, "d": DAY}


class ScheduleError(ValueError):
    """A schedule file that cannot be used (the exporter refuses to start with it)."""


def parse_duration(value: object) -> float:
    """``90s``, ``15m``, ``6h``, ``1d`` or a number of seconds -> seconds (positive)."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        seconds = float(value)
    else:
        match = _DURATION.match(str(value).strip())
        if match is None:
            raise ScheduleError(f"not a duration: {value!r} (use 90s, 15m, 6h, 1d)")
        seconds = float(match[1]) * _UNITS[match[2]]
    if seconds <= 0:
        raise ScheduleError(f"a duration must be positive: {value!r}")
    return seconds


@dataclass(frozen=True)
class CheckSchedule:
    interval: float
    """Seconds between runs."""
    deadline: float | None = None
    """Seconds a run may take; None: the runner's default."""
    params: Mapping[str, str] = field(default_factory=dict)
    enabled: bool = True


def default_schedule(runner: CheckRunner) -> dict[str, CheckSchedule]:
    return {
        name: CheckSchedule(interval=DAY if check.invasive or name in HEAVY else HOUR)
        for name, check in runner.checks.items()
    }


def load_schedule(path: Path | None, runner: CheckRunner) -> dict[str, CheckSchedule]:
    """The default schedule updated by ``path``; raises :class:`ScheduleError` for a bad file."""
    schedule = default_schedule(runner)
    if path is None:
        return schedule
    try:
        document: Any = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ScheduleError(f"cannot read schedule {path}: {exc}") from None
    entries = document.get("checks", {}) if isinstance(document, Mapping) else None
    if not isinstance(entries, Mapping):
        raise ScheduleError(f"{path}: expected a mapping under `checks:`")
    for name, entry in entries.items():
        if name not in schedule:
            raise ScheduleError(f"{path}: unknown check {name!r} (known: {', '.join(sorted(schedule))})")
        entry = entry or {}  # noqa: PLW2901  `name:` with nothing under it means the defaults
        unknown = set(entry) - {"interval", "deadline", "params", "enabled"}
        if unknown:
            raise ScheduleError(f"{path}: {name}: unknown keys {sorted(unknown)}")
        params = {str(k): str(v) for k, v in (entry.get("params") or {}).items()}
        try:
            runner.validate([name], params)
        except ValueError as exc:
            raise ScheduleError(f"{path}: {name}: {exc}") from None
        base = schedule[name]
        schedule[name] = CheckSchedule(
            interval=parse_duration(entry["interval"]) if "interval" in entry else base.interval,
            deadline=parse_duration(entry["deadline"]) if "deadline" in entry else None,
            params=params,
            enabled=bool(entry.get("enabled", True)),
        )
    return schedule


class Scheduler:
    """Runs each enabled check when it is due, one check at a time (the runner keeps GPUs apart even
    when an on-demand request runs beside it)."""

    def __init__(
        self,
        runner: CheckRunner,
        schedule: Mapping[str, CheckSchedule],
        *,
        node: str = "",
        start: float | None = None,
        first_delay: float = 0.1,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.runner = runner
        self.schedule = {name: s for name, s in schedule.items() if s.enabled}
        self._clock = clock
        began = clock() if start is None else start
        self.next_due: dict[str, float] = {}
        for name, entry in self.schedule.items():
            digest = hashlib.sha256(f"{node}/{name}".encode()).digest()
            spread = int.from_bytes(digest[:4], "big") / 2**32
            self.next_due[name] = began + spread * first_delay * entry.interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def tick(self, now: float | None = None) -> list[str]:
        """Runs the checks due at ``now`` (the clock's time by default); returns their names."""
        ran = []
        for name, entry in self.schedule.items():
            at = self._clock() if now is None else now
            if at < self.next_due[name]:
                continue
            if entry.deadline is not None:
                self.runner.set_deadline(name, entry.deadline)
            result = self.runner.run(name, entry.params)
            logger.info("check %s: %s %s", name, result.verdict, result.message)
            self.next_due[name] = at + entry.interval
            ran.append(name)
        return ran

    def seconds_to_next(self, now: float) -> float:
        return max(0.0, min(self.next_due.values(), default=now + HOUR) - now)

    def start(self) -> None:
        def loop() -> None:
            while not self._stop.wait(min(self.seconds_to_next(self._clock()), 60.0)):
                self.tick()

        self._thread = threading.Thread(target=loop, name="check-schedule", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
