"""The decision engine: alerts in, decision records out, actions through the Cluster/Aws seams.

A delivery is handled in two passes. First every alert is observed: the node it names (label
configurable) and the first matching policy rule; firing alerts that would act feed the storm breaker,
resolved ones leave it, and the breaker is evaluated against the eligible nodes. Then each alert's
actions run in order (`on_resolved` ones when the alert resolved), each through, in this order:

1. idempotency: (fingerprint, startsAt, status, action, dry-run) already decided -> nothing new;
2. protected nodes (control plane, opt-out label) and nodes that do not exist -> skipped;
3. the pause switch, then (firing alerts only) the storm breaker -> deferred;
4. ordering: a disruptive action waits while an earlier one of the same alert is incomplete;
5. the target's own state (already cordoned? taint present? cordoned by us and untouched since?);
6. rate limits per action kind, then the disruption budget (disruptive actions only) -> deferred.

A deferred action is not decided: it is listed in `pending` (GET /state, a gauge) and decided again
on the next delivery of the alert.

A live drain runs in the background (`Cluster.drain` may take as long as the policy's timeout, far
longer than Alertmanager waits for a webhook answer): one task per node, owned by the engine. Its
start is recorded as `started`, its end as `done` (every pod gone) or `failed` (deadline passed,
refused, or interrupted), and when it ends the alert's later actions (e.g. aws_set_unhealthy) are
decided at once, through the same gates, without waiting for a resend. A resend, or another alert
for the same node, joins the running drain instead of starting a second one. A drain that ended
because the deadline passed counts as ended (the later actions run); a drain refused because pods
need permission (bare pods, emptyDir data) does not: its later disruptive actions are skipped and a
human decides. An alert that resolves while its drain runs lets the drain finish (a drain is never
reversed) and its later actions are skipped. A drain interrupted by the backend (unreachable, not the
leader) or by shutdown is not decided: the next delivery starts it again, and the executor resumes
it with its original deadline. Dry-run takes exactly the same path and changes nothing: no call
that mutates the cluster or AWS, no gate-state write. Gate state lives in the cluster (see
remediator/state.py): read at `start()`, written after each delivery that changed it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from remediator.alertmanager import AlertmanagerView
from remediator.audit import DecisionLog, DecisionRecord, Outcome
from remediator.cluster import (
    Aws,
    BackendUnavailable,
    Cluster,
    DrainOutcome,
    DrainSettings,
    Node,
    NodeCondition,
    Taint,
    instance_id_from_provider_id,
)
from remediator.drain import plan_drain
from remediator.payload import Alert, PayloadError, WebhookPayload, parse_payload
from remediator.policy import (
    DISRUPTIVE,
    Action,
    AddTaint,
    AwsReboot,
    AwsSetUnhealthy,
    CloudWatchMetric,
    Cordon,
    Drain,
    Policy,
    RecordEvent,
    RemoveTaint,
    Rule,
    SetCondition,
    Uncordon,
)
from remediator.repair import karpenter_managed, reboot_step, rebooted_annotation
from remediator.safety import DisruptionBudget, Verdict, eligible, protected_reason
from remediator.state import GateState, StateError
from remediator.statestore import StateStore

logger = logging.getLogger("remediator.decisions")

MAX_PENDING = 10_000
"""Deferred actions remembered at most (oldest forgotten first, with a log line)."""


@dataclass(frozen=True)
class EngineSettings:
    """Service-wide settings of the engine."""

    dry_run: bool = False
    """Plan only: decisions are recorded with dry_run=true; the cluster and AWS are never changed and
    the gate state is read but never written."""
    node_label: str = "node"
    """The alert label that names the Kubernetes node."""
    drain: DrainSettings = field(default_factory=DrainSettings)
    """How drains evict (concurrency, backoff, polling). The policy's drain action sets the timeout,
    the grace period and the permissions; those fields here are replaced by the action's."""


@dataclass(frozen=True)
class _Result:
    outcome: Outcome
    reason: str
    gate: str | None = None
    details: Mapping[str, Any] = field(default_factory=dict)
    done: str = ""  # what was (or, in dry-run, would have been) done, in the words of a live run


@dataclass(frozen=True)
class NodeEvent:
    """A core/v1 Event about a node (written unless dry-run; listed in the decision record)."""

    type: str
    """Normal or Warning."""
    reason: str
    """CamelCase, e.g. AccelCordoned."""
    message: str
    """What happened, in words."""

    def as_json(self) -> dict[str, str]:
        return {"type": self.type, "reason": self.reason, "message": self.message}


_DONE_REASONS = {
    "condition": "AccelConditionSet",
    "cordon": "AccelCordoned",
    "taint": "AccelTainted",
    "drain": "AccelDrainFinished",
    "aws_set_unhealthy": "AccelInstanceMarkedUnhealthy",
    "aws_reboot": "AccelInstanceRebooted",
    "uncordon": "AccelUncordoned",
    "untaint": "AccelUntainted",
}
"""Event reason of each node action done (cloudwatch_metric changes no node; `event` is one)."""
_HOLD_EVERYTHING = frozenset({"pause", "breaker"})
FAILURE_REASONS = frozenset({"AccelDrainBlocked", "AccelActionFailed"})
"""The Events `events: failures` keeps."""


def action_event(action: str, outcome: Outcome, text: str, *, alertname: str) -> NodeEvent | None:
    """The Event that tells of one decided node action, or None (skipped, deferred, not a node action)."""
    if action not in _DONE_REASONS:
        return None
    suffix = f" (alert {alertname})"
    if outcome == "failed":
        if action == "drain":
            return NodeEvent("Warning", "AccelDrainBlocked", text + suffix)
        return NodeEvent("Warning", "AccelActionFailed", f"{action} failed: {text}{suffix}")
    if outcome == "started" or (action == "drain" and outcome == "planned"):
        return NodeEvent("Normal", "AccelDrainStarted", "drain started: " + text + suffix)
    if outcome in ("done", "planned"):
        return NodeEvent("Normal", _DONE_REASONS[action], text + suffix)
    return None


@dataclass(frozen=True)
class AlertPlan:
    """What the engine made of one alert (for `explain` and tests)."""

    alert: Alert
    """The alert."""
    node: str | None
    """The node it names."""
    rule: Rule | None
    """The rule that matched."""
    notes: tuple[str, ...]
    """Which checks and gates applied, in words."""
    records: tuple[DecisionRecord, ...]
    """New decision records (empty when everything was already decided)."""


@dataclass
class PendingAction:
    """A deferred action waiting for the next delivery of its alert."""

    record: DecisionRecord
    """The latest deferral record."""
    first_deferred: float
    """Clock time of the first deferral."""
    evaluations: int = 1
    """How many deliveries deferred it."""

    def as_json(self) -> dict[str, Any]:
        return {
            **self.record.as_json(),
            "first_deferred": self.first_deferred,
            "evaluations": self.evaluations,
        }


