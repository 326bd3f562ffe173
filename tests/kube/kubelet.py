"""A kubelet (and scheduler) stand-in for fake nodes, as kwok plays one.

- Nodes: `add_node` registers a Ready node with capacity, labels, taints and a boot id.
- Scheduling: a pod without a node is bound to a fake node that is schedulable for it (cordon,
  taints and tolerations, nodeSelector, required node affinity with matchExpressions and
  matchFields), the least loaded first, after `schedule_delay`.
- Running: a bound pod becomes Running and Ready after `start_delay`. Pods of the project's image are
  real processes: their container command runs with the manifest's own args and env (fieldRefs and
  $(VAR) expanded), in a network namespace of their own and with their volumes mounted at their
  mountPaths (Secrets, ConfigMaps, emptyDirs, hostPaths from the fake node's root, the
  service-account token unless automount is off), env from values, fieldRefs and ConfigMap or Secret
  keys, and an /etc/hosts naming the Services the harness plays outside the API (`hosts`), the
  secondary networks of its Multus `k8s.v1.cni.cncf.io/networks` annotation (interfaces net1, ...,
  listed in `network-status` as Multus does), and with `nvidia_library` the NVIDIA runtime's NVML
  library in a container that asks for the GPUs; readiness
  follows the manifest's readinessProbe. A process that exits is restarted (restartPolicy Always) and
  counted in restartCount.
- With `image` (the image `make image` built, unpacked), each such container is the image run by
  runc as a container runtime runs it: the securityContext's user and group (the image's USER when
  none is set), fsGroup as a supplementary group and as the group of the Secret, ConfigMap and
  token files (with group read added, as the kubelet does), the capabilities left after `drop` and
  `add` (a non-root user holds only what its program's file capabilities permit), `privileged`,
  `readOnlyRootFilesystem` and `allowPrivilegeEscalation`, the pod's safe sysctls (set in its network
  namespace; an unsafe one is refused); the image's own environment and PATH under the manifest's
  env. Not
  played: seccomp profiles, resource limits, the device cgroup of an unprivileged container.
  Without `image`, the command runs from the development virtualenv as root (`tests.kube.podrun`):
  what a scenario uses that needs a debugger-level view of the process.
- Terminating: a pod with a deletionTimestamp is stopped (SIGTERM, then SIGKILL after its grace
  period) and finalized after `terminate_delay`, as the kubelet confirms a deletion.

Nothing here decides anything the product does: it only plays the node side of the API.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from tests.image import oci
from tests.kube.controlplane import ControlPlane, Process, spawn
from tests.kube.podnet import PodNetwork, set_sysctl
from tests.kube.rest import ApiError, Obj

logger = logging.getLogger("tests.kube.kubelet")
REPO = Path(__file__).resolve().parents[2]
SA_MOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"
NVML_IN_IMAGE = "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"
MULTUS_NETWORKS = "k8s.v1.cni.cncf.io/networks"
MULTUS_NETWORK_STATUS = "k8s.v1.cni.cncf.io/network-status"
_VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class ContainerProcess(Process):
    """`runc run` of one container; signals go to the container through runc."""

    container: str = ""

    def send(self, sig: int) -> None:
        subprocess.run(
            [oci.tool("runc"), "kill", self.container, str(int(sig))],
            capture_output=True,
            check=False,
            timeout=30,
        )

    def stop(self, *, timeout: float = 10.0, sig: int = signal.SIGTERM) -> None:
        if self.popen.poll() is None:
            self.send(sig)
            try:
                self.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.send(signal.SIGKILL)
                self.popen.wait(timeout=30)
        oci.delete(self.container)


@dataclass
class Running:
    """A process-backed pod's container."""

    pod_key: str
    uid: str
    ip: str
    netns: str
    process: Process
    spec_file: Path
    restarts: int = 0
    ready: bool = False
    last_probe: float = 0.0
    exited_at: float | None = None
    projected: list[tuple[Obj, Path]] = field(default_factory=list)
    """The pod's Secret and ConfigMap volumes and their folders, written again as the objects change."""
    projected_at: float = 0.0


