"""The remediator's engine reconciling against the real API server (issue 15's defects, one test each).

A bare control plane with the kubelet stand-in; the engine runs over the real Kubernetes executor
(admin credentials unless a test needs a narrower ServiceAccount), so preconditions, conflicts,
managedFields, PodDisruptionBudgets and RBAC refusals are the API server's own. Covered: a replica
that becomes leader rebuilds from the nodes and reads the gates again (pause and budget survive a
fail-over, nothing is done twice), and of two leaders at once only one cordons and records (the
other meets the node's precondition); one alert's resolve does not undo a hold another alert still
firing asks for, and a reversal held so is released by the next leader (from the node's record and
one read of Alertmanager); a drain deadline does not
override a PodDisruptionBudget, and an eviction answered 403 is a refusal, not retried; a human's
uncordon + re-cordon is never undone, and a cordon made by someone else between the read and the
write is not claimed; a follower neither shows nor changes the gates.
"""

from __future__ import annotations

import asyncio
import datetime
import io
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from remediator import cli, leader
from remediator.cluster import Node
from remediator.desired.alertmanager import AlertmanagerView, ShownAlert
from remediator.executors.kubernetes import GATES_KEY, STATE_KEY, KubernetesCluster, KubernetesSettings
from remediator.executors.snapshot import RecordingAws
from remediator.intake.app import create_app
from remediator.intake.payload import Alert, WebhookPayload, parse_payload
from remediator.lifecycle.engine import Engine
from remediator.lifecycle.model import EngineSettings
from remediator.lifecycle.record import EPISODES
from remediator.policy import Policy, parse_policy
from tests.kube.controlplane import (
    ControlPlane,
    apply_objects,
    cordoned,
    deployment,
    forget_remediation,
    wait_for,
)
from tests.kube.kubelet import FakeKubelet, KubeletSettings
from tests.kube.network import skew_proxy
from tests.kube.rest import ApiError, Obj
from tests.remediator.conftest import AiohttpClient

NS = "accel-health"
WORK = "work"
NODES = [f"gpu-{i}" for i in range(6)]
STATE_CM = "accel-health-remediator-gates"


