"""Where captures are kept: a ConfigMap per capture in the remediator's namespace (the default), an S3
bucket (`--evidence-bucket`, the aws overlay), or memory (a cluster snapshot, tests).

ConfigMaps are written once (`immutable: true`) and never rewritten; the only other write is the
deletion of old ones, right after a capture: beyond the newest `per_node` of a node, beyond the newest
`total` in the namespace, and older than `max_age_seconds`. They are listed by label as metadata only
(PartialObjectMetadataList: a LIST of 100 captures does not carry 100 bundles) and one is read with a
LIST narrowed to its name, so the remediator needs `list`, `create` and `delete` on ConfigMaps in its
namespace and nothing else (deploy/base/remediator-rbac.yaml). A capture stays when its Node is gone:
it is kept apart from the Node object. In S3, retention is the bucket's lifecycle rules' business.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp

from remediator.evidence.bundle import configmap_name, node_label_value, parse_time, rfc3339_ms, s3_key

logger = logging.getLogger("remediator.evidence")

EVIDENCE_LABEL = "accel-health.io/evidence"
"""Label (value "true") on every evidence ConfigMap."""
NODE_LABEL = "accel-health.io/evidence-node"
"""Label naming the node (`node_label_value`: the name, or a prefix and a digest of a long one); the
annotation of the same key holds the full name."""
CAPTURED_AT = "accel-health.io/evidence-captured-at"
"""Annotation: when the capture was made (RFC 3339, milliseconds)."""
ALERTNAME = "accel-health.io/evidence-alertname"
"""Annotation: the alert the capture was made for."""
MANAGED_BY = "app.kubernetes.io/managed-by"
DATA_KEY = "evidence.json"
"""The ConfigMap's data key holding the capture."""
METADATA_ONLY = "application/json;as=PartialObjectMetadataList;v=v1;g=meta.k8s.io,application/json"
"""Accept header of a LIST that returns metadata only."""


class EvidenceStoreError(RuntimeError):
    """The capture could not be stored or read; the message says why."""

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        """The HTTP status of the answer, when there was one."""


@dataclass(frozen=True)
class StoredEvidence:
    """One stored capture, as its listing shows it (no body)."""

    location: str
    """`configmap/<namespace>/<name>`, `s3://<bucket>/<key>` or `memory/<node>/<n>`."""
    node: str
    """The node it is about."""
    captured_at: float
    """Unix time of the capture."""
    alertname: str = ""
    """The alert it was made for."""
    uid: str = ""
    """The ConfigMap's uid (a deletion's precondition)."""


@dataclass(frozen=True)
class EvidenceRetention:
    """How many captures the cluster keeps, and how long."""

    per_node: int = 3
    """Newest captures kept per node (the older ones of the node are deleted)."""
    total: int = 100
    """Newest captures kept in the namespace, all nodes together (bounds what etcd holds: at most
    this many objects of at most 900 KiB, 256 KiB in practice)."""
    max_age_seconds: float = 30 * 86400.0
    """Captures older than this are deleted (default 30 days)."""

    def __post_init__(self) -> None:
        if self.per_node < 1 or self.total < 1 or self.max_age_seconds <= 0:
            raise ValueError(
                "evidence retention: keep at least 1 capture per node and in total, for a positive time "
                f"(got per_node={self.per_node}, total={self.total}, max_age_seconds={self.max_age_seconds})"
            )


def expired(
    items: list[StoredEvidence], *, now: float, retention: EvidenceRetention, keep: str = ""
) -> list[StoredEvidence]:
    """The captures to delete (pure): older than the retention, beyond the newest `per_node` of their
    node, or beyond the newest `total`; never the one at `keep` (the capture just written)."""
    newest_first = sorted(items, key=lambda i: (i.captured_at, i.location), reverse=True)
    doomed: list[StoredEvidence] = []
    per_node: dict[str, int] = {}
    kept = 0
    for item in newest_first:
        if item.location == keep:
            per_node[item.node] = per_node.get(item.node, 0) + 1
            kept += 1
            continue
        seen = per_node.get(item.node, 0)
        if now - item.captured_at > retention.max_age_seconds or seen >= retention.per_node:
            doomed.append(item)
            continue
        if kept >= retention.total:
            doomed.append(item)
            continue
        per_node[item.node] = seen + 1
        kept += 1
    return doomed


