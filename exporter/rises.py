"""How much each watched InfiniBand port counter rose while the exporter watched it, during this boot.

A port's ``link_downed``, ``local_link_integrity_errors`` and ``excessive_buffer_overrun_errors``
counters cordon the node on their first increase (alerts/infiniband.yaml). As raw counters they are 24
series on a node with 8 ports, nearly all of which never move, and a rule that must see an increase
within a second reads every one of them every second: at 2,000 nodes that was most of a second of
every second. So the fast path carries, instead, what this module keeps:
``accel_infiniband_port_events_seen_total{device, port, counter}``, the rises of those counters this
exporter saw, a series only once there was one (as an Xid count exists only from its first record).
The raw counters stay on the slow path for the dashboards and the slower rules.

- The first reading of a counter in a boot is history, not a rise: what the counter held before the
  exporter ran (the link training at boot, the faults of a previous exporter's time are counted by
  the state below).
- A reading below the previous one is a reset (an adapter reset, ``perfquery -R``): it is the new
  starting point, and only rises from it count. The series never goes down within a boot.
- With a state directory (the exporter's hostPath) the last readings and the rises survive an exporter
  restart within the boot: a rise while no exporter ran is counted at the first reading after it.
  State saved in another boot is ignored (the counters started again), and so are unreadable files.
- When each counter last rose is kept too, on the system's monotonic clock (CLOCK_MONOTONIC: seconds
  since this boot, the same for every process of the boot, so it survives a restart with the state):
  ``accel_infiniband_port_events_last_rise_age_seconds{device, port, counter}`` is how long ago, at
  the scrape. "Rose within the last 10 minutes" is then an instant comparison that needs no history in
  Prometheus and cannot reach into another boot (a rise of the previous boot is not in this boot's
  state) or depend on the node's wall clock.

Everything here is raw: the rules decide what a rise means and for how long (alerts/infiniband.yaml).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from exporter.readers.kmsg import BOOT_ID_PATH, read_boot_id
from exporter.readers.sysfs import InfinibandPort
from exporter.statefile import BootStateFile

logger = logging.getLogger(__name__)

STATE_FILE_NAME = "infiniband-rises.json"
_STATE_VERSION = 1
MAX_KEYS = 4096
"""Counters kept at most (a node has a few dozen): a driver inventing port names forever cannot grow
the state without bound; past it, new ports are not watched."""

Key = tuple[str, str, str]
"""(device, port, counter)."""


def _name(key: Key) -> str:
    return "/".join(key)


def _key(name: str) -> Key:
    device, port, counter = name.split("/")
    return device, port, counter


class CounterRises:
    """The rises of ``counters`` on every port read, this boot; thread-safe (the fast and the slow
    path read the ports concurrently and hand each reading here)."""

    def __init__(
        self,
        counters: Iterable[str],
        *,
        directory: Path | None,
        boot_id_path: Path = BOOT_ID_PATH,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.counters = frozenset(counters)
        self._monotonic = monotonic
        self.path = None if directory is None else directory / STATE_FILE_NAME
        self._file = (
            None
            if self.path is None
            else BootStateFile(
                self.path, logger=logger, prefix="infiniband", other_boot="next readings are history"
            )
        )
        self.boot_id = read_boot_id(boot_id_path) if directory is not None else None
        """This boot's id; None when there is no state directory or it cannot be read (then nothing is
        saved or loaded)."""
        self._lock = threading.Lock()
        self._generation = 0
        """Counts the changes; a state is written only when newer than the one written last."""
        self._last: dict[Key, int] = {}
        self._rises: dict[Key, int] = {}
        self._risen_at: dict[Key, float] = {}
        """When each counter last rose: the monotonic time of the reading that saw it (this boot)."""
        self._newest_read = -float("inf")
        """When the newest reading taken into account began (monotonic seconds)."""

    def load(self) -> bool:
        """Resumes this boot's readings and rises from the state directory; False when there is none."""
        if self._file is None or self.boot_id is None:
            return False
        state = self._file.read(self.boot_id)
        if state is None:
            return False
        try:
            last = {_key(str(name)): int(value) for name, value in dict(state["last"]).items()}
            rises = {_key(str(name)): int(value) for name, value in dict(state["rises"]).items()}
            # Kept from the version that added it; a rise of an older state has no known time and
            # counts as long ago (its alert had its 10 minutes before the restart, or nearly).
            kept = dict(state.get("risen_at", {}))
            risen_at = {_key(str(name)): float(value) for name, value in kept.items()}
        except (ValueError, TypeError, KeyError) as exc:
            self._file.malformed(exc)
            return False
        with self._lock:
            self._last = dict(list(last.items())[:MAX_KEYS])
            self._rises = {key: value for key, value in rises.items() if key in self._last and value > 0}
            self._risen_at = {key: value for key, value in risen_at.items() if key in self._rises}
        logger.info("infiniband: resuming this boot's counter readings from %s", self.path)
        return True

    def observe(self, ports: Iterable[InfinibandPort], *, read_at: float | None = None) -> dict[Key, int]:
        """Takes one reading of every port, begun at ``read_at`` (``time.monotonic()``; None: now), and
        returns every counter's rises so far (only those above 0), by (device, port, counter).

        A reading that began before one already taken is left out: the slow and the fast path read
        concurrently, and an older value arriving after a newer one would look like a reset, after
        which the newer value would count as a rise a second time."""
        changed = False
        with self._lock:
            begun = self._monotonic() if read_at is None else read_at
            stale = begun < self._newest_read
            self._newest_read = max(self._newest_read, begun)
            last, rises = self._last, self._rises
            for port in () if stale else ports:
                for counter, value in port.counters.items():
                    if counter not in self.counters:
                        continue
                    key = (port.device, port.port, counter)
                    before = last.get(key)
                    if before == value:
                        continue
                    if before is None and len(last) >= MAX_KEYS:
                        continue
                    last[key] = value
                    changed = True
                    if before is not None and value > before:
                        rises[key] = rises.get(key, 0) + value - before
                        self._risen_at[key] = begun
            found = dict(rises)
            if changed:
                self._generation += 1
            state = (self._generation, self._state()) if changed else None
        if state is not None:
            self._save(*state)
        return found

    def _state(self) -> dict[str, object]:
        return {
            "boot_id": self.boot_id,
            "version": _STATE_VERSION,
            "last": {_name(key): value for key, value in self._last.items()},
            "rises": {_name(key): value for key, value in self._rises.items()},
            "risen_at": {_name(key): value for key, value in self._risen_at.items()},
        }

    def ages(self, now: float | None = None) -> dict[Key, float]:
        """Seconds since each counter last rose (those with a known time), at ``now`` (monotonic;
        None: now); never below 0."""
        with self._lock:
            at = self._monotonic() if now is None else now
            return {key: max(0.0, at - risen) for key, risen in self._risen_at.items()}

    def _save(self, generation: int, state: Mapping[str, object]) -> None:
        """Writes ``state`` atomically unless a newer one was written already (two scrapes read at
        once; exporter/statefile.py); a failure is logged once and leaves the counts in memory, to be
        written with the next change."""
        if self._file is None or self.boot_id is None:
            return
        self._file.write(json.dumps(state, separators=(",", ":")), generation=generation)
