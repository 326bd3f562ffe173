"""Desired state: the alerts firing now, per node (pure; time comes from an injected clock).

A webhook delivery is a trigger, not the truth: Alertmanager resends a firing alert only every
repeat_interval and zeroes its endsAt, so "a delivery arrived lately" is not "it fires now". Here a
firing alert is kept until a delivery says it resolved, or until `expiry_seconds` pass without any
delivery of it (set it above the longest repeat_interval of the routes to this service). Each entry
is a cause: the node it names, the rule that matched, and what that rule holds on the node (cordon,
taints by key, conditions by type). A hold is released only when no cause asking for it is left.

The set is kept in the gate-state document, so a new leader starts from what fired before it led.
A resend of an alert already known only moves its expiry on; that is worth a write of the document
only once the expiry moved by more than `REFRESH_FRACTION` of `expiry_seconds` since it was last
written, so resends (and Alertmanager API reads every 30 s) of a storm that holds still write nothing,
and a new leader's copy expires an alert at most that fraction early.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from remediator.policy import AddTaint, Cordon, Drain, Rule, SetCondition

DEFAULT_EXPIRY_SECONDS = 4 * 3600.0 + 600.0
"""Alertmanager's default repeat_interval (4 h) plus a group_interval and slack."""
REFRESH_FRACTION = 0.01
"""How far (as a share of the expiry) a known alert's expiry moves on before the change is worth a
write: 150 s of the default policy's 15,000 s, well inside the 10 minutes of slack above a 4 h
repeat_interval."""


def holds_of(rule: Rule) -> frozenset[str]:
    """What a firing alert matched by `rule` holds on its node: `cordon`, `taint:<key>`,
    `condition:<type>` (a drain cordons, so it holds the cordon)."""
    out: set[str] = set()
    for action in rule.actions:
        match action:
            case Cordon() | Drain():
                out.add("cordon")
            case AddTaint():
                out.add(f"taint:{action.key}")
            case SetCondition():
                out.add(f"condition:{action.condition_type}")
            case _:
                pass
    return frozenset(out)


@dataclass
class Cause:
    """One firing alert on a node."""

    fingerprint: str
    """The alert's fingerprint."""
    alertname: str
    """Its alertname label (for people reading /state)."""
    rule: str
    """The policy rule that matched it."""
    holds: frozenset[str]
    """What it holds on the node (see `holds_of`)."""
    expires: float
    """Clock time after which it no longer counts without a new delivery."""
    labels: Mapping[str, str] = field(default_factory=dict)
    """The alert's labels (to decide its resolve when Alertmanager no longer shows it)."""
    starts_at: str = ""
    """Its startsAt (part of the idempotency key of that resolve)."""
    written: float = 0.0
    """The expiry as last reported worth writing (see `REFRESH_FRACTION`); not stored itself."""

    def as_json(self) -> dict[str, Any]:
        return {
            "alertname": self.alertname,
            "rule": self.rule,
            "holds": sorted(self.holds),
            "expires": self.expires,
            "labels": dict(self.labels),
            "startsAt": self.starts_at,
        }


def _same(a: Cause, b: Cause) -> bool:
    """The same alert as far as the stored document goes, expiry aside."""
    return (a.alertname, a.rule, a.holds, a.labels, a.starts_at) == (
        b.alertname,
        b.rule,
        b.holds,
        b.labels,
        b.starts_at,
    )


