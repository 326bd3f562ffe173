"""The nodes this service holds, read from the nodes alone (pure): which alert episodes hold each, since
when, what was done for each and what comes next. What `accel-health-remediator holds` prints and
`GET /state` serves under `holds`: the same answer whichever replica (or none) is running, because
it is derived from the nodes' own records (remediator/lifecycle/record.py), not from a process's memory."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from remediator.cluster import Node
from remediator.lifecycle.record import (
    CORDONED_BY,
    DRAIN_STATUS,
    EPISODES,
    MANAGER,
    TAINTS_ADDED,
    NodeRecord,
    owned_taints,
    read,
    starts_at_text,
)
from remediator.policy import Policy


@dataclass(frozen=True)
class HeldEpisode:
    """One alert episode recorded on a node."""

    alertname: str
    """Its alertname."""
    fingerprint: str
    """Its fingerprint."""
    rule: str
    """The policy rule it fired under."""
    starts_at: str
    """Its startsAt (RFC 3339, to the second)."""
    done: tuple[str, ...]
    """The rule's actions decided for it, in order (AWS actions: asked for)."""
    next: str | None
    """The next action of the rule not decided yet (None: all were); "(rule not in the policy)" when
    the policy no longer has the rule."""

    def as_json(self) -> dict[str, Any]:
        return {
            "alertname": self.alertname,
            "fingerprint": self.fingerprint,
            "rule": self.rule,
            "startsAt": self.starts_at,
            "done": list(self.done),
            "next": self.next,
        }


@dataclass(frozen=True)
class HeldNode:
    """A node this service holds (or holds a record on)."""

    node: str
    """The node."""
    since: str
    """When this service first acted on it (RFC 3339), as its record says; "" when unknown."""
    marks: tuple[str, ...]
    """What of this service's is on it now: cordon, taint <key:effect>, drain <status>, replacement."""
    episodes: tuple[HeldEpisode, ...]
    """The alert episodes recorded on it, oldest first."""

    def as_json(self) -> dict[str, Any]:
        return {
            "since": self.since,
            "marks": list(self.marks),
            "episodes": [e.as_json() for e in self.episodes],
        }


def _marks(node: Node, record: NodeRecord, manager: str) -> tuple[str, ...]:
    marks = []
    annotations = node.annotations
    if node.unschedulable and annotations.get(CORDONED_BY) == manager:
        marks.append("cordon")
    present = {(t.key, t.effect) for t in node.taints}
    for tid in owned_taints(annotations):
        key, _, effect = tid.rpartition(":")
        if (key, effect) in present:
            marks.append(f"taint {tid}")
    if status := annotations.get(DRAIN_STATUS):
        marks.append(f"drain {status}")
    if "aws_set_unhealthy" in record.times:
        marks.append("replacement asked")
    return tuple(marks)


def held_nodes(nodes: Iterable[Node], policy: Policy, *, manager: str = MANAGER) -> list[HeldNode]:
    """Every node that carries this service's record or marks, by name."""
    rules = {r.name: r for r in policy.rules}
    out = []
    for node in sorted(nodes, key=lambda n: n.name):
        annotations = node.annotations
        if not (
            EPISODES in annotations or TAINTS_ADDED in annotations or annotations.get(CORDONED_BY) == manager
        ):
            continue
        record = read(annotations)
        marks = _marks(node, record, manager)
        if not marks and not record.episodes:
            continue
        episodes = []
        for ep in sorted(record.episodes.values(), key=lambda e: (e.start, e.fingerprint)):
            rule = rules.get(ep.rule)
            if rule is None:
                done: tuple[str, ...] = ()
                following: str | None = "(rule not in the policy)"
            else:
                done = tuple(a.type for i, a in enumerate(rule.actions) if ep.done(i))
                following = next((a.type for i, a in enumerate(rule.actions) if not ep.done(i)), None)
            episodes.append(
                HeldEpisode(
                    alertname=ep.alertname,
                    fingerprint=ep.fingerprint,
                    rule=ep.rule,
                    starts_at=starts_at_text(ep.start) if ep.start > 0 else "",
                    done=done,
                    next=following,
                )
            )
        first = min(record.times.values(), default=None)
        since = datetime.fromtimestamp(first, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ") if first else ""
        out.append(HeldNode(node=node.name, since=since, marks=marks, episodes=tuple(episodes)))
    return out


def as_json(held: Iterable[HeldNode]) -> dict[str, Mapping[str, Any]]:
    return {h.node: h.as_json() for h in held}


def as_text(held: list[HeldNode]) -> str:
    """A table for people: one line per episode under its node."""
    if not held:
        return "no node is held by accel-health\n"
    lines = []
    for h in held:
        lines.append(f"{h.node}  since {h.since or '?'}  [{', '.join(h.marks) or 'nothing on the node now'}]")
        for e in h.episodes:
            done = ", ".join(e.done) or "nothing yet"
            lines.append(
                f"  {e.alertname} (rule {e.rule}, started {e.starts_at or '?'}, {e.fingerprint}): "
                f"done {done}; next {e.next or '-'}"
            )
    return "\n".join(lines) + "\n"
