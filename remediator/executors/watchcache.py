"""Watch-backed caches of cluster objects: observed state without a LIST per read.

As client-go's reflectors: one LIST (paginated) gives the objects and a resourceVersion, then a WATCH
from that version keeps the copy current (ADDED, MODIFIED, DELETED; BOOKMARKs move the version on).
A watch that ends is started again from the last version; `410 Gone` (the version was compacted
away) means LIST again, as does any other error answer of the API (after a pause that doubles while
the failures go on); a connection that breaks is watched again from the same version.

Three caches use this: every node (for as long as the service runs), the pods of one node (while a
drain of that node runs) and every PodDisruptionBudget (while any drain runs). `SharedWatch` is the
second and third kind's life cycle: the first user starts it, from a LIST of its own or from one
just made for another reason, and the last user to leave stops it.

A watch is the client's list method (`*_without_preload_content`) with `watch=True`, its answer read
one JSON event per line. Writes made by this service are put into the cache at once from the API's
answer (`observe`), so a decision right after a write never sees the object as it was before it.
`next_change` and `wait_change` let a loop sleep until the watch delivers something instead of
asking the API again.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Hashable, Mapping
from typing import Any, TypeVar

logger = logging.getLogger("remediator.watchcache")
T = TypeVar("T")

ListAll = Callable[[], Awaitable[tuple[list[dict[str, Any]], str]]]
"""Every object (all pages) and the list's resourceVersion; raises when the API cannot answer."""
KeyOf = Callable[[Mapping[str, Any]], Hashable | None]

BROKEN_AFTER = 2
"""Failures in a row (a watch, then the LIST or watch after it) after which the cache counts as
broken: its contents may be stale for longer than a blip, and a drain reading it stops."""
SHORT_WATCH_SECONDS = 1.0
"""A watch that ends this soon without delivering anything counts as a failure (client-go's rule),
so a server or proxy that closes watches at once is not asked again in a tight loop."""


def name_key(obj: Mapping[str, Any]) -> Hashable | None:
    """The key of a cluster-scoped object: its name."""
    name = (obj.get("metadata") or {}).get("name")
    return name if isinstance(name, str) else None


def namespaced_key(obj: Mapping[str, Any]) -> Hashable | None:
    """The key of a namespaced object: (namespace, name)."""
    meta = obj.get("metadata") or {}
    name = meta.get("name")
    return (str(meta.get("namespace") or "default"), name) if isinstance(name, str) else None


def _newer(a: Mapping[str, Any], b: Mapping[str, Any] | None) -> bool:
    """Whether object `a` is at least as new as `b` (resourceVersions compared as numbers when both
    are, as etcd's are; otherwise `a` wins)."""
    if b is None:
        return True
    ra = str((a.get("metadata") or {}).get("resourceVersion", ""))
    rb = str((b.get("metadata") or {}).get("resourceVersion", ""))
    if ra.isdigit() and rb.isdigit():
        return int(ra) >= int(rb)
    return True


