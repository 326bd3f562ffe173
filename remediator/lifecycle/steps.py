"""One alert through the engine: its rule, its node, then each action in order through idempotency,
the gates and the action itself; deferred actions are remembered, decided ones never again.

Idempotency has two memories: the decisions of this process (`Decided`, in memory, bounded), and
the node's record (remediator/lifecycle/record.py), which outlives the process: a step the record says was
decided is never decided again, whichever replica decided it."""

from __future__ import annotations

import hashlib
import logging
import math
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

from remediator.actuators.aws import AwsActuator
from remediator.actuators.events import EventRecorder, NodeEvent
from remediator.actuators.evidence import EvidenceActuator
from remediator.actuators.nodes import NodeActuator
from remediator.audit import DecisionLog, DecisionRecord
from remediator.cluster import BackendUnavailable, DrainOutcome, NotLeader
from remediator.desired.firing import FiringSet
from remediator.gates.gates import Gates
from remediator.gates.safety import protected_reason
from remediator.intake.payload import Alert
from remediator.lifecycle.drains import DrainRunner, drain_end
from remediator.lifecycle.model import (
    MAX_PENDING,
    ActionResult,
    AlertPlan,
    Context,
    EngineSettings,
    Observed,
    PendingAction,
    RunningDrain,
    Waiter,
)
from remediator.lifecycle.record import episode_start
from remediator.lifecycle.view import NodeView
from remediator.policy import (
    DISRUPTIVE,
    TELEMETRY,
    Action,
    AddTaint,
    AwsReboot,
    AwsSetUnhealthy,
    CaptureEvidence,
    CloudWatchMetric,
    Cordon,
    Drain,
    Policy,
    RecordEvent,
    RemoveTaint,
    Rule,
    Selection,
    SetCondition,
    Uncordon,
)

logger = logging.getLogger("remediator.decisions")

Key = tuple[Any, ...]
"""An idempotency key: (fingerprint, startsAt in unix seconds, status, index, action, dry-run)."""


