"""etcd + kube-apiserver + kube-controller-manager on loopback, with RBAC on, for the tests.

The binaries come from `KUBEBUILDER_ASSETS` (envtest's convention: a folder with etcd, kube-apiserver
and kube-controller-manager) or from the cache `scripts/build-control-plane.sh` fills once
(`make test` runs it): ``${XDG_CACHE_HOME:-~/.cache}/accel-health/kube/<version>/``.

Authentication is a static token for the admin (system:masters) and service-account tokens signed by
a key pair of the harness; the token controller of kube-controller-manager writes each
ServiceAccount's token Secret, so a test authenticates exactly as a pod of that ServiceAccount would
and the shipped RBAC is what the API server enforces. No kubelet and no scheduler run: the kubelet
stand-in (tests/kube/kubelet.py) plays both for fake nodes. The node lifecycle controller is off, so
fake nodes stay Ready without heartbeats.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import threading
import time
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from kubernetes.aio import client as k8s

from examples.pipeline import die_with_parent, free_port
from tests.kube.pki import Pki, write_pki
from tests.kube.rest import ApiError, Obj, Rest

VERSION = "1.20.2"
BUILD = 2
"""scripts/build-control-plane.sh's BUILD: the cache folder of another build is not used."""
BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager")
ADMIN_USER = "accel-health-test-admin"


class ControlPlaneUnavailable(Exception):
    """The binaries are not there (the message says how to get them)."""


def cache_dir() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "accel-health" / "kube" / f"{VERSION}-{BUILD}"


def find_binaries() -> Path:
    """The folder holding etcd, kube-apiserver and kube-controller-manager."""
    assets = os.environ.get("KUBEBUILDER_ASSETS")
    folder = Path(assets) if assets else cache_dir()
    missing = [b for b in BINARIES if not os.access(folder / b, os.X_OK)]
    if missing:
        where = f"KUBEBUILDER_ASSETS={assets}" if assets else str(folder)
        raise ControlPlaneUnavailable(
            f"{where} lacks {', '.join(missing)}: run scripts/build-control-plane.sh "
            "(`make test` does, once) or point KUBEBUILDER_ASSETS at a folder with them"
        )
    return folder


def wait_for(what: str, check: Callable[[], bool], *, timeout: float, interval: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if check():
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


async def eventually(check: Callable[[], Awaitable[bool]], seconds: float = 10.0) -> None:
    """`wait_for` for a test's event loop: await `check` until it holds (TimeoutError after `seconds`)."""
    async with asyncio.timeout(seconds):
        while True:
            if await check():
                return
            await asyncio.sleep(0.1)


@dataclass
class Repeating:
    """Calls `action` every `interval` seconds on a daemon thread of its own, from `start` to `stop`:
    the harness's pollers (pod discovery, the connection recorder)."""

    action: Callable[[], object]
    interval: float
    name: str
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.action()


def cordoned(plane: ControlPlane) -> list[str]:
    """The nodes with spec.unschedulable, sorted."""
    return sorted(
        n["metadata"]["name"] for n in plane.admin.items("/api/v1/nodes") if n["spec"].get("unschedulable")
    )


def request_of(event: Obj) -> tuple[str, str]:
    """(verb, resource[/subresource]) of an audit event."""
    ref = event.get("objectRef") or {}
    sub = ref.get("subresource")
    return str(event["verb"]), str(ref.get("resource", "")) + (f"/{sub}" if sub else "")


def deployment(name: str, namespace: str, *, node_selector: dict[str, str], replicas: int = 1) -> Obj:
    """A Deployment of `replicas` trainer pods (label app=`name`) on the nodes `node_selector` picks."""
    labels = {"app": name}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "nodeSelector": node_selector,
                    "containers": [{"name": "main", "image": "trainer:1"}],
                },
            },
        },
    }


