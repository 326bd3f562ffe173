"""One active replica: leader election on a coordination.k8s.io Lease (kubernetes.aio.leaderelection).

Only the leader acts. `install(app, elector, replica=engine)` wires the election into the aiohttp
service: the elector runs for the application's lifetime; a replica that becomes leader reads the
view again from the cluster (`replica.became_leader()`, then `replica.sync()`, retried with back-off
until it succeeds) and `/readyz` answers 200 only once that is done and while it leads (so the
Service sends Alertmanager's deliveries to the leader).
A follower serves nothing that shows or changes the gates: `/alerts`, `/actions`, `/state`,
`/pause` and `/resume` answer 503 naming the leader (a follower's log and gates are stale, and a
pause set in its memory would act nowhere); the operator asks again (the Service routes to the
leader). The executors ask `elector.is_leader` before every write, so
a leader that loses its Lease mid-drain stops at the next request, and the new leader resumes the
drain from the node's annotations.

The election itself is the client library's (acquire, renew within `renew_deadline`, step down);
this module adds what a long-running service needs around it: it keeps campaigning after losing
the lease or after an API error, and hands the Lease back on shutdown so that a rolling update
fails over within one retry period instead of one lease duration.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import logging
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp
from aiohttp import web
from kubernetes.aio import client as k8s
from kubernetes.aio.leaderelection import electionconfig, leaderelection
from kubernetes.aio.leaderelection.leaderelectionrecord import LeaderElectionRecord
from kubernetes.aio.leaderelection.resourcelock.leaselock import LeaseLock

logger = logging.getLogger("remediator.leader")


def _default_identity() -> str:
    return f"{socket.gethostname()}_{uuid.uuid4().hex[:8]}"


@dataclass(frozen=True)
class LeaderSettings:
    """Where the Lease lives and its timing (client-go's defaults: 15 s / 10 s / 2 s)."""

    namespace: str = "accel-health"
    """Namespace of the Lease (the remediator's own)."""
    lease_name: str = "accel-health-remediator"
    """Name of the Lease."""
    identity: str = field(default_factory=_default_identity)
    """This replica's holderIdentity: host (pod) name plus a random suffix, unique per process."""
    lease_duration_seconds: int = 15
    """How long followers wait after the last renewal before taking over (failover time); whole
    seconds, as Lease.spec.leaseDurationSeconds is (the library writes it as `int(str(value))`, so a
    float such as 15.0 would end the election)."""
    renew_deadline_seconds: float = 10.0
    """How long the leader keeps trying to renew before it steps down; below lease_duration."""
    retry_period_seconds: float = 2.0
    """Pause between attempts to acquire or renew (at least 1 s, the library's minimum)."""
    request_timeout_seconds: float | None = None
    """Limit on each of the election's API requests; None: half the renew deadline, at least 1 s
    (client-go's choice), so a hung request cannot stretch a renewal past the deadline."""

    def __post_init__(self) -> None:
        duration = self.lease_duration_seconds
        if isinstance(duration, bool) or not isinstance(duration, int) or duration < 1:
            raise ValueError(
                f"lease_duration_seconds must be a whole number of seconds >= 1, got {duration!r}"
            )
        electionconfig.Config(  # the library's own checks of the timings, at construction time
            lock=_NO_LOCK,
            lease_duration=duration,
            renew_deadline=self.renew_deadline_seconds,
            retry_period=self.retry_period_seconds,
            onstarted_leading=_nothing,
            onstopped_leading=_nothing,
        )

    @classmethod
    def from_lease_duration(cls, seconds: int, *, namespace: str, lease_name: str) -> LeaderSettings:
        """client-go's proportions for a lease of `seconds`: renew deadline 2/3 of it, retry period
        2/15 (at least 1 s); 15 s gives client-go's 15 s / 10 s / 2 s."""
        return cls(
            namespace=namespace,
            lease_name=lease_name,
            lease_duration_seconds=seconds,
            renew_deadline_seconds=seconds * 2 / 3,
            retry_period_seconds=max(1.0, seconds * 2 / 15),
        )

    @property
    def request_timeout(self) -> float:
        """The limit on each election request, in seconds."""
        if self.request_timeout_seconds is not None:
            return self.request_timeout_seconds
        return max(1.0, self.renew_deadline_seconds / 2)


async def _nothing() -> None:
    return None


_NO_LOCK: Any = object()  # stands in for a lock where only the timings are checked


class LeaderElector:
    """Campaigns for the Lease for as long as `run()` runs; `is_leader` says whether this replica leads."""

    def __init__(self, *, api: k8s.ApiClient, settings: LeaderSettings) -> None:
        self.settings = settings
        self.api = api
        """The client the election uses (owned by the caller, who closes it)."""
        self._leader = False
        self._listeners: list[Callable[[bool], None]] = []
        self._election: _LeaderElection | None = None
        self.transitions = 0
        """How many times this replica became leader."""

    @property
    def is_leader(self) -> bool:
        """True while this replica holds the Lease: it acquired it, and its last successful renewal
        began less than the renew deadline ago (on this process's monotonic clock). The second part
        fences a replica that was paused (stopped, starved) past its Lease: when it runs again it
        writes nothing, even before its renew loop has noticed it lost, while another replica leads."""
        if not self._leader:
            return False
        election = self._election
        renewed = election.renewed_at if election is not None else None
        return renewed is None or time.monotonic() - renewed < self.settings.renew_deadline_seconds

    @property
    def leader_identity(self) -> str | None:
        """The holder of the Lease as last observed (this replica's identity while it leads)."""
        if self._leader:
            return self.settings.identity
        record = self._election.observed_record if self._election is not None else None
        holder = getattr(record, "holder_identity", None)
        return str(holder) if holder else None

    def subscribe(self, listener: Callable[[bool], None]) -> None:
        """Call `listener(is_leader)` on every change."""
        self._listeners.append(listener)

    def _set(self, leader: bool) -> None:
        if leader == self._leader:
            return
        self._leader = leader
        if leader:
            self.transitions += 1
        logger.warning(
            "%s %s the leader Lease %s/%s",
            self.settings.identity,
            "acquired" if leader else "lost",
            self.settings.namespace,
            self.settings.lease_name,
        )
        for listener in self._listeners:
            listener(leader)

    async def _started(self) -> None:
        self._set(True)

    async def _stopped(self) -> None:
        self._set(False)

    async def run(self) -> None:
        """Campaign forever: lead while the Lease is renewed, then go back to following."""
        s = self.settings
        while True:
            lock = _LeaseLock(s.lease_name, s.namespace, s.identity, self.api, timeout=s.request_timeout)
            config = electionconfig.Config(
                lock=lock,
                lease_duration=s.lease_duration_seconds,
                renew_deadline=s.renew_deadline_seconds,
                retry_period=s.retry_period_seconds,
                onstarted_leading=self._started,
                onstopped_leading=self._stopped,
            )
            self._election = _LeaderElection(config)
            try:
                await self._election.run()
            except (aiohttp.ClientError, TimeoutError, k8s.ApiException) as exc:
                # The library handles API errors answered by the server; a dropped connection
                # escapes it. Either way this replica must not act until it holds the Lease again.
                logger.warning("leader election interrupted: %s", exc or type(exc).__name__)
            except Exception:
                # Anything else (a malformed Lease, a library bug) must not end the campaign for
                # good: that replica would never lead again. Logged with its traceback, retried.
                logger.exception("leader election failed; campaigning again")
            finally:
                self._set(False)
            await asyncio.sleep(s.retry_period_seconds)

    async def release(self) -> None:
        """Hand the Lease back if this replica holds it (on shutdown), so a follower takes over at once."""
        s = self.settings
        leases = k8s.CoordinationV1Api(self.api)
        try:
            resp = await leases.read_namespaced_lease_without_preload_content(s.lease_name, s.namespace)
            lease = json.loads(await resp.read())
            resp.release()
            if resp.status != 200 or (lease.get("spec") or {}).get("holderIdentity") != s.identity:
                return
            patch = {
                "metadata": {"resourceVersion": lease["metadata"]["resourceVersion"]},
                "spec": {"holderIdentity": None, "acquireTime": None, "renewTime": None},
            }
            resp = await leases.patch_namespaced_lease_without_preload_content(
                s.lease_name, s.namespace, patch, _content_type="application/merge-patch+json"
            )
            resp.release()
            logger.info("released the leader Lease %s/%s (HTTP %d)", s.namespace, s.lease_name, resp.status)
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError) as exc:
            logger.warning("could not release the leader Lease: %s", exc)


