"""Leader election on a coordination.k8s.io Lease against the HTTP-level fake API server.

Two electors campaign for one Lease with short timings (lease 3 s, renew 2 s, retry 1 s): one
leads; when it dies the other takes over well within 15 s; a graceful stop hands the Lease over at
once; only the leader's /readyz is 200 and a follower answers /alerts with 503; and a leader that
dies mid-drain leaves a drain the new leader resumes with the same deadline, evicting nothing twice.
The command line's own default timing (a 15 s lease) leads too, a leader whose renewal hangs steps
down within its renew deadline, and the Lease's times are UTC whatever the local time zone. A new
leader whose rebuild fails tries again with back-off and is ready once it succeeds; a leader paused
past its renew deadline is fenced (writes nothing) as soon as it runs again.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import time
from collections.abc import AsyncIterator, Callable

import pytest
from kubernetes.aio import client as k8s

from remediator import cli
from remediator.cluster import DrainSettings, NotLeader
from remediator.executors.kubernetes import KubernetesCluster
from remediator.executors.snapshot import RecordingAws, SnapshotCluster
from remediator.intake.app import create_app
from remediator.leader import LeaderElector, LeaderSettings, install
from remediator.lifecycle.engine import Engine
from remediator.lifecycle.model import EngineSettings
from remediator.lifecycle.record import DRAIN_DEADLINE
from remediator.policy import load_policy
from tests.remediator.conftest import AUTH, TOKEN, AiohttpClient, payload
from tests.remediator.fake_apiserver import FakeApiServer, node, pdb, pod, serve

FAILOVER_LIMIT = 15.0


def elector(url: str, identity: str) -> LeaderElector:
    return LeaderElector(
        api=k8s.ApiClient(k8s.Configuration(host=url)),
        settings=LeaderSettings(
            namespace="accel-health",
            lease_name="remediator",
            identity=identity,
            lease_duration_seconds=3,
            renew_deadline_seconds=2,
            retry_period_seconds=1,
        ),
    )


async def wait_until(condition: Callable[[], bool], *, limit: float) -> float:
    """Seconds until `condition()` held; fails the test after `limit`."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > limit:
            pytest.fail(f"condition not met within {limit}s")
        await asyncio.sleep(0.05)
    return time.monotonic() - started


@contextlib.asynccontextmanager
async def campaigning(e: LeaderElector) -> AsyncIterator[asyncio.Task[None]]:
    task = asyncio.create_task(e.run())
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await close(e.api)


async def close(api: k8s.ApiClient) -> None:
    await api.close()  # type: ignore[no-untyped-call]  # untyped upstream


def holder(api: FakeApiServer) -> str | None:
    lease = api.stored("leases", "remediator", "accel-health")
    return None if lease is None else lease.get("spec", {}).get("holderIdentity")


async def test_one_of_two_electors_leads_and_the_lease_names_it() -> None:
    async with serve() as (api, url):
        a, b = elector(url, "a"), elector(url, "b")
        async with campaigning(a), campaigning(b):
            await wait_until(lambda: a.is_leader or b.is_leader, limit=5)
            await asyncio.sleep(1.5)  # a few renewals later, still exactly one
            assert a.is_leader != b.is_leader
            assert holder(api) == ("a" if a.is_leader else "b")


async def test_when_the_leader_dies_the_other_takes_over_within_15_seconds() -> None:
    async with serve() as (api, url):
        a, b = elector(url, "a"), elector(url, "b")
        async with campaigning(a) as task_a:
            await wait_until(lambda: a.is_leader, limit=5)
            async with campaigning(b):
                await asyncio.sleep(1.2)
                assert not b.is_leader
                task_a.cancel()  # dies: no release, the Lease just stops being renewed
                with contextlib.suppress(asyncio.CancelledError):
                    await task_a
                failover = await wait_until(lambda: b.is_leader, limit=FAILOVER_LIMIT)
                assert holder(api) == "b"
    assert failover < FAILOVER_LIMIT
    assert failover >= 1.0  # it did wait for the lease to expire


async def test_a_graceful_stop_hands_the_lease_over_within_a_retry_period() -> None:
    async with serve() as (api, url):
        a, b = elector(url, "a"), elector(url, "b")
        async with campaigning(a) as task_a:
            await wait_until(lambda: a.is_leader, limit=5)
            async with campaigning(b):
                task_a.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task_a
                await a.release()
                assert holder(api) is None
                handover = await wait_until(lambda: b.is_leader, limit=FAILOVER_LIMIT)
    assert handover < 2.5


