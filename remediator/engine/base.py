"""The engine's shared state and its decision records: who the parts below act through (cluster,
AWS, clock), the records they write, deferred actions, and what dry-run changes."""

from __future__ import annotations

import asyncio
import logging
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

from remediator.audit import DecisionLog, DecisionRecord
from remediator.cluster import Aws, Cluster
from remediator.engine.model import (
    MAX_PENDING,
    ActionResult,
    Context,
    EngineSettings,
    PendingAction,
    RunningDrain,
)
from remediator.payload import Alert
from remediator.policy import Action, Policy, Rule
from remediator.safety import DisruptionBudget, ScopedBudgets
from remediator.state import GateState
from remediator.statestore import StateStore

logger = logging.getLogger("remediator.decisions")


class EngineBase(ABC):
    """State and records shared by the engine's parts (each a layer on top of this one)."""

    def __init__(
        self,
        *,
        policy: Policy,
        cluster: Cluster,
        aws: Aws,
        settings: EngineSettings,
        clock: Callable[[], float],
        log: DecisionLog | None = None,
    ) -> None:
        self.policy = policy
        self.settings = settings
        self.state = GateState(settings=policy.safety, clock=clock)
        self.log = log if log is not None else DecisionLog()
        self.pending: OrderedDict[tuple[Any, ...], PendingAction] = OrderedDict()
        """Deferred actions by idempotency key, oldest first."""
        self._cluster = cluster
        self._aws = aws
        self._clock = clock
        self._listeners: list[Callable[[DecisionRecord], None]] = []
        self._lock = asyncio.Lock()
        self._dirty = False
        self._store = StateStore(cluster=cluster, settings=policy.safety, clock=clock)
        self._eligible: set[str] | None = None  # eligible nodes, as last observed
        self._held: dict[str, dict[tuple[str, str, bool], tuple[Alert, Rule]]] = {}
        # node -> (fingerprint, startsAt, dry-run) -> a resolved alert whose reversals are held back
        # by other causes still firing (kept in the gate state, so a new leader releases them)
        self._reconciled = False  # budget reconciled during the current delivery
        self._drains: dict[str, RunningDrain] = {}
        self._resume: dict[str, list[Alert]] = {}  # drains a previous leader left running
        self._tasks: set[asyncio.Task[None]] = set()  # drains, and the bookkeeping after each
        self._stopping = False
        self.suppressed: dict[str, str] = {}
        """fingerprint -> why, for alerts Alertmanager last showed silenced or inhibited."""
        self.scoped = ScopedBudgets({r.name: (r.nodes, r.budget) for r in policy.rules if r.budget})
        """The rules' own budgets over the nodes their selectors cover (observed with the nodes)."""

    @property
    def budget(self) -> DisruptionBudget:
        """The disruption budget."""
        return self.state.budget

    def subscribe(self, listener: Callable[[DecisionRecord], None]) -> None:
        """Call `listener` with every new decision record (metrics, audit sinks)."""
        self._listeners.append(listener)

    def publish(self, record: DecisionRecord) -> None:
        """A decision made outside a delivery (the repair loop): logged and shown like the others."""
        self.log.append(record)
        for listener in self._listeners:
            listener(record)

    def _record(self, alert: Alert, **kwargs: Any) -> DecisionRecord:
        record = DecisionRecord(
            time=self._clock(),
            alertname=alert.labels.get("alertname", ""),
            fingerprint=alert.fingerprint,
            starts_at=alert.starts_at,
            status="resolved" if alert.status == "resolved" else "firing",
            **kwargs,
        )
        self.log.append(record)
        logger.info("%s", record.log_line())
        for listener in self._listeners:
            listener(record)
        return record

    def _ignore(
        self, alert: Alert, *, node: str | None, rule: Rule | None, reason: str
    ) -> DecisionRecord | None:
        dry = self.settings.dry_run or (rule is not None and rule.dry_run)
        key = (alert.fingerprint, alert.starts_at, alert.status, "none", dry)
        if key in self.state.decided:
            return None
        self.state.decided.add(key, persist=False)  # ignoring changes nothing worth persisting
        return self._record(
            alert,
            node=node,
            action="none",
            rule=rule.name if rule else None,
            dry_run=dry,
            outcome="ignored",
            reason=reason,
        )

    def _defer(self, key: tuple[Any, ...], alert: Alert, fields: dict[str, Any]) -> DecisionRecord | None:
        """Remember a deferred action; a new record only when it is new or another gate holds it."""
        pending = self.pending.get(key)
        if pending is not None and pending.record.gate == fields["gate"]:
            pending.evaluations += 1
            pending.record = DecisionRecord(
                time=self._clock(),
                alertname=pending.record.alertname,
                fingerprint=pending.record.fingerprint,
                starts_at=pending.record.starts_at,
                status=pending.record.status,
                **fields,
            )
            self.pending.move_to_end(key)
            return None
        record = self._record(alert, **fields)
        first = pending.first_deferred if pending is not None else self._clock()
        evaluations = pending.evaluations + 1 if pending is not None else 1
        self.pending[key] = PendingAction(record=record, first_deferred=first, evaluations=evaluations)
        self.pending.move_to_end(key)
        while len(self.pending) > MAX_PENDING:
            _, oldest = self.pending.popitem(last=False)
            logger.warning("forgetting the oldest deferred action (%s)", oldest.record.log_line())
        return record

    def _done(
        self, ctx: Context, text: str, *, would: str, details: Mapping[str, Any] | None = None
    ) -> ActionResult:
        if ctx.dry_run:
            return ActionResult("planned", would, details=details or {}, done=text)
        return ActionResult("done", text, details=details or {}, done=text)

    def _counts(self, ctx: Context) -> bool:
        """Does this decision change the gates? Real actions do, and every decision of a dry-run
        service (so that its decisions equal a live one's); a dry-run rule in a live service does not
        use up the real budget or rate limits."""
        return not ctx.dry_run or self.settings.dry_run

    @abstractmethod
    async def _run_actions(
        self, ctx: Context, actions: tuple[Action, ...], notes: list[str], *, start: int = 0
    ) -> list[DecisionRecord]:
        """Decide `actions` (from `start`) for the context's alert (remediator/engine/pipeline.py)."""
