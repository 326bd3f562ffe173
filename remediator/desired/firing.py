"""Desired state: the alerts firing now, per node (pure; time comes from an injected clock).

A webhook delivery is a trigger, not the truth: Alertmanager resends a firing alert only every
repeat_interval and zeroes its endsAt, so "a delivery arrived lately" is not "it fires now". Here a
firing alert is kept until a delivery says it resolved, or until `expiry_seconds` pass without any
delivery of it (set it above the longest repeat_interval of the routes to this service). Each entry
is a cause: the node it names, the rule that matched, and what that rule holds on the node (cordon,
taints by key, conditions by type). A hold is released only when no cause asking for it is left.

The set lives in memory. A new leader starts from the alerts whose episodes are recorded on the
nodes they hold (remediator/lifecycle/record.py), each with a fresh expiry, and from one read of
Alertmanager's API when it has one; the webhook deliveries that follow complete it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from remediator.lifecycle.record import episode_start
from remediator.policy import AddTaint, Cordon, Drain, Rule, SetCondition

DEFAULT_EXPIRY_SECONDS = 4 * 3600.0 + 600.0
"""Alertmanager's default repeat_interval (4 h) plus a group_interval and slack."""


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
    released: bool = False
    """A human ended this episode's remediation (remediator/lifecycle/record.py): it still fires, it holds
    nothing."""
    seen: float = 0.0
    """When a delivery last said it fires (``time.monotonic()``): a read of Alertmanager begun before
    that moment does not resolve it by not showing it."""

    def as_json(self) -> dict[str, Any]:
        return {
            "alertname": self.alertname,
            "rule": self.rule,
            "holds": sorted(self.holds),
            "expires": self.expires,
            "labels": dict(self.labels),
            "startsAt": self.starts_at,
            **({"released": True} if self.released else {}),
        }


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
        released: bool = False,
    ) -> None:
        """A delivery says this alert fires: (re)start its expiry. An episode a human released stays
        released (it holds nothing) for as long as it fires."""
        expires = self._clock() + self.expiry_seconds
        old = self._causes.get(node, {}).get(fingerprint)
        released = released or (
            old is not None and old.released and episode_start(old.starts_at) == episode_start(starts_at)
        )
        cause = Cause(
            fingerprint=fingerprint,
            alertname=alertname,
            rule=rule.name,
            holds=frozenset() if released else holds_of(rule),
            expires=expires,
            labels=dict(labels or {}),
            starts_at=starts_at,
            released=released,
            seen=time.monotonic(),
        )
        self._causes.setdefault(node, {})[fingerprint] = cause
        self._next_expiry = min(self._next_expiry, expires)

    def touch(self, node: str, fingerprint: str) -> None:
        """Alertmanager still shows this alert (silenced or inhibited): keep it, restart its expiry."""
        cause = self._causes.get(node, {}).get(fingerprint)
        if cause is not None:
            cause.expires = self._clock() + self.expiry_seconds

    def release(self, node: str) -> list[Cause]:
        """A human ended the remediation of every alert firing on `node`: they hold nothing from now
        on (until a new episode of one of them starts). The causes released."""
        out = []
        for cause in self._causes.get(node, {}).values():
            if not cause.released:
                cause.released = True
                cause.holds = frozenset()
                out.append(cause)
        return out

    def known(self, node: str, fingerprint: str) -> Cause | None:
        """The cause of this alert on `node`, if it fires now."""
        self._prune()
        return self._causes.get(node, {}).get(fingerprint)

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
