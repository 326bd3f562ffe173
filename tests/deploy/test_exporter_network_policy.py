"""The exporter's rendered NetworkPolicy admits exactly what the shipped exporter does: with the active
checks (every overlay), the API server for its pod lists, `ping` (ICMP) and `iperf` (TCP 5201)
to and from the other exporter pods, and its own port 9835 for Prometheus, the remediator's repair
checks and `accel-health check`; nothing else, in either direction. Without the component, it calls
nothing at all."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from exporter.checks.network import IPERF_PORT
from tests.deploy.kube import DEPLOY, OVERLAYS, kubectl_problem, render
from tests.deploy.netpol import Outside, Pod, allowed

pytestmark = pytest.mark.skipif(kubectl_problem() is not None, reason=str(kubectl_problem()))

NAMESPACE = "accel-health"
EXPORTER = Pod(NAMESPACE, {"app.kubernetes.io/name": "accel-health-exporter"}, {"metrics": 9835})
PEER = Pod(
    NAMESPACE,
    {"app.kubernetes.io/name": "accel-health-exporter", "app.kubernetes.io/component": "exporter"},
    {"metrics": 9835},
)
REMEDIATOR = Pod(NAMESPACE, {"app.kubernetes.io/name": "accel-health-remediator"}, {"http": 9836})
PROMETHEUS = Pod("monitoring", {"app.kubernetes.io/name": "prometheus"})
CHECK_CLI = Pod("ops", {"app.kubernetes.io/name": "accel-health-check"})
TRAINER = Pod("training", {"app": "trainer"})
IMPOSTOR = Pod("training", {"app.kubernetes.io/name": "accel-health-exporter"})
"""A pod of another namespace wearing the exporter's label: not a peer."""
API_SERVER = Outside("172.20.0.1")


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {overlay: render(DEPLOY / "overlays" / overlay) for overlay in OVERLAYS}


def test_every_overlay_lets_the_exporters_ping_and_iperf_one_another(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    for overlay, objects in rendered.items():
        assert allowed(objects, EXPORTER, PEER, 0, "ICMP"), overlay
        assert allowed(objects, PEER, EXPORTER, 0, "ICMP"), overlay
        assert allowed(objects, EXPORTER, PEER, IPERF_PORT), overlay
        assert allowed(objects, PEER, EXPORTER, IPERF_PORT), overlay


def test_every_overlay_lets_the_exporter_list_pods_and_be_scraped_and_checked(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    for overlay, objects in rendered.items():
        assert allowed(objects, EXPORTER, API_SERVER, 443), overlay
        assert allowed(objects, EXPORTER, API_SERVER, 6443), overlay
        assert allowed(objects, PROMETHEUS, EXPORTER, 9835), overlay
        assert allowed(objects, REMEDIATOR, EXPORTER, 9835), overlay
        assert allowed(objects, CHECK_CLI, EXPORTER, 9835), overlay


def test_the_exporter_reaches_nothing_else_and_nothing_else_reaches_it(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    for overlay, objects in rendered.items():
        for port, protocol in ((0, "ICMP"), (IPERF_PORT, "TCP"), (9836, "TCP"), (53, "UDP")):
            assert not allowed(objects, EXPORTER, TRAINER, port, protocol), (overlay, port)
            assert not allowed(objects, EXPORTER, REMEDIATOR, port, protocol), (overlay, port)
            assert not allowed(objects, EXPORTER, IMPOSTOR, port, protocol), (overlay, port)
        for port in (80, IPERF_PORT, 9093):
            assert not allowed(objects, EXPORTER, Outside("10.0.0.5"), port), (overlay, port)
        for source in (TRAINER, IMPOSTOR, PROMETHEUS, CHECK_CLI):
            assert not allowed(objects, source, EXPORTER, IPERF_PORT), (overlay, source)
            assert not allowed(objects, source, EXPORTER, 0, "ICMP"), (overlay, source)
        assert not allowed(objects, TRAINER, EXPORTER, 9835), overlay


def test_without_the_active_checks_the_exporter_calls_nothing(tmp_path: Path) -> None:
    mine = tmp_path / "no-checks"
    mine.mkdir()
    (mine / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                # kustomize takes no absolute path.
                "resources": [os.path.relpath(DEPLOY / "base", mine)],
            }
        )
    )
    objects = render(mine)
    assert not allowed(objects, EXPORTER, PEER, 0, "ICMP")
    assert not allowed(objects, EXPORTER, PEER, IPERF_PORT)
    assert not allowed(objects, EXPORTER, API_SERVER, 443)
    assert allowed(objects, PROMETHEUS, EXPORTER, 9835)
