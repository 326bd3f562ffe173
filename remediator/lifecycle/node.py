"""The background reconcile of one node: what no webhook delivery brings, read from the node as the watch
shows it now and converged in one write. The queue (remediator/lifecycle/queue.py) calls it under the
node's lock when the node watch saw the node change, after a resolve, after a new leader's rebuild.

- **A human wins.** This service's cordon gone (`cordoned-by` still says it was ours, the node is
  schedulable) or a taint it added removed or changed: someone else put the node back. The drain of
  the node stops at once (no eviction after it; recorded `stopped` for each alert waiting on it),
  and one write forgets the ownership, ends a drain left `in-progress` (`stopped`) and marks every
  episode recorded on the node released (nothing more is done for them, their later disruptive
  steps never run, the node is never cordoned again for them); their deferred actions are dropped,
  the budget slot is free at once. An AccelReleasedByHuman Event says so. A new alert episode starts
  afresh.
- **A drain nobody runs.** `drain-status: in-progress` on a cordoned node that this replica does
  not drain (a fail-over, a shutdown): resumed for the episodes waiting on it that fire now (with the
  rule recorded for them: the alert a record stands for carries no other label), ended as `stopped`
  when none does (the node stays cordoned, held by that cordon until its repair).
- **The record outlives nothing.** A node this service holds nothing on any more (no cordon, taint
  or drain of its own) whose recorded episodes all ended loses its record in one write.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from remediator.actuators.events import EventRecorder, NodeEvent
from remediator.audit import DecisionRecord
from remediator.cluster import Node
from remediator.desired.firing import FiringSet
from remediator.intake.payload import Alert
from remediator.lifecycle.drains import DrainRunner
from remediator.lifecycle.model import Observed
from remediator.lifecycle.record import (
    CORDONED_AT,
    CORDONED_BY,
    DRAIN_STATUS,
    TAINTS_ADDED,
    Episode,
    RecordChange,
    owned_taints,
    starts_at_text,
    taint_id,
)
from remediator.lifecycle.steps import Decisions, Reconciler
from remediator.lifecycle.view import NodeView
from remediator.policy import Drain, Policy

logger = logging.getLogger("remediator.lifecycle")

RELEASED_REASON = "AccelReleasedByHuman"


class NodeWriter(Protocol):
    """The one write this part makes: this service's annotations, with a change to the record."""

    async def annotate_node(
        self, node: str, annotations: Mapping[str, str | None], *, record: RecordChange | None = None
    ) -> None: ...


Resume = Callable[[str, list[Observed]], Awaitable[None]]
"""(node, alerts) -> decide these alerts' steps on the node (the caller holds the node's lock)."""


@dataclass(frozen=True)
class Release:
    """What a human changed that ends this service's hold on a node."""

    why: str
    """In words: `uncordoned`, `taint k:NoSchedule removed`."""
    taints: tuple[str, ...] = ()
    """`key:effect` of this service's taints no longer on the node as it set them."""


def released_by_human(view: NodeView, node: Node) -> Release | None:
    """Did someone other than this service put the node back (uncordon, taint removed or changed)?
    This service's own reversals forget the ownership in the same write, so what they leave is never
    mistaken for a human's."""
    reasons: list[str] = []
    if view.claimed_cordon(node) and not node.unschedulable:
        reasons.append("uncordoned by someone else")
    elif node.annotations.get(DRAIN_STATUS) == "in-progress" and not node.unschedulable:
        reasons.append("uncordoned by someone else during its drain")
    present = {(t.key, t.effect) for t in view.present_taints(node)}
    gone = tuple(taint_id(k, e) for k, e in view.owned_taints(node) if (k, e) not in present)
    if gone:
        reasons.append(f"taint {', '.join(gone)} removed or changed by someone else")
    if not reasons:
        return None
    return Release(why="; ".join(reasons), taints=gone)


