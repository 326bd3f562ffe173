"""The gates every action passes: node and protection, pause, storm breaker, order, rate limits, the
disruption budget (reconciled with the cluster as it is), and holds of other causes still firing."""

from __future__ import annotations

import logging

from remediator.cluster import Node
from remediator.engine.model import ActionResult, Context
from remediator.engine.state_sync import StateSync
from remediator.policy import DISRUPTIVE, Action, Rule
from remediator.safety import Verdict

logger = logging.getLogger("remediator.decisions")


class Gates(StateSync):
    """Gate checks and the bookkeeping of what passed them."""

    async def _gates(self, ctx: Context, kind: str, node: str, *, rate: bool = True) -> ActionResult | None:
        """Rate limit (unless `rate` is false), then (disruptive actions) the budget; None when the
        action may go ahead."""
        verdict = self.state.rate.check(kind)
        if rate and not verdict.allowed:
            return ActionResult("deferred", verdict.reason, gate=verdict.gate)
        if kind in DISRUPTIVE:
            verdict = self._budget_verdict(ctx.rule, node)
            if not verdict.allowed and await self._reconcile_budget():
                verdict = self._budget_verdict(ctx.rule, node)
            if not verdict.allowed:
                return ActionResult("deferred", verdict.reason, gate=verdict.gate)
        return None

    def _budget_verdict(self, rule: Rule, node: str) -> Verdict:
        """The global budget, then the rule's own (the first that refuses answers)."""
        verdict = self.state.budget.check(node)
        if not verdict.allowed:
            return verdict
        return self.scoped.check(rule.name, node, self.state.budget.holders())

    def _commit(self, ctx: Context, kind: str, node: str, *, rate: bool = True) -> None:
        if not self._counts(ctx):
            return
        if rate:
            self.state.rate.commit(kind)
        if kind in DISRUPTIVE:
            self.state.budget.commit(node, kind=kind, dry_run=ctx.dry_run)
        self._dirty = True

    async def _reconcile_budget(self) -> bool:
        """Give back budget held for nodes that are no longer disrupted by this service (someone
        uncordoned them, or they are gone); once per delivery. True when something was released."""
        if self._reconciled:
            return False
        self._reconciled = True
        released = False
        for name, hold in self.state.budget.holders().items():
            if hold.dry_run:
                continue
            node = await self._cluster.get_node(name)
            why = self._still_ours(name, node, hold.kinds)
            if why is None:
                continue
            self.state.budget.release(name)
            self.state.ownership.forget(name)
            logger.info("budget: %s released (%s)", name, why)
            released = True
            self._dirty = True
        return released

    def _still_ours(self, name: str, node: Node | None, kinds: set[str]) -> str | None:
        """None while the node is still disrupted by this service, else why not."""
        if node is None:
            return "node no longer exists"
        if "aws_set_unhealthy" in kinds:
            return None  # being replaced: counted until the node object goes away
        own = self.state.ownership
        if own.cordoned.get(name) is False and not node.unschedulable:
            own.cordoned.pop(name, None)
        present = {(t.key, t.value, t.effect) for t in node.taints}
        for taint in own.our_taints(name):
            if (taint.key, taint.value, taint.effect) not in present:
                own.drop_taint(name, taint)
        if name in own.cordoned or name in own.tainted:
            return None
        return "no longer cordoned or tainted by accel-health (changed by someone else)"

    def _gate_verdict(self, ctx: Context) -> Verdict | None:
        verdict = self.state.pause.check()
        if not verdict.allowed:
            return verdict
        if ctx.alert.status == "firing":
            verdict = self.state.breaker.check()
            if not verdict.allowed:
                return verdict
        return None

    def _precheck(self, ctx: Context, action: Action) -> ActionResult | None:
        """Checks every action passes before its own: node, protection, pause, breaker, order."""
        if ctx.node is None:
            return ActionResult("skipped", f"node {ctx.node_name} not found in the cluster")
        if ctx.protected:
            return ActionResult("skipped", ctx.protected)
        if action.type in DISRUPTIVE and ctx.refused:
            return ActionResult("skipped", f"{ctx.refused}; not run: a human decides")
        if (verdict := self._gate_verdict(ctx)) is not None:
            return ActionResult("deferred", verdict.reason, gate=verdict.gate)
        if action.type in DISRUPTIVE and ctx.incomplete:
            return ActionResult("deferred", f"waits for {ctx.incomplete} to complete", gate="order")
        return None

    def _held_by_others(self, ctx: Context, hold: str) -> ActionResult | None:
        """A resolved alert's reversal waits while another alert firing on the node holds the same
        thing (cordon, taint key, condition type); it runs when none is left."""
        if ctx.alert.status != "resolved":
            return None
        causes = self.state.firing.holding(ctx.node_name, hold, besides=ctx.alert.fingerprint)
        if not causes:
            return None
        names = ", ".join(sorted({f"{c.alertname} (rule {c.rule})" for c in causes}))
        return ActionResult(
            "deferred",
            f"{hold} still held by alert(s) firing on this node: {names}; released when none is left",
            gate="hold",
        )

    def _maybe_release(self, ctx: Context, node: str) -> None:
        own = self.state.ownership
        hold = self.state.budget.holders().get(node)
        if node in own.cordoned or node in own.tainted:
            return
        if hold is not None and "aws_set_unhealthy" in hold.kinds:
            return
        if self._counts(ctx) and self.state.budget.release(node):
            self._dirty = True

    def _draining(self, ctx: Context, node: str) -> ActionResult | None:
        """Reversals wait for nothing and undo nothing while the node drains: a drain is never reversed."""
        if ctx.dry_run or node not in self._drains:
            return None
        return ActionResult("skipped", "a drain of this node is running; accel-health never reverses a drain")
