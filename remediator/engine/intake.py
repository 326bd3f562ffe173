"""Desired and observed state: a webhook delivery or Alertmanager's API view updates the alerts firing
now, the nodes are read from the cluster (a watch-backed cache), and every alert is decided."""

from __future__ import annotations

from remediator.alertmanager import AlertmanagerView
from remediator.engine.model import AlertPlan, Context, Observed
from remediator.engine.pipeline import Pipeline
from remediator.engine.stored import made_up_payload, resolved_alert
from remediator.payload import Alert, WebhookPayload
from remediator.policy import Selection
from remediator.safety import eligible, protected_reason


class Intake(Pipeline):
    """Turns deliveries and Alertmanager views into decisions."""

    async def handle(self, payload: WebhookPayload) -> list[AlertPlan]:
        """Decide (and act) on every alert of a delivery, one delivery at a time."""
        async with self._lock:
            await self._load()
            self._reconciled = False
            try:
                observed = await self._observe(payload)
                plans = [await self._handle_alert(o) for o in observed]
                await self._release_held({o.node_name for o in observed if o.alert.status == "resolved"})
                return plans
            finally:
                await self._save()

    async def reconcile(self, view: AlertmanagerView) -> list[AlertPlan]:
        """Converge on what Alertmanager shows now (remediator/alertmanager.py): decide the alerts
        active there, keep (without acting) those silenced or inhibited, and resolve those this
        service knew firing that no Alertmanager shows any more."""
        async with self._lock:
            await self._load()
            label = self.settings.node_label
            self.suppressed = {fp: s.suppressed for fp, s in view.alerts.items() if s.suppressed}
            firing = self.state.firing
            active = [s.alert for s in view.alerts.values() if not s.suppressed]
            quiet: list[Alert] = []
            for shown in view.alerts.values():
                if shown.suppressed:
                    node = shown.alert.labels.get(label, "")
                    self._dirty = firing.touch(node, shown.alert.fingerprint) or self._dirty
                    quiet.append(shown.alert)
            resolved: list[Alert] = []
            orphans: set[str] = set()
            for node, cause in firing.all():
                if cause.fingerprint in view.alerts:
                    continue
                if cause.starts_at and cause.labels:
                    resolved.append(
                        resolved_alert(cause.fingerprint, cause.labels, cause.starts_at, self._clock())
                    )
                else:  # stored before labels were kept: forget it, release what nothing else holds
                    firing.resolved(node, cause.fingerprint)
                    self._dirty = True
                    orphans.add(node)
            if orphans:
                await self._release_held(orphans)
        plans = [
            self._suppressed_plan(a, (await self._select(a, a.labels.get(label, ""))).rule) for a in quiet
        ]
        if active or resolved:
            plans += await self.handle(made_up_payload([*active, *resolved], group_key="alertmanager-api"))
        return plans

    async def _release_held(self, nodes: set[str]) -> None:
        """Decide again the reversals held back on these nodes: a hold no cause asks for any more
        is released now (the last cause resolved, or expired without a delivery)."""
        for name in sorted(nodes & set(self._held)):
            held = self._held.pop(name)
            self._dirty = self._dirty or any(not dry for _, _, dry in held)
            node = await self._cluster.get_node(name)
            for (_, _, dry_run), (alert, rule) in held.items():
                ctx = Context(  # the actions already decided are skipped (idempotency keys)
                    alert=alert,
                    node_name=name,
                    node=node,
                    rule=rule,
                    dry_run=dry_run,
                    protected=protected_reason(node, self.policy.safety) if node is not None else None,
                )
                await self._run_actions(ctx, rule.on_resolved, [])

    async def _observe(self, payload: WebhookPayload) -> list[Observed]:
        """Update the desired state (alerts firing now) from the delivery, then the observed state
        (eligible nodes, nodes out of service) and the breaker."""
        label = self.settings.node_label
        observed = []
        acting = False
        firing = self.state.firing
        for alert in payload.alerts:
            node_name = alert.labels.get(label, "")
            chosen = await self._select(alert, node_name) if node_name else Selection(None)
            rule = chosen.rule
            observed.append(
                Observed(alert=alert, node_name=node_name, rule=rule, passed_over=chosen.passed_over)
            )
            if not node_name:
                continue
            if alert.status == "resolved":
                self._dirty = firing.resolved(node_name, alert.fingerprint) or self._dirty
            elif rule is not None and rule.actions:
                alertname = alert.labels.get("alertname", "")
                changed = firing.firing(  # a resend only moves the expiry: written now and then
                    node_name,
                    fingerprint=alert.fingerprint,
                    alertname=alertname,
                    rule=rule,
                    labels=alert.labels,
                    starts_at=alert.starts_at,
                )
                self._dirty = changed or self._dirty
                acting = True
        if acting:
            await self._observe_nodes()
        if self.state.breaker.evaluate(alerting=self._alerting_nodes()):
            self._dirty = True
        return observed

    async def _observe_nodes(self) -> None:
        """The eligible nodes and those already out of service, from the cluster as it is now."""
        nodes = await self._cluster.list_nodes()
        safety = self.policy.safety
        self._eligible = {n.name for n in nodes if eligible(n, safety)}
        self.state.budget.observe(nodes, safety)
        self.scoped.observe(nodes, safety)
        self.state.breaker.evaluate(eligible=len(self._eligible))

    def _alerting_nodes(self) -> int | None:
        """Eligible nodes with a fault firing now (what the breaker counts); None before the
        cluster was first observed."""
        if self._eligible is None:
            return None
        return len(self.state.firing.nodes(among=self._eligible))
