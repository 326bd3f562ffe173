"""Where each node is in its lifecycle, read from the nodes alone (pure): its phase and since when, the
alert episodes recorded on it, what of this service's is on it, the next step and what that step
waits on. What `accel-health status` prints and `GET /state` serves under `nodes`: the same answer
whichever replica (or none) runs, because it is derived from the nodes' own records
(remediator/lifecycle/record.py). What only a running remediator knows (an action deferred by the budget, the
storm breaker or the pause) is added when its `GET /state` is at hand (`deferred`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from remediator.cluster import Node
from remediator.lifecycle.phases import HEALTHY, NAMES
from remediator.lifecycle.record import (
    CORDONED_BY,
    DRAIN_BLOCKED,
    DRAIN_DEADLINE,
    DRAIN_STATUS,
    EPISODES,
    MANAGER,
    TAINTS_ADDED,
    NodeRecord,
    owned_taints,
    read,
    rfc3339,
    starts_at_text,
)
from remediator.policy import Policy

REBOOTED = "accel-health.io/rebooted"
"""remediator/lifecycle/repair.py's record of a reboot asked of EC2 (read here, not imported: this
stays pure)."""
REPAIR_FAILED = "accel-health.io/repair-failed"
"""remediator/lifecycle/repair.py's record of a failed verification."""


@dataclass(frozen=True)
class EpisodeStatus:
    """One alert episode recorded on a node."""

    alertname: str
    fingerprint: str
    rule: str
    starts_at: str
    """RFC 3339, to the second."""
    done: tuple[str, ...]
    """The rule's steps decided for it, in order (AWS steps: asked for)."""
    next: str | None
    """The rule's next step not decided yet (None: all were); "(rule not in the policy)"."""
    released: bool
    """A human ended its remediation."""

    def as_json(self) -> dict[str, Any]:
        return {
            "alertname": self.alertname,
            "fingerprint": self.fingerprint,
            "rule": self.rule,
            "startsAt": self.starts_at,
            "done": list(self.done),
            "next": self.next,
            "released": self.released,
        }


@dataclass(frozen=True)
class NodeStatus:
    """A node this service holds, or holds a record on."""

    node: str
    phase: str
    """One of remediator/lifecycle/phases.py's (`held` for a record an older release wrote)."""
    since: str
    """When the node entered the phase (RFC 3339); "" when unknown."""
    marks: tuple[str, ...]
    """What of this service's is on it now: cordon, taint <key:effect>, drain <status>, replacement."""
    episodes: tuple[EpisodeStatus, ...]
    """The alert episodes recorded on it, oldest first."""
    next: str
    """The next step, in words."""
    waits_on: str
    """What the next step waits on, in words ("" when nothing but the next look)."""

    def as_json(self) -> dict[str, Any]:
        return {
            "phase": self.phase,
            "since": self.since,
            "marks": list(self.marks),
            "alerts": sorted({e.alertname for e in self.episodes}),
            "episodes": [e.as_json() for e in self.episodes],
            "next": self.next,
            "waits_on": self.waits_on,
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


def _episodes(record: NodeRecord, policy: Policy) -> list[EpisodeStatus]:
    out = []
    for ep in sorted(record.episodes.values(), key=lambda e: (e.start, e.fingerprint)):
        rule = policy.rule(ep.rule)
        if rule is None:
            done: tuple[str, ...] = ()
            following: str | None = "(rule not in the policy)"
        else:
            done = tuple(a.type for i, a in enumerate(rule.actions) if ep.done(i) and not ep.released)
            following = next((a.type for i, a in enumerate(rule.actions) if not ep.done(i)), None)
        out.append(
            EpisodeStatus(
                alertname=ep.alertname,
                fingerprint=ep.fingerprint,
                rule=ep.rule,
                starts_at=starts_at_text(ep.start) if ep.start > 0 else "",
                done=done,
                next=following,
                released=ep.released,
            )
        )
    return out


def _load(raw: str | None) -> dict[str, Any]:
    try:
        doc = json.loads(raw or "")
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) else {}


def _phase(node: Node, record: NodeRecord, marks: tuple[str, ...]) -> str:
    if record.phase:
        return record.phase
    if node.annotations.get(DRAIN_STATUS) == "in-progress":
        return "draining"
    return "held" if marks or record.episodes else HEALTHY


