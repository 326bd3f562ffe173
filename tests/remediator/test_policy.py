"""Policy parsing and validation (rules, actions, the safety section, node selectors and a rule's own
budget), Alertmanager matcher semantics, Kubernetes label-selector semantics, which rule an alert gets
on which node, and the shipped default policy."""

from __future__ import annotations

from pathlib import Path

import pytest

from remediator.cluster import LabelRequirement, LabelSelector, Node
from remediator.gates.safety import BudgetLimits, RateLimit, StormSettings
from remediator.policy import (
    AddTaint,
    AwsSetUnhealthy,
    CaptureEvidence,
    Cordon,
    Drain,
    Matcher,
    PolicyError,
    RemoveTaint,
    SetCondition,
    load_policy,
    parse_policy,
)
from remediator.repairpolicy import RepairSettings

GOOD = """
safety: {max_disrupted_nodes: 3}
rules:
  - name: drain
    match: ['remediation="drain"', 'severity=~"critical|warning"']
    actions:
      - {type: condition, condition_type: AcceleratorHealthy}
      - cordon
      - {type: drain, timeout_seconds: 60, grace_period_seconds: 30, delete_emptydir_data: true}
    on_resolved: [uncordon]
  - name: catch-all
    match: []
    actions: []
    dry_run: true
"""


def test_a_good_policy_loads_with_every_field() -> None:
    policy = parse_policy(GOOD, source="good.yaml")
    assert policy.safety.max_disrupted_nodes == 3
    drain = policy.rules[0]
    assert [a.type for a in drain.actions] == ["condition", "cordon", "drain"]
    assert drain.actions[2] == Drain(timeout_seconds=60, grace_period_seconds=30, delete_emptydir_data=True)
    assert [a.type for a in drain.on_resolved] == ["uncordon"]
    assert policy.rules[1].dry_run is True


def test_the_first_matching_rule_wins() -> None:
    policy = parse_policy(GOOD)
    matched = policy.first_match({"remediation": "drain", "severity": "critical"})
    assert matched is not None
    assert matched.name == "drain"
    fallback = policy.first_match({"remediation": "drain", "severity": "info"})
    assert fallback is not None
    assert fallback.name == "catch-all"


@pytest.mark.parametrize(
    ("matcher", "labels", "expected"),
    [
        ('remediation="drain"', {"remediation": "drain"}, True),
        ('remediation="drain"', {"remediation": "drain2"}, False),
        ('alertname!="X"', {"alertname": "Y"}, True),
        ('alertname!="X"', {}, True),
        ('severity=~"critical|warning"', {"severity": "warning"}, True),
        ('severity=~"crit"', {"severity": "critical"}, False),  # anchored, like Alertmanager
        ('severity!~"info|none"', {"severity": "critical"}, True),
        ('severity!~"info|none"', {"severity": "info"}, False),
        ('node=""', {}, True),  # a missing label reads as the empty string
        ("xid=~79|48", {"xid": "48"}, True),  # unquoted values are accepted
        (r'summary="say \"hi\""', {"summary": 'say "hi"'}, True),
    ],
)
def test_matchers_follow_alertmanager_semantics(matcher: str, labels: dict[str, str], expected: bool) -> None:
    assert Matcher.parse(matcher).matches(labels) is expected


def _problems(text: str) -> str:
    with pytest.raises(PolicyError) as info:
        parse_policy(text, source="/etc/accel/policy.yaml")
    message = str(info.value)
    assert message.startswith("invalid policy /etc/accel/policy.yaml")
    return message


def test_an_unknown_action_type_names_file_rule_and_field() -> None:
    message = _problems("rules:\n  - name: r\n    match: []\n    actions: [{type: reboot}]\n")
    assert "rules[0] (r).actions[0].type: unknown action type 'reboot'" in message


def test_a_wrongly_typed_action_field_names_the_field() -> None:
    message = _problems("rules:\n  - name: d\n    actions: [{type: drain, timeout_seconds: soon}]\n")
    assert "rules[0] (d).actions[0].timeout_seconds: expected an integer" in message


