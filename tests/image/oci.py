"""The image `make image` builds, as tests run it: built (only when its caches are warm, unless asked
to build cold), unpacked once per image with umoci into ~/.cache/accel-health/image/unpacked/<digest>,
and started with runc from runtime configurations made here. Shared by tests/image (the image alone)
and tests/kube (the project's pods on the real API server).

Running needs root (runc with the image's own uid inside), and buildah, skopeo, umoci and runc
(`make image-tools`).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import tomllib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
BUILD = REPO / "scripts" / "image" / "build.sh"
TOOLS = ("buildah", "skopeo", "umoci", "runc", "git", "bash")
CACHE = (
    Path(
        os.environ.get("ACCEL_HEALTH_CACHE")
        or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "accel-health"
    )
    / "image"
    / "unpacked"
)
"""Where unpacked images are kept, beside scripts/image/build.sh's caches."""

_PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
VERSION: str = _PROJECT["project"]["version"]
IMAGE = f"{_PROJECT['tool']['accel-health']['image']['name']}:{VERSION}"

# What a container runtime grants a container by default (containerd's and CRI-O's list), before a
# securityContext drops or adds any.
DEFAULT_CAPABILITIES = (
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FSETID",
    "CAP_FOWNER",
    "CAP_MKNOD",
    "CAP_NET_RAW",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETFCAP",
    "CAP_SETPCAP",
    "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT",
    "CAP_KILL",
    "CAP_AUDIT_WRITE",
)


class ImageUnavailable(Exception):
    """The image cannot be built or run here; the message says why."""


def tool(name: str) -> str:
    return shutil.which(name) or name


def problem() -> str | None:
    """Why images cannot be run here, or None."""
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        return f"{', '.join(missing)} not installed (make image-tools)"
    if os.geteuid() != 0:
        return "runc runs the image as root here (rootless runc needs umoci unpack --rootless)"
    return None


@dataclass(frozen=True)
class Unpacked:
    """The built image, unpacked: its OCI config, umoci's runtime config and its root filesystem."""

    config: dict[str, Any]
    runtime: dict[str, Any]
    rootfs: Path
    digest: str

    @property
    def env(self) -> dict[str, str]:
        """The image's own environment (ENV)."""
        return dict(e.split("=", 1) for e in self.config["config"].get("Env") or [])


@contextlib.contextmanager
def _one_at_a_time() -> Iterator[None]:
    """Held while the image is built or unpacked: test workers (pytest-xdist) each call `build` and
    `unpack`, and two builds at once replace each other's build context ("cp: ... are the same file"),
    two unpacks remove each other's tree."""
    CACHE.parent.mkdir(parents=True, exist_ok=True)
    with (CACHE.parent / "unpack.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def build(*, cold: bool = False) -> None:
    """`scripts/image/build.sh`: a warm rebuild (seconds, no network) or, with ``cold``, a full one.
    Raises ImageUnavailable when the caches are cold and ``cold`` is not given."""
    argv = [tool("bash"), str(BUILD)] + ([] if cold else ["--if-warm"])
    with _one_at_a_time():
        built = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=1800, cwd=REPO)
    if built.returncode == 3:
        raise ImageUnavailable(built.stderr.strip().splitlines()[-1].removeprefix("image: "))
    if built.returncode != 0:
        raise RuntimeError(f"scripts/image/build.sh failed:\n{built.stderr[-4000:]}")


def unpack() -> Unpacked:
    """The image in containers-storage, unpacked once per digest (the older ones removed)."""
    with _one_at_a_time():
        return _unpack()


