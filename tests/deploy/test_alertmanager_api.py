"""The remediator as rendered reads Alertmanager's API v2 (deploy/components/alertmanager-api): every
overlay passes the members of kube-prometheus' Alertmanager, from the one ConfigMap key an overlay of
one's own changes; the receiver filter matches the receiver as the Prometheus Operator and the example
name it; and the rendered NetworkPolicies let through every connection the remediator makes (API
server, each Alertmanager, the exporters' checks, DNS) and nothing it does not need."""

from __future__ import annotations

import os
import re
import urllib.parse
from pathlib import Path
from typing import Any

import pytest
import yaml

from remediator.cli import _serve_parser as remediator_parser
from remediator.cli import alertmanager_urls
from tests.deploy.kube import DEPLOY, OVERLAYS, REPO, expanded_args, find, kubectl_problem, render
from tests.deploy.netpol import Outside, Pod, allowed

pytestmark = pytest.mark.skipif(kubectl_problem() is not None, reason=str(kubectl_problem()))

NAMESPACE = "accel-health"
CONFIGMAP = "accel-health-remediator-alertmanager"
KUBE_PROMETHEUS_MEMBERS = tuple(
    f"http://alertmanager-main-{i}.alertmanager-operated.monitoring.svc:9093" for i in range(3)
)
"""kube-prometheus: Alertmanager `main` in `monitoring`, 3 replicas, each named under the governing
headless Service `alertmanager-operated` the Operator creates for its StatefulSet."""

# Pods as kube-prometheus and the Operator label them (manifests/alertmanager-alertmanager.yaml's
# podMetadata, plus what the Operator adds), and ours as rendered.
ALERTMANAGER = Pod(
    "monitoring",
    {
        "app.kubernetes.io/name": "alertmanager",
        "app.kubernetes.io/instance": "main",
        "app.kubernetes.io/component": "alert-router",
        "app.kubernetes.io/part-of": "kube-prometheus",
        "app.kubernetes.io/managed-by": "prometheus-operator",
        "alertmanager": "main",
    },
    {"web": 9093, "mesh-tcp": 9094},
)
PROMETHEUS = Pod("monitoring", {"app.kubernetes.io/name": "prometheus", "prometheus": "k8s"})
GRAFANA = Pod("monitoring", {"app.kubernetes.io/name": "grafana"})
REMEDIATOR = Pod(NAMESPACE, {"app.kubernetes.io/name": "accel-health-remediator"}, {"http": 9836})
EXPORTER = Pod(NAMESPACE, {"app.kubernetes.io/name": "accel-health-exporter"}, {"metrics": 9835})
TRAINER = Pod("training", {"app": "trainer"})
API_SERVER = Outside("172.20.0.1")

KUBE_PROMETHEUS_ALERTMANAGER_POLICY: dict[str, Any] = {
    # kube-prometheus' manifests/alertmanager-networkPolicy.yaml (v0.13), as shipped.
    "apiVersion": "networking.k8s.io/v1",
    "kind": "NetworkPolicy",
    "metadata": {"name": "alertmanager-main", "namespace": "monitoring"},
    "spec": {
        "egress": [{}],
        "ingress": [
            {
                "from": [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}],
                "ports": [{"port": 9093, "protocol": "TCP"}, {"port": 8080, "protocol": "TCP"}],
            },
            {
                "from": [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "alertmanager"}}}],
                "ports": [{"port": 9094, "protocol": "TCP"}, {"port": 9094, "protocol": "UDP"}],
            },
        ],
        "podSelector": {
            "matchLabels": {
                "app.kubernetes.io/component": "alert-router",
                "app.kubernetes.io/instance": "main",
                "app.kubernetes.io/name": "alertmanager",
                "app.kubernetes.io/part-of": "kube-prometheus",
            }
        },
        "policyTypes": ["Egress", "Ingress"],
    },
}


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {overlay: render(DEPLOY / "overlays" / overlay) for overlay in OVERLAYS}


def _container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    deployment = find(objects, "Deployment", "accel-health-remediator")
    container: dict[str, Any] = deployment["spec"]["template"]["spec"]["containers"][0]
    return container


