"""Drains in the background: one task per node, joined by every alert that asks for it.

The drain's start (cordon, deadline, the record of the episode) is written before the webhook is
answered; the evictions run in a task; its end is written with the record of every alert waiting on
it, then `on_end` (the reconciler) records the end for each and decides what follows."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

from remediator.actuators.drainplan import plan_drain
from remediator.audit import Outcome
from remediator.cluster import BackendUnavailable, DrainOutcome, Drains, DrainSettings, Node
from remediator.gates.gates import Gates
from remediator.lifecycle.model import ActionResult, Context, RunningDrain
from remediator.lifecycle.record import DRAIN_STATUS, Episode, RecordChange, episode_start
from remediator.lifecycle.view import NodeView
from remediator.policy import Drain

logger = logging.getLogger("remediator.decisions")

OnEnd = Callable[[RunningDrain, DrainOutcome | None, str, bool], Awaitable[None]]
"""(drain, outcome or None, error, final) -> record the end for each waiter, decide what follows."""


def drain_end(  # noqa: PLR0911  one return per way a drain ends
    outcome: DrainOutcome | None, error: str, *, final: bool, proceed: bool, stopped: str = ""
) -> tuple[Outcome, str, str | None, dict[str, Any]]:
    """(outcome, reason, why later disruptive actions are refused, details) of a drain's end."""
    if stopped:
        return "stopped", f"drain stopped: {stopped}", f"the drain was stopped ({stopped})", {}
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


