"""The decision engine: alerts in, decision records out, actions through the Cluster/Aws seams.

For each alert of a delivery: find the node (label configurable), the first matching policy rule,
and run its actions in order (`on_resolved` ones when the alert resolved). Every action passes, in
this order: idempotency (fingerprint, startsAt, status, action already decided -> nothing new),
protected nodes (control plane, opt-out), the target's own state (already cordoned?), ordering (a
disruptive action waits while an earlier one is incomplete), and the safety gates (disruptive
actions only). Dry-run takes exactly the same path and changes nothing in the backend.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from remediator.audit import DecidedKeys, DecisionLog, DecisionRecord, Outcome
from remediator.cluster import (
    Aws,
    Cluster,
    EvictionResult,
    Node,
    NodeCondition,
    Taint,
    instance_id_from_provider_id,
)
from remediator.drain import plan_drain
from remediator.payload import Alert, WebhookPayload
from remediator.policy import (
    DISRUPTIVE,
    Action,
    AddTaint,
    AwsSetUnhealthy,
    CloudWatchMetric,
    Cordon,
    Drain,
    Policy,
    RecordEvent,
    Rule,
    SetCondition,
    Uncordon,
)
from remediator.safety import DisruptionBudget, Gate, protected_reason

logger = logging.getLogger("remediator.decisions")


@dataclass(frozen=True)
class EngineSettings:
    """Service-wide settings of the engine."""

    dry_run: bool = False
    """Plan only: decisions are recorded with dry_run=true and the backend is never changed."""
    node_label: str = "node"
    """The alert label that names the Kubernetes node."""


@dataclass(frozen=True)
class _Result:
    outcome: Outcome
    reason: str
    gate: str | None = None
    details: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class AlertPlan:
    """What the engine made of one alert (for `explain` and tests)."""

    alert: Alert
    """The alert."""
    node: str | None
    """The node it names."""
    rule: Rule | None
    """The rule that matched."""
    notes: tuple[str, ...]
    """Which checks and gates applied, in words."""
    records: tuple[DecisionRecord, ...]
    """New decision records (empty when everything was already decided)."""


@dataclass
class _Context:
    alert: Alert
    node_name: str
    node: Node | None
    rule: Rule
    dry_run: bool
    protected: str | None
    incomplete: str | None = None  # the earlier disruptive action that did not complete


class Engine:
    """Turns webhook deliveries into decisions and actions. One per service; not thread-safe."""

    def __init__(
        self,
        *,
        policy: Policy,
        cluster: Cluster,
        aws: Aws,
        settings: EngineSettings,
        clock: Callable[[], float],
        extra_gates: Sequence[Gate] = (),
        log: DecisionLog | None = None,
        decided: DecidedKeys | None = None,
    ) -> None:
        self.policy = policy
        self.settings = settings
        self.budget = DisruptionBudget(max_nodes=policy.safety.max_disrupted_nodes, clock=clock)
        self.log = log if log is not None else DecisionLog()
        self._cluster = cluster
        self._aws = aws
        self._clock = clock
        self._gates: tuple[Gate, ...] = (self.budget, *extra_gates)
        self._decided = decided if decided is not None else DecidedKeys()
        self._listeners: list[Callable[[DecisionRecord], None]] = []
        self._cordoned_by_us: set[str] = set()
        self._lock = asyncio.Lock()

    def subscribe(self, listener: Callable[[DecisionRecord], None]) -> None:
        """Call `listener` with every new decision record (metrics, audit sinks)."""
        self._listeners.append(listener)

    async def handle(self, payload: WebhookPayload) -> list[AlertPlan]:
        """Decide (and act) on every alert of a delivery, one delivery at a time."""
        async with self._lock:
            return [await self._handle_alert(alert) for alert in payload.alerts]

    # -- per alert ---------------------------------------------------------------------------

    def _record(self, alert: Alert, **kwargs: Any) -> DecisionRecord:
        record = DecisionRecord(
            time=self._clock(),
            alertname=alert.labels.get("alertname", ""),
            fingerprint=alert.fingerprint,
            starts_at=alert.starts_at,
            status="resolved" if alert.status == "resolved" else "firing",
            **kwargs,
        )
        self.log.append(record)
        logger.info("%s", record.log_line())
        for listener in self._listeners:
            listener(record)
        return record

    def _ignore(
        self, alert: Alert, *, node: str | None, rule: Rule | None, reason: str
    ) -> DecisionRecord | None:
        key = (alert.fingerprint, alert.starts_at, alert.status, "none")
        if key in self._decided:
            return None
        self._decided.add(key)
        dry = self.settings.dry_run or (rule is not None and rule.dry_run)
        return self._record(
            alert,
            node=node,
            action="none",
            rule=rule.name if rule else None,
            dry_run=dry,
            outcome="ignored",
            reason=reason,
        )

    async def _handle_alert(self, alert: Alert) -> AlertPlan:
        label = self.settings.node_label
        node_name = alert.labels.get(label, "")
        notes: list[str] = []
        if not node_name:
            rec = self._ignore(
                alert, node=None, rule=None, reason=f"alert has no {label!r} label; nothing to act on"
            )
            return AlertPlan(alert, None, None, (f"no {label!r} label",), (rec,) if rec else ())
        rule = self.policy.first_match(alert.labels)
        if rule is None:
            rec = self._ignore(alert, node=node_name, rule=None, reason="no policy rule matches this alert")
            return AlertPlan(alert, node_name, None, ("no rule matched",), (rec,) if rec else ())
        matched = ", ".join(str(m) for m in rule.matchers) or "(matches every alert)"
        notes.append(f"rule {rule.name!r} (rules[{rule.index}]) matched: {matched}")
        resolved = alert.status == "resolved"
        actions = rule.on_resolved if resolved else rule.actions
        if not actions:
            why = (
                f"alert resolved; rule {rule.name!r} has no on_resolved actions"
                if resolved
                else f"rule {rule.name!r} has no actions"
            )
            rec = self._ignore(alert, node=node_name, rule=rule, reason=why)
            return AlertPlan(alert, node_name, rule, (*notes, why), (rec,) if rec else ())
        if resolved:
            notes.append("alert resolved: only on_resolved actions (never destructive) run")
        node = await self._cluster.get_node(node_name)
        protected = protected_reason(node, self.policy.safety) if node is not None else None
        notes.append(f"protected-node check: {protected or ('node not found' if node is None else 'passed')}")
        dry_run = self.settings.dry_run or rule.dry_run
        if dry_run:
            notes.append(
                "dry-run: "
                + ("service-wide" if self.settings.dry_run else f"rule {rule.name!r} has dry_run: true")
            )
        ctx = _Context(
            alert=alert, node_name=node_name, node=node, rule=rule, dry_run=dry_run, protected=protected
        )
        records = []
        for index, action in enumerate(actions):
            key = (alert.fingerprint, alert.starts_at, alert.status, index, action.type)
            if key in self._decided:
                notes.append(f"{action.type}: already decided for this alert (idempotency)")
                continue
            result = await self._decide(ctx, action)
            if result.gate:
                notes.append(f"{action.type}: gate {result.gate}: {result.reason}")
            if action.type in DISRUPTIVE and result.outcome in ("deferred", "failed"):
                ctx.incomplete = ctx.incomplete or action.type
            if result.outcome != "deferred":
                self._decided.add(key)
            records.append(
                self._record(
                    alert,
                    node=node_name,
                    action=action.type,
                    rule=rule.name,
                    dry_run=dry_run,
                    outcome=result.outcome,
                    reason=result.reason,
                    gate=result.gate,
                    details=result.details,
                )
            )
        notes.append(
            f"budget: {self.budget.in_use} of {self.budget.capacity} nodes disrupted by accel-health"
        )
        return AlertPlan(alert, node_name, rule, tuple(notes), tuple(records))

    # -- per action --------------------------------------------------------------------------

    def _check_gates(self, node: str) -> _Result | None:
        for gate in self._gates:
            verdict = gate.check(node)
            if not verdict.allowed:
                return _Result("deferred", verdict.reason, gate=verdict.gate)
        return None

    def _commit(self, node: str) -> None:
        for gate in self._gates:
            gate.commit(node)

    def _release(self, node: str) -> None:
        for gate in self._gates:
            gate.release(node)

    async def _decide(self, ctx: _Context, action: Action) -> _Result:  # noqa: PLR0911  one per action type
        if ctx.node is None:
            return _Result("skipped", f"node {ctx.node_name} not found in the cluster")
        if ctx.protected:
            return _Result("skipped", ctx.protected)
        if action.type in DISRUPTIVE and ctx.incomplete:
            return _Result("deferred", f"waits for {ctx.incomplete} to complete", gate="order")
        node = ctx.node
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
                return await self._aws_unhealthy(ctx, node)
            case CloudWatchMetric():
                return await self._metric(ctx, node, action)
            case Uncordon():
                return await self._uncordon(ctx, node)

    def _done(
        self, ctx: _Context, text: str, *, would: str, details: Mapping[str, Any] | None = None
    ) -> _Result:
        if ctx.dry_run:
            return _Result("planned", would, details=details or {})
        return _Result("done", text, details=details or {})

    async def _cordon(self, ctx: _Context, node: Node) -> _Result:
        if node.unschedulable:
            return _Result("skipped", "already cordoned (spec.unschedulable=true)")
        if (held := self._check_gates(node.name)) is not None:
            return held
        if not ctx.dry_run:
            await self._cluster.cordon(node.name)
        self._cordoned_by_us.add(node.name)
        self._commit(node.name)
        return self._done(ctx, "cordoned", would="would cordon (spec.unschedulable=true)")

    async def _uncordon(self, ctx: _Context, node: Node) -> _Result:
        if node.name not in self._cordoned_by_us:
            return _Result("skipped", "not cordoned by accel-health; left as it is")
        if not ctx.dry_run and not node.unschedulable:
            self._cordoned_by_us.discard(node.name)
            self._release(node.name)
            return _Result("skipped", "someone already uncordoned it")
        if not ctx.dry_run:
            await self._cluster.uncordon(node.name)
        self._cordoned_by_us.discard(node.name)
        self._release(node.name)
        return self._done(ctx, "uncordoned", would="would uncordon (cordoned by accel-health)")

    async def _taint(self, ctx: _Context, node: Node, action: AddTaint) -> _Result:
        taint = Taint(key=action.key, value=action.value, effect=action.effect)
        text = f"{taint.key}={taint.value}:{taint.effect}"
        if any(t.key == taint.key and t.effect == taint.effect for t in node.taints):
            return _Result("skipped", f"already tainted {taint.key}:{taint.effect}")
        if (held := self._check_gates(node.name)) is not None:
            return held
        if not ctx.dry_run:
            await self._cluster.add_taint(node.name, taint)
        self._commit(node.name)
        return self._done(ctx, f"tainted {text}", would=f"would taint {text}", details={"taint": text})

    async def _drain(self, ctx: _Context, node: Node, action: Drain) -> _Result:
        if (held := self._check_gates(node.name)) is not None:
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
        self._commit(node.name)
        if ctx.dry_run:
            outcome: Outcome = "failed" if plan.needs_permission else "planned"
            return _Result(outcome, plan.summary(dry_run=True), details=details)
        if not node.unschedulable and node.name not in self._cordoned_by_us:
            await self._cluster.cordon(node.name)  # kubectl drain cordons first
            self._cordoned_by_us.add(node.name)
        refused = []
        for pod in plan.evict:
            result = await self._cluster.evict_pod(
                namespace=pod.namespace, name=pod.name, grace_period_seconds=action.grace_period_seconds
            )
            if result is EvictionResult.REFUSED_BY_PDB:
                refused.append(
                    {"namespace": pod.namespace, "name": pod.name, "reason": "eviction refused (429)"}
                )
        if refused:
            details["blocked"] = [*details["blocked"], *refused]
            details["evict"] = [
                e
                for e in details["evict"]
                if not any(e["name"] == r["name"] and e["namespace"] == r["namespace"] for r in refused)
            ]
        summary = plan.summary(dry_run=False)
        if plan.needs_permission:
            return _Result("failed", f"{summary}; the rest needs a human", details=details)
        if plan.waiting_on_pdb or refused:
            return _Result(
                "deferred", f"{summary}; retried when Alertmanager resends", gate="pdb", details=details
            )
        return _Result("done", summary, details=details)

    async def _condition(self, ctx: _Context, node: Node, action: SetCondition) -> _Result:
        status = action.status or ("True" if ctx.alert.status == "resolved" else "False")
        alertname = ctx.alert.labels.get("alertname", "AcceleratorFault")
        message = ctx.alert.annotations.get("summary") or f"{alertname} is {ctx.alert.status}"
        cond = NodeCondition(type=action.condition_type, status=status, reason=alertname, message=message)
        text = f"{cond.type}={cond.status} (reason {cond.reason})"
        if any(
            c.type == cond.type and c.status == cond.status and c.reason == cond.reason
            for c in node.conditions
        ):
            return _Result("skipped", f"condition already {text}")
        if not ctx.dry_run:
            await self._cluster.set_condition(node.name, cond)
        return self._done(
            ctx,
            f"set condition {text}",
            would=f"would set condition {text}",
            details={"condition_type": cond.type, "status": cond.status, "message": message},
        )

    async def _event(self, ctx: _Context) -> _Result:
        alertname = ctx.alert.labels.get("alertname", "AcceleratorFault")
        message = ctx.alert.annotations.get("summary") or f"{alertname} is {ctx.alert.status}"
        type_ = "Normal" if ctx.alert.status == "resolved" else "Warning"
        if not ctx.dry_run:
            await self._cluster.record_event(
                node=ctx.node_name, reason=alertname, message=message, type_=type_
            )
        return self._done(
            ctx,
            f"recorded {type_} event {alertname}",
            would=f"would record {type_} event {alertname}",
            details={"type": type_, "message": message},
        )

    async def _aws_unhealthy(self, ctx: _Context, node: Node) -> _Result:
        instance = instance_id_from_provider_id(node.provider_id)
        if instance is None:
            return _Result(
                "skipped", f"no EC2 instance id in spec.providerID ({node.provider_id or 'empty'})"
            )
        if (held := self._check_gates(node.name)) is not None:
            return held
        if not ctx.dry_run:
            await self._aws.set_unhealthy(instance)
        self._commit(node.name)
        text = f"{instance} Unhealthy in its Auto Scaling group (no grace period): it gets replaced"
        return self._done(
            ctx, f"marked {text}", would=f"would mark {text}", details={"instance_id": instance}
        )

    async def _metric(self, ctx: _Context, node: Node, action: CloudWatchMetric) -> _Result:
        dims = {"node": node.name, "alertname": ctx.alert.labels.get("alertname", "")}
        instance = instance_id_from_provider_id(node.provider_id)
        if instance:
            dims["InstanceId"] = instance
        if not ctx.dry_run:
            await self._aws.put_metric(
                namespace=action.namespace, name=action.metric_name, value=1.0, dimensions=dims
            )
        text = f"{action.namespace}/{action.metric_name}=1 {dims}"
        return self._done(
            ctx, f"put metric {text}", would=f"would put metric {text}", details={"dimensions": dims}
        )