@dataclass
class Process:
    """A started child process with its log file."""

    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def tail(self, lines: int = 30) -> str:
        text = self.log.read_text(errors="replace").splitlines()[-lines:]
        return f"--- {self.name} (exit {self.popen.poll()}) ---\n" + "\n".join(text)

    def stop(self, *, timeout: float = 10.0, sig: int = signal.SIGTERM) -> None:
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, sig)
            try:
                self.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait()


def spawn(
    name: str, argv: list[str], *, log_dir: Path, env: dict[str, str] | None = None, cwd: Path | None = None
) -> Process:
    """Start `argv` in a session of its own, logging to `log_dir/name.log`; it dies with this process."""
    log = log_dir / f"{name}.log"
    with log.open("ab") as out:
        popen = subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=cwd,
            start_new_session=True,
            preexec_fn=die_with_parent,  # noqa: PLW1509 -- prctl only, no locks or threads touched
        )
    return Process(name=name, popen=popen, log=log)


@dataclass
class ControlPlane:
    """A running control plane; `admin` talks to it as system:masters."""

    workdir: Path
    pki: Pki
    server: str
    """https://127.0.0.1:PORT of kube-apiserver."""
    admin_token: str
    kubeconfig: Path
    """An admin kubeconfig (kubectl, kube-controller-manager)."""
    processes: list[Process] = field(default_factory=list)
    extra_ips: tuple[str, ...] = ()
    etcd: str = ""
    """http://127.0.0.1:PORT of etcd's client endpoint (its v3 HTTP gateway answers there too)."""

    @property
    def admin(self) -> Rest:
        return Rest(server=self.server, token=self.admin_token, ca_file=self.pki.ca_cert)

    def as_service_account(self, namespace: str, name: str, *, server: str | None = None) -> Rest:
        return Rest(
            server=server or self.server,
            token=self.service_account_token(namespace, name),
            ca_file=self.pki.ca_cert,
        )

    def service_account_token(self, namespace: str, name: str, *, timeout: float = 30.0) -> str:
        """The token the token controller wrote for the ServiceAccount (base64-decoded)."""
        found: list[str] = []

        def ready() -> bool:
            for secret in self.admin.items(f"/api/v1/namespaces/{namespace}/secrets"):
                annotations = secret["metadata"].get("annotations") or {}
                if (
                    secret.get("type") == "kubernetes.io/service-account-token"
                    and annotations.get("kubernetes.io/service-account.name") == name
                    and (secret.get("data") or {}).get("token")
                ):
                    found.append(base64.b64decode(secret["data"]["token"]).decode())
                    return True
            return False

        wait_for(f"the token of ServiceAccount {namespace}/{name}", ready, timeout=timeout, interval=0.2)
        return found[0]

    def cluster_admin_account(self, namespace: str, name: str) -> str:
        """A ServiceAccount (and its namespace) bound to cluster-admin, so that the audit log tells
        its requests apart while RBAC refuses it nothing; its token."""
        apply_objects(
            self.admin,
            [
                {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}},
                {
                    "apiVersion": "v1",
                    "kind": "ServiceAccount",
                    "metadata": {"name": name, "namespace": namespace},
                },
                {
                    "apiVersion": "rbac.authorization.k8s.io/v1",
                    "kind": "ClusterRoleBinding",
                    "metadata": {"name": name},
                    "roleRef": {
                        "apiGroup": "rbac.authorization.k8s.io",
                        "kind": "ClusterRole",
                        "name": "cluster-admin",
                    },
                    "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}],
                },
            ],
        )
        return self.service_account_token(namespace, name)

    def api_client(self, *, token: str | None = None, server: str | None = None) -> k8s.ApiClient:
        """A Kubernetes client as the remediator builds one: a bearer token (the admin's unless
        given) and this plane's CA, to the API server or to `server` (a proxy in front of it)."""
        cfg = k8s.Configuration(host=server or self.server)
        cfg.api_key = {"authorization": token or self.admin_token}
        cfg.api_key_prefix = {"authorization": "Bearer"}
        cfg.ssl_ca_cert = str(self.pki.ca_cert)
        return k8s.ApiClient(cfg)

    def kubectl(self, *args: str, stdin: str | None = None, check: bool = True) -> str:
        kubectl = shutil.which("kubectl")
        if kubectl is None:
            raise ControlPlaneUnavailable("kubectl is not installed")
        proc = subprocess.run(
            [kubectl, f"--kubeconfig={self.kubeconfig}", *args],
            input=stdin,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if check and proc.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)}: exit {proc.returncode}\n{proc.stderr}")
        return proc.stdout + proc.stderr

    def logs(self) -> str:
        return "\n".join(p.tail() for p in self.processes)

    def audit(self, *, user: str | None = None) -> list[Obj]:
        """The API server's audit events (ResponseComplete, or ResponseStarted for a watch), optionally
        of one user only."""
        events = []
        path = self.workdir / "audit.log"
        if not path.exists():
            return []
        for line in path.read_text().splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue  # a line being written
            stage = event.get("stage")
            # A watch completes only when it ends (minutes later): count it when its answer starts.
            started_watch = stage == "ResponseStarted" and event.get("verb") == "watch"
            if stage != "ResponseComplete" and not started_watch:
                continue
            if user is None or event.get("user", {}).get("username") == user:
                events.append(event)
        return events

    def stop(self) -> None:
        for proc in reversed(self.processes):
            proc.stop()


