"""One reconcile per node at a time, nodes in parallel: the work queue keyed by node.

As client-go's workqueue: every trigger that may move a node (a delivery, a read of Alertmanager, the
node watch, a drain's end, a repair timer) names the node; the node's work runs under the node's own
lock, so two triggers for one node never interleave, while different nodes proceed at once and a
slow eviction, evidence fetch or AWS call holds only its node. Nothing is locked across nodes.

Two ways in:

- `lock(node)`: a caller that must answer with the result (a webhook delivery waits for its
  cordon) runs its work for the node itself, under the lock;
- `add(node)`: a trigger that only says "look again" (the watch saw a human's uncordon, a drain
  ended, a timer fired). Triggers for a node that waits already collapse into one; a node added
  while its reconcile runs is reconciled once more after it (it may have missed the change). The
  workers call the `reconcile` they are handed, under the node's lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from remediator.cluster import NotLeader

logger = logging.getLogger("remediator.lifecycle")

Reconcile = Callable[[str], Awaitable[None]]


@dataclass
class _Entry:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0


class NodeQueue:
    """Per-node locks and a de-duplicating queue of nodes to reconcile in the background."""

    def __init__(
        self, *, reconcile: Reconcile | None = None, workers: int = 8, retry_seconds: float = 5.0
    ) -> None:
        self._reconcile = reconcile
        """What the workers call for each node taken from the queue (see `bind`)."""
        self._entries: dict[str, _Entry] = {}
        self._queued: OrderedDict[str, None] = OrderedDict()
        self._running: set[str] = set()
        self._again: set[str] = set()
        self._ready = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._workers = max(1, workers)
        self._retry_seconds = retry_seconds
        self.deferred = 0
        """Reconciles a replica that did not lead (or not at that moment) left for later."""
        self._tasks: list[asyncio.Task[None]] = []
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self.reconciles = 0
        """Background reconciles run (a metric for tests and benchmarks)."""
        self.failures = 0
        """Background reconciles that raised (each retried after `retry_seconds`)."""

    # -- the per-node lock -------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def lock(self, node: str) -> AsyncIterator[None]:
        """Hold `node` (waits while another reconcile of it runs); other nodes are not held."""
        entry = self._entries.get(node)
        if entry is None:
            entry = self._entries[node] = _Entry()
        entry.users += 1
        try:
            async with entry.lock:
                yield
        finally:
            entry.users -= 1
            if entry.users == 0 and self._entries.get(node) is entry:
                del self._entries[node]

    def busy(self, node: str) -> bool:
        """A reconcile of `node` holds its lock (or waits for it) now."""
        return node in self._entries

    @property
    def held(self) -> int:
        """Nodes whose lock is held or awaited now."""
        return len(self._entries)

    # -- the background queue ----------------------------------------------------------------

    def add(self, node: str) -> None:
        """Reconcile `node` soon (once, however often it is added before a worker takes it)."""
        if not node:
            return
        if node in self._running:
            self._again.add(node)
            return
        if node not in self._queued:
            self._queued[node] = None
            self._idle.clear()
            self._ready.set()
            if not self._tasks and self._reconcile is not None and _in_loop():
                self.start(self._reconcile)  # the first trigger starts the workers

    def add_after(self, node: str, seconds: float) -> None:
        """Reconcile `node` in `seconds` (a repair timer, a retry); an earlier timer for it is kept."""
        if node in self._timers:
            return
        loop = asyncio.get_running_loop()

        def fire() -> None:
            self._timers.pop(node, None)
            self.add(node)

        self._timers[node] = loop.call_later(max(0.0, seconds), fire)

    def __len__(self) -> int:
        return len(self._queued)

    def bind(self, reconcile: Reconcile) -> None:
        """The reconcile the workers call; they start with the first node added."""
        self._reconcile = reconcile

    def start(self, reconcile: Reconcile) -> None:
        """Start the workers now (idempotent)."""
        self._reconcile = reconcile
        if self._tasks:
            return
        self._tasks = [
            asyncio.create_task(self._work(reconcile), name=f"node-queue-{i}") for i in range(self._workers)
        ]

    async def stop(self) -> None:
        """Stop the workers and the timers; what is queued is dropped (a new leader rebuilds it)."""
        for handle in self._timers.values():
            handle.cancel()
        self._timers.clear()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        self._queued.clear()
        self._again.clear()
        self._idle.set()

    async def idle(self) -> None:
        """Until nothing is queued or running (tests, a benchmark's end)."""
        while not self._idle.is_set():
            await self._idle.wait()

    async def _work(self, reconcile: Reconcile) -> None:
        while True:
            while not self._queued:
                self._ready.clear()
                await self._ready.wait()
            node, _ = self._queued.popitem(last=False)
            self._running.add(node)
            try:
                async with self.lock(node):
                    self.reconciles += 1
                    await reconcile(node)
            except asyncio.CancelledError:
                raise
            except NotLeader as exc:  # not an error: the leader acts; looked at again, quietly
                self.deferred += 1
                logger.debug(
                    "reconcile of %s left for now (%s); tried again in %.0f s", node, exc, self._retry_seconds
                )
                self.add_after(node, self._retry_seconds)
            except Exception:  # retried: a reconcile is level-triggered, running it again is safe
                self.failures += 1
                logger.exception("reconcile of %s failed; tried again in %.0f s", node, self._retry_seconds)
                self.add_after(node, self._retry_seconds)
            finally:
                self._running.discard(node)
                if node in self._again:
                    self._again.discard(node)
                    self.add(node)
                if not self._queued and not self._running:
                    self._idle.set()


def _in_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True