@pytest.fixture(scope="module")
def kubelet(plane: ControlPlane, workdir: Path) -> Iterator[FakeKubelet]:
    fake = FakeKubelet(plane=plane, workdir=workdir, settings=KubeletSettings(start_delay=0.2))
    for i, name in enumerate(NODES):
        fake.add_node(
            name,
            labels={"pool": "gpu"},
            capacity={"nvidia.com/gpu": "8"},
            provider_id=f"aws:///us-east-1a/i-{i:017x}",
        )
    fake.add_node("cpu-0", labels={"pool": "cpu"})
    namespaces = [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": n}} for n in (NS, WORK)]
    apply_objects(plane.admin, namespaces)
    fake.start()
    yield fake
    fake.stop()


@pytest.fixture(scope="module")
def proxy(plane: ControlPlane) -> Iterator[str]:
    """policy/v1 (Evictions, PDBs) on the 1.20 server, with the caller's own token."""
    with skew_proxy(plane) as url:
        yield url


@pytest.fixture
def fresh(plane: ControlPlane, kubelet: FakeKubelet) -> Iterator[None]:
    """Every node schedulable and without this service's annotations, and no stored gate state."""

    forget_remediation(plane, namespace=NS, state_configmap=STATE_CM)
    yield
    forget_remediation(plane, namespace=NS, state_configmap=STATE_CM)


def cluster_for(
    plane: ControlPlane,
    *,
    server: str | None = None,
    token: str | None = None,
    should_act: Callable[[], bool] = lambda: True,
) -> KubernetesCluster:
    settings = KubernetesSettings(
        state_namespace=NS, request_timeout_seconds=5.0, retry_base_seconds=0.05, instance="test"
    )
    api = plane.api_client(token=token, server=server)
    return KubernetesCluster(api=api, settings=settings, should_act=should_act)


def engine_over(cluster: KubernetesCluster, policy: Policy, *, aws: RecordingAws | None = None) -> Engine:
    return Engine(
        policy=policy,
        cluster=cluster,
        aws=aws or RecordingAws(),
        settings=EngineSettings(),
        clock=time.time,
    )


def alert(node: str, *, name: str = "AccelGPUFatalXid", status: str = "firing") -> dict[str, Any]:
    return {
        "status": status,
        "labels": {"alertname": name, "node": node},
        "startsAt": "2025-11-22T20:00:00Z",
        "fingerprint": f"{name}-{node}",
    }


def webhook(*alerts: dict[str, Any]) -> WebhookPayload:
    return parse_payload({"version": "4", "status": "firing", "alerts": list(alerts)})


def outcomes(engine: Engine) -> list[tuple[str | None, str, str, str | None]]:
    return [(r.node, r.action, r.outcome, r.gate) for r in engine.log.records()]


def node_obj(plane: ControlPlane, name: str) -> Obj:
    obj: Obj = plane.admin.get(f"/api/v1/nodes/{name}")
    return obj


def stored_gates(plane: ControlPlane) -> dict[str, Any]:
    cm = plane.admin.get(f"/api/v1/namespaces/{NS}/configmaps/{STATE_CM}")
    doc: dict[str, Any] = json.loads(cm["data"][GATES_KEY])
    return doc


def episodes(plane: ControlPlane, name: str) -> dict[str, Any]:
    """fingerprint -> [rule, alertname, startsAt, steps] of the record on the node."""
    annotations = node_obj(plane, name)["metadata"].get("annotations") or {}
    text = annotations.get(EPISODES)
    return dict(json.loads(text)["e"]) if text else {}


CORDON = parse_policy(
    "safety: {max_disrupted_nodes: 2, storm_breaker: {enabled: false}}\n"
    "rules:\n  - {name: c, actions: [cordon], on_resolved: [uncordon]}\n"
)


# -- 1: fail-over ----------------------------------------------------------------------------------


async def test_a_new_leader_rebuilds_from_the_nodes_so_pause_and_budget_survive_a_failover(
    plane: ControlPlane, fresh: None
) -> None:
    leading = {"a": True, "b": False}
    a_cluster = cluster_for(plane, should_act=lambda: leading["a"])
    b_cluster = cluster_for(plane, should_act=lambda: leading["b"])
    a, b = engine_over(a_cluster, CORDON), engine_over(b_cluster, CORDON)
    try:
        assert await a_cluster.start_cache(wait_seconds=20)
        assert await b_cluster.start_cache(wait_seconds=20)  # a follower keeps its cache warm
        await a.start()
        await b.start()  # the follower read the (empty) gates at its start, before it led
        await a.handle(webhook(alert("gpu-0"), alert("gpu-1")))
        await a.set_paused(True, "rack maintenance")
        assert cordoned(plane) == ["gpu-0", "gpu-1"]

        leading.update(a=False, b=True)  # a's Lease ran out; b holds it now
        b.became_leader()
        started = time.monotonic()
        await b.sync()  # before it is ready: the nodes (its cache) and the gates document
        assert time.monotonic() - started < 2
        assert set(b.budget.holders()) == {"gpu-0", "gpu-1"}
        await b.handle(webhook(alert("gpu-2"), alert("gpu-3")))
        assert b.status().paused
        assert [o[2:] for o in outcomes(b)] == [("deferred", "pause"), ("deferred", "pause")]
        await b.set_paused(False)
        await b.handle(webhook(alert("gpu-2"), alert("gpu-3")))
        assert [o[2:] for o in outcomes(b)[-2:]] == [("deferred", "budget"), ("deferred", "budget")]
        await b.handle(webhook(alert("gpu-0"), alert("gpu-1")))  # resends of what a did: nothing twice
        assert [o[2:] for o in outcomes(b)[-2:]] == [("deferred", "budget"), ("deferred", "budget")]
    finally:
        await a_cluster.close()
        await b_cluster.close()
    assert cordoned(plane) == ["gpu-0", "gpu-1"]  # budget 2: never four
    assert set(episodes(plane, "gpu-0")) == {"AccelGPUFatalXid-gpu-0"}
    assert stored_gates(plane)["pause"]["paused"] is False
    # What it holds, read from the nodes alone by the command an operator runs.
    out = io.StringIO()
    await asyncio.to_thread(cli.holds, ["--kubeconfig", str(plane.kubeconfig), "--json"], out=out)
    held = json.loads(out.getvalue())
    assert sorted(held) == ["gpu-0", "gpu-1"]
    assert held["gpu-0"]["marks"] == ["cordon"]
    assert [e["alertname"] for e in held["gpu-0"]["episodes"]] == ["AccelGPUFatalXid"]


async def test_two_leaders_at_once_never_both_cordon_and_the_record_is_the_winners(
    plane: ControlPlane, fresh: None
) -> None:
    a_cluster, b_cluster = cluster_for(plane), cluster_for(plane)
    a, b = engine_over(a_cluster, CORDON), engine_over(b_cluster, CORDON)
    try:
        await a.start()
        await b.start()
        # Both believe they lead (a split second of split brain) and get the same delivery at once.
        await asyncio.gather(a.handle(webhook(alert("gpu-0"))), b.handle(webhook(alert("gpu-0"))))
        await a.set_paused(True, "rack maintenance")
        await b.set_paused(True, "from b")  # b's view is stale: it reads the gates again, re-applies
    finally:
        await a_cluster.close()
        await b_cluster.close()
    cordons = sorted(r.outcome for e in (a, b) for r in e.log.records() if r.action == "cordon")
    assert cordons == ["done", "skipped"]  # one cordoned; the other met the precondition and backed off
    skipped = next(r for e in (a, b) for r in e.log.records() if r.outcome == "skipped")
    assert "cordoned by someone else meanwhile" in skipped.reason
    assert list(episodes(plane, "gpu-0")) == ["AccelGPUFatalXid-gpu-0"]
    assert stored_gates(plane)["pause"]["reason"] == "from b"


# -- 2: holds belong to causes -------------------------------------------------------------------

TWO_CAUSES = parse_policy(
    """
rules:
  - name: pcie
    match: ['alertname="AccelPCIeErrors"']
    actions: [condition, cordon]
    on_resolved: [uncordon, condition]
  - name: fatal
    match: ['alertname="AccelGPUFatalXid"']
    actions: [condition, cordon]
"""
)


def condition(plane: ControlPlane, node: str) -> str:
    conds = node_obj(plane, node)["status"].get("conditions") or []
    return str(next(c["status"] for c in conds if c["type"] == "AcceleratorHealthy"))


async def test_one_alerts_resolve_does_not_undo_a_hold_another_alert_still_firing_asks_for(
    plane: ControlPlane, fresh: None
) -> None:
    cluster = cluster_for(plane)
    engine = engine_over(cluster, TWO_CAUSES)
    pcie, fatal = alert("gpu-2", name="AccelPCIeErrors"), alert("gpu-2")
    try:
        await engine.handle(webhook(pcie, fatal))
        assert cordoned(plane) == ["gpu-2"]
        assert condition(plane, "gpu-2") == "False"

        await engine.handle(webhook({**pcie, "status": "resolved"}, fatal))
        assert cordoned(plane) == ["gpu-2"]  # the fatal Xid still fires
        assert condition(plane, "gpu-2") == "False"
        held = [r for r in engine.log.records() if r.gate == "hold"]
        assert [r.action for r in held] == ["uncordon", "condition"]
        assert "AccelGPUFatalXid (rule fatal)" in held[0].reason

        await engine.handle(webhook({**fatal, "status": "resolved"}))  # the last cause resolves
    finally:
        await cluster.close()
    assert cordoned(plane) == []
    assert condition(plane, "gpu-2") == "True"


async def test_a_reversal_held_by_another_cause_is_released_by_the_next_leader(
    plane: ControlPlane, fresh: None
) -> None:
    """The next leader derives the held reversal from the node (the PCIe alert's episode recorded
    with its cordon) and one read of Alertmanager (the PCIe alert no longer shown, the fatal Xid
    still firing): the reversal is held until the last cause resolves, then released."""
    leading = {"a": True, "b": False}
    a_cluster = cluster_for(plane, should_act=lambda: leading["a"])
    b_cluster = cluster_for(plane, should_act=lambda: leading["b"])
    a, b = engine_over(a_cluster, TWO_CAUSES), engine_over(b_cluster, TWO_CAUSES)
    pcie, fatal = alert("gpu-3", name="AccelPCIeErrors"), alert("gpu-3")
    try:
        await b.start()
        await a.handle(webhook(pcie, fatal))
        await a.handle(webhook({**pcie, "status": "resolved"}, fatal))  # held: the fatal Xid fires
        assert cordoned(plane) == ["gpu-3"]
        # The PCIe alert's episode recorded with its condition and cordon, the fatal Xid's with its
        # condition (the cordon was there already).
        assert set(episodes(plane, "gpu-3")) == {"AccelPCIeErrors-gpu-3", "AccelGPUFatalXid-gpu-3"}

        leading.update(a=False, b=True)  # fail-over while the PCIe reversal is held
        b.became_leader()
        shown = parse_payload({"version": "4", "alerts": [fatal]}).alerts[0]
        b.alertmanager = _showing(shown)
        await b.sync()  # the nodes, then one read of Alertmanager: the PCIe alert resolved
        assert cordoned(plane) == ["gpu-3"]  # still held by the fatal Xid
        await b.handle(webhook({**fatal, "status": "resolved"}))  # the last cause resolves
    finally:
        await a_cluster.close()
        await b_cluster.close()
    assert cordoned(plane) == []
    assert condition(plane, "gpu-3") == "True"
    assert [(r.action, r.outcome) for r in b.log.records() if r.status == "resolved"][-2:] == [
        ("uncordon", "done"),
        ("condition", "done"),
    ]
    assert episodes(plane, "gpu-3") == {}  # both episodes ended with the reversal's writes


def _showing(alert_shown: Alert) -> Callable[[], Awaitable[AlertmanagerView]]:
    """Alertmanager's API, as a new leader reads it: showing this alert alone, active."""

    async def read() -> AlertmanagerView:
        fp = alert_shown.fingerprint
        return AlertmanagerView(alerts={fp: ShownAlert(alert=alert_shown, suppressed="")}, reached=("am",))

    return read


# -- 5: drain deadline and refusals ---------------------------------------------------------------

REPLACE = """
safety: {max_disrupted_nodes: 3}
rules:
  - name: replace
    actions:
      - cordon
      - {type: drain, timeout_seconds: TIMEOUT, on_timeout: stop}
      - aws_set_unhealthy
"""


def on_node(name: str, *, node: str, replicas: int) -> Obj:
    return deployment(name, WORK, node_selector={"kubernetes.io/hostname": node}, replicas=replicas)


def ready_pods(plane: ControlPlane, app: str) -> int:
    pods = plane.admin.items(f"/api/v1/namespaces/{WORK}/pods", labelSelector=f"app={app}")
    return sum(
        any(
            c["type"] == "Ready" and c["status"] == "True"
            for c in (p.get("status") or {}).get("conditions", [])
        )
        for p in pods
    )


async def test_a_drain_deadline_does_not_override_a_pod_disruption_budget(
    plane: ControlPlane, kubelet: FakeKubelet, proxy: str, fresh: None
) -> None:
    pdb: Obj = {
        "apiVersion": "policy/v1beta1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": "guarded", "namespace": WORK},
        "spec": {"minAvailable": 2, "selector": {"matchLabels": {"app": "guarded"}}},
    }
    apply_objects(plane.admin, [on_node("guarded", node="gpu-5", replicas=2), pdb])
    wait_for("2 ready pods", lambda: ready_pods(plane, "guarded") == 2, timeout=60)
    pdb_path = f"/apis/policy/v1beta1/namespaces/{WORK}/poddisruptionbudgets/guarded"
    wait_for(
        "the PDB's status",
        lambda: plane.admin.get(pdb_path).get("status", {}).get("currentHealthy") == 2,
        timeout=60,
    )
    aws = RecordingAws()
    cluster = cluster_for(plane, server=proxy)
    engine = engine_over(cluster, parse_policy(REPLACE.replace("TIMEOUT", "3")), aws=aws)
    try:
        await engine.handle(webhook(alert("gpu-5")))
        await engine.drained()
    finally:
        await cluster.close()
    assert [(a, o) for _, a, o, _ in outcomes(engine)] == [
        ("cordon", "done"),
        ("drain", "started"),
        ("drain", "failed"),
        ("aws_set_unhealthy", "skipped"),
    ]
    assert "429" in engine.log.records()[2].details["blocked"][0]["reason"]
    assert aws.calls == []  # the protected pods are still on the node: nothing replaces it
    assert ready_pods(plane, "guarded") == 2


