"""The `repair:` section of the policy: how a quarantined node comes back (pure; YAML in, settings out).

    repair:
      enabled: true
      checks: [remapped, power]        # run on the node before it is returned (cheap ones by default)
      escalate_after: 5                 # quarantines of one node within window_seconds: a human decides
      window_seconds: 604800            # 7 days
      escalation_label: accel-health.io/needs-human
      check_timeout_seconds: 120
      interval_seconds: 15
      verify_new_nodes: false           # a new node registered with the startup taint: checks first?
    rules:
      - name: drain
        verify: [pciebw, remapped]      # per rule: the checks after a repair of this rule's faults

A rule's `verify` replaces `repair.checks` for the nodes its alerts took out; `verify: []` returns
them without a check (the alerts resolving after a reboot is then the only evidence).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

CHECK_NAMES = ("pciebw", "gpumem", "remapped", "power", "dcgm")
"""The exporter's active checks (exporter/checks/catalog.py), by the names GET /checks takes."""
DEFAULT_CHECKS = ("remapped", "power")
"""Cheap: they read NVML and load no GPU (seconds, not minutes)."""
MAX_ESCALATE_AFTER = 32
"""The most quarantines `escalate_after` may count: the stored history (node annotation and the
durable copy, each kept under 1 KiB) holds at most this many times."""


@dataclass(frozen=True)
class RepairSettings:
    """The closed loop: recognise a repair, verify, return to the pool or keep out, escalate."""

    enabled: bool = True
    """Return repaired nodes to the pool (after verification); false leaves them to a human."""
    checks: tuple[str, ...] = DEFAULT_CHECKS
    """Active checks run on the node (still cordoned) after a repair, unless its rule says `verify`."""
    escalate_after: int = 5
    """A node quarantined this many times within `window_seconds` is not returned: it is labelled
    for a human, alerted on and counted (NVSentinel's default: 5 in 7 days)."""
    window_seconds: float = 7 * 86400.0
    """The window of `escalate_after`, seconds (default 7 days)."""
    escalation_label: str = "accel-health.io/needs-human"
    """Label (value "true") put on an escalated node; removing it hands the node back to the loop."""
    check_timeout_seconds: float = 120.0
    """How long the node's exporter may take to answer the checks, seconds."""
    interval_seconds: float = 15.0
    """How often the loop looks at the quarantined nodes, seconds (also after every delivery)."""
    verify_new_nodes: bool = False
    """A node that registers with the startup taint (`accel-health.io/unverified`) under a name with
    no quarantine recorded: false (default) removes the taint at once (nothing says it was bad);
    true runs `checks` on it first and keeps it tainted while they fail. A node under a quarantined
    name is always verified."""


_FIELDS = (
    "enabled",
    "checks",
    "escalate_after",
    "window_seconds",
    "escalation_label",
    "check_timeout_seconds",
    "interval_seconds",
    "verify_new_nodes",
)


def parse_checks(raw: Any, where: str, problems: list[str]) -> tuple[str, ...] | None:
    """A list of check names -> tuple; None (and a problem) when it is not one."""
    if not isinstance(raw, list) or not all(isinstance(c, str) for c in raw):
        problems.append(f"{where}: expected a list of check names ({', '.join(CHECK_NAMES)})")
        return None
    unknown = [c for c in raw if c not in CHECK_NAMES]
    if unknown:
        problems.append(f"{where}: unknown check(s) {', '.join(unknown)} (known: {', '.join(CHECK_NAMES)})")
        return None
    return tuple(dict.fromkeys(raw))


def parse_repair(raw: Any, problems: list[str]) -> RepairSettings:  # noqa: PLR0912  a branch per field
    """The `repair:` mapping -> RepairSettings; problems are appended (defaults returned then)."""
    if raw is None:
        return RepairSettings()
    if not isinstance(raw, dict):
        problems.append(f"repair: expected a mapping (fields: {', '.join(_FIELDS)})")
        return RepairSettings()
    before = len(problems)
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        name = f"repair.{key}"
        if key in ("enabled", "verify_new_nodes"):
            if not isinstance(value, bool):
                problems.append(f"{name}: expected true or false, got {value!r}")
            kwargs[key] = value
        elif key == "checks":
            kwargs[key] = parse_checks(value, name, problems)
        elif key == "escalate_after":
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                problems.append(f"{name}: expected an integer of at least 1, got {value!r}")
            elif value > MAX_ESCALATE_AFTER:
                problems.append(
                    f"{name}: at most {MAX_ESCALATE_AFTER} (the stored history keeps that many), got {value}"
                )
            kwargs[key] = value
        elif key in ("window_seconds", "check_timeout_seconds", "interval_seconds"):
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                problems.append(f"{name}: expected a positive number of seconds, got {value!r}")
            else:
                kwargs[key] = float(value)
        elif key == "escalation_label":
            if not isinstance(value, str) or not value:
                problems.append(f"{name}: expected a non-empty label name, got {value!r}")
            kwargs[key] = value
        else:
            problems.append(f"{name}: unknown field (known: {', '.join(_FIELDS)})")
    return RepairSettings(**kwargs) if len(problems) == before else RepairSettings()
