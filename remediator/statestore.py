"""Reading and writing the gate state (remediator/state.py) through the Cluster seam.

The leader is the only writer, but two replicas can both believe they lead for a moment around a
fail-over, and a replica that read the document before it led holds a stale copy. So:

- a replica reads the document again each time it becomes the leader (`invalidate()`, then the next
  `load()`), before it reports ready or decides anything;
- every write carries the resourceVersion it was read at (the executor's precondition); a conflict
  means another writer was there: read the stored document again, merge what this replica knows
  that the stored one lacks (`GateState.merge_unsaved`), re-apply the change being made (a pause),
  and write again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from remediator.cluster import Cluster, StateConflict
from remediator.safety import SafetySettings
from remediator.state import GateState, StateError

logger = logging.getLogger("remediator.state")

CONFLICT_ATTEMPTS = 5


class StateStore:
    """Loads the gate state when needed and saves it with conflict handling."""

    def __init__(self, *, cluster: Cluster, settings: SafetySettings, clock: Callable[[], float]) -> None:
        self._cluster = cluster
        self._settings = settings
        self._clock = clock
        self.loaded = False
        """True once the document was read since start or since the last `invalidate()`."""
        self.loads = 0
        """How often the document was read (a metric for tests and /state)."""

    def invalidate(self) -> None:
        """The copy in memory may be stale (this replica just became leader): read it again."""
        self.loaded = False

    async def read(self) -> GateState:
        """The stored state (an empty one when none is stored). StateError, BackendUnavailable."""
        fresh = GateState(settings=self._settings, clock=self._clock)
        doc = await self._cluster.load_gate_state()
        self.loads += 1
        if doc is not None:
            fresh.load_document(doc)
        return fresh

    async def load(self, current: GateState) -> GateState:
        """`current`, or the stored state when it needs reading. Unusable stored state: `current`,
        paused (loudly), keeping the stored document for inspection."""
        if self.loaded:
            return current
        try:
            fresh = await self.read()
        except StateError as exc:
            self.loaded = True
            logger.error("stored gate state is unusable (%s); PAUSED", exc)
            current.pause.pause(f"stored gate state unusable: {exc}; check, then POST /resume")
            return current
        self.loaded = True
        logger.info(
            "gate state read: %d node(s) held, %d node(s) with alerts firing, breaker %s, %s",
            len(fresh.budget.holders()),
            len(fresh.firing.nodes()),
            "OPEN" if fresh.breaker.open else "closed",
            "PAUSED" if fresh.pause.paused else "not paused",
        )
        return fresh

    async def save(
        self, state: GateState, *, reapply: Callable[[GateState], object] | None = None
    ) -> GateState:
        """Write `state`; on a conflict read, merge, re-apply and write again. Returns the state now
        in force (the merged one after a conflict)."""
        for attempt in range(1, CONFLICT_ATTEMPTS + 1):
            try:
                await self._cluster.save_gate_state(state.to_document())
            except StateConflict as exc:
                if attempt == CONFLICT_ATTEMPTS:
                    raise
                logger.warning("gate state changed by another writer (%s); reading it again and merging", exc)
                stored = await self.read()
                stored.merge_unsaved(state)
                if reapply is not None:
                    reapply(stored)
                state = stored
                continue
            return state
        raise AssertionError("unreachable")  # pragma: no cover
