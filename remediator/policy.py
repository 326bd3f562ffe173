"""Remediation policy: which alert gets which node actions (pure; YAML in, frozen objects out).

    safety: {max_disrupted_nodes: 2}
    events: all                  # Events on the node for every action (or: failures, none)
    rules:                       # ordered; the first rule whose matchers all match wins
      - name: drain
        match: ['remediation="drain"', 'severity=~"critical|warning"']
        actions: [{type: condition}, {type: cordon}, {type: drain, timeout_seconds: 600}]
        on_resolved: []          # or [uncordon, untaint]; destructive actions are refused here
        dry_run: false           # optional: this rule only plans
        verify: [remapped]       # optional: checks after a repair (default: repair.checks)
        nodes:                   # optional: only alerts on nodes this label selector matches
          matchLabels: {karpenter.sh/nodepool: p5}
          matchExpressions: [{key: node.kubernetes.io/instance-type, operator: In, values: [p5.48xlarge]}]
        max_disrupted_nodes: 1   # optional: this rule's own budget over the nodes `nodes` covers
        max_disrupted_percent: 10
    repair: {checks: [remapped, power], escalate_after: 5, window_seconds: 604800}
    # safety: max_disrupted_nodes, max_disrupted_percent, opt_out_label,
    #         rate_limits: {drain: {max_actions: 3, window_seconds: 3600}},
    #         storm_breaker: {threshold_percent: 30, min_nodes: 3, window_seconds: 600,
    #                         cooldown_seconds: 900, enabled: true}

Matchers follow Alertmanager: `=`, `!=`, `=~`, `!~`; regexes are anchored; a missing label reads as
"". A rule with `nodes:` (a Kubernetes label selector, as a Deployment's: matchLabels and
matchExpressions with In, NotIn, Exists, DoesNotExist) applies only when the alert's node, as the
service observes it, carries matching labels; a node it cannot see matches no such rule. So one
cluster can drain one pool and only taint another. A rule's own `max_disrupted_nodes` and
`max_disrupted_percent` count the nodes its selector covers (remediator/gates/safety.py ScopedBudgets),
on top of the `safety:` budget. Validation collects every problem and raises one PolicyError naming
file, rule and field, so an invalid policy never half-loads.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml

from remediator.cluster import LabelSelector, Node, label_selector_from_object
from remediator.gates.safety import BudgetLimits, RateLimit, SafetySettings, StormSettings
from remediator.repairpolicy import RepairSettings, parse_checks, parse_repair

DEFAULT_POLICY_NAME = "default_policy.yaml"
EventsMode = Literal["all", "failures", "none"]
EVENTS_MODES: tuple[EventsMode, ...] = ("all", "failures", "none")


class PolicyError(ValueError):
    """The policy is invalid; the message lists every problem found."""

    def __init__(self, source: str, problems: Sequence[str]) -> None:
        self.source = source
        self.problems = tuple(problems)
        super().__init__(f"invalid policy {source}:\n" + "\n".join(f"  - {p}" for p in self.problems))


# -- matchers ----------------------------------------------------------------------------------

_MATCHER = re.compile(r'^\s*([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*(?:"((?:[^"\\]|\\.)*)"|([^"\s]*))\s*$')


@dataclass(frozen=True)
class Matcher:
    """One Alertmanager-style label matcher."""

    label: str
    """Label name."""
    op: str
    """`=`, `!=`, `=~` or `!~`."""
    value: str
    """Literal or (anchored) regular expression."""
    regex: re.Pattern[str] | None = field(default=None, compare=False)
    """Compiled regex for =~ and !~."""

    @classmethod
    def parse(cls, text: str) -> Matcher:
        """`severity=~"critical|warning"` -> Matcher; ValueError with a reason otherwise."""
        m = _MATCHER.match(text)
        if not m:
            raise ValueError(f'cannot parse matcher {text!r} (expected e.g. remediation="drain")')
        label, op, quoted, bare = m.groups()
        value = re.sub(r'\\(["\\])', r"\1", quoted) if quoted is not None else bare
        regex = None
        if op in ("=~", "!~"):
            try:
                regex = re.compile(f"(?:{value})")
            except re.error as exc:
                raise ValueError(f"invalid regular expression in {text!r}: {exc}") from exc
        return cls(label=label, op=op, value=value, regex=regex)

    def matches(self, labels: Mapping[str, str]) -> bool:
        actual = labels.get(self.label, "")
        if self.op == "=":
            return actual == self.value
        if self.op == "!=":
            return actual != self.value
        assert self.regex is not None
        found = self.regex.fullmatch(actual) is not None
        return found if self.op == "=~" else not found

    def __str__(self) -> str:
        return f'{self.label}{self.op}"{self.value}"'


# -- actions -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Cordon:
    """Mark the node unschedulable."""

    type: ClassVar[str] = "cordon"


@dataclass(frozen=True)
class Uncordon:
    """Make the node schedulable again (only if this service cordoned it)."""

    type: ClassVar[str] = "uncordon"


@dataclass(frozen=True)
class AddTaint:
    """Add a taint to the node."""

    type: ClassVar[str] = "taint"
    key: str = "accel-health.io/unhealthy"
    """Taint key."""
    value: str = "true"
    """Taint value."""
    effect: str = "NoSchedule"
    """NoSchedule, PreferNoSchedule or NoExecute."""


@dataclass(frozen=True)
class RemoveTaint:
    """Remove a taint this service added (only if nobody changed it since)."""

    type: ClassVar[str] = "untaint"
    key: str = "accel-health.io/unhealthy"
    """Taint key."""
    effect: str | None = None
    """Only the taint with this effect; None removes every taint of this key that the service added."""


@dataclass(frozen=True)
class Drain:
    """Evict the node's pods like `kubectl drain` (cordons first if needed)."""

    type: ClassVar[str] = "drain"
    timeout_seconds: int = 600
    """Overall time allowed for the drain, seconds (used by the Kubernetes executor)."""
    grace_period_seconds: int | None = None
    """Termination grace period for evicted pods; None keeps each pod's own."""
    delete_emptydir_data: bool = False
    """Allow evicting pods whose emptyDir data would be lost."""
    force_bare_pods: bool = False
    """Allow evicting pods that no controller would recreate."""
    on_timeout: str = "stop"
    """What the actions after the drain do when its deadline passes with pods left (a
    PodDisruptionBudget still refusing, pods still terminating): `stop` (default) skips the later
    disruptive actions, so nothing replaces a node whose protected pods are still on it, and a human
    decides; `proceed` runs them anyway (the rule's explicit choice). A refused drain (pods that need
    a permission, an eviction answered 403 or denied by admission) always stops."""