def _kubeconfig(path: Path, *, server: str, ca: Path, token: str) -> None:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "test", "cluster": {"server": server, "certificate-authority": str(ca)}}],
        "users": [{"name": "admin", "user": {"token": token}}],
        "contexts": [{"name": "test", "context": {"cluster": "test", "user": "admin"}}],
        "current-context": "test",
    }
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)


def start_control_plane(
    workdir: Path, *, extra_ips: tuple[str, ...] = (), apiserver_args: tuple[str, ...] = ()
) -> ControlPlane:
    """Starts etcd, kube-apiserver and kube-controller-manager; returns once the API answers and the
    controllers have made the default ServiceAccount. `extra_ips` go into the serving certificate;
    `apiserver_args` are added to kube-apiserver's."""
    bins = find_binaries()
    workdir.mkdir(parents=True, exist_ok=True)
    pki = write_pki(workdir / "pki", ips=extra_ips)
    token = secrets.token_hex(16)
    (workdir / "tokens.csv").write_text(f"{token},{ADMIN_USER},{ADMIN_USER},system:masters\n")
    # Every request at Metadata level: who did what to which object, and the answer's code. The tests
    # read it to prove the shipped RBAC is enough (no 403) and not too much (every rule used).
    (workdir / "audit-policy.yaml").write_text(
        "apiVersion: audit.k8s.io/v1\nkind: Policy\n"
        "omitStages: [RequestReceived]\nrules:\n  - level: Metadata\n"
    )
    etcd_client, etcd_peer, api_port = free_port(), free_port(), free_port()
    server = f"https://127.0.0.1:{api_port}"
    kubeconfig = workdir / "admin.kubeconfig"
    _kubeconfig(kubeconfig, server=server, ca=pki.ca_cert, token=token)
    plane = ControlPlane(
        workdir=workdir,
        pki=pki,
        server=server,
        admin_token=token,
        kubeconfig=kubeconfig,
        extra_ips=extra_ips,
        etcd=f"http://127.0.0.1:{etcd_client}",
    )
    try:
        plane.processes.append(
            spawn(
                "etcd",
                [
                    str(bins / "etcd"),
                    f"--data-dir={workdir / 'etcd'}",
                    f"--listen-client-urls=http://127.0.0.1:{etcd_client}",
                    f"--advertise-client-urls=http://127.0.0.1:{etcd_client}",
                    f"--listen-peer-urls=http://127.0.0.1:{etcd_peer}",
                    f"--initial-advertise-peer-urls=http://127.0.0.1:{etcd_peer}",
                    f"--initial-cluster=default=http://127.0.0.1:{etcd_peer}",
                    "--unsafe-no-fsync",
                    "--log-level=warn",
                ],
                log_dir=workdir,
                # Debian's etcd 3.4 on amd64 needs no ETCD_UNSUPPORTED_ARCH; harmless elsewhere.
                env={**os.environ, "ETCD_UNSUPPORTED_ARCH": os.uname().machine},
            )
        )
        plane.processes.append(
            spawn(
                "kube-apiserver",
                [
                    str(bins / "kube-apiserver"),
                    f"--etcd-servers=http://127.0.0.1:{etcd_client}",
                    "--bind-address=127.0.0.1",
                    "--advertise-address=127.0.0.1",
                    f"--secure-port={api_port}",
                    f"--tls-cert-file={pki.serving_cert}",
                    f"--tls-private-key-file={pki.serving_key}",
                    f"--client-ca-file={pki.ca_cert}",
                    f"--token-auth-file={workdir / 'tokens.csv'}",
                    "--authorization-mode=RBAC",
                    f"--service-account-key-file={pki.sa_pub}",
                    f"--service-account-signing-key-file={pki.sa_key}",
                    "--service-account-issuer=https://kubernetes.default.svc",
                    "--service-cluster-ip-range=10.96.0.0/16",
                    # No ServiceAccount admission: the kubelet stand-in mounts the tokens itself.
                    # No TaintNodesByCondition: fake nodes have no kubelet to clear the taints.
                    "--disable-admission-plugins=ServiceAccount,TaintNodesByCondition",
                    "--allow-privileged=true",
                    f"--cert-dir={workdir / 'apiserver-certs'}",
                    "--profiling=false",
                    "--enable-priority-and-fairness=false",
                    "--event-ttl=1h",
                    f"--audit-policy-file={workdir / 'audit-policy.yaml'}",
                    f"--audit-log-path={workdir / 'audit.log'}",
                    "--audit-log-format=json",
                    "--audit-log-mode=blocking",
                    *apiserver_args,
                ],
                log_dir=workdir,
            )
        )

        def api_ready() -> bool:
            if plane.processes[-1].popen.poll() is not None:
                raise RuntimeError("kube-apiserver exited\n" + plane.logs())
            try:
                plane.admin.get("/api/v1/namespaces/default")
            except (ApiError, OSError, ValueError):
                return False
            return True

        wait_for("kube-apiserver /readyz", api_ready, timeout=60)
        plane.processes.append(
            spawn(
                "kube-controller-manager",
                [
                    str(bins / "kube-controller-manager"),
                    f"--kubeconfig={kubeconfig}",
                    "--controllers=*,-nodelifecycle,-csrsigning,-csrapproving,-csrcleaner,-nodeipam,"
                    "-attachdetach,-persistentvolume-binder,-persistentvolume-expander,-pvc-protection,"
                    "-pv-protection,-cloud-node-lifecycle,-route,-service,-ttl-after-finished,-bootstrapsigner,"
                    "-tokencleaner",
                    f"--service-account-private-key-file={pki.sa_key}",
                    f"--root-ca-file={pki.ca_cert}",
                    "--use-service-account-credentials=false",
                    "--leader-elect=false",
                    "--port=0",
                    "--secure-port=0",
                    "--concurrent-deployment-syncs=2",
                    # PDB status follows pod readiness quickly (the default resync is 30 s).
                    "--min-resync-period=5s",
                ],
                log_dir=workdir,
            )
        )
        wait_for(
            "the default ServiceAccount's token",
            lambda: bool(plane.service_account_token("default", "default")),
            timeout=60,
        )
    except BaseException:
        plane.stop()
        raise
    return plane


