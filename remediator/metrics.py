"""The remediator's own metrics, in its own CollectorRegistry (nothing global).

Counters for decisions and webhook answers; the gates (budget, breaker, pause, deferred actions) are
read from the engine on every scrape by a custom collector, so they can never drift from the truth.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from remediator.actuators.evidence import CAPTURE_OUTCOMES
from remediator.audit import DecisionRecord
from remediator.desired.alertmanager import PollCounters
from remediator.lifecycle.model import GateStatus

DEFERRING_GATES = ("pause", "breaker", "order", "rate_limit", "budget", "unavailable")


class _GateCollector(Collector):
    def __init__(self, status: Callable[[], GateStatus]) -> None:
        self._status = status

    def describe(self) -> list[GaugeMetricFamily]:
        return []  # nothing to check at registration; avoids reading the engine before it started

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        st = self._status()
        yield GaugeMetricFamily(
            "accel_remediator_nodes_disrupted",
            "Nodes currently disrupted (cordoned, tainted, drained, replaced) by the remediator: "
            "the budget in use.",
            value=st.budget_in_use,
        )
        yield GaugeMetricFamily(
            "accel_remediator_disruption_budget_nodes",
            "The effective disruption budget (max_disrupted_nodes, or the percentage of eligible nodes).",
            value=st.budget_capacity,
        )
        rule_in_use = GaugeMetricFamily(
            "accel_remediator_rule_nodes_disrupted",
            "Nodes a rule's selector covers that are out of service now (held by the remediator, or "
            "unschedulable / NotReady), for rules with a budget of their own.",
            labels=["rule"],
        )
        rule_capacity = GaugeMetricFamily(
            "accel_remediator_rule_disruption_budget_nodes",
            "A rule's own effective disruption budget over the nodes its selector covers.",
            labels=["rule"],
        )
        for rule, usage in sorted(st.rule_budgets.items()):
            rule_in_use.add_metric([rule], usage["in_use"])
            rule_capacity.add_metric([rule], usage["capacity"])
        yield rule_in_use
        yield rule_capacity
        yield GaugeMetricFamily(
            "accel_remediator_breaker_open",
            "1 while the storm breaker holds every action back, else 0.",
            value=int(st.breaker_open),
        )
        trips = CounterMetricFamily(
            "accel_remediator_breaker_trips", "How often the storm breaker opened (survives restarts)."
        )
        trips.add_metric([], st.breaker_trips)
        yield trips
        yield GaugeMetricFamily(
            "accel_remediator_alerting_nodes",
            "Eligible nodes with a firing alert within the storm-breaker window.",
            value=st.alerting_nodes,
        )
        yield GaugeMetricFamily(
            "accel_remediator_eligible_nodes",
            "Nodes the remediator may act on (not control plane, not opted out), last count.",
            value=st.eligible_nodes,
        )
        yield GaugeMetricFamily(
            "accel_remediator_paused", "1 while remediation is paused, else 0.", value=int(st.paused)
        )
        deferred = GaugeMetricFamily(
            "accel_remediator_deferred_actions",
            "Actions deferred now and waiting for Alertmanager to resend their alert, by gate.",
            labels=["gate"],
        )
        for gate in sorted({*DEFERRING_GATES, *st.deferred}):
            deferred.add_metric([gate], st.deferred.get(gate, 0))
        yield deferred
        missing = CounterMetricFamily(
            "accel_remediator_api_unavailable",
            "Requests to an optional Kubernetes API the API server does not serve (404), by API; the "
            "remediator goes on without it (e.g. a drain plans without the PodDisruptionBudget list).",
            labels=["api"],
        )
        for api, count in sorted(st.api_unavailable.items()):
            missing.add_metric([api], count)
        yield missing
        phases = GaugeMetricFamily(
            "accel_remediator_nodes_in_phase",
            "Nodes in each phase of their remediation (held, evidence, draining, repair, verifying, "
            "escalated, released), from the nodes' own records; a returned node is in none.",
            labels=["phase"],
        )
        for phase, count in sorted(st.phases.items()):
            phases.add_metric([phase], count)
        yield phases
        yield GaugeMetricFamily(
            "accel_remediator_drains_in_progress",
            "Drains running now in the background; each alert's later actions are decided when its ends.",
            value=len(st.drains),
        )


class _PollCollector(Collector):
    def __init__(self, counters: PollCounters) -> None:
        self._counters = counters

    def describe(self) -> list[CounterMetricFamily]:
        return []

    def collect(self) -> Iterator[CounterMetricFamily]:
        polls = CounterMetricFamily(
            "accel_remediator_alertmanager_polls",
            "Reads of the alerts firing now from Alertmanager's API by result: ok (at least one "
            "Alertmanager answered), unreachable (none did; the webhook deliveries and their expiry are "
            "the desired state meanwhile).",
            labels=["result"],
        )
        polls.add_metric(["ok"], self._counters.ok)
        polls.add_metric(["unreachable"], self._counters.unreachable)
        yield polls


class RemediatorMetrics:
    """accel_remediator_actions_total, accel_remediator_webhooks_total,
    accel_remediator_evidence_captures_total and the gate gauges."""

    def __init__(self, *, status: Callable[[], GateStatus]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.actions = Counter(
            "accel_remediator_actions",
            "Decisions per action type and outcome (planned, started, done, skipped, deferred, ignored, "
            "failed).",
            ["action", "outcome", "dry_run"],
            registry=self.registry,
        )
        self.webhooks = Counter(
            "accel_remediator_webhooks",
            "Alertmanager webhook deliveries by HTTP status code answered.",
            ["code"],
            registry=self.registry,
        )
        self.evidence = Counter(
            "accel_remediator_evidence_captures",
            "Evidence captures (the policy's `evidence` step) by outcome: captured (stored with the "
            "node's evidence), fetch_failed (stored without it: the exporter did not answer), "
            "store_failed (nothing stored).",
            ["outcome"],
            registry=self.registry,
        )
        for outcome in CAPTURE_OUTCOMES:
            self.evidence.labels(outcome)
        self.registry.register(_GateCollector(status))

    def track_alertmanager(self, counters: PollCounters) -> None:
        """Export how the reads of Alertmanager's API went."""
        self.registry.register(_PollCollector(counters))

    def observe(self, record: DecisionRecord) -> None:
        self.actions.labels(record.action, record.outcome, str(record.dry_run).lower()).inc()
        capture = record.details.get("capture")
        if record.action == "evidence" and not record.dry_run and capture in CAPTURE_OUTCOMES:
            self.evidence.labels(capture).inc()

    def webhook_answered(self, code: int) -> None:
        self.webhooks.labels(str(code)).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