@dataclass(frozen=True)
class SetCondition:
    """Write a node condition (e.g. AcceleratorHealthy=False)."""

    type: ClassVar[str] = "condition"
    condition_type: str = "AcceleratorHealthy"
    """Condition type."""
    status: str | None = None
    """Condition status; None means "False" while firing and "True" when resolved."""


@dataclass(frozen=True)
class RecordEvent:
    """Record a Kubernetes Event on the node."""

    type: ClassVar[str] = "event"


@dataclass(frozen=True)
class AwsSetUnhealthy:
    """Mark the node's EC2 instance Unhealthy in its Auto Scaling group (it gets replaced)."""

    type: ClassVar[str] = "aws_set_unhealthy"
    handover_condition: str = ""
    """For a node in no Auto Scaling group (Karpenter, EKS Auto Mode, self-managed): write this node
    condition with status False (e.g. `AcceleratedHardwareReady`, what EKS node auto repair and
    Karpenter node repair act on) so that the node's own provisioner replaces it. Empty: off. Nodes
    labelled by Karpenter or EKS Auto Mode get it without any Auto Scaling call."""


@dataclass(frozen=True)
class AwsReboot:
    """Reboot the node's EC2 instance (RebootInstances): the graceful step before a replacement.

    When the fault comes back within `replace_after_reboot_seconds` of a reboot this service asked
    for (the node has booted since), the action escalates: the instance is marked Unhealthy in its
    Auto Scaling group (or handed over with `handover_condition`) instead of being rebooted again."""

    type: ClassVar[str] = "aws_reboot"
    replace_after_reboot_seconds: int = 86400
    """A fault within this many seconds after our reboot escalates to a replacement (default 1 day)."""
    handover_condition: str = ""
    """As for aws_set_unhealthy, used when the escalation finds the node in no Auto Scaling group."""


