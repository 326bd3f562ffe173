"""Safety gates between a decision and an action (pure; time comes from an injected clock).

The gates, in the order the engine asks them:

- `PauseSwitch`: a global stop, switched over HTTP (`POST /pause`, `POST /resume`) or at start-up.
- `StormBreaker`: when more than X% of the eligible nodes have a fault firing now, stop acting until
  that fraction has stayed below the threshold for a cooldown; it resets by itself.
- `RateLimiter`: at most N actions of a kind per sliding window.
- `DisruptionBudget`: at most N nodes, or P% of the eligible nodes, disrupted at once: the nodes this
  service holds plus the eligible nodes already unschedulable or NotReady for other reasons.
- `ScopedBudgets`: a policy rule's own budget, counted the same way over the nodes its selector
  covers (one node pool, one instance type); asked after the global budget, same gate name.

The pause switch and the breaker's latch are written to a small document the cluster keeps
(remediator/gates/state.py); the budget's holds and the rate limits' times are derived from the nodes
(remediator/lifecycle/record.py), so both survive restarts and fail-overs without a document that grows with
the fleet. Nothing here imports aiohttp, kubernetes or boto3.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from remediator.cluster import LabelSelector, Node

CONTROL_PLANE_LABELS = ("node-role.kubernetes.io/control-plane", "node-role.kubernetes.io/master")
logger = logging.getLogger("remediator.gates.safety")

Clock = Callable[[], float]


@dataclass(frozen=True)
class RateLimit:
    """At most `max_actions` actions of one kind per sliding window."""

    max_actions: int
    """Actions allowed per window (0 defers every action of the kind)."""
    window_seconds: float
    """Window length, seconds."""


@dataclass(frozen=True)
class StormSettings:
    """The storm breaker's `safety.storm_breaker` section."""

    enabled: bool = True
    """False turns the breaker off (not recommended)."""
    threshold_percent: float = 30.0
    """The breaker opens when MORE than this share of the eligible nodes alert within the window.
    Default 30%: EKS auto repair pauses above 20% of a group; 30% leaves room for a bad rack."""
    min_nodes: int = 3
    """...and at least this many nodes alert: in a 4-node cluster one broken node is 25%, which is
    a fault, not a storm. Default 3."""
    window_seconds: float = 600.0
    """No longer used (kept so that older policies load): the breaker counts the faults firing now,
    each kept until it resolves or until `safety.alert_expiry_seconds` pass without a delivery."""
    cooldown_seconds: float = 900.0
    """After a trip, the fraction must stay below the threshold this long before the breaker closes by
    itself. Default 15 minutes."""


@dataclass(frozen=True)
class SafetySettings:
    """The policy's `safety:` section."""

    max_disrupted_nodes: int = 2
    """How many nodes this service may hold disrupted (cordoned, tainted, drained, replaced) at once.
    Default 2: enough to take a broken node out while another is still draining, too few for a faulty
    rule to empty a cluster (draino #54, #89)."""
    max_disrupted_percent: float | None = None
    """Optionally also at most this share of the eligible nodes, rounded down (so 10% of 15 nodes is
    1). The smaller of the two limits applies. Default: no percentage limit."""
    opt_out_label: str = "accel-health.io/opt-out"
    """Nodes carrying this label with value "true" are never acted on."""
    rate_limits: Mapping[str, RateLimit] = field(default_factory=dict)
    """Per action type (cordon, drain, ...): at most N per window. Default: none."""
    storm_breaker: StormSettings = field(default_factory=StormSettings)
    """The storm breaker."""
    alert_expiry_seconds: float = 4 * 3600.0 + 600.0
    """A firing alert counts as firing (holds its node, counts for the breaker) until a delivery says
    it resolved, or until this long passes without a delivery of it. Set it above the longest
    repeat_interval of the Alertmanager routes to this service. Default 4 h 10 min (Alertmanager's
    default repeat_interval is 4 h)."""


@dataclass(frozen=True)
class Verdict:
    """A gate's answer."""

    allowed: bool
    """False: the action is deferred."""
    gate: str
    """Name of the gate that answered."""
    reason: str
    """Why, in words."""