@dataclass
class KubeletSettings:
    """Delays of the node side, seconds (small, so that mid-drain moments can be caught)."""

    schedule_delay: float = 0.0
    start_delay: float = 0.2
    terminate_delay: float = 0.3
    tick: float = 0.2
    """How often the stand-in looks at the pods."""
    volume_sync: float = 2.0
    """How often a running pod's Secret and ConfigMap volumes are written again from the API (the
    kubelet's sync period and cache TTL, about a minute, shortened)."""
    nvidia_library: Path | None = None
    """The NVIDIA container runtime's part, for containers run from the image: one whose env sets
    NVIDIA_VISIBLE_DEVICES gets this file, read-only, as the driver's libnvidia-ml.so.1 where the
    runtime's hook puts it (a directory of the loader's own search; a process holding file
    capabilities ignores LD_LIBRARY_PATH). Tests mount the NVML stub (tests/exporter/nvml_stub.c)."""


def _tolerates(pod: Obj, taint: Obj) -> bool:
    for tol in pod["spec"].get("tolerations") or []:
        if tol.get("effect") and tol["effect"] != taint.get("effect"):
            continue
        if tol.get("operator") == "Exists" and not tol.get("key"):
            return True
        if tol.get("key") != taint.get("key"):
            continue
        if tol.get("operator") == "Exists" or tol.get("value", "") == taint.get("value", ""):
            return True
    return False


def _expr_matches(expr: Obj, values: dict[str, str]) -> bool:
    key, op, wanted = expr["key"], expr["operator"], expr.get("values") or []
    present = key in values
    if op == "In":
        return present and values[key] in wanted
    if op == "NotIn":
        return not present or values[key] not in wanted
    if op == "Exists":
        return present
    if op == "DoesNotExist":
        return not present
    if op in ("Gt", "Lt") and present:
        return int(values[key]) > int(wanted[0]) if op == "Gt" else int(values[key]) < int(wanted[0])
    return False


def fits(pod: Obj, node: Obj) -> bool:
    """Whether the scheduler would put `pod` on `node` (the predicates the tests' pods use)."""
    labels = node["metadata"].get("labels") or {}
    taints = list(node["spec"].get("taints") or [])
    if node["spec"].get("unschedulable"):
        taints.append({"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"})
    for taint in taints:
        if taint.get("effect") in ("NoSchedule", "NoExecute") and not _tolerates(pod, taint):
            return False
    for key, value in (pod["spec"].get("nodeSelector") or {}).items():
        if labels.get(key) != value:
            return False
    required = (
        ((pod["spec"].get("affinity") or {}).get("nodeAffinity") or {}).get(
            "requiredDuringSchedulingIgnoredDuringExecution"
        )
        or {}
    ).get("nodeSelectorTerms")
    if required:
        fields = {"metadata.name": node["metadata"]["name"]}
        return any(
            all(_expr_matches(e, labels) for e in term.get("matchExpressions") or [])
            and all(_expr_matches(e, fields) for e in term.get("matchFields") or [])
            for term in required
        )
    return True


