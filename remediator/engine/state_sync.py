"""The gate state kept in the cluster: read at start and again on becoming leader, written after a
delivery that changed it (with a resourceVersion precondition, see remediator/statestore.py)."""

from __future__ import annotations

import logging

from remediator.engine.base import EngineBase
from remediator.engine.stored import alert_document, held_reversals, running_drains
from remediator.state import GateState, StateError

logger = logging.getLogger("remediator.decisions")


class StateSync(EngineBase):
    """Reads and writes the gate state."""

    async def start(self) -> None:
        """Read the gate state from the cluster. Unreadable state pauses the service (loudly)
        instead of starting with an empty budget; BackendUnavailable propagates."""
        async with self._lock:
            await self._load()

    def became_leader(self) -> None:
        """This replica now leads: what it read before may be stale, so it reads the gate state
        again before its next decision (`synced` is False until then)."""
        if not self.settings.dry_run:
            self._store.invalidate()

    @property
    def synced(self) -> bool:
        """The gate state was read since start or since this replica last became the leader."""
        return self._store.loaded

    async def _load(self) -> None:
        if self._store.loaded:
            return
        self.state = await self._store.load(self.state)
        self._dirty = False
        if not self.settings.dry_run:
            try:
                self._resume = running_drains(self.state.drains)
            except StateError as exc:
                logger.error(
                    "stored drains unusable (%s); the next delivery of their alerts resumes them", exc
                )
                self._resume = {}
            try:
                stored = held_reversals(self.state.held, self.policy)
            except StateError as exc:
                logger.error("stored held reversals unusable (%s); they stay held until a human acts", exc)
                stored = {}
            self._held = {
                node: {(a.fingerprint, a.starts_at, False): (a, rule) for a, rule in items}
                for node, items in stored.items()
            }

    async def _save(self) -> None:
        if not self._dirty or self.settings.dry_run:
            self._dirty = False
            return
        # The alerts waiting on each drain running now: a new leader resumes those drains from them.
        self.state.drains = {
            node: [alert_document(w.alert) for w in running.waiters.values() if w.resolved is None]
            for node, running in self._drains.items()
            if not running.ended
        }
        # The reversals held back by other causes: a new leader releases them when none is left.
        self.state.held = {
            node: [
                {"rule": rule.name, "alert": alert_document(alert)}
                for (_, _, dry), (alert, rule) in held.items()
                if not dry
            ]
            for node, held in self._held.items()
            if any(not dry for _, _, dry in held)
        }
        self.state = await self._store.save(self.state)
        self._dirty = False

    async def set_paused(self, paused: bool, reason: str = "") -> bool:
        """Pause or resume every action; True when the switch changed. Saved at once (not in dry-run)."""
        async with self._lock:
            await self._load()

            def apply(state: GateState) -> bool:
                if paused:
                    was = state.pause.paused
                    state.pause.pause(reason or "paused by an operator")
                    return not was
                return state.pause.resume()

            changed = apply(self.state)
            if not self.settings.dry_run:
                self.state = await self._store.save(self.state, reapply=apply)
            return changed
