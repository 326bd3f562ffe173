"""Drains in the background: one task per node, joined by every alert that asks for it; its end is
recorded and the later actions of each waiting alert decided at once, through the same gates."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from datetime import UTC, datetime
from typing import Any

from remediator.audit import Outcome
from remediator.cluster import BackendUnavailable, DrainOutcome, Node
from remediator.drain import plan_drain
from remediator.engine.aws_actions import AwsActions
from remediator.engine.model import ActionResult, Context, RunningDrain, Waiter
from remediator.payload import Alert
from remediator.policy import Drain
from remediator.safety import protected_reason

logger = logging.getLogger("remediator.decisions")


def drain_end(
    outcome: DrainOutcome | None, error: str, *, final: bool, proceed: bool
) -> tuple[Outcome, str, str | None, dict[str, Any]]:
    """(outcome, reason, why later disruptive actions are refused, details) of a drain's end."""
    if outcome is None:
        if final:
            return "failed", error, f"the drain failed ({error})", {}
        return (
            "failed",
            f"drain interrupted: {error}; the next delivery of the alert starts it again and it "
            "resumes with its original deadline",
            None,
            {},
        )
    details = outcome_details(outcome)
    reason = outcome.summary() + (" (resumed a drain started earlier)" if outcome.resumed else "")
    if outcome.completed:
        return "done", reason, None, details
    if outcome.timed_out and proceed:
        return (
            "failed",
            reason + "; the deadline passed and the rule says on_timeout: proceed, so the actions after "
            "it run",
            None,
            details,
        )
    if outcome.timed_out:
        return (
            "failed",
            reason + "; the deadline passed with pods left: the actions after it do not run "
            "(on_timeout: stop); a human decides",
            "the drain timed out with pods left (a PodDisruptionBudget or a pod that would not go)",
            details,
        )
    why = "; ".join(sorted({b.reason for b in outcome.blocked})) or "refused"
    return (
        "failed",
        reason + "; the drain was refused, not retried",
        f"the drain was refused ({why})",
        details,
    )


def outcome_details(outcome: DrainOutcome) -> dict[str, Any]:
    """The `details` of a drain's final record."""

    def pods(names: tuple[str, ...]) -> list[dict[str, str]]:
        return [dict(zip(("namespace", "name"), n.split("/", 1), strict=True)) for n in names]

    return {
        "evicted": pods(outcome.evicted),
        "skipped": pods(outcome.skipped),
        "blocked": [b.as_json() for b in outcome.blocked],
        "timed_out": outcome.timed_out,
        "resumed": outcome.resumed,
        "deadline": datetime.fromtimestamp(outcome.deadline, tz=UTC).isoformat(timespec="seconds"),
    }