def protected_reason(node: Node, settings: SafetySettings) -> str | None:
    """Why the node must never be acted on, or None."""
    for label in CONTROL_PLANE_LABELS:
        if label in node.labels:
            return f"control-plane node (label {label}); never remediated automatically"
    for taint in node.taints:
        if taint.key in CONTROL_PLANE_LABELS:
            return f"control-plane node (taint {taint.key}); never remediated automatically"
    if node.labels.get(settings.opt_out_label, "").lower() == "true":
        return f"node opted out (label {settings.opt_out_label}=true)"
    return None


def eligible(node: Node, settings: SafetySettings) -> bool:
    """An accelerator node the service may act on: counted by the budget's percentage and the
    breaker (CPU-only nodes, control-plane and opted-out nodes are not)."""
    return node.has_accelerators and protected_reason(node, settings) is None


def eligible_count(nodes: Iterable[Node], settings: SafetySettings) -> int:
    """Nodes the service may act on at all: the denominator of percentages."""
    return sum(1 for n in nodes if eligible(n, settings))


def disrupted_reason(node: Node) -> str | None:
    """Why a node is out of service now whoever did it (cordoned, NotReady), or None."""
    if node.unschedulable:
        return "unschedulable"
    if not node.ready:
        return "NotReady"
    return None


def _float(doc: Mapping[str, Any], key: str, default: float | None = None) -> float:
    value = doc.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{key}: expected a number, got {value!r}")
    return float(value)


# -- pause -------------------------------------------------------------------------------------


class PauseSwitch:
    """Global stop: while paused, every action is deferred (gate "pause")."""

    name = "pause"

    def __init__(self, *, clock: Clock) -> None:
        self._clock = clock
        self.paused = False
        self.since = 0.0
        self.reason = ""

    def pause(self, reason: str) -> None:
        if not self.paused:
            self.since = self._clock()
        self.paused = True
        self.reason = reason
        logger.warning("remediation PAUSED: %s", reason)

    def resume(self) -> bool:
        """True when it was paused."""
        was = self.paused
        self.paused = False
        self.reason = ""
        if was:
            logger.warning("remediation resumed")
        return was

    def check(self) -> Verdict:
        if not self.paused:
            return Verdict(True, self.name, "not paused")
        for_s = self._clock() - self.since
        return Verdict(
            False,
            self.name,
            f"remediation paused {for_s:.0f}s ago ({self.reason}); POST /resume to continue; "
            "re-evaluated when Alertmanager resends",
        )

    def to_state(self) -> dict[str, Any]:
        return {"paused": self.paused, "since": self.since, "reason": self.reason}

    def load_state(self, doc: Mapping[str, Any]) -> None:
        paused = doc.get("paused", False)
        if not isinstance(paused, bool):
            raise ValueError(f"paused: expected true or false, got {paused!r}")
        self.paused = paused
        self.since = _float(doc, "since", 0.0)
        self.reason = str(doc.get("reason", ""))


# -- storm breaker -----------------------------------------------------------------------------


