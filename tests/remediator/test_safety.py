"""The safety gates on an injected clock: budget (count and percentage), a rule's own budget over the
nodes its selector covers, rate limits, the storm breaker's trip and self-reset, the pause switch,
protected nodes, and the gates document (pause switch and breaker latch)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from remediator.cluster import LabelSelector, Node, Taint
from remediator.gates.safety import (
    BudgetLimits,
    DisruptionBudget,
    PauseSwitch,
    RateLimit,
    RateLimiter,
    SafetySettings,
    ScopedBudgets,
    StormBreaker,
    StormSettings,
    eligible_count,
    protected_reason,
)
from remediator.gates.state import StateError, gates_document, load_gates


class FakeClock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


# -- budget ------------------------------------------------------------------------------------


def test_the_budget_admits_up_to_its_limit_and_defers_the_next_node() -> None:
    clock = FakeClock()
    budget = DisruptionBudget(max_nodes=2, clock=clock)
    for node in ("a", "b"):
        assert budget.check(node).allowed
        budget.commit(node, kind="cordon", dry_run=False)
    clock.now += 90
    verdict = budget.check("c")
    assert not verdict.allowed
    assert verdict.gate == "budget"
    assert "2 of 2 nodes already out of service (a for 90s, b for 90s)" in verdict.reason
    assert budget.in_use == 2


def test_a_node_already_counted_is_admitted_again_without_using_more_budget() -> None:
    budget = DisruptionBudget(max_nodes=1, clock=FakeClock())
    budget.commit("a", kind="cordon", dry_run=False)
    assert budget.check("a").allowed
    budget.commit("a", kind="drain", dry_run=False)
    assert budget.in_use == 1
    assert budget.holders()["a"].kinds == {"cordon", "drain"}


def test_live_holds_follow_the_nodes_observed_and_dry_run_holds_are_released_by_hand() -> None:
    budget = DisruptionBudget(max_nodes=1, clock=FakeClock())
    budget.commit("a", kind="cordon", dry_run=False)
    assert not budget.check("b").allowed
    nodes = [Node(name=n, accelerators=("nvidia.com/gpu",)) for n in ("a", "b")]
    budget.observe(nodes, SafetySettings(), holds={})  # a is no longer held, as the nodes show
    assert budget.check("b").allowed
    budget.commit("b", kind="cordon", dry_run=True)
    budget.observe(nodes, SafetySettings(), holds={})  # nothing on a node shows a dry-run hold: kept
    assert set(budget.holders()) == {"b"}
    assert budget.release_dry("b") is True
    assert budget.release_dry("b") is False
    assert budget.in_use == 0


def test_commit_remembers_when_the_disruption_started() -> None:
    clock = FakeClock()
    budget = DisruptionBudget(max_nodes=3, clock=clock)
    budget.commit("a", kind="cordon", dry_run=False)
    clock.now += 5
    budget.commit("a", kind="drain", dry_run=False)
    assert budget.holders()["a"].since == 1_000.0


def test_a_zero_budget_defers_everything() -> None:
    assert not DisruptionBudget(max_nodes=0, clock=FakeClock()).check("a").allowed


@pytest.mark.parametrize(
    ("max_nodes", "percent", "eligible", "capacity"),
    [
        (10, 10.0, 15, 1),  # 1.5 rounds down
        (10, 10.0, 9, 0),  # a small cluster gets no percentage budget at all
        (2, 50.0, 100, 2),  # the count is smaller
        (10, 30.0, 10, 3),  # exact percentages are not lost to float error
        (5, None, 1000, 5),
    ],
)
def test_the_effective_budget_is_the_smaller_of_the_count_and_the_percentage_of_eligible_nodes(
    max_nodes: int, percent: float | None, eligible: int, capacity: int
) -> None:
    budget = DisruptionBudget(max_nodes=max_nodes, max_percent=percent, clock=FakeClock())
    budget.eligible = eligible
    assert budget.capacity == capacity


def test_a_percentage_budget_names_the_percentage_when_it_defers() -> None:
    budget = DisruptionBudget(max_nodes=10, max_percent=10.0, clock=FakeClock())
    budget.eligible = 20
    budget.commit("a", kind="cordon", dry_run=False)
    budget.commit("b", kind="cordon", dry_run=False)
    verdict = budget.check("c")
    assert not verdict.allowed
    assert "2 of 2 (10% of 20 eligible nodes, rounded down) nodes already out of service" in verdict.reason


# -- rate limits -------------------------------------------------------------------------------


def test_the_rate_limit_defers_beyond_n_per_window_and_frees_a_slot_as_the_window_slides() -> None:
    clock = FakeClock()
    limiter = RateLimiter(limits={"drain": RateLimit(max_actions=2, window_seconds=3600)}, clock=clock)
    limiter.commit("drain")
    clock.now += 600
    limiter.commit("drain")
    verdict = limiter.check("drain")
    assert not verdict.allowed
    assert verdict.gate == "rate_limit"
    assert "2 of 2 drain actions within 3600s already; a slot frees in 3000s" in verdict.reason
    clock.now += 2999
    assert not limiter.check("drain").allowed
    clock.now += 1
    assert limiter.check("drain").allowed
    assert limiter.usage() == {"drain": 1}


def test_kinds_without_a_rate_limit_are_never_held() -> None:
    limiter = RateLimiter(limits={"drain": RateLimit(max_actions=0, window_seconds=60)}, clock=FakeClock())
    assert not limiter.check("drain").allowed
    for _ in range(100):
        limiter.commit("cordon")
    assert limiter.check("cordon").allowed


# -- storm breaker -----------------------------------------------------------------------------


def breaker(clock: FakeClock, **kwargs: Any) -> StormBreaker:
    settings = StormSettings(
        **{
            "threshold_percent": 30.0,
            "min_nodes": 3,
            "window_seconds": 600,
            "cooldown_seconds": 900,
            **kwargs,
        }
    )
    return StormBreaker(settings=settings, clock=clock)


def test_the_breaker_opens_when_more_than_the_threshold_of_eligible_nodes_alert() -> None:
    clock = FakeClock()
    b = breaker(clock)
    assert b.evaluate(eligible=10, alerting=3) is False  # 30% is not MORE than 30%
    assert b.check().allowed
    assert b.evaluate(alerting=4) is True
    verdict = b.check()
    assert not verdict.allowed
    assert verdict.gate == "breaker"
    assert "storm breaker OPEN: 4 of 10 eligible nodes with a fault firing now" in verdict.reason
    assert b.trips == 1


def test_a_single_broken_node_in_a_tiny_cluster_is_a_fault_not_a_storm() -> None:
    b = breaker(FakeClock())
    b.evaluate(eligible=3, alerting=2)  # 67%, but fewer than min_nodes
    assert not b.open


def test_the_breaker_stays_open_while_faults_fire_and_closes_only_after_a_calm_cooldown() -> None:
    clock = FakeClock()
    b = breaker(clock)
    b.evaluate(eligible=10, alerting=5)
    assert b.open
    clock.now += 7200  # hours without any delivery: the faults still fire, so it stays open
    b.evaluate()
    assert b.open
    b.evaluate(alerting=0)  # they resolved
    assert b.open  # below since now, but the cooldown has not passed
    assert "below the threshold for 0s, closes in 900s" in b.describe()
    clock.now += 899
    b.evaluate()
    assert b.open
    clock.now += 1
    assert b.evaluate() is True
    assert b.check().allowed  # closed by itself
    assert b.trips == 1


def test_faults_returning_during_the_cooldown_restart_it() -> None:
    clock = FakeClock()
    b = breaker(clock)
    b.evaluate(eligible=10, alerting=4)
    b.evaluate(alerting=0)
    clock.now += 800
    b.evaluate(alerting=4)
    clock.now += 200
    b.evaluate(alerting=0)
    clock.now += 899
    assert b.evaluate() is False
    assert b.open
    clock.now += 1
    assert b.evaluate() is True
    assert b.trips == 1


def test_nodes_added_by_a_scale_up_lower_the_alerting_fraction() -> None:
    b = breaker(FakeClock())
    b.evaluate(eligible=20, alerting=4)  # 20%: a scale-up of 10 new nodes, 4 of them not ready yet
    assert not b.open


def test_a_disabled_breaker_never_opens() -> None:
    b = breaker(FakeClock(), enabled=False)
    b.evaluate(eligible=10, alerting=10)
    assert b.check().allowed


def test_the_budget_counts_eligible_nodes_out_of_service_for_other_reasons() -> None:
    clock = FakeClock()
    budget = DisruptionBudget(max_nodes=2, clock=clock)
    gpu = ("nvidia.com/gpu",)
    nodes = [
        Node(name="cordoned", accelerators=gpu, unschedulable=True),
        Node(name="cpu-cordoned", unschedulable=True),  # CPU-only: not ours to count
        Node(name="ok", accelerators=gpu),
        Node(name="other", accelerators=gpu),
    ]
    budget.observe(nodes, SafetySettings())
    assert budget.in_use == 1
    assert budget.check("cordoned").allowed  # already out of service: acting on it costs nothing
    assert budget.check("ok").allowed
    budget.commit("ok", kind="cordon", dry_run=False)
    verdict = budget.check("other")
    assert not verdict.allowed
    assert "cordoned unschedulable" in verdict.reason


def _pools() -> list[Node]:
    gpu = ("nvidia.com/gpu",)
    p5 = {"pool": "p5"}
    return [
        *(Node(name=f"p5-{i}", labels=p5, accelerators=gpu) for i in (0, 2, 3)),
        Node(name="p5-1", labels=p5, accelerators=gpu, unschedulable=True),  # a human cordoned it
        Node(name="p5-cpu", labels=p5, unschedulable=True),  # CPU-only: neither counted nor covered
        Node(name="g5-0", labels={"pool": "g5"}, accelerators=gpu, unschedulable=True),
        Node(name="g5-1", labels={"pool": "g5"}, accelerators=gpu),
    ]


def test_a_rules_budget_counts_only_the_nodes_its_selector_covers() -> None:
    clock = FakeClock()
    budget = DisruptionBudget(max_nodes=10, clock=clock)
    scoped = ScopedBudgets(
        {"p5": (LabelSelector(match_labels={"pool": "p5"}), BudgetLimits(max_disrupted_percent=50))}
    )
    scoped.observe(_pools(), SafetySettings())
    budget.commit("g5-1", kind="cordon", dry_run=False)  # another pool's hold costs p5 nothing
    assert scoped.check("p5", "p5-0", budget.holders()).allowed  # 1 (p5-1) of 2 (50% of 4) in use
    budget.commit("p5-0", kind="cordon", dry_run=False)
    assert scoped.check("p5", "p5-1", budget.holders()).allowed  # already out of service: free
    verdict = scoped.check("p5", "p5-2", budget.holders())
    assert not verdict.allowed
    assert verdict.gate == "budget"
    assert verdict.reason.startswith(
        "rule 'p5' budget exhausted: 2 of 2 (50% of 4 nodes pool=p5, rounded down) already out of "
        "service (p5-0 held by accel-health (cordon), p5-1 unschedulable)"
    )
    assert scoped.check("g5", "g5-1", budget.holders()).allowed  # a rule without a budget of its own
    budget.observe(_pools(), SafetySettings(), holds={})  # p5-0 given back, as the nodes show
    assert scoped.check("p5", "p5-2", budget.holders()).allowed


def test_a_rules_budget_counts_dry_run_holds_as_a_live_service_would_have_disrupted() -> None:
    budget = DisruptionBudget(max_nodes=10, clock=FakeClock())
    scoped = ScopedBudgets(
        {"p5": (LabelSelector(match_labels={"pool": "p5"}), BudgetLimits(max_disrupted_nodes=2))}
    )
    scoped.observe(_pools(), SafetySettings())
    budget.commit("p5-0", kind="drain", dry_run=True)
    assert not scoped.check("p5", "p5-2", budget.holders()).allowed
    assert scoped.usage(budget.holders()) == {
        "p5": {
            "selector": "pool=p5",
            "max_disrupted_nodes": 2,
            "max_disrupted_percent": None,
            "covered_nodes": 4,
            "in_use": 2,
            "capacity": 2,
            "disrupted": {"p5-0": "held by accel-health (drain)", "p5-1": "unschedulable"},
        }
    }


def test_a_rules_budget_without_a_selector_covers_every_eligible_node() -> None:
    budget = DisruptionBudget(max_nodes=10, clock=FakeClock())
    scoped = ScopedBudgets({"any": (None, BudgetLimits(max_disrupted_percent=34))})
    scoped.observe(_pools(), SafetySettings())
    # 6 eligible nodes (p5-cpu is CPU-only): 34% is 2; p5-1 and g5-0 are out of service already.
    verdict = scoped.check("any", "p5-0", budget.holders())
    assert not verdict.allowed
    assert "2 of 2 (34% of 6 eligible nodes, rounded down)" in verdict.reason


# -- pause, protected nodes --------------------------------------------------------------------


def test_the_pause_switch_defers_with_its_reason_until_resumed() -> None:
    clock = FakeClock()
    switch = PauseSwitch(clock=clock)
    assert switch.check().allowed
    switch.pause("maintenance window")
    clock.now += 30
    verdict = switch.check()
    assert not verdict.allowed
    assert verdict.gate == "pause"
    assert "paused 30s ago (maintenance window)" in verdict.reason
    assert switch.resume() is True
    assert switch.resume() is False
    assert switch.check().allowed


def test_control_plane_and_opted_out_nodes_are_protected_and_not_eligible() -> None:
    settings = SafetySettings()
    nodes = [
        Node(name="cp", labels={"node-role.kubernetes.io/control-plane": ""}),
        Node(name="m", labels={"node-role.kubernetes.io/master": ""}),
        Node(name="t", taints=(Taint("node-role.kubernetes.io/control-plane", "", "NoSchedule"),)),
        Node(name="o", labels={"accel-health.io/opt-out": "true"}),
        Node(name="o2", labels={"accel-health.io/opt-out": "false"}, accelerators=("nvidia.com/gpu",)),
        Node(name="gpu", labels={"nvidia.com/gpu.present": "true"}),
        Node(name="cpu"),
    ]
    reasons = {n.name: protected_reason(n, settings) or "" for n in nodes}
    assert "control-plane" in reasons["cp"]
    assert "control-plane" in reasons["m"]
    assert "taint node-role.kubernetes.io/control-plane" in reasons["t"]
    assert "opted out" in reasons["o"]
    assert reasons["o2"] == reasons["gpu"] == ""
    assert eligible_count(nodes, settings) == 2


# -- the gates document --------------------------------------------------------------------------


def test_the_gates_document_keeps_the_pause_and_the_breaker_latch_in_under_a_kibibyte() -> None:
    clock = FakeClock()
    pause, breaker = PauseSwitch(clock=clock), StormBreaker(settings=StormSettings(), clock=clock)
    breaker.evaluate(eligible=10, alerting=4)
    pause.pause("rack maintenance " * 200)  # a long reason is cut, not stored whole
    doc = json.loads(json.dumps(gates_document(pause, breaker)))
    assert len(json.dumps(doc, separators=(",", ":"))) <= 1024
    assert set(doc["breaker"]) == {"open", "opened_at", "trips"}  # the latch, not the counts

    restored_pause = PauseSwitch(clock=clock)
    restored = StormBreaker(settings=StormSettings(), clock=clock)
    load_gates(doc, restored_pause, restored)
    assert restored.open
    assert restored.trips == 1
    assert restored.opened_at == 1_000.0
    assert restored_pause.paused
    assert restored_pause.reason.startswith("rack maintenance")


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ([], "expected a mapping"),
        ({"version": 1}, "version: expected 2"),
        ({"version": 2, "breaker": {"open": "yes"}}, "breaker.open: expected true or false"),
        ({"version": 2, "pause": {"paused": 1}}, "pause.paused: expected true or false"),
        ({"version": 2, "pause": "on"}, "pause: expected a mapping"),
    ],
)
def test_an_unusable_gates_document_is_rejected_naming_the_field_and_changes_nothing(
    doc: Any, message: str
) -> None:
    clock = FakeClock()
    pause, breaker = PauseSwitch(clock=clock), StormBreaker(settings=StormSettings(), clock=clock)
    with pytest.raises(StateError, match=message):
        load_gates(doc, pause, breaker)
    assert not pause.paused
    assert not breaker.open