class EvidenceStore(Protocol):
    """Keeps captures; every method raises EvidenceStoreError when it cannot."""

    def describe(self) -> str:
        """Where captures go, in words (for dry-run decisions and logs)."""
        ...

    async def put(self, *, node: str, captured_at: float, alertname: str, body: bytes) -> str:
        """Store one capture, written once; its location (`configmap/ns/name`, `s3://bucket/key`)."""
        ...

    async def captures(self, node: str) -> list[StoredEvidence]:
        """The node's stored captures, newest first."""
        ...

    async def read(self, item: StoredEvidence) -> bytes:
        """The body of one stored capture."""
        ...


async def latest(store: EvidenceStore, node: str) -> tuple[StoredEvidence, bytes] | None:
    """The node's newest capture and its body, or None when none is stored."""
    items = await store.captures(node)
    if not items:
        return None
    return items[0], await store.read(items[0])


# -- memory ---------------------------------------------------------------------------------------


class MemoryEvidenceStore:
    """EvidenceStore in this process (a cluster snapshot's service, the demo, tests)."""

    def __init__(self, *, per_node: int = 3) -> None:
        self._per_node = per_node
        self.items: dict[str, list[tuple[StoredEvidence, bytes]]] = {}
        """node -> its captures, oldest first."""
        self._count = 0

    def describe(self) -> str:
        return "memory (this process only)"

    async def put(self, *, node: str, captured_at: float, alertname: str, body: bytes) -> str:
        self._count += 1
        item = StoredEvidence(f"memory/{node}/{self._count}", node, captured_at, alertname)
        kept = self.items.setdefault(node, [])
        kept.append((item, body))
        del kept[: -self._per_node]
        return item.location

    async def captures(self, node: str) -> list[StoredEvidence]:
        return [item for item, _ in reversed(self.items.get(node, []))]

    async def read(self, item: StoredEvidence) -> bytes:
        for stored, body in self.items.get(item.node, []):
            if stored.location == item.location:
                return body
        raise EvidenceStoreError(f"{item.location}: gone")


# -- ConfigMaps -----------------------------------------------------------------------------------