class DrainRunner:
    """Starts drains and runs each in a background task until it ends."""

    def __init__(
        self,
        *,
        cluster: Drains,
        gates: Gates,
        view: NodeView,
        settings: DrainSettings,
        clock: Callable[[], float],
        lock: Callable[[str], contextlib.AbstractAsyncContextManager[None]],
    ) -> None:
        self._cluster = cluster
        self._gates = gates
        self._view = view
        self._settings = settings
        self._clock = clock
        self._lock = lock
        self.running: dict[str, RunningDrain] = {}
        """Node -> the drain running on it in the background."""
        self.tasks: set[asyncio.Task[None]] = set()
        """The drains' tasks, and the bookkeeping after each."""
        self.stopping = False
        self.on_end: OnEnd | None = None
        """Told of every drain's end, under the node's lock (set by the reconciler)."""

    def draining(self, node: str) -> bool:
        return node in self.running

    async def start(self, ctx: Context, node: Node, action: Drain) -> ActionResult:
        running = None if ctx.dry_run else self.running.get(node.name)
        if running is not None and (running.ending or running.ended):
            # Its end is being recorded (without this alert): it is over for a newcomer, who would
            # wait on it and never have its end recorded. A drain of its own starts (and, on a node
            # drained, ends at once).
            running = None
        if running is not None:
            # A drain resumed after a fail-over is joined again by the episodes that joined it then
            # (their earlier steps are on the node's record): told then, not again.
            told = running.resumed and bool(ctx.steps)
            return ActionResult(
                "started",
                f"joins the drain of {node.name} running since {running.as_json()['since']}; "
                "its end is recorded here too",
                details={"resumed": True} if told else {},
            )
        if self.stopping and not ctx.dry_run:
            raise BackendUnavailable("shutting down; the drain starts with the next delivery")
        # A drain started before (interrupted, or a fail-over) is resumed, not counted again.
        again = not ctx.dry_run and node.annotations.get(DRAIN_STATUS) == "in-progress"
        if (held := self._gates.check(ctx, "drain", node.name, rate=not again)) is not None:
            return held
        pods = await self._cluster.list_pods(node.name)
        pdbs = await self._cluster.list_pdbs()
        refs = {(p.namespace, c.name) for p in pods if (c := p.controller) and c.kind == "DaemonSet"}
        plan = plan_drain(
            pods,
            pdbs,
            delete_emptydir_data=action.delete_emptydir_data,
            force_bare_pods=action.force_bare_pods,
            daemonsets=await self._cluster.daemonsets_exist(refs) if refs else None,
        )
        details: dict[str, Any] = dict(plan.details())
        settings = dataclasses.replace(
            self._settings,
            timeout_seconds=float(action.timeout_seconds),
            grace_period_seconds=action.grace_period_seconds,
            delete_emptydir_data=action.delete_emptydir_data,
            force_bare_pods=action.force_bare_pods,
        )
        if ctx.dry_run:
            if not node.unschedulable and self._gates.counts(ctx):
                self._view.dry.cordoned.add(node.name)  # kubectl drain cordons first
            self._gates.commit(ctx, "drain", node.name, rate=not again)
            outcome: Outcome = "failed" if plan.needs_permission else "planned"
            return ActionResult(outcome, plan.summary(dry_run=True), details=details)
        # Cordon (kubectl drain cordons first), the deadline and the episode, in one write, now:
        # the webhook is answered after it.
        await self._cluster.start_drain(
            node.name, settings, record=ctx.record("drain", self._clock(), decided=False)
        )
        self._gates.commit(ctx, "drain", node.name, rate=not again)
        running = RunningDrain(node=node.name, since=self._clock(), settings=settings, resumed=again)
        self.running[node.name] = running
        running.task = asyncio.create_task(self._run(running), name=f"drain {node.name}")
        self.tasks.add(running.task)
        running.task.add_done_callback(self.tasks.discard)
        return ActionResult(
            "started",
            f"drain started in the background (timeout {action.timeout_seconds}s): "
            f"{plan.summary(dry_run=False)}; its end is recorded when it comes",
            details={
                **details,
                "timeout_seconds": action.timeout_seconds,
                **({"resumed": True} if again else {}),
            },
        )

    def _ended(self, running: RunningDrain, outcome: DrainOutcome) -> RecordChange:
        """The record of the drain's end: every alert still waiting on it has its drain decided, and
        the node moves on (repair), or to a human when the drain could not end as it should; also
        when every alert waiting on it resolved meanwhile (their episodes are not recorded again: the
        node is drained all the same, and its phase says so)."""
        proceed = any(
            isinstance(a := w.rule.actions[w.index], Drain) and a.on_timeout == "proceed"
            for w in running.waiters.values()
        )
        running.ending = True
        onward = outcome.completed or (outcome.timed_out and proceed)
        episodes = tuple(
            Episode(
                fingerprint=w.alert.fingerprint,
                rule=w.rule.name,
                alertname=w.alert.labels.get("alertname", ""),
                start=episode_start(w.alert.starts_at),
                steps=w.steps | 1 << w.index,
            )
            for w in running.waiters.values()
            if w.resolved is None
        )
        return RecordChange(
            episodes=episodes, phase="repair" if onward else "escalated", at=int(self._clock())
        )

    async def _run(self, running: RunningDrain) -> None:
        """The background task: drain, then (under the engine's lock) record the end."""
        outcome: DrainOutcome | None = None
        error = ""
        final = True  # decided: a resend does not start it again
        try:
            try:
                outcome = await self._cluster.drain(
                    running.node, running.settings, ended=lambda result: self._ended(running, result)
                )
            except BackendUnavailable as exc:  # NotLeader too: the next delivery starts it again
                logger.warning("drain of %s interrupted: %s", running.node, exc)
                error, final = f"{type(exc).__name__}: {exc}", False
            except asyncio.CancelledError:
                if not running.stopped:
                    logger.warning(
                        "drain of %s interrupted by shutdown; the next delivery of its alert resumes it",
                        running.node,
                    )
                    raise
                logger.warning("drain of %s stopped: %s", running.node, running.stopped)
                error = running.stopped
            except Exception as exc:  # an executor error that retrying will not fix: recorded as failed
                logger.exception("drain of %s failed", running.node)
                error = f"{type(exc).__name__}: {exc}"
            running.ended = True
            async with self._lock(running.node):
                if self.running.get(running.node) is running:
                    del self.running[running.node]
                if self.on_end is not None:
                    await self.on_end(running, outcome, error, final)
        finally:
            if self.running.get(running.node) is running:
                del self.running[running.node]

    def stop_node(self, node: str, why: str) -> bool:
        """Stop the drain of `node` now (a human uncordoned it): no eviction after this; its end is
        recorded `stopped` for each alert waiting on it, and nothing after it runs. Does not wait
        (the end's bookkeeping takes the node's lock, which the caller may hold). True when a drain
        ran."""
        running = self.running.get(node)
        if running is None or running.ended or running.task is None:
            return False
        running.stopped = why
        running.task.cancel()
        return True

    async def wait(self) -> None:
        """Until no drain runs and the bookkeeping after each is done."""
        while self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)

    async def stop(self) -> None:
        """Cancel the drains running (service shutdown); idempotent. A cancelled drain is not decided:
        the next delivery (here or on the next leader) resumes it with its original deadline."""
        self.stopping = True
        for drain in self.running.values():
            if drain.task is not None and not drain.ended:
                drain.task.cancel()
        await self.wait()
