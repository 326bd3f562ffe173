"""Alerts as documents (the drains kept in the gate state) and the deliveries the engine makes up
itself: what Alertmanager's API shows, a resolve of an alert no longer shown, a resumed drain."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from remediator.payload import Alert, PayloadError, WebhookPayload, parse_payload
from remediator.policy import Policy, Rule
from remediator.state import StateError

logger = logging.getLogger("remediator.decisions")


def alert_document(alert: Alert) -> dict[str, Any]:
    """An alert as Alertmanager's webhook sends it (what `parse_payload` reads back)."""
    return {
        "status": alert.status,
        "labels": dict(alert.labels),
        "annotations": dict(alert.annotations),
        "startsAt": alert.starts_at,
        "endsAt": alert.ends_at,
        "generatorURL": alert.generator_url,
        "fingerprint": alert.fingerprint,
    }


def running_drains(section: Any) -> dict[str, list[Alert]]:
    """The stored `drains` section: node -> the alerts its drain was started for."""
    if not isinstance(section, Mapping):
        raise StateError("drains: expected a mapping")
    drains: dict[str, list[Alert]] = {}
    for node, alerts in section.items():
        try:
            payload = parse_payload({"version": "4", "status": "firing", "alerts": alerts})
        except PayloadError as exc:
            raise StateError(f"drains.{node}: {exc}") from exc
        if payload.alerts:
            drains[str(node)] = list(payload.alerts)
    return drains


def resume_payload(alerts: list[Alert]) -> WebhookPayload:
    return WebhookPayload(
        version="4",
        group_key="accel-health/resume",
        truncated_alerts=0,
        status="firing",
        receiver="accel-health-remediator",
        group_labels={},
        common_labels={},
        common_annotations={},
        external_url="",
        alerts=tuple(alerts),
    )


def api_payload(alerts: list[Alert]) -> WebhookPayload:
    """What Alertmanager's API shows, as one delivery."""
    return WebhookPayload(
        version="4",
        group_key="alertmanager-api",
        truncated_alerts=0,
        status="firing" if any(a.status == "firing" for a in alerts) else "resolved",
        receiver="",
        group_labels={},
        common_labels={},
        common_annotations={},
        external_url="",
        alerts=tuple(alerts),
    )


def resolved_alert(fingerprint: str, labels: Mapping[str, str], starts_at: str, now: float) -> Alert:
    """The resolve of an alert no Alertmanager shows any more."""
    ends = datetime.fromtimestamp(now, tz=UTC).isoformat().replace("+00:00", "Z")
    return Alert(
        status="resolved",
        labels=labels,
        annotations={},
        starts_at=starts_at,
        ends_at=ends,
        generator_url="",
        fingerprint=fingerprint,
    )


def held_reversals(section: Mapping[str, Any], policy: Policy) -> dict[str, list[tuple[Alert, Rule]]]:
    """The stored `held` section: node -> (resolved alert, its rule) whose reversals wait. An entry
    whose rule is no longer in the policy is dropped (logged): nothing would say what to reverse."""
    rules = {rule.name: rule for rule in policy.rules}
    held: dict[str, list[tuple[Alert, Rule]]] = {}
    for node, items in section.items():
        for item in items:
            rule = rules.get(str(item.get("rule", "")))
            try:
                payload = parse_payload({"version": "4", "status": "resolved", "alerts": [item["alert"]]})
            except PayloadError as exc:
                raise StateError(f"held.{node}: {exc}") from exc
            if rule is None:
                logger.warning("%s: held reversal of rule %r dropped: no such rule", node, item.get("rule"))
                continue
            held.setdefault(str(node), []).extend((alert, rule) for alert in payload.alerts)
    return held
