"""The core/v1 Events that tell a node's story in `kubectl describe node`: the fault seen, each node
action decided, a drain's end; as the policy's `events` setting wants them, never in dry-run."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from remediator.audit import Outcome
from remediator.cluster import BackendUnavailable
from remediator.engine.gates import Gates
from remediator.engine.model import ActionResult, Context, Waiter

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
}
"""Event reason of each node action done (cloudwatch_metric changes no node; `event` is one)."""


HOLD_EVERYTHING = frozenset({"pause", "breaker"})


FAILURE_REASONS = frozenset({"AccelDrainBlocked", "AccelActionFailed"})
"""The Events `events: failures` keeps."""


def action_event(action: str, outcome: Outcome, text: str, *, alertname: str) -> NodeEvent | None:
    """The Event that tells of one decided node action, or None (skipped, deferred, not a node action)."""
    if action not in DONE_REASONS:
        return None
    suffix = f" (alert {alertname})"
    if outcome == "failed":
        if action == "drain":
            return NodeEvent("Warning", "AccelDrainBlocked", text + suffix)
        return NodeEvent("Warning", "AccelActionFailed", f"{action} failed: {text}{suffix}")
    if outcome == "started" or (action == "drain" and outcome == "planned"):
        return NodeEvent("Normal", "AccelDrainStarted", "drain started: " + text + suffix)
    if outcome in ("done", "planned"):
        return NodeEvent("Normal", DONE_REASONS[action], text + suffix)
    return None


class Events(Gates):
    """Writes the Events of decisions."""

    def _fault_seen(self, ctx: Context) -> NodeEvent | None:
        """The Event that says the fault was seen: once per firing alert, with its first decision
        (`events: all` only; none on a protected or missing node, or while paused or in a storm)."""
        alert = ctx.alert
        if self.policy.events != "all" or alert.status != "firing" or ctx.node is None or ctx.protected:
            return None
        seen = (alert.fingerprint, alert.starts_at, alert.status, "fault-seen", ctx.dry_run)
        if seen in self.state.decided or self._gate_verdict(ctx) is not None:
            return None
        self.state.decided.add(seen, persist=not ctx.dry_run)
        self._dirty = self._dirty or not ctx.dry_run
        alertname = alert.labels.get("alertname", "AcceleratorFault")
        summary = alert.annotations.get("summary") or alert.annotations.get("description") or ""
        message = f"{alertname} firing" + (f": {summary}" if summary else "") + f" (rule {ctx.rule.name})"
        return NodeEvent("Warning", "AccelFaultDetected", message)

    def _action_event(self, ctx: Context, action: str, result: ActionResult) -> NodeEvent | None:
        """The Event of a decided node action, as the policy's `events` setting wants it."""
        if ctx.node is None or ctx.protected or result.gate in HOLD_EVERYTHING:
            return None
        alertname = ctx.alert.labels.get("alertname", "AcceleratorFault")
        event = action_event(action, result.outcome, result.done or result.reason, alertname=alertname)
        return event if event is not None and self._wanted(event) else None

    async def _announce(self, ctx: Context, event: NodeEvent | None) -> list[NodeEvent]:
        """Write `event` on the context's node (not in dry-run); the events for the decision record."""
        if event is None:
            return []
        if not ctx.dry_run:
            await self._write_events(ctx.node_name, [event])
        return [event]

    def _wanted(self, event: NodeEvent) -> bool:
        mode = self.policy.events
        return mode == "all" or (mode == "failures" and event.reason in FAILURE_REASONS)

    async def _drain_end_events(
        self, node: str, waiter: Waiter, outcome: Outcome, reason: str
    ) -> list[NodeEvent]:
        """Write the Event of a drain's end (finished, or blocked and by what); the ones written."""
        alert = waiter.resolved or waiter.alert
        event = action_event(
            "drain", outcome, reason, alertname=alert.labels.get("alertname", "AcceleratorFault")
        )
        if event is None or not self._wanted(event):
            return []
        await self._write_events(node, [event])
        return [event]

    async def _write_events(self, node: str, events: list[NodeEvent]) -> None:
        """Write Events; one that cannot be written is logged, never undoes or fails the action."""
        for event in events:
            try:
                await self._cluster.record_event(
                    node=node, reason=event.reason, message=event.message, type_=event.type
                )
            except BackendUnavailable as exc:
                logger.warning("%s: Event %s not written: %s", node, event.reason, exc)
