"""The capture document (pure: no I/O): the node's evidence as its exporter served it, with what the
remediator knows, bounded in size, and the names it is stored under.

    {"schema": "accel-health.io/evidence-capture/v1",
     "node": "gpu-node-1", "captured_at": "2025-11-22T20:00:03.120Z", "remediator_version": "0.1.0",
     "kubernetes": {"name", "uid", "provider_id", "boot_id", "labels": {a few}},
     "trigger": {"alertname", "fingerprint", "rule", "starts_at"},
     "alerts": [{"alertname", "status", "fingerprint", "starts_at", "labels", "annotations"}],
     "decisions": [the remediator's decision records for the node, oldest first],
     "timeline": [{"at": RFC 3339, "what": "..."}],
     "fetch": {"url", "ok", "status", "error", "seconds", "bytes"},
     "node_evidence": <the exporter's accel-health.io/evidence/v1 document, or null>,
     "notes": ["..."]}
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import metadata
from typing import Any

from remediator.audit import DecisionRecord
from remediator.cluster import Node
from remediator.desired.firing import Cause
from remediator.intake.payload import Alert

SCHEMA = "accel-health.io/evidence-capture/v1"
"""The schema of a stored capture."""
NODE_SCHEMA = "accel-health.io/evidence/v1"
"""The schema of the exporter's `GET /evidence` document."""
ANNOTATION = "accel-health.io/evidence"
"""The Node annotation naming where the newest capture is (`s3://bucket/key` or
`configmap/<namespace>/<name>`)."""
MAX_STORED_BYTES = 900 * 1024
"""A capture larger than this is cut down (see `encode`): a ConfigMap holds at most 1 MiB, and the
exporter's own bound keeps a bundle under 256 KiB, so only a misbehaving exporter gets here."""
MAX_DECISIONS = 50
"""The newest decision records for the node that a capture keeps."""
NODE_LABELS = (
    "node.kubernetes.io/instance-type",
    "topology.kubernetes.io/region",
    "topology.kubernetes.io/zone",
    "kubernetes.io/hostname",
    "karpenter.sh/nodepool",
    "eks.amazonaws.com/nodegroup",
    "eks.amazonaws.com/capacityType",
    "nvidia.com/gpu.product",
    "nvidia.com/gpu.count",
    "nvidia.com/cuda.driver.major",
)
"""The Node labels a capture keeps (what a support case asks for; the rest are the cluster's own)."""


@dataclass(frozen=True)
class FetchResult:
    """How the fetch of the node's evidence went."""

    url: str | None
    """The URL asked (None when no exporter pod was found on the node)."""
    document: Mapping[str, Any] | None
    """The exporter's document (a JSON object), or None when the fetch failed."""
    error: str = ""
    """Why it failed, in words; empty when it worked."""
    status: int | None = None
    """The HTTP status of the answer, when there was one."""
    seconds: float = 0.0
    """How long the fetch took."""
    size: int = 0
    """Bytes of the answer's body."""

    @property
    def ok(self) -> bool:
        return self.document is not None and not self.error

    def as_json(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "ok": self.ok,
            "status": self.status,
            "error": self.error or None,
            "seconds": round(self.seconds, 3),
            "bytes": self.size,
        }


