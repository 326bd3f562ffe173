"""The disruption budget (on an injected clock) and the protected-node rules."""

from __future__ import annotations

from remediator.cluster import Node
from remediator.safety import DisruptionBudget, SafetySettings, protected_reason


class FakeClock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def test_the_budget_admits_up_to_its_limit_and_defers_the_next_node() -> None:
    clock = FakeClock()
    budget = DisruptionBudget(max_nodes=2, clock=clock)
    for node in ("a", "b"):
        assert budget.check(node).allowed
        budget.commit(node)
    clock.now += 90
    verdict = budget.check("c")
    assert not verdict.allowed
    assert verdict.gate == "budget"
    assert "2 of 2 nodes already disrupted (a for 90s, b for 90s)" in verdict.reason
    assert budget.in_use == 2


def test_a_node_already_counted_is_admitted_again_without_using_more_budget() -> None:
    budget = DisruptionBudget(max_nodes=1, clock=FakeClock())
    budget.commit("a")
    assert budget.check("a").allowed
    budget.commit("a")
    assert budget.in_use == 1


def test_releasing_a_node_frees_its_slot() -> None:
    clock = FakeClock()
    budget = DisruptionBudget(max_nodes=1, clock=clock)
    budget.commit("a")
    assert not budget.check("b").allowed
    assert budget.release("a") is True
    assert budget.release("a") is False
    assert budget.check("b").allowed


def test_commit_remembers_when_the_disruption_started() -> None:
    clock = FakeClock()
    budget = DisruptionBudget(max_nodes=3, clock=clock)
    budget.commit("a")
    clock.now += 5
    budget.commit("a")
    assert budget.holders() == {"a": 1_000.0}


def test_a_zero_budget_defers_everything() -> None:
    assert not DisruptionBudget(max_nodes=0, clock=FakeClock()).check("a").allowed


def test_control_plane_and_opted_out_nodes_are_protected() -> None:
    settings = SafetySettings()
    assert "control-plane" in (
        protected_reason(Node(name="cp", labels={"node-role.kubernetes.io/control-plane": ""}), settings)
        or ""
    )
    assert "control-plane" in (
        protected_reason(Node(name="m", labels={"node-role.kubernetes.io/master": ""}), settings) or ""
    )
    assert "opted out" in (
        protected_reason(Node(name="o", labels={"accel-health.io/opt-out": "true"}), settings) or ""
    )
    assert protected_reason(Node(name="o", labels={"accel-health.io/opt-out": "false"}), settings) is None
    assert protected_reason(Node(name="gpu"), settings) is None
