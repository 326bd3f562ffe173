"""Alertmanager webhook (version 4) payloads as frozen dataclasses.

Lenient on fields it does not know (newer Alertmanager releases add some), strict on the types of
the fields it reads: any mismatch raises PayloadError naming the field, e.g. `alerts[0].labels.node`.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any


class PayloadError(ValueError):
    """The body is not a usable webhook payload; the message names the field."""


@dataclass(frozen=True)
class Alert:
    """One alert of a webhook payload."""

    status: str
    """"firing" or "resolved"."""
    labels: Mapping[str, str]
    """The alert's label set."""
    annotations: Mapping[str, str]
    """summary, description, runbook_url, ..."""
    starts_at: str
    """startsAt in UTC with milliseconds (`canonical_time`; part of the idempotency key)."""
    ends_at: str
    """endsAt, as sent."""
    generator_url: str
    """Link to the expression in Prometheus."""
    fingerprint: str
    """Hash of the label set; computed here when the sender left it out."""


@dataclass(frozen=True)
class WebhookPayload:
    """A whole webhook delivery: a snapshot of one alert group."""

    version: str
    """"4"."""
    group_key: str
    """Alertmanager's key of the group."""
    truncated_alerts: int
    """Alerts left out because of max_alerts."""
    status: str
    """Group status: "firing" when any alert fires."""
    receiver: str
    """Receiver name."""
    group_labels: Mapping[str, str]
    """Labels the group is keyed on."""
    common_labels: Mapping[str, str]
    """Labels all alerts share."""
    common_annotations: Mapping[str, str]
    """Annotations all alerts share."""
    external_url: str
    """Alertmanager's external URL."""
    alerts: tuple[Alert, ...]
    """The alerts."""


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    return {
        bool: "boolean",
        int: "number",
        float: "number",
        str: "string",
        list: "array",
        dict: "object",
    }.get(type(value), type(value).__name__)


def _string(obj: Mapping[str, Any], key: str, where: str, *, default: str = "") -> str:
    value = obj.get(key, default)
    if not isinstance(value, str):
        raise PayloadError(f"{where}{key}: expected a string, got {_type_name(value)}")
    return value


def _string_map(obj: Mapping[str, Any], key: str, where: str, *, required: bool = False) -> Mapping[str, str]:
    if key not in obj:
        if required:
            raise PayloadError(f"{where}{key}: required field is missing")
        return MappingProxyType({})
    value = obj[key]
    if not isinstance(value, dict):
        raise PayloadError(f"{where}{key}: expected an object of strings, got {_type_name(value)}")
    for k, v in value.items():
        if not isinstance(v, str):
            raise PayloadError(f"{where}{key}.{k}: expected a string, got {_type_name(v)}")
    return MappingProxyType(dict(value))


def _fingerprint(labels: Mapping[str, str]) -> str:
    canon = json.dumps(sorted(labels.items()), separators=(",", ":"))
    return hashlib.sha256(canon.encode()).hexdigest()[:16]


MAX_ALERTNAME = 128
"""The longest alertname accepted (a Kubernetes Event's reason is at most 128 characters)."""
_FINGERPRINT = re.compile(r"[A-Za-z0-9._:-]{1,64}")
"""A fingerprint as the node's record keeps it (Alertmanager's are 16 hex digits)."""

_RFC3339 = re.compile(r"(\d{4}-\d{2}-\d{2})[Tt ](\d{2}:\d{2}:\d{2})(?:\.(\d+))?(Z|z|[+-]\d{2}:\d{2})$")


def canonical_time(text: str) -> str:
    """An RFC 3339 time in UTC with milliseconds, truncated, as Alertmanager's API v2 writes it (its
    webhooks write nanoseconds): the same startsAt reads the same from both, so idempotency keys
    match. Text that is not RFC 3339 is kept as sent."""
    m = _RFC3339.match(text)
    if m is None:
        return text
    date, clock, frac, zone = m.groups()
    try:
        when = datetime.fromisoformat(f"{date}T{clock}{'+00:00' if zone in 'Zz' else zone}")
        u = when.astimezone(UTC)
    except (ValueError, OverflowError):
        return text
    millis = (frac or "").ljust(3, "0")[:3]
    return f"{u.year:04d}-{u.month:02d}-{u.day:02d}T{u.hour:02d}:{u.minute:02d}:{u.second:02d}.{millis}Z"


