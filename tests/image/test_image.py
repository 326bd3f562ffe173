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
import shutil
import stat
import struct
import subprocess
import urllib.request
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from examples.pipeline import free_port
from exporter.privileges import Capability
from tests.exporter.helpers import GPU_NODE, spawn_exporter, wait_until
from tests.exporter.test_golden import normalise
from tests.image import oci
from tests.image.oci import VERSION, Mount, Spec, Unpacked, tool
from tests.kube.kubelet import write_kmsg
from tests.kube.podnet import set_sysctl

REPO = Path(__file__).resolve().parents[2]
REQUIRED = os.environ.get("ACCEL_HEALTH_IMAGE_TEST") == "require"
PAYLOAD = REPO / "examples" / "payloads" / "gpu-fatal-xid.json"
SNAPSHOT = REPO / "examples" / "cluster-snapshot.yaml"
_PROJECT = oci._PROJECT
CAP_CHOWN, CAP_SYSLOG = Capability.CHOWN, Capability.SYSLOG
XID_79 = "NVRM: Xid (PCI:0000:9d:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."


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
    """A process of the image, started by runc as ``name``; its output goes to ``log``."""

    process: subprocess.Popen[bytes]
    log: Path
    name: str

    def status(self) -> dict[str, str]:
        """/proc/PID/status of the container's process, as the host sees it."""
        state = subprocess.run(
            [tool("runc"), "state", self.name], capture_output=True, text=True, check=True, timeout=30
        )
        return oci.process_status(json.loads(state.stdout)["pid"])

    def listening(self, marker: str = "listening on 127.0.0.1:") -> str | None:
        text = self.log.read_text()
        at = text.find(marker)
        if at < 0:
            return None
        port = text[at + len(marker) :].split(maxsplit=1)[0]
        return f"http://127.0.0.1:{port}"

    def url(self, timeout: float = 10) -> str:
        """The URL of the exporter or remediator in the container, once it listens."""
        assert wait_until(lambda: self.listening() is not None, timeout=timeout), self.log.read_text()
        url = self.listening()
        assert url is not None
        return url

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
    privileged: bool = False,
    escalation: bool = False,
    network_namespace: Path | None = None,
) -> Iterator[Container]:
    """Runs ``args`` in the image as a pod would: the image's user (or ``user``), environment and
    PATH, a read-only root filesystem, ``mounts`` read-only and ``writable`` read-write (an emptyDir),
    no capability (or ``capabilities``, or every one with ``privileged``), privilege escalation
    allowed only with ``escalation`` or ``privileged``; the host's network, so that loopback reaches
    it (or ``network_namespace``)."""
    spec = Spec(
        args=args,
        user=user,
        capabilities=capabilities,
        mounts=[
            *(Mount(source, target) for target, source in mounts.items()),
            *(Mount(source, target, read_only=False) for target, source in (writable or {}).items()),
        ],
        privileged=privileged,
        no_new_privileges=not (escalation or privileged),
        network_namespace=network_namespace,
    )
    bundle = oci.write_bundle(image, spec, tmp_path / "bundle")
    name = f"accel-health-test-{uuid.uuid4().hex[:12]}"
    log = tmp_path / "container.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            oci.run_argv(bundle, name), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
    try:
        yield Container(process=process, log=log, name=name)
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