@dataclass(frozen=True)
class CaptureEvidence:
    """Capture the node's evidence before anything disruptive: the exporter's bundle (`GET /evidence`:
    device identity, the fault's own kernel-log lines, the latest checks) with what this service knows
    (the alerts, its decisions, a timeline), stored once per alert episode (S3 or a ConfigMap, see
    remediator/evidence/). A capture that fails is recorded and the next step runs anyway."""

    type: ClassVar[str] = "evidence"
    timeout_seconds: int = 10
    """Deadline for the fetch and the store together, seconds (1 to 120): the remediation never waits
    longer than this for its evidence."""


@dataclass(frozen=True)
class CloudWatchMetric:
    """Put one CloudWatch data point about the fault."""

    type: ClassVar[str] = "cloudwatch_metric"
    namespace: str = "AccelHealth"
    """CloudWatch namespace."""
    metric_name: str = "NodeFaults"
    """Metric name (value 1 per decision, dimensions node and alertname)."""


Action = (
    Cordon
    | Uncordon
    | AddTaint
    | RemoveTaint
    | Drain
    | SetCondition
    | RecordEvent
    | AwsSetUnhealthy
    | AwsReboot
    | CaptureEvidence
    | CloudWatchMetric
)

ACTION_TYPES: dict[str, type[Action]] = {
    cls.type: cls
    for cls in (
        Cordon,
        Uncordon,
        AddTaint,
        RemoveTaint,
        Drain,
        SetCondition,
        RecordEvent,
        AwsSetUnhealthy,
        AwsReboot,
        CaptureEvidence,
        CloudWatchMetric,
    )
}
DISRUPTIVE = frozenset({"cordon", "taint", "drain", "aws_set_unhealthy", "aws_reboot"})
TELEMETRY = frozenset({"cloudwatch_metric", "event", "evidence"})
"""Steps that tell (a metric, an Event, the evidence for the vendor) and never hold a safety step
back: a failure is recorded as failed and the next step runs."""
"""Actions that take capacity away: budget-gated, and never run for resolved alerts."""
RESOLVED_ALLOWED = frozenset({"uncordon", "untaint", "condition", "event", "cloudwatch_metric"})
REVERSALS = frozenset({"uncordon", "untaint"})
"""Actions that give capacity back: only in on_resolved."""
_TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")


@dataclass(frozen=True)
class Rule:
    """One policy rule."""

    name: str
    """Unique name, shown in every decision."""
    index: int
    """Position in `rules:` (0-based)."""
    matchers: tuple[Matcher, ...]
    """All must match (an empty list matches every alert)."""
    actions: tuple[Action, ...]
    """Run in order while the alert fires."""
    on_resolved: tuple[Action, ...] = ()
    """Run once when the alert resolves (non-destructive actions only)."""
    dry_run: bool = False
    """This rule only plans, even when the service acts."""
    verify: tuple[str, ...] | None = None
    """Checks run after a repair of a node this rule took out; None: `repair.checks`."""
    nodes: LabelSelector | None = None
    """Only alerts on nodes whose labels this selector matches (`nodes:`); None: any node."""
    budget: BudgetLimits | None = None
    """The rule's own disruption budget over the nodes `nodes` covers (every eligible node without
    `nodes:`); None: only the `safety:` budget."""

    def matches(self, labels: Mapping[str, str]) -> bool:
        """The alert matchers (not the node selector) match these alert labels."""
        return all(m.matches(labels) for m in self.matchers)


@dataclass(frozen=True)
class Selection:
    """The rule an alert gets, and why rules before it whose matchers matched did not apply."""

    rule: Rule | None
    """The first rule whose matchers and node selector match; None: no rule applies."""
    passed_over: tuple[str, ...] = ()
    """One line per rule passed over for its node selector (the node's labels, or the node unseen)."""