def rfc3339_ms(ts: float) -> str:
    """`2025-11-22T20:00:03.120Z`."""
    return datetime.fromtimestamp(ts, tz=UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def parse_time(text: object) -> float | None:
    """An RFC 3339 time (any offset, fractions up to nanoseconds) as unix seconds; None otherwise."""
    if not isinstance(text, str) or not text:
        return None
    cleaned = text.strip().replace("Z", "+00:00")
    match = re.match(r"^(.*T\d\d:\d\d:\d\d)(\.\d+)?(.*)$", cleaned)
    if match is None:
        return None
    head, fraction, tail = match.groups()
    try:
        when = datetime.fromisoformat(head + (fraction or "")[:7] + tail)
    except ValueError:
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return when.timestamp()


def remediator_version() -> str:
    try:
        return metadata.version("accel-health")
    except metadata.PackageNotFoundError:
        return "unknown"


def _alert_json(alert: Alert) -> dict[str, Any]:
    return {
        "alertname": alert.labels.get("alertname", ""),
        "status": alert.status,
        "fingerprint": alert.fingerprint,
        "starts_at": alert.starts_at,
        "labels": dict(alert.labels),
        "annotations": dict(alert.annotations),
    }


def _cause_json(cause: Cause) -> dict[str, Any]:
    return {
        "alertname": cause.alertname,
        "status": "firing",
        "fingerprint": cause.fingerprint,
        "starts_at": cause.starts_at,
        "labels": dict(cause.labels),
        "annotations": {},
        "rule": cause.rule,
    }


def _timeline(
    alerts: Sequence[Mapping[str, Any]],
    decisions: Sequence[DecisionRecord],
    node_evidence: Mapping[str, Any] | None,
    fetch: FetchResult,
    captured_at: float,
) -> list[dict[str, str]]:
    moments: list[tuple[float, str]] = []
    for alert in alerts:
        at = parse_time(alert.get("starts_at"))
        if at is not None:
            moments.append((at, f"{alert.get('alertname')} started firing"))
    for record in node_evidence.get("records") or [] if node_evidence else []:
        if not isinstance(record, Mapping):
            continue
        first = record.get("first") or []
        head = first[0] if first and isinstance(first[0], Mapping) else None
        at = parse_time(head.get("time")) if head else None
        if at is not None:
            code = f" {record.get('code')}" if record.get("code") not in (None, "") else ""
            moments.append((at, f"first {record.get('kind')}{code} record on {record.get('device')}"))
    for rec in decisions:
        moments.append((rec.time, f"{rec.action} {rec.outcome}: {rec.reason}"))
    collected = parse_time(node_evidence.get("collected_at")) if node_evidence else None
    if collected is not None:
        moments.append((collected, "the exporter collected the node's evidence"))
    what = "captured" if fetch.ok else f"captured without the node's evidence ({fetch.error})"
    moments.append((captured_at, what))
    moments.sort(key=lambda m: m[0])
    return [{"at": rfc3339_ms(at), "what": text} for at, text in moments]


def build_capture(
    *,
    node_name: str,
    node: Node | None,
    alert: Alert,
    rule: str,
    others: Sequence[Cause],
    decisions: Sequence[DecisionRecord],
    fetch: FetchResult,
    captured_at: float,
    version: str,
) -> dict[str, Any]:
    """The capture document (see the module docstring). `others` are the other alerts firing on the
    node now; `decisions` this service's records for the node (the newest MAX_DECISIONS kept)."""
    alerts = [_alert_json(alert)]
    alerts += [_cause_json(c) for c in others if c.fingerprint != alert.fingerprint]
    kept = list(decisions)[-MAX_DECISIONS:]
    notes: list[str] = []
    if len(decisions) > len(kept):
        notes.append(f"{len(decisions) - len(kept)} older decision record(s) for the node left out")
    node_evidence = dict(fetch.document) if fetch.document is not None else None
    if node_evidence is not None and node_evidence.get("schema") != NODE_SCHEMA:
        notes.append(f"the exporter's document has schema {node_evidence.get('schema')!r}, not {NODE_SCHEMA}")
    if node_evidence is not None and node_evidence.get("node") not in (None, node_name):
        notes.append(f"the exporter says it runs on node {node_evidence.get('node')!r}, not {node_name!r}")
    return {
        "schema": SCHEMA,
        "node": node_name,
        "captured_at": rfc3339_ms(captured_at),
        "remediator_version": version,
        "kubernetes": {
            "name": node_name,
            "uid": node.uid if node else None,
            "provider_id": node.provider_id if node else None,
            "boot_id": node.boot_id if node else None,
            "labels": {k: node.labels[k] for k in NODE_LABELS if node and k in node.labels},
        },
        "trigger": {
            "alertname": alert.labels.get("alertname", ""),
            "fingerprint": alert.fingerprint,
            "rule": rule,
            "starts_at": alert.starts_at,
        },
        "alerts": alerts,
        "decisions": [r.as_json() for r in kept],
        "timeline": _timeline(alerts, kept, node_evidence, fetch, captured_at),
        "fetch": fetch.as_json(),
        "node_evidence": node_evidence,
        "notes": notes,
    }


def _dumps(doc: Mapping[str, Any]) -> bytes:
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def encode(capture: Mapping[str, Any], *, limit: int = MAX_STORED_BYTES) -> bytes:
    """The capture as compact JSON of at most `limit` bytes. A larger one keeps only the first and
    the last line of each record group, then, if still too large, drops the node's records and
    then the node's evidence altogether; each cut is said in `notes`."""
    body = _dumps(capture)
    if len(body) <= limit:
        return body
    size = len(body)
    doc = dict(capture)
    notes = list(doc.get("notes") or [])
    evidence = dict(doc.get("node_evidence") or {})
    records = evidence.get("records")
    if isinstance(records, list):
        trimmed = []
        for group in records:
            if isinstance(group, Mapping):
                g = dict(group)
                first, last = list(g.get("first") or []), list(g.get("last") or [])
                dropped = len(first[1:]) + len(last[:-1])
                g["first"], g["last"] = first[:1], last[-1:]
                g["dropped"] = int(g.get("dropped") or 0) + dropped
                trimmed.append(g)
        evidence["records"] = trimmed
        doc["node_evidence"] = evidence
        doc["notes"] = [*notes, f"{size} bytes over the {limit}-byte limit: one first and one last line kept"]
        body = _dumps(doc)
        if len(body) <= limit:
            return body
        evidence["records"] = []
        doc["notes"] = [*notes, f"{size} bytes over the {limit}-byte limit: the node's records left out"]
        body = _dumps(doc)
        if len(body) <= limit:
            return body
    doc["node_evidence"] = None
    doc["notes"] = [*notes, f"{size} bytes over the {limit}-byte limit: the node's evidence left out"]
    doc["decisions"] = list(doc.get("decisions") or [])[-5:]
    return _dumps(doc)


def stamp(ts: float) -> str:
    """`20251122T200003.120Z`: sorts as the time does; part of every stored name."""
    when = datetime.fromtimestamp(ts, tz=UTC)
    return when.strftime("%Y%m%dT%H%M%S") + f".{when.microsecond // 1000:03d}Z"


_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")


def node_label_value(node: str) -> str:
    """The node's name as a label value (at most 63 characters): itself when it fits, else a
    prefix and a digest, the same every time (the CLI selects by it)."""
    if len(node) <= 63 and _DNS_LABEL.match(node):
        return node
    digest = hashlib.sha256(node.encode()).hexdigest()[:10]
    prefix = re.sub(r"[^a-z0-9.-]", "-", node.lower())[:52].strip("-.")
    return f"{prefix}-{digest}" if prefix else digest


def configmap_name(node: str, captured_at: float) -> str:
    """`accel-health-evidence-<node>-<UTC time>`: a DNS subdomain, lowercase, at most 253 characters."""
    when = stamp(captured_at).lower().replace(".", "-")
    base = re.sub(r"[^a-z0-9.-]", "-", node.lower())
    if len(base) > 200:
        base = base[:189].strip("-.") + "-" + hashlib.sha256(node.encode()).hexdigest()[:10]
    return f"accel-health-evidence-{base}-{when}"


def s3_key(prefix: str, node: str, captured_at: float, alertname: str) -> str:
    """`<prefix>/<node>/<UTC time>-<alertname>.json` (no prefix: `<node>/...`)."""
    safe_alert = re.sub(r"[^A-Za-z0-9_.-]", "_", alertname or "alert")
    head = prefix.strip("/")
    return f"{head + '/' if head else ''}{node}/{stamp(captured_at)}-{safe_alert}.json"
