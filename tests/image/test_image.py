"""The container image as a cluster runs it: built by scripts/image/build.sh, unpacked with umoci and
started with runc on a read-only root filesystem as the image's own user. The exporter serves the same
exposition from a fixture node as the source tree does, the remediator answers /healthz and records
dry-run decisions against a cluster snapshot, the image carries its OCI labels, uv.lock's versions of
the dependencies and the `checks` extra, ping and iperf3 that work, and none of what was only needed
to build it.

Runs where buildah, skopeo, umoci and runc are installed and the build cache is warm (a rebuild then
takes seconds and reaches no network; `make test` builds it first); skipped otherwise, with the
reason. `make image-test` builds first, cold if need be, and fails instead of skipping
(ACCEL_HEALTH_IMAGE_TEST=require).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import urllib.request
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from examples.pipeline import free_port
from tests.exporter.helpers import GPU_NODE, spawn_exporter, wait_until
from tests.exporter.test_golden import normalise
from tests.image import oci
from tests.image.oci import VERSION, Mount, Spec, Unpacked, tool

REPO = Path(__file__).resolve().parents[2]
REQUIRED = os.environ.get("ACCEL_HEALTH_IMAGE_TEST") == "require"
PAYLOAD = REPO / "examples" / "payloads" / "gpu-fatal-xid.json"
SNAPSHOT = REPO / "examples" / "cluster-snapshot.yaml"
_PROJECT = oci._PROJECT


def _unavailable(reason: str) -> None:
    if REQUIRED:
        pytest.fail(reason)
    pytest.skip(reason)


@pytest.fixture(scope="module")
def image() -> Unpacked:
    reason = oci.problem()
    if reason:
        _unavailable(reason)
    try:
        oci.build()
    except oci.ImageUnavailable as exc:
        _unavailable(str(exc))
    return oci.unpack()


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

    def wait(self, timeout: float = 60) -> str:
        """The container's whole output once it exited with 0."""
        code = self.process.wait(timeout=timeout)
        text = self.log.read_text()
        assert code == 0, text
        return text


@contextmanager
def run(
    image: Unpacked,
    tmp_path: Path,
    args: Sequence[str],
    mounts: dict[str, Path],
    *,
    user: tuple[int, int] | None = None,
    capabilities: Sequence[str] | None = (),
    writable: dict[str, Path] | None = None,
) -> Iterator[Container]:
    """Runs ``args`` in the image as a pod would: the image's user (or ``user``), environment and
    PATH, a read-only root filesystem, ``mounts`` read-only and ``writable`` read-write (an emptyDir),
    no capability (or ``capabilities``); the host's network, so that loopback reaches it."""
    spec = Spec(
        args=args,
        user=user,
        capabilities=capabilities,
        mounts=[
            *(Mount(source, target) for target, source in mounts.items()),
            *(Mount(source, target, read_only=False) for target, source in (writable or {}).items()),
        ],
        no_new_privileges=True,
    )
    bundle = oci.write_bundle(image, spec, tmp_path / "bundle")
    name = f"accel-health-test-{uuid.uuid4().hex[:12]}"
    log = tmp_path / "container.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            oci.run_argv(bundle, name), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
    try:
        yield Container(process=process, log=log)
    finally:
        subprocess.run([tool("runc"), "kill", name, "KILL"], capture_output=True, check=False, timeout=30)
        process.wait(timeout=30)
        oci.delete(name)


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


# -- what the shipped components use ---------------------------------------------------------------


def _locked(extra: str) -> dict[str, str]:
    """name -> version of what uv.lock holds for the project with ``extra`` (what `make image` installs)."""
    exported = subprocess.run(
        [str(REPO / ".venv" / "bin" / "uv"), "export", "--quiet", "--frozen", "--no-emit-project", "--no-dev",
         "--extra", extra, "--no-header", "--no-annotate", "--no-hashes", "--format", "requirements-txt"],
        capture_output=True, text=True, check=True, cwd=REPO, timeout=60,
    ).stdout  # fmt: skip
    found = re.findall(r"^([A-Za-z0-9_.-]+)==([^ ;\\]+)", exported, flags=re.MULTILINE)
    return {re.sub(r"[-_.]+", "-", name).lower(): version for name, version in found}