async def test_only_the_leader_is_ready_and_a_follower_refuses_alerts_with_503(
    aiohttp_client: AiohttpClient,
) -> None:
    async with serve() as (api, url):
        api.add(node("gpu-node-1"))

        def service(identity: str) -> tuple[LeaderElector, object]:
            e = elector(url, identity)
            engine = Engine(
                policy=load_policy(),
                cluster=SnapshotCluster(nodes=[], pods=[], pdbs=[]),
                aws=RecordingAws(),
                settings=EngineSettings(dry_run=True),
                clock=time.time,
            )
            app = create_app(engine=engine, token=TOKEN)
            install(app, e)
            return e, app

        ea, app_a = service("a")
        client_a = await aiohttp_client(app_a)  # type: ignore[arg-type]  # an aiohttp Application
        await wait_until(lambda: ea.is_leader, limit=5)
        eb, app_b = service("b")
        client_b = await aiohttp_client(app_b)  # type: ignore[arg-type]  # an aiohttp Application
        await asyncio.sleep(1.2)
        assert (await client_a.get("/readyz")).status == 200
        assert (await client_b.get("/readyz")).status == 503
        assert (await client_b.get("/healthz")).status == 200  # alive, just not leading
        assert (await client_b.post("/alerts", json=payload("gpu-fatal-xid"), headers=AUTH)).status == 503
        assert (await client_a.post("/alerts", json=payload("gpu-fatal-xid"), headers=AUTH)).status == 200
        metrics = await (await client_b.get("/metrics")).text()
        assert 'accel_remediator_webhooks_total{code="503"} 1.0' in metrics

        await client_a.close()  # shuts app a down: its Lease is handed back
        await wait_until(lambda: eb.is_leader, limit=FAILOVER_LIMIT)
        assert (await client_b.get("/readyz")).status == 200
        await client_b.close()
        await close(ea.api)
        await close(eb.api)


async def test_a_leader_dying_mid_drain_leaves_a_drain_the_new_leader_resumes() -> None:
    drain = DrainSettings(
        timeout_seconds=60, backoff_initial_seconds=0.1, backoff_max_seconds=0.3, poll_interval_seconds=0.1
    )
    async with serve() as (api, url):
        api.add(node("gpu-1"))
        for i in range(3):
            api.add(pod(f"w-{i}", node_name="gpu-1"))
        api.add(pod("db-0", node_name="gpu-1", labels={"app": "db"}, owner=("StatefulSet", "db")))
        api.add(pdb("db", match={"app": "db"}, allowed=0))
        a, b = elector(url, "a"), elector(url, "b")
        cluster_a = KubernetesCluster(api=a.api, should_act=lambda: a.is_leader)
        cluster_b = KubernetesCluster(api=b.api, should_act=lambda: b.is_leader)
        async with campaigning(a) as task_a:
            await wait_until(lambda: a.is_leader, limit=5)
            async with campaigning(b):
                drain_a = asyncio.create_task(cluster_a.drain("gpu-1", drain))
                await wait_until(lambda: len(api.evictions) >= 5, limit=5)  # three evicted, db-0 refused
                deadline = api.stored("nodes", "gpu-1")["metadata"]["annotations"][DRAIN_DEADLINE]  # type: ignore[index]  # exists

                task_a.cancel()  # the leader dies mid-drain
                with contextlib.suppress(asyncio.CancelledError):
                    await task_a
                with pytest.raises(NotLeader):
                    await drain_a  # it stops at its next request

                failover = await wait_until(lambda: b.is_leader, limit=FAILOVER_LIMIT)
                api.set_disruptions_allowed("training", "db", 1)
                outcome = await cluster_b.drain("gpu-1", drain)
    assert failover < FAILOVER_LIMIT
    assert outcome.resumed
    assert outcome.completed, outcome.summary()
    assert api.stored("nodes", "gpu-1")["metadata"]["annotations"][DRAIN_DEADLINE] == deadline  # type: ignore[index]  # exists
    accepted = [name for _, name, status in api.evictions if status == 201]
    assert sorted(accepted) == ["db-0", "w-0", "w-1", "w-2"]  # each exactly once


def default_elector(url: str, identity: str) -> LeaderElector:
    """An elector with the settings `accel-health-remediator serve` uses when given no flag."""
    args = cli._serve_parser().parse_args(["--insecure-no-auth"])
    settings = LeaderSettings.from_lease_duration(
        args.lease_duration, namespace="accel-health", lease_name=args.lease_name
    )
    return LeaderElector(
        api=k8s.ApiClient(k8s.Configuration(host=url)),
        settings=dataclasses.replace(settings, identity=identity),
    )


