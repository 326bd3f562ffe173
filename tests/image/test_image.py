"""The container image as a cluster runs it: built by scripts/image/build.sh, unpacked with umoci and
started with runc on a read-only root filesystem as the image's own user. The exporter serves the same
exposition from a fixture node as the source tree does, the remediator answers /healthz and records
dry-run decisions against a cluster snapshot, and the image carries its OCI labels and none of what was
only needed to build it.

Runs where buildah, skopeo, umoci and runc are installed and the build cache is warm (a rebuild then
takes seconds and reaches no network); skipped otherwise, with the reason. `make image-test` builds
first, cold if need be, and fails instead of skipping (ACCEL_HEALTH_IMAGE_TEST=require).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tomllib
import urllib.request
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from examples.pipeline import free_port
from tests.exporter.helpers import GPU_NODE, spawn_exporter, wait_until
from tests.exporter.test_golden import normalise

REPO = Path(__file__).resolve().parents[2]
BUILD = REPO / "scripts" / "image" / "build.sh"
TOOLS = ("buildah", "skopeo", "umoci", "runc", "git", "bash")
REQUIRED = os.environ.get("ACCEL_HEALTH_IMAGE_TEST") == "require"
PAYLOAD = REPO / "examples" / "payloads" / "gpu-fatal-xid.json"
SNAPSHOT = REPO / "examples" / "cluster-snapshot.yaml"

_PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
VERSION: str = _PROJECT["project"]["version"]
IMAGE = f"{_PROJECT['tool']['accel-health']['image']['name']}:{VERSION}"


def tool(name: str) -> str:
    """The full path of ``name``, which the ``image`` fixture checked is installed."""
    return shutil.which(name) or name


def _unavailable(reason: str) -> None:
    if REQUIRED:
        pytest.fail(reason)
    pytest.skip(reason)


@dataclass(frozen=True)
class Unpacked:
    """The built image, unpacked: its OCI config and its root filesystem."""

    config: dict[str, Any]
    rootfs: Path


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Unpacked:
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        _unavailable(f"{', '.join(missing)} not installed (make image-tools)")
    if os.geteuid() != 0:
        _unavailable("runc runs the image as root here (rootless runc needs umoci unpack --rootless)")
    built = subprocess.run(
        [tool("bash"), str(BUILD), "--if-warm"], capture_output=True, text=True, check=False, timeout=600
    )
    if built.returncode == 3:
        _unavailable(built.stderr.strip().removeprefix("image: "))
    assert built.returncode == 0, built.stderr
    work = tmp_path_factory.mktemp("image")
    layout = f"oci:{work / 'oci'}:{VERSION}"
    subprocess.run(
        [tool("skopeo"), "copy", "--quiet", f"containers-storage:{IMAGE}", layout],
        check=True,
        capture_output=True,
        timeout=120,
    )
    subprocess.run(
        [tool("umoci"), "unpack", "--image", str(work / "oci") + f":{VERSION}", str(work / "bundle")],
        check=True,
        capture_output=True,
        timeout=120,
    )
    inspected = subprocess.run(
        [tool("skopeo"), "inspect", "--config", layout], check=True, capture_output=True, timeout=60
    )
    return Unpacked(config=json.loads(inspected.stdout), rootfs=work / "bundle" / "rootfs")


@dataclass(frozen=True)
class Container:
    """A process of the image, started by runc; its output goes to ``log``."""

    process: subprocess.Popen[bytes]
    log: Path

    def listening(self, marker: str = "listening on 127.0.0.1:") -> str | None:
        text = self.log.read_text()
        at = text.find(marker)
        if at < 0:
            return None
        port = text[at + len(marker) :].split(maxsplit=1)[0]
        return f"http://127.0.0.1:{port}"


@contextmanager
def run(image: Unpacked, tmp_path: Path, args: Sequence[str], mounts: dict[str, Path]) -> Iterator[Container]:
    """Runs ``args`` in the image as a pod would: the image's user, environment and PATH, a read-only
    root filesystem, ``mounts`` read-only; the host's network, so that loopback reaches it."""
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    config = json.loads((image.rootfs.parent / "config.json").read_text())
    config["root"] = {"path": str(image.rootfs), "readonly": True}
    config["process"]["args"] = list(args)
    config["process"]["terminal"] = False
    config["linux"]["namespaces"] = [n for n in config["linux"]["namespaces"] if n["type"] != "network"]
    for target, source in mounts.items():
        config["mounts"].append(
            {"destination": target, "type": "bind", "source": str(source), "options": ["rbind", "ro"]}
        )
    (bundle / "config.json").write_text(json.dumps(config))
    name = f"accel-health-test-{uuid.uuid4().hex[:12]}"
    log = tmp_path / "container.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [tool("runc"), "run", "--bundle", str(bundle), name],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    try:
        yield Container(process=process, log=log)
    finally:
        subprocess.run([tool("runc"), "kill", name, "KILL"], capture_output=True, check=False, timeout=30)
        process.wait(timeout=30)
        subprocess.run([tool("runc"), "delete", "-f", name], capture_output=True, check=False, timeout=30)


