"""The core/v1 Events that tell a node's story in `kubectl describe node`: the fault seen, each node
action decided, a drain's end; as the policy's `events` setting wants them, never in dry-run.

At most one Event per action: the Event that says a fault was seen carries the first action done
for it (`AccelFaultDetected: ... ; cordoned`), the later actions have one each."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from remediator.audit import Outcome
from remediator.cluster import BackendUnavailable, EventSink
from remediator.lifecycle.model import ActionResult, Context, Waiter
from remediator.lifecycle.record import DRAIN_STATUS, read

logger = logging.getLogger("remediator.decisions")


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


DONE_REASONS = {
    "condition": "AccelConditionSet",
    "cordon": "AccelCordoned",
    "taint": "AccelTainted",
    "drain": "AccelDrainFinished",
    "aws_set_unhealthy": "AccelInstanceMarkedUnhealthy",
    "aws_reboot": "AccelInstanceRebooted",
    "uncordon": "AccelUncordoned",
    "untaint": "AccelUntainted",
    "evidence": "AccelEvidenceCaptured",
}
"""Event reason of each node action done (cloudwatch_metric changes no node; `event` is one)."""


HOLD_EVERYTHING = frozenset({"pause", "breaker"})


ALREADY_TOLD = frozenset({"AccelFaultDetected", "AccelDrainStarted"})
"""Reasons told at most once per node and episode, whichever leader tells them: a new leader (after a
fail-over or a restart) reads from the node whether the one before told them (`already_told`)."""


FAILURE_REASONS = frozenset({"AccelDrainBlocked", "AccelActionFailed", "AccelEvidenceCaptureFailed"})
"""The Events `events: failures` keeps."""


def action_event(  # noqa: PLR0911  one return per kind of Event
    action: str, outcome: Outcome, text: str, *, alertname: str
) -> NodeEvent | None:
    """The Event that tells of one decided node action, or None (skipped, deferred, not a node action)."""
    if action not in DONE_REASONS:
        return None
    suffix = f" (alert {alertname})"
    if outcome == "failed":
        if action == "drain":
            return NodeEvent("Warning", "AccelDrainBlocked", text + suffix)
        if action == "evidence":
            return NodeEvent("Warning", "AccelEvidenceCaptureFailed", text + suffix)
        return NodeEvent("Warning", "AccelActionFailed", f"{action} failed: {text}{suffix}")
    if outcome == "started" or (action == "drain" and outcome == "planned"):
        return NodeEvent("Normal", "AccelDrainStarted", "drain started: " + text + suffix)
    if outcome in ("done", "planned"):
        return NodeEvent("Normal", DONE_REASONS[action], text + suffix)
    return None


def already_told(ctx: Context, reason: str) -> bool:
    """Does the node, as read for this decision, show that the Event of `reason` was written for the
    context's episode already (by the leader before a fail-over, or before a restart)? The fault seen
    is told with the first step decided for the episode, whose write records the episode; the start
    of a drain (or the join) is told for an episode recorded with every step before it decided while
    the drain is in progress (the episodes a new leader resumes the drain for, lifecycle/node.py)."""
    if reason not in ALREADY_TOLD or ctx.node is None or ctx.dry_run or ctx.alert.status != "firing":
        return False
    annotations = ctx.node.annotations
    episode = read(annotations).episode(ctx.alert.fingerprint, ctx.start)
    if episode is None:
        return False
    if reason == "AccelFaultDetected":
        return True
    waits = all(episode.done(i) for i in range(ctx.index)) and not episode.done(ctx.index)
    return waits and annotations.get(DRAIN_STATUS) == "in-progress"


class EventRecorder:
    """Writes the Events of decisions, as the policy's `events` setting wants them."""

    def __init__(self, *, sink: EventSink, mode: str, seen: Callable[[tuple[object, ...]], bool]) -> None:
        self._sink = sink
        self.mode = mode
        """all, failures or none (the policy's `events`)."""
        self._seen = seen
        """True the first time a key is asked (and remembers it): idempotency's memory."""

    def fault_seen(self, ctx: Context, *, held: bool) -> NodeEvent | None:
        """The Event that says the fault was seen: once per firing alert, with its first decision
        (`events: all` only; none on a protected or missing node, or while `held` by the pause or
        the storm breaker; none after a fail-over for an episode whose steps the node's record
        shows)."""
        alert = ctx.alert
        if self.mode != "all" or alert.status != "firing" or ctx.node is None or ctx.protected or held:
            return None
        if ctx.steps or ctx.intent:
            return None  # a step of the episode was decided (here, or by an earlier leader: the node's
            # record says so), and the Event of the first one told of the fault
        if not self._seen((alert.fingerprint, ctx.start, alert.status, "fault-seen", ctx.dry_run)):
            return None  # told already
        if already_told(ctx, "AccelFaultDetected"):
            return None
        alertname = alert.labels.get("alertname", "AcceleratorFault")
        summary = alert.annotations.get("summary") or alert.annotations.get("description") or ""
        message = f"{alertname} firing" + (f": {summary}" if summary else "") + f" (rule {ctx.rule.name})"
        return NodeEvent("Warning", "AccelFaultDetected", message)

    def action_event(self, ctx: Context, action: str, result: ActionResult) -> NodeEvent | None:
        """The Event of a decided node action, as the policy's `events` setting wants it."""
        if ctx.node is None or ctx.protected or result.gate in HOLD_EVERYTHING:
            return None
        if result.details.get("resumed"):
            return None  # decided before (a drain started, an AWS call asked for by an earlier
            # leader): its Event was told then
        alertname = ctx.alert.labels.get("alertname", "AcceleratorFault")
        event = action_event(action, result.outcome, result.done or result.reason, alertname=alertname)
        if event is None or not self.wanted(event) or already_told(ctx, event.reason):
            return None
        return event

    @staticmethod
    def combine(seen: NodeEvent | None, event: NodeEvent | None) -> list[NodeEvent]:
        """One Event per action: the fault seen carries the first action done for it; a failure
        keeps an Event of its own (the `events: failures` mode lists those)."""
        if seen is None:
            return [event] if event is not None else []
        if event is None:
            return [seen]
        if event.type == "Normal":
            return [NodeEvent(seen.type, seen.reason, f"{seen.message}; {event.message}")]
        return [seen, event]

    async def announce(self, ctx: Context, events: list[NodeEvent]) -> list[NodeEvent]:
        """Write `events` on the context's node (not in dry-run); the events for the decision record."""
        if events and not ctx.dry_run:
            await self.write(ctx.node_name, events)
        return events

    def wanted(self, event: NodeEvent) -> bool:
        return self.mode == "all" or (self.mode == "failures" and event.reason in FAILURE_REASONS)

    async def drain_end(self, node: str, waiter: Waiter, outcome: Outcome, reason: str) -> list[NodeEvent]:
        """Write the Event of a drain's end (finished, or blocked and by what); the ones written."""
        alert = waiter.resolved or waiter.alert
        event = action_event(
            "drain", outcome, reason, alertname=alert.labels.get("alertname", "AcceleratorFault")
        )
        if event is None or not self.wanted(event):
            return []
        await self.write(node, [event])
        return [event]

    async def write(self, node: str, events: list[NodeEvent]) -> None:
        """Write Events; one that cannot be written is logged, never undoes or fails the action."""
        for event in events:
            try:
                await self._sink.record_event(
                    node=node, reason=event.reason, message=event.message, type_=event.type
                )
            except BackendUnavailable as exc:
                logger.warning("%s: Event %s not written: %s", node, event.reason, exc)