async def test_an_eviction_answered_403_is_a_refusal_not_retried_until_the_deadline(
    plane: ControlPlane, kubelet: FakeKubelet, proxy: str, fresh: None
) -> None:
    apply_objects(plane.admin, [on_node("plain", node="gpu-4", replicas=1)])
    wait_for("a ready pod", lambda: ready_pods(plane, "plain") == 1, timeout=60)
    token = narrow_service_account(plane)  # every permission the remediator has except evictions
    aws = RecordingAws()
    cluster = cluster_for(plane, server=proxy, token=token)
    engine = engine_over(cluster, parse_policy(REPLACE.replace("TIMEOUT", "60")), aws=aws)
    started = time.monotonic()
    try:
        await engine.handle(webhook(alert("gpu-4")))
        await engine.drained()
    finally:
        await cluster.close()
    took = time.monotonic() - started
    assert took < 20  # not 60 s of retries
    drain_end = engine.log.records()[2]
    assert (drain_end.action, drain_end.outcome) == ("drain", "failed")
    assert "refused" in drain_end.reason
    assert "403" in drain_end.details["blocked"][0]["reason"]
    assert outcomes(engine)[3][1:3] == ("aws_set_unhealthy", "skipped")
    assert aws.calls == []
    annotations = node_obj(plane, "gpu-4")["metadata"]["annotations"]
    assert annotations["accel-health.io/drain-status"] == "refused"