def _get(url: str, body: bytes | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(  # noqa: S310 -- loopback URL
        url, data=body, headers={"Content-Type": "application/json"} if body else {}
    )
    with urllib.request.urlopen(request, timeout=10) as response:  # noqa: S310 -- loopback URL
        status: int = response.status
        data: bytes = response.read()
        return status, data


# -- what is in the image ---------------------------------------------------------------------------


def test_the_image_runs_as_a_non_root_user_and_carries_its_oci_labels(image: Unpacked) -> None:
    config = image.config["config"]
    assert config["User"] == "65532:65532"
    labels = config["Labels"]
    revision = subprocess.run(
        [tool("git"), "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.strip()
    assert labels["org.opencontainers.image.version"] == VERSION
    assert labels["org.opencontainers.image.revision"].removesuffix("-dirty") == revision
    assert labels["org.opencontainers.image.licenses"] == _PROJECT["project"]["license"]
    assert labels["org.opencontainers.image.source"] == _PROJECT["project"]["urls"]["Source"]
    path = dict(e.split("=", 1) for e in config["Env"])["PATH"].split(":")
    for script in ("accel-health-exporter", "accel-health-remediator"):
        assert any((image.rootfs / p.lstrip("/") / script).is_file() for p in path), script
    passwd = (image.rootfs / "etc" / "passwd").read_text()
    assert ":65532:65532:" in passwd


def test_the_image_holds_no_compiler_pip_package_cache_or_docs(image: Unpacked) -> None:
    root = image.rootfs
    names = {p.name for p in root.rglob("*")}
    assert not names & {"gcc", "cc", "c++", "ld", "pip", "pip3", "ensurepip", "__pip-runner__.py"}
    assert not list(root.glob("opt/accel-health/lib/python3*/site-packages/pip*"))
    assert not list(root.glob("var/cache/apt/archives/*.deb"))
    assert not [p for p in root.glob("var/lib/apt/lists/*") if p.name not in {"lock", "partial"}]
    assert not [p for p in (root / "usr" / "share" / "man").rglob("*") if p.is_file()]
    docs = [p for p in (root / "usr" / "share" / "doc").rglob("*") if p.is_file()]
    assert docs
    assert {p.name for p in docs} == {"copyright"}
    # The Debian packages stay visible to image scanners.
    assert (root / "var" / "lib" / "dpkg" / "status.d" / "python3").is_file()


# -- what it does -----------------------------------------------------------------------------------


def test_the_exporter_in_the_image_serves_the_fixture_node_as_the_source_tree_does(
    image: Unpacked, tmp_path: Path
) -> None:
    (tmp_path / "host").mkdir()
    (tmp_path / "image").mkdir()
    host = spawn_exporter(
        kmsg=GPU_NODE / "kmsg", sysfs_root=GPU_NODE / "sys", log=tmp_path / "host.log", flags=("--nvml=off",)
    )
    try:
        expected = normalise(host.scrape())
    finally:
        host.process.terminate()
        host.process.wait(timeout=10)
    args = [
        "accel-health-exporter",
        "--listen=127.0.0.1:0",
        "--kmsg=/node/kmsg",
        "--sysfs-root=/node/sys",
        "--nvml=off",
    ]
    with run(image, tmp_path / "image", args, {"/node": GPU_NODE}) as container:
        assert wait_until(lambda: container.listening() is not None, timeout=10), container.log.read_text()
        url = container.listening()
        assert url is not None
        status, body = _get(url + "/metrics")
    assert status == 200
    assert normalise(body.decode()) == expected
    assert "Traceback" not in container.log.read_text()


def test_the_remediator_in_the_image_answers_healthz_and_records_dry_run_decisions(
    image: Unpacked, tmp_path: Path
) -> None:
    port = free_port()
    args = [
        "accel-health-remediator",
        f"--listen=127.0.0.1:{port}",
        "--dry-run",
        "--insecure-no-auth",
        "--cluster-snapshot=/snapshot/cluster-snapshot.yaml",
        # Builds the Auto Scaling and CloudWatch clients: the service models the image keeps load.
        "--aws",
        "--aws-region=us-east-1",
        "--aws-endpoint-url=http://127.0.0.1:9",
    ]
    with run(image, tmp_path, args, {"/snapshot": SNAPSHOT.parent}) as container:

        def healthy() -> bool:
            try:
                return _get(f"http://127.0.0.1:{port}/healthz")[0] == 200
            except OSError:
                return False

        assert wait_until(healthy, timeout=30, interval=0.1), container.log.read_text()
        status, _ = _get(f"http://127.0.0.1:{port}/alerts", PAYLOAD.read_bytes())
        assert status == 200
        _, body = _get(f"http://127.0.0.1:{port}/actions")
    decisions = json.loads(body)
    assert decisions, container.log.read_text()
    assert {d["node"] for d in decisions} == {"gpu-node-1"}
    assert all(d["dry_run"] for d in decisions)
    assert "Traceback" not in container.log.read_text()