@dataclass
class FakeKubelet:
    """Plays kubelet and scheduler for the nodes it registered."""

    plane: ControlPlane
    workdir: Path
    settings: KubeletSettings = field(default_factory=KubeletSettings)
    network: PodNetwork | None = None
    """Where process-backed pods get their namespaces; None runs no process (every pod is fake)."""
    runs_process: Callable[[Obj], bool] = lambda _pod: False
    """Which pods are real processes (the project's image)."""
    image: oci.Unpacked | None = None
    """The project's image: those pods' containers run from it with runc (None: from the virtualenv)."""
    nodes: dict[str, Path] = field(default_factory=dict)
    """Fake node name -> its root folder (hostPath volumes resolve there)."""
    api_port_for_pods: int = 443
    """The port pods reach the API server on (KUBERNETES_SERVICE_PORT), set by the harness."""
    hosts: dict[str, str] = field(default_factory=dict)
    """Cluster DNS as process pods see it: name -> address, written into every pod's /etc/hosts (a
    file the kubelet manages in real pods too), for the Services the harness plays outside the API."""
    errors: list[str] = field(default_factory=list)
    running: dict[str, Running] = field(default_factory=dict)
    addresses: dict[str, Obj] = field(default_factory=dict)
    """Pod IP -> the pod as its process was started there (namespace, labels, container ports): who
    an address was, also after the pod is gone (addresses are never handed out twice)."""
    _seen: dict[str, float] = field(default_factory=dict)
    _deleting: dict[str, float] = field(default_factory=dict)
    _created_dirs: list[Path] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _fake_ip: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    # -- nodes -----------------------------------------------------------------------------------

    def add_node(
        self,
        name: str,
        *,
        labels: dict[str, str] | None = None,
        taints: list[Obj] | None = None,
        capacity: dict[str, str] | None = None,
        provider_id: str | None = None,
    ) -> Obj:
        root = self.workdir / "nodes" / name
        (root / "dev").mkdir(parents=True, exist_ok=True)
        (root / "dev" / "kmsg").touch()
        self.nodes[name] = root
        caps = {"cpu": "32", "memory": "256Gi", "pods": "110", **(capacity or {})}
        node: Obj = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": name,
                "labels": {
                    "kubernetes.io/hostname": name,
                    "kubernetes.io/os": "linux",
                    "kubernetes.io/arch": "amd64",
                    **(labels or {}),
                },
            },
            "spec": {"taints": taints or [], **({"providerID": provider_id} if provider_id else {})},
            "status": {
                "capacity": caps,
                "allocatable": caps,
                "conditions": [
                    {
                        "type": "Ready",
                        "status": "True",
                        "reason": "KubeletReady",
                        "message": "kubelet stand-in",
                        "lastHeartbeatTime": now_rfc3339(),
                        "lastTransitionTime": now_rfc3339(),
                    }
                ],
                "addresses": [{"type": "Hostname", "address": name}],
                "nodeInfo": {
                    "bootID": str(uuid.uuid4()),
                    "machineID": uuid.uuid4().hex,
                    "systemUUID": str(uuid.uuid4()),
                    "kernelVersion": "6.1.0",
                    "osImage": "Debian GNU/Linux 12 (bookworm)",
                    "containerRuntimeVersion": "fake://1.0",
                    "kubeletVersion": "v1.20.2",
                    "kubeProxyVersion": "v1.20.2",
                    "operatingSystem": "linux",
                    "architecture": "amd64",
                },
            },
        }
        created: Obj = self.plane.admin.create("/api/v1/nodes", node)
        if not created.get("status", {}).get("conditions"):
            self.plane.admin.merge_patch(f"/api/v1/nodes/{name}/status", {"status": node["status"]})
        return created

    def reboot(self, name: str) -> str:
        """A new boot id on the node (as after a reboot); returns it."""
        boot = str(uuid.uuid4())
        self.plane.admin.strategic_patch(
            f"/api/v1/nodes/{name}/status", {"status": {"nodeInfo": {"bootID": boot}}}
        )
        return boot

    # -- lifecycle --------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="fake-kubelet", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        for run in list(self.running.values()):
            run.process.stop(timeout=5)
        self.running.clear()
        for path in reversed(self._created_dirs):
            shutil.rmtree(path, ignore_errors=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.sync()
            except (ApiError, OSError, ValueError, KeyError) as exc:
                self.errors.append(f"{type(exc).__name__}: {exc}")
                logger.warning("kubelet stand-in: %s", exc)
            self._stop.wait(self.settings.tick)

    # -- one pass ---------------------------------------------------------------------------------

    def sync(self) -> None:
        with self._lock:
            nodes = {n["metadata"]["name"]: n for n in self.plane.admin.items("/api/v1/nodes")}
            pods = self.plane.admin.items("/api/v1/pods")
            now = time.monotonic()
            load: dict[str, int] = {}
            for pod in pods:
                node = pod["spec"].get("nodeName")
                if node:
                    load[node] = load.get(node, 0) + 1
            live_keys = set()
            for pod in pods:
                meta = pod["metadata"]
                key = f"{meta['namespace']}/{meta['name']}/{meta['uid']}"
                live_keys.add(key)
                first = self._seen.setdefault(key, now)
                node = pod["spec"].get("nodeName")
                if meta.get("deletionTimestamp"):
                    self._terminate(pod, key, first_seen=first, now=now)
                elif not node:
                    if now - first >= self.settings.schedule_delay:
                        self._schedule(pod, nodes, load)
                elif node in self.nodes:
                    self._run(pod, key, now=now, first_seen=first)
            for key in list(self.running):
                if key not in live_keys:
                    self.running.pop(key).process.stop(timeout=5)
            for seen in (self._seen, self._deleting):
                for key in list(seen):
                    if key not in live_keys:
                        del seen[key]

    def _schedule(self, pod: Obj, nodes: dict[str, Obj], load: dict[str, int]) -> None:
        candidates = [n for n in nodes.values() if n["metadata"]["name"] in self.nodes and fits(pod, n)]
        if not candidates:
            return
        target = min(candidates, key=lambda n: (load.get(n["metadata"]["name"], 0), n["metadata"]["name"]))
        name = target["metadata"]["name"]
        meta = pod["metadata"]
        binding = {
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": {"name": meta["name"]},
            "target": {"apiVersion": "v1", "kind": "Node", "name": name},
        }
        try:
            self.plane.admin.create(
                f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/binding", binding
            )
        except ApiError as exc:
            if exc.status not in (404, 409):
                raise
            return
        load[name] = load.get(name, 0) + 1

    def _status(self, pod: Obj, *, ip: str, ready: bool, restarts: int = 0) -> Obj:
        spec = pod["spec"]
        started = pod.get("status", {}).get("startTime") or now_rfc3339()
        flag = "True" if ready else "False"
        conditions = [
            {"type": t, "status": s, "lastTransitionTime": now_rfc3339()}
            for t, s in (
                ("Initialized", "True"),
                ("Ready", flag),
                ("ContainersReady", flag),
                ("PodScheduled", "True"),
            )
        ]
        return {
            "status": {
                "phase": "Running",
                "hostIP": "10.213.0.1",
                "podIP": ip,
                "podIPs": [{"ip": ip}],
                "startTime": started,
                "conditions": conditions,
                "containerStatuses": [
                    {
                        "name": c["name"],
                        "image": c.get("image", ""),
                        "imageID": "",
                        "ready": ready,
                        "started": True,
                        "restartCount": restarts,
                        "state": {"running": {"startedAt": started}},
                    }
                    for c in spec["containers"]
                ],
            }
        }

    def _patch_status(self, pod: Obj, status: Obj) -> None:
        meta = pod["metadata"]
        try:
            self.plane.admin.merge_patch(
                f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/status", status
            )
        except ApiError as exc:
            if exc.status != 404:
                raise

    def _run(self, pod: Obj, key: str, *, now: float, first_seen: float) -> None:
        status = pod.get("status") or {}
        if not self.runs_process(pod) or self.network is None:
            if status.get("phase") != "Running" and now - first_seen >= self.settings.start_delay:
                self._fake_ip += 1
                ip = f"10.244.{self._fake_ip // 250}.{1 + self._fake_ip % 250}"
                self._patch_status(pod, self._status(pod, ip=ip, ready=True))
            return
        run = self.running.get(key)
        if run is None:
            if now - first_seen < self.settings.start_delay:
                return
            run = self._start_process(pod, key)
            self.running[key] = run
            self._patch_status(pod, self._status(pod, ip=run.ip, ready=False))
            return
        if run.process.popen.poll() is not None:
            # CrashLoopBackOff, shortened: 0.5 s doubling up to 8 s.
            if run.exited_at is None:
                run.exited_at = now
                logger.warning("pod %s exited with %s", key, run.process.popen.returncode)
            if now - run.exited_at < min(8.0, 0.5 * 2**run.restarts):
                return
            run.exited_at = None
            run.restarts += 1
            run.ready = False
            run.process = self._exec(run.netns, run.spec_file, name=run.process.name)
            self._patch_status(pod, self._status(pod, ip=run.ip, ready=False, restarts=run.restarts))
            return
        if now - run.projected_at >= self.settings.volume_sync:
            run.projected_at = now
            for volume, target in run.projected:
                self._project(pod, volume, target)
        probe = pod["spec"]["containers"][0].get("readinessProbe")
        period = float((probe or {}).get("periodSeconds", 10)) if probe else 0.5
        if now - run.last_probe < min(period, 1.0):
            return
        run.last_probe = now
        ready = self._probe(pod, run.ip) if probe else True
        if ready != run.ready or status.get("podIP") != run.ip:
            run.ready = ready
            self._patch_status(pod, self._status(pod, ip=run.ip, ready=ready, restarts=run.restarts))

    def _probe(self, pod: Obj, ip: str) -> bool:
        container = pod["spec"]["containers"][0]
        http = (container.get("readinessProbe") or {}).get("httpGet")
        if not http:
            return True
        port = http["port"]
        if isinstance(port, str):
            port = next(p["containerPort"] for p in container.get("ports", []) if p.get("name") == port)
        url = f"http://{ip}:{port}{http.get('path', '/')}"
        try:
            with urllib.request.urlopen(url, timeout=1.0) as resp:
                return 200 <= int(resp.status) < 400
        except OSError:
            return False

    def _terminate(self, pod: Obj, key: str, *, first_seen: float, now: float) -> None:
        meta = pod["metadata"]
        run = self.running.pop(key, None)
        if run is not None:
            grace = float(meta.get("deletionGracePeriodSeconds") or 30)
            run.process.stop(timeout=grace)
        deleted_at = self._deleting.setdefault(key, now)
        if now - deleted_at < self.settings.terminate_delay and run is None:
            return
        try:
            self.plane.admin.delete(
                f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}",
                {
                    "apiVersion": "v1",
                    "kind": "DeleteOptions",
                    "gracePeriodSeconds": 0,
                    "preconditions": {"uid": meta["uid"]},
                },
            )
        except ApiError as exc:
            if exc.status not in (404, 409):
                raise

    # -- processes --------------------------------------------------------------------------------

    def _mount_point(self, target: str, *, is_file: bool) -> None:
        path = Path(target)
        if path.exists():
            return
        top = path if not is_file else path.parent
        missing = top
        while not missing.parent.exists():
            missing = missing.parent
        if not is_file:
            path.mkdir(parents=True, exist_ok=True)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.touch()
        self._created_dirs.append(missing)

    def _volume(self, pod: Obj, volume: Obj, pod_dir: Path) -> Path:
        path = self._volume_source(pod, volume, pod_dir)
        if "hostPath" not in volume:
            _set_volume_ownership(path, _fs_group(pod), read_only="emptyDir" not in volume)
        return path

    def _volume_source(self, pod: Obj, volume: Obj, pod_dir: Path) -> Path:
        name = volume["name"]
        target: Path = pod_dir / "volumes" / name
        if "hostPath" in volume:
            node_root = self.nodes[pod["spec"]["nodeName"]]
            host: Path = node_root / str(volume["hostPath"]["path"]).lstrip("/")
            kind = volume["hostPath"].get("type", "")
            if not host.exists():
                if kind != "DirectoryOrCreate":
                    raise FileNotFoundError(
                        f"hostPath {volume['hostPath']['path']} ({kind}) is not on the node"
                    )
                host.mkdir(parents=True, exist_ok=True)
            return host
        if _projected(volume):
            target.mkdir(parents=True, exist_ok=True)
            self._project(pod, volume, target, ownership=False)
            return target
        if "emptyDir" in volume:
            target.mkdir(parents=True, exist_ok=True)
            target.chmod(0o777)
            return target
        raise ValueError(f"volume {name}: kind not played by the kubelet stand-in: {sorted(volume)}")

    def _project(self, pod: Obj, volume: Obj, target: Path, *, ownership: bool = True) -> None:
        """Write a Secret or ConfigMap volume's files from the object as the API has it now: at the
        pod's start, then again every `volume_sync` (a value set after the pod started, such as the
        checks token an operator patches in, reaches it as in a cluster). Each changed file is
        replaced by a rename, so a reader sees the old content or the new, never half of it."""
        ns = pod["metadata"]["namespace"]
        source_kind, api = ("secret", "secrets") if "secret" in volume else ("configMap", "configmaps")
        src = volume[source_kind]
        obj_name = src.get("secretName") or src.get("name")
        obj = self.plane.admin.get(f"/api/v1/namespaces/{ns}/{api}/{obj_name}")
        data = obj.get("data") or {}
        items = src.get("items") or [{"key": k, "path": k} for k in data]
        mode = int(src.get("defaultMode", 0o644))
        changed = False
        for item in items:
            if item["key"] not in data:
                raise KeyError(f"{source_kind} {ns}/{obj_name} has no key {item['key']}")
            value = data[item["key"]]
            raw = base64.b64decode(value) if source_kind == "secret" else value.encode()
            out = target / item["path"]
            if out.is_file() and out.read_bytes() == raw:
                continue
            out.parent.mkdir(parents=True, exist_ok=True)
            staged = out.with_name(f".{out.name}.new")
            staged.write_bytes(raw)
            staged.chmod(int(item.get("mode", mode)))
            staged.replace(out)
            changed = True
        if changed and ownership:
            _set_volume_ownership(target, _fs_group(pod), read_only=True)

    def _start_process(self, pod: Obj, key: str) -> Running:
        assert self.network is not None
        meta, spec = pod["metadata"], pod["spec"]
        container = spec["containers"][0]
        pod_dir = self.workdir / "pods" / f"{meta['namespace']}_{meta['name']}"
        pod_dir.mkdir(parents=True, exist_ok=True)
        volumes = {v["name"]: v for v in spec.get("volumes") or []}
        mounts: list[tuple[str, str, bool]] = []
        projected: list[tuple[Obj, Path]] = []
        for vm in container.get("volumeMounts") or []:
            volume = volumes[vm["name"]]
            volume_dir = self._volume(pod, volume, pod_dir)
            mounts.append((str(volume_dir), vm["mountPath"], bool(vm.get("readOnly"))))
            if _projected(volume) and not vm.get("subPath"):
                projected.append((volume, volume_dir))
        sa_name = spec.get("serviceAccountName") or "default"
        automount = spec.get("automountServiceAccountToken")
        if automount is None:
            sa = self.plane.admin.get(f"/api/v1/namespaces/{meta['namespace']}/serviceaccounts/{sa_name}")
            automount = sa.get("automountServiceAccountToken", True)
        if automount:
            sa_dir = pod_dir / "serviceaccount"
            sa_dir.mkdir(parents=True, exist_ok=True)
            (sa_dir / "token").write_text(self.plane.service_account_token(meta["namespace"], sa_name))
            shutil.copyfile(self.plane.pki.ca_cert, sa_dir / "ca.crt")
            (sa_dir / "namespace").write_text(meta["namespace"])
            for item in sa_dir.iterdir():
                item.chmod(0o644)  # the token volume's defaultMode (420)
            _set_volume_ownership(sa_dir, _fs_group(pod), read_only=True)
            mounts.append((str(sa_dir), SA_MOUNT, True))
        if self.image is None:
            for source, mount_path, _ro in mounts:
                self._mount_point(mount_path, is_file=Path(source).is_file())
        env = self._env(pod, container)
        nvidia = self.settings.nvidia_library
        if self.image is not None and nvidia is not None and "NVIDIA_VISIBLE_DEVICES" in env:
            mounts.append((str(nvidia), NVML_IN_IMAGE, True))
        argv = [*container.get("command", []), *container.get("args", [])]
        argv = [_VAR_REF.sub(lambda m: env.get(m.group(1), m.group(0)), a) for a in argv]
        if self.image is None:
            argv[0] = shutil.which(argv[0], path=str(Path(sys.executable).parent)) or argv[0]
        netns, ip = self.network.add_pod()
        self.addresses[ip] = pod
        _apply_sysctls(pod, netns)
        self._attach_networks(pod, netns, ip)
        hosts = pod_dir / "etc-hosts"
        lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback", f"{ip}\t{meta['name']}"]
        hosts.write_text("\n".join([*lines, *(f"{a}\t{n}" for n, a in sorted(self.hosts.items()))]) + "\n")
        hosts.chmod(0o644)
        mounts.append((str(hosts), "/etc/hosts", True))
        spec_file = pod_dir / "podrun.json"
        if self.image is not None:
            env.pop("PATH")  # the image's own
            spec_file = oci.write_bundle(
                self.image,
                container_spec(pod, container, argv=argv, env=env, mounts=mounts, netns=netns),
                pod_dir / "bundle",
            )
        else:
            spec_file.write_text(
                json.dumps({"argv": argv, "env": env, "mounts": mounts, "hostname": meta["name"]})
            )
        name = f"pod-{meta['namespace']}-{meta['name']}"
        return Running(
            pod_key=key,
            uid=meta["uid"],
            ip=ip,
            netns=netns,
            process=self._exec(netns, spec_file, name=name),
            spec_file=spec_file,
            projected=projected,
            projected_at=time.monotonic(),
        )

    def _attach_networks(self, pod: Obj, netns: str, ip: str) -> None:
        """Plays Multus: each network the pod's `k8s.v1.cni.cncf.io/networks` annotation names (`name`
        or `namespace/name`, comma-separated) becomes an interface net1, net2, ... on a secondary
        network (tests/kube/podnet.py), and the pod's `k8s.v1.cni.cncf.io/network-status`
        annotation lists them after the cluster network, as Multus writes it."""
        assert self.network is not None
        meta = pod["metadata"]
        wanted = (meta.get("annotations") or {}).get(MULTUS_NETWORKS, "")
        names = [n.strip() for n in wanted.split(",") if n.strip()]
        if not names:
            return
        status: list[Obj] = [{"name": "cluster", "interface": "eth0", "ips": [ip], "default": True}]
        for i, name in enumerate(names, start=1):
            network = name if "/" in name else f"{meta['namespace']}/{name}"
            address = self.network.attach(netns, network, f"net{i}")
            self.addresses[address] = pod
            status.append({"name": network, "interface": f"net{i}", "ips": [address], "default": False})
        self.plane.admin.merge_patch(
            f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}",
            {"metadata": {"annotations": {MULTUS_NETWORK_STATUS: json.dumps(status)}}},
        )

    def _exec(self, netns: str, spec_file: Path, *, name: str) -> Process:
        if self.image is not None:
            # A container name of its own per pod (runc's state is global): the bundle's folder name
            # is the pod's, made unique by the workdir.
            container = f"ah{os.getpid()}-{hashlib.sha256(str(spec_file).encode()).hexdigest()[:12]}"
            oci.delete(container)  # the exited run before a restart
            started = spawn(name, oci.run_argv(spec_file, container), log_dir=self.workdir)
            return ContainerProcess(name=name, popen=started.popen, log=started.log, container=container)
        argv = [
            "ip",
            "netns",
            "exec",
            netns,
            "unshare",
            "-m",
            "-u",
            "--propagation",
            "private",
            sys.executable,
            "-m",
            "tests.kube.podrun",
            str(spec_file),
        ]
        return spawn(name, argv, log_dir=self.workdir, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})

    def _env(self, pod: Obj, container: Obj) -> dict[str, str]:
        meta = pod["metadata"]
        env: dict[str, str] = {
            "PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin",
            "HOSTNAME": meta["name"],
            "KUBERNETES_SERVICE_HOST": self.network.host_ip if self.network else "127.0.0.1",
            "KUBERNETES_SERVICE_PORT": str(self.api_port_for_pods),
            "PYTHONUNBUFFERED": "1",
        }
        fields = {
            "metadata.name": meta["name"],
            "metadata.namespace": meta["namespace"],
            "metadata.uid": meta["uid"],
            "spec.nodeName": pod["spec"].get("nodeName", ""),
            "spec.serviceAccountName": pod["spec"].get("serviceAccountName", "default"),
        }
        for item in container.get("env") or []:
            source = item.get("valueFrom") or {}
            if "value" in item:
                env[item["name"]] = _VAR_REF.sub(lambda m: env.get(m.group(1), m.group(0)), item["value"])
            elif "fieldRef" in source:
                env[item["name"]] = fields[source["fieldRef"]["fieldPath"]]
            elif "configMapKeyRef" in source or "secretKeyRef" in source:
                value = self._key_ref(meta["namespace"], source)
                if value is not None:
                    env[item["name"]] = value
            else:
                raise ValueError(f"env {item['name']}: source not played by the kubelet stand-in: {source}")
        return env

    def _key_ref(self, namespace: str, source: Obj) -> str | None:
        """A configMapKeyRef or secretKeyRef, read now; None when optional and absent (the kubelet
        refuses to start the container otherwise)."""
        secret = "secretKeyRef" in source
        ref = source["secretKeyRef" if secret else "configMapKeyRef"]
        api = "secrets" if secret else "configmaps"
        try:
            data = (
                self.plane.admin.get(f"/api/v1/namespaces/{namespace}/{api}/{ref['name']}").get("data") or {}
            )
        except ApiError as exc:
            if exc.status == 404 and ref.get("optional"):
                return None
            raise
        if ref["key"] not in data:
            if ref.get("optional"):
                return None
            raise KeyError(f"{api} {namespace}/{ref['name']} has no key {ref['key']}")
        value = data[ref["key"]]
        return base64.b64decode(value).decode() if secret else str(value)

    # -- helpers for tests ------------------------------------------------------------------------

    def pod_process(self, namespace: str, name: str) -> Running:
        for key, run in self.running.items():
            if key.startswith(f"{namespace}/{name}/"):
                return run
        raise KeyError(f"{namespace}/{name} is not a running process")

    def container_pid(self, namespace: str, name: str) -> int:
        """The host pid of the pod's container process (runc's state)."""
        process = self.pod_process(namespace, name).process
        if not isinstance(process, ContainerProcess):
            return process.popen.pid
        state = subprocess.run(
            [oci.tool("runc"), "state", process.container],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        )
        pid: int = json.loads(state.stdout)["pid"]
        return pid

    def kill(self, namespace: str, name: str) -> None:
        """SIGKILL the pod's process, as a crash or an OOM kill would (the stand-in restarts it)."""
        run = self.pod_process(namespace, name)
        if isinstance(run.process, ContainerProcess):
            run.process.send(signal.SIGKILL)
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(run.process.popen.pid, signal.SIGKILL)


