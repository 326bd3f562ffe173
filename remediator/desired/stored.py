"""Alerts as documents, and the deliveries the engine makes up itself: what Alertmanager's API
shows, a resolve of an alert no longer shown, a resumed drain."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from remediator.intake.payload import Alert, WebhookPayload


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