def _alert(raw: Any, index: int) -> Alert:
    where = f"alerts[{index}]."
    if not isinstance(raw, dict):
        raise PayloadError(f"alerts[{index}]: expected an object, got {_type_name(raw)}")
    status = _string(raw, "status", where, default="firing")
    if status not in ("firing", "resolved"):
        raise PayloadError(f'{where}status: expected "firing" or "resolved", got {status!r}')
    labels = _string_map(raw, "labels", where, required=True)
    alertname = labels.get("alertname", "")
    if len(alertname) > MAX_ALERTNAME:
        # It becomes an Event's and a condition's reason, and part of the node's record.
        raise PayloadError(
            f"{where}labels.alertname: {len(alertname)} characters, at most {MAX_ALERTNAME} (it names "
            "Events and conditions on the node)"
        )
    fingerprint = _string(raw, "fingerprint", where) or _fingerprint(labels)
    if not _FINGERPRINT.fullmatch(fingerprint):
        raise PayloadError(
            f"{where}fingerprint: expected 1 to 64 letters, digits or ._:- (Alertmanager sends 16 hex "
            f"digits), got {fingerprint[:80]!r}{'...' if len(fingerprint) > 80 else ''}"
        )
    starts_at = _string(raw, "startsAt", where)
    if not starts_at:
        # Part of the idempotency key: without it every episode of the alert would share one key.
        raise PayloadError(f"{where}startsAt: required field is missing (Alertmanager always sends it)")
    return Alert(
        status=status,
        labels=labels,
        annotations=_string_map(raw, "annotations", where),
        starts_at=canonical_time(starts_at),
        ends_at=_string(raw, "endsAt", where),
        generator_url=_string(raw, "generatorURL", where),
        fingerprint=fingerprint,
    )


def parse_payload(doc: Any) -> WebhookPayload:
    """A decoded JSON document -> WebhookPayload, or PayloadError."""
    if not isinstance(doc, dict):
        raise PayloadError(f"expected a JSON object (Alertmanager webhook v4), got {_type_name(doc)}")
    if "alerts" not in doc:
        raise PayloadError("alerts: required field is missing")
    raw_alerts = doc["alerts"]
    if not isinstance(raw_alerts, list):
        raise PayloadError(f"alerts: expected an array, got {_type_name(raw_alerts)}")
    version = _string(doc, "version", "", default="4")
    if version != "4":
        raise PayloadError(f'version: expected "4" (Alertmanager webhook v4), got {version!r}')
    truncated = doc.get("truncatedAlerts", 0)
    if not isinstance(truncated, int) or isinstance(truncated, bool):
        raise PayloadError(f"truncatedAlerts: expected an integer, got {_type_name(truncated)}")
    return WebhookPayload(
        version=version,
        group_key=_string(doc, "groupKey", ""),
        truncated_alerts=truncated,
        status=_string(doc, "status", ""),
        receiver=_string(doc, "receiver", ""),
        group_labels=_string_map(doc, "groupLabels", ""),
        common_labels=_string_map(doc, "commonLabels", ""),
        common_annotations=_string_map(doc, "commonAnnotations", ""),
        external_url=_string(doc, "externalURL", ""),
        alerts=tuple(_alert(raw, i) for i, raw in enumerate(raw_alerts)),
    )


def parse_body(body: bytes) -> WebhookPayload:
    """Raw request body -> WebhookPayload, or PayloadError (bad UTF-8, bad JSON, too deep, bad fields)."""
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise PayloadError(f"body is not valid JSON: {exc}") from exc
    return parse_payload(doc)
