"""One alert through the engine: its rule, its node, then each action in order through idempotency,
the gates and the action itself; deferred actions are remembered, decided ones never again."""

from __future__ import annotations

import logging
from typing import Any

from remediator.audit import DecisionRecord
from remediator.cluster import BackendUnavailable
from remediator.engine.drains import Drains
from remediator.engine.model import ActionResult, AlertPlan, Context, Observed, Waiter
from remediator.payload import Alert
from remediator.policy import (
    DISRUPTIVE,
    Action,
    AddTaint,
    AwsReboot,
    AwsSetUnhealthy,
    CloudWatchMetric,
    Cordon,
    Drain,
    RecordEvent,
    RemoveTaint,
    Rule,
    Selection,
    SetCondition,
    Uncordon,
)
from remediator.safety import protected_reason

logger = logging.getLogger("remediator.decisions")


class Pipeline(Drains):
    """Decides one alert's actions."""

    async def _select(self, alert: Alert, node_name: str) -> Selection:
        """The rule for an alert on `node_name`: a resolve gets the rule its alert fired under (the
        node may be gone or relabelled since); node selectors look at the node as observed."""
        if alert.status == "resolved":
            fired = [c for c in self.state.firing.causes(node_name) if c.fingerprint == alert.fingerprint]
            rule = self.policy.rule(fired[0].rule) if fired else None
            if rule is not None and rule.matches(alert.labels):
                return Selection(rule)
        if not node_name or not self.policy.selects_nodes:
            return Selection(self.policy.first_match(alert.labels))
        node = await self._cluster.get_node(node_name)
        return self.policy.select(alert.labels, node, node_name=node_name)

    def _suppressed_plan(self, alert: Alert, rule: Rule | None) -> AlertPlan:
        """A silenced or inhibited alert: recorded once, nothing done, nothing undone."""
        node = alert.labels.get(self.settings.node_label) or None
        why = self.suppressed.get(alert.fingerprint, "suppressed in Alertmanager")
        rec = self._ignore(
            alert, node=node, rule=rule, reason=f"{why}: no action, and what it holds stays held"
        )
        return AlertPlan(alert, node, rule, (why,), (rec,) if rec else ())

    def _drop_pending_of_resolved(self, alert: Alert) -> list[DecisionRecord]:
        """A resolved alert's deferred firing actions will never run: say so, once each."""
        records = []
        mine = [
            k
            for k in self.pending
            if k[0] == alert.fingerprint and k[1] == alert.starts_at and k[2] == "firing"
        ]
        for key in mine:
            pending = self.pending.pop(key)
            old = pending.record
            records.append(
                self._record(
                    alert,
                    node=old.node,
                    action=old.action,
                    rule=old.rule,
                    dry_run=old.dry_run,
                    outcome="skipped",
                    reason=(
                        f"alert resolved while the action was deferred by gate {old.gate} "
                        f"({pending.evaluations} evaluation(s)); not run"
                    ),
                    gate=old.gate,
                )
            )
        return records

    async def _handle_alert(self, item: Observed) -> AlertPlan:
        alert, node_name, rule = item.alert, item.node_name, item.rule
        label = self.settings.node_label
        resolved = alert.status == "resolved"
        dropped = self._drop_pending_of_resolved(alert) if resolved else []
        if resolved:
            self._resolve_waiters(alert)
        if not node_name:
            rec = self._ignore(
                alert, node=None, rule=None, reason=f"alert has no {label!r} label; nothing to act on"
            )
            return AlertPlan(alert, None, None, (f"no {label!r} label",), (rec,) if rec else ())
        if rule is None:
            why = "; ".join(("no policy rule matches this alert", *item.passed_over))
            rec = self._ignore(alert, node=node_name, rule=None, reason=why)
            return AlertPlan(
                alert,
                node_name,
                None,
                ("no rule matched", *item.passed_over),
                (*dropped, *([rec] if rec else [])),
            )
        notes: list[str] = list(item.passed_over)
        matched = ", ".join(str(m) for m in rule.matchers) or "(matches every alert)"
        matched += f"; nodes {rule.nodes}" if rule.nodes is not None else ""
        notes.append(f"rule {rule.name!r} (rules[{rule.index}]) matched: {matched}")
        actions = rule.on_resolved if resolved else rule.actions
        if not actions:
            why = (
                f"alert resolved; rule {rule.name!r} has no on_resolved actions"
                if resolved
                else f"rule {rule.name!r} has no actions"
            )
            rec = self._ignore(alert, node=node_name, rule=rule, reason=why)
            return AlertPlan(alert, node_name, rule, (*notes, why), (*dropped, *([rec] if rec else [])))
        if resolved:
            notes.append("alert resolved: only on_resolved actions (never destructive) run")
        elif alert.fingerprint in self.suppressed:
            return self._suppressed_plan(alert, rule)
        node = await self._cluster.get_node(node_name)
        protected = protected_reason(node, self.policy.safety) if node is not None else None
        notes.append(f"protected-node check: {protected or ('node not found' if node is None else 'passed')}")
        dry_run = self.settings.dry_run or rule.dry_run
        if dry_run:
            notes.append(
                "dry-run: "
                + ("service-wide" if self.settings.dry_run else f"rule {rule.name!r} has dry_run: true")
            )
        notes.append(
            f"pause: {'PAUSED (' + self.state.pause.reason + ')' if self.state.pause.paused else 'off'}"
        )
        if not resolved:
            notes.append(self.state.breaker.describe())
        ctx = Context(
            alert=alert, node_name=node_name, node=node, rule=rule, dry_run=dry_run, protected=protected
        )
        records = [*dropped, *await self._run_actions(ctx, actions, notes)]
        notes.append(
            f"budget: {self.state.budget.in_use} of {self.state.budget.capacity} nodes disrupted by "
            "accel-health"
        )
        if rule.name in self.scoped:
            notes.append(self.scoped.describe(rule.name, self.state.budget.holders()))
        return AlertPlan(alert, node_name, rule, tuple(notes), tuple(records))

    async def _run_actions(
        self, ctx: Context, actions: tuple[Action, ...], notes: list[str], *, start: int = 0
    ) -> list[DecisionRecord]:
        alert, node_name, rule, dry_run = ctx.alert, ctx.node_name, ctx.rule, ctx.dry_run
        records: list[DecisionRecord] = []
        for index, action in enumerate(actions):
            if index < start:
                continue
            key = (alert.fingerprint, alert.starts_at, alert.status, index, action.type, dry_run)
            if key in self.state.decided:
                notes.append(f"{action.type}: already decided for this alert (idempotency)")
                continue
            running = self._drains.get(node_name)
            if running is not None and key in running.waiters:
                notes.append(
                    f"{action.type}: running in the background since {running.as_json()['since']}; "
                    "the actions after it are decided when it ends"
                )
                break
            seen = await self._announce(ctx, self._fault_seen(ctx))
            result = await self._decide_guarded(ctx, action)
            if result.gate:
                notes.append(f"{action.type}: gate {result.gate}: {result.reason}")
            if action.type in DISRUPTIVE and result.outcome in ("deferred", "failed"):
                ctx.incomplete = ctx.incomplete or action.type
            if action.type == "drain" and result.outcome == "failed":  # planned refusal (dry-run), error
                ctx.refused = ctx.refused or f"the drain failed ({result.reason})"
            events = seen + await self._announce(ctx, self._action_event(ctx, action.type, result))
            details = (
                {**result.details, "events": [e.as_json() for e in events]} if events else result.details
            )
            fields: dict[str, Any] = {
                "node": node_name,
                "action": action.type,
                "rule": rule.name,
                "dry_run": dry_run,
                "outcome": result.outcome,
                "reason": result.reason,
                "gate": result.gate,
                "details": details,
            }
            if result.outcome == "deferred":
                if result.gate == "hold":
                    held = self._held.setdefault(node_name, {})
                    if (alert.fingerprint, alert.starts_at, dry_run) not in held:
                        held[(alert.fingerprint, alert.starts_at, dry_run)] = (alert, rule)
                        self._dirty = self._dirty or not dry_run
                rec = self._defer(key, alert, fields)
                if rec is not None:
                    records.append(rec)
                continue
            if result.outcome == "started":  # decided when the drain ends, with the actions after it
                self._drains[node_name].waiters[key] = Waiter(key=key, alert=alert, rule=rule, index=index)
                self.pending.pop(key, None)
                records.append(self._record(alert, **fields))
                notes.append(f"{action.type}: the actions after it are decided when it ends")
                break
            self.pending.pop(key, None)
            self.state.decided.add(key, persist=not dry_run)
            self._dirty = self._dirty or not dry_run
            records.append(self._record(alert, **fields))
        return records

    async def _decide_guarded(self, ctx: Context, action: Action) -> ActionResult:
        """`_decide`, with the errors that retrying will not fix recorded as failed."""
        try:
            return await self._decide(ctx, action)
        except BackendUnavailable as exc:
            if not ctx.background:
                raise  # the webhook answers 503 and Alertmanager redelivers
            logger.warning("%s on %s after its drain: %s", action.type, ctx.node_name, exc)
            why = f"backend unavailable ({exc}); retried when Alertmanager resends"
            return ActionResult("deferred", why, gate="unavailable")
        except Exception as exc:  # a bug or an executor error that retrying will not fix: recorded
            logger.exception("%s on %s failed", action.type, ctx.node_name)
            return ActionResult("failed", f"{type(exc).__name__}: {exc}")

    async def _decide(self, ctx: Context, action: Action) -> ActionResult:  # noqa: PLR0911  one per action type
        if (early := self._precheck(ctx, action)) is not None:
            return early
        node = ctx.node
        assert node is not None  # _precheck skipped a missing node
        match action:
            case Cordon():
                return await self._cordon(ctx, node)
            case AddTaint():
                return await self._taint(ctx, node, action)
            case Drain():
                return await self._drain(ctx, node, action)
            case SetCondition():
                return await self._condition(ctx, node, action)
            case RecordEvent():
                return await self._event(ctx)
            case AwsSetUnhealthy():
                return await self._aws_unhealthy(ctx, node, handover=action.handover_condition)
            case AwsReboot():
                return await self._aws_reboot(ctx, node, action)
            case CloudWatchMetric():
                return await self._metric(ctx, node, action)
            case Uncordon():
                return await self._uncordon(ctx, node)
            case RemoveTaint():
                return await self._untaint(ctx, node, action)
