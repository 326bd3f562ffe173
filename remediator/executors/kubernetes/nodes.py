"""The Node objects: the watch-backed node cache, and every write this service makes on a node, each a
conditional patch (the resourceVersion as precondition; a 409 reads the node again and decides again)
that carries the node's record (remediator/lifecycle/record.py) in the same request.

Ownership is recorded in node annotations (`accel-health.io/…`) and every write names this service as
its field manager: un-cordon requires both the annotation and the API server's own record
(metadata.managedFields) that this service still manages spec.unschedulable, so a human's uncordon +
re-cordon is never undone; un-taint undoes only the taints the annotation lists, by value. Conditions
go to the status subresource as strategic merge patches (merged by type: the kubelet's own are
untouched).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

from remediator.cluster import (
    BackendUnavailable,
    Node,
    NodeCondition,
    NodeListener,
    ObjectFormatError,
    Returned,
    Taint,
    node_from_object,
)
from remediator.executors.kubernetes.api import (
    MERGE_PATCH,
    STRATEGIC_MERGE_PATCH,
    Api,
    ApiError,
    refused_or_unavailable,
)
from remediator.executors.watchcache import WatchCache
from remediator.lifecycle.record import (
    CORDONED_AT,
    CORDONED_BY,
    RETURN_FORGETS,
    TAINTS_ADDED,
    RecordChange,
    owned_taints,
    rfc3339,
    taint_id,
)

logger = logging.getLogger("remediator.kubernetes")

NODE_STATUS_UNREAD = ("images", "volumesInUse", "volumesAttached", "daemonEndpoints", "config")
"""Parts of a node's status the remediator never reads. `images` alone is tens of KB on a GPU node
with many images: kept for 2,000 nodes it would be most of the service's memory."""


def annotations_of(obj: Mapping[str, Any]) -> dict[str, str]:
    return dict((obj.get("metadata") or {}).get("annotations") or {})


def record_annotation(record: RecordChange | None, obj: Mapping[str, Any]) -> dict[str, str | None]:
    """The annotation entry that applies `record` to the node as read ({} for none)."""
    return {} if record is None else record.annotation(annotations_of(obj))


def _kept(stored: Mapping[str, str], wanted: Mapping[str, str], record: RecordChange | None) -> bool:
    """Did a write keep these annotations and this record change?"""
    if any(stored.get(k) != v for k, v in wanted.items()):
        return False
    return record is None or not record.annotation(stored)


def _taint_json(taint: Taint) -> dict[str, str]:
    out = {"key": taint.key, "effect": taint.effect}
    if taint.value:
        out["value"] = taint.value
    return out


def trim_node(obj: dict[str, Any]) -> dict[str, Any]:
    """A node as the cache keeps it: without the status the remediator never reads, and with
    managedFields cut down to who manages `spec.unschedulable` (what `manages_unschedulable` reads)."""
    status = obj.get("status")
    meta = obj.get("metadata")
    if not isinstance(status, dict) or not isinstance(meta, dict):
        return obj
    out = dict(obj)
    out["status"] = {k: v for k, v in status.items() if k not in NODE_STATUS_UNREAD}
    entries = meta.get("managedFields")
    if isinstance(entries, list):
        kept: list[dict[str, Any]] = []
        for entry in entries:
            if not isinstance(entry, dict):
                continue
            fields_v1 = entry.get("fieldsV1")
            spec = (fields_v1.get("f:spec") or {}) if isinstance(fields_v1, dict) else {}
            fields: dict[str, Any] = {"f:spec": {"f:unschedulable": {}}} if "f:unschedulable" in spec else {}
            kept.append({"manager": entry.get("manager"), "fieldsV1": fields})
        out["metadata"] = {**meta, "managedFields": kept}
    return out


def manages_unschedulable(obj: Mapping[str, Any], manager: str) -> bool:
    """Does `manager` still own spec.unschedulable, per the API server's managedFields? (True when the
    server records no managedFields at all: then only the annotation can tell.)"""
    entries = (obj.get("metadata") or {}).get("managedFields")
    if not entries:
        return True
    for entry in entries:
        if entry.get("manager") != manager:
            continue
        spec = (entry.get("fieldsV1") or {}).get("f:spec") or {}
        if "f:unschedulable" in spec:
            return True
    return False


