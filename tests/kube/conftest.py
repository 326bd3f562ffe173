"""Fixtures of the real control plane. Each test module that needs one starts its own (about 10 s),
so a module's scenarios share a cluster and modules never see each other's objects."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.kube import podnet
from tests.kube.controlplane import ControlPlane, ControlPlaneUnavailable, control_plane, find_binaries
from tests.kube.deployed import image_skip_reason


def control_plane_skip_reason() -> str | None:
    try:
        find_binaries()
    except ControlPlaneUnavailable as exc:
        return str(exc)
    return None


def deployed_skip_reason() -> str | None:
    reason = control_plane_skip_reason() or podnet.available()
    if reason:
        return reason
    for tool in ("kubectl", "prometheus", "prometheus-alertmanager"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (make test installs it)"
    return image_skip_reason()


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="accel-health-kube-"))
    yield path
    # ACCEL_HEALTH_KEEP_KUBE_LOGS=1 keeps every process's log and the audit log for a look afterwards.
    if not os.environ.get("ACCEL_HEALTH_KEEP_KUBE_LOGS"):
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def plane(workdir: Path) -> Iterator[ControlPlane]:
    reason = control_plane_skip_reason()
    if reason:
        pytest.skip(reason)
    with control_plane(workdir / "control-plane") as started:
        yield started