def test_a_bad_matcher_and_a_bad_regex_are_both_reported() -> None:
    message = _problems("rules:\n  - name: m\n    match: ['sev ~ x', 'a=~\"(\"']\n    actions: []\n")
    assert "rules[0] (m).match[0]: cannot parse matcher" in message
    assert "rules[0] (m).match[1]: invalid regular expression" in message


def test_destructive_actions_are_refused_on_resolved() -> None:
    message = _problems("rules:\n  - name: r\n    actions: []\n    on_resolved: [drain]\n")
    assert "rules[0] (r).on_resolved[0].type: drain is not allowed when an alert resolves" in message


def test_missing_names_duplicates_and_unknown_fields_are_all_listed_at_once() -> None:
    message = _problems(
        "rules:\n"
        "  - match: []\n    actions: []\n"
        "  - name: a\n    actions: []\n"
        "  - name: a\n    actions: []\n    dryrun: true\n"
        "  - name: b\n"
        "safety: {max_disrupted_nodes: -1}\n"
    )
    assert "rules[0].name: required" in message
    assert "rules[2] (a).name: duplicate rule name 'a'" in message
    assert "rules[2] (a).dryrun: unknown field" in message
    assert "rules[3] (b).actions: required" in message
    assert "safety.max_disrupted_nodes: must not be negative" in message


def test_a_bad_taint_effect_is_rejected() -> None:
    message = _problems("rules:\n  - name: t\n    actions: [{type: taint, key: k, effect: Sometimes}]\n")
    assert "rules[0] (t).actions[0].effect: expected one of NoSchedule" in message


def test_a_document_that_is_not_a_policy_is_rejected() -> None:
    assert "expected a mapping" in _problems("- just\n- a list\n")
    assert "not valid YAML" in _problems("rules: [\n")
    assert "rules: expected a list" in _problems("safety: {}\n")


def test_an_unreadable_policy_file_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match=r"missing\.yaml"):
        load_policy(tmp_path / "missing.yaml")


def test_the_default_policy_covers_every_remediation_label_the_alerts_set() -> None:
    policy = load_policy()
    by_label = {}
    for value in ("drain", "cordon", "taint", "replace", "none"):
        rule = policy.first_match({"remediation": value})
        assert rule is not None, value
        by_label[value] = rule
    assert by_label["drain"].actions[:2] == (SetCondition(), Cordon())
    assert by_label["drain"].actions[2] == CaptureEvidence(timeout_seconds=10)  # before the drain
    assert isinstance(by_label["drain"].actions[3], Drain)
    assert by_label["cordon"].actions == (SetCondition(), Cordon())
    assert by_label["taint"].actions == (
        SetCondition(),
        AddTaint("accel-health.io/unhealthy", "true", "NoSchedule"),
    )
    assert [a.type for a in by_label["replace"].actions] == [
        "condition",
        "cordon",
        "evidence",
        "drain",
        "aws_set_unhealthy",
    ]
    assert by_label["replace"].actions[-1] == AwsSetUnhealthy(handover_condition="AcceleratedHardwareReady")
    assert by_label["none"].actions == ()
    assert all(rule.on_resolved == () for rule in policy.rules)  # nodes come back verified, not blindly
    assert policy.safety.max_disrupted_nodes == 2
    assert policy.repair == RepairSettings(escalate_after=5, window_seconds=7 * 86400.0)
    assert policy.repair.checks == ("remapped", "power")  # the cheap ones


def test_the_repair_section_and_a_rules_verify_load() -> None:
    policy = parse_policy(
        """
repair: {checks: [pciebw], escalate_after: 3, window_seconds: 3600, enabled: true, interval_seconds: 5}
rules:
  - name: replace
    match: []
    verify: [gpumem, remapped]
    actions: [{type: aws_set_unhealthy, handover_condition: AcceleratedHardwareReady}]
"""
    )
    assert policy.repair == RepairSettings(
        checks=("pciebw",), escalate_after=3, window_seconds=3600.0, interval_seconds=5.0
    )
    assert policy.rules[0].verify == ("gpumem", "remapped")
    assert policy.rules[0].actions == (AwsSetUnhealthy(handover_condition="AcceleratedHardwareReady"),)