def test_the_image_holds_the_locked_versions_of_the_dependencies_and_the_checks_extra(
    image: Unpacked,
) -> None:
    site = next(image.rootfs.glob("opt/accel-health/lib/python3*/site-packages"))
    installed = {}
    for dist in site.glob("*.dist-info"):
        name, version = dist.name.removesuffix(".dist-info").split("-", 1)
        installed[re.sub(r"[-_.]+", "-", name).lower()] = version
    assert installed.pop("accel-health") == VERSION
    locked = _locked("checks")
    assert "cuda-bindings" in locked
    assert installed == locked


def test_the_checks_extra_loads_in_the_image_and_asks_for_the_driver_not_the_package(
    image: Unpacked, tmp_path: Path
) -> None:
    """pciebw and gpumem: on a node without a driver the bindings load and only cuInit fails."""
    script = (
        "from exporter.checks.cuda import CudaBindingsDriver, CudaError\n"
        "try:\n    CudaBindingsDriver().devices()\n"
        "except CudaError as exc:\n    print('CudaError:', exc)\n"
    )
    with run(image, tmp_path, ["python3", "-c", script], {}) as container:
        out = container.wait()
    assert "CudaError: cuInit" in out, out
    assert "not installed" not in out


def test_ping_and_iperf3_work_in_the_image_as_the_exporter_runs_them(image: Unpacked, tmp_path: Path) -> None:
    """The exporter's user and capabilities of the shipped overlays (root, privileged: ping's raw
    socket), on loopback: one ping, and one second of iperf3 between two containers of the image.
    iperf3 makes a file in /tmp for each stream ("unable to create a new stream: Read-only file
    system" without one): the active-checks component mounts an emptyDir there."""
    root = (0, 0)
    with run(image, tmp_path / "ping", ["ping", "-c", "1", "-W", "5", "127.0.0.1"], {}, user=root,
             capabilities=("CAP_NET_RAW",)) as ping:  # fmt: skip
        out = ping.wait()
    assert "1 packets transmitted, 1 received" in out, out
    for folder in ("server", "client", "server-tmp", "client-tmp"):
        (tmp_path / folder).mkdir()
    port = free_port()
    server_args = ["iperf3", "-s", "-1", "-p", str(port), "--forceflush"]
    with run(
        image, tmp_path / "server", server_args, {}, user=root, writable={"/tmp": tmp_path / "server-tmp"}
    ) as server:
        assert wait_until(lambda: "Server listening" in server.log.read_text(), timeout=10), (
            server.log.read_text()
        )
        client_args = ["iperf3", "-c", "127.0.0.1", "-p", str(port), "-t", "1", "-J"]
        with run(
            image, tmp_path / "client", client_args, {}, user=root, writable={"/tmp": tmp_path / "client-tmp"}
        ) as client:
            report = json.loads(client.wait())
    assert "error" not in report, report
    assert report["end"]["sum_received"]["bits_per_second"] > 0, report["end"]


def test_every_module_of_the_interpreter_the_image_keeps_loads(image: Unpacked, tmp_path: Path) -> None:
    """The Debian libraries dropped (scripts/image/build.sh, UNUSED_DEBS) took only the extension
    modules that went with them: every one left finds the libraries it links."""
    script = (
        "import importlib, pathlib, sys\n"
        "(dynload,) = [p for p in sys.path if p.endswith('lib-dynload')]\n"
        "for so in sorted(pathlib.Path(dynload).glob('*.so')):\n"
        "    importlib.import_module(so.name.split('.')[0])\n"
        "    print('loaded', so.name.split('.')[0])\n"
        "import ssl, ctypes, sqlite3\n"
    )
    with run(image, tmp_path, ["python3", "-c", script], {}) as container:
        container.process.wait(timeout=60)
    out = container.log.read_text()
    assert "loaded _ssl" in out, out
    assert "loaded _ctypes" in out, out
    # Nothing failed but the last line: sqlite3's extension module is not in the image.
    assert out.rstrip().endswith("ModuleNotFoundError: No module named '_sqlite3'"), out