def test_the_exporters_interpreter_holds_the_images_only_file_capability_and_nothing_is_setuid(
    image: Unpacked,
) -> None:
    """scripts/image/capabilities.py: a copy of the interpreter with CAP_SYSLOG and CAP_CHOWN permitted,
    the effective bit unset (the exporter raises them itself, and a container that bounds them out
    still starts it), started by the exporter's console script alone; no setuid or setgid file."""
    granted: dict[str, bytes] = {}
    set_id: list[str] = []
    for path in image.rootfs.rglob("*"):
        if path.is_symlink() or not path.is_file():
            continue
        name = str(path.relative_to(image.rootfs))
        if path.stat().st_mode & (stat.S_ISUID | stat.S_ISGID):
            set_id.append(name)
        try:
            granted[name] = os.getxattr(path, "security.capability", follow_symlinks=False)
        except OSError:
            continue
    assert set_id == []
    assert set(granted) == {"opt/accel-health/bin/exporter-python"}
    magic, permitted_low, inheritable_low, permitted_high, inheritable_high = struct.unpack(
        "<5I", granted["opt/accel-health/bin/exporter-python"]
    )
    assert magic == 0x02000000  # revision 2, effective bit unset
    assert permitted_low | permitted_high << 32 == 1 << CAP_SYSLOG | 1 << CAP_CHOWN
    assert inheritable_low == inheritable_high == 0
    bin_dir = image.rootfs / "opt" / "accel-health" / "bin"
    exporter = (bin_dir / "accel-health-exporter").read_text().splitlines()[0]
    remediator = (bin_dir / "accel-health-remediator").read_text().splitlines()[0]
    assert (exporter, remediator) == (
        "#!/opt/accel-health/bin/exporter-python",
        "#!/opt/accel-health/bin/python",
    )


# -- what it does -----------------------------------------------------------------------------------


def test_the_exporter_in_the_image_serves_the_fixture_node_as_the_source_tree_does(
    image: Unpacked, tmp_path: Path
) -> None:
    """Compared once each has read the whole kernel log (its records counted): before that, a scrape
    races the follower thread, and a GPU's UUID (from the log) may not be known yet."""
    records = len(
        re.findall(r"^\d+,", (GPU_NODE / "kmsg").read_text(), flags=re.MULTILINE)
    )  # not continuations

    def read_all(url: str) -> bool:
        return sum(_samples(url, "accel_kmsg_records_total").values()) == records

    (tmp_path / "host").mkdir()
    (tmp_path / "image").mkdir()
    host = spawn_exporter(
        kmsg=GPU_NODE / "kmsg", sysfs_root=GPU_NODE / "sys", log=tmp_path / "host.log", flags=("--nvml=off",)
    )
    try:
        assert wait_until(lambda: read_all(host.url), timeout=10)
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
        url = container.url()
        assert wait_until(lambda: read_all(url), timeout=10), container.log.read_text()
        status, body = _get(url + "/metrics")
    assert status == 200
    assert normalise(body.decode()) == expected
    assert "Traceback" not in container.log.read_text()


