"""Safety gates between a decision and an action (pure; time comes from an injected clock).

Gates implement the `Gate` Protocol: the engine asks every gate before a disruptive action (cordon,
taint, drain, instance replacement) and tells them when the action went ahead or the node was given
back. This issue ships the disruption budget; the storm breaker and rate limits of later issues are
further `Gate`s, and persistence (node annotations / a Lease) replaces the in-memory bookkeeping.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from remediator.cluster import Node

CONTROL_PLANE_LABELS = ("node-role.kubernetes.io/control-plane", "node-role.kubernetes.io/master")


@dataclass(frozen=True)
class SafetySettings:
    """The policy's `safety:` section."""

    max_disrupted_nodes: int = 2
    """How many nodes this service may hold disrupted (cordoned, tainted, drained) at once. Default 2:
    enough to take a broken node out while another is still draining, too few for a faulty rule to
    empty a cluster (draino #54, #89)."""
    opt_out_label: str = "accel-health.io/opt-out"
    """Nodes carrying this label with value "true" are never acted on."""


@dataclass(frozen=True)
class Verdict:
    """A gate's answer."""

    allowed: bool
    """False: the action is deferred."""
    gate: str
    """Name of the gate that answered."""
    reason: str
    """Why, in words."""


class Gate(Protocol):
    """Something that can hold back a disruptive action on a node."""

    name: str

    def check(self, node: str) -> Verdict:
        """May a disruptive action on `node` go ahead now?"""
        ...

    def commit(self, node: str) -> None:
        """A disruptive action on `node` went ahead (or would have, in dry-run)."""
        ...

    def release(self, node: str) -> bool:
        """`node` is no longer disrupted by this service; True when it was."""
        ...


def protected_reason(node: Node, settings: SafetySettings) -> str | None:
    """Why the node must never be acted on, or None."""
    for label in CONTROL_PLANE_LABELS:
        if label in node.labels:
            return f"control-plane node (label {label}); never remediated automatically"
    if node.labels.get(settings.opt_out_label, "").lower() == "true":
        return f"node opted out (label {settings.opt_out_label}=true)"
    return None


class DisruptionBudget:
    """At most `max_nodes` nodes disrupted by this service at once (in-memory; persisted later)."""

    name = "budget"

    def __init__(self, *, max_nodes: int, clock: Callable[[], float]) -> None:
        self._max = max_nodes
        self._clock = clock
        self._since: dict[str, float] = {}

    @property
    def in_use(self) -> int:
        """Nodes currently counted."""
        return len(self._since)

    @property
    def capacity(self) -> int:
        """max_disrupted_nodes"""
        return self._max

    def holders(self) -> Mapping[str, float]:
        """Node -> clock time when this service started disrupting it."""
        return dict(self._since)

    def holds(self, node: str) -> bool:
        """True when this service disrupted the node and has not given it back."""
        return node in self._since

    def check(self, node: str) -> Verdict:
        if node in self._since:
            return Verdict(
                True, self.name, f"{node} already counted ({self.in_use} of {self._max} nodes in use)"
            )
        if self.in_use < self._max:
            return Verdict(True, self.name, f"{self.in_use + 1} of {self._max} nodes in use after this one")
        now = self._clock()
        held = ", ".join(f"{n} for {now - t:.0f}s" for n, t in sorted(self._since.items()))
        return Verdict(
            False,
            self.name,
            f"disruption budget exhausted: {self.in_use} of {self._max} nodes already disrupted ({held}); "
            "re-evaluated when Alertmanager resends",
        )

    def commit(self, node: str) -> None:
        self._since.setdefault(node, self._clock())

    def release(self, node: str) -> bool:
        return self._since.pop(node, None) is not None