def narrow_service_account(plane: ControlPlane) -> str:
    rules: list[Obj] = [
        {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch", "patch"]},
        {"apiGroups": [""], "resources": ["nodes/status"], "verbs": ["patch"]},
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
        {"apiGroups": ["policy"], "resources": ["poddisruptionbudgets"], "verbs": ["list", "watch"]},
        {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "create", "update"]},
        {"apiGroups": [""], "resources": ["events"], "verbs": ["create", "patch"]},
    ]
    objects: list[Obj] = [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "no-evict", "namespace": NS}},
    ]
    apply_objects(plane.admin, objects)
    rbac = "/apis/rbac.authorization.k8s.io/v1"
    for path, obj in (
        (f"{rbac}/clusterroles", {"metadata": {"name": "no-evict"}, "rules": rules}),
        (
            f"{rbac}/clusterrolebindings",
            {
                "metadata": {"name": "no-evict"},
                "roleRef": {
                    "apiGroup": "rbac.authorization.k8s.io",
                    "kind": "ClusterRole",
                    "name": "no-evict",
                },
                "subjects": [{"kind": "ServiceAccount", "name": "no-evict", "namespace": NS}],
            },
        ),
    ):
        try:
            plane.admin.create(path, obj)
        except ApiError as exc:
            if exc.status != 409:
                raise
    return plane.service_account_token(NS, "no-evict")


