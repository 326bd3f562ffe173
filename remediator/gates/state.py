"""The gates document: the only thing this service keeps outside the nodes it acts on (pure codec).

Everything else a new leader needs (budget holders, ownership, idempotency, running drains, held
reversals, rate-limit times) is derived from the nodes (remediator/lifecycle/record.py). What cannot
be derived from any node is kept here, in one small object (the Kubernetes executor: the ConfigMap
`accel-health-remediator-gates`), written only when it changes:

    {"version": 2,
     "pause":   {"paused": true, "since": 1732312800.0, "reason": "rack maintenance"},
     "breaker": {"open": true, "opened_at": 1732312800.0, "trips": 3}}

The pause switch (set by an operator) and the storm breaker's latch (open since when, how often it
opened) change a handful of times a day, so the object is written that often, whatever the size of
the fleet or of a storm. It stays under 1 KiB: the pause reason is cut to `MAX_REASON` characters.
Whether the breaker is above its threshold is not stored: every leader counts the nodes with faults
firing now; a new leader that finds the latch open keeps it open until the fraction has stayed below
the threshold for a whole cooldown counted from its own start (never shorter than intended).

A leader reads it when it becomes leader, before it is ready; a write carries the resourceVersion it
was read at, and a conflict (two leaders around a fail-over) reads it again and re-applies the change.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from remediator.gates.safety import PauseSwitch, StormBreaker

GATES_VERSION = 2
MAX_REASON = 512
"""Characters of a pause reason kept (the document stays under 1 KiB)."""


class StateError(ValueError):
    """Stored state that cannot be read; the message names the field."""


def gates_document(pause: PauseSwitch, breaker: StormBreaker) -> dict[str, Any]:
    """The document for the pause switch and the breaker's latch."""
    return {
        "version": GATES_VERSION,
        "pause": {"paused": pause.paused, "since": pause.since, "reason": pause.reason[:MAX_REASON]},
        "breaker": {"open": breaker.open, "opened_at": breaker.opened_at, "trips": breaker.trips},
    }


def load_gates(doc: Any, pause: PauseSwitch, breaker: StormBreaker) -> None:
    """Restore both from a stored document; StateError naming the field when it cannot be used
    (nothing is changed then)."""
    if not isinstance(doc, Mapping):
        raise StateError(f"expected a mapping, got {type(doc).__name__}")
    if doc.get("version") != GATES_VERSION:
        raise StateError(f"version: expected {GATES_VERSION}, got {doc.get('version')!r}")
    sections = {}
    for key in ("pause", "breaker"):
        section = doc.get(key, {})
        if not isinstance(section, Mapping):
            raise StateError(f"{key}: expected a mapping")
        sections[key] = section
    trial_pause, trial_breaker = (
        PauseSwitch(clock=lambda: 0.0),
        StormBreaker(settings=breaker.settings, clock=lambda: 0.0),
    )
    for key, part in (("pause", trial_pause), ("breaker", trial_breaker)):
        try:
            part.load_state(sections[key])
        except ValueError as exc:
            raise StateError(f"{key}.{exc}") from exc
    pause.load_state(sections["pause"])
    latch = {k: v for k, v in sections["breaker"].items() if k in ("open", "opened_at", "trips")}
    breaker.load_state({**latch, "eligible": breaker.eligible, "alerting": breaker.alerting})