@dataclass(frozen=True)
class Policy:
    """A validated policy."""

    rules: tuple[Rule, ...]
    """Ordered rules."""
    safety: SafetySettings = field(default_factory=SafetySettings)
    """Safety limits."""
    events: EventsMode = "all"
    """Which node actions leave a core/v1 Event on the node: `all` (every action done, and the
    fault seen), `failures` (only actions that failed: a drain blocked, timed out or refused, an
    action that erred) or `none`. The `event` action writes its Event whatever this says."""
    source: str = "<string>"
    """Where it was loaded from."""
    repair: RepairSettings = field(default_factory=RepairSettings)
    """The closed loop back to the pool (remediator/lifecycle/repair.py)."""

    def first_match(self, labels: Mapping[str, str]) -> Rule | None:
        """The first rule whose matchers match, node selectors left aside (see `select`)."""
        return next((r for r in self.rules if r.matches(labels)), None)

    @property
    def selects_nodes(self) -> bool:
        """Some rule has a node selector (so the node must be looked at to pick a rule)."""
        return any(r.nodes is not None for r in self.rules)

    def rule(self, name: str) -> Rule | None:
        """The rule of this name, or None."""
        return next((r for r in self.rules if r.name == name), None)

    def select(self, labels: Mapping[str, str], node: Node | None, *, node_name: str) -> Selection:
        """The first rule whose matchers match the alert's labels and whose node selector (if any)
        matches the labels of `node`, the alert's node as observed (None: not seen, which no rule
        with a selector matches)."""
        passed: list[str] = []
        for rule in self.rules:
            if not rule.matches(labels):
                continue
            if rule.nodes is None:
                return Selection(rule, tuple(passed))
            if node is None:
                passed.append(
                    f"rule {rule.name!r} selects nodes ({rule.nodes}) but node {node_name} is not in the "
                    "observed nodes (no such node, or not seen yet): a node that cannot be seen matches "
                    "no node selector"
                )
            elif rule.nodes.matches(node.labels):
                return Selection(rule, tuple(passed))
            else:
                passed.append(f"rule {rule.name!r}: node {node_name} is not among its nodes ({rule.nodes})")
        return Selection(None, tuple(passed))


# -- loading and validation --------------------------------------------------------------------


def load_policy(path: Path | None = None) -> Policy:
    """The policy in `path`, or the shipped default policy."""
    if path is None:
        text = resources.files("remediator").joinpath(DEFAULT_POLICY_NAME).read_text(encoding="utf-8")
        return parse_policy(text, source=f"remediator/{DEFAULT_POLICY_NAME} (default)")
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise PolicyError(str(path), [f"cannot read: {exc.strerror or exc}"]) from exc
    return parse_policy(text, source=str(path))


def _field_problem(value: Any, expected: type | tuple[type, ...], name: str) -> str | None:
    if isinstance(value, bool) and bool not in (expected if isinstance(expected, tuple) else (expected,)):
        return f"{name}: expected {_type_name(expected)}, got a boolean"
    if not isinstance(value, expected):
        return f"{name}: expected {_type_name(expected)}, got {type(value).__name__} {value!r}"
    return None


def _type_name(expected: type | tuple[type, ...]) -> str:
    names = {int: "an integer", bool: "true or false", str: "a string", list: "a list", dict: "a mapping"}
    types = expected if isinstance(expected, tuple) else (expected,)
    return " or ".join(names.get(t, t.__name__) for t in types)


_ACTION_FIELDS: dict[str, dict[str, type | tuple[type, ...]]] = {
    "cordon": {},
    "uncordon": {},
    "event": {},
    "aws_set_unhealthy": {"handover_condition": str},
    "aws_reboot": {"replace_after_reboot_seconds": int, "handover_condition": str},
    "taint": {"key": str, "value": str, "effect": str},
    "untaint": {"key": str, "effect": str},
    "drain": {
        "timeout_seconds": int,
        "grace_period_seconds": int,
        "delete_emptydir_data": bool,
        "force_bare_pods": bool,
        "on_timeout": str,
    },
    "condition": {"condition_type": str, "status": str},
    "cloudwatch_metric": {"namespace": str, "metric_name": str},
    "evidence": {"timeout_seconds": int},
}
EVIDENCE_TIMEOUT_RANGE = (1, 120)
"""The evidence step's deadline, seconds: at least 1 (a fetch needs a round trip), at most 120 (the
remediation waits this long at most)."""


def _value_problem(key: str, value: Any, where: str) -> str | None:
    """What is wrong with an action field's value (its type being right), or None."""
    if isinstance(value, int) and not isinstance(value, bool) and value < 0:
        return f"{where}.{key}: must not be negative, got {value}"
    if key == "effect" and value not in _TAINT_EFFECTS:
        return f"{where}.effect: expected one of {', '.join(_TAINT_EFFECTS)}, got {value!r}"
    if key == "on_timeout" and value not in ("stop", "proceed"):
        return f'{where}.on_timeout: expected "stop" or "proceed", got {value!r}'
    if key == "status" and value not in ("True", "False", "Unknown"):
        return f'{where}.status: expected "True", "False" or "Unknown", got {value!r}'
    return None