class StormBreaker:
    """Opens when too many eligible nodes have faults firing at once; closes by itself after a calm
    cooldown.

    It counts faults, not deliveries: `evaluate(eligible=..., alerting=...)` is given the eligible
    nodes with an alert firing now (remediator/desired/firing.py keeps those until they resolve or expire),
    so a storm that keeps firing keeps the breaker open however rarely Alertmanager resends. It is
    evaluated on every delivery, every check and every metrics scrape. While open, every action for a
    firing alert is deferred (gate "breaker").
    """

    name = "breaker"

    def __init__(self, *, settings: StormSettings, clock: Clock) -> None:
        self.settings = settings
        self._clock = clock
        self.open = False
        self.opened_at = 0.0
        self.below_since: float | None = None
        self.trips = 0
        self.eligible = 0
        """Eligible nodes at the last evaluation."""
        self.alerting = 0
        """Eligible nodes with a fault firing now, at the last evaluation."""

    def _above(self) -> bool:
        count = self.alerting
        return count >= self.settings.min_nodes and count * 100 > self.settings.threshold_percent * max(
            self.eligible, 0
        )

    def evaluate(self, eligible: int | None = None, alerting: int | None = None) -> bool:
        """Update the state; True when it changed (opened or closed)."""
        if eligible is not None:
            self.eligible = eligible
        if alerting is not None:
            self.alerting = alerting
        if not self.settings.enabled:
            return False
        now = self._clock()
        if self._above():
            self.below_since = None
            if not self.open:
                self.open = True
                self.opened_at = now
                self.trips += 1
                logger.error(
                    "STORM BREAKER OPEN: %d of %d eligible nodes have a fault firing (threshold %g%%); "
                    "no action runs until the fraction stays below the threshold for %.0fs",
                    self.alerting,
                    self.eligible,
                    self.settings.threshold_percent,
                    self.settings.cooldown_seconds,
                )
                return True
            return False
        if not self.open:
            return False
        if self.below_since is None:
            self.below_since = now
        if now - self.below_since >= self.settings.cooldown_seconds:
            self.open = False
            self.below_since = None
            logger.warning(
                "storm breaker closed: fraction of nodes with faults below %g%% for %.0fs; acting again",
                self.settings.threshold_percent,
                self.settings.cooldown_seconds,
            )
            return True
        return False

    def describe(self) -> str:
        share = 100.0 * self.alerting / self.eligible if self.eligible else 0.0
        state = "OPEN" if self.open else "closed"
        text = (
            f"storm breaker {state}: {self.alerting} of {self.eligible} eligible nodes with a fault "
            f"firing now ({share:.0f}%; opens above {self.settings.threshold_percent:g}% and at least "
            f"{self.settings.min_nodes} nodes)"
        )
        if self.open:
            now = self._clock()
            if self.below_since is None:
                text += f"; open for {now - self.opened_at:.0f}s, fraction still above the threshold"
            else:
                left = self.settings.cooldown_seconds - (now - self.below_since)
                text += f"; below the threshold for {now - self.below_since:.0f}s, closes in {left:.0f}s"
        return text

    def check(self) -> Verdict:
        self.evaluate()
        if not self.open:
            return Verdict(True, self.name, self.describe())
        return Verdict(False, self.name, self.describe() + "; re-evaluated with every delivery")

    def to_state(self) -> dict[str, Any]:
        return {
            "open": self.open,
            "opened_at": self.opened_at,
            "below_since": self.below_since,
            "trips": self.trips,
            "eligible": self.eligible,
            "alerting": self.alerting,
        }

    def load_state(self, doc: Mapping[str, Any]) -> None:
        is_open = doc.get("open", False)
        if not isinstance(is_open, bool):
            raise ValueError(f"open: expected true or false, got {is_open!r}")
        alerting = doc.get("alerting", 0)
        if isinstance(alerting, Mapping):  # written by an older release: node -> deliveries
            alerting = len(alerting)
        trips = doc.get("trips", 0)
        eligible = doc.get("eligible", 0)
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (trips, eligible, alerting)):
            raise ValueError("trips, eligible and alerting: expected integers")
        self.open = is_open
        self.opened_at = _float(doc, "opened_at", 0.0)
        below = doc.get("below_since")
        self.below_since = None if below is None else _float(doc, "below_since")
        self.trips = trips
        self.eligible = eligible
        self.alerting = alerting


# -- rate limits -------------------------------------------------------------------------------


class RateLimiter:
    """At most `max_actions` per action kind within a sliding window."""

    name = "rate_limit"

    def __init__(self, *, limits: Mapping[str, RateLimit], clock: Clock) -> None:
        self._limits = dict(limits)
        self._clock = clock
        self._times: dict[str, deque[float]] = {kind: deque() for kind in self._limits}

    def _prune(self, kind: str) -> deque[float]:
        times = self._times[kind]
        horizon = self._clock() - self._limits[kind].window_seconds
        while times and times[0] <= horizon:
            times.popleft()
        return times

    def check(self, kind: str) -> Verdict:
        limit = self._limits.get(kind)
        if limit is None:
            return Verdict(True, self.name, f"no rate limit for {kind}")
        times = self._prune(kind)
        if len(times) < limit.max_actions:
            return Verdict(
                True,
                self.name,
                f"{len(times) + 1} of {limit.max_actions} {kind} actions per {limit.window_seconds:g}s",
            )
        wait = times[0] + limit.window_seconds - self._clock() if times else limit.window_seconds
        return Verdict(
            False,
            self.name,
            f"rate limit: {len(times)} of {limit.max_actions} {kind} actions within "
            f"{limit.window_seconds:g}s already; a slot frees in {wait:.0f}s; "
            "re-evaluated when Alertmanager resends",
        )

    def commit(self, kind: str) -> float | None:
        """Count one action of `kind` now; its time (None when the kind has no limit)."""
        if kind not in self._limits:
            return None
        at = self._clock()
        self._prune(kind).append(at)
        return at

    def uncommit(self, kind: str, at: float) -> None:
        """An action counted at `at` did not happen after all: its slot is free again."""
        times = self._times.get(kind)
        if times is not None:
            with contextlib.suppress(ValueError):  # already out of the window
                times.remove(at)

    def usage(self) -> dict[str, int]:
        """Actions counted in the current window, per limited kind."""
        return {kind: len(self._prune(kind)) for kind in self._limits}

    def reset(self, times: Iterable[tuple[str, float]]) -> None:
        """Start over from these (kind, time) actions (a new leader's, read off the nodes)."""
        self._times = {kind: deque() for kind in self._limits}
        for kind, at in sorted(times, key=lambda item: item[1]):
            if kind in self._times:
                self._times[kind].append(at)


