"""One active replica: leader election on a coordination.k8s.io Lease (kubernetes.aio.leaderelection).

Only the leader acts. `install(app, elector)` wires the election into the aiohttp service: the
elector runs for the application's lifetime, `/readyz` answers 200 only while this replica leads
(so the Service sends Alertmanager's deliveries to the leader), and a non-leader answers `/alerts`
with 503 so that Alertmanager retries. The executors ask `elector.is_leader` before every write, so
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
import json
import logging
import socket
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

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
    seconds, as Lease.spec.leaseDurationSeconds is."""
    renew_deadline_seconds: float = 10.0
    """How long the leader keeps trying to renew before it steps down; below lease_duration."""
    retry_period_seconds: float = 2.0
    """Pause between attempts to acquire or renew (at least 1 s, the library's minimum)."""


class LeaderElector:
    """Campaigns for the Lease for as long as `run()` runs; `is_leader` says whether this replica leads."""

    def __init__(self, *, api: k8s.ApiClient, settings: LeaderSettings) -> None:
        self.settings = settings
        self.api = api
        """The client the election uses (owned by the caller, who closes it)."""
        self._leader = False
        self._listeners: list[Callable[[bool], None]] = []
        self.transitions = 0
        """How many times this replica became leader."""

    @property
    def is_leader(self) -> bool:
        """True while this replica holds the Lease."""
        return self._leader

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
            lock = _LeaseLock(s.lease_name, s.namespace, s.identity, self.api)
            config = electionconfig.Config(
                lock=lock,
                lease_duration=s.lease_duration_seconds,
                renew_deadline=s.renew_deadline_seconds,
                retry_period=s.retry_period_seconds,
                onstarted_leading=self._started,
                onstopped_leading=self._stopped,
            )
            try:
                await leaderelection.LeaderElection(config).run()
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


class _LeaseLock(LeaseLock):
    """The library's LeaseLock with `create` fixed: kubernetes 37.0.1 passes `pretty=True`, which its
    own pydantic-validated client rejects (pretty must be a string), so the Lease could never be
    created. Otherwise identical."""

    async def create(self, name: str, namespace: str, election_record: LeaderElectionRecord) -> bool:
        body = k8s.V1Lease(metadata=k8s.V1ObjectMeta(name=name), spec=self.update_lease(election_record))
        try:
            await self.api_instance.create_namespaced_lease(namespace, body)
        except k8s.ApiException as exc:
            logger.info("could not create the Lease %s/%s: %s", namespace, name, exc.reason)
            return False
        return True


ELECTOR = web.AppKey("leader_elector", LeaderElector)


@web.middleware
async def _leader_only(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    elector = request.app[ELECTOR]
    if elector.is_leader:
        return await handler(request)
    if request.path == "/readyz":
        return web.Response(text="not ready: not the leader\n", status=503)
    if request.path == "/alerts" and request.method == "POST":
        return web.json_response(
            {"error": "this replica is not the leader; retry (the Service routes to the leader)"}, status=503
        )
    return await handler(request)


def install(app: web.Application, elector: LeaderElector) -> None:
    """Run `elector` for the application's lifetime and gate /readyz and /alerts on leadership."""
    app[ELECTOR] = elector
    app.middlewares.append(_leader_only)

    async def campaign(app: web.Application) -> AsyncIterator[None]:
        task = asyncio.create_task(elector.run(), name="leader-election")
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await elector.release()

    app.cleanup_ctx.append(campaign)