class NodeLifecycle:
    """The queue's reconcile: a human's release, a drain nobody runs, a record nothing needs."""

    def __init__(
        self,
        *,
        policy: Policy,
        view: NodeView,
        firing: FiringSet,
        drains: DrainRunner,
        reconciler: Reconciler,
        events: EventRecorder,
        decisions: Decisions,
        writer: NodeWriter,
        observe: Callable[[], Awaitable[object]],
        resume: Resume,
        clock: Callable[[], float],
        node_label: str,
        dry_run: bool,
    ) -> None:
        self._policy = policy
        self._view = view
        self._firing = firing
        self._drains = drains
        self._reconciler = reconciler
        self._events = events
        self._decisions = decisions
        self._writer = writer
        self._observe = observe
        self._resume = resume
        self._clock = clock
        self._label = node_label
        self._dry_run = dry_run
        self.releases = 0
        """Nodes given back by a human and released (a metric for tests and benchmarks)."""

    async def __call__(self, name: str) -> None:
        """Converge one node (called under its lock)."""
        if self._dry_run:
            return  # a dry run wrote nothing: nothing to release, resume or forget
        node = await self._view.get(name)
        if node is None:
            if self._drains.stop_node(name, "the node was deleted"):
                logger.warning("%s: node deleted while its drain ran; the drain stopped", name)
            return
        release = released_by_human(self._view, node)
        if release is not None:
            await self._release(node, release)
            return
        if node.annotations.get(DRAIN_STATUS) == "in-progress" and name not in self._drains.running:
            await self._orphan_drain(node)
            return
        await self._forget_ended(node)

    # -- a human wins --------------------------------------------------------------------------

    async def _release(self, node: Node, release: Release) -> None:
        name = node.name
        record = self._view.record(node)
        stopped = self._drains.stop_node(name, f"the node was {release.why}")
        annotations: dict[str, str | None] = {}
        if self._view.claimed_cordon(node):
            annotations |= {CORDONED_BY: None, CORDONED_AT: None}
        if release.taints:
            left = sorted(t for t in owned_taints(node.annotations) if t not in release.taints)
            annotations[TAINTS_ADDED] = json.dumps(left) if left else None
        if node.annotations.get(DRAIN_STATUS) == "in-progress":
            annotations[DRAIN_STATUS] = "stopped"
        live = [e for e in record.episodes.values() if not e.released]
        change = RecordChange(
            release=True,
            phase="released",
            force=True,
            at=int(self._clock()),
            forget=self._ended(name, record),
        )
        await self._writer.annotate_node(name, annotations, record=change)
        self.releases += 1
        causes = self._firing.release(name)
        self._reconciler.held.pop(name, None)
        dropped = self._drop_pending(name, release.why)
        alertnames = sorted({e.alertname for e in live} | {c.alertname for c in causes})
        text = (
            f"{release.why}: accel-health ends the remediation of "
            f"{', '.join(alertnames) or 'the alerts recorded on it'} here"
            + ("; its drain stopped" if stopped else "")
            + "; nothing more is done for them and the node is not cordoned again for them (a new "
            "fault starts afresh)"
        )
        event = NodeEvent("Normal", RELEASED_REASON, text)
        if self._events.wanted(event):
            await self._events.write(name, [event])
        self._publish(
            name,
            text,
            alertname=", ".join(alertnames),
            details={
                "episodes": [e.fingerprint for e in live],
                "drain_stopped": stopped,
                "deferred_dropped": dropped,
                "events": [event.as_json()] if self._events.wanted(event) else [],
            },
        )
        logger.warning("%s: %s", name, text)
        await self._observe()  # the budget slot is free now, not at the next delivery

    def _drop_pending(self, node: str, why: str) -> int:
        """The deferred actions of the node's alerts will not run: said once each."""
        pending = self._reconciler.pending
        mine = [k for k, p in pending.items() if p.record.node == node]
        for key in mine:
            old = pending.pop(key).record
            self._decisions.publish(
                DecisionRecord(
                    time=self._clock(),
                    node=node,
                    action=old.action,
                    alertname=old.alertname,
                    fingerprint=old.fingerprint,
                    starts_at=old.starts_at,
                    status=old.status,
                    rule=old.rule,
                    dry_run=old.dry_run,
                    outcome="skipped",
                    reason=f"the node was {why}; the deferred action will not run",
                    gate=old.gate,
                )
            )
        return len(mine)

    # -- a drain nobody runs -------------------------------------------------------------------

    async def _orphan_drain(self, node: Node) -> None:
        waiting: list[Observed] = []
        record = self._view.record(node)
        for episode in record.episodes.values():
            rule = self._policy.rule(episode.rule)
            if episode.released or rule is None:
                continue
            following = next((i for i, _ in enumerate(rule.actions) if not episode.done(i)), None)
            if following is None or not isinstance(rule.actions[following], Drain):
                continue
            cause = self._firing.known(node.name, episode.fingerprint)
            if cause is None:
                continue  # not firing (as far as this replica knows): it does not resume the drain
            waiting.append(Observed(alert=self._alert_of(episode, node.name), node_name=node.name, rule=rule))
        if waiting:
            logger.warning("%s: resuming the drain left running by the previous leader", node.name)
            await self._resume(node.name, waiting)
            return
        text = (
            "a drain left in progress (a fail-over or a shutdown) whose alerts no longer fire: stopped; "
            "the node stays cordoned until its repair"
        )
        await self._writer.annotate_node(
            node.name,
            {DRAIN_STATUS: "stopped"},
            record=RecordChange(forget=self._ended(node.name, record)),
        )
        self._publish(node.name, text, alertname="", action="drain", outcome="stopped")

    def _alert_of(self, episode: Episode, node: str) -> Alert:
        """The firing alert a recorded episode stands for (no labels are stored but its name and node)."""
        return Alert(
            status="firing",
            labels={"alertname": episode.alertname, self._label: node},
            annotations={},
            starts_at=starts_at_text(episode.start),
            ends_at="",
            generator_url="",
            fingerprint=episode.fingerprint,
        )

    # -- the record outlives nothing -----------------------------------------------------------

    def _ended(self, node: str, record: Any) -> frozenset[tuple[str, int]]:
        """The episodes recorded on the node that fire no more (as this replica knows)."""
        out = set()
        for episode in record.episodes.values():
            cause = self._firing.known(node, episode.fingerprint)
            if cause is None:
                out.add((episode.fingerprint, episode.start))
        return frozenset(out)

    async def _forget_ended(self, node: Node) -> None:
        """Nothing of this service's holds the node and none of its episodes fires: the record goes."""
        record = self._view.record(node)
        if not record.episodes or self._view.hold(node) is not None or node.name in self._drains.running:
            return
        if len(self._ended(node.name, record)) < len(record.episodes):
            return
        await self._writer.annotate_node(node.name, {}, record=RecordChange(clear=True))
        logger.info("%s: its episodes ended and nothing holds it: its record is removed", node.name)

    # -- decision records ----------------------------------------------------------------------

    def _publish(
        self,
        node: str,
        reason: str,
        *,
        alertname: str,
        action: str = "release",
        outcome: Any = "done",
        details: Mapping[str, Any] | None = None,
    ) -> None:
        self._decisions.publish(
            DecisionRecord(
                time=self._clock(),
                node=node,
                action=action,
                alertname=alertname,
                fingerprint="",
                starts_at="",
                status="firing",
                rule=None,
                dry_run=False,
                outcome=outcome,
                reason=reason,
                details=dict(details or {}),
            )
        )
        logger.info("%s: %s %s: %s", node, action, outcome, reason)