# -- disruption budget -------------------------------------------------------------------------


@dataclass
class Hold:
    """One node counted against the budget."""

    since: float
    """Clock time when this service started disrupting it."""
    dry_run: bool
    """Counted by a dry-run decision (nothing changed on the node; kept in memory only)."""
    kinds: set[str] = field(default_factory=set)
    """What was done: cordon, taint, drain, aws_set_unhealthy."""


class DisruptionBudget:
    """At most `max_nodes` (and at most `max_percent` of the eligible) nodes disrupted at once."""

    name = "budget"

    def __init__(self, *, max_nodes: int, clock: Clock, max_percent: float | None = None) -> None:
        self._max = max_nodes
        self._percent = max_percent
        self._clock = clock
        self._holds: dict[str, Hold] = {}
        self._reserved: set[str] = set()
        """Nodes whose disruptive action passed the check and is being written now (nodes are
        reconciled in parallel: a reservation keeps a second node from taking the same slot while
        the first one's write is in flight). Kept across `observe`; ended by `commit` or `unreserve`."""
        self.eligible: int | None = None
        """Eligible nodes, set by the engine before it checks (needed only for max_percent)."""
        self.others: dict[str, str] = {}
        """Eligible nodes out of service for other reasons (node -> unschedulable or NotReady), as
        last observed: they count against the budget too, as MHC's maxUnhealthy counts them."""

    def observe(
        self,
        nodes: Iterable[Node],
        settings: SafetySettings,
        *,
        holds: Mapping[str, Hold] | None = None,
        judged: bool = False,
    ) -> None:
        """Take the eligible nodes, those already out of service and (`holds`, derived from the
        nodes themselves) this service's live holds from the cluster as it is now. Holds of dry-run
        decisions are kept: nothing on the nodes shows them. `judged`: `nodes` are the eligible ones
        already (the caller judged them)."""
        listed = list(nodes) if judged else [n for n in nodes if eligible(n, settings)]
        self.eligible = len(listed)
        if holds is not None:
            dry = {n: h for n, h in self._holds.items() if h.dry_run and n not in holds}
            self._holds = {**dict(holds), **dry}
        self.others = {
            n.name: why for n in listed if n.name not in self._holds and (why := disrupted_reason(n))
        }

    @property
    def in_use(self) -> int:
        """Nodes counted now: ours (held or being acted on), plus the eligible nodes already out of
        service."""
        return len(set(self._holds) | self._reserved | set(self.others))

    @property
    def capacity(self) -> int:
        """The effective limit: max_disrupted_nodes, or the percentage of eligible nodes if smaller."""
        if self._percent is None or self.eligible is None:
            return self._max
        return min(self._max, math.floor(self._percent * self.eligible / 100.0 + 1e-9))

    def _limit_text(self) -> str:
        if self._percent is None or self.eligible is None or self.capacity == self._max:
            return f"{self.capacity}"
        return f"{self.capacity} ({self._percent:g}% of {self.eligible} eligible nodes, rounded down)"

    def holders(self) -> Mapping[str, Hold]:
        """Node -> hold."""
        return dict(self._holds)

    def holds(self, node: str) -> bool:
        """True when this service disrupted the node and has not given it back."""
        return node in self._holds

    def reserve(self, node: str) -> None:
        """The node's disruptive action passed the check and is about to be written: counted now."""
        self._reserved.add(node)

    def unreserve(self, node: str) -> None:
        """The action was committed (a hold now) or did not happen: the reservation ends."""
        self._reserved.discard(node)

    @property
    def reserved(self) -> frozenset[str]:
        """Nodes whose disruptive action is being written now."""
        return frozenset(self._reserved)

    def counted(self) -> Mapping[str, Hold]:
        """Node -> hold, the reservations included (as holds of no kind yet): what a rule's own budget
        counts as this service's."""
        out = dict(self._holds)
        for node in self._reserved - set(out):
            out[node] = Hold(since=self._clock(), dry_run=False)
        return out

    def check(self, node: str) -> Verdict:
        if node in self._holds or node in self.others or node in self._reserved:
            return Verdict(
                True,
                self.name,
                f"{node} already counted ({self.in_use} of {self._limit_text()} nodes in use)",
            )
        if self.in_use < self.capacity:
            return Verdict(
                True, self.name, f"{self.in_use + 1} of {self._limit_text()} nodes in use after this one"
            )
        now = self._clock()
        held = ", ".join(
            [f"{n} for {now - h.since:.0f}s" for n, h in sorted(self._holds.items())]
            + [f"{n} {why}" for n, why in sorted(self.others.items()) if n not in self._holds]
        )
        return Verdict(
            False,
            self.name,
            f"disruption budget exhausted: {self.in_use} of {self._limit_text()} nodes already out of "
            "service"
            f"{f' ({held})' if held else ''}; re-evaluated when Alertmanager resends",
        )

    def commit(self, node: str, *, kind: str, dry_run: bool) -> None:
        hold = self._holds.get(node)
        if hold is None:
            hold = self._holds[node] = Hold(since=self._clock(), dry_run=dry_run)
            self.others.pop(node, None)
        elif hold.dry_run and not dry_run:
            hold.dry_run = False
        hold.kinds.add(kind)
        self._reserved.discard(node)

    def release_dry(self, node: str) -> bool:
        """A dry-run decision gave the node back (live holds follow the nodes: see `observe`)."""
        hold = self._holds.get(node)
        if hold is None or not hold.dry_run:
            return False
        del self._holds[node]
        return True