class _LeaderElection(leaderelection.LeaderElection):
    """The library's election with the renewal bounded as client-go bounds it: each round of renew
    attempts (and every request in it) ends within `renew_deadline`, after which the leader steps
    down. The library checks its deadline only between attempts, so one hung request kept a leader
    acting for as long as the client's timeout (300 s), long after a follower took the Lease over.
    A transport error or a timed-out request is a failed attempt, retried within the deadline."""

    renewed_at: float | None = None
    """Monotonic time at which the last successful acquire or renew request began."""

    async def try_acquire_or_renew(self) -> bool:
        began = time.monotonic()
        ok: bool = await super().try_acquire_or_renew()
        if ok:
            self.renewed_at = began  # the Lease runs from before the request, never from after
        return ok

    async def renew_loop(self) -> None:
        retry = self.election_config.retry_period
        try:
            while True:
                async with asyncio.timeout(self.election_config.renew_deadline):
                    while True:
                        if await self._attempt():
                            break
                        await asyncio.sleep(retry)
                await asyncio.sleep(retry)
        except TimeoutError:
            logger.warning(
                "could not renew the leader Lease within %ss; stepping down",
                self.election_config.renew_deadline,
            )

    async def _attempt(self) -> bool:
        try:
            return await self.try_acquire_or_renew()
        except (aiohttp.ClientError, TimeoutError) as exc:
            if isinstance(exc, TimeoutError) and asyncio.current_task().cancelling():  # type: ignore[union-attr]  # always in a task
                raise  # the round's own deadline, not the request's
            logger.info("renewing the leader Lease failed: %s", exc or type(exc).__name__)
            return False


