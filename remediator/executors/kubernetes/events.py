"""Node Events: core/v1 Events with involvedObject kind Node, the way the kubelet writes them, so
`kubectl describe node` lists them; a repeat within ten minutes bumps the count (client-go's series)."""

from __future__ import annotations

import logging
import time

from remediator.cluster import BackendUnavailable
from remediator.executors.kubernetes.api import MERGE_PATCH, Api, ApiError
from remediator.lifecycle.record import rfc3339

logger = logging.getLogger("remediator.kubernetes")

EVENT_MESSAGE_LIMIT = 1024
EVENT_SERIES_SECONDS = 600.0
"""A repeat within this long bumps an Event's count (client-go's window); older series are forgotten."""


class EventWriter:
    """Writes node Events, remembering each series of the last ten minutes to count repeats."""

    def __init__(self, api: Api) -> None:
        self._api = api
        self._events: dict[tuple[str, str, str, str], tuple[str, int, float]] = {}

    async def record_event(self, *, node: str, reason: str, message: str, type_: str) -> None:
        """A core/v1 Event about the node; a repeat within 10 minutes bumps the count, like client-go."""
        self._api.ensure_leader("record an event")
        now = self._api.clock()
        stamp = rfc3339(now)
        ns = self._api.settings.event_namespace
        if len(message) > EVENT_MESSAGE_LIMIT:
            message = message[: EVENT_MESSAGE_LIMIT - 3] + "..."
        key = (node, reason, message, type_)
        seen = self._events.get(key)
        if seen is not None and now - seen[2] < EVENT_SERIES_SECONDS:
            name, count, _ = seen
            try:
                await self._api.call(
                    f"update event {name}",
                    self._api.core.patch_namespaced_event_without_preload_content,
                    name,
                    ns,
                    {"count": count + 1, "lastTimestamp": stamp},
                    _content_type=MERGE_PATCH,
                )
            except ApiError as exc:
                if exc.status != 404:
                    raise BackendUnavailable(f"Kubernetes API: update event {name}: {exc}") from exc
            else:
                self._remember_event(key, (name, count + 1, now))
                return
        name = f"{node}.{time.time_ns():x}"
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": name, "namespace": ns},
            # The kubelet's convention for nodes (uid = node name) is what `kubectl describe node` queries.
            "involvedObject": {"apiVersion": "v1", "kind": "Node", "name": node, "uid": node},
            "reason": reason,
            "message": message,
            "type": type_,
            "count": 1,
            "firstTimestamp": stamp,
            "lastTimestamp": stamp,
            "source": {"component": self._api.settings.manager},
            "reportingComponent": self._api.settings.manager,
            "reportingInstance": self._api.settings.instance,
        }
        try:
            await self._api.call(
                f"create event on {node}",
                self._api.core.create_namespaced_event_without_preload_content,
                ns,
                body,
            )
        except ApiError as exc:
            raise BackendUnavailable(f"Kubernetes API: create event on {node}: {exc}") from exc
        self._remember_event(key, (name, 1, now))

    def _remember_event(self, key: tuple[str, str, str, str], series: tuple[str, int, float]) -> None:
        """Keep the series last written (kept in order of last write) and forget those older than
        the window: a storm's Events on thousands of nodes are not remembered forever."""
        self._events.pop(key, None)
        self._events[key] = series
        horizon = series[2] - EVENT_SERIES_SECONDS
        while True:  # ends at the latest: the one just written is within the window
            oldest = next(iter(self._events))
            if self._events[oldest][2] >= horizon:
                return
            del self._events[oldest]

    @property
    def event_series(self) -> int:
        """Event series remembered to count repeats (those written in the last 10 minutes)."""
        return len(self._events)