class ConfigMapEvidenceStore:
    """EvidenceStore over ConfigMaps in one namespace (kubernetes.aio CoreV1Api)."""

    def __init__(
        self,
        *,
        core: Any,
        namespace: str,
        retention: EvidenceRetention | None = None,
        manager: str = "accel-health-remediator",
        should_act: Callable[[], bool] = lambda: True,
        clock: Callable[[], float],
        request_timeout_seconds: float = 10.0,
    ) -> None:
        self._core = core
        """A kubernetes.aio CoreV1Api."""
        self.namespace = namespace
        self.retention = retention or EvidenceRetention()
        self._manager = manager
        self._should_act = should_act
        """Asked before every write (the leader writes, a standby never does)."""
        self._clock = clock
        self._timeout = request_timeout_seconds
        self.deleted = 0
        """Captures deleted by the retention (a metric for tests)."""
        self.prune_errors = 0
        """Deletions or listings of the retention that failed (logged; the next capture tries again)."""

    def describe(self) -> str:
        return f"an immutable ConfigMap in namespace {self.namespace}"

    async def _request(self, what: str, method: Callable[..., Awaitable[Any]], *args: Any, **kw: Any) -> Any:
        try:
            resp = await method(*args, _request_timeout=self._timeout, **kw)
            try:
                body = await resp.read()
            finally:
                resp.release()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise EvidenceStoreError(f"Kubernetes API: {what}: {type(exc).__name__}: {exc}") from exc
        if 200 <= resp.status < 300:
            return json.loads(body) if body else {}
        message = body.decode("utf-8", "replace")
        try:
            message = str(json.loads(body).get("message") or message)
        except (ValueError, AttributeError):
            message = message[:300]
        raise EvidenceStoreError(f"Kubernetes API: {what}: {resp.status}: {message}", status=resp.status)

    async def put(self, *, node: str, captured_at: float, alertname: str, body: bytes) -> str:
        name = configmap_name(node, captured_at)
        what = f"create ConfigMap {self.namespace}/{name}"
        if not self._should_act():
            raise EvidenceStoreError(f"not the leader; refusing to {what}")
        obj = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {
                "name": name,
                "namespace": self.namespace,
                "labels": {
                    MANAGED_BY: self._manager,
                    EVIDENCE_LABEL: "true",
                    NODE_LABEL: node_label_value(node),
                },
                "annotations": {
                    NODE_LABEL: node,
                    CAPTURED_AT: rfc3339_ms(captured_at),
                    ALERTNAME: alertname,
                },
            },
            "immutable": True,
            "data": {DATA_KEY: body.decode("utf-8")},
        }
        create = self._core.create_namespaced_config_map_without_preload_content
        await self._request(what, create, self.namespace, obj)
        location = f"configmap/{self.namespace}/{name}"
        await self.prune(keep=location)
        return location

    def _item(self, obj: Any) -> StoredEvidence | None:
        meta = obj.get("metadata") or {} if isinstance(obj, dict) else {}
        annotations = meta.get("annotations") or {}
        node = annotations.get(NODE_LABEL) or (meta.get("labels") or {}).get(NODE_LABEL)
        at = parse_time(annotations.get(CAPTURED_AT)) or parse_time(meta.get("creationTimestamp"))
        if not node or at is None or not meta.get("name"):
            return None
        return StoredEvidence(
            location=f"configmap/{self.namespace}/{meta['name']}",
            node=str(node),
            captured_at=at,
            alertname=str(annotations.get(ALERTNAME, "")),
            uid=str(meta.get("uid", "")),
        )

    async def _list(self, selector: str) -> list[StoredEvidence]:
        listed = await self._request(
            f"list evidence ConfigMaps in {self.namespace}",
            self._core.list_namespaced_config_map_without_preload_content,
            self.namespace,
            label_selector=selector,
            _headers={"Accept": METADATA_ONLY},
        )
        items = [self._item(obj) for obj in listed.get("items") or []]
        return sorted((i for i in items if i), key=lambda i: (i.captured_at, i.location), reverse=True)

    async def captures(self, node: str) -> list[StoredEvidence]:
        found = await self._list(f"{EVIDENCE_LABEL}=true,{NODE_LABEL}={node_label_value(node)}")
        return [i for i in found if i.node == node]

    async def read(self, item: StoredEvidence) -> bytes:
        name = item.location.rsplit("/", 1)[-1]
        listed = await self._request(
            f"read ConfigMap {self.namespace}/{name}",
            self._core.list_namespaced_config_map_without_preload_content,
            self.namespace,
            field_selector=f"metadata.name={name}",
        )
        for obj in listed.get("items") or []:
            data = obj.get("data") or {}
            if DATA_KEY in data:
                return str(data[DATA_KEY]).encode("utf-8")
        raise EvidenceStoreError(f"ConfigMap {self.namespace}/{name}: gone, or no {DATA_KEY} in it")

    async def prune(self, *, keep: str = "") -> list[StoredEvidence]:
        """Delete what the retention no longer keeps; what it deleted. Failures are logged and
        counted (`prune_errors`), never raised: the capture is stored, the next one tries again."""
        try:
            items = await self._list(f"{EVIDENCE_LABEL}=true,{MANAGED_BY}={self._manager}")
        except EvidenceStoreError as exc:
            self.prune_errors += 1
            logger.warning("evidence retention: %s", exc)
            return []
        gone = []
        for item in expired(items, now=self._clock(), retention=self.retention, keep=keep):
            name = item.location.rsplit("/", 1)[-1]
            body = {"preconditions": {"uid": item.uid}} if item.uid else {}
            try:
                await self._request(
                    f"delete ConfigMap {self.namespace}/{name}",
                    self._core.delete_namespaced_config_map_without_preload_content,
                    name,
                    self.namespace,
                    body=body,
                )
            except EvidenceStoreError as exc:
                if exc.status == 404:
                    continue  # deleted already (a second leader around a fail-over, a human)
                self.prune_errors += 1
                logger.warning("evidence retention: %s", exc)
                continue
            self.deleted += 1
            gone.append(item)
        if gone:
            logger.info(
                "evidence retention: deleted %d capture(s): %s",
                len(gone),
                ", ".join(i.location for i in gone),
            )
        return gone