class WatchRefused(Exception):
    """The API server answered a watch with an error: an HTTP status, or an ERROR event (410 Gone)."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(f"{status} {reason}")
        self.status = status
        self.reason = reason

    @classmethod
    def from_status(cls, code: int, status: Any, default: str) -> WatchRefused:
        """From a Status object (its reason and message), or `default` when it is none."""
        if not isinstance(status, dict):
            return cls(code, default)
        return cls(code, f"{status.get('reason') or default}: {status.get('message', '')}")


def _event(line: bytes, what: str) -> Mapping[str, Any]:
    """One line of a watch: {type, object}; raises WatchRefused for an ERROR event (or a bare Status)."""
    try:
        event = json.loads(line)
    except ValueError as exc:
        raise ValueError(f"a line of the {what} watch is no JSON: {line[:200]!r}") from exc
    if not isinstance(event, dict):
        raise ValueError(f"a line of the {what} watch is no event: {line[:200]!r}")
    if str(event.get("type", "")).upper() == "ERROR" or "type" not in event:
        status = event.get("object") if "type" in event else event
        if isinstance(status, dict) and "code" in status:
            raise WatchRefused.from_status(int(status["code"]), status, "Error")
        raise ValueError(f"a line of the {what} watch is no event: {line[:200]!r}")
    return event


def _version(obj: Mapping[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("resourceVersion", ""))


def _keep(obj: dict[str, Any]) -> dict[str, Any]:
    return obj


class WatchCache:
    """Objects of one kind (optionally narrowed by a field selector), kept current by a watch.

    Start `run()` as a task; cancel it to stop.
    """

    def __init__(
        self,
        *,
        what: str,
        list_all: ListAll,
        watch: Callable[..., Awaitable[Any]],
        watch_args: Mapping[str, Any] | None = None,
        key: KeyOf = name_key,
        trim: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
        watch_seconds: int = 300,
        retry_seconds: float = 1.0,
        max_retry_seconds: float = 30.0,
    ) -> None:
        self.what = what
        """What is cached, in words (for logs): `nodes`, `pods on gpu-1`."""
        # `watch` is the client's list method `*_without_preload_content` (it answers the raw HTTP
        # response, read here line by line); `watch_args` narrow it (a field selector).
        self._list_all = list_all
        self._watch_method = watch
        self._watch_args = dict(watch_args or {})
        self._key = key
        self._trim = trim if trim is not None else _keep
        """What is kept of each object (the node cache drops what the remediator never reads)."""
        self._watch_seconds = watch_seconds
        self._retry_seconds = retry_seconds
        self._max_retry_seconds = max_retry_seconds
        self._objects: dict[Hashable, dict[str, Any]] = {}
        self._converted: dict[Hashable, tuple[dict[str, Any], Any]] = {}  # key -> (object, converted)
        self._convert: Callable[[dict[str, Any]], Any] | None = None
        self._version = ""
        self._synced = asyncio.Event()
        self._changed = asyncio.Event()
        self.lists = 0
        """LISTs made (one at start unless seeded, one per 410 Gone or error answer)."""
        self.watches = 0
        """WATCH requests made."""
        self.expired = 0
        """Watches answered 410 Gone (their resourceVersion was compacted away)."""
        self.listeners: list[Callable[[Hashable, dict[str, Any] | None], None]] = []
        """Told of every object the watch (or a LIST replacing the contents) changed: (key, the
        object now, None when it is gone). Not told of this service's own writes (`observe`): the
        watch event that follows them tells."""
        self.failures = 0
        """Failed LISTs and watches in a row (0 again after a LIST or an event)."""
        self.last_error = ""
        """The last failure, in words."""

    @property
    def synced(self) -> bool:
        """The first LIST completed (or the cache was seeded): the cache answers reads."""
        return self._synced.is_set()

    @property
    def broken(self) -> bool:
        """The watch failed, and so did the attempt after it: what the cache holds may be stale."""
        return self.failures >= BROKEN_AFTER

    @property
    def version(self) -> str:
        """The resourceVersion the next watch starts from."""
        return self._version

    async def wait_synced(self, seconds: float) -> bool:
        """Wait up to `seconds` for the first LIST; whether it completed."""
        try:
            async with asyncio.timeout(seconds):
                await self._synced.wait()
        except TimeoutError:
            return False
        return True

    def next_change(self) -> asyncio.Event:
        """The event set at the cache's next change (an event, a relist, a failure). Take it before
        looking at the cache and wait on it after, so that no change in between is missed."""
        return self._changed

    async def wait_change(self, seconds: float) -> bool:
        """Wait up to `seconds` for the cache to change (an event, a relist, a failure); whether it did."""
        changed = self._changed
        try:
            async with asyncio.timeout(max(0.0, seconds)):
                await changed.wait()
        except TimeoutError:
            return False
        return True

    def get(self, key: Hashable) -> dict[str, Any] | None:
        return self._objects.get(key)

    def objects(self) -> list[dict[str, Any]]:
        return list(self._objects.values())

    def converted(self, convert: Callable[[dict[str, Any]], T]) -> list[T]:
        """Every object through `convert`, called once per version of each object (a cached object
        is replaced, never changed in place, when it changes): every delivery reads every node, and
        converting 2,000 of them each time costs about 50 ms. Conversions of objects gone or
        changed since are dropped."""
        if convert is not self._convert:
            self._converted, self._convert = {}, convert
        kept: dict[Hashable, tuple[dict[str, Any], Any]] = {}
        out: list[T] = []
        for key, obj in self._objects.items():
            hit = self._converted.get(key)
            value = hit[1] if hit is not None and hit[0] is obj else convert(obj)
            kept[key] = (obj, value)
            out.append(value)
        self._converted = kept
        return out

    def observe(self, obj: Mapping[str, Any]) -> None:
        """An object as the API just answered a write or a read: newer than what is cached, or ignored."""
        key = self._key(obj)
        if key is not None and self.synced and _newer(obj, self._objects.get(key)):
            self._objects[key] = self._trim(dict(obj))
            self._touch()

    def forget(self, key: Hashable) -> None:
        """The API said the object does not exist."""
        if self._objects.pop(key, None) is not None:
            self._touch()

    def seed(self, items: list[dict[str, Any]], version: str) -> None:
        """Fill the cache from a LIST made elsewhere; the watch starts from its resourceVersion, so
        whatever changed since that LIST arrives as events."""
        self._replace(items, version)

    async def relist(self) -> None:
        """LIST now and replace the cache's contents; raises what the list function raises."""
        items, version = await self._list_all()
        self.lists += 1
        self._replace(items, version)

    def _replace(self, items: list[dict[str, Any]], version: str) -> None:
        objects: dict[Hashable, dict[str, Any]] = {}
        for obj in items:
            key = self._key(obj)
            if key is not None:
                objects[key] = self._trim(obj)
        before, self._objects = self._objects, objects
        if self.listeners and before:
            for key in before.keys() - objects.keys():
                self._tell(key, None)
            for key, obj in objects.items():
                old = before.get(key)
                if old is None or _version(old) != _version(obj):
                    self._tell(key, obj)
        self._version = version
        self.failures = 0
        if not self._synced.is_set():
            logger.info(
                "%s cache synced: %d object(s) at resourceVersion %s", self.what, len(objects), version
            )
        self._synced.set()
        self._touch()

    def _failed(self, why: str) -> None:
        self.failures += 1
        self.last_error = why
        self._touch()  # who waits for a change looks again, and sees `broken`

    def _touch(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _apply(self, event: Mapping[str, Any]) -> None:
        kind = str(event.get("type", "")).upper()
        obj = event.get("object")
        if not isinstance(obj, dict):
            return
        meta = obj.get("metadata") or {}
        self._version = str(meta.get("resourceVersion") or self._version)
        self.failures = 0
        if kind == "BOOKMARK":
            return
        key = self._key(obj)
        if key is None:
            return
        if kind == "DELETED":
            if self._objects.pop(key, None) is not None:
                self._tell(key, None)
        elif _newer(obj, self._objects.get(key)):
            self._objects[key] = kept = self._trim(obj)
            self._tell(key, kept)
        self._touch()

    def _tell(self, key: Hashable, obj: dict[str, Any] | None) -> None:
        for listener in self.listeners:
            try:
                listener(key, obj)
            except Exception:  # a listener's bug must not stop the watch
                logger.exception("%s cache: a listener failed on %r", self.what, key)

    async def _watch(self) -> int:
        """One WATCH from the current version until the server ends it; the events it delivered."""
        self.watches += 1
        response = await self._watch_method(
            **self._watch_args,
            watch=True,
            resource_version=self._version,
            allow_watch_bookmarks=True,
            timeout_seconds=self._watch_seconds,
            _request_timeout=self._watch_seconds + 30,
        )
        delivered = 0
        try:
            if response.status != 200:
                body = await response.read()
                try:
                    status = json.loads(body)
                except ValueError:
                    status = None
                raise WatchRefused.from_status(response.status, status, response.reason or "")
            while line := await response.content.readline():
                self._apply(_event(line, self.what))
                delivered += 1
        finally:
            response.release()
        return delivered

    async def run(self, *, listed: bool = False) -> None:
        """LIST (unless `listed`: already listed or seeded), then WATCH for as long as it runs."""
        need_list = not listed
        delay = self._retry_seconds
        while True:
            try:
                if need_list:
                    await self.relist()
                    need_list = False
                started = time.monotonic()
                delivered = await self._watch()
                if delivered or time.monotonic() - started >= SHORT_WATCH_SECONDS:
                    delay = self._retry_seconds
                    self.failures = 0
                    continue
                self._failed("it ended at once without an event")
                logger.warning("%s watch ended at once without an event; watching again", self.what)
            except asyncio.CancelledError:
                raise
            except WatchRefused as exc:
                if exc.status == 410:
                    self.expired += 1
                    logger.info(
                        "%s watch: resourceVersion %s expired (410 Gone); listing again",
                        self.what,
                        self._version,
                    )
                    need_list = True
                    continue
                # 429: the server asks to slow down; the version is still good. Anything else (403,
                # 5xx): list again, as client-go does.
                need_list = need_list or exc.status != 429
                self._failed(f"{exc.status} {exc.reason}")
                logger.warning(
                    "%s watch answered %s %s; retrying in %.1fs", self.what, exc.status, exc.reason, delay
                )
            except Exception as exc:  # transport errors, timeouts, a failed LIST: retried after a pause
                self._failed(f"{type(exc).__name__}: {exc}")
                logger.warning(
                    "%s watch failed (%s: %s); retrying in %.1fs", self.what, type(exc).__name__, exc, delay
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, self._max_retry_seconds)


class SharedWatch:
    """A WatchCache for as long as somebody uses it: the first user starts it, the last one stops it.

    `users` is counted by the owner (`enter` before `start`, `leave` always, also when `start`
    failed), so a user that arrives while another is still listing waits for that LIST.
    """

    def __init__(self, cache: WatchCache) -> None:
        self.cache = cache
        self.users = 0
        self._task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()

    @property
    def running(self) -> bool:
        """The first LIST completed and the watch runs."""
        return self._task is not None and self.cache.synced

    async def start(self, seed: tuple[list[dict[str, Any]], str] | None = None) -> WatchCache:
        """The synced cache: seeded (or listed, when there is no seed) and watched by the first caller;
        later callers get the running one. Raises what the LIST raises."""
        async with self._lock:
            if self._task is None:
                if seed is not None:
                    self.cache.seed(*seed)
                else:
                    await self.cache.relist()
                self._task = asyncio.create_task(self.cache.run(listed=True), name=f"watch {self.cache.what}")
        return self.cache

    async def stop(self) -> None:
        """End the watch (the last user left)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