# -- an older release's document -------------------------------------------------------------------


async def test_an_older_releases_configmap_is_moved_onto_the_nodes_and_deleted_by_the_first_leader(
    plane: ControlPlane, fresh: None
) -> None:
    legacy = f"/api/v1/namespaces/{NS}/configmaps/accel-health-remediator-state"
    doc = {
        "version": 1,
        "pause": {"paused": False, "since": 0, "reason": ""},
        "breaker": {"open": False, "opened_at": 0, "trips": 4},
        "budget": {"gpu-4": {"since": 1_700_000_000.0, "kinds": ["cordon"]}},
        "cordoned": ["gpu-4"],
        "decided": ["0123456789abcdef"],
        "firing": {
            "gpu-4": {
                "AccelGPUFatalXid-gpu-4": {
                    "alertname": "AccelGPUFatalXid",
                    "rule": "c",
                    "holds": ["cordon"],
                    "expires": 1_700_009_999.0,
                    "labels": {"alertname": "AccelGPUFatalXid", "node": "gpu-4"},
                    "startsAt": "2025-11-22T20:00:00.000Z",
                }
            }
        },
    }
    body = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "accel-health-remediator-state"}}
    plane.admin.create(f"/api/v1/namespaces/{NS}/configmaps", {**body, "data": {STATE_KEY: json.dumps(doc)}})
    cluster = cluster_for(plane)
    engine = engine_over(cluster, CORDON)
    try:
        await cluster.cordon("gpu-4")  # as the older release cordoned: its annotation, its field manager
        await engine.start()
        assert not plane.admin.exists(legacy)  # read once, then deleted
        assert set(episodes(plane, "gpu-4")) == {"AccelGPUFatalXid-gpu-4"}
        assert stored_gates(plane)["breaker"]["trips"] == 4
        assert set(engine.budget.holders()) == {"gpu-4"}
        await engine.handle(webhook(alert("gpu-4")))  # a resend after the upgrade: nothing twice
        assert [r.outcome for r in engine.log.records()] == []
        await engine.handle(webhook(alert("gpu-4", status="resolved")))
    finally:
        await cluster.close()
    assert cordoned(plane) == []  # the upgraded service knew the cordon was its own
    assert episodes(plane, "gpu-4") == {}


# -- 8: nobody touched it since ------------------------------------------------------------------