@contextlib.contextmanager
def control_plane(
    workdir: Path, *, extra_ips: tuple[str, ...] = (), apiserver_args: tuple[str, ...] = ()
) -> Iterator[ControlPlane]:
    plane = start_control_plane(workdir, extra_ips=extra_ips, apiserver_args=apiserver_args)
    try:
        yield plane
    finally:
        plane.stop()


def compact_etcd(plane: ControlPlane) -> int:
    """Compact etcd to its current revision (through its v3 HTTP gateway), as the API server's own
    compactor does every few minutes: a watch from an older resourceVersion is answered 410 Gone.
    Returns the revision compacted to."""

    def post(path: str, body: Obj) -> Obj:
        url = plane.etcd + path  # http://127.0.0.1:PORT of the etcd this harness started
        data = json.dumps(body).encode()
        request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})  # noqa: S310  http, ours
        with urllib.request.urlopen(request, timeout=10) as answer:  # noqa: S310  http, ours
            result: Obj = json.loads(answer.read())
            return result

    revision = int(post("/v3/kv/range", {"key": base64.b64encode(b"/").decode()})["header"]["revision"])
    post("/v3/kv/compaction", {"revision": str(revision), "physical": True})
    return revision


def forget_remediation(plane: ControlPlane, *, namespace: str, state_configmap: str) -> None:
    """Every node schedulable and without the remediator's annotations, and no stored gate state:
    a clean slate between tests that share a control plane."""
    for node in plane.admin.items("/api/v1/nodes"):
        annotations = {k: None for k in node["metadata"].get("annotations") or {} if "accel-health" in k}
        patch: Obj = {"spec": {"unschedulable": None}, "metadata": {"annotations": annotations}}
        plane.admin.merge_patch(f"/api/v1/nodes/{node['metadata']['name']}", patch)
    try:
        plane.admin.delete(f"/api/v1/namespaces/{namespace}/configmaps/{state_configmap}")
    except ApiError as exc:
        if exc.status != 404:
            raise