class Drains(AwsActions):
    """Starts drains, and decides what follows when each ends."""

    async def _drain(self, ctx: Context, node: Node, action: Drain) -> ActionResult:
        running = None if ctx.dry_run else self._drains.get(node.name)
        if running is not None:
            return ActionResult(
                "started",
                f"joins the drain of {node.name} running since {running.as_json()['since']}; "
                "its end is recorded here too",
            )
        if self._stopping and not ctx.dry_run:
            raise BackendUnavailable("shutting down; the drain starts with the next delivery")
        # A drain started before (interrupted, or the process restarted) is resumed, not counted again.
        hold = self.state.budget.holders().get(node.name)
        again = not ctx.dry_run and hold is not None and not hold.dry_run and "drain" in hold.kinds
        if (held := await self._gates(ctx, "drain", node.name, rate=not again)) is not None:
            return held
        pods = await self._cluster.list_pods(node.name)
        pdbs = await self._cluster.list_pdbs()
        plan = plan_drain(
            pods,
            pdbs,
            delete_emptydir_data=action.delete_emptydir_data,
            force_bare_pods=action.force_bare_pods,
        )
        details: dict[str, Any] = dict(plan.details())
        if not node.unschedulable and node.name not in self.state.ownership.cordoned:
            mine = ctx.dry_run or await self._cluster.cordon(node.name)  # kubectl drain cordons first
            if self._counts(ctx) and mine:
                self.state.ownership.add_cordon(node.name, dry_run=ctx.dry_run)
        self._commit(ctx, "drain", node.name, rate=not again)
        if ctx.dry_run:
            outcome: Outcome = "failed" if plan.needs_permission else "planned"
            return ActionResult(outcome, plan.summary(dry_run=True), details=details)
        settings = dataclasses.replace(
            self.settings.drain,
            timeout_seconds=float(action.timeout_seconds),
            grace_period_seconds=action.grace_period_seconds,
            delete_emptydir_data=action.delete_emptydir_data,
            force_bare_pods=action.force_bare_pods,
        )
        running = RunningDrain(node=node.name, since=self._clock(), settings=settings)
        self._drains[node.name] = running
        running.task = asyncio.create_task(self._run_drain(running), name=f"drain {node.name}")
        self._tasks.add(running.task)
        running.task.add_done_callback(self._tasks.discard)
        return ActionResult(
            "started",
            f"drain started in the background (timeout {action.timeout_seconds}s): "
            f"{plan.summary(dry_run=False)}; its end is recorded when it comes",
            details={**details, "timeout_seconds": action.timeout_seconds},
        )

    async def _run_drain(self, running: RunningDrain) -> None:
        """The background task: drain, then record the end and decide each waiting alert's later actions."""
        outcome: DrainOutcome | None = None
        error = ""
        final = True  # decided: a resend does not start it again
        try:
            try:
                outcome = await self._cluster.drain(running.node, running.settings)
            except BackendUnavailable as exc:  # NotLeader too: the next delivery starts it again
                logger.warning("drain of %s interrupted: %s", running.node, exc)
                error, final = f"{type(exc).__name__}: {exc}", False
            except asyncio.CancelledError:
                logger.warning(
                    "drain of %s interrupted by shutdown; the next delivery of its alert resumes it",
                    running.node,
                )
                raise
            except Exception as exc:  # an executor error that retrying will not fix: recorded as failed
                logger.exception("drain of %s failed", running.node)
                error = f"{type(exc).__name__}: {exc}"
            running.ended = True
            async with self._lock:
                if self._drains.get(running.node) is running:
                    del self._drains[running.node]
                self._reconciled = False
                try:
                    for waiter in list(running.waiters.values()):
                        await self._drain_ended(running, waiter, outcome, error, final=final)
                finally:
                    try:
                        await self._save()
                    except BackendUnavailable as exc:
                        logger.warning(
                            "gate state not saved after the drain of %s (%s); saved with the next delivery",
                            running.node,
                            exc,
                        )
        finally:
            if self._drains.get(running.node) is running:
                del self._drains[running.node]

    async def _drain_ended(
        self, running: RunningDrain, waiter: Waiter, outcome: DrainOutcome | None, error: str, *, final: bool
    ) -> None:
        """Record how the drain ended for one alert, then decide that alert's later actions."""
        action = waiter.rule.actions[waiter.index]
        proceed = isinstance(action, Drain) and action.on_timeout == "proceed"
        result, reason, refused, details = drain_end(outcome, error, final=final, proceed=proceed)
        if final:
            self.state.decided.add(waiter.key)
            self._dirty = True
            if events := await self._drain_end_events(running.node, waiter, result, reason):
                details = {**details, "events": [e.as_json() for e in events]}
        self._record(
            waiter.resolved or waiter.alert,
            node=running.node,
            action="drain",
            rule=waiter.rule.name,
            dry_run=False,
            outcome=result,
            reason=reason,
            details=details,
        )
        if not final:
            return
        if waiter.resolved is not None:
            self._skip_after_resolved(running.node, waiter)
            return
        if waiter.index + 1 >= len(waiter.rule.actions):
            return
        try:
            node = await self._cluster.get_node(running.node)
        except BackendUnavailable as exc:
            logger.warning(
                "%s: the actions after the drain are decided with the next delivery (%s)", running.node, exc
            )
            return
        ctx = Context(
            alert=waiter.alert,
            node_name=running.node,
            node=node,
            rule=waiter.rule,
            dry_run=False,
            protected=protected_reason(node, self.policy.safety) if node is not None else None,
            refused=refused,
            background=True,
        )
        await self._run_actions(ctx, waiter.rule.actions, [], start=waiter.index + 1)

    def _skip_after_resolved(self, node: str, waiter: Waiter) -> None:
        alert, resolved = waiter.alert, waiter.resolved
        assert resolved is not None  # only called for resolved waiters
        for index, action in enumerate(waiter.rule.actions):
            if index <= waiter.index:
                continue
            key = (alert.fingerprint, alert.starts_at, alert.status, index, action.type, False)
            if key in self.state.decided:
                continue
            self.pending.pop(key, None)
            self.state.decided.add(key)
            self._dirty = True
            self._record(
                resolved,
                node=node,
                action=action.type,
                rule=waiter.rule.name,
                dry_run=False,
                outcome="skipped",
                reason="alert resolved while the drain ran; not run",
            )

    def _resolve_waiters(self, alert: Alert) -> None:
        """The alert resolved while its drain runs: the drain finishes, the later actions will not run."""
        for running in self._drains.values():
            for waiter in running.waiters.values():
                same = (waiter.alert.fingerprint, waiter.alert.starts_at) == (
                    alert.fingerprint,
                    alert.starts_at,
                )
                if same and waiter.resolved is None:
                    waiter.resolved = alert
                    logger.info(
                        "%s: alert %s resolved while its drain runs; the drain finishes, the later "
                        "actions will not run",
                        running.node,
                        alert.fingerprint,
                    )