SAFE_SYSCTLS = frozenset(
    {
        "kernel.shm_rmid_forced",
        "net.ipv4.ip_local_port_range",
        "net.ipv4.tcp_syncookies",
        "net.ipv4.ping_group_range",
        "net.ipv4.ip_unprivileged_port_start",
    }
)
"""The sysctls a kubelet sets for a pod without --allowed-unsafe-sysctls (its safe set since 1.22)."""


def _apply_sysctls(pod: Obj, netns: str) -> None:
    """Sets the pod's securityContext.sysctls in its network namespace, as the runtime does; a sysctl
    outside the safe set is refused as the kubelet refuses it (SysctlForbidden)."""
    for item in (pod["spec"].get("securityContext") or {}).get("sysctls") or []:
        name, value = item["name"], item["value"]
        if name not in SAFE_SYSCTLS:
            raise ValueError(f"SysctlForbidden: {name} is not a safe sysctl the kubelet allows")
        if not name.startswith("net."):
            continue  # IPC namespace sysctls: the pod's processes share the host's IPC namespace here
        set_sysctl(netns, name, value)


def _projected(volume: Obj) -> bool:
    """A Secret or ConfigMap volume: files the kubelet writes from an API object, and keeps writing."""
    return "secret" in volume or "configMap" in volume