def apply_objects(rest: Rest, objects: list[Obj]) -> None:
    """Create-or-replace a list of objects through `rest` (used for fixtures, not for deploy/)."""
    for obj in objects:
        path = object_path(obj)
        try:
            rest.create(path, obj)
        except ApiError as exc:
            if exc.status != 409:
                raise
            name = obj["metadata"]["name"]
            rest.merge_patch(f"{path}/{name}", obj)


def shipped_remediator_account(
    plane: ControlPlane, namespace: str, name: str = "accel-health-remediator"
) -> str:
    """The remediator's ServiceAccount in `namespace`, bound by deploy/'s RBAC as shipped; its token."""
    repo = Path(__file__).resolve().parents[2]
    rbac = [doc for doc in yaml.safe_load_all((repo / "deploy/base/remediator-rbac.yaml").read_text()) if doc]
    account = {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": {"name": name, "namespace": namespace},
    }
    apply_objects(plane.admin, [account, *rbac])
    return plane.service_account_token(namespace, name)


_PLURALS = {
    "Namespace": ("api/v1", "namespaces", False),
    "Node": ("api/v1", "nodes", False),
    "Pod": ("api/v1", "pods", True),
    "Secret": ("api/v1", "secrets", True),
    "ConfigMap": ("api/v1", "configmaps", True),
    "ServiceAccount": ("api/v1", "serviceaccounts", True),
    "Deployment": ("apis/apps/v1", "deployments", True),
    "ReplicaSet": ("apis/apps/v1", "replicasets", True),
    "DaemonSet": ("apis/apps/v1", "daemonsets", True),
    "PodDisruptionBudget": ("apis/policy/v1beta1", "poddisruptionbudgets", True),
    "CustomResourceDefinition": ("apis/apiextensions.k8s.io/v1", "customresourcedefinitions", False),
    "ClusterRoleBinding": ("apis/rbac.authorization.k8s.io/v1", "clusterrolebindings", False),
    "ClusterRole": ("apis/rbac.authorization.k8s.io/v1", "clusterroles", False),
    "Role": ("apis/rbac.authorization.k8s.io/v1", "roles", True),
    "RoleBinding": ("apis/rbac.authorization.k8s.io/v1", "rolebindings", True),
}


def object_path(obj: Obj) -> str:
    """The collection path of `obj` (kinds the harness creates itself)."""
    base, plural, namespaced = _PLURALS[obj["kind"]]
    if namespaced:
        return f"/{base}/namespaces/{obj['metadata'].get('namespace', 'default')}/{plural}"
    return f"/{base}/{plural}"