@dataclass(frozen=True)
class GateStatus:
    """The gates at a glance (GET /state, /metrics)."""

    paused: bool
    """The pause switch."""
    pause_reason: str
    """Why it is paused."""
    breaker_open: bool
    """The storm breaker."""
    breaker_trips: int
    """How often it opened (persisted)."""
    breaker: str
    """The breaker in words."""
    alerting_nodes: int
    """Eligible nodes with a fault firing now."""
    eligible_nodes: int
    """Nodes that may be acted on (last count)."""
    budget_in_use: int
    """Eligible nodes out of service now: held by this service, or unschedulable / NotReady."""
    budget_capacity: int
    """The effective budget."""
    budget_holders: Mapping[str, Mapping[str, Any]]
    """Node -> since, kinds, dry_run."""
    rate_limits: Mapping[str, int]
    """Action kind -> actions counted in the current window."""
    deferred: Mapping[str, int]
    """Gate -> deferred actions waiting now."""
    drains: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """Node -> the drain running now in the background (since, deadline, alerts)."""
    api_unavailable: Mapping[str, int] = field(default_factory=dict)
    """Optional Kubernetes API -> how often the backend found it not served (404)."""
    budget_others: Mapping[str, str] = field(default_factory=dict)
    """Eligible nodes out of service for other reasons (node -> unschedulable or NotReady)."""
    firing: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """Node -> fingerprint -> the alert firing now (the desired state)."""

    def as_json(self) -> dict[str, Any]:
        return {
            "paused": self.paused,
            "pause_reason": self.pause_reason,
            "breaker": {
                "open": self.breaker_open,
                "trips": self.breaker_trips,
                "alerting_nodes": self.alerting_nodes,
                "eligible_nodes": self.eligible_nodes,
                "description": self.breaker,
            },
            "budget": {
                "in_use": self.budget_in_use,
                "capacity": self.budget_capacity,
                "holders": {k: dict(v) for k, v in self.budget_holders.items()},
                "others": dict(self.budget_others),
            },
            "firing": {k: dict(v) for k, v in self.firing.items()},
            "rate_limits": dict(self.rate_limits),
            "deferred": dict(self.deferred),
            "drains": {k: dict(v) for k, v in self.drains.items()},
            "api_unavailable": dict(self.api_unavailable),
        }


@dataclass
class _Context:
    alert: Alert
    node_name: str
    node: Node | None
    rule: Rule
    dry_run: bool
    protected: str | None
    incomplete: str | None = None  # the earlier disruptive action that did not complete
    refused: str | None = None  # why an earlier drain was refused: later disruptive actions are skipped
    background: bool = False  # decided when a drain ended, not in a webhook request


@dataclass
class _Waiter:
    """An alert whose drain action is the drain running on its node."""

    key: tuple[Any, ...]
    """The drain action's idempotency key."""
    alert: Alert
    """The firing alert (its later actions are decided for it)."""
    rule: Rule
    """The rule that matched it."""
    index: int
    """The drain action's index in the rule's actions."""
    resolved: Alert | None = None
    """The resolved alert, when it resolved while the drain ran."""


@dataclass
class _RunningDrain:
    """A drain running in the background, and the alerts waiting for it to end."""

    node: str
    since: float
    settings: DrainSettings
    waiters: dict[tuple[Any, ...], _Waiter] = field(default_factory=dict)
    task: asyncio.Task[None] | None = None
    ended: bool = False  # Cluster.drain returned (or raised): only the bookkeeping is left

    def as_json(self) -> dict[str, Any]:
        return {
            "since": datetime.fromtimestamp(self.since, tz=UTC).isoformat(timespec="seconds"),
            "timeout_seconds": self.settings.timeout_seconds,
            "alerts": [
                {
                    "alertname": w.alert.labels.get("alertname", ""),
                    "fingerprint": w.alert.fingerprint,
                    "resolved": w.resolved is not None,
                }
                for w in self.waiters.values()
            ],
        }


@dataclass(frozen=True)
class _Observed:
    alert: Alert
    node_name: str
    rule: Rule | None