def _fs_group(pod: Obj) -> int | None:
    group = (pod["spec"].get("securityContext") or {}).get("fsGroup")
    return None if group is None else int(group)


def _set_volume_ownership(path: Path, fs_group: int | None, *, read_only: bool) -> None:
    """What the kubelet does to a volume of a pod with an fsGroup (pkg/volume/volume_linux.go): every
    file and folder gets that group, files group read (and write, unless the volume is read-only)
    added, folders the set-group-id bit and group search. Without an fsGroup, nothing."""
    if fs_group is None:
        return
    for item in [path, *path.rglob("*")]:
        os.lchown(item, -1, fs_group)
        if item.is_symlink():
            continue
        mode = item.stat().st_mode & 0o7777
        mask = 0o440 if read_only else 0o660
        if item.is_dir():
            mask |= 0o2000 | 0o110
        item.chmod(mode | mask)


_DEFAULT_CAPABILITIES = frozenset(oci.DEFAULT_CAPABILITIES)


def container_spec(
    pod: Obj,
    container: Obj,
    *,
    argv: list[str],
    env: dict[str, str],
    mounts: list[tuple[str, str, bool]],
    netns: str,
) -> oci.Spec:
    """How a container runtime runs ``container`` of ``pod``: the user, groups, capabilities and
    file system rights of its securityContext (over the pod's), its volumes, the pod's network."""
    pod_sc = pod["spec"].get("securityContext") or {}
    sc = container.get("securityContext") or {}
    uid = sc.get("runAsUser", pod_sc.get("runAsUser"))
    gid = sc.get("runAsGroup", pod_sc.get("runAsGroup"))
    user = None if uid is None else (int(uid), int(gid if gid is not None else 0))
    groups = [int(g) for g in pod_sc.get("supplementalGroups") or []]
    if pod_sc.get("fsGroup") is not None:
        groups.append(int(pod_sc["fsGroup"]))
    caps = sc.get("capabilities") or {}
    dropped = {f"CAP_{c}" for c in caps.get("drop") or []}
    kept = set() if "CAP_ALL" in dropped else _DEFAULT_CAPABILITIES - dropped
    kept |= {f"CAP_{c}" for c in caps.get("add") or []}
    return oci.Spec(
        args=argv,
        env=env,
        user=user,
        supplementary_groups=groups,
        read_only_root=bool(sc.get("readOnlyRootFilesystem")),
        capabilities=sorted(kept),
        privileged=bool(sc.get("privileged")),
        no_new_privileges=sc.get("allowPrivilegeEscalation") is False,
        mounts=[oci.Mount(Path(source), target, read_only) for source, target, read_only in mounts],
        network_namespace=Path("/var/run/netns") / netns,
        hostname=pod["metadata"]["name"],
    )


def write_kmsg(node_root: Path, message: str, *, level: int = 3) -> None:
    """Append one record in /dev/kmsg format to a fake node's kernel log."""
    kmsg = node_root / "dev" / "kmsg"
    seq, ts = 0, 0
    for line in kmsg.read_text().splitlines():
        head = line.split(";", 1)[0].split(",")
        if len(head) >= 3 and head[1].isdigit():
            seq, ts = int(head[1]), int(head[2])
    with kmsg.open("a") as out:
        out.write(f"{level},{seq + 1},{ts + 1_000_000},-;{message}\n")


__all__ = ["FakeKubelet", "KubeletSettings", "fits", "write_kmsg"]