def test_verify_new_nodes_loads_and_escalate_after_is_capped_by_the_stored_history() -> None:
    assert parse_policy("repair: {verify_new_nodes: true}\nrules: []\n").repair.verify_new_nodes is True
    assert parse_policy("rules: []\n").repair.verify_new_nodes is False
    message = _problems("repair: {verify_new_nodes: sometimes, escalate_after: 33}\nrules: []\n")
    assert "repair.verify_new_nodes: expected true or false, got 'sometimes'" in message
    assert "repair.escalate_after: at most 32 (the stored history keeps that many), got 33" in message


def test_every_problem_in_the_repair_section_is_named() -> None:
    message = _problems(
        """
repair: {checks: [pciebw, burn], escalate_after: 0, window_seconds: -1, escalation_label: "", retry: 3}
rules:
  - name: x
    match: []
    verify: nvml
    actions: [{type: aws_reboot, replace_after_reboot_seconds: -5}]
"""
    )
    assert "repair.checks: unknown check(s) burn (known: pciebw, gpumem, remapped, power, dcgm)" in message
    assert "repair.escalate_after: expected an integer of at least 1, got 0" in message
    assert "repair.window_seconds: expected a positive number of seconds, got -1" in message
    assert "repair.escalation_label: expected a non-empty label name, got ''" in message
    assert "repair.retry: unknown field" in message
    assert "rules[0] (x).verify: expected a list of check names" in message
    assert "rules[0] (x).actions[0].replace_after_reboot_seconds: must not be negative, got -5" in message


def test_the_safety_section_loads_budgets_rate_limits_and_the_storm_breaker() -> None:
    policy = parse_policy(
        """
safety:
  max_disrupted_nodes: 5
  max_disrupted_percent: 10
  opt_out_label: example.com/no-remediation
  rate_limits:
    drain: {max_actions: 3, window_seconds: 3600}
  storm_breaker: {threshold_percent: 20, min_nodes: 5, window_seconds: 300, cooldown_seconds: 1800}
rules:
  - {name: r, actions: [cordon], on_resolved: [uncordon, {type: untaint, key: k, effect: NoExecute}]}
"""
    )
    safety = policy.safety
    assert (safety.max_disrupted_nodes, safety.max_disrupted_percent) == (5, 10.0)
    assert safety.opt_out_label == "example.com/no-remediation"
    assert safety.rate_limits == {"drain": RateLimit(max_actions=3, window_seconds=3600.0)}
    assert safety.storm_breaker == StormSettings(
        threshold_percent=20.0, min_nodes=5, window_seconds=300.0, cooldown_seconds=1800.0
    )
    assert policy.rules[0].on_resolved[1] == RemoveTaint(key="k", effect="NoExecute")


def test_every_problem_in_the_safety_section_is_named() -> None:
    message = _problems(
        """
safety:
  max_disrupted_percent: 150
  rate_limits:
    reboot: {max_actions: 1, window_seconds: 60}
    drain: {max_actions: -1}
  storm_breaker: {threshold_percent: fifty, cooldown: 10}
  budget: 3
rules: []
"""
    )
    assert "safety.max_disrupted_percent: must be at most 100, got 150" in message
    assert "safety.rate_limits.reboot: unknown action type" in message
    assert "safety.rate_limits.drain.max_actions: must not be negative" in message
    assert "safety.rate_limits.drain.window_seconds: required" in message
    assert "safety.storm_breaker.threshold_percent: expected a number, got str 'fifty'" in message
    assert "safety.storm_breaker.cooldown: unknown field" in message
    assert "safety.budget: unknown field" in message


def test_reversals_are_refused_among_the_firing_actions() -> None:
    message = _problems("rules:\n  - name: r\n    actions: [untaint]\n")
    assert "rules[0] (r).actions[0].type: untaint belongs in on_resolved" in message


# -- node selectors and a rule's own budget --------------------------------------------------------