def _relative(target: Path, overlay: Path) -> str:
    """kustomize takes no absolute path: `target` as seen from the overlay's folder."""
    return os.path.relpath(target.resolve(), overlay)


def _settings(objects: list[dict[str, Any]]) -> tuple[tuple[str, ...], str]:
    args = remediator_parser().parse_args(expanded_args(objects, _container(objects)))
    return alertmanager_urls(args.alertmanager_url), str(args.alertmanager_receiver)


def test_every_overlay_reads_each_member_of_kube_prometheus_alertmanager(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    for overlay, objects in rendered.items():
        urls, receiver = _settings(objects)
        assert urls == KUBE_PROMETHEUS_MEMBERS, overlay
        assert receiver, overlay


def test_the_urls_come_from_one_configmap_key_and_nowhere_else(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    for overlay, objects in rendered.items():
        container = _container(objects)
        flags = [a for a in container["args"] if a.startswith("--alertmanager-url")]
        assert flags == ["--alertmanager-url=$(ALERTMANAGER_URLS)"], overlay
        (ref,) = [
            e["valueFrom"]["configMapKeyRef"] for e in container["env"] if e["name"] == "ALERTMANAGER_URLS"
        ]
        # A generated name (hash suffix): a changed URL rolls the Deployment.
        assert re.fullmatch(rf"{CONFIGMAP}-[a-z0-9]{{10}}", ref["name"]), ref
        configmap = find(objects, "ConfigMap", ref["name"])
        assert configmap["metadata"]["namespace"] == NAMESPACE
        texts = [yaml.safe_dump(o) for o in objects if o is not configmap]
        assert not any("alertmanager-operated" in t for t in texts), overlay


def test_an_overlay_of_ones_own_points_the_remediator_at_another_alertmanager_in_one_place(
    tmp_path: Path,
) -> None:
    """docs/install.md, "Which Alertmanager the remediator reads": kube-prometheus-stack's, by overlay."""
    mine = tmp_path / "mine"
    mine.mkdir()
    stack = (
        "http://alertmanager-kube-prometheus-stack-alertmanager-0.alertmanager-operated.monitoring.svc:9093"
    )
    (mine / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "resources": [_relative(DEPLOY / "overlays" / "enforce", mine)],
                "configMapGenerator": [
                    {
                        "name": CONFIGMAP,
                        "namespace": NAMESPACE,
                        "behavior": "merge",
                        "literals": [f"urls={stack}"],
                    }
                ],
            }
        )
    )
    objects = render(mine)
    assert _settings(objects)[0] == (stack,)
    assert (
        len([o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith(CONFIGMAP)])
        == 1
    )


def test_without_the_component_the_remediator_runs_on_the_webhook_alone(tmp_path: Path) -> None:
    """The documented fallback: an overlay without components/alertmanager-api passes no URL and
    opens no port to Alertmanager."""
    mine = tmp_path / "webhook-only"
    mine.mkdir()
    enforce = yaml.safe_load((DEPLOY / "overlays" / "enforce" / "kustomization.yaml").read_text())
    components = [_relative(DEPLOY / "overlays" / "enforce" / c, mine) for c in enforce["components"]]
    kept = [c for c in components if not c.endswith("alertmanager-api")]
    assert len(kept) == len(components) - 1
    (mine / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "resources": [_relative(DEPLOY / "base", mine)],
                "components": kept,
            }
        )
    )
    objects = render(mine)
    assert not any(a.startswith("--alertmanager") for a in _container(objects)["args"])
    assert not allowed(objects, REMEDIATOR, ALERTMANAGER, 9093)
    assert allowed(objects, ALERTMANAGER, REMEDIATOR, 9836)  # the webhook still arrives


def _operator_receiver_name(objects: list[dict[str, Any]]) -> str:
    """The name the Prometheus Operator gives the AlertmanagerConfig's receiver in the configuration
    it generates: <namespace>/<object name>/<receiver> (pkg/alertmanager/amcfg.go, makeNamespacedString)."""
    crd = find(objects, "AlertmanagerConfig", "accel-health-remediator")
    receiver = crd["spec"]["route"]["receiver"]
    return f"{crd['metadata']['namespace']}/{crd['metadata']['name']}/{receiver}"


