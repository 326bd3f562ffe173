"""One JSON file of the exporter's state directory (``--state-dir``, a hostPath), tagged with the boot
it belongs to: the kernel-log counts, the evidence and the InfiniBand counters' rises each keep one.

Reading gives the state only when it was saved during the current boot; an absent file is no state, an
unreadable one or one from another boot is logged and ignored. Writing is atomic (a temporary file
renamed over the old one); a failure is logged once until a write succeeds again. Each store logs
through its own logger, with its own prefix.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any


class BootStateFile:
    """``path``, read and written for one store; ``other_boot`` says what the store does when the file
    is from another boot (``"counting from zero"``)."""

    def __init__(self, path: Path, *, logger: logging.Logger, prefix: str, other_boot: str) -> None:
        self.path = path
        self._logger = logger
        self._prefix = prefix
        self._other_boot = other_boot
        self._last_error: str | None = None

    def read(self, boot_id: str) -> dict[str, Any] | None:
        """The saved state when it is this boot's (``boot_id``); None otherwise."""
        try:
            state = json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            self._logger.warning("%s: ignoring unreadable state %s: %s", self._prefix, self.path, exc)
            return None
        if not isinstance(state, dict) or state.get("boot_id") != boot_id:
            self._logger.info("%s: %s is from another boot; %s", self._prefix, self.path, self._other_boot)
            return None
        return state

    def malformed(self, exc: Exception) -> None:
        """Logs that this boot's state could not be taken as it is (the store ignores it)."""
        self._logger.warning("%s: ignoring malformed state %s: %s", self._prefix, self.path, exc)

    def write(self, text: str) -> bool:
        """Replaces the file with ``text``; False (logged once) when it cannot be written."""
        temporary = self.path.with_name(f".{self.path.name}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            temporary.write_text(text)
            os.replace(temporary, self.path)
        except OSError as exc:
            error = f"cannot write {self.path}: {exc.strerror or exc}"
            if error != self._last_error:
                self._logger.warning("%s: %s", self._prefix, error)
                self._last_error = error
            return False
        self._last_error = None
        return True
