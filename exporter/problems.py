"""Problems a source meets while it reads, counted against the collector that is running.

Readers keep returning typed values and skip what they cannot read; they call :func:`note` for each
file or field they had to skip. The framework runs every source inside :func:`recording`, so a scrape
that met problems reports ``accel_exporter_collector_up 0`` while still exporting what it could read:
a garbage file is a 0 and a log line, never a crash and never a wrong number.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from contextvars import ContextVar

_current: ContextVar[list[str] | None] = ContextVar("accel_exporter_problems", default=None)
_quiet: ContextVar[bool] = ContextVar("accel_exporter_problems_quiet", default=False)


def note(logger: logging.Logger, message: str, *args: object) -> None:
    """Logs a problem as a warning on ``logger`` (not inside a quiet :func:`recording`) and counts it
    against the running collector."""
    if not _quiet.get():
        logger.warning(message, *args)
    found = _current.get()
    if found is not None:
        found.append(message % args if args else message)


@contextlib.contextmanager
def recording(*, quiet: bool = False) -> Iterator[list[str]]:
    """Collects the problems noted inside the block into the list it yields; ``quiet`` leaves them
    out of the log (the fast path reads the same files every 2 s: the full read logs them)."""
    found: list[str] = []
    token = _current.set(found)
    quiet_token = _quiet.set(quiet)
    try:
        yield found
    finally:
        _quiet.reset(quiet_token)
        _current.reset(token)