class FiringSet:
    """node -> fingerprint -> Cause, for the alerts firing now."""

    def __init__(self, *, clock: Callable[[], float], expiry_seconds: float = DEFAULT_EXPIRY_SECONDS) -> None:
        self._clock = clock
        self.expiry_seconds = expiry_seconds
        self._causes: dict[str, dict[str, Cause]] = {}
        self._next_expiry = math.inf

    def firing(
        self,
        node: str,
        *,
        fingerprint: str,
        alertname: str,
        rule: Rule,
        labels: Mapping[str, str] | None = None,
        starts_at: str = "",
    ) -> bool:
        """A delivery says this alert fires: (re)start its expiry. True when the stored document
        should be written: the alert is new or changed (rule, labels, startsAt), or its expiry moved
        on by more than `REFRESH_FRACTION` since last reported."""
        expires = self._clock() + self.expiry_seconds
        cause = Cause(
            fingerprint=fingerprint,
            alertname=alertname,
            rule=rule.name,
            holds=holds_of(rule),
            expires=expires,
            labels=dict(labels or {}),
            starts_at=starts_at,
        )
        old = self._causes.get(node, {}).get(fingerprint)
        if old is not None and _same(old, cause) and not self._stale(old, expires):
            cause.written, changed = old.written, False
        else:
            cause.written, changed = expires, True
        self._causes.setdefault(node, {})[fingerprint] = cause
        self._next_expiry = min(self._next_expiry, expires)
        return changed

    def _stale(self, cause: Cause, expires: float) -> bool:
        """Whether moving `cause`'s expiry to `expires` is worth a write."""
        return expires - cause.written > self.expiry_seconds * REFRESH_FRACTION

    def touch(self, node: str, fingerprint: str) -> bool:
        """Alertmanager still shows this alert (silenced or inhibited): keep it, restart its expiry.
        True when it was known and the move is worth a write (see `firing`)."""
        cause = self._causes.get(node, {}).get(fingerprint)
        if cause is None:
            return False
        cause.expires = self._clock() + self.expiry_seconds
        if not self._stale(cause, cause.expires):
            return False
        cause.written = cause.expires
        return True

    def all(self) -> list[tuple[str, Cause]]:
        """Every (node, cause) firing now."""
        self._prune()
        return [(n, c) for n, cs in self._causes.items() for c in cs.values()]

    def resolved(self, node: str, fingerprint: str) -> bool:
        """A delivery says it resolved; True when it was counted."""
        causes = self._causes.get(node)
        if causes is None or causes.pop(fingerprint, None) is None:
            return False
        if not causes:
            del self._causes[node]
        return True

    def _prune(self) -> None:
        now = self._clock()
        if self._next_expiry > now:
            return
        oldest = math.inf
        for node in list(self._causes):
            kept = {fp: c for fp, c in self._causes[node].items() if c.expires > now}
            if kept:
                self._causes[node] = kept
                oldest = min(oldest, *(c.expires for c in kept.values()))
            else:
                del self._causes[node]
        self._next_expiry = oldest

    def causes(self, node: str) -> list[Cause]:
        """The causes firing now on `node`."""
        self._prune()
        return list(self._causes.get(node, {}).values())

    def holding(self, node: str, hold: str, *, besides: str = "") -> list[Cause]:
        """Causes on `node` (other than fingerprint `besides`) that hold `hold`."""
        return [c for c in self.causes(node) if hold in c.holds and c.fingerprint != besides]

    def nodes(self, among: Iterable[str] | None = None) -> set[str]:
        """Nodes with at least one cause firing now (restricted to `among` when given)."""
        self._prune()
        if among is None:
            return set(self._causes)
        return {n for n in among if n in self._causes}

    def as_json(self) -> dict[str, dict[str, Any]]:
        self._prune()
        return {n: {fp: c.as_json() for fp, c in cs.items()} for n, cs in sorted(self._causes.items())}

    def to_state(self) -> dict[str, dict[str, Any]]:
        return self.as_json()

    def load_state(self, doc: Mapping[str, Any]) -> None:
        loaded: dict[str, dict[str, Cause]] = {}
        for node, causes in doc.items():
            if not isinstance(causes, Mapping):
                raise ValueError(f"{node}: expected a mapping of fingerprint -> cause")
            for fp, raw in causes.items():
                if not isinstance(raw, Mapping):
                    raise ValueError(f"{node}.{fp}: expected a mapping")
                expires = raw.get("expires")
                holds = raw.get("holds", [])
                labels = raw.get("labels", {})
                if not isinstance(labels, Mapping):
                    raise ValueError(f"{node}.{fp}.labels: expected a mapping")
                if isinstance(expires, bool) or not isinstance(expires, int | float):
                    raise ValueError(f"{node}.{fp}.expires: expected a number")
                if not isinstance(holds, list):
                    raise ValueError(f"{node}.{fp}.holds: expected a list")
                loaded.setdefault(str(node), {})[str(fp)] = Cause(
                    fingerprint=str(fp),
                    alertname=str(raw.get("alertname", "")),
                    rule=str(raw.get("rule", "")),
                    holds=frozenset(str(h) for h in holds),
                    expires=float(expires),
                    labels={str(k): str(v) for k, v in labels.items()},
                    starts_at=str(raw.get("startsAt", "")),
                    written=float(expires),
                )
        self._causes = loaded
        self._next_expiry = min((c.expires for cs in loaded.values() for c in cs.values()), default=math.inf)

    def merge(self, other: FiringSet) -> None:
        """Add the causes of `other` that this set lacks (used when two writers met on the document)."""
        for node, causes in other._causes.items():
            mine = self._causes.setdefault(node, {})
            for fp, cause in causes.items():
                if fp not in mine or mine[fp].expires < cause.expires:
                    mine[fp] = cause
                    self._next_expiry = min(self._next_expiry, cause.expires)