def _unpack() -> Unpacked:
    digest = subprocess.run(
        [tool("skopeo"), "inspect", "--format", "{{.Digest}}", f"containers-storage:{IMAGE}"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout.strip()
    here = CACHE / digest.replace(":", "-")
    if not (here / "done").is_file():
        if CACHE.is_dir():
            for old in CACHE.iterdir():
                shutil.rmtree(old, ignore_errors=True)
        here.mkdir(parents=True)
        layout = f"oci:{here / 'oci'}:{VERSION}"
        subprocess.run(
            [tool("skopeo"), "copy", "--quiet", f"containers-storage:{IMAGE}", layout],
            check=True,
            capture_output=True,
            timeout=300,
        )
        subprocess.run(
            [tool("umoci"), "unpack", "--image", f"{here / 'oci'}:{VERSION}", str(here / "bundle")],
            check=True,
            capture_output=True,
            timeout=300,
        )
        inspected = subprocess.run(
            [tool("skopeo"), "inspect", "--config", layout], check=True, capture_output=True, timeout=60
        )
        (here / "image-config.json").write_bytes(inspected.stdout)
        shutil.rmtree(here / "oci")
        (here / "done").write_text(digest)
    return Unpacked(
        config=json.loads((here / "image-config.json").read_text()),
        runtime=json.loads((here / "bundle" / "config.json").read_text()),
        rootfs=here / "bundle" / "rootfs",
        digest=digest,
    )


@dataclass(frozen=True)
class Mount:
    """A bind mount into the container."""

    source: Path
    target: str
    read_only: bool = True


@dataclass
class Spec:
    """What one container runs and with which rights, as a pod's securityContext and volumes say."""

    args: Sequence[str]
    env: dict[str, str] = field(default_factory=dict)
    """Added to the image's own environment (and overriding it), as Kubernetes does."""
    user: tuple[int, int] | None = None
    """(uid, gid); None: the image's USER."""
    supplementary_groups: Sequence[int] = ()
    read_only_root: bool = True
    capabilities: Sequence[str] | None = None
    """Effective capabilities (CAP_...); None: the runtime's default set."""
    privileged: bool = False
    no_new_privileges: bool = False
    mounts: Sequence[Mount] = ()
    network_namespace: Path | None = None
    """Join this network namespace (/var/run/netns/NAME); None: the host's network."""
    hostname: str | None = None


def runtime_config(image: Unpacked, spec: Spec) -> dict[str, Any]:
    """The runc configuration for ``spec``, from umoci's for the image."""
    config: dict[str, Any] = json.loads(json.dumps(image.runtime))
    config["root"] = {"path": str(image.rootfs), "readonly": spec.read_only_root}
    process = config["process"]
    process["args"] = list(spec.args)
    process["terminal"] = False
    process["env"] = [f"{k}={v}" for k, v in (image.env | spec.env).items()]
    if spec.user is not None:
        process["user"] = {"uid": spec.user[0], "gid": spec.user[1]}
    if spec.supplementary_groups:
        process["user"]["additionalGids"] = list(spec.supplementary_groups)
    uid = int(process["user"]["uid"])
    if spec.privileged:
        caps = [f"CAP_{c}" for c in _all_capabilities()]
    else:
        caps = list(DEFAULT_CAPABILITIES if spec.capabilities is None else spec.capabilities)
    # As containerd and CRI-O run a non-root user: no ambient capabilities, so after exec the process
    # holds only what its program's file capabilities permit within the bounding set (the image's
    # exporter interpreter: SYSLOG and CHOWN, scripts/image/capabilities.py).
    process["capabilities"] = {
        "bounding": caps,
        "permitted": caps,
        "effective": caps if uid == 0 else [],
        "inheritable": [],
        "ambient": [],
    }
    process["noNewPrivileges"] = spec.no_new_privileges
    process.pop("rlimits", None)
    linux = config["linux"]
    namespaces = [n for n in linux["namespaces"] if n["type"] != "network"]
    if spec.network_namespace is not None:
        namespaces.append({"type": "network", "path": str(spec.network_namespace)})
    linux["namespaces"] = namespaces
    if spec.privileged:
        linux.pop("maskedPaths", None)
        linux.pop("readonlyPaths", None)
        linux.setdefault("resources", {})["devices"] = [{"allow": True, "access": "rwm"}]
        for mount in config["mounts"]:
            if mount["destination"] == "/sys":
                mount["options"] = [o for o in mount["options"] if o != "ro"]
    if spec.hostname:
        config["hostname"] = spec.hostname
    for mount in spec.mounts:
        options = ["rbind", "ro" if mount.read_only else "rw"]
        config["mounts"].append(
            {"destination": mount.target, "type": "bind", "source": str(mount.source), "options": options}
        )
    return config


def _all_capabilities() -> list[str]:
    """Every capability a privileged container gets: all this kernel knows, within what the harness
    itself may hand on (its bounding set)."""
    status = Path("/proc/self/status").read_text()
    (bounding,) = [int(line.split()[1], 16) for line in status.splitlines() if line.startswith("CapBnd:")]
    names = [
        "CHOWN", "DAC_OVERRIDE", "DAC_READ_SEARCH", "FOWNER", "FSETID", "KILL", "SETGID", "SETUID",
        "SETPCAP", "LINUX_IMMUTABLE", "NET_BIND_SERVICE", "NET_BROADCAST", "NET_ADMIN", "NET_RAW",
        "IPC_LOCK", "IPC_OWNER", "SYS_MODULE", "SYS_RAWIO", "SYS_CHROOT", "SYS_PTRACE", "SYS_PACCT",
        "SYS_ADMIN", "SYS_BOOT", "SYS_NICE", "SYS_RESOURCE", "SYS_TIME", "SYS_TTY_CONFIG", "MKNOD",
        "LEASE", "AUDIT_WRITE", "AUDIT_CONTROL", "SETFCAP", "MAC_OVERRIDE", "MAC_ADMIN", "SYSLOG",
        "WAKE_ALARM", "BLOCK_SUSPEND", "AUDIT_READ", "PERFMON", "BPF", "CHECKPOINT_RESTORE",
    ]  # fmt: skip
    return [name for bit, name in enumerate(names) if bounding >> bit & 1]


def process_status(pid: int) -> dict[str, str]:
    """/proc/PID/status of a container's process as the host sees it (Uid, CapEff, NoNewPrivs, ...)."""
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {key: value.strip() for key, _, value in (line.partition(":") for line in lines)}


def write_bundle(image: Unpacked, spec: Spec, bundle: Path) -> Path:
    """A runc bundle (its config.json; the root filesystem stays the shared, read-only unpacked one)."""
    bundle.mkdir(parents=True, exist_ok=True)
    (bundle / "config.json").write_text(json.dumps(runtime_config(image, spec)))
    return bundle


def run_argv(bundle: Path, name: str) -> list[str]:
    """`runc run` in the foreground: the container's output is runc's, and a signal to runc's process
    group reaches the container's process too."""
    return [tool("runc"), "run", "--bundle", str(bundle), name]


def delete(name: str) -> None:
    """Kills and removes the container ``name`` (nothing when there is none)."""
    subprocess.run([tool("runc"), "delete", "--force", name], capture_output=True, check=False, timeout=30)
