"""What the engine works with and reports: settings, per-action results, plans, pending actions,
the gates at a glance, and the drains running in the background."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from remediator.audit import DecisionRecord, Outcome
from remediator.cluster import DrainSettings, Node
from remediator.intake.payload import Alert
from remediator.lifecycle.phases import phase_of
from remediator.lifecycle.record import Episode, RecordChange, episode_start
from remediator.policy import Rule

MAX_PENDING = 10_000
"""Deferred actions remembered at most; past it a new deferral is not remembered (counted, a log line a
minute) while those remembered keep their place."""


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
class ActionResult:
    outcome: Outcome
    reason: str
    gate: str | None = None
    details: Mapping[str, Any] = field(default_factory=dict)
    done: str = ""  # what was (or, in dry-run, would have been) done, in the words of a live run


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
    rule_budgets: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """Rule -> its own budget in use now (selector, limits, nodes covered, in use, capacity)."""
    phases: Mapping[str, int] = field(default_factory=dict)
    """Lifecycle phase -> nodes in it now, from the observed nodes (remediator/lifecycle/status.py)."""

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
                "rules": {k: dict(v) for k, v in self.rule_budgets.items()},
            },
            "firing": {k: dict(v) for k, v in self.firing.items()},
            "rate_limits": dict(self.rate_limits),
            "deferred": dict(self.deferred),
            "drains": {k: dict(v) for k, v in self.drains.items()},
            "api_unavailable": dict(self.api_unavailable),
            "phases": dict(self.phases),
        }


@dataclass
class Context:
    """One alert being decided on one node: what every action of it is decided with."""

    alert: Alert
    node_name: str
    node: Node | None
    rule: Rule
    dry_run: bool
    protected: str | None
    incomplete: str | None = None  # the earlier disruptive action that did not complete
    refused: str | None = None  # why an earlier drain was refused: later disruptive actions are skipped
    background: bool = False  # decided when a drain ended, not in a webhook request
    index: int = 0  # the action being decided (its position in the rule's actions)
    steps: int = 0  # bit i: action i of this episode decided (in memory or in the node's record)
    intent: int = 0  # bit i: the node's record says action i was asked of AWS (not yet seen done here)
    ended: frozenset[tuple[str, int]] = frozenset()  # episodes recorded on the node that fire no more

    @property
    def start(self) -> int:
        """The episode's startsAt, unix seconds (with the fingerprint, its identity)."""
        return episode_start(self.alert.starts_at)

    def record(
        self, kind: str, at: float, *, decided: bool = True, held_after: bool = False
    ) -> RecordChange | None:
        """The change to the node's record that this action's write carries (None in dry-run: a dry
        run writes nothing). Firing: the episode, with this action among its decided steps when
        `decided`; resolved: the episode ends. Either way the episodes recorded on the node that no
        longer fire (`ended`) are forgotten in the same write, except by a resolved alert's write
        that leaves a hold of this service on the node (`held_after`: the taint still there after
        the uncordon): the episodes go with the write that releases the last hold, so that a hold
        never outlives the record of what it is for (a leader that dies between the two writes
        leaves the next one an episode to resolve, not a taint nothing names)."""
        if self.dry_run:
            return None
        alert = self.alert
        if alert.status == "resolved":
            if held_after:
                return RecordChange(kind=kind, at=int(at))
            ended = self.ended | {(alert.fingerprint, self.start)}
            return RecordChange(kind=kind, at=int(at), forget=ended)
        steps = self.steps | (1 << self.index) if decided else self.steps
        episode = Episode(
            fingerprint=alert.fingerprint,
            rule=self.rule.name,
            alertname=alert.labels.get("alertname", ""),
            start=self.start,
            steps=steps,
        )
        return RecordChange(
            episodes=(episode,), kind=kind, at=int(at), forget=self.ended, phase=phase_of(kind)
        )


@dataclass(frozen=True)
class Observed:
    alert: Alert
    node_name: str
    rule: Rule | None
    passed_over: tuple[str, ...] = ()  # rules passed over for their node selector, and why


@dataclass
class Waiter:
    """An alert whose drain action is the drain running on its node."""

    key: tuple[Any, ...]
    """The drain action's idempotency key."""
    alert: Alert
    """The firing alert (its later actions are decided for it)."""
    rule: Rule
    """The rule that matched it."""
    index: int
    """The drain action's index in the rule's actions."""
    steps: int = 0
    """The alert's steps decided before the drain (bit i: action i)."""
    resolved: Alert | None = None
    """The resolved alert, when it resolved while the drain ran."""


@dataclass
class RunningDrain:
    """A drain running in the background, and the alerts waiting for it to end."""

    node: str
    since: float
    settings: DrainSettings
    waiters: dict[tuple[Any, ...], Waiter] = field(default_factory=dict)
    task: asyncio.Task[None] | None = None
    ending: bool = False  # its end's record was taken (`ended`), the write may be on its way: no join
    ended: bool = False  # Cluster.drain returned (or raised): only the bookkeeping is left
    stopped: str = ""  # why it was stopped before its end (a human's uncordon): recorded `stopped`
    resumed: bool = False  # started before (an earlier leader, or an interrupted start): told then

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