def uid_of(obj: Mapping[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("uid", ""))


class NodeStore:
    """Reads nodes from the watch cache, and writes them: cordon, taints, conditions, annotations,
    labels, the return to the pool, the startup taint."""

    def __init__(self, api: Api) -> None:
        self._api = api
        self.cache = WatchCache(
            what="nodes",
            list_all=self.list_with_version,
            watch=api.core.list_node_without_preload_content,
            trim=trim_node,
            watch_seconds=api.settings.watch_seconds,
        )
        """The watch-backed node cache; reads come from it once it synced."""

    async def list_with_version(self) -> tuple[list[dict[str, Any]], str]:
        """Every node and the list's resourceVersion (where the node watch starts)."""
        try:
            return await self._api.list_with_version(
                "list nodes", self._api.core.list_node_without_preload_content
            )
        except ApiError as exc:
            raise BackendUnavailable(f"Kubernetes API: list nodes: {exc}") from exc

    async def read_object(self, name: str) -> dict[str, Any] | None:
        """The node as the API server has it now (a GET: read-modify-write starts here)."""
        try:
            obj: dict[str, Any] = await self._api.call(
                f"read node {name}", self._api.core.read_node_without_preload_content, name
            )
        except ApiError as exc:
            if exc.status == 404:
                self.cache.forget(name)
                return None
            raise BackendUnavailable(f"Kubernetes API: read node {name}: {exc}") from exc
        self.cache.observe(obj)
        return obj

    async def cached_object(self, name: str) -> dict[str, Any] | None:
        """The node as the watch last saw it (the API when the cache is not synced yet)."""
        if self.cache.synced:
            return self.cache.get(name)
        return await self.read_object(name)

    async def patch(
        self, name: str, body: Mapping[str, Any], *, status: bool = False, ctype: str = MERGE_PATCH
    ) -> dict[str, Any]:
        method = (
            self._api.core.patch_node_status_without_preload_content
            if status
            else self._api.core.patch_node_without_preload_content
        )
        obj: dict[str, Any] = await self._api.call(
            f"patch node {name}{'/status' if status else ''}",
            method,
            name,
            dict(body),
            _content_type=ctype,
            field_manager=self._api.settings.manager,
        )
        self.cache.observe(obj)  # our own write, seen at once
        return obj

    async def modify(
        self,
        name: str,
        what: str,
        change: Callable[[dict[str, Any]], dict[str, Any] | None],
        *,
        current: dict[str, Any] | None = None,
        status: bool = False,
        ctype: str = MERGE_PATCH,
    ) -> dict[str, Any] | None:
        """Read-modify-write with the resourceVersion as precondition; retried on 409 Conflict.

        `change` gets the node and returns a patch (without resourceVersion), or None when nothing
        needs to change. The first attempt starts from `current` or, when not given, from the node
        as the watch last saw it (no GET: a write costs one request); a conflict (the cache was
        behind, or another writer was there) reads the node from the API and decides again.
        `status` writes to the status subresource (conditions). Returns the node as written, or None
        when nothing was written.
        """
        if current is None and self.cache.synced:
            current = self.cache.get(name)
        for attempt in range(1, self._api.settings.conflict_attempts + 1):
            self._api.ensure_leader(what)  # also before a retry: a conflict may mean another leader wrote
            if attempt > 1 or current is None:
                current = await self.read_object(name)
            if current is None:
                logger.warning("%s: node %s not found; nothing to do", what, name)
                return None
            patch = change(current)
            if patch is None:
                return None
            rv = current.get("metadata", {}).get("resourceVersion")
            patch.setdefault("metadata", {})["resourceVersion"] = rv
            try:
                written = await self.patch(name, patch, status=status, ctype=ctype)
            except ApiError as exc:
                if exc.status == 409 and attempt < self._api.settings.conflict_attempts:
                    logger.info("%s on %s: conflict (attempt %d), re-reading", what, name, attempt)
                    await asyncio.sleep(0.01 * attempt * random.random())  # noqa: S311  jitter, not crypto
                    continue
                if exc.status == 404:
                    return None
                raise refused_or_unavailable(f"{what} {name}", exc) from exc
            return written
        raise BackendUnavailable(f"Kubernetes API: {what} {name}: still conflicting")  # pragma: no cover

    async def annotate(
        self,
        name: str,
        what: str,
        annotations: Mapping[str, str | None],
        *,
        record: RecordChange | None = None,
    ) -> None:
        """Merge-patch this service's own annotations, and apply `record` to the node's record in the
        same write (with the resourceVersion as precondition: the record is computed from the node)."""
        if record is None:
            self._api.ensure_leader(what)
            try:
                await self.patch(name, {"metadata": {"annotations": dict(annotations)}})
            except ApiError as exc:
                if exc.status != 404:
                    raise refused_or_unavailable(f"{what} {name}", exc) from exc
            return

        def change(obj: dict[str, Any]) -> dict[str, Any] | None:
            merged = {**dict(annotations), **record.annotation(annotations_of(obj))}
            return {"metadata": {"annotations": merged}} if merged else None

        await self.modify(name, what, change)

    async def get_node(self, name: str) -> Node | None:
        obj = await self.cached_object(name)
        if obj is None:
            return None
        try:
            return node_from_object(obj)
        except ObjectFormatError as exc:
            raise BackendUnavailable(f"node {name} has an unexpected shape: {exc}") from exc

    async def list_nodes(self) -> list[Node]:
        try:
            if self.cache.synced:
                return self.cache.converted(node_from_object)
            objs, _ = await self.list_with_version()
            return [node_from_object(o) for o in objs]
        except ObjectFormatError as exc:
            raise BackendUnavailable(f"a node has an unexpected shape: {exc}") from exc

    def observed_nodes(self) -> list[Node] | None:
        """The nodes as the watch cache has them (no request); None until it synced."""
        if not self.cache.synced:
            return None
        try:
            return self.cache.converted(node_from_object)
        except ObjectFormatError:
            return None

    def watch_nodes(self, listener: NodeListener) -> None:
        """Call `listener(name, annotations)` at every change the node watch delivers (annotations
        None: the node was deleted)."""

        def tell(key: Hashable, obj: dict[str, Any] | None) -> None:
            if obj is None:
                listener(str(key), None)
            else:
                listener(str(key), annotations_of(obj))

        self.cache.listeners.append(tell)

    async def node_annotations(self, name: str) -> dict[str, str]:
        """The node's annotations ({} when it does not exist)."""
        obj = await self.read_object(name)
        return dict((obj or {}).get("metadata", {}).get("annotations") or {})

    async def annotate_node(
        self, node: str, annotations: Mapping[str, str | None], *, record: RecordChange | None = None
    ) -> None:
        """Set (or, with None, remove) annotations of this service on the node; `record` is applied
        to the node's record in the same write."""
        await self.annotate(node, "annotate", annotations, record=record)

    async def label_node(self, node: str, labels: Mapping[str, str | None]) -> None:
        """Set (or, with None, remove) labels on the node (a merge patch: other labels are kept)."""
        self._api.ensure_leader("label")
        try:
            await self.patch(node, {"metadata": {"labels": dict(labels)}})
        except ApiError as exc:
            if exc.status != 404:
                raise BackendUnavailable(f"Kubernetes API: label {node}: {exc}") from exc

    async def cordon(self, node: str, *, record: RecordChange | None = None) -> bool:
        """Cordon and record ownership (and `record`) in one write; True when this call cordoned it.
        A node someone else cordoned (before the read, or between the read and the write: the
        resourceVersion precondition makes that a conflict, and the re-read sees the cordon) is left
        as it is and not claimed."""

        def change(obj: dict[str, Any]) -> dict[str, Any] | None:
            if obj.get("spec", {}).get("unschedulable"):
                return None
            annotations: dict[str, str | None] = {
                CORDONED_BY: self._api.settings.manager,
                CORDONED_AT: rfc3339(self._api.clock()),
                **record_annotation(record, obj),
            }
            return {"metadata": {"annotations": annotations}, "spec": {"unschedulable": True}}

        done = await self.modify(node, "cordon", change) is not None
        if done:
            logger.info("cordoned %s", node)
        return done

    async def uncordon(self, node: str, *, record: RecordChange | None = None) -> bool:
        """Un-cordon only a node this service cordoned and whose cordon nobody changed since (the
        annotation, and managedFields showing this service still manages spec.unschedulable); True
        when this call uncordoned it. Otherwise only the ownership annotation is forgotten. `record`
        is applied to the node's record in the same write."""
        flipped = False

        def change(obj: dict[str, Any]) -> dict[str, Any] | None:
            nonlocal flipped
            flipped = False
            annotations = annotations_of(obj)
            if annotations.get(CORDONED_BY) != self._api.settings.manager:
                logger.info(
                    "uncordon %s: not cordoned by %s; left as it is", node, self._api.settings.manager
                )
                return None
            drop: dict[str, str | None] = {CORDONED_BY: None, CORDONED_AT: None}
            forget: dict[str, Any] = {"metadata": {"annotations": {**drop, **record_annotation(record, obj)}}}
            if not obj.get("spec", {}).get("unschedulable"):
                return forget  # a human un-cordoned it already
            if not manages_unschedulable(obj, self._api.settings.manager):
                logger.info("uncordon %s: the cordon was changed by someone else since; left", node)
                return forget
            flipped = True
            return {**forget, "spec": {"unschedulable": False}}

        written = await self.modify(node, "uncordon", change) is not None
        if written and flipped:
            logger.info("uncordoned %s", node)
        return written and flipped

    async def add_taint(self, node: str, taint: Taint, *, record: RecordChange | None = None) -> None:
        """Add (or replace by key and effect) one taint; other taints are kept as they are. `record`
        is applied to the node's record in the same write."""

        def change(obj: dict[str, Any]) -> dict[str, Any] | None:
            taints = list(obj.get("spec", {}).get("taints") or [])
            want = _taint_json(taint)
            same = [t for t in taints if (t.get("key"), t.get("effect")) == (taint.key, taint.effect)]
            if same and all(t.get("value", "") == taint.value for t in same):
                return None
            kept = [t for t in taints if (t.get("key"), t.get("effect")) != (taint.key, taint.effect)]
            owned = owned_taints(annotations_of(obj))
            tid = taint_id(taint.key, taint.effect)
            patch: dict[str, Any] = {
                "spec": {"taints": [*kept, {**want, "timeAdded": rfc3339(self._api.clock())}]}
            }
            annotations = record_annotation(record, obj)
            if not same and tid not in owned:  # only a taint we created is ours to remove later
                annotations[TAINTS_ADDED] = json.dumps(sorted([*owned, tid]))
            if annotations:
                patch["metadata"] = {"annotations": annotations}
            return patch

        if await self.modify(node, "taint", change):
            logger.info("tainted %s with %s=%s:%s", node, taint.key, taint.value, taint.effect)

    async def remove_taint(self, node: str, taint: Taint, *, record: RecordChange | None = None) -> None:
        """Remove a taint, but only one this service added (per the taints-added annotation) and only
        with the value it set: a taint someone changed since is left where it is and is no longer
        counted as this service's. `record` is applied to the node's record in the same write."""

        def change(obj: dict[str, Any]) -> dict[str, Any] | None:
            owned = owned_taints(annotations_of(obj))
            tid = taint_id(taint.key, taint.effect)
            if tid not in owned:
                return None
            left = sorted(t for t in owned if t != tid)
            taints = list(obj.get("spec", {}).get("taints") or [])
            kept = [
                t
                for t in taints
                if (t.get("key"), t.get("effect"), t.get("value", ""))
                != (taint.key, taint.effect, taint.value)
            ]
            annotations = {TAINTS_ADDED: json.dumps(left) if left else None}
            annotations |= record_annotation(record, obj)
            return {"metadata": {"annotations": annotations}, "spec": {"taints": kept}}

        if await self.modify(node, "untaint", change):
            logger.info("removed taint %s:%s from %s", taint.key, taint.effect, node)

    async def return_node(
        self,
        node: str,
        *,
        uid: str,
        taints: Sequence[Taint],
        annotations: Mapping[str, str | None],
        record: RecordChange | None = None,
    ) -> Returned | None:
        """Give the node with this `uid` back to the pool in one write: uncordon it if this service
        cordoned it and nobody changed the cordon since (annotation and managedFields), remove exactly
        these taints (key, effect and value) where this service added them, forget the ownership and
        drain annotations, set (None: remove) `annotations` and apply `record`. None when no node
        with that uid exists (gone, or replaced again)."""
        done = Returned()

        def change(obj: dict[str, Any]) -> dict[str, Any] | None:
            nonlocal done
            if uid_of(obj) != uid:
                return None
            current = annotations_of(obj)
            owned = owned_taints(current)
            spec_taints = list(obj.get("spec", {}).get("taints") or [])
            gone = {(t.key, t.effect, t.value) for t in taints if taint_id(t.key, t.effect) in owned}
            kept = [t for t in spec_taints if (t.get("key"), t.get("effect"), t.get("value", "")) not in gone]
            removed = tuple(sorted(taint_id(k, e) for k, e, _ in gone))
            meta: dict[str, str | None] = {k: None for k in (*RETURN_FORGETS, TAINTS_ADDED) if k in current}
            meta.update(annotations)
            meta |= record_annotation(record, obj)
            patch: dict[str, Any] = {"metadata": {"annotations": meta}}
            if len(kept) != len(spec_taints):
                patch["spec"] = {"taints": kept}
            ours = current.get(CORDONED_BY) == self._api.settings.manager
            cordoned = bool(obj.get("spec", {}).get("unschedulable"))
            flip = ours and cordoned and manages_unschedulable(obj, self._api.settings.manager)
            if flip:
                patch.setdefault("spec", {})["unschedulable"] = False
            done = Returned(
                found=True,
                uncordoned=flip,
                cordon_kept=cordoned and not flip,
                taints_removed=removed,
            )
            return patch

        written = await self.modify(node, "return to the pool", change)
        if written is None and not done.found:
            return None
        logger.info("%s returned to the pool: %s", node, done)
        return done

    async def set_condition(
        self,
        node: str,
        condition: NodeCondition,
        *,
        record: RecordChange | None = None,
        annotations: Mapping[str, str | None] | None = None,
    ) -> None:
        """Upsert by type on the status subresource (a strategic merge patch: the kubelet's own
        conditions are untouched); lastTransitionTime moves only when status does. `record` and
        `annotations` go into the same write (the API server keeps metadata written through a node's
        status subresource), with the resourceVersion as precondition."""

        def change(obj: dict[str, Any]) -> dict[str, Any] | None:
            now = rfc3339(self._api.clock())
            previous = next(
                (c for c in obj.get("status", {}).get("conditions") or [] if c.get("type") == condition.type),
                None,
            )
            transition = now
            if previous is not None and previous.get("status") == condition.status:
                transition = str(previous.get("lastTransitionTime") or now)
            entry = {
                "type": condition.type,
                "status": condition.status,
                "reason": condition.reason,
                "message": condition.message,
                "lastHeartbeatTime": now,
                "lastTransitionTime": transition,
            }
            patch: dict[str, Any] = {"status": {"conditions": [entry]}}
            meta = {**dict(annotations or {}), **record_annotation(record, obj)}
            if meta:
                patch["metadata"] = {"annotations": meta}
            return patch

        written = await self.modify(
            node, "set a node condition", change, status=True, ctype=STRATEGIC_MERGE_PATCH
        )
        wanted = {k: v for k, v in (annotations or {}).items() if v is not None}
        if (
            written is not None
            and (record is not None or wanted)
            and not _kept(annotations_of(written), wanted, record)
        ):
            # An API server that drops metadata written through the status subresource (the 1.20
            # one keeps it): the record and annotations follow in a write of their own.
            logger.info("%s: metadata not kept by the status subresource; writing it apart", node)
            await self.annotate(node, "record the condition", dict(annotations or {}), record=record)

    async def set_startup_taint(
        self,
        node: str,
        *,
        uid: str,
        taint: Taint,
        present: bool,
        annotations: Mapping[str, str | None],
        labels: Mapping[str, str | None],
    ) -> bool:
        """One merge patch with the resourceVersion as precondition, on the node object with `uid`
        only: add (`present`) or remove the taints with `taint.key` (whoever added them: the taint is
        this service's to lift), with annotation and label changes. False when no such node exists."""
        found = False

        def change(obj: dict[str, Any]) -> dict[str, Any] | None:
            nonlocal found
            found = uid_of(obj) == uid
            if not found:
                return None
            meta = obj.get("metadata") or {}
            taints = list((obj.get("spec") or {}).get("taints") or [])
            kept = [t for t in taints if t.get("key") != taint.key]
            patch: dict[str, Any] = {}
            if present and len(kept) == len(taints):
                added = _taint_json(taint)
                if taint.effect == "NoExecute":
                    added["timeAdded"] = rfc3339(self._api.clock())
                patch["spec"] = {"taints": [*taints, added]}
            elif not present and len(kept) != len(taints):
                patch["spec"] = {"taints": kept}
            have = meta.get("annotations") or {}
            changed: dict[str, str | None] = {k: v for k, v in annotations.items() if have.get(k) != v}
            owned = owned_taints(have)
            left = [t for t in owned if not t.startswith(taint.key + ":")]
            if not present and left != owned:
                changed[TAINTS_ADDED] = json.dumps(left) if left else None
            have_labels = meta.get("labels") or {}
            relabel = {k: v for k, v in labels.items() if have_labels.get(k) != v}
            if changed or relabel:
                patch["metadata"] = {
                    **({"annotations": changed} if changed else {}),
                    **({"labels": relabel} if relabel else {}),
                }
            return patch or None

        what = "add the startup taint" if present else "remove the startup taint"
        if await self.modify(node, what, change):
            logger.info("%s: %s %s", node, what, taint.key)
        return found