def _samples(url: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """The samples named ``name`` on ``url``/metrics: sorted labels -> value."""
    status, body = _get(url + "/metrics")
    assert status == 200
    return {
        tuple(sorted(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(body.decode())
        for sample in family.samples
        if sample.name == name
    }


def _mask(status: dict[str, str], key: str) -> int:
    return int(status[key], 16)


def _last_seq(saved: Path) -> int | None:
    """The last kernel-log record the exporter's saved state has counted (None before it saved)."""
    if not saved.is_file():
        return None
    value = json.loads(saved.read_text()).get("last_seq")
    return value if isinstance(value, int) else None


def _dmesg_restricted() -> bool:
    return Path("/proc/sys/kernel/dmesg_restrict").read_text().strip() == "1"


@pytest.mark.skipif(not Path("/dev/kmsg").exists(), reason="no /dev/kmsg on this machine")
def test_the_exporter_reads_the_hosts_kernel_log_as_uid_65532_raising_syslog_for_the_open_alone(
    image: Unpacked, tmp_path: Path
) -> None:
    """As the shipped overlays run it (components/kmsg-privileged: privileged for the device cgroup,
    the image's user): the exporter reads this machine's own /dev/kmsg. Where kernel.dmesg_restrict=1
    the open needs CAP_SYSLOG, which uid 65532 holds only through the exporter
    interpreter's file capability: the same exporter started by the image's plain interpreter is
    refused (that half only where dmesg_restrict is 1). Between opens the process holds no effective
    capability, and CAP_CHOWN is given up."""
    args = ["--listen=127.0.0.1:0", "--kmsg=/dev/kmsg", "--sysfs-root=/sys", "--nvml=off"]
    kmsg = {"/dev/kmsg": Path("/dev/kmsg")}
    (tmp_path / "shipped").mkdir()
    with run(
        image, tmp_path / "shipped", ["accel-health-exporter", *args], kmsg, privileged=True
    ) as container:
        url = container.url()
        assert wait_until(lambda: sum(_samples(url, "accel_kmsg_records_total").values()) > 0, timeout=10)
        assert _samples(url, "accel_exporter_collector_up")[(("collector", "kmsg"),)] == 1
        status = container.status()
    log = container.log.read_text()
    assert status["Uid"].split() == ["65532"] * 4
    assert _mask(status, "CapEff") == 0, status
    assert _mask(status, "CapPrm") == 1 << CAP_SYSLOG, status
    assert "running as uid 65532; capabilities permitted: SYSLOG; effective: none" in log, log
    if not _dmesg_restricted():
        return
    plain = [
        "/opt/accel-health/bin/python",
        "-c",
        "import sys; from exporter.cli import main; sys.exit(main())",
    ]
    (tmp_path / "plain").mkdir()
    with run(image, tmp_path / "plain", [*plain, *args], kmsg, privileged=True) as container:
        url = container.url()
        assert _samples(url, "accel_exporter_collector_up")[(("collector", "kmsg"),)] == 0
    assert "cannot read /dev/kmsg: Operation not permitted" in container.log.read_text()


def test_the_exporter_takes_over_the_state_directory_a_root_exporter_left_and_resumes_its_counts(
    image: Unpacked, tmp_path: Path
) -> None:
    """An exporter of an earlier version ran as root and left its state, root's, in the hostPath the
    kubelet made (root, 0755). The exporter as the base manifest runs it (uid 65532, SYSLOG and CHOWN
    added, privilege escalation allowed) takes the directory and its files over, resumes the counts
    (the Xid the ring buffer no longer holds still counts) and saves again; CAP_CHOWN is then gone."""
    node, state = tmp_path / "node", tmp_path / "state"
    (node / "dev").mkdir(parents=True)
    state.mkdir(mode=0o755)
    kmsg = node / "dev" / "kmsg"
    kmsg.write_text("6,0,0,-;Linux version 6.1.0\n")
    write_kmsg(node, XID_79)
    args = [
        "accel-health-exporter",
        "--listen=127.0.0.1:0",
        "--kmsg=/node/dev/kmsg",
        "--sysfs-root=/sys-fixture",
        "--nvml=off",
        "--state-dir=/var/lib/accel-health",
    ]
    mounts = {"/node": node, "/sys-fixture": GPU_NODE / "sys"}
    writable = {"/var/lib/accel-health": state}

    def xid_79(url: str) -> float:
        return sum(v for k, v in _samples(url, "accel_gpu_xid_errors_total").items() if ("xid", "79") in k)

    saved = state / "kmsg-state.json"
    (tmp_path / "root").mkdir()
    with run(image, tmp_path / "root", args, mounts, user=(0, 0), capabilities=("CAP_SYSLOG",),
             writable=writable) as earlier:  # fmt: skip
        url = earlier.url()
        assert wait_until(lambda: xid_79(url) == 1, timeout=10)
        assert wait_until(lambda: _last_seq(saved) == 1, timeout=10), earlier.log.read_text()
    assert {p.stat().st_uid for p in [state, *state.iterdir()]} == {0}
    # The ring buffer moved on: the first Xid is gone from it, a second one came.
    kmsg.write_text("3,2,3000000,-;" + XID_79 + "\n")
    (tmp_path / "user").mkdir()
    with run(image, tmp_path / "user", args, mounts, capabilities=("CAP_SYSLOG", "CAP_CHOWN"),
             escalation=True, writable=writable) as container:  # fmt: skip
        url = container.url()
        assert wait_until(lambda: xid_79(url) == 2, timeout=10), container.log.read_text()
        assert wait_until(lambda: _last_seq(saved) == 2, timeout=10), container.log.read_text()
        status = container.status()
    log = container.log.read_text()
    assert {p.stat().st_uid for p in [state, *state.iterdir()]} == {65532}, log
    assert "state directory /var/lib/accel-health handed over to uid 65532" in log
    assert _mask(status, "CapPrm") == 1 << CAP_SYSLOG, status
    assert _mask(status, "CapEff") == 0, status


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


@contextmanager
def _network_namespace(ping_group_range: str | None = None) -> Iterator[Path]:
    """A network namespace of its own with loopback up, and the pod sysctl ``ping_group_range``."""
    name = f"ah-image-{uuid.uuid4().hex[:8]}"
    ip = shutil.which("ip") or "/usr/sbin/ip"
    subprocess.run([ip, "netns", "add", name], check=True, timeout=30)
    try:
        subprocess.run([ip, "netns", "exec", name, ip, "link", "set", "lo", "up"], check=True, timeout=30)
        if ping_group_range is not None:
            set_sysctl(name, "net.ipv4.ping_group_range", ping_group_range)
        yield Path("/var/run/netns") / name
    finally:
        subprocess.run([ip, "netns", "delete", name], check=False, timeout=30)


def test_ping_and_iperf3_work_in_the_image_as_the_exporter_runs_them(image: Unpacked, tmp_path: Path) -> None:
    """As the exporter's user, uid 65532, with no capability and no privilege escalation. ping opens
    an ICMP datagram socket, which the pod's sysctl net.ipv4.ping_group_range (components/active-checks)
    grants to group 65532 in the pod's network namespace, and which is refused without it (a new
    network namespace admits no group). One second of iperf3 between two containers of the image;
    iperf3 makes a file in /tmp for each stream ("unable to create a new stream: Read-only file
    system" without one): the active-checks component mounts an emptyDir there."""
    ping_args = ["ping", "-c", "1", "-W", "5", "127.0.0.1"]
    with (
        _network_namespace("65532 65532") as netns,
        run(image, tmp_path / "ping", ping_args, {}, network_namespace=netns) as ping,
    ):
        out = ping.wait()
    assert "1 packets transmitted, 1 received" in out, out
    with (
        _network_namespace() as netns,
        run(image, tmp_path / "refused", ping_args, {}, network_namespace=netns) as refused,
    ):
        code = refused.process.wait(timeout=30)
    out = refused.log.read_text()
    assert code != 0, out
    assert "Operation not permitted" in out, out
    for folder in ("server", "client", "server-tmp", "client-tmp"):
        (tmp_path / folder).mkdir()
    for folder in ("server-tmp", "client-tmp"):
        (tmp_path / folder).chmod(0o777)  # an emptyDir's mode
    port = free_port()
    server_args = ["iperf3", "-s", "-1", "-p", str(port), "--forceflush"]
    with run(
        image, tmp_path / "server", server_args, {}, writable={"/tmp": tmp_path / "server-tmp"}
    ) as server:
        assert wait_until(lambda: "Server listening" in server.log.read_text(), timeout=10), (
            server.log.read_text()
        )
        client_args = ["iperf3", "-c", "127.0.0.1", "-p", str(port), "-t", "1", "-J"]
        with run(
            image, tmp_path / "client", client_args, {}, writable={"/tmp": tmp_path / "client-tmp"}
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
    # Nothing failed but the last import: sqlite3's extension module is not in the image. (Where the
    # traceback lands among the printed lines depends on how the two streams reach the log.)
    assert "ModuleNotFoundError: No module named '_sqlite3'" in out, out
    assert out.count("Error:") == 1, out