class _LeaseLock(LeaseLock):
    """The library's LeaseLock with every request limited to `timeout` seconds, and two fixes:

    - `create`: kubernetes 37.0.1 passes `pretty=True`, which its own pydantic-validated client
      rejects (pretty must be a string), so the Lease could never be created;
    - times: the library makes acquire/renew times with `str(datetime.fromtimestamp(...))`, local
      time, and wrote them with a `Z` as if they were UTC (renewTime hours off wherever TZ is not
      UTC); and `str(datetime)` drops the fraction when the microseconds are 0, which its parser
      then refused (once in a million renewals the renewTime did not move). Here the records hold
      local time throughout and the Lease gets UTC.
    """

    def __init__(
        self, name: str, namespace: str, identity: str, api: k8s.ApiClient, *, timeout: float
    ) -> None:
        super().__init__(name, namespace, identity, api)
        self.timeout = timeout

    async def get(
        self, name: str, namespace: str
    ) -> tuple[bool, LeaderElectionRecord] | tuple[bool, Exception] | tuple[bool, None]:
        try:
            lease = await self.api_instance.read_namespaced_lease(
                name, namespace, _request_timeout=self.timeout
            )
        except k8s.ApiException as exc:
            return False, exc
        self.lease_reference = lease
        return True, self.election_record(lease)

    async def create(self, name: str, namespace: str, election_record: LeaderElectionRecord) -> bool:
        body = k8s.V1Lease(metadata=k8s.V1ObjectMeta(name=name), spec=self.update_lease(election_record))
        try:
            await self.api_instance.create_namespaced_lease(namespace, body, _request_timeout=self.timeout)
        except k8s.ApiException as exc:
            logger.info("could not create the Lease %s/%s: %s", namespace, name, exc.reason)
            return False
        return True

    async def update(self, name: str, namespace: str, updated_record: LeaderElectionRecord) -> bool:
        if self.lease_reference is None:
            return False
        self.lease_reference.spec = self.update_lease(updated_record, self.lease_reference.spec)
        try:
            await self.api_instance.replace_namespaced_lease(
                name=name, namespace=namespace, body=self.lease_reference, _request_timeout=self.timeout
            )
        except k8s.ApiException as exc:
            logger.info("could not update the Lease %s/%s: %s", namespace, name, exc.reason)
            return False
        return True

    def election_record(self, lease: k8s.V1Lease) -> LeaderElectionRecord:
        """The record of a Lease read back, its times in local time like the ones the library makes."""
        record: LeaderElectionRecord = super().election_record(lease)
        spec = lease.spec
        for attr in ("acquire_time", "renew_time"):
            value = getattr(spec, attr, None) if spec is not None else None
            if isinstance(value, datetime.datetime):
                local = value.astimezone() if value.tzinfo is not None else value
                setattr(record, attr, str(local.replace(tzinfo=None)))
        return record

    def time_str_to_iso(self, str_time: str) -> str | None:
        """A record's time (naive local time, as `str(datetime.fromtimestamp(...))` gives) in UTC."""
        for fmt in ("%Y-%m-%d %H:%M:%S.%f", "%Y-%m-%d %H:%M:%S"):
            with contextlib.suppress(ValueError, TypeError):
                when = datetime.datetime.strptime(str_time, fmt).astimezone(datetime.UTC)
                return when.replace(tzinfo=None).isoformat(timespec="microseconds") + "Z"
        logger.error("could not read the election time %r", str_time)
        return None


