"""The remediator's own metrics, in its own CollectorRegistry (nothing global)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from remediator.audit import DecisionRecord


class RemediatorMetrics:
    """accel_remediator_actions_total, accel_remediator_webhooks_total, accel_remediator_nodes_disrupted."""

    def __init__(self, *, nodes_disrupted: Callable[[], float]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.actions = Counter(
            "accel_remediator_actions",
            "Decisions per action type and outcome (planned, done, skipped, deferred, ignored, failed).",
            ["action", "outcome", "dry_run"],
            registry=self.registry,
        )
        self.webhooks = Counter(
            "accel_remediator_webhooks",
            "Alertmanager webhook deliveries by HTTP status code answered.",
            ["code"],
            registry=self.registry,
        )
        self.nodes_disrupted = Gauge(
            "accel_remediator_nodes_disrupted",
            "Nodes currently disrupted (cordoned, tainted, drained) by the remediator: the budget in use.",
            registry=self.registry,
        )
        self.nodes_disrupted.set_function(nodes_disrupted)

    def observe(self, record: DecisionRecord) -> None:
        self.actions.labels(record.action, record.outcome, str(record.dry_run).lower()).inc()

    def webhook_answered(self, code: int) -> None:
        self.webhooks.labels(str(code)).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
