"""What this service keeps in its own namespace, apart from the nodes: the gates document (the pause
switch and the storm breaker's latch, under 1 KiB, written only when one of them changes), an older
release's whole-state document (read once, moved onto the nodes, deleted), and the durable copy of
each quarantine (one small ConfigMap per quarantined node, labelled so that one LIST reads them all:
a quarantine must outlive the Node object, which a machine replaced under the same name is not)."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping
from typing import Any

from remediator.cluster import BackendUnavailable, StateConflict
from remediator.executors.kubernetes.api import Api, ApiError
from remediator.gates.state import StateError
from remediator.lifecycle.record import PREFIX

logger = logging.getLogger("remediator.kubernetes")

STATE_KEY = "state.json"
"""The data key of the document an older release kept all its gate state in (migrated, then deleted)."""
GATES_KEY = "gates.json"
"""The gates ConfigMap's data key: the pause switch and the storm breaker's latch
(remediator/gates/state.py)."""
QUARANTINE_CONFIGMAP_PREFIX = "accel-health-quarantine-"
"""Name of a node's durable quarantine ConfigMap: this prefix and the node name (a hash when long)."""
QUARANTINE_LABEL = PREFIX + "quarantine"
"""Label (value "true") of the durable quarantine ConfigMaps; the LIST selects on it."""
MANAGED_BY = "app.kubernetes.io/managed-by"
"""Label naming this service (its `manager`) on the ConfigMaps it writes."""
QUARANTINE_KEY = "quarantine.json"
"""The data key holding a durable quarantine document."""
NAME_LIMIT = 253
"""The longest object name (a DNS subdomain)."""


def quarantine_configmap_name(node: str) -> str:
    """`accel-health-quarantine-<node>`; a name too long for an object keeps its start and ends with
    a hash of the whole node name."""
    name = QUARANTINE_CONFIGMAP_PREFIX + node
    if len(name) <= NAME_LIMIT:
        return name
    digest = hashlib.sha256(node.encode()).hexdigest()[:16]
    return f"{name[: NAME_LIMIT - len(digest) - 1].rstrip('-.')}-{digest}"