# -- S3 -------------------------------------------------------------------------------------------


class S3EvidenceStore:
    """EvidenceStore over one S3 bucket: `<prefix>/<node>/<UTC time>-<alertname>.json`, one object per
    capture, never overwritten (the time, to the millisecond, is in the key). boto3 calls run in a
    worker thread (`asyncio.to_thread`); retention is the bucket's lifecycle rules'."""

    def __init__(self, *, bucket: str, prefix: str = "accel-health/evidence", client: Any) -> None:
        if not bucket or "/" in bucket:
            raise ValueError(f"evidence bucket: expected a bucket name, got {bucket!r}")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self._client = client
        """A boto3 S3 client (its botocore retry mode and timeouts apply to every call)."""

    def describe(self) -> str:
        return f"s3://{self.bucket}/{self.prefix + '/' if self.prefix else ''}"

    async def _call(self, what: str, method: Callable[..., Any], **kwargs: Any) -> Any:
        # botocore's errors all derive from BotoCoreError or ClientError; both carry the reason.
        import botocore.exceptions  # noqa: PLC0415  boto3 only in a service that uses S3

        try:
            return await asyncio.to_thread(method, **kwargs)
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as exc:
            raise EvidenceStoreError(f"S3 {what}: {exc}") from exc

    async def put(self, *, node: str, captured_at: float, alertname: str, body: bytes) -> str:
        key = s3_key(self.prefix, node, captured_at, alertname)
        await self._call(
            f"PutObject s3://{self.bucket}/{key}",
            self._client.put_object,
            Bucket=self.bucket,
            Key=key,
            Body=body,
            ContentType="application/json",
            Metadata={
                "node": node_label_value(node),
                "alertname": alertname.encode("ascii", "replace").decode(),
            },
        )
        return f"s3://{self.bucket}/{key}"

    async def captures(self, node: str) -> list[StoredEvidence]:
        prefix = f"{self.prefix + '/' if self.prefix else ''}{node}/"
        items: list[StoredEvidence] = []
        token: str | None = None
        while True:
            extra = {"ContinuationToken": token} if token else {}
            page = await self._call(
                f"ListObjectsV2 s3://{self.bucket}/{prefix}",
                self._client.list_objects_v2,
                Bucket=self.bucket,
                Prefix=prefix,
                **extra,
            )
            for obj in page.get("Contents") or []:
                key = str(obj["Key"])
                name = key[len(prefix) :]
                when = parse_time(_stamp_time(name))
                at = when if when is not None else obj["LastModified"].timestamp()
                alertname = name.split("-", 1)[1].removesuffix(".json") if "-" in name else ""
                items.append(StoredEvidence(f"s3://{self.bucket}/{key}", node, at, alertname))
            if not page.get("IsTruncated"):
                break
            token = page.get("NextContinuationToken")
        return sorted(items, key=lambda i: (i.captured_at, i.location), reverse=True)

    async def read(self, item: StoredEvidence) -> bytes:
        key = item.location.removeprefix(f"s3://{self.bucket}/")
        answer = await self._call(
            f"GetObject {item.location}", self._client.get_object, Bucket=self.bucket, Key=key
        )
        body = answer["Body"]
        try:
            return bytes(await asyncio.to_thread(body.read))
        finally:
            body.close()


def _stamp_time(name: str) -> str:
    """`20251122T200003.120Z-Alert.json` -> `2025-11-22T20:00:03.120Z` (what `parse_time` reads)."""
    head = name.split("-", 1)[0]
    if len(head) < 15:
        return ""
    return f"{head[0:4]}-{head[4:6]}-{head[6:8]}T{head[9:11]}:{head[11:13]}:{head[13:]}"


def s3_client(*, region: str | None, endpoint_url: str | None = None) -> Any:
    """A boto3 S3 client with botocore's `standard` retries and short timeouts (a capture has a
    deadline of seconds)."""
    import boto3  # noqa: PLC0415  boto3 only in a service that uses S3
    import botocore.config  # noqa: PLC0415

    config = botocore.config.Config(
        retries={"mode": "standard", "max_attempts": 3}, connect_timeout=3, read_timeout=10
    )
    return boto3.session.Session().client("s3", region_name=region, endpoint_url=endpoint_url, config=config)