class Engine:
    """Turns webhook deliveries into decisions and actions. One per service; not thread-safe."""

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
        self._held: dict[str, dict[tuple[Any, ...], tuple[Alert, Rule]]] = {}
        # node -> reversals of resolved alerts held back by other causes still firing
        self._reconciled = False  # budget reconciled during the current delivery
        self._drains: dict[str, _RunningDrain] = {}
        self._resume: dict[str, list[Alert]] = {}  # drains a previous leader left running
        self._tasks: set[asyncio.Task[None]] = set()  # drains, and the bookkeeping after each
        self._stopping = False
        self.suppressed: dict[str, str] = {}
        """fingerprint -> why, for alerts Alertmanager last showed silenced or inhibited."""

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

    # -- lifecycle and state -----------------------------------------------------------------

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

    async def sync(self) -> None:
        """Read the gate state now if it needs reading (a new leader does this before it is ready),
        then resume the drains a previous leader left running: Alertmanager will not resend their
        alerts for a repeat_interval. A resumed drain keeps its deadline (node annotations) and evicts
        only what is still there; the actions before it are already decided (idempotency keys)."""
        async with self._lock:
            await self._load()
            resume = {n: a for n, a in self._resume.items() if n not in self._drains}
            self._resume = {}
        for node, alerts in resume.items():
            logger.warning("resuming the drain of %s left running by the previous leader", node)
            await self.handle(_resume_payload(alerts))

    async def _load(self) -> None:
        if self._store.loaded:
            return
        loaded = self._store.loaded
        self.state = await self._store.load(self.state)
        self._dirty = False
        if not loaded and not self.settings.dry_run:
            try:
                self._resume = _running_drains(self.state.drains)
            except StateError as exc:
                logger.error(
                    "stored drains unusable (%s); the next delivery of their alerts resumes them", exc
                )
                self._resume = {}

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

    async def drained(self) -> None:
        """Wait until no drain runs in the background and the actions after each were decided."""
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def stop(self) -> None:
        """Cancel the drains running in the background (service shutdown); idempotent.

        A cancelled drain is not decided: Alertmanager's next delivery (to this service again or to
        the next leader) starts it again, and the executor resumes it with its original deadline.
        A drain that already ended still records its end and decides the actions after it.
        """
        self._stopping = True
        for drain in self._drains.values():
            if drain.task is not None and not drain.ended:
                drain.task.cancel()
        await self.drained()

    def status(self) -> GateStatus:
        """The gates now (evaluates the breaker on the clock, so a scrape sees it close)."""
        st = self.state
        if st.breaker.evaluate(alerting=self._alerting_nodes()):
            self._dirty = True
        deferred: dict[str, int] = {}
        for pending in self.pending.values():
            gate = pending.record.gate or "unknown"
            deferred[gate] = deferred.get(gate, 0) + 1
        return GateStatus(
            paused=st.pause.paused,
            pause_reason=st.pause.reason,
            breaker_open=st.breaker.open,
            breaker_trips=st.breaker.trips,
            breaker=st.breaker.describe(),
            alerting_nodes=st.breaker.alerting,
            eligible_nodes=st.breaker.eligible,
            budget_in_use=st.budget.in_use,
            budget_capacity=st.budget.capacity,
            budget_holders={
                n: {"since": h.since, "kinds": sorted(h.kinds), "dry_run": h.dry_run}
                for n, h in st.budget.holders().items()
            },
            budget_others=dict(st.budget.others),
            firing=st.firing.as_json(),
            rate_limits=st.rate.usage(),
            deferred=deferred,
            drains={name: running.as_json() for name, running in self._drains.items()},
            # Only the Kubernetes executor has optional APIs; the Cluster seam does not require it.
            api_unavailable=dict(getattr(self._cluster, "api_unavailable", {})),
        )

    # -- deliveries --------------------------------------------------------------------------

    async def handle(self, payload: WebhookPayload) -> list[AlertPlan]:
        """Decide (and act) on every alert of a delivery, one delivery at a time."""
        async with self._lock:
            await self._load()
            self._reconciled = False
            try:
                observed = await self._observe(payload)
                plans = [await self._handle_alert(o) for o in observed]
                await self._release_held({o.node_name for o in observed if o.alert.status == "resolved"})
                return plans
            finally:
                await self._save()

    async def reconcile(self, view: AlertmanagerView) -> list[AlertPlan]:
        """Converge on what Alertmanager shows now (remediator/alertmanager.py): decide the alerts
        active there, keep (without acting) those silenced or inhibited, and resolve those this
        service knew firing that no Alertmanager shows any more."""
        async with self._lock:
            await self._load()
            label = self.settings.node_label
            self.suppressed = {fp: s.suppressed for fp, s in view.alerts.items() if s.suppressed}
            firing = self.state.firing
            active = [s.alert for s in view.alerts.values() if not s.suppressed]
            quiet: list[Alert] = []
            for shown in view.alerts.values():
                if shown.suppressed:
                    node = shown.alert.labels.get(label, "")
                    self._dirty = firing.touch(node, shown.alert.fingerprint) or self._dirty
                    quiet.append(shown.alert)
            resolved: list[Alert] = []
            orphans: set[str] = set()
            for node, cause in firing.all():
                if cause.fingerprint in view.alerts:
                    continue
                if cause.starts_at and cause.labels:
                    resolved.append(
                        _resolved_alert(cause.fingerprint, cause.labels, cause.starts_at, self._clock())
                    )
                else:  # stored before labels were kept: forget it, release what nothing else holds
                    firing.resolved(node, cause.fingerprint)
                    self._dirty = True
                    orphans.add(node)
            if orphans:
                await self._release_held(orphans)
        plans = [self._suppressed_plan(a) for a in quiet]
        if active or resolved:
            plans += await self.handle(_api_payload([*active, *resolved]))
        return plans

    def _suppressed_plan(self, alert: Alert) -> AlertPlan:
        """A silenced or inhibited alert: recorded once, nothing done, nothing undone."""
        node = alert.labels.get(self.settings.node_label) or None
        why = self.suppressed.get(alert.fingerprint, "suppressed in Alertmanager")
        rule = self._rule_for(alert)
        rec = self._ignore(
            alert, node=node, rule=rule, reason=f"{why}: no action, and what it holds stays held"
        )
        return AlertPlan(alert, node, rule, (why,), (rec,) if rec else ())

    async def _release_held(self, nodes: set[str]) -> None:
        """Decide again the reversals held back on these nodes: a hold no cause asks for any more
        is released now (the last cause resolved, or expired without a delivery)."""
        for name in sorted(nodes & set(self._held)):
            held = self._held.pop(name)
            node = await self._cluster.get_node(name)
            for key, (alert, rule) in held.items():
                if key in self.state.decided:
                    continue
                ctx = _Context(
                    alert=alert,
                    node_name=name,
                    node=node,
                    rule=rule,
                    dry_run=key[-1],
                    protected=protected_reason(node, self.policy.safety) if node is not None else None,
                )
                await self._run_actions(ctx, rule.on_resolved, [])

    def _rule_for(self, alert: Alert) -> Rule | None:
        return self.policy.first_match(alert.labels)

    async def _observe(self, payload: WebhookPayload) -> list[_Observed]:
        """Update the desired state (alerts firing now) from the delivery, then the observed state
        (eligible nodes, nodes out of service) and the breaker."""
        label = self.settings.node_label
        observed = []
        acting = False
        firing = self.state.firing
        for alert in payload.alerts:
            node_name = alert.labels.get(label, "")
            rule = self._rule_for(alert) if node_name else None
            observed.append(_Observed(alert=alert, node_name=node_name, rule=rule))
            if not node_name:
                continue
            if alert.status == "resolved":
                self._dirty = firing.resolved(node_name, alert.fingerprint) or self._dirty
            elif rule is not None and rule.actions:
                alertname = alert.labels.get("alertname", "")
                changed = firing.firing(  # a resend only moves the expiry: written now and then
                    node_name,
                    fingerprint=alert.fingerprint,
                    alertname=alertname,
                    rule=rule,
                    labels=alert.labels,
                    starts_at=alert.starts_at,
                )
                self._dirty = changed or self._dirty
                acting = True
        if acting:
            await self._observe_nodes()
        if self.state.breaker.evaluate(alerting=self._alerting_nodes()):
            self._dirty = True
        return observed

    async def _observe_nodes(self) -> None:
        """The eligible nodes and those already out of service, from the cluster as it is now."""
        nodes = await self._cluster.list_nodes()
        safety = self.policy.safety
        self._eligible = {n.name for n in nodes if eligible(n, safety)}
        self.state.budget.observe(nodes, safety)
        self.state.breaker.evaluate(eligible=len(self._eligible))

    def _alerting_nodes(self) -> int | None:
        """Eligible nodes with a fault firing now (what the breaker counts); None before the
        cluster was first observed."""
        if self._eligible is None:
            return None
        return len(self.state.firing.nodes(among=self._eligible))

    # -- per alert ---------------------------------------------------------------------------

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

    def _drop_pending_of_resolved(self, alert: Alert) -> list[DecisionRecord]:
        """A resolved alert's deferred firing actions will never run: say so, once each."""
        records = []
        mine = [
            k
            for k in self.pending
            if k[0] == alert.fingerprint and k[1] == alert.starts_at and k[2] == "firing"
        ]
        for key in mine:
            pending = self.pending.pop(key)
            old = pending.record
            records.append(
                self._record(
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

    def _resolve_waiters(self, alert: Alert) -> None:
        """The alert resolved while its drain runs: the drain finishes, the later actions will not run."""
        for running in self._drains.values():
            for waiter in running.waiters.values():
                same = (waiter.alert.fingerprint, waiter.alert.starts_at) == (
                    alert.fingerprint,
                    alert.starts_at,
                )
                if same and waiter.resolved is None:
                    waiter.resolved = alert
                    logger.info(
                        "%s: alert %s resolved while its drain runs; the drain finishes, the later "
                        "actions will not run",
                        running.node,
                        alert.fingerprint,
                    )

    async def _handle_alert(self, item: _Observed) -> AlertPlan:
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
            rec = self._ignore(alert, node=node_name, rule=None, reason="no policy rule matches this alert")
            return AlertPlan(
                alert, node_name, None, ("no rule matched",), (*dropped, *([rec] if rec else []))
            )
        notes: list[str] = []
        matched = ", ".join(str(m) for m in rule.matchers) or "(matches every alert)"
        notes.append(f"rule {rule.name!r} (rules[{rule.index}]) matched: {matched}")
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
            return self._suppressed_plan(alert)
        node = await self._cluster.get_node(node_name)
        protected = protected_reason(node, self.policy.safety) if node is not None else None
        notes.append(f"protected-node check: {protected or ('node not found' if node is None else 'passed')}")
        dry_run = self.settings.dry_run or rule.dry_run
        if dry_run:
            notes.append(
                "dry-run: "
                + ("service-wide" if self.settings.dry_run else f"rule {rule.name!r} has dry_run: true")
            )
        notes.append(
            f"pause: {'PAUSED (' + self.state.pause.reason + ')' if self.state.pause.paused else 'off'}"
        )
        if not resolved:
            notes.append(self.state.breaker.describe())
        ctx = _Context(
            alert=alert, node_name=node_name, node=node, rule=rule, dry_run=dry_run, protected=protected
        )
        records = [*dropped, *await self._run_actions(ctx, actions, notes)]
        notes.append(
            f"budget: {self.state.budget.in_use} of {self.state.budget.capacity} nodes disrupted by "
            "accel-health"
        )
        return AlertPlan(alert, node_name, rule, tuple(notes), tuple(records))

    async def _run_actions(
        self, ctx: _Context, actions: tuple[Action, ...], notes: list[str], *, start: int = 0
    ) -> list[DecisionRecord]:
        alert, node_name, rule, dry_run = ctx.alert, ctx.node_name, ctx.rule, ctx.dry_run
        records: list[DecisionRecord] = []
        for index, action in enumerate(actions):
            if index < start:
                continue
            key = (alert.fingerprint, alert.starts_at, alert.status, index, action.type, dry_run)
            if key in self.state.decided:
                notes.append(f"{action.type}: already decided for this alert (idempotency)")
                continue
            running = self._drains.get(node_name)
            if running is not None and key in running.waiters:
                notes.append(
                    f"{action.type}: running in the background since {running.as_json()['since']}; "
                    "the actions after it are decided when it ends"
                )
                break
            seen = await self._announce(ctx, self._fault_seen(ctx))
            result = await self._decide_guarded(ctx, action)
            if result.gate:
                notes.append(f"{action.type}: gate {result.gate}: {result.reason}")
            if action.type in DISRUPTIVE and result.outcome in ("deferred", "failed"):
                ctx.incomplete = ctx.incomplete or action.type
            if action.type == "drain" and result.outcome == "failed":  # planned refusal (dry-run), error
                ctx.refused = ctx.refused or f"the drain failed ({result.reason})"
            events = seen + await self._announce(ctx, self._action_event(ctx, action.type, result))
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
                    self._held.setdefault(node_name, {})[key] = (alert, rule)
                rec = self._defer(key, alert, fields)
                if rec is not None:
                    records.append(rec)
                continue
            if result.outcome == "started":  # decided when the drain ends, with the actions after it
                self._drains[node_name].waiters[key] = _Waiter(key=key, alert=alert, rule=rule, index=index)
                self.pending.pop(key, None)
                records.append(self._record(alert, **fields))
                notes.append(f"{action.type}: the actions after it are decided when it ends")
                break
            self.pending.pop(key, None)
            self.state.decided.add(key, persist=not dry_run)
            self._dirty = self._dirty or not dry_run
            records.append(self._record(alert, **fields))
        return records

    def _fault_seen(self, ctx: _Context) -> NodeEvent | None:
        """The Event that says the fault was seen: once per firing alert, with its first decision
        (`events: all` only; none on a protected or missing node, or while paused or in a storm)."""
        alert = ctx.alert
        if self.policy.events != "all" or alert.status != "firing" or ctx.node is None or ctx.protected:
            return None
        seen = (alert.fingerprint, alert.starts_at, alert.status, "fault-seen", ctx.dry_run)
        if seen in self.state.decided or self._gate_verdict(ctx) is not None:
            return None
        self.state.decided.add(seen, persist=not ctx.dry_run)
        self._dirty = self._dirty or not ctx.dry_run
        alertname = alert.labels.get("alertname", "AcceleratorFault")
        summary = alert.annotations.get("summary") or alert.annotations.get("description") or ""
        message = f"{alertname} firing" + (f": {summary}" if summary else "") + f" (rule {ctx.rule.name})"
        return NodeEvent("Warning", "AccelFaultDetected", message)

    def _action_event(self, ctx: _Context, action: str, result: _Result) -> NodeEvent | None:
        """The Event of a decided node action, as the policy's `events` setting wants it."""
        if ctx.node is None or ctx.protected or result.gate in _HOLD_EVERYTHING:
            return None
        alertname = ctx.alert.labels.get("alertname", "AcceleratorFault")
        event = action_event(action, result.outcome, result.done or result.reason, alertname=alertname)
        return event if event is not None and self._wanted(event) else None

    async def _announce(self, ctx: _Context, event: NodeEvent | None) -> list[NodeEvent]:
        """Write `event` on the context's node (not in dry-run); the events for the decision record."""
        if event is None:
            return []
        if not ctx.dry_run:
            await self._write_events(ctx.node_name, [event])
        return [event]

    def _wanted(self, event: NodeEvent) -> bool:
        mode = self.policy.events
        return mode == "all" or (mode == "failures" and event.reason in FAILURE_REASONS)

    async def _drain_end_events(
        self, node: str, waiter: _Waiter, outcome: Outcome, reason: str
    ) -> list[NodeEvent]:
        """Write the Event of a drain's end (finished, or blocked and by what); the ones written."""
        alert = waiter.resolved or waiter.alert
        event = action_event(
            "drain", outcome, reason, alertname=alert.labels.get("alertname", "AcceleratorFault")
        )
        if event is None or not self._wanted(event):
            return []
        await self._write_events(node, [event])
        return [event]

    async def _write_events(self, node: str, events: list[NodeEvent]) -> None:
        """Write Events; one that cannot be written is logged, never undoes or fails the action."""
        for event in events:
            try:
                await self._cluster.record_event(
                    node=node, reason=event.reason, message=event.message, type_=event.type
                )
            except BackendUnavailable as exc:
                logger.warning("%s: Event %s not written: %s", node, event.reason, exc)

    async def _decide_guarded(self, ctx: _Context, action: Action) -> _Result:
        """`_decide`, with the errors that retrying will not fix recorded as failed."""
        try:
            return await self._decide(ctx, action)
        except BackendUnavailable as exc:
            if not ctx.background:
                raise  # the webhook answers 503 and Alertmanager redelivers
            logger.warning("%s on %s after its drain: %s", action.type, ctx.node_name, exc)
            why = f"backend unavailable ({exc}); retried when Alertmanager resends"
            return _Result("deferred", why, gate="unavailable")
        except Exception as exc:  # a bug or an executor error that retrying will not fix: recorded
            logger.exception("%s on %s failed", action.type, ctx.node_name)
            return _Result("failed", f"{type(exc).__name__}: {exc}")

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

    # -- gates -------------------------------------------------------------------------------

    def _counts(self, ctx: _Context) -> bool:
        """Does this decision change the gates? Real actions do, and every decision of a dry-run
        service (so that its decisions equal a live one's); a dry-run rule in a live service does not
        use up the real budget or rate limits."""
        return not ctx.dry_run or self.settings.dry_run

    async def _gates(self, ctx: _Context, kind: str, node: str, *, rate: bool = True) -> _Result | None:
        """Rate limit (unless `rate` is false), then (disruptive actions) the budget; None when the
        action may go ahead."""
        verdict = self.state.rate.check(kind)
        if rate and not verdict.allowed:
            return _Result("deferred", verdict.reason, gate=verdict.gate)
        if kind in DISRUPTIVE:
            verdict = self.state.budget.check(node)
            if not verdict.allowed and await self._reconcile_budget():
                verdict = self.state.budget.check(node)
            if not verdict.allowed:
                return _Result("deferred", verdict.reason, gate=verdict.gate)
        return None

    def _commit(self, ctx: _Context, kind: str, node: str, *, rate: bool = True) -> None:
        if not self._counts(ctx):
            return
        if rate:
            self.state.rate.commit(kind)
        if kind in DISRUPTIVE:
            self.state.budget.commit(node, kind=kind, dry_run=ctx.dry_run)
        self._dirty = True

    async def _reconcile_budget(self) -> bool:
        """Give back budget held for nodes that are no longer disrupted by this service (someone
        uncordoned them, or they are gone); once per delivery. True when something was released."""
        if self._reconciled:
            return False
        self._reconciled = True
        released = False
        for name, hold in self.state.budget.holders().items():
            if hold.dry_run:
                continue
            node = await self._cluster.get_node(name)
            why = self._still_ours(name, node, hold.kinds)
            if why is None:
                continue
            self.state.budget.release(name)
            self.state.ownership.forget(name)
            logger.info("budget: %s released (%s)", name, why)
            released = True
            self._dirty = True
        return released

    def _still_ours(self, name: str, node: Node | None, kinds: set[str]) -> str | None:
        """None while the node is still disrupted by this service, else why not."""
        if node is None:
            return "node no longer exists"
        if "aws_set_unhealthy" in kinds:
            return None  # being replaced: counted until the node object goes away
        own = self.state.ownership
        if own.cordoned.get(name) is False and not node.unschedulable:
            own.cordoned.pop(name, None)
        present = {(t.key, t.value, t.effect) for t in node.taints}
        for taint in own.our_taints(name):
            if (taint.key, taint.value, taint.effect) not in present:
                own.drop_taint(name, taint)
        if name in own.cordoned or name in own.tainted:
            return None
        return "no longer cordoned or tainted by accel-health (changed by someone else)"

    def _gate_verdict(self, ctx: _Context) -> Verdict | None:
        verdict = self.state.pause.check()
        if not verdict.allowed:
            return verdict
        if ctx.alert.status == "firing":
            verdict = self.state.breaker.check()
            if not verdict.allowed:
                return verdict
        return None

    # -- per action --------------------------------------------------------------------------

    def _precheck(self, ctx: _Context, action: Action) -> _Result | None:
        """Checks every action passes before its own: node, protection, pause, breaker, order."""
        if ctx.node is None:
            return _Result("skipped", f"node {ctx.node_name} not found in the cluster")
        if ctx.protected:
            return _Result("skipped", ctx.protected)
        if action.type in DISRUPTIVE and ctx.refused:
            return _Result("skipped", f"{ctx.refused}; not run: a human decides")
        if (verdict := self._gate_verdict(ctx)) is not None:
            return _Result("deferred", verdict.reason, gate=verdict.gate)
        if action.type in DISRUPTIVE and ctx.incomplete:
            return _Result("deferred", f"waits for {ctx.incomplete} to complete", gate="order")
        return None

    async def _decide(self, ctx: _Context, action: Action) -> _Result:  # noqa: PLR0911  one per action type
        if (early := self._precheck(ctx, action)) is not None:
            return early
        node = ctx.node
        assert node is not None  # _precheck skipped a missing node
        match action:
            case Cordon():
                return await self._cordon(ctx, node)
            case AddTaint():
                return await self._taint(ctx, node, action)
            case Drain():
                return await self._drain(ctx, node, action)
            case SetCondition():
                return await self._condition(ctx, node, action)
            case RecordEvent():
                return await self._event(ctx)
            case AwsSetUnhealthy():
                return await self._aws_unhealthy(ctx, node, handover=action.handover_condition)
            case AwsReboot():
                return await self._aws_reboot(ctx, node, action)
            case CloudWatchMetric():
                return await self._metric(ctx, node, action)
            case Uncordon():
                return await self._uncordon(ctx, node)
            case RemoveTaint():
                return await self._untaint(ctx, node, action)

    def _done(
        self, ctx: _Context, text: str, *, would: str, details: Mapping[str, Any] | None = None
    ) -> _Result:
        if ctx.dry_run:
            return _Result("planned", would, details=details or {}, done=text)
        return _Result("done", text, details=details or {}, done=text)

    async def _cordon(self, ctx: _Context, node: Node) -> _Result:
        if node.unschedulable:
            return _Result("skipped", "already cordoned (spec.unschedulable=true)")
        if (held := await self._gates(ctx, "cordon", node.name)) is not None:
            return held
        if not ctx.dry_run and not await self._cluster.cordon(node.name):
            return _Result("skipped", "cordoned by someone else meanwhile; left as it is, not claimed")
        if self._counts(ctx):
            self.state.ownership.add_cordon(node.name, dry_run=ctx.dry_run)
        self._commit(ctx, "cordon", node.name)
        return self._done(ctx, "cordoned", would="would cordon (spec.unschedulable=true)")

    def _maybe_release(self, ctx: _Context, node: str) -> None:
        own = self.state.ownership
        hold = self.state.budget.holders().get(node)
        if node in own.cordoned or node in own.tainted:
            return
        if hold is not None and "aws_set_unhealthy" in hold.kinds:
            return
        if self._counts(ctx) and self.state.budget.release(node):
            self._dirty = True

    def _held_by_others(self, ctx: _Context, hold: str) -> _Result | None:
        """A resolved alert's reversal waits while another alert firing on the node holds the same
        thing (cordon, taint key, condition type); it runs when none is left."""
        if ctx.alert.status != "resolved":
            return None
        causes = self.state.firing.holding(ctx.node_name, hold, besides=ctx.alert.fingerprint)
        if not causes:
            return None
        names = ", ".join(sorted({f"{c.alertname} (rule {c.rule})" for c in causes}))
        return _Result(
            "deferred",
            f"{hold} still held by alert(s) firing on this node: {names}; released when none is left",
            gate="hold",
        )

    def _draining(self, ctx: _Context, node: str) -> _Result | None:
        """Reversals wait for nothing and undo nothing while the node drains: a drain is never reversed."""
        if ctx.dry_run or node not in self._drains:
            return None
        return _Result("skipped", "a drain of this node is running; accel-health never reverses a drain")

    def _forget_cordon(self, ctx: _Context, node: str, why: str) -> _Result:
        self.state.ownership.cordoned.pop(node, None)
        self._maybe_release(ctx, node)
        self._dirty = True
        return _Result("skipped", why)

    def _uncordon_moot(self, ctx: _Context, node: Node) -> _Result | None:
        """Why there is nothing to uncordon (or not now), or None."""
        if (draining := self._draining(ctx, node.name)) is not None:
            return draining
        if (held := self._held_by_others(ctx, "cordon")) is not None:
            return held
        own = self.state.ownership
        if node.name not in own.cordoned:
            return _Result("skipped", "not cordoned by accel-health; left as it is")
        if own.cordoned[node.name] and not ctx.dry_run:
            return _Result("skipped", "the cordon was only planned (dry-run); nothing to undo")
        if not own.cordoned[node.name] and not node.unschedulable:
            return self._forget_cordon(ctx, node.name, "someone already uncordoned it")
        return None

    async def _uncordon(self, ctx: _Context, node: Node) -> _Result:
        if (moot := self._uncordon_moot(ctx, node)) is not None:
            return moot
        own = self.state.ownership
        if (held := await self._gates(ctx, "uncordon", node.name)) is not None:
            return held
        if not ctx.dry_run and not await self._cluster.uncordon(node.name):
            why = "the cordon was changed by someone else since; left as it is"
            return self._forget_cordon(ctx, node.name, why)
        if self._counts(ctx):
            own.cordoned.pop(node.name, None)
            self._commit(ctx, "uncordon", node.name)
        self._maybe_release(ctx, node.name)
        return self._done(ctx, "uncordoned", would="would uncordon (cordoned by accel-health)")

    async def _taint(self, ctx: _Context, node: Node, action: AddTaint) -> _Result:
        taint = Taint(key=action.key, value=action.value, effect=action.effect)
        text = f"{taint.key}={taint.value}:{taint.effect}"
        if any(t.key == taint.key and t.effect == taint.effect for t in node.taints):
            return _Result("skipped", f"already tainted {taint.key}:{taint.effect}")
        if (held := await self._gates(ctx, "taint", node.name)) is not None:
            return held
        if not ctx.dry_run:
            await self._cluster.add_taint(node.name, taint)
        if self._counts(ctx):
            self.state.ownership.add_taint(node.name, taint, dry_run=ctx.dry_run)
        self._commit(ctx, "taint", node.name)
        return self._done(ctx, f"tainted {text}", would=f"would taint {text}", details={"taint": text})

    async def _untaint(self, ctx: _Context, node: Node, action: RemoveTaint) -> _Result:
        if (draining := self._draining(ctx, node.name)) is not None:
            return draining
        if (held := self._held_by_others(ctx, f"taint:{action.key}")) is not None:
            return held
        own = self.state.ownership
        ours = [
            t
            for t in own.our_taints(node.name)
            if t.key == action.key and (action.effect is None or t.effect == action.effect)
        ]
        if not ours:
            return _Result("skipped", f"no {action.key} taint added by accel-health; left as it is")
        present = {(t.key, t.value, t.effect) for t in node.taints}
        simulated = own.tainted[node.name]
        to_remove = []
        for taint in ours:
            dry = simulated[(taint.key, taint.effect)][1]
            if dry and not ctx.dry_run:
                continue  # only planned: nothing to undo
            if not dry and (taint.key, taint.value, taint.effect) not in present:
                own.drop_taint(node.name, taint)  # removed or changed by someone else since
                self._dirty = True
                continue
            to_remove.append(taint)
        if not to_remove:
            self._maybe_release(ctx, node.name)
            return _Result(
                "skipped", f"{action.key} taint removed or changed by someone else since; left as it is"
            )
        if (held := await self._gates(ctx, "untaint", node.name)) is not None:
            return held
        for taint in to_remove:
            if not ctx.dry_run:
                await self._cluster.remove_taint(node.name, taint)
            if self._counts(ctx):
                own.drop_taint(node.name, taint)
        self._commit(ctx, "untaint", node.name)
        self._maybe_release(ctx, node.name)
        text = ", ".join(f"{t.key}={t.value}:{t.effect}" for t in to_remove)
        return self._done(ctx, f"removed taint {text}", would=f"would remove taint {text}")

    async def _drain(self, ctx: _Context, node: Node, action: Drain) -> _Result:
        running = None if ctx.dry_run else self._drains.get(node.name)
        if running is not None:
            return _Result(
                "started",
                f"joins the drain of {node.name} running since {running.as_json()['since']}; "
                "its end is recorded here too",
            )
        if self._stopping and not ctx.dry_run:
            raise BackendUnavailable("shutting down; the drain starts with the next delivery")
        # A drain started before (interrupted, or the process restarted) is resumed, not counted again.
        hold = self.state.budget.holders().get(node.name)
        again = not ctx.dry_run and hold is not None and not hold.dry_run and "drain" in hold.kinds
        if (held := await self._gates(ctx, "drain", node.name, rate=not again)) is not None:
            return held
        pods = await self._cluster.list_pods(node.name)
        pdbs = await self._cluster.list_pdbs()
        plan = plan_drain(
            pods,
            pdbs,
            delete_emptydir_data=action.delete_emptydir_data,
            force_bare_pods=action.force_bare_pods,
        )
        details: dict[str, Any] = dict(plan.details())
        if not node.unschedulable and node.name not in self.state.ownership.cordoned:
            mine = ctx.dry_run or await self._cluster.cordon(node.name)  # kubectl drain cordons first
            if self._counts(ctx) and mine:
                self.state.ownership.add_cordon(node.name, dry_run=ctx.dry_run)
        self._commit(ctx, "drain", node.name, rate=not again)
        if ctx.dry_run:
            outcome: Outcome = "failed" if plan.needs_permission else "planned"
            return _Result(outcome, plan.summary(dry_run=True), details=details)
        settings = dataclasses.replace(
            self.settings.drain,
            timeout_seconds=float(action.timeout_seconds),
            grace_period_seconds=action.grace_period_seconds,
            delete_emptydir_data=action.delete_emptydir_data,
            force_bare_pods=action.force_bare_pods,
        )
        running = _RunningDrain(node=node.name, since=self._clock(), settings=settings)
        self._drains[node.name] = running
        running.task = asyncio.create_task(self._run_drain(running), name=f"drain {node.name}")
        self._tasks.add(running.task)
        running.task.add_done_callback(self._tasks.discard)
        return _Result(
            "started",
            f"drain started in the background (timeout {action.timeout_seconds}s): "
            f"{plan.summary(dry_run=False)}; its end is recorded when it comes",
            details={**details, "timeout_seconds": action.timeout_seconds},
        )

    async def _run_drain(self, running: _RunningDrain) -> None:
        """The background task: drain, then record the end and decide each waiting alert's later actions."""
        outcome: DrainOutcome | None = None
        error = ""
        final = True  # decided: a resend does not start it again
        try:
            try:
                outcome = await self._cluster.drain(running.node, running.settings)
            except BackendUnavailable as exc:  # NotLeader too: the next delivery starts it again
                logger.warning("drain of %s interrupted: %s", running.node, exc)
                error, final = f"{type(exc).__name__}: {exc}", False
            except asyncio.CancelledError:
                logger.warning(
                    "drain of %s interrupted by shutdown; the next delivery of its alert resumes it",
                    running.node,
                )
                raise
            except Exception as exc:  # an executor error that retrying will not fix: recorded as failed
                logger.exception("drain of %s failed", running.node)
                error = f"{type(exc).__name__}: {exc}"
            running.ended = True
            async with self._lock:
                if self._drains.get(running.node) is running:
                    del self._drains[running.node]
                self._reconciled = False
                try:
                    for waiter in list(running.waiters.values()):
                        await self._drain_ended(running, waiter, outcome, error, final=final)
                finally:
                    try:
                        await self._save()
                    except BackendUnavailable as exc:
                        logger.warning(
                            "gate state not saved after the drain of %s (%s); saved with the next delivery",
                            running.node,
                            exc,
                        )
        finally:
            if self._drains.get(running.node) is running:
                del self._drains[running.node]

    async def _drain_ended(
        self,
        running: _RunningDrain,
        waiter: _Waiter,
        outcome: DrainOutcome | None,
        error: str,
        *,
        final: bool,
    ) -> None:
        """Record how the drain ended for one alert, then decide that alert's later actions."""
        action = waiter.rule.actions[waiter.index]
        proceed = isinstance(action, Drain) and action.on_timeout == "proceed"
        result, reason, refused, details = _drain_end(outcome, error, final=final, proceed=proceed)
        if final:
            self.state.decided.add(waiter.key)
            self._dirty = True
            if events := await self._drain_end_events(running.node, waiter, result, reason):
                details = {**details, "events": [e.as_json() for e in events]}
        self._record(
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
        if waiter.resolved is not None:
            self._skip_after_resolved(running.node, waiter)
            return
        if waiter.index + 1 >= len(waiter.rule.actions):
            return
        try:
            node = await self._cluster.get_node(running.node)
        except BackendUnavailable as exc:
            logger.warning(
                "%s: the actions after the drain are decided with the next delivery (%s)", running.node, exc
            )
            return
        ctx = _Context(
            alert=waiter.alert,
            node_name=running.node,
            node=node,
            rule=waiter.rule,
            dry_run=False,
            protected=protected_reason(node, self.policy.safety) if node is not None else None,
            refused=refused,
            background=True,
        )
        await self._run_actions(ctx, waiter.rule.actions, [], start=waiter.index + 1)

    def _skip_after_resolved(self, node: str, waiter: _Waiter) -> None:
        alert, resolved = waiter.alert, waiter.resolved
        assert resolved is not None  # only called for resolved waiters
        for index, action in enumerate(waiter.rule.actions):
            if index <= waiter.index:
                continue
            key = (alert.fingerprint, alert.starts_at, alert.status, index, action.type, False)
            if key in self.state.decided:
                continue
            self.pending.pop(key, None)
            self.state.decided.add(key)
            self._dirty = True
            self._record(
                resolved,
                node=node,
                action=action.type,
                rule=waiter.rule.name,
                dry_run=False,
                outcome="skipped",
                reason="alert resolved while the drain ran; not run",
            )

    async def _condition(self, ctx: _Context, node: Node, action: SetCondition) -> _Result:
        status = action.status or ("True" if ctx.alert.status == "resolved" else "False")
        alertname = ctx.alert.labels.get("alertname", "AcceleratorFault")
        message = ctx.alert.annotations.get("summary") or f"{alertname} is {ctx.alert.status}"
        cond = NodeCondition(type=action.condition_type, status=status, reason=alertname, message=message)
        text = f"{cond.type}={cond.status} (reason {cond.reason})"
        if (held := self._held_by_others(ctx, f"condition:{cond.type}")) is not None:
            return held
        if any(
            c.type == cond.type and c.status == cond.status and c.reason == cond.reason
            for c in node.conditions
        ):
            return _Result("skipped", f"condition already {text}")
        if (held := await self._gates(ctx, "condition", node.name)) is not None:
            return held
        if not ctx.dry_run:
            await self._cluster.set_condition(node.name, cond)
        self._commit(ctx, "condition", node.name)
        return self._done(
            ctx,
            f"set condition {text}",
            would=f"would set condition {text}",
            details={"condition_type": cond.type, "status": cond.status, "message": message},
        )

    async def _event(self, ctx: _Context) -> _Result:
        alertname = ctx.alert.labels.get("alertname", "AcceleratorFault")
        message = ctx.alert.annotations.get("summary") or f"{alertname} is {ctx.alert.status}"
        type_ = "Normal" if ctx.alert.status == "resolved" else "Warning"
        if (held := await self._gates(ctx, "event", ctx.node_name)) is not None:
            return held
        if not ctx.dry_run:
            await self._cluster.record_event(
                node=ctx.node_name, reason=alertname, message=message, type_=type_
            )
        self._commit(ctx, "event", ctx.node_name)
        return self._done(
            ctx,
            f"recorded {type_} event {alertname}",
            would=f"would record {type_} event {alertname}",
            details={"type": type_, "message": message},
        )

    async def _aws_unhealthy(  # noqa: PLR0911  one return per outcome: skipped, deferred, handed over, done
        self, ctx: _Context, node: Node, *, handover: str = "", why: str = ""
    ) -> _Result:
        instance = instance_id_from_provider_id(node.provider_id)
        if instance is None:
            return _Result(
                "skipped", f"no EC2 instance id in spec.providerID ({node.provider_id or 'empty'})"
            )
        hold = self.state.budget.holders().get(node.name)
        if hold is not None and "aws_set_unhealthy" in hold.kinds and hold.dry_run == ctx.dry_run:
            return _Result("skipped", f"{instance} already marked Unhealthy by accel-health")
        if (held := await self._gates(ctx, "aws_set_unhealthy", node.name)) is not None:
            return held
        details = {"instance_id": instance, **({"escalated": why} if why else {})}
        prefix = f"{why}; " if why else ""
        if handover and karpenter_managed(node):
            return await self._handover(ctx, node, handover, prefix, details)
        if not ctx.dry_run and not await self._aws.set_unhealthy(instance):
            if handover:
                return await self._handover(ctx, node, handover, prefix, details)
            return _Result(
                "skipped",
                f"{prefix}{instance} is in no Auto Scaling group (Karpenter or self-managed node): "
                "nothing marked, nothing replaces it; a human decides",
                details=details,
            )
        self._commit(ctx, "aws_set_unhealthy", node.name)
        text = f"{instance} Unhealthy in its Auto Scaling group (no grace period): it gets replaced"
        return self._done(ctx, f"{prefix}marked {text}", would=f"{prefix}would mark {text}", details=details)

    async def _handover(
        self, ctx: _Context, node: Node, condition_type: str, prefix: str, details: Mapping[str, Any]
    ) -> _Result:
        """A node no Auto Scaling group replaces: the condition its own provisioner's repair acts on."""
        alertname = ctx.alert.labels.get("alertname", "AcceleratorFault")
        cond = NodeCondition(
            type=condition_type,
            status="False",
            reason=alertname,
            message=(
                f"accelerator fault ({alertname}): accel-health hands the node to its provisioner's repair"
            ),
        )
        if not ctx.dry_run:
            await self._cluster.set_condition(node.name, cond)
        self._commit(ctx, "aws_set_unhealthy", node.name)
        text = f"{condition_type}=False for the node's own provisioner (no Auto Scaling group call)"
        return self._done(
            ctx,
            f"{prefix}handed over: set {text}",
            would=f"{prefix}would hand over: set {text}",
            details={**details, "handover_condition": condition_type},
        )

    async def _aws_reboot(self, ctx: _Context, node: Node, action: AwsReboot) -> _Result:
        instance = instance_id_from_provider_id(node.provider_id)
        if instance is None:
            return _Result(
                "skipped", f"no EC2 instance id in spec.providerID ({node.provider_id or 'empty'})"
            )
        step, why = reboot_step(node, action, now=self._clock())
        if step == "replace":
            return await self._aws_unhealthy(ctx, node, handover=action.handover_condition, why=why)
        if step == "wait":
            return _Result("skipped", why, details={"instance_id": instance})
        if (held := await self._gates(ctx, "aws_reboot", node.name)) is not None:
            return held
        if not ctx.dry_run:
            await self._cluster.annotate_node(node.name, rebooted_annotation(node, now=self._clock()))
            await self._aws.reboot(instance)
        self._commit(ctx, "aws_reboot", node.name)
        return self._done(
            ctx,
            f"asked EC2 to reboot {instance} ({why})",
            would=f"would ask EC2 to reboot {instance} ({why})",
            details={"instance_id": instance},
        )

    async def _metric(self, ctx: _Context, node: Node, action: CloudWatchMetric) -> _Result:
        dims = {"node": node.name, "alertname": ctx.alert.labels.get("alertname", "")}
        instance = instance_id_from_provider_id(node.provider_id)
        if instance:
            dims["InstanceId"] = instance
        if (held := await self._gates(ctx, "cloudwatch_metric", node.name)) is not None:
            return held
        if not ctx.dry_run:
            await self._aws.put_metric(
                namespace=action.namespace, name=action.metric_name, value=1.0, dimensions=dims
            )
        self._commit(ctx, "cloudwatch_metric", node.name)
        text = f"{action.namespace}/{action.metric_name}=1 {dims}"
        return self._done(
            ctx, f"put metric {text}", would=f"would put metric {text}", details={"dimensions": dims}
        )


def _drain_end(
    outcome: DrainOutcome | None, error: str, *, final: bool, proceed: bool
) -> tuple[Outcome, str, str | None, dict[str, Any]]:
    """(outcome, reason, why later disruptive actions are refused, details) of a drain's end."""
    if outcome is None:
        if final:
            return "failed", error, f"the drain failed ({error})", {}
        return (
            "failed",
            f"drain interrupted: {error}; the next delivery of the alert starts it again and it "
            "resumes with its original deadline",
            None,
            {},
        )
    details = _outcome_details(outcome)
    reason = outcome.summary() + (" (resumed a drain started earlier)" if outcome.resumed else "")
    if outcome.completed:
        return "done", reason, None, details
    if outcome.timed_out and proceed:
        return (
            "failed",
            reason + "; the deadline passed and the rule says on_timeout: proceed, so the actions after "
            "it run",
            None,
            details,
        )
    if outcome.timed_out:
        return (
            "failed",
            reason + "; the deadline passed with pods left: the actions after it do not run "
            "(on_timeout: stop); a human decides",
            "the drain timed out with pods left (a PodDisruptionBudget or a pod that would not go)",
            details,
        )
    why = "; ".join(sorted({b.reason for b in outcome.blocked})) or "refused"
    return (
        "failed",
        reason + "; the drain was refused, not retried",
        f"the drain was refused ({why})",
        details,
    )


def _outcome_details(outcome: DrainOutcome) -> dict[str, Any]:
    """The `details` of a drain's final record."""

    def pods(names: tuple[str, ...]) -> list[dict[str, str]]:
        return [dict(zip(("namespace", "name"), n.split("/", 1), strict=True)) for n in names]

    return {
        "evicted": pods(outcome.evicted),
        "skipped": pods(outcome.skipped),
        "blocked": [b.as_json() for b in outcome.blocked],
        "timed_out": outcome.timed_out,
        "resumed": outcome.resumed,
        "deadline": datetime.fromtimestamp(outcome.deadline, tz=UTC).isoformat(timespec="seconds"),
    }


def alert_document(alert: Alert) -> dict[str, Any]:
    """An alert as Alertmanager's webhook sends it (what `parse_payload` reads back)."""
    return {
        "status": alert.status,
        "labels": dict(alert.labels),
        "annotations": dict(alert.annotations),
        "startsAt": alert.starts_at,
        "endsAt": alert.ends_at,
        "generatorURL": alert.generator_url,
        "fingerprint": alert.fingerprint,
    }


def _running_drains(section: Any) -> dict[str, list[Alert]]:
    """The stored `drains` section: node -> the alerts its drain was started for."""
    if not isinstance(section, Mapping):
        raise StateError("drains: expected a mapping")
    drains: dict[str, list[Alert]] = {}
    for node, alerts in section.items():
        try:
            payload = parse_payload({"version": "4", "status": "firing", "alerts": alerts})
        except PayloadError as exc:
            raise StateError(f"drains.{node}: {exc}") from exc
        if payload.alerts:
            drains[str(node)] = list(payload.alerts)
    return drains


def _resolved_alert(fingerprint: str, labels: Mapping[str, str], starts_at: str, now: float) -> Alert:
    """The resolve of an alert no Alertmanager shows any more."""
    ends = datetime.fromtimestamp(now, tz=UTC).isoformat().replace("+00:00", "Z")
    return Alert(
        status="resolved",
        labels=labels,
        annotations={},
        starts_at=starts_at,
        ends_at=ends,
        generator_url="",
        fingerprint=fingerprint,
    )


def _api_payload(alerts: list[Alert]) -> WebhookPayload:
    """What Alertmanager's API shows, as one delivery."""
    return WebhookPayload(
        version="4",
        group_key="alertmanager-api",
        truncated_alerts=0,
        status="firing" if any(a.status == "firing" for a in alerts) else "resolved",
        receiver="",
        group_labels={},
        common_labels={},
        common_annotations={},
        external_url="",
        alerts=tuple(alerts),
    )


def _resume_payload(alerts: list[Alert]) -> WebhookPayload:
    return WebhookPayload(
        version="4",
        group_key="accel-health/resume",
        truncated_alerts=0,
        status="firing",
        receiver="accel-health-remediator",
        group_labels={},
        common_labels={},
        common_annotations={},
        external_url="",
        alerts=tuple(alerts),
    )