def test_the_receiver_filter_matches_the_remediators_receiver_as_the_operator_and_the_example_name_it(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    example = yaml.safe_load((REPO / "examples" / "alertmanager.yaml").read_text())
    webhook_receivers = {r["name"] for r in example["receivers"] if r.get("webhook_configs")}
    others = {r["name"] for r in example["receivers"]} - webhook_receivers
    for overlay, objects in rendered.items():
        _, receiver = _settings(objects)
        # Alertmanager anchors the regex: ^(?:REGEX)$ (api/v2/api.go, getAlertsHandler).
        anchored = re.compile(f"^(?:{receiver})$")
        names = {_operator_receiver_name(objects), *webhook_receivers}
        assert all(anchored.match(n) for n in names), (overlay, receiver, names)
        assert not any(anchored.match(n) for n in others), (overlay, receiver, others)


def test_the_rendered_network_policies_let_through_every_connection_of_the_remediator(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    for overlay, objects in rendered.items():
        # Each Alertmanager the args name, on the port its URL names.
        for url in _settings(objects)[0]:
            port = urllib.parse.urlsplit(url).port
            assert port is not None
            assert allowed(objects, REMEDIATOR, ALERTMANAGER, port), (overlay, url)
        assert allowed(objects, REMEDIATOR, API_SERVER, 443), overlay
        assert allowed(objects, REMEDIATOR, API_SERVER, 6443), overlay
        assert allowed(objects, REMEDIATOR, Outside("10.96.0.10"), 53, "UDP"), overlay
        assert allowed(objects, REMEDIATOR, EXPORTER, 9835), overlay  # a repaired node's checks
        # And those that reach the remediator: webhooks and scrapes.
        assert allowed(objects, ALERTMANAGER, REMEDIATOR, 9836), overlay
        assert allowed(objects, PROMETHEUS, REMEDIATOR, 9836), overlay


def test_the_remediator_may_reach_nothing_else_of_the_monitoring_stack_or_the_workloads(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    for overlay, objects in rendered.items():
        assert not allowed(objects, REMEDIATOR, ALERTMANAGER, 9094), overlay  # the members' gossip
        assert not allowed(objects, REMEDIATOR, GRAFANA, 9093), overlay
        assert not allowed(objects, REMEDIATOR, PROMETHEUS, 9090), overlay
        assert not allowed(objects, REMEDIATOR, TRAINER, 9093), overlay
        assert not allowed(objects, REMEDIATOR, Outside("10.0.0.5"), 9093), overlay
        assert not allowed(objects, GRAFANA, REMEDIATOR, 9836), overlay


def test_kube_prometheus_alertmanager_policy_needs_the_shipped_addition_and_keeps_its_own_peers(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    """kube-prometheus guards Alertmanager with a NetworkPolicy that admits only Prometheus on 9093;
    deploy/prometheus/alertmanager-network-policy.yaml, applied in its namespace, admits the
    remediator beside it."""
    objects = [*rendered["enforce"], KUBE_PROMETHEUS_ALERTMANAGER_POLICY]
    assert not allowed(objects, REMEDIATOR, ALERTMANAGER, 9093)
    addition = yaml.safe_load((DEPLOY / "prometheus" / "alertmanager-network-policy.yaml").read_text())
    addition["metadata"]["namespace"] = "monitoring"  # `kubectl -n monitoring apply -f`
    both = [*objects, addition]
    assert allowed(both, REMEDIATOR, ALERTMANAGER, 9093)
    assert not allowed(both, REMEDIATOR, ALERTMANAGER, 9094)
    assert allowed(both, PROMETHEUS, ALERTMANAGER, 9093)
    assert allowed(both, ALERTMANAGER, ALERTMANAGER, 9094)
    assert allowed(both, ALERTMANAGER, REMEDIATOR, 9836)
    assert not allowed(
        both, Pod("other", {"app.kubernetes.io/name": "accel-health-remediator"}), ALERTMANAGER, 9093
    )
