"""The gates every action passes, as one part the engine is handed: pause, storm breaker, order, rate
limits, the disruption budget (global and per rule) and what passed them; and the one small object
that keeps the pause switch and the breaker's latch in the cluster (remediator/gates/state.py)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping

from remediator.cluster import GatesStore, Node, StateConflict
from remediator.gates.safety import (
    DisruptionBudget,
    Hold,
    PauseSwitch,
    RateLimiter,
    ScopedBudgets,
    StormBreaker,
    Verdict,
    eligible,
)
from remediator.gates.state import StateError, gates_document, load_gates
from remediator.lifecycle.model import ActionResult, Context
from remediator.policy import DISRUPTIVE, Action, Policy, Rule

logger = logging.getLogger("remediator.decisions")

CONFLICT_ATTEMPTS = 5


class LatchStore:
    """Reads and writes the gates document (pause switch, breaker latch) through the cluster seam.

    A write carries the resourceVersion of the last read (the executor's precondition); a conflict
    means another writer (a second leader around a fail-over) was there: read again, re-apply the
    change being made, write again.
    """

    def __init__(self, *, store: GatesStore, clock: Callable[[], float]) -> None:
        self._cluster = store
        self._clock = clock
        self.writes = 0
        """Documents written (a metric for tests and benchmarks)."""

    async def load(self, pause: PauseSwitch, breaker: StormBreaker) -> None:
        """Restore both from the cluster. An unusable document pauses the service (loudly) instead
        of starting with the gates open; BackendUnavailable propagates."""
        try:
            doc = await self._cluster.load_gates()
            if doc is not None:
                load_gates(doc, pause, breaker)
        except StateError as exc:
            logger.error("stored gates are unusable (%s); PAUSED", exc)
            pause.pause(f"stored gate state unusable: {exc}; check, then POST /resume")

    async def save(
        self,
        pause: PauseSwitch,
        breaker: StormBreaker,
        *,
        reapply: Callable[[PauseSwitch, StormBreaker], object] | None = None,
    ) -> None:
        """Write both; on a conflict read the stored ones, re-apply the change, write again."""
        for attempt in range(1, CONFLICT_ATTEMPTS + 1):
            try:
                await self._cluster.save_gates(gates_document(pause, breaker))
                self.writes += 1
                return
            except StateConflict as exc:
                if attempt == CONFLICT_ATTEMPTS:
                    raise
                logger.warning("gates changed by another writer (%s); reading them again", exc)
                trips, was_open, opened_at = breaker.trips, breaker.open, breaker.opened_at
                await self.load(pause, breaker)
                # The latch of either writer holds: open if either opened it, every trip counted.
                breaker.trips = max(breaker.trips, trips)
                if was_open and not breaker.open:
                    breaker.open, breaker.opened_at = True, opened_at
                if reapply is not None:
                    reapply(pause, breaker)


class Gates:
    """Pause, storm breaker, order, rate limits and disruption budgets; pure but for the clock."""

    def __init__(self, *, policy: Policy, clock: Callable[[], float], dry_run: bool) -> None:
        safety = policy.safety
        self._safety = safety
        self._clock = clock
        self._dry_service = dry_run
        self.pause = PauseSwitch(clock=clock)
        self.breaker = StormBreaker(settings=safety.storm_breaker, clock=clock)
        self.rate = RateLimiter(limits=safety.rate_limits, clock=clock)
        self.budget = DisruptionBudget(
            max_nodes=safety.max_disrupted_nodes, max_percent=safety.max_disrupted_percent, clock=clock
        )
        self.scoped = ScopedBudgets({r.name: (r.nodes, r.budget) for r in policy.rules if r.budget})
        """The rules' own budgets over the nodes their selectors cover (observed with the nodes)."""
        self._rate_reserved: dict[str, list[tuple[str, float]]] = {}
        # node -> (kind, time) of rate-limit slots taken by a check whose action is in flight
        self.eligible_nodes: set[str] | None = None
        """The eligible nodes as last observed (None before the first observation)."""
        self._eligible: dict[str, tuple[Node, bool]] = {}
        # name -> (node object, eligible?): each node object is judged once (see NodeView.holds)

    # -- observed state ------------------------------------------------------------------------

    def observe(self, nodes: Iterable[Node], holds: Mapping[str, Hold]) -> None:
        """Take the eligible nodes, those out of service and this service's holds from the cluster
        as it is now."""
        listed = list(nodes)
        memo = self._eligible
        judged = []
        for node in listed:
            cached = memo.get(node.name)
            if cached is None or cached[0] is not node:
                cached = memo[node.name] = (node, eligible(node, self._safety))
            if cached[1]:
                judged.append(node)
        if len(memo) > 2 * len(listed) + 100:  # nodes gone: forget them now and then
            names = {n.name for n in listed}
            self._eligible = {k: v for k, v in memo.items() if k in names}
        self.eligible_nodes = {n.name for n in judged}
        self.budget.observe(judged, self._safety, holds=holds, judged=True)
        self.scoped.observe(listed, self._safety)
        self.breaker.evaluate(eligible=len(self.eligible_nodes))

    def counts(self, ctx: Context) -> bool:
        """Does this decision change the gates? Real actions do, and every decision of a dry-run
        service (so that its decisions equal a live one's); a dry-run rule in a live service does not
        use up the real budget or rate limits."""
        return not ctx.dry_run or self._dry_service

    # -- the checks, in the order the engine asks them -------------------------------------------

    def hold_everything(self, ctx: Context) -> Verdict | None:
        """The pause switch, then (firing alerts) the storm breaker."""
        verdict = self.pause.check()
        if not verdict.allowed:
            return verdict
        if ctx.alert.status == "firing":
            verdict = self.breaker.check()
            if not verdict.allowed:
                return verdict
        return None

    def precheck(self, ctx: Context, action: Action) -> ActionResult | None:
        """Checks every action passes before its own: node, protection, pause, breaker, order."""
        if ctx.node is None:
            return ActionResult("skipped", f"node {ctx.node_name} not found in the cluster")
        if ctx.protected:
            return ActionResult("skipped", ctx.protected)
        if action.type in DISRUPTIVE and ctx.refused:
            return ActionResult("skipped", f"{ctx.refused}; not run: a human decides")
        if (verdict := self.hold_everything(ctx)) is not None:
            return ActionResult("deferred", verdict.reason, gate=verdict.gate)
        if action.type in DISRUPTIVE and ctx.incomplete:
            return ActionResult("deferred", f"waits for {ctx.incomplete} to complete", gate="order")
        return None

    def check(self, ctx: Context, kind: str, node: str, *, rate: bool = True) -> ActionResult | None:
        """Rate limit (unless `rate` is false), then (disruptive actions) the budgets; None when the
        action may go ahead. An action that may go ahead is counted at once (a reservation), so that
        another node reconciled meanwhile does not take the same slot while this one's write is in
        flight; `commit` keeps it, `release` gives back what was not committed."""
        verdict = self.rate.check(kind)
        if rate and not verdict.allowed:
            return ActionResult("deferred", verdict.reason, gate=verdict.gate)
        if kind in DISRUPTIVE:
            verdict = self.budget_verdict(ctx.rule, node)
            if not verdict.allowed:
                return ActionResult("deferred", verdict.reason, gate=verdict.gate)
        if self.counts(ctx):
            if rate and (at := self.rate.commit(kind)) is not None:
                self._rate_reserved.setdefault(node, []).append((kind, at))
            if kind in DISRUPTIVE:
                self.budget.reserve(node)
        return None

    def budget_verdict(self, rule: Rule, node: str) -> Verdict:
        """The global budget, then the rule's own (the first that refuses answers)."""
        verdict = self.budget.check(node)
        if not verdict.allowed:
            return verdict
        return self.scoped.check(rule.name, node, self.budget.counted())

    def commit(self, ctx: Context, kind: str, node: str, *, rate: bool = True) -> None:
        """What passed the gates counts: the rate limit's window and (disruptive) the budget."""
        if not self.counts(ctx):
            return
        if rate:
            taken = self._rate_reserved.get(node, [])
            slot = next((item for item in taken if item[0] == kind), None)
            if slot is not None:
                taken.remove(slot)  # counted by the check already
            else:
                self.rate.commit(kind)
        if kind in DISRUPTIVE:
            self.budget.commit(node, kind=kind, dry_run=ctx.dry_run)

    def release(self, node: str) -> None:
        """The node's action was decided: what its check counted and nobody committed is given back
        (the write failed, the node was cordoned by someone else meanwhile, ...)."""
        for kind, at in self._rate_reserved.pop(node, []):
            self.rate.uncommit(kind, at)
        self.budget.unreserve(node)

    def rebuild_rate_limits(self, times: Iterable[tuple[str, float]]) -> None:
        """A new leader's rate limits: the actions the nodes' records say ran within each window."""
        self.rate.reset(times)
