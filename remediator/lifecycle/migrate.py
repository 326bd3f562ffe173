"""Moving an older release's gate state onto the nodes, once.

Releases before this one kept everything in one document (the ConfigMap
`accel-health-remediator-state`, key `state.json`, version 1), rewritten on every delivery. A leader
that finds it reads it once and moves what still matters:

- the pause switch and the breaker's latch -> the gates document (remediator/gates/state.py), unless one
  is there already;
- every alert that held a node (`firing`, and the resolved ones whose reversals were held back) ->
  an episode in that node's record (remediator/lifecycle/record.py), its steps those whose effect the node
  shows (cordoned by this service, its taint present, the condition set, a drain recorded) and
  every step before them; a replacement asked for (`budget.<node>.kinds`) keeps the node held;
- ownership of cordons and taints, and drain progress, were on the nodes already (annotations).

What is dropped, and why it is safe: the idempotency keys (a step the node does not show is decided
again, and every action first checks the node: nothing is cordoned or tainted twice), the rate-limit
times (the limits count afresh), and documents of a version it cannot read (logged; nothing moved).
Then the document is deleted. One write per node that an alert held, one for the gates, one delete.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from remediator.cluster import GatesStore, Node, NodeWrites
from remediator.gates.state import GATES_VERSION, StateError
from remediator.lifecycle.record import (
    CORDONED_BY,
    DRAIN_STATUS,
    MANAGER,
    Episode,
    RecordChange,
    episode_start,
    owned_taints,
    taint_id,
)
from remediator.policy import AddTaint, AwsSetUnhealthy, Cordon, Drain, Policy, Rule, SetCondition

logger = logging.getLogger("remediator.migrate")

LEGACY_VERSION = 1


def evident_steps(rule: Rule, node: Node, *, alertname: str, replaced: bool) -> int:
    """The steps of `rule` the node shows were done for an alert, and every step before the last of
    them (the engine decides a rule's steps in order)."""
    ours = node.annotations.get(CORDONED_BY) == MANAGER
    taints = set(owned_taints(node.annotations))
    last = -1
    mask = 0
    for index, action in enumerate(rule.actions):
        match action:
            case Cordon():
                seen = ours and node.unschedulable
            case AddTaint():
                seen = taint_id(action.key, action.effect) in taints
            case SetCondition():
                seen = any(c.type == action.condition_type and c.reason == alertname for c in node.conditions)
            case Drain():
                seen = node.annotations.get(DRAIN_STATUS) in ("done", "timed-out", "refused")
            case AwsSetUnhealthy():
                seen = replaced
            case _:
                seen = False
        if seen:
            mask |= 1 << index
            last = index
    return mask | ((1 << (last + 1)) - 1)


def _causes(doc: Mapping[str, Any]) -> dict[str, list[tuple[str, str, str, str]]]:
    """node -> (fingerprint, rule, alertname, startsAt) of every alert the document says held it."""
    out: dict[str, list[tuple[str, str, str, str]]] = {}
    firing = doc.get("firing") or {}
    if not isinstance(firing, Mapping):
        raise StateError("firing: expected a mapping")
    for node, causes in firing.items():
        if not isinstance(causes, Mapping):
            raise StateError(f"firing.{node}: expected a mapping")
        for fp, cause in causes.items():
            if isinstance(cause, Mapping):
                out.setdefault(str(node), []).append(
                    (
                        str(fp),
                        str(cause.get("rule", "")),
                        str(cause.get("alertname", "")),
                        str(cause.get("startsAt", "")),
                    )
                )
    held = doc.get("held") or {}
    if isinstance(held, Mapping):
        for node, items in held.items():
            for item in items if isinstance(items, list) else []:
                alert = item.get("alert") if isinstance(item, Mapping) else None
                if isinstance(alert, Mapping):
                    labels = alert.get("labels") or {}
                    out.setdefault(str(node), []).append(
                        (
                            str(alert.get("fingerprint", "")),
                            str(item.get("rule", "")),
                            str(labels.get("alertname", "")) if isinstance(labels, Mapping) else "",
                            str(alert.get("startsAt", "")),
                        )
                    )
    return out


class LegacyStores(GatesStore, NodeWrites, Protocol):
    """What the move needs: the older document and the gates (GatesStore), and the nodes' records."""


async def migrate_legacy_state(*, cluster: LegacyStores, policy: Policy, nodes: Sequence[Node]) -> bool:
    """Move an older release's document onto the nodes and delete it; True when it wrote anything.
    Not called in dry-run (a dry run writes nothing)."""
    try:
        doc = await cluster.load_legacy_state()
    except StateError as exc:
        logger.error("the older release's gate state is unreadable (%s); left in place, nothing moved", exc)
        return False
    if doc is None:
        return False
    if doc and doc.get("version") != LEGACY_VERSION:
        logger.error("the older release's gate state has version %r; left in place", doc.get("version"))
        return False
    try:
        causes = _causes(doc)
    except StateError as exc:
        logger.error("the older release's gate state is unusable (%s); left in place", exc)
        return False
    by_name = {n.name: n for n in nodes}
    budget = doc.get("budget") or {}
    moved = 0
    for name, items in sorted(causes.items()):
        node = by_name.get(name)
        if node is None:
            continue
        kinds = (budget.get(name) or {}).get("kinds", []) if isinstance(budget, Mapping) else []
        replaced = isinstance(kinds, list) and "aws_set_unhealthy" in kinds
        episodes = []
        for fp, rule_name, alertname, starts_at in items:
            rule = policy.rule(rule_name)
            if rule is None or not fp:
                continue
            steps = evident_steps(rule, node, alertname=alertname, replaced=replaced)
            start = episode_start(starts_at)
            episodes.append(
                Episode(fingerprint=fp, rule=rule.name, alertname=alertname, start=start, steps=steps)
            )
        if not episodes:
            continue
        since = (budget.get(name) or {}).get("since", 0) if isinstance(budget, Mapping) else 0
        change = RecordChange(
            episodes=tuple(episodes),
            kind="aws_set_unhealthy" if replaced else "",
            at=int(since) if isinstance(since, int | float) else 0,
        )
        await cluster.annotate_node(name, {}, record=change)
        moved += 1
    gates = {key: doc[key] for key in ("pause", "breaker") if isinstance(doc.get(key), Mapping)}
    if gates and await cluster.load_gates() is None:
        breaker = {k: v for k, v in gates.get("breaker", {}).items() if k in ("open", "opened_at", "trips")}
        await cluster.save_gates(
            {"version": GATES_VERSION, "pause": gates.get("pause", {}), "breaker": breaker}
        )
    await cluster.delete_legacy_state()
    logger.warning(
        "moved the older release's gate state onto %d node(s) and deleted it (idempotency keys and "
        "rate-limit times are not carried over)",
        moved,
    )
    return True
