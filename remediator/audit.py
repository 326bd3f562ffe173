"""Decision records: what the remediator decided, why, and what it did (or would have done).

One record per (alert, action) decision. `GET /actions` serves the last N as JSON, newest last; each
record is also logged as one human-readable line. A deferred action gets a record when it is first
deferred and whenever another gate holds it; the engine's `pending` list (GET /state) shows how often
it was re-evaluated since.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

Outcome = Literal["planned", "started", "done", "skipped", "deferred", "ignored", "failed", "stopped"]

DEFAULT_KEEP = 1000


@dataclass(frozen=True)
class DecisionRecord:
    """One decision about one action for one alert."""

    time: float
    """Unix time of the decision."""
    node: str | None
    """Node name (None when the alert had no node label)."""
    action: str
    """Action type, or "none" for ignored alerts."""
    alertname: str
    """The alert's alertname label."""
    fingerprint: str
    """Alertmanager's fingerprint of the alert's label set."""
    starts_at: str
    """The alert's startsAt."""
    status: Literal["firing", "resolved"]
    """The alert's status."""
    rule: str | None
    """Name of the policy rule that matched, if any."""
    dry_run: bool
    """True when nothing was (or will be) changed."""
    outcome: Outcome
    """planned, started (a drain running in the background: its end gets a record of its own), done,
    skipped, deferred, ignored or failed."""
    reason: str
    """Why, in words."""
    gate: str | None = None
    """The safety gate that held the action back, if any."""
    details: Mapping[str, Any] = field(default_factory=dict)
    """Action-specific details (a drain lists evict/skip/blocked pods)."""

    def as_json(self) -> dict[str, Any]:
        """The /actions representation."""
        return {
            "time": datetime.fromtimestamp(self.time, tz=UTC).isoformat(timespec="milliseconds"),
            "node": self.node,
            "action": self.action,
            "alertname": self.alertname,
            "fingerprint": self.fingerprint,
            "starts_at": self.starts_at,
            "status": self.status,
            "rule": self.rule,
            "dry_run": self.dry_run,
            "outcome": self.outcome,
            "reason": self.reason,
            "gate": self.gate,
            "details": dict(self.details),
        }

    def log_line(self) -> str:
        """`DRY-RUN gpu-node-1: drain (alert AccelGPUFatalXid, rule drain): planned: would evict ...`"""
        prefix = "DRY-RUN " if self.dry_run else ""
        rule = f", rule {self.rule}" if self.rule else ""
        gate = f" [gate {self.gate}]" if self.gate else ""
        return (
            f"{prefix}{self.node or '<no node>'}: {self.action} (alert {self.alertname}{rule}): "
            f"{self.outcome}{gate}: {self.reason}"
        )


class DecisionLog:
    """The last `keep` decision records, oldest first (in memory; an audit sink comes later)."""

    def __init__(self, *, keep: int = DEFAULT_KEEP) -> None:
        self._records: deque[DecisionRecord] = deque(maxlen=keep)

    def append(self, record: DecisionRecord) -> None:
        self._records.append(record)

    def records(self) -> list[DecisionRecord]:
        return list(self._records)

    def __len__(self) -> int:
        return len(self._records)
