"""Alerts as documents (the drains kept in the gate state) and the deliveries the engine makes up
itself: what Alertmanager's API shows, a resolve of an alert no longer shown, a resumed drain; the
reversals held back by other causes, kept for the next leader."""

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


def stored_alerts(docs: Any, where: str, *, status: str) -> list[Alert]:
    """Alert documents kept in the gate state, read back as a webhook's; StateError naming `where`."""
    try:
        return list(parse_payload({"version": "4", "status": status, "alerts": docs}).alerts)
    except PayloadError as exc:
        raise StateError(f"{where}: {exc}") from exc


def running_drains(section: Any) -> dict[str, list[Alert]]:
    """The stored `drains` section: node -> the alerts its drain was started for."""
    if not isinstance(section, Mapping):
        raise StateError("drains: expected a mapping")
    drains = {
        str(node): stored_alerts(alerts, f"drains.{node}", status="firing")
        for node, alerts in section.items()
    }
    return {node: alerts for node, alerts in drains.items() if alerts}


def made_up_payload(alerts: list[Alert], *, group_key: str, receiver: str = "") -> WebhookPayload:
    """A delivery the engine makes up itself (Alertmanager's API view, a resumed drain)."""
    return WebhookPayload(
        version="4",
        group_key=group_key,
        truncated_alerts=0,
        status="firing" if any(a.status == "firing" for a in alerts) else "resolved",
        receiver=receiver,
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
            alerts = stored_alerts([item["alert"]], f"held.{node}", status="resolved")
            if rule is None:
                logger.warning("%s: held reversal of rule %r dropped: no such rule", node, item.get("rule"))
                continue
            held.setdefault(str(node), []).extend((alert, rule) for alert in alerts)
    return held
