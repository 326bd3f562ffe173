"""The node actions: condition, cordon and uncordon, taint and untaint, Event; each reversal only of
what this service made and nobody changed since, and only when no other cause still holds it."""

from __future__ import annotations

from remediator.cluster import Node, NodeCondition, Taint
from remediator.engine.events import Events
from remediator.engine.model import ActionResult, Context
from remediator.policy import AddTaint, RemoveTaint, SetCondition


class NodeActions(Events):
    """Node actions."""

    async def _condition(self, ctx: Context, node: Node, action: SetCondition) -> ActionResult:
        status = action.status or ("True" if ctx.alert.status == "resolved" else "False")
        alertname = ctx.alert.labels.get("alertname", "AcceleratorFault")
        message = ctx.alert.annotations.get("summary") or f"{alertname} is {ctx.alert.status}"
        cond = NodeCondition(type=action.condition_type, status=status, reason=alertname, message=message)
        text = f"{cond.type}={cond.status} (reason {cond.reason})"
        if (held := self._held_by_others(ctx, f"condition:{cond.type}")) is not None:
            return held
        if any(
            c.type == cond.type and c.status == cond.status and c.reason == cond.reason
            for c in node.conditions
        ):
            return ActionResult("skipped", f"condition already {text}")
        if (held := await self._gates(ctx, "condition", node.name)) is not None:
            return held
        if not ctx.dry_run:
            await self._cluster.set_condition(node.name, cond)
        self._commit(ctx, "condition", node.name)
        return self._done(
            ctx,
            f"set condition {text}",
            would=f"would set condition {text}",
            details={"condition_type": cond.type, "status": cond.status, "message": message},
        )

    async def _cordon(self, ctx: Context, node: Node) -> ActionResult:
        if node.unschedulable:
            return ActionResult("skipped", "already cordoned (spec.unschedulable=true)")
        if (held := await self._gates(ctx, "cordon", node.name)) is not None:
            return held
        if not ctx.dry_run and not await self._cluster.cordon(node.name):
            return ActionResult("skipped", "cordoned by someone else meanwhile; left as it is, not claimed")
        if self._counts(ctx):
            self.state.ownership.add_cordon(node.name, dry_run=ctx.dry_run)
        self._commit(ctx, "cordon", node.name)
        return self._done(ctx, "cordoned", would="would cordon (spec.unschedulable=true)")

    def _forget_cordon(self, ctx: Context, node: str, why: str) -> ActionResult:
        self.state.ownership.cordoned.pop(node, None)
        self._maybe_release(ctx, node)
        self._dirty = True
        return ActionResult("skipped", why)

    def _uncordon_moot(self, ctx: Context, node: Node) -> ActionResult | None:
        """Why there is nothing to uncordon (or not now), or None."""
        if (draining := self._draining(ctx, node.name)) is not None:
            return draining
        if (held := self._held_by_others(ctx, "cordon")) is not None:
            return held
        own = self.state.ownership
        if node.name not in own.cordoned:
            return ActionResult("skipped", "not cordoned by accel-health; left as it is")
        if own.cordoned[node.name] and not ctx.dry_run:
            return ActionResult("skipped", "the cordon was only planned (dry-run); nothing to undo")
        if not own.cordoned[node.name] and not node.unschedulable:
            return self._forget_cordon(ctx, node.name, "someone already uncordoned it")
        return None

    async def _uncordon(self, ctx: Context, node: Node) -> ActionResult:
        if (moot := self._uncordon_moot(ctx, node)) is not None:
            return moot
        own = self.state.ownership
        if (held := await self._gates(ctx, "uncordon", node.name)) is not None:
            return held
        if not ctx.dry_run and not await self._cluster.uncordon(node.name):
            why = "the cordon was changed by someone else since; left as it is"
            return self._forget_cordon(ctx, node.name, why)
        if self._counts(ctx):
            own.cordoned.pop(node.name, None)
            self._commit(ctx, "uncordon", node.name)
        self._maybe_release(ctx, node.name)
        return self._done(ctx, "uncordoned", would="would uncordon (cordoned by accel-health)")

    async def _taint(self, ctx: Context, node: Node, action: AddTaint) -> ActionResult:
        taint = Taint(key=action.key, value=action.value, effect=action.effect)
        text = f"{taint.key}={taint.value}:{taint.effect}"
        if any(t.key == taint.key and t.effect == taint.effect for t in node.taints):
            return ActionResult("skipped", f"already tainted {taint.key}:{taint.effect}")
        if (held := await self._gates(ctx, "taint", node.name)) is not None:
            return held
        if not ctx.dry_run:
            await self._cluster.add_taint(node.name, taint)
        if self._counts(ctx):
            self.state.ownership.add_taint(node.name, taint, dry_run=ctx.dry_run)
        self._commit(ctx, "taint", node.name)
        return self._done(ctx, f"tainted {text}", would=f"would taint {text}", details={"taint": text})

    async def _untaint(self, ctx: Context, node: Node, action: RemoveTaint) -> ActionResult:
        if (draining := self._draining(ctx, node.name)) is not None:
            return draining
        if (held := self._held_by_others(ctx, f"taint:{action.key}")) is not None:
            return held
        own = self.state.ownership
        ours = [
            t
            for t in own.our_taints(node.name)
            if t.key == action.key and (action.effect is None or t.effect == action.effect)
        ]
        if not ours:
            return ActionResult("skipped", f"no {action.key} taint added by accel-health; left as it is")
        present = {(t.key, t.value, t.effect) for t in node.taints}
        simulated = own.tainted[node.name]
        to_remove = []
        for taint in ours:
            dry = simulated[(taint.key, taint.effect)][1]
            if dry and not ctx.dry_run:
                continue  # only planned: nothing to undo
            if not dry and (taint.key, taint.value, taint.effect) not in present:
                own.drop_taint(node.name, taint)  # removed or changed by someone else since
                self._dirty = True
                continue
            to_remove.append(taint)
        if not to_remove:
            self._maybe_release(ctx, node.name)
            return ActionResult(
                "skipped", f"{action.key} taint removed or changed by someone else since; left as it is"
            )
        if (held := await self._gates(ctx, "untaint", node.name)) is not None:
            return held
        for taint in to_remove:
            if not ctx.dry_run:
                await self._cluster.remove_taint(node.name, taint)
            if self._counts(ctx):
                own.drop_taint(node.name, taint)
        self._commit(ctx, "untaint", node.name)
        self._maybe_release(ctx, node.name)
        text = ", ".join(f"{t.key}={t.value}:{t.effect}" for t in to_remove)
        return self._done(ctx, f"removed taint {text}", would=f"would remove taint {text}")

    async def _event(self, ctx: Context) -> ActionResult:
        alertname = ctx.alert.labels.get("alertname", "AcceleratorFault")
        message = ctx.alert.annotations.get("summary") or f"{alertname} is {ctx.alert.status}"
        type_ = "Normal" if ctx.alert.status == "resolved" else "Warning"
        if (held := await self._gates(ctx, "event", ctx.node_name)) is not None:
            return held
        if not ctx.dry_run:
            await self._cluster.record_event(
                node=ctx.node_name, reason=alertname, message=message, type_=type_
            )
        self._commit(ctx, "event", ctx.node_name)
        return self._done(
            ctx,
            f"recorded {type_} event {alertname}",
            would=f"would record {type_} event {alertname}",
            details={"type": type_, "message": message},
        )
