"""One JSON file of the exporter's state directory (``--state-dir``, a hostPath), tagged with the boot
it belongs to: the kernel-log counts, the evidence and the InfiniBand counters' rises each keep one.

Reading gives the state only when it was saved during the current boot; an absent file is no state.
A file that cannot be read (not JSON, cut short, not the store's shape) is damaged: an error line,
and counted in :func:`damaged_counts` (``accel_exporter_state_file_damaged_total{file}``); the store
starts without it. One from another boot is logged and ignored.

Writing has one writer at a time and never goes back in time:

- every save names its *generation*, a number the store takes under its own lock when it builds the
  state (later built, larger); a save older than the one written last is dropped, so two threads
  saving at once can never leave the older state on disk;
- the write itself holds the file's lock in this process and an ``flock`` on a lock file beside it
  (another exporter on the same directory, during a rolling update, waits for it);
- the text goes to a temporary file of its own (``mkstemp`` in the same directory: two writers never
  share one), is flushed to disk (``fsync``), and is renamed over the old file, which is atomic: a
  reader, or the next start after a SIGKILL at any point, finds the old state or the new, never a mix;
  temporary files a killed process left are removed by the next writer.

A write that fails is logged once until a write succeeds again. Each store logs through its own
logger, with its own prefix.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_damaged: dict[str, int] = {}
_damaged_lock = threading.Lock()


def damaged_counts() -> dict[str, int]:
    """State file name -> reads that found it damaged, in this process (only files that were)."""
    with _damaged_lock:
        return dict(_damaged)


def _count_damaged(name: str) -> None:
    with _damaged_lock:
        _damaged[name] = _damaged.get(name, 0) + 1


class BootStateFile:
    """``path``, read and written for one store; ``other_boot`` says what the store does when the file
    is from another boot (``"counting from zero"``)."""

    def __init__(self, path: Path, *, logger: logging.Logger, prefix: str, other_boot: str) -> None:
        self.path = path
        self._logger = logger
        self._prefix = prefix
        self._other_boot = other_boot
        self._last_error: str | None = None
        self._lock = threading.Lock()
        self._written: int | None = None
        """The generation written last by this process (None: none yet)."""
        self._swept = False

    def read(self, boot_id: str) -> dict[str, Any] | None:
        """The saved state when it is this boot's (``boot_id``); None otherwise. A read starts the
        store's generations afresh (it resumes from what it read, or from nothing)."""
        with self._lock:
            self._written = None
        try:
            state = json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            self.damaged(f"cannot read {self.path}: {exc}")
            return None
        if not isinstance(state, dict):
            self.damaged(f"{self.path} holds no JSON object")
            return None
        if state.get("boot_id") != boot_id:
            self._logger.info("%s: %s is from another boot; %s", self._prefix, self.path, self._other_boot)
            return None
        return state

    def malformed(self, exc: Exception) -> None:
        """This boot's state could not be taken as it is (the store ignores it): damaged."""
        self.damaged(f"malformed state in {self.path}: {exc}")

    def damaged(self, why: str) -> None:
        """Logs (an error) and counts a damaged state file; the store goes on without it."""
        _count_damaged(self.path.name)
        self._logger.error("%s: %s; going on without it", self._prefix, why)

    def write(self, text: str, *, generation: int | None = None) -> bool:
        """Replaces the file with ``text`` unless a newer generation was written already (then True:
        the file holds a newer state); False (logged once) when it cannot be written. ``generation``
        None: always written (a store with one writer thread)."""
        with self._lock:
            if generation is not None and self._written is not None and generation <= self._written:
                return True
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                with self._flocked():
                    self._sweep()
                    self._replace(text)
            except OSError as exc:
                error = f"cannot write {self.path}: {exc.strerror or exc}"
                if error != self._last_error:
                    self._logger.warning("%s: %s", self._prefix, error)
                    self._last_error = error
                return False
            if generation is not None:
                self._written = generation
        self._last_error = None
        return True

    @contextlib.contextmanager
    def _flocked(self) -> Iterator[None]:
        fd = os.open(self.path.with_name(f".{self.path.name}.lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    def _sweep(self) -> None:
        """Once per process: remove temporary files a killed writer left (under the file lock)."""
        if self._swept:
            return
        self._swept = True
        for left in self.path.parent.glob(f".{self.path.name}.*.tmp"):
            with contextlib.suppress(OSError):
                left.unlink()

    def _replace(self, text: str) -> None:
        fd, temporary = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as out:
                out.write(text)
                out.flush()
                os.fsync(out.fileno())
            os.replace(temporary, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise
        with contextlib.suppress(OSError):  # the rename itself, on disk (not every filesystem allows it)
            directory = os.open(self.path.parent, os.O_RDONLY)
            try:
                os.fsync(directory)
            finally:
                os.close(directory)