# -- a rule's own budget -------------------------------------------------------------------------


@dataclass(frozen=True)
class BudgetLimits:
    """A policy rule's own disruption budget (its `max_disrupted_nodes` / `max_disrupted_percent`)."""

    max_disrupted_nodes: int | None = None
    """At most this many of the nodes the rule's selector covers out of service at once; None: no
    count limit."""
    max_disrupted_percent: float | None = None
    """At most this share of the eligible nodes the selector covers, rounded down (10% of a 15-node
    pool is 1; of a 9-node pool, 0: nothing is disrupted there); None: no percentage limit. The
    smaller of the two applies."""


@dataclass
class _Scope:
    selector: LabelSelector | None
    limits: BudgetLimits
    covered: set[str] = field(default_factory=set)  # eligible nodes the selector matches
    matched: set[str] = field(default_factory=set)  # every node the selector matches
    others: dict[str, str] = field(default_factory=dict)  # covered node -> unschedulable / NotReady


class ScopedBudgets:
    """Each budgeted rule's disruption budget over the nodes its selector covers, as observed.

    Counted as `DisruptionBudget` counts, only within the scope: the nodes this service holds (the
    global budget's holds, whichever rule took them, dry-run holds of a dry-run service included)
    that the selector matches, plus the eligible nodes it matches that are already unschedulable or
    NotReady. The percentage is of the eligible nodes it matches (not CPU-only, control-plane or
    opted-out ones). Holds are not kept here: `check` and `usage` take the global budget's, so a
    hold given back there is given back in every scope. Until `observe` first runs a scope covers
    no node (a percentage admits none); the engine observes the nodes with every delivery that may
    act, before it decides.
    """

    name = "budget"

    def __init__(self, scopes: Mapping[str, tuple[LabelSelector | None, BudgetLimits]]) -> None:
        self._scopes = {rule: _Scope(selector=sel, limits=limits) for rule, (sel, limits) in scopes.items()}

    def __contains__(self, rule: str) -> bool:
        return rule in self._scopes

    def observe(self, nodes: Iterable[Node], settings: SafetySettings) -> None:
        """Take each scope's nodes, and those already out of service, from the cluster as it is now."""
        listed = list(nodes)
        for scope in self._scopes.values():
            sel = scope.selector
            mine = [n for n in listed if sel is None or sel.matches(n.labels)]
            scope.matched = {n.name for n in mine}
            scope.covered = {n.name for n in mine if eligible(n, settings)}
            scope.others = {
                n.name: why for n in mine if n.name in scope.covered and (why := disrupted_reason(n))
            }

    @staticmethod
    def _in_use(scope: _Scope, holds: Mapping[str, Hold]) -> int:
        held = sum(1 for n in holds if n in scope.matched and n not in scope.others)
        return len(scope.others) + held

    def _disrupted(self, scope: _Scope, holds: Mapping[str, Hold]) -> dict[str, str]:
        out = dict(scope.others)
        for node, hold in holds.items():
            if node in scope.matched:
                out[node] = f"held by accel-health ({', '.join(sorted(hold.kinds)) or 'planned'})"
        return out

    @staticmethod
    def _capacity(scope: _Scope) -> int:
        limits = scope.limits
        caps = []
        if limits.max_disrupted_nodes is not None:
            caps.append(limits.max_disrupted_nodes)
        if limits.max_disrupted_percent is not None:
            caps.append(math.floor(limits.max_disrupted_percent * len(scope.covered) / 100.0 + 1e-9))
        return min(caps) if caps else len(scope.covered)

    @classmethod
    def _limit_text(cls, scope: _Scope) -> str:
        cap = cls._capacity(scope)
        limits = scope.limits
        where = f"nodes {scope.selector}" if scope.selector is not None else "eligible nodes"
        if limits.max_disrupted_percent is not None and cap != limits.max_disrupted_nodes:
            return f"{cap} ({limits.max_disrupted_percent:g}% of {len(scope.covered)} {where}, rounded down)"
        return f"{cap} among {len(scope.covered)} {where}"

    def check(self, rule: str, node: str, holds: Mapping[str, Hold]) -> Verdict:
        """May `node` be disrupted within `rule`'s budget, given the service's holds now? A rule
        without a budget of its own is always allowed."""
        scope = self._scopes.get(rule)
        if scope is None:
            return Verdict(True, self.name, f"rule {rule!r} has no budget of its own")
        in_use = self._in_use(scope, holds)
        if node in scope.others or (node in holds and node in scope.matched):
            return Verdict(
                True,
                self.name,
                f"rule {rule!r} budget: {node} already counted ({in_use} of {self._limit_text(scope)})",
            )
        if in_use < self._capacity(scope):
            return Verdict(
                True,
                self.name,
                f"rule {rule!r} budget: {in_use + 1} of {self._limit_text(scope)} after this one",
            )
        listed = ", ".join(f"{n} {why}" for n, why in sorted(self._disrupted(scope, holds).items()))
        return Verdict(
            False,
            self.name,
            f"rule {rule!r} budget exhausted: {in_use} of {self._limit_text(scope)} already out of "
            f"service{f' ({listed})' if listed else ''}; re-evaluated when Alertmanager resends",
        )

    def describe(self, rule: str, holds: Mapping[str, Hold]) -> str:
        """The rule's budget in use now, in words (for `explain`)."""
        scope = self._scopes[rule]
        return f"rule {rule!r} budget: {self._in_use(scope, holds)} of {self._limit_text(scope)} disrupted"

    def usage(self, holds: Mapping[str, Hold]) -> dict[str, dict[str, Any]]:
        """Rule -> its budget in use now (GET /state)."""
        out = {}
        for rule, scope in self._scopes.items():
            disrupted = self._disrupted(scope, holds)
            out[rule] = {
                "selector": str(scope.selector) if scope.selector is not None else None,
                "max_disrupted_nodes": scope.limits.max_disrupted_nodes,
                "max_disrupted_percent": scope.limits.max_disrupted_percent,
                "covered_nodes": len(scope.covered),
                "in_use": len(disrupted),
                "capacity": self._capacity(scope),
                "disrupted": dict(sorted(disrupted.items())),
            }
        return out