def _next(  # noqa: PLR0911  one answer per phase
    phase: str,
    node: Node,
    record: NodeRecord,
    episodes: list[EpisodeStatus],
    *,
    escalation_label: str,
    deferred: str,
) -> tuple[str, str]:
    """(the next step, what it waits on) of a node in `phase`."""
    annotations = node.annotations
    pending = [e.next for e in episodes if not e.released and e.next and not e.next.startswith("(")]
    if phase in ("held", "evidence") and pending:
        return pending[0], deferred
    if phase in ("held", "evidence", "repair"):
        failed = _load(annotations.get(REPAIR_FAILED))
        rebooted = _load(annotations.get(REBOOTED))
        if failed and failed.get("bootID") == node.boot_id:
            waits = f"a new repair: check {failed.get('check', '?')} failed on this boot"
        elif rebooted and rebooted.get("bootID") == node.boot_id:
            at = rebooted.get("at")
            when = rfc3339(float(at)) if isinstance(at, int | float) else "?"
            waits = f"the reboot asked of EC2 at {when} (the node has not booted since)"
        elif "aws_set_unhealthy" in record.times:
            waits = "its replacement (Auto Scaling group, or its provisioner's repair)"
        else:
            waits = "a repair: a reboot, a new node or instance (by a human or its provisioner)"
        return "verification once repaired and its alerts resolved, then the return to the pool", waits
    if phase == "draining":
        deadline = annotations.get(DRAIN_DEADLINE, "?")
        return "the drain's end", f"evictions until every pod is gone or the deadline {deadline}"
    if phase == "verifying":
        return "the return to the pool", "the active checks on the node's exporter"
    if phase == "escalated":
        if node.labels.get(escalation_label) == "true":
            return "a human", f"a human: remove the label {escalation_label} to hand it back to the loop"
        blocked = annotations.get(DRAIN_BLOCKED)
        waits = f"a human; the drain was blocked by {blocked}" if blocked else "a human"
        return "a human (uncordon to give it back)", waits
    if phase == "released":
        return "nothing: released by a human", "its alerts to resolve (the record goes then)"
    return "nothing", ""


def node_statuses(
    nodes: Iterable[Node],
    policy: Policy,
    *,
    manager: str = MANAGER,
    deferred: Mapping[str, str] | None = None,
) -> list[NodeStatus]:
    """Every node that carries this service's record or marks, by name. `deferred`: node -> the gate
    a running remediator defers its next step by, in words (from its GET /state)."""
    escalation_label = policy.repair.escalation_label
    out = []
    for node in sorted(nodes, key=lambda n: n.name):
        annotations = node.annotations
        if not (
            EPISODES in annotations
            or TAINTS_ADDED in annotations
            or annotations.get(CORDONED_BY) == manager
            or DRAIN_STATUS in annotations
        ):
            continue
        record = read(annotations)
        marks = _marks(node, record, manager)
        if not marks and not record.episodes:
            continue
        episodes = _episodes(record, policy)
        phase = _phase(node, record, marks)
        following, waits = _next(
            phase,
            node,
            record,
            episodes,
            escalation_label=escalation_label,
            deferred=(deferred or {}).get(node.name, ""),
        )
        if record.since:
            since = rfc3339(record.since)
        else:
            first = min(record.times.values(), default=None)
            since = datetime.fromtimestamp(first, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ") if first else ""
        out.append(
            NodeStatus(
                node=node.name,
                phase=phase,
                since=since,
                marks=marks,
                episodes=tuple(episodes),
                next=following,
                waits_on=waits,
            )
        )
    return out


def phase_counts(
    nodes: Iterable[Node],
    policy: Policy,
    *,
    manager: str = MANAGER,
    memo: dict[str, tuple[Node, str]] | None = None,
) -> dict[str, int]:
    """Phase -> nodes in it now (every phase listed, 0 included; `healthy` not counted). `memo`
    (node name -> (node object, phase)) spares the nodes that did not change since the last call
    (a node object is replaced, never changed, when the watch sees it change)."""
    counts = dict.fromkeys(NAMES, 0)
    seen: dict[str, tuple[Node, str]] = {}
    for node in nodes:
        hit = memo.get(node.name) if memo is not None else None
        if hit is not None and hit[0] is node:
            phase = hit[1]
        else:
            statuses = node_statuses([node], policy, manager=manager)
            phase = statuses[0].phase if statuses else HEALTHY
        seen[node.name] = (node, phase)
        if phase != HEALTHY:
            counts[phase] = counts.get(phase, 0) + 1
    if memo is not None:
        memo.clear()
        memo.update(seen)
    return counts


def as_json(statuses: Iterable[NodeStatus]) -> dict[str, Mapping[str, Any]]:
    return {s.node: s.as_json() for s in statuses}


def as_text(statuses: list[NodeStatus]) -> str:
    """A table for people: a line per node, then one per episode under it."""
    if not statuses:
        return "no node is held by accel-health\n"
    lines = []
    for s in statuses:
        alerts = ", ".join(sorted({e.alertname for e in s.episodes})) or "-"
        lines.append(
            f"{s.node}  {s.phase} since {s.since or '?'}  [{', '.join(s.marks) or 'nothing on the node now'}]"
        )
        lines.append(f"  alerts: {alerts}")
        lines.append(f"  next: {s.next}" + (f"; waits on {s.waits_on}" if s.waits_on else ""))
        for e in s.episodes:
            done = ", ".join(e.done) or "nothing yet"
            state = "released by a human" if e.released else f"done {done}; next {e.next or '-'}"
            lines.append(
                f"    {e.alertname} (rule {e.rule}, started {e.starts_at or '?'}, {e.fingerprint}): {state}"
            )
    return "\n".join(lines) + "\n"