POOLS = """
rules:
  - name: drain-p5
    match: ['remediation=~"drain|cordon"']
    nodes:
      matchLabels: {karpenter.sh/nodepool: p5}
      matchExpressions:
        - {key: node.kubernetes.io/instance-type, operator: In, values: [p5.48xlarge, p5e.48xlarge]}
        - {key: example.com/spot, operator: DoesNotExist}
    max_disrupted_nodes: 2
    max_disrupted_percent: 10
    actions: [cordon, drain]
  - name: taint-g5
    match: ['remediation=~"drain|cordon"']
    nodes:
      matchExpressions:
        - {key: karpenter.sh/nodepool, operator: Exists}
        - {key: karpenter.sh/nodepool, operator: NotIn, values: [p5]}
    max_disrupted_percent: 50
    actions: [{type: taint, key: accel-health.io/unhealthy}]
  - name: elsewhere
    match: ['remediation=~"drain|cordon"']
    actions: [condition]
"""
P5 = {"karpenter.sh/nodepool": "p5", "node.kubernetes.io/instance-type": "p5.48xlarge"}
G5 = {"karpenter.sh/nodepool": "g5", "node.kubernetes.io/instance-type": "g5.48xlarge"}


def test_a_rule_loads_its_node_selector_and_its_own_budget() -> None:
    drain, taint, elsewhere = parse_policy(POOLS).rules
    assert drain.nodes == LabelSelector(
        match_labels={"karpenter.sh/nodepool": "p5"},
        match_expressions=(
            LabelRequirement("node.kubernetes.io/instance-type", "In", ("p5.48xlarge", "p5e.48xlarge")),
            LabelRequirement("example.com/spot", "DoesNotExist"),
        ),
    )
    assert drain.budget == BudgetLimits(max_disrupted_nodes=2, max_disrupted_percent=10.0)
    assert taint.budget == BudgetLimits(max_disrupted_percent=50.0)
    assert (elsewhere.nodes, elsewhere.budget) == (None, None)
    assert str(drain.nodes) == (
        "karpenter.sh/nodepool=p5,node.kubernetes.io/instance-type in (p5.48xlarge,p5e.48xlarge),"
        "!example.com/spot"
    )


@pytest.mark.parametrize(
    ("labels", "rule"),
    [
        (P5, "drain-p5"),
        ({**P5, "example.com/spot": "true"}, "elsewhere"),  # a spot node of the p5 pool is not drained
        ({**P5, "node.kubernetes.io/instance-type": "p4d.24xlarge"}, "elsewhere"),
        (G5, "taint-g5"),
        ({"node.kubernetes.io/instance-type": "g5.48xlarge"}, "elsewhere"),  # in no node pool
    ],
)
def test_the_first_rule_whose_matchers_and_node_selector_both_match_wins(
    labels: dict[str, str], rule: str
) -> None:
    policy = parse_policy(POOLS)
    chosen = policy.select({"remediation": "drain"}, Node(name="n", labels=labels), node_name="n")
    assert chosen.rule is not None
    assert chosen.rule.name == rule


def test_a_rule_passed_over_for_its_selector_says_why() -> None:
    policy = parse_policy(POOLS)
    chosen = policy.select({"remediation": "drain"}, Node(name="g5-1", labels=G5), node_name="g5-1")
    assert chosen.passed_over == (
        "rule 'drain-p5': node g5-1 is not among its nodes (karpenter.sh/nodepool=p5,"
        "node.kubernetes.io/instance-type in (p5.48xlarge,p5e.48xlarge),!example.com/spot)",
    )


def test_a_node_that_cannot_be_seen_matches_no_rule_with_a_selector() -> None:
    policy = parse_policy(POOLS)
    chosen = policy.select({"remediation": "drain"}, None, node_name="ghost")
    assert chosen.rule is not None
    assert chosen.rule.name == "elsewhere"  # the first rule without a selector
    assert len(chosen.passed_over) == 2
    assert all("node ghost is not in the observed nodes" in why for why in chosen.passed_over)
    only_pools = parse_policy(POOLS.split("  - name: elsewhere", maxsplit=1)[0])
    assert only_pools.select({"remediation": "drain"}, None, node_name="ghost").rule is None
    assert only_pools.selects_nodes
    assert not parse_policy(GOOD).selects_nodes


