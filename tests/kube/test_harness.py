"""The test control plane itself: RBAC is enforced, the controllers run (ReplicaSet, disruption,
endpoints, service-account tokens), and the kubelet stand-in schedules, runs and finalizes pods the
way the scenarios rely on. If these fail, the "as deployed" scenarios would prove nothing."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes.aio import client as k8s

from tests.kube.controlplane import ControlPlane, apply_objects, deployment, wait_for
from tests.kube.kubelet import FakeKubelet, KubeletSettings, fits
from tests.kube.network import skew_proxy
from tests.kube.rest import ApiError, Obj, Rest

NS = "harness"


@pytest.fixture(scope="module")
def kubelet(plane: ControlPlane, workdir: Path) -> Iterator[FakeKubelet]:
    fake = FakeKubelet(plane=plane, workdir=workdir, settings=KubeletSettings(start_delay=0.5))
    for name in ("node-a", "node-b"):
        fake.add_node(name, labels={"pool": "gpu"})
    fake.add_node("node-cpu", labels={"pool": "cpu"})
    apply_objects(plane.admin, [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}}])
    fake.start()
    yield fake
    fake.stop()


def trainers(name: str, *, replicas: int, pool: str = "gpu") -> Obj:
    return deployment(name, NS, node_selector={"pool": pool}, replicas=replicas)


def pods_of(plane: ControlPlane, app: str) -> list[Obj]:
    return plane.admin.items(f"/api/v1/namespaces/{NS}/pods", labelSelector=f"app={app}")


def ready(pod: Obj) -> bool:
    return any(
        c["type"] == "Ready" and c["status"] == "True"
        for c in (pod.get("status") or {}).get("conditions", [])
    )


def test_a_service_account_without_grants_is_forbidden(plane: ControlPlane) -> None:
    rest = plane.as_service_account("default", "default")
    with pytest.raises(ApiError) as err:
        rest.get("/api/v1/nodes")
    assert err.value.status == 403
    assert plane.admin.get("/api/v1/nodes")["kind"] == "NodeList"


def test_deployment_pods_are_scheduled_where_they_fit_and_become_ready(
    plane: ControlPlane, kubelet: FakeKubelet
) -> None:
    apply_objects(plane.admin, [trainers("spread", replicas=4)])
    wait_for("4 ready pods", lambda: sum(ready(p) for p in pods_of(plane, "spread")) == 4, timeout=30)
    nodes = sorted(p["spec"]["nodeName"] for p in pods_of(plane, "spread"))
    assert nodes == ["node-a", "node-a", "node-b", "node-b"]  # gpu pool only, least loaded first
    assert all(p["status"]["podIP"] for p in pods_of(plane, "spread"))


def test_a_cordoned_node_gets_no_new_pods_and_deleted_pods_are_finalized(
    plane: ControlPlane, kubelet: FakeKubelet
) -> None:
    apply_objects(plane.admin, [trainers("moves", replicas=1)])
    wait_for("a ready pod", lambda: any(ready(p) for p in pods_of(plane, "moves")), timeout=30)
    first = pods_of(plane, "moves")[0]
    node = first["spec"]["nodeName"]
    plane.admin.merge_patch(f"/api/v1/nodes/{node}", {"spec": {"unschedulable": True}})
    try:
        plane.admin.delete(f"/api/v1/namespaces/{NS}/pods/{first['metadata']['name']}")
        wait_for(
            "the replacement on the other node",
            lambda: (
                [p["spec"].get("nodeName") for p in pods_of(plane, "moves") if ready(p)]
                == ["node-b" if node == "node-a" else "node-a"]
            ),
            timeout=30,
        )
        assert not plane.admin.exists(f"/api/v1/namespaces/{NS}/pods/{first['metadata']['name']}")
    finally:
        plane.admin.merge_patch(f"/api/v1/nodes/{node}", {"spec": {"unschedulable": None}})


def test_the_disruption_controller_enforces_a_pdb_on_evictions(
    plane: ControlPlane, kubelet: FakeKubelet
) -> None:
    apply_objects(
        plane.admin,
        [
            trainers("guarded", replicas=2),
            {
                "apiVersion": "policy/v1beta1",
                "kind": "PodDisruptionBudget",
                "metadata": {"name": "guarded", "namespace": NS},
                "spec": {"minAvailable": 2, "selector": {"matchLabels": {"app": "guarded"}}},
            },
        ],
    )
    wait_for("2 ready pods", lambda: sum(ready(p) for p in pods_of(plane, "guarded")) == 2, timeout=30)
    pdb_path = f"/apis/policy/v1beta1/namespaces/{NS}/poddisruptionbudgets/guarded"
    wait_for(
        "the PDB's status",
        lambda: plane.admin.get(pdb_path).get("status", {}).get("currentHealthy") == 2,
        timeout=30,
    )
    victim = pods_of(plane, "guarded")[0]["metadata"]["name"]
    eviction = {
        "apiVersion": "policy/v1beta1",
        "kind": "Eviction",
        "metadata": {"name": victim, "namespace": NS},
    }
    with pytest.raises(ApiError) as err:
        plane.admin.create(f"/api/v1/namespaces/{NS}/pods/{victim}/eviction", eviction)
    assert err.value.status == 429  # TooManyRequests: the budget allows no disruption


def test_the_skew_proxy_serves_policy_v1_on_the_old_server_with_the_callers_identity(
    plane: ControlPlane, kubelet: FakeKubelet
) -> None:
    with skew_proxy(plane) as url:
        admin = Rest(server=url, token=plane.admin_token, ca_file=plane.pki.ca_cert)
        listed = admin.get(f"/apis/policy/v1/namespaces/{NS}/poddisruptionbudgets")
        assert listed["apiVersion"] == "policy/v1"
        assert [i["metadata"]["name"] for i in listed["items"]] == ["guarded"]
        nobody = Rest(
            server=url,
            token=plane.service_account_token("default", "default"),
            ca_file=plane.pki.ca_cert,
        )
        with pytest.raises(ApiError) as err:
            nobody.get(f"/apis/policy/v1/namespaces/{NS}/poddisruptionbudgets")
        assert err.value.status == 403


async def test_the_skew_proxy_passes_an_answer_the_api_server_compresses_readable(
    plane: ControlPlane,
) -> None:
    """The API server gzips an answer over 128 KB for a client that accepts it (the remediator's,
    aiohttp, does); the proxy passes the bytes on without Content-Encoding, so it must ask for them
    plain. A LIST of 107 nodes through it was unreadable to the remediator's client (its node cache
    never synced)."""
    blobs = [
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": f"big-{i}", "namespace": NS},
            "data": {"blob": "x" * 60_000},
        }
        for i in range(3)
    ]
    apply_objects(plane.admin, [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}}, *blobs])
    try:
        with skew_proxy(plane) as url:
            api = plane.api_client(server=url)
            try:
                listed = await k8s.CoreV1Api(api).list_namespaced_config_map(NS)
            finally:
                await api.close()  # type: ignore[no-untyped-call]  # untyped upstream
        assert {f"big-{i}" for i in range(3)} <= {c.metadata.name for c in listed.items if c.metadata}
    finally:
        for i in range(3):
            plane.admin.delete(f"/api/v1/namespaces/{NS}/configmaps/big-{i}")


def test_the_scheduler_predicates_follow_taints_selectors_and_affinity() -> None:
    node = {
        "metadata": {"name": "n1", "labels": {"gpu": "yes"}},
        "spec": {"taints": [{"key": "nvidia.com/gpu", "effect": "NoSchedule"}]},
    }
    plain: Obj = {"spec": {"containers": []}}
    tolerant: Obj = {"spec": {"tolerations": [{"operator": "Exists"}]}}
    pinned: Obj = {
        "spec": {
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}],
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [
                            {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n2"]}]}
                        ]
                    }
                }
            },
        }
    }
    assert not fits(plain, node)
    assert fits(tolerant, node)
    assert not fits(pinned, node)
    cordoned = {"metadata": node["metadata"], "spec": {"unschedulable": True}}
    assert not fits({"spec": {}}, cordoned)
    assert fits(tolerant, cordoned)