async def test_the_command_lines_default_lease_timing_leads_and_writes_a_15_second_lease() -> None:
    async with serve() as (api, url):
        a = default_elector(url, "a")
        assert a.settings.lease_duration_seconds == 15
        async with campaigning(a):
            await wait_until(lambda: a.is_leader, limit=5)
            lease = api.stored("leases", "accel-health-remediator", "accel-health")
    assert lease is not None
    assert lease["spec"]["holderIdentity"] == "a"
    assert lease["spec"]["leaseDurationSeconds"] == 15


def test_a_lease_duration_that_is_not_whole_seconds_is_refused_at_once() -> None:
    with pytest.raises(ValueError, match="whole number of seconds"):
        LeaderSettings(lease_duration_seconds=15.0)  # type: ignore[arg-type]  # the mistake under test
    with pytest.raises(ValueError, match="greater than renew_deadline"):
        LeaderSettings(lease_duration_seconds=10, renew_deadline_seconds=10)


async def test_a_leader_whose_renewal_hangs_steps_down_within_its_renew_deadline() -> None:
    async with serve() as (api, url):
        a = elector(url, "a")  # lease 3 s, renew deadline 2 s: requests limited to 1 s
        async with campaigning(a):
            await wait_until(lambda: a.is_leader, limit=5)
            api["put", api.resource("coordination.k8s.io/v1/leases")] << (lambda: asyncio.sleep(60))
            stepped_down = await wait_until(lambda: not a.is_leader, limit=10)
    # Within retry period + renew deadline (+ a request's timeout of slack), below the lease
    # duration that a follower waits from the last renewal: never two leaders acting at once.
    assert stepped_down < 1 + 2 + 0.5


async def test_the_lease_times_are_utc_whatever_the_local_time_zone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TZ", "XYZ+05:00")  # five hours behind UTC, POSIX rule, needs no tz database
    time.tzset()
    try:
        async with serve() as (api, url):
            a = elector(url, "a")
            async with campaigning(a):
                await wait_until(lambda: a.is_leader, limit=5)
                await asyncio.sleep(1.5)  # renewed at least once, from a Lease read back
                lease = api.stored("leases", "remediator", "accel-health")
    finally:
        monkeypatch.delenv("TZ")
        time.tzset()
    assert lease is not None
    for field in ("acquireTime", "renewTime"):
        written = datetime.datetime.fromisoformat(lease["spec"][field].replace("Z", "+00:00"))
        assert abs(written.timestamp() - time.time()) < 10, (field, lease["spec"][field])


class FlakyReplica:
    """A replica whose rebuild fails (the API unreachable) until `fail` is set to 0."""

    def __init__(self, *, fail: int) -> None:
        self.fail = fail
        self.attempts = 0
        self._synced = False

    def became_leader(self) -> None:
        self._synced = False

    @property
    def synced(self) -> bool:
        return self._synced

    async def sync(self) -> None:
        self.attempts += 1
        if self.fail:
            self.fail -= 1
            raise ConnectionError("the API server is unreachable")
        self._synced = True


async def test_a_new_leader_whose_rebuild_fails_retries_and_is_ready_once_it_succeeds(
    aiohttp_client: AiohttpClient,
) -> None:
    async with serve() as (_api, url):
        e = elector(url, "a")
        engine = Engine(
            policy=load_policy(),
            cluster=SnapshotCluster(nodes=[], pods=[], pdbs=[]),
            aws=RecordingAws(),
            settings=EngineSettings(dry_run=True),
            clock=time.time,
        )
        app = create_app(engine=engine, token=TOKEN)
        replica = FlakyReplica(fail=3)
        install(app, e, replica=replica)
        client = await aiohttp_client(app)
        await wait_until(lambda: e.is_leader, limit=5)
        assert (await client.get("/readyz")).status == 503  # leading, not rebuilt yet
        took = await wait_until(lambda: replica.synced, limit=10)
        assert replica.attempts == 4  # three failures, each retried with back-off, then success
        assert took < 0.5 + 1 + 2 + 1  # back-off 0.5, 1, 2 s: ready within seconds of the API's return
        assert (await client.get("/readyz")).status == 200
        await client.close()
        await close(e.api)


async def test_a_leader_paused_past_its_renew_deadline_writes_nothing_when_it_runs_again() -> None:
    async with serve() as (_api, url), campaigning(e := elector(url, "a")):
        await wait_until(lambda: e.is_leader, limit=5)
        election = e._election  # the test reads the renewal time the fencing uses
        assert election is not None
        assert election.renewed_at is not None
        election.renewed_at -= 5  # as if the process had been stopped for 5 s (renew deadline 2 s)
        assert not e.is_leader  # fenced at once, before its renew loop notices
        cluster = KubernetesCluster(
            api=k8s.ApiClient(k8s.Configuration(host=url)), should_act=lambda: e.is_leader
        )
        with pytest.raises(NotLeader):
            await cluster.cordon("gpu-node-1")
        await cluster.close()