def _parse_action(raw: Any, where: str, problems: list[str]) -> Action | None:
    if isinstance(raw, str):
        raw = {"type": raw}
    if not isinstance(raw, dict):
        problems.append(f"{where}: expected a mapping like {{type: cordon}} or a type name, got {raw!r}")
        return None
    kind = raw.get("type")
    if kind not in ACTION_TYPES:
        problems.append(
            f"{where}.type: unknown action type {kind!r} (known: {', '.join(sorted(ACTION_TYPES))})"
        )
        return None
    fields = _ACTION_FIELDS[kind]
    kwargs: dict[str, Any] = {}
    ok = True
    for key, value in raw.items():
        if key == "type":
            continue
        if key not in fields:
            known = ", ".join(sorted(fields)) or "none"
            problems.append(f"{where}.{key}: unknown field for action {kind} (known: {known})")
            ok = False
            continue
        problem = _field_problem(value, fields[key], f"{where}.{key}") or _value_problem(key, value, where)
        if problem is not None:
            problems.append(problem)
            ok = False
        else:
            kwargs[key] = value
    low, high = EVIDENCE_TIMEOUT_RANGE
    if kind == "evidence" and not low <= kwargs.get("timeout_seconds", low) <= high:
        problems.append(
            f"{where}.timeout_seconds: the evidence deadline must be {low} to {high} seconds, "
            f"got {kwargs['timeout_seconds']}"
        )
        ok = False
    if kind == "taint" and "key" in kwargs and not kwargs["key"]:
        problems.append(f"{where}.key: must not be empty")
        ok = False
    return ACTION_TYPES[kind](**kwargs) if ok else None


