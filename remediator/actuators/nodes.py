"""The node actions: condition, cordon and uncordon, taint and untaint, Event. Each write carries the
node's record (remediator/lifecycle/record.py) in the same request; each reversal undoes only what
this service made and nobody changed since, and only when no other cause still holds it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from remediator.cluster import EventSink, Node, NodeCondition, NodeWrites, Taint
from remediator.desired.firing import FiringSet
from remediator.gates.gates import Gates
from remediator.lifecycle.model import ActionResult, Context
from remediator.lifecycle.view import NodeView
from remediator.policy import AddTaint, RemoveTaint, SetCondition

Quarantine = Callable[[Node, Context, str], Mapping[str, str | None]]
"""(node, context, condition status) -> the annotations the condition's own write carries: the repair
loop's record of a quarantine starting (status False), or its removal (True: the quarantine ended)."""


def done(ctx: Context, text: str, *, would: str, details: Mapping[str, Any] | None = None) -> ActionResult:
    """The result of an action done (or, in dry-run, planned)."""
    if ctx.dry_run:
        return ActionResult("planned", would, details=details or {}, done=text)
    return ActionResult("done", text, details=details or {}, done=text)


class NodeActuator:
    """Conditions, cordons, taints and Events on nodes, through the gates."""

    def __init__(
        self,
        *,
        nodes: NodeWrites,
        events: EventSink,
        view: NodeView,
        gates: Gates,
        firing: FiringSet,
        draining: Callable[[str], bool],
        taint_values: Mapping[tuple[str, str], frozenset[str]],
        clock: Callable[[], float],
        quarantine: Quarantine | None = None,
    ) -> None:
        self._cluster = nodes
        self._events = events
        self._view = view
        self._gates = gates
        self._firing = firing
        self._draining = draining
        self._taint_values = taint_values
        self._clock = clock
        self._quarantine = quarantine

    # -- holds of other causes -----------------------------------------------------------------

    def held_by_others(self, ctx: Context, hold: str) -> ActionResult | None:
        """A resolved alert's reversal waits while another alert firing on the node holds the same
        thing (cordon, taint key, condition type); it runs when none is left."""
        if ctx.alert.status != "resolved":
            return None
        causes = self._firing.holding(ctx.node_name, hold, besides=ctx.alert.fingerprint)
        if not causes:
            return None
        names = ", ".join(sorted({f"{c.alertname} (rule {c.rule})" for c in causes}))
        return ActionResult(
            "deferred",
            f"{hold} still held by alert(s) firing on this node: {names}; released when none is left",
            gate="hold",
        )

    def _drain_running(self, ctx: Context, node: str) -> ActionResult | None:
        """Reversals wait for nothing and undo nothing while the node drains: a drain is never reversed."""
        if ctx.dry_run or not self._draining(node):
            return None
        return ActionResult("skipped", "a drain of this node is running; accel-health never reverses a drain")

    async def _held_after(self, ctx: Context, name: str, write: Callable[[Node], Node]) -> bool:
        """A resolved alert's reversal: does the node keep a hold of this service once `write` (the
        node as it will be) is made? Then the write forgets no episode (see `Context.record`). The
        node is read again (from the watch cache, which has this service's own writes of this
        delivery): the context's copy is from before them."""
        if ctx.alert.status != "resolved" or ctx.dry_run:
            return False
        current = await self._view.get(name)
        return current is not None and self._view.hold(write(current)) is not None

    def _release_dry(self, ctx: Context, node: str) -> None:
        """A dry-run reversal gave the node back: its planned hold ends when nothing planned is left."""
        if ctx.dry_run and self._gates.counts(ctx) and not self._view.dry.holds(node):
            self._gates.budget.release_dry(node)

    # -- the actions ---------------------------------------------------------------------------

    async def condition(self, ctx: Context, node: Node, action: SetCondition) -> ActionResult:
        status = action.status or ("True" if ctx.alert.status == "resolved" else "False")
        alertname = ctx.alert.labels.get("alertname", "AcceleratorFault")
        message = ctx.alert.annotations.get("summary") or f"{alertname} is {ctx.alert.status}"
        cond = NodeCondition(type=action.condition_type, status=status, reason=alertname, message=message)
        text = f"{cond.type}={cond.status} (reason {cond.reason})"
        if (held := self.held_by_others(ctx, f"condition:{cond.type}")) is not None:
            return held
        if any(
            c.type == cond.type and c.status == cond.status and c.reason == cond.reason
            for c in node.conditions
        ):
            return ActionResult("skipped", f"condition already {text}")
        if (held := self._gates.check(ctx, "condition", node.name)) is not None:
            return held
        if not ctx.dry_run:
            extra = self._quarantine(node, ctx, status) if self._quarantine else None
            keeps = await self._held_after(ctx, node.name, lambda n: n)
            record = ctx.record("condition", self._clock(), held_after=keeps)
            await self._cluster.set_condition(node.name, cond, record=record, annotations=extra)
        self._gates.commit(ctx, "condition", node.name)
        return done(
            ctx,
            f"set condition {text}",
            would=f"would set condition {text}",
            details={"condition_type": cond.type, "status": cond.status, "message": message},
        )

    async def cordon(self, ctx: Context, node: Node) -> ActionResult:
        if node.unschedulable:
            return ActionResult("skipped", "already cordoned (spec.unschedulable=true)")
        if (held := self._gates.check(ctx, "cordon", node.name)) is not None:
            return held
        if not ctx.dry_run and not await self._cluster.cordon(
            node.name, record=ctx.record("cordon", self._clock())
        ):
            return ActionResult("skipped", "cordoned by someone else meanwhile; left as it is, not claimed")
        if ctx.dry_run and self._gates.counts(ctx):
            self._view.dry.cordoned.add(node.name)
        self._gates.commit(ctx, "cordon", node.name)
        return done(ctx, "cordoned", would="would cordon (spec.unschedulable=true)")

    def _uncordon_moot(self, ctx: Context, node: Node) -> ActionResult | None:
        """Why there is nothing to uncordon (or not now), or None."""
        if (draining := self._drain_running(ctx, node.name)) is not None:
            return draining
        if (held := self.held_by_others(ctx, "cordon")) is not None:
            return held
        ours = self._view.claimed_cordon(node)
        planned = node.name in self._view.dry.cordoned
        if not ours and not planned:
            return ActionResult("skipped", "not cordoned by accel-health; left as it is")
        if not ours and not ctx.dry_run:
            return ActionResult("skipped", "the cordon was only planned (dry-run); nothing to undo")
        if ours and not node.unschedulable and not planned:
            return ActionResult("skipped", "someone already uncordoned it")
        return None

    async def uncordon(self, ctx: Context, node: Node) -> ActionResult:
        if (moot := self._uncordon_moot(ctx, node)) is not None:
            return moot
        if (held := self._gates.check(ctx, "uncordon", node.name)) is not None:
            return held
        keeps = await self._held_after(ctx, node.name, lambda n: dataclasses.replace(n, unschedulable=False))
        if not ctx.dry_run and not await self._cluster.uncordon(
            node.name, record=ctx.record("uncordon", self._clock(), held_after=keeps)
        ):
            return ActionResult("skipped", "the cordon was changed by someone else since; left as it is")
        if ctx.dry_run and self._gates.counts(ctx):
            self._view.dry.cordoned.discard(node.name)
        self._gates.commit(ctx, "uncordon", node.name)
        self._release_dry(ctx, node.name)
        return done(ctx, "uncordoned", would="would uncordon (cordoned by accel-health)")

    async def taint(self, ctx: Context, node: Node, action: AddTaint) -> ActionResult:
        taint = Taint(key=action.key, value=action.value, effect=action.effect)
        text = f"{taint.key}={taint.value}:{taint.effect}"
        if any(t.key == taint.key and t.effect == taint.effect for t in node.taints):
            return ActionResult("skipped", f"already tainted {taint.key}:{taint.effect}")
        if (held := self._gates.check(ctx, "taint", node.name)) is not None:
            return held
        if not ctx.dry_run:
            await self._cluster.add_taint(node.name, taint, record=ctx.record("taint", self._clock()))
        elif self._gates.counts(ctx):
            self._view.dry.tainted.setdefault(node.name, {})[(taint.key, taint.effect)] = taint.value
        self._gates.commit(ctx, "taint", node.name)
        return done(ctx, f"tainted {text}", would=f"would taint {text}", details={"taint": text})

    def _removable(self, ctx: Context, node: Node, action: RemoveTaint) -> list[Taint] | ActionResult:
        """The taints of `action.key` this service added and nobody changed since, or why none."""

        def wanted(key: str, effect: str) -> bool:
            return key == action.key and (action.effect is None or effect == action.effect)

        present = {(t.key, t.effect): t for t in node.taints}
        live = [(k, e) for k, e in self._view.owned_taints(node) if wanted(k, e)]
        planned = {ke: v for ke, v in self._view.dry.tainted.get(node.name, {}).items() if wanted(*ke)}
        if not live and not planned:
            return ActionResult("skipped", f"no {action.key} taint added by accel-health; left as it is")
        out: list[Taint] = []
        for key, effect in live:
            taint = present.get((key, effect))
            if taint is not None and taint.value in self._taint_values.get((key, effect), ()):
                out.append(taint)  # still as this service set it (else changed by someone: left)
        if ctx.dry_run:
            out += [Taint(key=k, value=v, effect=e) for (k, e), v in planned.items() if (k, e) not in live]
        if not out:
            if not live and not ctx.dry_run:
                return ActionResult(
                    "skipped", f"the {action.key} taint was only planned (dry-run); nothing to undo"
                )
            return ActionResult(
                "skipped", f"{action.key} taint removed or changed by someone else since; left as it is"
            )
        return out

    async def untaint(self, ctx: Context, node: Node, action: RemoveTaint) -> ActionResult:
        if (draining := self._drain_running(ctx, node.name)) is not None:
            return draining
        if (held := self.held_by_others(ctx, f"taint:{action.key}")) is not None:
            return held
        to_remove = self._removable(ctx, node, action)
        if isinstance(to_remove, ActionResult):
            self._release_dry(ctx, node.name)
            return to_remove
        if (held := self._gates.check(ctx, "untaint", node.name)) is not None:
            return held
        for taint in to_remove:
            if not ctx.dry_run:

                def removed(n: Node, gone: Taint = taint) -> Node:
                    kept = tuple(t for t in n.taints if (t.key, t.effect) != (gone.key, gone.effect))
                    return dataclasses.replace(n, taints=kept)

                keeps = await self._held_after(ctx, node.name, removed)
                await self._cluster.remove_taint(
                    node.name, taint, record=ctx.record("untaint", self._clock(), held_after=keeps)
                )
            elif self._gates.counts(ctx):
                self._view.dry.tainted.get(node.name, {}).pop((taint.key, taint.effect), None)
        self._gates.commit(ctx, "untaint", node.name)
        self._release_dry(ctx, node.name)
        text = ", ".join(f"{t.key}={t.value}:{t.effect}" for t in to_remove)
        return done(ctx, f"removed taint {text}", would=f"would remove taint {text}")

    async def event(self, ctx: Context) -> ActionResult:
        alertname = ctx.alert.labels.get("alertname", "AcceleratorFault")
        message = ctx.alert.annotations.get("summary") or f"{alertname} is {ctx.alert.status}"
        type_ = "Normal" if ctx.alert.status == "resolved" else "Warning"
        if (held := self._gates.check(ctx, "event", ctx.node_name)) is not None:
            return held
        if not ctx.dry_run:
            await self._events.record_event(
                node=ctx.node_name, reason=alertname, message=message, type_=type_
            )
        self._gates.commit(ctx, "event", ctx.node_name)
        return done(
            ctx,
            f"recorded {type_} event {alertname}",
            would=f"would record {type_} event {alertname}",
            details={"type": type_, "message": message},
        )