class Decided:
    """Idempotency keys decided by this process, as 64-bit digests, bounded (oldest forgotten first;
    the nodes' records keep what must outlive the process)."""

    def __init__(self, *, keep: int = 100_000) -> None:
        self._keys: OrderedDict[str, None] = OrderedDict()
        self._keep = keep

    @staticmethod
    def _digest(key: Hashable) -> str:
        return hashlib.blake2b(repr(key).encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()

    def __contains__(self, key: Hashable) -> bool:
        return self._digest(key) in self._keys

    def add(self, key: Hashable) -> None:
        digest = self._digest(key)
        self._keys[digest] = None
        self._keys.move_to_end(digest)
        while len(self._keys) > self._keep:
            self._keys.popitem(last=False)

    def first(self, key: Hashable) -> bool:
        """True the first time `key` is asked (and remembers it)."""
        if key in self:
            return False
        self.add(key)
        return True

    def __len__(self) -> int:
        return len(self._keys)


class Decisions:
    """The decision records: logged, kept for GET /actions, and told to listeners (metrics)."""

    def __init__(self, *, log: DecisionLog, clock: Callable[[], float]) -> None:
        self.log = log
        self._clock = clock
        self._listeners: list[Callable[[DecisionRecord], None]] = []

    def subscribe(self, listener: Callable[[DecisionRecord], None]) -> None:
        self._listeners.append(listener)

    def publish(self, record: DecisionRecord) -> None:
        self.log.append(record)
        for listener in self._listeners:
            listener(record)

    def record(self, alert: Alert, **fields: Any) -> DecisionRecord:
        record = DecisionRecord(
            time=self._clock(),
            alertname=alert.labels.get("alertname", ""),
            fingerprint=alert.fingerprint,
            starts_at=alert.starts_at,
            status="resolved" if alert.status == "resolved" else "firing",
            **fields,
        )
        logger.info("%s", record.log_line())
        self.publish(record)
        return record


OVERFLOW_LOG_SECONDS = 60.0
"""At most one log line this often for deferrals not remembered."""


class Reconciler:
    """Decides each alert's actions against the nodes as observed, through the parts it is handed."""

    def __init__(
        self,
        *,
        policy: Policy,
        settings: EngineSettings,
        view: NodeView,
        gates: Gates,
        firing: FiringSet,
        events: EventRecorder,
        nodes: NodeActuator,
        aws: AwsActuator,
        evidence: EvidenceActuator,
        drains: DrainRunner,
        decisions: Decisions,
        decided: Decided,
        clock: Callable[[], float],
    ) -> None:
        self.policy = policy
        self.settings = settings
        self._view = view
        self._gates = gates
        self._firing = firing
        self._events = events
        self._nodes = nodes
        self._aws = aws
        self._evidence = evidence
        self._drains = drains
        self._decisions = decisions
        self.decided = decided
        self._clock = clock
        self.pending: OrderedDict[Key, PendingAction] = OrderedDict()
        """Deferred actions by idempotency key, oldest first."""
        self.pending_overflow = 0
        """Deferrals not remembered because `MAX_PENDING` were (their alerts decide them again at the
        next delivery or read of Alertmanager)."""
        self._overflow_logged = -math.inf
        self.held: dict[str, dict[tuple[str, int, bool], tuple[Alert, Rule]]] = {}
        """node -> (fingerprint, startsAt, dry-run) -> a resolved alert whose reversals are held back
        by other causes still firing; released when the last cause resolves."""
        self.suppressed: dict[str, str] = {}
        """fingerprint -> why, for alerts Alertmanager last showed silenced or inhibited."""
        drains.on_end = self.drain_ended

    # -- records ---------------------------------------------------------------------------------

    def _ignore(
        self, alert: Alert, *, node: str | None, rule: Rule | None, reason: str
    ) -> DecisionRecord | None:
        dry = self.settings.dry_run or (rule is not None and rule.dry_run)
        key = (alert.fingerprint, episode_start(alert.starts_at), alert.status, "none", dry)
        if not self.decided.first(key):
            return None
        return self._decisions.record(
            alert,
            node=node,
            action="none",
            rule=rule.name if rule else None,
            dry_run=dry,
            outcome="ignored",
            reason=reason,
        )

    def _defer(self, key: Key, alert: Alert, fields: dict[str, Any]) -> DecisionRecord | None:
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
        if pending is None and len(self.pending) >= MAX_PENDING:
            # Full: the deferral is not remembered (no record, no log line each time). Forgetting the
            # oldest instead would, with more deferred actions than room and every read of
            # Alertmanager deferring them again in the same order, forget each one just before it
            # comes round again: a new record and a log line for every action of every read.
            self.pending_overflow += 1
            now = self._clock()
            if now - self._overflow_logged >= OVERFLOW_LOG_SECONDS:
                self._overflow_logged = now
                logger.warning(
                    "%d deferred actions remembered, the most kept: %s is not (nor others, %d so far; "
                    "their alerts decide them again when next delivered or read)",
                    len(self.pending),
                    fields.get("action", "an action"),
                    self.pending_overflow,
                )
            return None
        record = self._decisions.record(alert, **fields)
        first = pending.first_deferred if pending is not None else self._clock()
        evaluations = pending.evaluations + 1 if pending is not None else 1
        self.pending[key] = PendingAction(record=record, first_deferred=first, evaluations=evaluations)
        self.pending.move_to_end(key)
        return record

    # -- one alert -------------------------------------------------------------------------------

    async def select(self, alert: Alert, node_name: str) -> Selection:
        """The rule for an alert on `node_name`: a resolve gets the rule its alert fired under (the
        node may be gone or relabelled since); node selectors look at the node as observed."""
        if alert.status == "resolved":
            fired = [c for c in self._firing.causes(node_name) if c.fingerprint == alert.fingerprint]
            rule = self.policy.rule(fired[0].rule) if fired else None
            if rule is not None:
                return Selection(rule)
        elif node_name and (cause := self._firing.known(node_name, alert.fingerprint)) is not None:
            # An episode keeps the rule it fired under (also one rebuilt from the node's record,
            # whose alert carries no other label than its name and node).
            rule = self.policy.rule(cause.rule)
            if rule is not None and episode_start(cause.starts_at) == episode_start(alert.starts_at):
                return Selection(rule)
        if not node_name or not self.policy.selects_nodes:
            return Selection(self.policy.first_match(alert.labels))
        node = await self._view.get(node_name)
        return self.policy.select(alert.labels, node, node_name=node_name)

    def suppressed_plan(self, alert: Alert, rule: Rule | None) -> AlertPlan:
        """A silenced or inhibited alert: recorded once, nothing done, nothing undone."""
        node = alert.labels.get(self.settings.node_label) or None
        why = self.suppressed.get(alert.fingerprint, "suppressed in Alertmanager")
        rec = self._ignore(
            alert, node=node, rule=rule, reason=f"{why}: no action, and what it holds stays held"
        )
        return AlertPlan(alert, node, rule, (why,), (rec,) if rec else ())

    def _drop_pending_of_resolved(self, alert: Alert) -> list[DecisionRecord]:
        """A resolved alert's deferred firing actions will never run: say so, once each."""
        start = episode_start(alert.starts_at)
        records = []
        mine = [k for k in self.pending if k[0] == alert.fingerprint and k[1] == start and k[2] == "firing"]
        for key in mine:
            pending = self.pending.pop(key)
            old = pending.record
            records.append(
                self._decisions.record(
                    alert,
                    node=old.node,
                    action=old.action,
                    rule=old.rule,
                    dry_run=old.dry_run,
                    outcome="skipped",
                    reason=(
                        f"alert resolved while the action was deferred by gate {old.gate} "
                        f"({pending.evaluations} evaluation(s)); not run"
                    ),
                    gate=old.gate,
                )
            )
        return records

    async def handle_alert(self, item: Observed) -> AlertPlan:
        alert, node_name, rule = item.alert, item.node_name, item.rule
        label = self.settings.node_label
        resolved = alert.status == "resolved"
        dropped = self._drop_pending_of_resolved(alert) if resolved else []
        if resolved:
            self._resolve_waiters(alert)
        if not node_name:
            rec = self._ignore(
                alert, node=None, rule=None, reason=f"alert has no {label!r} label; nothing to act on"
            )
            return AlertPlan(alert, None, None, (f"no {label!r} label",), (rec,) if rec else ())
        if rule is None:
            why = "; ".join(("no policy rule matches this alert", *item.passed_over))
            rec = self._ignore(alert, node=node_name, rule=None, reason=why)
            return AlertPlan(
                alert,
                node_name,
                None,
                ("no rule matched", *item.passed_over),
                (*dropped, *([rec] if rec else [])),
            )
        notes: list[str] = list(item.passed_over)
        matched = ", ".join(str(m) for m in rule.matchers) or "(matches every alert)"
        matched += f"; nodes {rule.nodes}" if rule.nodes is not None else ""
        notes.append(f"rule {rule.name!r} (rules[{rule.index}]) matched: {matched}")
        if resolved:
            self._close_episode(alert, rule)
        actions = rule.on_resolved if resolved else rule.actions
        if not actions:
            why = (
                f"alert resolved; rule {rule.name!r} has no on_resolved actions"
                if resolved
                else f"rule {rule.name!r} has no actions"
            )
            rec = self._ignore(alert, node=node_name, rule=rule, reason=why)
            return AlertPlan(alert, node_name, rule, (*notes, why), (*dropped, *([rec] if rec else [])))
        if resolved:
            notes.append("alert resolved: only on_resolved actions (never destructive) run")
        elif alert.fingerprint in self.suppressed:
            return self.suppressed_plan(alert, rule)
        node = await self._view.get(node_name)
        protected = protected_reason(node, self.policy.safety) if node is not None else None
        notes.append(f"protected-node check: {protected or ('node not found' if node is None else 'passed')}")
        dry_run = self.settings.dry_run or rule.dry_run
        if dry_run:
            notes.append(
                "dry-run: "
                + ("service-wide" if self.settings.dry_run else f"rule {rule.name!r} has dry_run: true")
            )
        pause = self._gates.pause
        notes.append(f"pause: {'PAUSED (' + pause.reason + ')' if pause.paused else 'off'}")
        if not resolved:
            notes.append(self._gates.breaker.describe())
        ctx = self.context(alert, node_name, node, rule, dry_run=dry_run)
        records = [*dropped, *await self.run_actions(ctx, actions, notes)]
        budget = self._gates.budget
        notes.append(f"budget: {budget.in_use} of {budget.capacity} nodes disrupted by accel-health")
        if rule.name in self._gates.scoped:
            notes.append(self._gates.scoped.describe(rule.name, budget.holders()))
        return AlertPlan(alert, node_name, rule, tuple(notes), tuple(records))

    def _close_episode(self, alert: Alert, rule: Rule) -> None:
        """A resolved episode is over: its firing steps count as decided in this process, whoever
        decided them. The node's record, which said which were, goes with the reversal; without
        this a view of Alertmanager read before the resolve and reconciled after it (or a late
        delivery) made a new leader cordon, taint and call AWS again for an episode that ended."""
        dry_run = self.settings.dry_run or rule.dry_run
        start = episode_start(alert.starts_at)
        for running in self._drains.running.values():
            if any(w.resolved is alert for w in running.waiters.values()):
                return  # its drain decides the steps after it when it ends (_resolve_waiters)
        for index, action in enumerate(rule.actions):
            self.decided.add((alert.fingerprint, start, "firing", index, action.type, dry_run))

    def context(
        self, alert: Alert, node_name: str, node: Any, rule: Rule, *, dry_run: bool, **extra: Any
    ) -> Context:
        """The context an alert's actions are decided in, with what the node's record says."""
        ctx = Context(
            alert=alert,
            node_name=node_name,
            node=node,
            rule=rule,
            dry_run=dry_run,
            protected=protected_reason(node, self.policy.safety) if node is not None else None,
            **extra,
        )
        if node is not None and not dry_run:
            firing = {c.fingerprint for c in self._firing.causes(node_name)}
            recorded_episodes = self._view.record(node).episodes.values()
            ctx.ended = frozenset(
                (e.fingerprint, e.start) for e in recorded_episodes if e.fingerprint not in firing
            )
        if alert.status == "firing":
            recorded = self._view.steps(node, rule, alert.fingerprint, ctx.start)
            ctx.intent = 0 if dry_run else recorded.intent
            memory = 0
            for index, action in enumerate(rule.actions):
                if self._key(ctx, index, action) in self.decided:
                    memory |= 1 << index
            ctx.steps = memory | (0 if dry_run else recorded.decided)
        return ctx

    @staticmethod
    def _key(ctx: Context, index: int, action: Action) -> Key:
        alert = ctx.alert
        return (alert.fingerprint, ctx.start, alert.status, index, action.type, ctx.dry_run)

    async def run_actions(
        self, ctx: Context, actions: tuple[Action, ...], notes: list[str], *, start: int = 0
    ) -> list[DecisionRecord]:
        """Decide `actions` (from `start`) for the context's alert."""
        alert, node_name, rule, dry_run = ctx.alert, ctx.node_name, ctx.rule, ctx.dry_run
        firing = alert.status == "firing"
        records: list[DecisionRecord] = []
        for index, action in enumerate(actions):
            if index < start:
                continue
            key = self._key(ctx, index, action)
            if key in self.decided or (firing and ctx.steps >> index & 1):
                notes.append(f"{action.type}: already decided for this alert (idempotency)")
                continue
            running = self._drains.running.get(node_name)
            if running is not None and key in running.waiters:
                notes.append(
                    f"{action.type}: running in the background since {running.as_json()['since']}; "
                    "the actions after it are decided when it ends"
                )
                break
            ctx.index = index
            held = self._gates.hold_everything(ctx) is not None
            seen = self._events.fault_seen(ctx, held=held)
            result = await self._decide_guarded(ctx, action)
            self._wait_on_drain(ctx, key, result)
            if result.gate:
                notes.append(f"{action.type}: gate {result.gate}: {result.reason}")
            if action.type in DISRUPTIVE and result.outcome in ("deferred", "failed"):
                ctx.incomplete = ctx.incomplete or action.type
            if action.type == "drain" and result.outcome == "failed":  # planned refusal (dry-run), error
                ctx.refused = ctx.refused or f"the drain failed ({result.reason})"
            act = self._events.action_event(ctx, action.type, result)
            events = await self._events.announce(ctx, self._events.combine(seen, act))
            details = (
                {**result.details, "events": [e.as_json() for e in events]} if events else result.details
            )
            fields: dict[str, Any] = {
                "node": node_name,
                "action": action.type,
                "rule": rule.name,
                "dry_run": dry_run,
                "outcome": result.outcome,
                "reason": result.reason,
                "gate": result.gate,
                "details": details,
            }
            if result.outcome == "deferred":
                if result.gate == "hold":
                    self.held.setdefault(node_name, {}).setdefault(
                        (alert.fingerprint, ctx.start, dry_run), (alert, rule)
                    )
                rec = self._defer(key, alert, fields)
                if rec is not None:
                    records.append(rec)
                continue
            if result.outcome == "started":  # decided when the drain ends, with the actions after it
                self.pending.pop(key, None)
                records.append(self._decisions.record(alert, **fields))
                notes.append(f"{action.type}: the actions after it are decided when it ends")
                break
            self.pending.pop(key, None)
            self.decided.add(key)
            if firing:
                ctx.steps |= 1 << index
            records.append(self._decisions.record(alert, **fields))
        return records

    def _wait_on_drain(self, ctx: Context, key: Key, result: ActionResult) -> None:
        """A drain started or joined: the alert waits on it from now, before the Event of its start
        is written, so that a drain that ends meanwhile records its end for this alert too
        (DrainRunner._ended) and decides the actions after it."""
        if result.outcome == "started":
            self._drains.running[ctx.node_name].waiters[key] = Waiter(
                key=key, alert=ctx.alert, rule=ctx.rule, index=ctx.index, steps=ctx.steps
            )

    async def _decide_guarded(self, ctx: Context, action: Action) -> ActionResult:
        """`_decide`, with the errors that retrying will not fix recorded as failed; what the gates
        counted for an action that did not commit is given back."""
        try:
            return await self._decide(ctx, action)
        except BackendUnavailable as exc:
            if action.type in TELEMETRY and not isinstance(exc, NotLeader):
                # Telemetry never blocks or fails a safety step: recorded, and the next step runs.
                logger.warning("%s on %s not done: %s; the next step runs", action.type, ctx.node_name, exc)
                return ActionResult("failed", f"{exc}; not retried: the next step runs")
            if not ctx.background:
                raise  # the webhook answers 503 and Alertmanager redelivers
            logger.warning("%s on %s after its drain: %s", action.type, ctx.node_name, exc)
            why = f"backend unavailable ({exc}); retried when Alertmanager resends"
            return ActionResult("deferred", why, gate="unavailable")
        except Exception as exc:  # a bug or an executor error that retrying will not fix: recorded
            logger.exception("%s on %s failed", action.type, ctx.node_name)
            return ActionResult("failed", f"{type(exc).__name__}: {exc}")
        finally:
            self._gates.release(ctx.node_name)

    async def _decide(self, ctx: Context, action: Action) -> ActionResult:  # noqa: PLR0911  one per action type
        if (early := self._gates.precheck(ctx, action)) is not None:
            return early
        node = ctx.node
        assert node is not None  # precheck skipped a missing node
        match action:
            case Cordon():
                return await self._nodes.cordon(ctx, node)
            case AddTaint():
                return await self._nodes.taint(ctx, node, action)
            case Drain():
                return await self._drains.start(ctx, node, action)
            case SetCondition():
                return await self._nodes.condition(ctx, node, action)
            case RecordEvent():
                return await self._nodes.event(ctx)
            case AwsSetUnhealthy():
                return await self._aws.unhealthy(ctx, node, handover=action.handover_condition)
            case AwsReboot():
                return await self._aws.reboot(ctx, node, action)
            case CloudWatchMetric():
                return await self._aws.metric(ctx, node, action)
            case CaptureEvidence():
                return await self._evidence.capture(ctx, node, action)
            case Uncordon():
                return await self._nodes.uncordon(ctx, node)
            case RemoveTaint():
                return await self._nodes.untaint(ctx, node, action)

    # -- reversals held by other causes ------------------------------------------------------------

    async def release_held(self, nodes: set[str]) -> None:
        """Decide again the reversals held back on these nodes: a hold no cause asks for any more
        is released now (the last cause resolved, or expired without a delivery)."""
        for name in sorted(nodes & set(self.held)):
            held = self.held.pop(name)
            node = await self._view.get(name)
            for (_, _, dry_run), (alert, rule) in held.items():
                ctx = self.context(alert, name, node, rule, dry_run=dry_run)
                await self.run_actions(ctx, rule.on_resolved, [])  # decided ones are skipped

    # -- drains ending -----------------------------------------------------------------------------

    async def drain_ended(
        self, running: RunningDrain, outcome: DrainOutcome | None, error: str, final: bool
    ) -> None:
        """Record how the drain ended for each alert waiting on it, then decide their later actions."""
        for waiter in list(running.waiters.values()):
            await self._waiter_ended(running, waiter, outcome, error, final=final)

    async def _waiter_ended(
        self, running: RunningDrain, waiter: Waiter, outcome: DrainOutcome | None, error: str, *, final: bool
    ) -> None:
        action = waiter.rule.actions[waiter.index]
        proceed = isinstance(action, Drain) and action.on_timeout == "proceed"
        result, reason, refused, details = drain_end(
            outcome, error, final=final, proceed=proceed, stopped=running.stopped
        )
        if final:
            self.decided.add(waiter.key)
            events: list[NodeEvent] = await self._events.drain_end(running.node, waiter, result, reason)
            if events:
                details = {**details, "events": [e.as_json() for e in events]}
        self._decisions.record(
            waiter.resolved or waiter.alert,
            node=running.node,
            action="drain",
            rule=waiter.rule.name,
            dry_run=False,
            outcome=result,
            reason=reason,
            details=details,
        )
        if not final:
            return
        if waiter.resolved is not None or running.stopped:
            self._skip_after(running.node, waiter, why=running.stopped)
            return
        if waiter.index + 1 >= len(waiter.rule.actions):
            return
        try:
            node = await self._view.get(running.node)
        except BackendUnavailable as exc:
            logger.warning(
                "%s: the actions after the drain are decided with the next delivery (%s)", running.node, exc
            )
            return
        ctx = self.context(
            waiter.alert, running.node, node, waiter.rule, dry_run=False, refused=refused, background=True
        )
        ctx.steps |= 1 << waiter.index
        await self.run_actions(ctx, waiter.rule.actions, [], start=waiter.index + 1)

    def _skip_after(self, node: str, waiter: Waiter, *, why: str = "") -> None:
        """The actions after the drain will not run: the alert resolved while it ran, or (`why`) the
        drain was stopped."""
        alert = waiter.alert
        start = episode_start(alert.starts_at)
        for index, action in enumerate(waiter.rule.actions):
            if index <= waiter.index:
                continue
            key = (alert.fingerprint, start, alert.status, index, action.type, False)
            if key in self.decided:
                continue
            self.pending.pop(key, None)
            self.decided.add(key)
            self._decisions.record(
                waiter.resolved or alert,
                node=node,
                action=action.type,
                rule=waiter.rule.name,
                dry_run=False,
                outcome="skipped",
                reason=f"the drain was stopped ({why}); not run"
                if why
                else "alert resolved while the drain ran; not run",
            )

    def _resolve_waiters(self, alert: Alert) -> None:
        """The alert resolved while its drain runs: the drain finishes, the later actions will not run."""
        episode = (alert.fingerprint, episode_start(alert.starts_at))
        for running in self._drains.running.values():
            for waiter in running.waiters.values():
                same = (waiter.alert.fingerprint, episode_start(waiter.alert.starts_at)) == episode
                if same and waiter.resolved is None:
                    waiter.resolved = alert
                    logger.info(
                        "%s: alert %s resolved while its drain runs; the drain finishes, the later "
                        "actions will not run",
                        running.node,
                        alert.fingerprint,
                    )