def _parse_actions(raw: Any, where: str, problems: list[str], *, resolved: bool) -> tuple[Action, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        problems.append(f"{where}: expected a list, got {type(raw).__name__}")
        return ()
    actions = []
    for i, item in enumerate(raw):
        action = _parse_action(item, f"{where}[{i}]", problems)
        if action is None:
            continue
        if resolved and action.type not in RESOLVED_ALLOWED:
            problems.append(
                f"{where}[{i}].type: {action.type} is not allowed when an alert resolves "
                f"(allowed: {', '.join(sorted(RESOLVED_ALLOWED))})"
            )
            continue
        if not resolved and action.type in REVERSALS:
            problems.append(f"{where}[{i}].type: {action.type} belongs in on_resolved, not in actions")
            continue
        actions.append(action)
    return tuple(actions)


def _number(value: Any, name: str, problems: list[str], *, minimum: float = 0.0) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        problems.append(f"{name}: expected a number, got {type(value).__name__} {value!r}")
        return None
    if value < minimum:
        problems.append(f"{name}: must be at least {minimum:g}, got {value}")
        return None
    return float(value)


def _count(value: Any, name: str, problems: list[str]) -> int | None:
    problem = _field_problem(value, int, name)
    if problem is None and value < 0:
        problem = f"{name}: must not be negative, got {value}"
    if problem:
        problems.append(problem)
        return None
    return int(value)


def _parse_rate_limits(raw: Any, problems: list[str]) -> dict[str, RateLimit]:
    where = "safety.rate_limits"
    if not isinstance(raw, dict):
        problems.append(f"{where}: expected a mapping of action type -> {{max_actions, window_seconds}}")
        return {}
    limits = {}
    for kind, spec in raw.items():
        at = f"{where}.{kind}"
        if kind not in ACTION_TYPES:
            problems.append(f"{at}: unknown action type (known: {', '.join(sorted(ACTION_TYPES))})")
            continue
        if not isinstance(spec, dict):
            problems.append(f"{at}: expected a mapping with max_actions and window_seconds")
            continue
        unknown = [k for k in spec if k not in ("max_actions", "window_seconds")]
        problems.extend(f"{at}.{k}: unknown field (known: max_actions, window_seconds)" for k in unknown)
        for required in ("max_actions", "window_seconds"):
            if required not in spec:
                problems.append(f"{at}.{required}: required")
        count = _count(spec["max_actions"], f"{at}.max_actions", problems) if "max_actions" in spec else None
        window = (
            _number(spec["window_seconds"], f"{at}.window_seconds", problems, minimum=1.0)
            if "window_seconds" in spec
            else None
        )
        if count is not None and window is not None and not unknown:
            limits[kind] = RateLimit(max_actions=count, window_seconds=window)
    return limits


_STORM_FIELDS = ("enabled", "threshold_percent", "min_nodes", "window_seconds", "cooldown_seconds")


def _parse_storm(raw: Any, problems: list[str]) -> StormSettings:
    where = "safety.storm_breaker"
    if not isinstance(raw, dict):
        problems.append(f"{where}: expected a mapping (fields: {', '.join(_STORM_FIELDS)})")
        return StormSettings()
    kwargs: dict[str, Any] = {}
    before = len(problems)
    for key, value in raw.items():
        name = f"{where}.{key}"
        if key == "enabled":
            if (problem := _field_problem(value, bool, name)) is not None:
                problems.append(problem)
            kwargs[key] = value
        elif key == "threshold_percent":
            number = _number(value, name, problems)
            if number is not None and number > 100:
                problems.append(f"{name}: must be at most 100, got {value}")
            kwargs[key] = number
        elif key == "min_nodes":
            kwargs[key] = _count(value, name, problems)
        elif key in ("window_seconds", "cooldown_seconds"):
            kwargs[key] = _number(value, name, problems, minimum=1.0 if key == "window_seconds" else 0.0)
        else:
            problems.append(f"{name}: unknown field (known: {', '.join(_STORM_FIELDS)})")
    return StormSettings(**kwargs) if len(problems) == before else StormSettings()


_SAFETY_FIELDS = (
    "max_disrupted_nodes",
    "max_disrupted_percent",
    "opt_out_label",
    "rate_limits",
    "storm_breaker",
    "alert_expiry_seconds",
)


def _parse_safety(raw: Any, problems: list[str]) -> SafetySettings:
    if raw is None:
        return SafetySettings()
    if not isinstance(raw, dict):
        problems.append(f"safety: expected a mapping, got {type(raw).__name__}")
        return SafetySettings()
    kwargs: dict[str, Any] = {}
    before = len(problems)
    for key, value in raw.items():
        name = f"safety.{key}"
        if key == "max_disrupted_nodes":
            kwargs[key] = _count(value, name, problems)
        elif key in ("max_disrupted_percent", "alert_expiry_seconds"):
            percent = key == "max_disrupted_percent"
            number = _number(value, name, problems, minimum=0.0 if percent else 60.0)
            if percent and number is not None and number > 100:
                problems.append(f"{name}: must be at most 100, got {value}")
            kwargs[key] = number
        elif key == "opt_out_label":
            problem = _field_problem(value, str, name)
            if problem is None and not value:
                problem = f"{name}: must not be empty"
            if problem:
                problems.append(problem)
            kwargs[key] = value
        elif key == "rate_limits":
            kwargs[key] = _parse_rate_limits(value, problems)
        elif key == "storm_breaker":
            kwargs[key] = _parse_storm(value, problems)
        else:
            problems.append(f"{name}: unknown field (known: {', '.join(_SAFETY_FIELDS)})")
    return SafetySettings(**kwargs) if len(problems) == before else SafetySettings()


_RULE_FIELDS = (
    "name",
    "match",
    "nodes",
    "actions",
    "on_resolved",
    "dry_run",
    "verify",
    "max_disrupted_nodes",
    "max_disrupted_percent",
)


def _parse_nodes(raw: Any, where: str, problems: list[str]) -> LabelSelector | None:
    before = len(problems)
    selector = label_selector_from_object(raw, where, problems)
    if len(problems) > before:
        return None
    if selector.empty:
        problems.append(
            f"{where}: give matchLabels and/or matchExpressions (leave nodes: out to match every node)"
        )
        return None
    return selector


def _parse_rule_budget(raw: Mapping[str, Any], where: str, problems: list[str]) -> BudgetLimits | None:
    if "max_disrupted_nodes" not in raw and "max_disrupted_percent" not in raw:
        return None
    count = percent = None
    if "max_disrupted_nodes" in raw:
        count = _count(raw["max_disrupted_nodes"], f"{where}.max_disrupted_nodes", problems)
    if "max_disrupted_percent" in raw:
        name = f"{where}.max_disrupted_percent"
        percent = _number(raw["max_disrupted_percent"], name, problems)
        if percent is not None and percent > 100:
            problems.append(f"{name}: must be at most 100, got {raw['max_disrupted_percent']}")
    actions = raw.get("actions")
    disruptive = isinstance(actions, list) and any(
        (a if isinstance(a, str) else a.get("type") if isinstance(a, dict) else None) in DISRUPTIVE
        for a in actions
    )
    if not disruptive:
        field_name = "max_disrupted_nodes" if "max_disrupted_nodes" in raw else "max_disrupted_percent"
        problems.append(
            f"{where}.{field_name}: the rule has no disruptive action for a budget to limit "
            f"({', '.join(sorted(DISRUPTIVE))})"
        )
    return BudgetLimits(max_disrupted_nodes=count, max_disrupted_percent=percent)


def _parse_matchers(raw_match: Any, where: str, problems: list[str]) -> tuple[Matcher, ...]:
    if not isinstance(raw_match, list):
        problems.append(f"{where}: expected a list of matcher strings, got {type(raw_match).__name__}")
        return ()
    matchers = []
    for i, text in enumerate(raw_match):
        if not isinstance(text, str):
            problems.append(f'{where}[{i}]: expected a string like remediation="drain", got {text!r}')
            continue
        try:
            matchers.append(Matcher.parse(text))
        except ValueError as exc:
            problems.append(f"{where}[{i}]: {exc}")
    return tuple(matchers)


def _parse_rule(raw: Any, *, index: int, seen: set[str], problems: list[str]) -> Rule | None:
    name = raw.get("name") if isinstance(raw, dict) else None
    where = f"rules[{index}]" + (f" ({name})" if isinstance(name, str) and name else "")
    if not isinstance(raw, dict):
        problems.append(f"{where}: expected a mapping, got {type(raw).__name__}")
        return None
    before = len(problems)
    if not isinstance(name, str) or not name:
        problems.append(f"{where}.name: required, a non-empty string")
    elif name in seen:
        problems.append(f"{where}.name: duplicate rule name {name!r}")
    else:
        seen.add(name)
    problems.extend(
        f"{where}.{key}: unknown field (known: {', '.join(_RULE_FIELDS)})"
        for key in raw
        if key not in _RULE_FIELDS
    )
    matchers = _parse_matchers(raw.get("match", []), f"{where}.match", problems)
    if "actions" not in raw:
        problems.append(f"{where}.actions: required (use [] to ignore matching alerts)")
    actions = _parse_actions(raw.get("actions"), f"{where}.actions", problems, resolved=False)
    on_resolved = _parse_actions(raw.get("on_resolved"), f"{where}.on_resolved", problems, resolved=True)
    dry_run = raw.get("dry_run", False)
    if not isinstance(dry_run, bool):
        problems.append(f"{where}.dry_run: expected true or false, got {dry_run!r}")
    verify = parse_checks(raw["verify"], f"{where}.verify", problems) if "verify" in raw else None
    nodes = _parse_nodes(raw["nodes"], f"{where}.nodes", problems) if "nodes" in raw else None
    budget = _parse_rule_budget(raw, where, problems)
    if len(problems) > before:
        return None
    return Rule(
        name=str(name),
        index=index,
        matchers=matchers,
        actions=actions,
        on_resolved=on_resolved,
        dry_run=bool(dry_run),
        verify=verify,
        nodes=nodes,
        budget=budget,
    )


def parse_policy(text: str, *, source: str = "<string>") -> Policy:
    """Parse and validate a policy document; raise one PolicyError listing every problem."""
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise PolicyError(source, [f"not valid YAML: {exc}"]) from exc
    if not isinstance(doc, dict):
        raise PolicyError(source, [f"expected a mapping with `rules:` at the top, got {type(doc).__name__}"])
    problems: list[str] = []
    for key in doc:
        if key not in ("rules", "safety", "events", "repair"):
            problems.append(f"{key}: unknown top-level field (known: rules, safety, events, repair)")
    safety = _parse_safety(doc.get("safety"), problems)
    repair = parse_repair(doc.get("repair"), problems)
    events = doc.get("events", "all")
    if events not in EVENTS_MODES:
        problems.append(f"events: expected one of {', '.join(EVENTS_MODES)}, got {events!r}")
    raw_rules = doc.get("rules")
    if not isinstance(raw_rules, list):
        problems.append(f"rules: expected a list of rules, got {type(raw_rules).__name__}")
        raise PolicyError(source, problems)
    rules: list[Rule] = []
    seen: set[str] = set()
    for index, raw in enumerate(raw_rules):
        rule = _parse_rule(raw, index=index, seen=seen, problems=problems)
        if rule is not None:
            rules.append(rule)
    if problems:
        raise PolicyError(source, problems)
    return Policy(rules=tuple(rules), safety=safety, events=events, source=source, repair=repair)