async def test_a_humans_uncordon_and_recordon_is_never_undone(plane: ControlPlane, fresh: None) -> None:
    cluster = cluster_for(plane)
    engine = engine_over(cluster, CORDON)
    try:
        await engine.handle(webhook(alert("gpu-1")))
        assert cordoned(plane) == ["gpu-1"]
        plane.admin.merge_patch("/api/v1/nodes/gpu-1", {"spec": {"unschedulable": None}})  # kubectl uncordon
        plane.admin.merge_patch("/api/v1/nodes/gpu-1", {"spec": {"unschedulable": True}})  # kubectl cordon
        await engine.handle(webhook(alert("gpu-1", status="resolved")))
    finally:
        await cluster.close()
    assert cordoned(plane) == ["gpu-1"]  # the human's cordon stays
    record = engine.log.records()[-1]
    assert (record.action, record.outcome) == ("uncordon", "skipped")
    assert "changed by someone else" in record.reason
    assert "accel-health.io/cordoned-by" not in (
        node_obj(plane, "gpu-1")["metadata"].get("annotations") or {}
    )


class HumanCordonsAfterTheRead(KubernetesCluster):
    """The real executor; a human cordons the node right after the engine read it."""

    plane: ControlPlane

    async def get_node(self, name: str) -> Node | None:
        node = await super().get_node(name)
        self.plane.admin.merge_patch(f"/api/v1/nodes/{name}", {"spec": {"unschedulable": True}})
        return node


async def test_a_cordon_by_someone_else_between_read_and_write_is_not_claimed(
    plane: ControlPlane, fresh: None
) -> None:
    base = cluster_for(plane)
    cluster = HumanCordonsAfterTheRead(api=base.api, settings=base.settings)
    cluster.plane = plane
    engine = engine_over(cluster, CORDON)
    try:
        await engine.handle(webhook(alert("gpu-3")))
        assert outcomes(engine)[-1][1:3] == ("cordon", "skipped")
        assert "not claimed" in engine.log.records()[-1].reason
        assert engine.budget.holders() == {}
        await engine.handle(webhook(alert("gpu-3", status="resolved")))
    finally:
        await cluster.close()
    assert cordoned(plane) == ["gpu-3"]
    assert "accel-health.io/cordoned-by" not in (
        node_obj(plane, "gpu-3")["metadata"].get("annotations") or {}
    )


# -- 7: followers -------------------------------------------------------------------------------


def lease_held_by_someone_else(plane: ControlPlane) -> None:
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    lease: Obj = {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": "accel-health-remediator", "namespace": NS},
        "spec": {
            "holderIdentity": "other-replica",
            "leaseDurationSeconds": 600,
            "acquireTime": now,
            "renewTime": now,
        },
    }
    path = f"/apis/coordination.k8s.io/v1/namespaces/{NS}/leases"
    try:
        plane.admin.create(path, lease)
    except ApiError as exc:
        if exc.status != 409:
            raise
        plane.admin.merge_patch(f"{path}/accel-health-remediator", lease)


@pytest.fixture
async def follower(plane: ControlPlane, fresh: None) -> AsyncIterator[tuple[Engine, leader.LeaderElector]]:
    lease_held_by_someone_else(plane)
    elector: leader.LeaderElector | None = None
    cluster = cluster_for(plane, should_act=lambda: elector is not None and elector.is_leader)
    elector = leader.LeaderElector(
        api=cluster.api,
        settings=leader.LeaderSettings(
            namespace=NS, lease_duration_seconds=3, renew_deadline_seconds=2, retry_period_seconds=1
        ),
    )
    engine = engine_over(cluster, CORDON)
    yield engine, elector
    await cluster.close()


async def test_a_follower_neither_shows_nor_changes_the_gates(
    follower: tuple[Engine, leader.LeaderElector], aiohttp_client: AiohttpClient
) -> None:
    engine, elector = follower
    app = create_app(engine=engine, token=None)
    leader.install(app, elector, replica=engine)
    client = await aiohttp_client(app)
    for _ in range(50):
        if elector.leader_identity is not None:
            break
        await asyncio.sleep(0.1)
    assert not elector.is_leader
    for method, path in (("GET", "/state"), ("GET", "/actions"), ("POST", "/pause"), ("POST", "/resume")):
        response = await client.request(method, path)
        assert response.status == 503, path
        body = await response.json()
        assert body["leader"] == "other-replica"
        assert "not the leader" in body["error"]
    assert not engine.gates.pause.paused  # nothing changed in its memory
    assert (await client.get("/readyz")).status == 503