@pytest.mark.parametrize(
    ("selector", "labels", "expected"),
    [
        (LabelSelector(match_labels={"pool": "p5"}), {"pool": "p5", "zone": "a"}, True),
        (LabelSelector(match_labels={"pool": "p5"}), {"pool": "g5"}, False),
        (LabelSelector(match_labels={"pool": "p5"}), {}, False),
        (
            LabelSelector(match_expressions=(LabelRequirement("pool", "In", ("p5", "p4")),)),
            {"pool": "p4"},
            True,
        ),
        (LabelSelector(match_expressions=(LabelRequirement("pool", "In", ("p5",)),)), {}, False),
        (LabelSelector(match_expressions=(LabelRequirement("pool", "NotIn", ("p5",)),)), {}, True),
        (
            LabelSelector(match_expressions=(LabelRequirement("pool", "NotIn", ("p5",)),)),
            {"pool": "p5"},
            False,
        ),
        (LabelSelector(match_expressions=(LabelRequirement("spot", "Exists"),)), {"spot": ""}, True),
        (LabelSelector(match_expressions=(LabelRequirement("spot", "DoesNotExist"),)), {"spot": ""}, False),
    ],
)
def test_node_selectors_follow_kubernetes_label_selector_semantics(
    selector: LabelSelector, labels: dict[str, str], expected: bool
) -> None:
    assert selector.matches(labels) is expected


def test_every_problem_in_node_selectors_and_rule_budgets_is_named() -> None:
    message = _problems(
        """
rules:
  - name: a
    nodes: {matchLabels: {gpu: true, pool: p5}, podSelector: {}}
    max_disrupted_nodes: -1
    max_disrupted_percent: 120
    actions: [cordon]
  - name: b
    nodes:
      matchExpressions:
        - {key: pool, operator: Equals, values: [p5]}
        - {key: pool, operator: In}
        - {key: spot, operator: Exists, values: ["true"]}
        - {operator: NotIn, values: [1]}
    actions: [cordon]
  - name: c
    nodes: {}
    actions: [cordon]
  - name: d
    nodes: [pool=p5]
    max_disrupted_nodes: 1
    actions: [condition, event]
"""
    )
    assert (
        "rules[0] (a).nodes.matchLabels.gpu: expected a string (quote numbers and true/false), got True"
        in message
    )
    assert "rules[0] (a).nodes.podSelector: unknown field (known: matchLabels, matchExpressions)" in message
    assert "rules[0] (a).max_disrupted_nodes: must not be negative, got -1" in message
    assert "rules[0] (a).max_disrupted_percent: must be at most 100, got 120" in message
    assert (
        "rules[1] (b).nodes.matchExpressions[0].operator: expected one of In, NotIn, Exists, DoesNotExist, "
        "got 'Equals'" in message
    )
    assert (
        "rules[1] (b).nodes.matchExpressions[1].values: required, at least one value, for operator In"
        in message
    )
    assert "rules[1] (b).nodes.matchExpressions[2].values: must be empty for operator Exists" in message
    assert "rules[1] (b).nodes.matchExpressions[3].key: required, a non-empty string" in message
    assert "rules[1] (b).nodes.matchExpressions[3].values: expected a list of strings" in message
    assert "rules[2] (c).nodes: give matchLabels and/or matchExpressions (leave nodes: out" in message
    assert "rules[3] (d).nodes: expected a mapping with matchLabels and/or matchExpressions" in message
    assert (
        "rules[3] (d).max_disrupted_nodes: the rule has no disruptive action for a budget to limit" in message
    )


def test_the_default_policys_commented_node_pool_example_loads_as_it_reads() -> None:
    text = (Path(__file__).parents[2] / "remediator" / "default_policy.yaml").read_text(encoding="utf-8")
    example = text.split("#  - name: drain-p5", 1)[1]
    rules = "rules:\n  - name: drain-p5" + "".join(line[1:] + "\n" for line in example.splitlines())
    drain, taint = parse_policy(rules).rules
    assert drain.nodes == LabelSelector(match_labels={"karpenter.sh/nodepool": "p5"})
    assert drain.budget == BudgetLimits(max_disrupted_percent=10.0)
    assert taint.nodes is not None
    assert taint.nodes.matches({"node.kubernetes.io/instance-type": "g5.48xlarge"})
    assert [a.type for a in taint.actions] == ["condition", "taint"]
