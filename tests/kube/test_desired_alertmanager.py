"""Desired state from a real Alertmanager's API v2, acted on against the real API server.

Alerts are posted to Alertmanager as Prometheus posts them and silences set through its API, as an
operator would; the engine over the real Kubernetes executor reads what fires now through
`AlertmanagerClient` and reconciles. Covered: a silence stops actions on that node (and keeps what is
held); an alert no Alertmanager shows any more releases its hold per the policy; with no Alertmanager
reachable the webhook deliveries stay the desired state (counted); two Alertmanagers delivering the
same group over real webhooks act once.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from remediator.desired.alertmanager import AlertmanagerClient, AlertmanagerPoller, AlertmanagerSettings
from remediator.executors.kubernetes import KubernetesCluster, KubernetesSettings
from remediator.executors.snapshot import RecordingAws
from remediator.intake.app import create_app
from remediator.intake.payload import parse_payload
from remediator.lifecycle.engine import Engine
from remediator.lifecycle.model import EngineSettings
from remediator.policy import parse_policy
from tests import alertmanager_process
from tests.alertmanager_process import Alertmanager, ended, fired
from tests.kube.controlplane import ControlPlane, apply_objects, cordoned, eventually, forget_remediation
from tests.kube.kubelet import FakeKubelet, KubeletSettings
from tests.remediator.conftest import AiohttpClient

pytestmark = pytest.mark.skipif(
    not alertmanager_process.available(), reason="prometheus-alertmanager missing"
)

NS = "accel-health"
NODES = [f"gpu-{i}" for i in range(4)]
STATE_CM = "accel-health-remediator-gates"
CORDON = parse_policy(
    "safety: {max_disrupted_nodes: 3, storm_breaker: {enabled: false}}\n"
    "rules:\n  - {name: c, actions: [cordon], on_resolved: [uncordon]}\n"
)


@pytest.fixture(scope="module")
def kubelet(plane: ControlPlane, workdir: Path) -> Iterator[FakeKubelet]:
    fake = FakeKubelet(plane=plane, workdir=workdir, settings=KubeletSettings(start_delay=0.2))
    for name in NODES:
        fake.add_node(name, labels={"pool": "gpu"}, capacity={"nvidia.com/gpu": "8"})
    apply_objects(plane.admin, [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}}])
    fake.start()
    yield fake
    fake.stop()


@pytest.fixture
def fresh(plane: ControlPlane, kubelet: FakeKubelet) -> Iterator[None]:
    forget_remediation(plane, namespace=NS, state_configmap=STATE_CM)
    yield
    forget_remediation(plane, namespace=NS, state_configmap=STATE_CM)


@pytest.fixture
def manager(tmp_path: Path) -> Iterator[Alertmanager]:
    am = Alertmanager(workdir=tmp_path / "am")
    yield am
    am.stop()


def cluster_for(plane: ControlPlane) -> KubernetesCluster:
    settings = KubernetesSettings(state_namespace=NS, request_timeout_seconds=5.0, instance="test")
    return KubernetesCluster(api=plane.api_client(), settings=settings, should_act=lambda: True)


def engine_over(cluster: KubernetesCluster) -> Engine:
    return Engine(
        policy=CORDON, cluster=cluster, aws=RecordingAws(), settings=EngineSettings(), clock=time.time
    )


def poller_for(engine: Engine, *urls: str) -> AlertmanagerPoller:
    client = AlertmanagerClient(AlertmanagerSettings(urls=urls, timeout_seconds=2.0))
    return AlertmanagerPoller(client=client, reconcile=engine.reconcile, ready=lambda: True)


async def test_a_silence_set_in_alertmanager_stops_actions_on_that_node(
    plane: ControlPlane, fresh: None, manager: Alertmanager
) -> None:
    cluster = cluster_for(plane)
    engine = engine_over(cluster)
    poller = poller_for(engine, manager.url)
    t0 = time.time() - 60
    try:
        silence = manager.silence(matchers={"node": "gpu-1"})
        manager.post_alerts(fired("gpu-0", starts_at=t0), fired("gpu-1", starts_at=t0))
        await poller.poll_once()
        assert cordoned(plane) == ["gpu-0"]
        silenced = [r for r in engine.log.records() if r.node == "gpu-1"]
        assert [(r.action, r.outcome) for r in silenced] == [("none", "ignored")]
        assert f"silenced in Alertmanager by {silence}" in silenced[0].reason

        # A webhook for the silenced alert (e.g. from an Alertmanager without the silence) changes nothing.
        fp = next(a["fingerprint"] for a in manager.alerts() if a["labels"]["node"] == "gpu-1")
        body = {**fired("gpu-1", starts_at=t0), "fingerprint": fp, "status": "firing"}
        await engine.handle(parse_payload({"version": "4", "alerts": [body]}))
        assert cordoned(plane) == ["gpu-0"]

        # Silencing a node already cordoned neither acts nor undoes: the cordon stays held.
        manager.silence(matchers={"node": "gpu-0"})
        await poller.poll_once()
        assert cordoned(plane) == ["gpu-0"]
        assert not [r for r in engine.log.records() if r.action == "uncordon"]

        # The silence on gpu-1 ends: the alert acts now.
        manager.expire_silence(silence)
        await poller.poll_once()
        assert cordoned(plane) == ["gpu-0", "gpu-1"]
    finally:
        await poller.client.close()
        await cluster.close()


async def test_an_alert_alertmanager_no_longer_shows_releases_its_hold_per_the_policy(
    plane: ControlPlane, fresh: None, manager: Alertmanager
) -> None:
    cluster = cluster_for(plane)
    engine = engine_over(cluster)
    poller = poller_for(engine, manager.url)
    t0 = time.time() - 60
    a0, a2 = fired("gpu-0", starts_at=t0), fired("gpu-2", starts_at=t0)
    try:
        manager.post_alerts(a0, a2)
        await poller.poll_once()
        assert cordoned(plane) == ["gpu-0", "gpu-2"]

        manager.post_alerts(ended(a2))  # it resolved; no webhook reaches this engine
        await poller.poll_once()
        assert cordoned(plane) == ["gpu-0"]
        uncordons = [(r.node, r.outcome) for r in engine.log.records() if r.action == "uncordon"]
        assert uncordons == [("gpu-2", "done")]
        assert set(engine.status().firing) == {"gpu-0"}

        await poller.poll_once()  # reconciling again changes nothing
        assert cordoned(plane) == ["gpu-0"]
        assert len([r for r in engine.log.records() if r.action == "uncordon"]) == 1
    finally:
        await poller.client.close()
        await cluster.close()


async def test_with_alertmanager_unreachable_the_webhook_deliveries_stay_the_desired_state(
    plane: ControlPlane, fresh: None, tmp_path: Path
) -> None:
    cluster = cluster_for(plane)
    engine = engine_over(cluster)
    gone = Alertmanager(workdir=tmp_path / "gone")
    gone.stop()  # its port answers nothing now
    poller = poller_for(engine, gone.url)
    alert = {
        "status": "firing",
        "labels": {"alertname": "AccelGPUFatalXid", "node": "gpu-3"},
        "startsAt": "2025-11-22T20:00:00Z",
        "fingerprint": "fatal-gpu-3",
    }
    try:
        await engine.handle(parse_payload({"version": "4", "alerts": [alert]}))
        assert cordoned(plane) == ["gpu-3"]
        assert await poller.poll_once() is None
        assert (poller.counters.ok, poller.counters.unreachable) == (0, 1)
        assert cordoned(plane) == ["gpu-3"]  # nothing concluded from silence on the wire
        assert set(engine.status().firing) == {"gpu-3"}
        await engine.handle(parse_payload({"version": "4", "alerts": [{**alert, "status": "resolved"}]}))
        assert cordoned(plane) == []
    finally:
        await poller.client.close()
        await cluster.close()


async def test_two_alertmanagers_delivering_the_same_group_act_once(
    plane: ControlPlane, fresh: None, tmp_path: Path, aiohttp_client: AiohttpClient
) -> None:
    cluster = cluster_for(plane)
    engine = engine_over(cluster)
    client = await aiohttp_client(create_app(engine=engine, token="t0ken"))
    hook = f"http://127.0.0.1:{client.port}/alerts"
    pair = [Alertmanager(workdir=tmp_path / f"am{i}", webhook_url=hook, token="t0ken") for i in range(2)]
    poller = poller_for(engine, *(am.url for am in pair))
    alert = fired("gpu-1", starts_at=time.time() - 60)
    try:
        for am in pair:  # Prometheus sends every alert to each member of the pair
            am.post_alerts(alert)

        async def both_delivered() -> bool:
            metrics = await (await client.get("/metrics")).text()
            return 'accel_remediator_webhooks_total{code="200"} 2.0' in metrics

        await eventually(both_delivered, seconds=20)
        assert cordoned(plane) == ["gpu-1"]
        decided = [(r.node, r.action, r.outcome) for r in engine.log.records()]
        assert decided == [("gpu-1", "cordon", "done")]

        view = await poller.poll_once()
        assert view is not None
        assert (len(view.alerts), len(view.reached)) == (1, 2)
        assert [(r.node, r.action, r.outcome) for r in engine.log.records()] == decided
    finally:
        for am in pair:
            am.stop()
        await poller.client.close()
        await cluster.close()