class ConfigMapStore:
    """The gates document, the older release's state, and the durable quarantine copies."""

    def __init__(self, api: Api) -> None:
        self._api = api
        self._state_version: str | None = None  # resourceVersion of the gates ConfigMap last read

    async def _read_configmap(self, name: str) -> dict[str, Any] | None:
        namespace = self._api.settings.state_namespace
        try:
            obj: dict[str, Any] = await self._api.call(
                f"read ConfigMap {namespace}/{name}",
                self._api.core.read_namespaced_config_map_without_preload_content,
                name,
                namespace,
            )
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise BackendUnavailable(f"Kubernetes API: read ConfigMap {namespace}/{name}: {exc}") from exc
        return obj

    @staticmethod
    def _document(obj: Mapping[str, Any], key: str, where: str) -> dict[str, Any] | None:
        text = (obj.get("data") or {}).get(key)
        if text is None:
            return None
        try:
            document = json.loads(text)
        except ValueError as exc:
            raise StateError(f"ConfigMap {where} key {key} is not JSON: {exc}") from exc
        if not isinstance(document, dict):
            raise StateError(f"ConfigMap {where} key {key} is not a JSON object")
        return document

    async def load_gates(self) -> Mapping[str, Any] | None:
        """The pause switch and breaker latch last saved; None when there are none yet. StateError
        when the ConfigMap holds something that is not a JSON object (the engine then starts paused
        rather than with the gates open), BackendUnavailable when unreachable."""
        name = self._api.settings.gates_configmap
        obj = await self._read_configmap(name)
        self._state_version = None if obj is None else (obj.get("metadata") or {}).get("resourceVersion")
        if obj is None:
            return None
        return self._document(obj, GATES_KEY, f"{self._api.settings.state_namespace}/{name}")

    async def save_gates(self, document: Mapping[str, Any]) -> None:
        """Replace the gates document, with the resourceVersion last read or written as precondition
        (creating the ConfigMap when there was none); StateConflict when another writer changed or
        created it since."""
        name, namespace = self._api.settings.gates_configmap, self._api.settings.state_namespace
        self._api.ensure_leader(f"write ConfigMap {namespace}/{name}")
        body: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {
                "name": name,
                "namespace": namespace,
                "labels": {"app.kubernetes.io/managed-by": self._api.settings.manager},
            },
            "data": {GATES_KEY: json.dumps(document, separators=(",", ":"), sort_keys=True)},
        }
        what = f"write ConfigMap {namespace}/{name}"
        try:
            if self._state_version is None:
                obj = await self._api.call(
                    what, self._api.core.create_namespaced_config_map_without_preload_content, namespace, body
                )
            else:
                body["metadata"]["resourceVersion"] = self._state_version
                obj = await self._api.call(
                    what,
                    self._api.core.replace_namespaced_config_map_without_preload_content,
                    name,
                    namespace,
                    body,
                )
        except ApiError as exc:
            if exc.status in (404, 409):  # changed, created or deleted by another writer
                raise StateConflict(f"{what}: {exc}") from exc
            raise BackendUnavailable(f"Kubernetes API: {what}: {exc}") from exc
        self._state_version = (obj.get("metadata") or {}).get("resourceVersion")

    async def load_legacy_state(self) -> Mapping[str, Any] | None:
        """The gate-state document of an older release, if its ConfigMap is still there (StateError
        when it holds garbage). Read with a LIST narrowed to its name (the quarantine Role's `list`:
        no grant of its own for an object that is read once)."""
        name, namespace = self._api.settings.legacy_configmap, self._api.settings.state_namespace
        try:
            page = await self._api.call(
                f"list ConfigMap {namespace}/{name}",
                self._api.core.list_namespaced_config_map_without_preload_content,
                namespace,
                field_selector=f"metadata.name={name}",
            )
        except ApiError as exc:
            raise BackendUnavailable(f"Kubernetes API: list ConfigMap {namespace}/{name}: {exc}") from exc
        items = page.get("items") or []
        if not items:
            return None
        return self._document(items[0], STATE_KEY, f"{namespace}/{name}") or {}

    async def delete_legacy_state(self) -> None:
        """Delete the older release's ConfigMap (once its content was moved onto the nodes)."""
        name, namespace = self._api.settings.legacy_configmap, self._api.settings.state_namespace
        self._api.ensure_leader(f"delete ConfigMap {namespace}/{name}")
        try:
            await self._api.call(
                f"delete ConfigMap {namespace}/{name}",
                self._api.core.delete_namespaced_config_map_without_preload_content,
                name,
                namespace,
            )
        except ApiError as exc:
            if exc.status != 404:
                raise BackendUnavailable(
                    f"Kubernetes API: delete ConfigMap {namespace}/{name}: {exc}"
                ) from exc

    async def _list_quarantine_objects(self) -> list[dict[str, Any]]:
        namespace = self._api.settings.state_namespace
        try:
            items, _ = await self._api.list_with_version(
                f"list quarantine ConfigMaps in {namespace}",
                self._api.core.list_namespaced_config_map_without_preload_content,
                namespace=namespace,
                label_selector=f"{QUARANTINE_LABEL}=true,{MANAGED_BY}={self._api.settings.manager}",
            )
        except ApiError as exc:
            raise BackendUnavailable(
                f"Kubernetes API: list quarantine ConfigMaps in {namespace}: {exc}"
            ) from exc
        return items

    async def load_quarantines(self) -> Mapping[str, Mapping[str, Any]]:
        """Node name -> document, from one LIST (label selector) of the remediator's namespace; a
        ConfigMap that holds no such document is logged and skipped."""
        out: dict[str, Mapping[str, Any]] = {}
        for obj in await self._list_quarantine_objects():
            name = (obj.get("metadata") or {}).get("name", "")
            try:
                doc = json.loads((obj.get("data") or {}).get(QUARANTINE_KEY) or "")
            except ValueError:
                doc = None
            if not isinstance(doc, dict) or not isinstance(doc.get("node"), str):
                logger.warning(
                    "ConfigMap %s holds no quarantine document (key %s); skipped", name, QUARANTINE_KEY
                )
                continue
            out[doc["node"]] = doc
        return out

    async def save_quarantine(self, node: str, document: Mapping[str, Any]) -> None:
        """Create the node's ConfigMap; one already there (an update: rare, the quarantine's history
        or escalation changed) is deleted, with its uid and resourceVersion as preconditions, and
        created again, so that the Role needs no update or patch of ConfigMaps it cannot name."""
        namespace, name = self._api.settings.state_namespace, quarantine_configmap_name(node)
        what = f"write ConfigMap {namespace}/{name}"
        self._api.ensure_leader(what)
        body = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {
                "name": name,
                "namespace": namespace,
                "labels": {MANAGED_BY: self._api.settings.manager, QUARANTINE_LABEL: "true"},
            },
            "data": {QUARANTINE_KEY: json.dumps(document, separators=(",", ":"), sort_keys=True)},
        }
        create = self._api.core.create_namespaced_config_map_without_preload_content
        try:
            await self._api.call(what, create, namespace, body)
            return
        except ApiError as exc:
            if exc.status != 409:
                raise BackendUnavailable(f"Kubernetes API: {what}: {exc}") from exc
        there = next(
            (o for o in await self._list_quarantine_objects() if o["metadata"]["name"] == name), None
        )
        if there is not None:
            meta = there["metadata"]
            await self._delete_quarantine_object(
                name, preconditions={"uid": meta.get("uid"), "resourceVersion": meta.get("resourceVersion")}
            )
        try:
            await self._api.call(what, create, namespace, body)
        except ApiError as exc:  # 409: another writer between the delete and the create
            raise BackendUnavailable(f"Kubernetes API: {what}: {exc}") from exc

    async def delete_quarantine(self, node: str) -> None:
        """Delete the node's ConfigMap (none there: nothing to do)."""
        await self._delete_quarantine_object(quarantine_configmap_name(node))

    async def _delete_quarantine_object(
        self, name: str, *, preconditions: Mapping[str, Any] | None = None
    ) -> None:
        namespace = self._api.settings.state_namespace
        what = f"delete ConfigMap {namespace}/{name}"
        self._api.ensure_leader(what)
        body = {"preconditions": dict(preconditions)} if preconditions else None
        try:
            await self._api.call(
                what,
                self._api.core.delete_namespaced_config_map_without_preload_content,
                name,
                namespace,
                body=body,
            )
        except ApiError as exc:
            if exc.status != 404:
                raise BackendUnavailable(f"Kubernetes API: {what}: {exc}") from exc