class Replica(Protocol):
    """What a replica does around leadership (the engine)."""

    def became_leader(self) -> None:
        """What was read before may be stale."""

    @property
    def synced(self) -> bool:
        """Read again since it became leader."""

    async def sync(self) -> None:
        """Read again now."""


class _Synced:
    """No replica state to rebuild (tests of the election alone)."""

    def became_leader(self) -> None:
        return None

    @property
    def synced(self) -> bool:
        return True

    async def sync(self) -> None:
        return None


RESYNC_FIRST_SECONDS = 0.5
"""First wait after a failed rebuild of a new leader; doubled after each failure."""
RESYNC_MAX_SECONDS = 5.0
"""Longest wait between two rebuild attempts."""

ELECTOR = web.AppKey("leader_elector", LeaderElector)
REPLICA = web.AppKey("leader_replica", Replica)
LEADER_ONLY = frozenset({"/alerts", "/actions", "/state", "/pause", "/resume"})
"""Paths only the leader serves: a follower's view is stale and its switches act nowhere."""


@web.middleware
async def _leader_only(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    elector = request.app[ELECTOR]
    replica = request.app[REPLICA]
    if elector.is_leader:
        if request.path == "/readyz" and not replica.synced:
            return web.Response(text="not ready: leader, rebuilding its view from the nodes\n", status=503)
        return await handler(request)
    if request.path == "/readyz":
        return web.Response(text="not ready: not the leader\n", status=503)
    if request.path in LEADER_ONLY:
        return web.json_response(
            {
                "error": "this replica is not the leader: it neither decides nor serves the gates; "
                "retry (the Service routes to the leader)",
                "leader": elector.leader_identity,
            },
            status=503,
            headers={"Retry-After": "2"},
        )
    return await handler(request)


def install(app: web.Application, elector: LeaderElector, *, replica: Replica | None = None) -> None:
    """Run `elector` for the application's lifetime; gate /readyz and the leader-only paths on
    leadership, and have `replica` read its state again each time this replica becomes leader."""
    app[ELECTOR] = elector
    app[REPLICA] = replica if replica is not None else _Synced()
    app.middlewares.append(_leader_only)
    tasks: set[asyncio.Task[None]] = set()

    async def resync() -> None:
        """Rebuild until it succeeds, while this replica leads: /readyz stays 503 until then, and
        an API that comes back is noticed within `RESYNC_MAX_SECONDS`."""
        delay = RESYNC_FIRST_SECONDS
        while elector.is_leader:
            try:
                await app[REPLICA].sync()
            except Exception as exc:  # any failure of the rebuild: logged, retried
                logger.warning("rebuilding after becoming leader failed (%s); again in %.1f s", exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, RESYNC_MAX_SECONDS)
                continue
            return

    def on_change(leading: bool) -> None:
        if not leading:
            return
        app[REPLICA].became_leader()
        task = asyncio.get_running_loop().create_task(resync(), name="resync-after-election")
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    elector.subscribe(on_change)

    async def campaign(app: web.Application) -> AsyncIterator[None]:
        task = asyncio.create_task(elector.run(), name="leader-election")
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        for pending in list(tasks):
            pending.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await elector.release()

    app.cleanup_ctx.append(campaign)
