"""The storm with the SHIPPED policy and overlay, on the real API server (issue 34, "Done when" item 1).

A real control plane (tests/kube: etcd, kube-apiserver, kube-controller-manager) holds `--nodes`
accelerator nodes (default 2,000; labelled nvidia.com/gpu.present=true, 8 `nvidia.com/gpu` each). On
them run, as the controllers make them and this benchmark binds them and marks them Running (no
kubelet runs): the exporter DaemonSet as deploy/overlays/enforce renders it (one pod per node, its IP
a loopback address where this benchmark answers the exporter's GET /evidence and GET /checks with the
checks token) and training jobs, ReplicaSets of 8 pods, one pod per node (grace period 0, so an
eviction deletes at once; a replacement stays Pending): a third of the jobs under a
PodDisruptionBudget that allows no disruption (a drain is blocked), a third under one that allows one
at a time, a third with none.

The remediator runs as shipped: `accel-health-remediator serve` in a process of its own, with the
arguments, the policy (remediator/default_policy.yaml, rendered into the ConfigMap
accel-health-remediator-policy) and the Alertmanager receiver of `kubectl kustomize
deploy/overlays/enforce` (no --dry-run; leader election on the Lease; the checks token, set as
deploy/README says; evidence and the repair loop on, as the policy has them), the files of its
volumes in a folder here, its kubeconfig that of its ServiceAccount bound by deploy/'s RBAC, reaching
the API server through the harness's policy/v1 skew proxy (the 1.20 server serves PDBs and evictions
as v1beta1), as a pod would. The Alertmanager URL (the overlay's one place to say which) is this
benchmark's Alertmanager.

Alertmanager is played: `--alerts` (default 5,000) alerts fire on the nodes (2 or 3 a node), each one
of the shipped rules whose alerts the shipped routing (examples/alertmanager.yaml) sends to the
remediator at once (severity critical, a node action), with the labels those rules and the exporter's
series give them. The nodes start alerting in a random order over `--ramp` seconds (default 60: a bad
driver rollout reaching the fleet), a node's further alerts within 10 s of its first. Its API v2
(GET /api/v2/alerts) shows the alerts firing so far (endsAt 4 min ahead, as Prometheus' resends keep
it); its webhook deliveries follow the shipped route: grouped by node, a group's first notification
at once (group_wait 0s), a change of the group at the next group_interval (5 s), never two of one
group at once, each delivery its own request (Alertmanager does not queue groups behind each other).
After the ramp, `--hold` seconds (default 60) with no delivery (the remediator's own 30 s reads of the
API go on), then every group is resent once over `--ramp` seconds (its repeat_interval come).

Measured: every delivery's answer (all must be 2xx) and its time (p50, p99, max; each phase and all);
the remediator's resident memory (VmRSS, sampled every 0.25 s: the largest) and its CPU use per phase
(from /proc/PID/stat: a process busy long after the deliveries stopped shows here); and, from the API
server's audit log, its writes during the storm by resource against the node actions it took (its
/metrics: accel_remediator_actions_total, done or started, dry_run false): one write of the node per
action (a drain: its start and its end), at most one Event each, as bench_node_records.py measures
today; the evidence ConfigMaps, evictions, the gate state and the Lease are listed apart.
Targets: every delivery 2xx, p99 <= 1 s, RSS <= 150 MiB, node writes = node actions, Events <=
node actions.

`--nodes 100 --alerts 250 --ramp 20 --hold 20` for a quick look. `--stacks S` dumps the remediator's
threads every S seconds while it is busy (faulthandler on SIGUSR1, in its log) and prints where they
were; `--profile FILE` runs it under cProfile and prints its top functions (both change how it is
started, not what it runs). `--workdir DIR` keeps every log.

Needs root (the harness) and the control-plane binaries (scripts/build-control-plane.sh).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import io
import json
import os
import pstats
import random
import re
import signal
import ssl
import statistics
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from aiohttp import web

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the control-plane harness lives in tests/kube

from examples.pipeline import free_port  # noqa: E402  after sys.path
from tests.kube.conftest import control_plane_skip_reason  # noqa: E402  after sys.path
from tests.kube.controlplane import (  # noqa: E402  after sys.path
    ControlPlane,
    Process,
    apply_objects,
    control_plane,
    request_of,
    shipped_remediator_account,
    spawn,
    wait_for,
)
from tests.kube.deployed import render  # noqa: E402  after sys.path
from tests.kube.kubelet import FakeKubelet  # noqa: E402  after sys.path
from tests.kube.network import Loop, SkewProxy  # noqa: E402  after sys.path
from tests.kube.rest import Obj  # noqa: E402  after sys.path
from tests.remediator.evidence_server import evidence_doc  # noqa: E402  after sys.path

NS = "accel-health"
REMEDIATOR = "accel-health-remediator"
USER = f"system:serviceaccount:{NS}:{REMEDIATOR}"
EXPORTER = "accel-health-exporter"
WORK = "training"
OVERLAY = "enforce"
WEBHOOK_TOKEN = "bench-webhook-token-0123456789"  # noqa: S105  throwaway process
CHECKS_TOKEN = "bench-checks-token-0123456789"  # noqa: S105  throwaway process
EXPORTER_PORT = 9835
JOB_SIZE = 8
WRITES = ("create", "update", "patch", "delete", "deletecollection")
NODE_ACTIONS = ("condition", "cordon", "taint", "evidence", "drain", "uncordon", "untaint")
"""Decisions that write their node (done, or a drain's start): each is one PATCH of the node or its
status carrying the record (an evidence capture: where it is; AWS actions: their intent)."""
RULE_FILES = ("gpu-xid.yaml", "gpu-memory.yaml", "pcie-nvlink.yaml", "infiniband.yaml", "active-checks.yaml")
"""The shipped rules of an NVIDIA node (neuron.yaml is Trainium's, exporter.yaml and remediator.yaml
say nothing about a node's hardware)."""


def node_name(i: int) -> str:
    return f"gpu-{i:04d}"


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))] if s else float("nan")


def rfc3339(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t * 1000) % 1000:03d}Z"


def seconds(text: str) -> float:
    """An Alertmanager duration (0s, 5s, 5m, 4h)."""
    units = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
    match = re.fullmatch(r"(\d+)(ms|s|m|h)", str(text))
    if not match:
        raise ValueError(f"duration {text!r}")
    return int(match.group(1)) * units[match.group(2)]


# -- what ships ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shipped:
    """The remediator of deploy/overlays/<overlay>, and the route and rules it gets alerts from."""

    args: list[str]
    env: dict[str, str]
    """The container's env that is not from the pod (ConfigMap keys: the Alertmanager settings)."""
    mounts: dict[str, str]
    """mountPath -> volume name."""
    policy: str
    exporter: Obj
    """The exporter DaemonSet."""
    route: dict[str, Any]
    """examples/alertmanager.yaml's route for critical node actions."""
    rules: list[dict[str, Any]]
    """The alerting rules that route sends to the remediator (name, labels)."""


def shipped() -> Shipped:
    objects = render(OVERLAY)
    deployment = next(o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == REMEDIATOR)
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    configmaps = {o["metadata"]["name"]: o.get("data") or {} for o in objects if o["kind"] == "ConfigMap"}
    env = {}
    for var in container.get("env") or []:
        ref = (var.get("valueFrom") or {}).get("configMapKeyRef")
        if ref:
            env[var["name"]] = configmaps[ref["name"]][ref["key"]]
        elif "value" in var:
            env[var["name"]] = var["value"]
    policy = configmaps[f"{REMEDIATOR}-policy"]["policy.yaml"]
    exporter = next(o for o in objects if o["kind"] == "DaemonSet" and o["metadata"]["name"] == EXPORTER)
    config = yaml.safe_load((ROOT / "examples" / "alertmanager.yaml").read_text())
    route = next(
        r
        for r in config["route"]["routes"]
        if r["receiver"] == REMEDIATOR and 'severity="critical"' in r.get("matchers", [])
    )
    actions = next(m for m in route["matchers"] if m.startswith("remediation=~"))
    wanted = set(actions.split('"')[1].split("|"))
    rules = []
    for name in RULE_FILES:
        for group in yaml.safe_load((ROOT / "alerts" / name).read_text())["groups"]:
            for rule in group["rules"]:
                labels = rule.get("labels") or {}
                routed = labels.get("severity") == "critical" and labels.get("remediation") in wanted
                if "alert" in rule and routed:
                    rules.append({"alertname": rule["alert"], **labels})
    return Shipped(
        args=list(container["args"]),
        env=env,
        mounts={m["mountPath"]: m["name"] for m in container.get("volumeMounts") or []},
        policy=policy,
        exporter=exporter,
        route=route,
        rules=rules,
    )


def remediator_argv(
    ship: Shipped, *, port: int, files: Path, kubeconfig: Path, alertmanager: str
) -> list[str]:
    """The shipped container's arguments, run here: $(VAR) expanded, the listen address on loopback,
    mounted paths under `files`, the Alertmanager URL this benchmark's, the kubeconfig added."""
    env = {**ship.env, "ALERTMANAGER_URLS": alertmanager}
    argv = []
    for raw in ship.args:
        arg = re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env[m.group(1)], raw)
        flag, _, value = arg.partition("=")
        if flag == "--listen":
            value = f"127.0.0.1:{port}"
        for mount, volume in ship.mounts.items():
            if value.startswith(mount + "/"):
                value = str(files / volume / value[len(mount) + 1 :])
        argv.append(f"{flag}={value}" if value else flag)
    if "--dry-run" in argv:
        raise SystemExit(f"deploy/overlays/{OVERLAY} runs the remediator in dry-run: not the shipped enforce")
    return [*argv, f"--kubeconfig={kubeconfig}"]


# -- the cluster ---------------------------------------------------------------------------------------


def exporter_ip(i: int) -> str:
    """The exporter pod's IP on node i: a loopback address this benchmark listens on."""
    return f"127.88.{i // 250}.{1 + i % 250}"


def trainer_ip(i: int) -> str:
    return f"10.244.{i // 250}.{1 + i % 250}"


def bind_and_run(plane: ControlPlane, pod: Obj, node: str, ip: str) -> None:
    """What the scheduler and the kubelet would do: bind the pod, mark it Running and Ready."""
    meta = pod["metadata"]
    path = f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}"
    if not pod["spec"].get("nodeName"):
        binding = {
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": {"name": meta["name"]},
            "target": {"apiVersion": "v1", "kind": "Node", "name": node},
        }
        plane.admin.create(f"{path}/binding", binding)
    now = rfc3339(time.time())
    conditions = [
        {"type": t, "status": "True", "lastTransitionTime": now}
        for t in ("Initialized", "Ready", "ContainersReady", "PodScheduled")
    ]
    status = {
        "phase": "Running",
        "hostIP": "10.213.0.1",
        "podIP": ip,
        "podIPs": [{"ip": ip}],
        "startTime": now,
        "conditions": conditions,
        "containerStatuses": [
            {
                "name": c["name"],
                "image": c.get("image", ""),
                "imageID": "",
                "ready": True,
                "started": True,
                "restartCount": 0,
                "state": {"running": {"startedAt": now}},
            }
            for c in pod["spec"]["containers"]
        ],
    }
    plane.admin.merge_patch(f"{path}/status", {"status": status})


def daemon_node(pod: Obj) -> str:
    """The node a DaemonSet pod is for (its nodeAffinity's matchFields, as the controller writes it)."""
    terms = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    for term in terms["nodeSelectorTerms"]:
        for expr in term.get("matchFields") or []:
            if expr["key"] == "metadata.name":
                return str(expr["values"][0])
    raise ValueError(f"no node in {pod['metadata']['name']}'s affinity")


def trainer_set(job: int) -> Obj:
    labels = {"app": f"trainer-{job:03d}"}
    return {
        "apiVersion": "apps/v1",
        "kind": "ReplicaSet",
        "metadata": {"name": f"trainer-{job:03d}", "namespace": WORK},
        "spec": {
            "replicas": JOB_SIZE,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "terminationGracePeriodSeconds": 0,
                    "containers": [{"name": "main", "image": "trainer:1"}],
                },
            },
        },
    }


def budget(job: int) -> Obj | None:
    """A third of the jobs allow no disruption, a third one at a time, a third have no budget."""
    if job % 3 == 2:
        return None
    return {
        "apiVersion": "policy/v1beta1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": f"trainer-{job:03d}", "namespace": WORK},
        "spec": {"maxUnavailable": job % 3, "selector": {"matchLabels": {"app": f"trainer-{job:03d}"}}},
    }


def populate(plane: ControlPlane, workdir: Path, ship: Shipped, nodes: int) -> tuple[str, int]:
    """The nodes, the exporter DaemonSet's pods and the training jobs' (bound and Running), the PDBs,
    the remediator's ServiceAccount with the shipped RBAC; its token and the PDB count."""
    fake = FakeKubelet(plane=plane, workdir=workdir)
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(
            pool.map(
                lambda i: fake.add_node(
                    node_name(i),
                    labels={"pool": "gpu", "nvidia.com/gpu.present": "true"},
                    capacity={"nvidia.com/gpu": "8"},
                ),
                range(nodes),
            )
        )
    ns = [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": n}} for n in (NS, WORK)]
    apply_objects(plane.admin, ns)
    token = shipped_remediator_account(plane, NS, REMEDIATOR)
    jobs = (nodes + JOB_SIZE - 1) // JOB_SIZE
    budgets = [b for j in range(jobs) if (b := budget(j)) is not None]
    daemonset = {k: v for k, v in ship.exporter.items() if k != "status"}
    apply_objects(plane.admin, [daemonset, *budgets, *(trainer_set(j) for j in range(jobs))])
    index = {node_name(i): i for i in range(nodes)}
    bound: set[str] = set()

    free_slots = {j: list(range(j * JOB_SIZE, min(nodes, (j + 1) * JOB_SIZE))) for j in range(jobs)}
    want = 2 * nodes  # the last job's replicas beyond the last node stay Pending
    deadline = time.monotonic() + 600
    while len(bound) < want and time.monotonic() < deadline:
        todo: list[tuple[Obj, str, str]] = []
        for namespace, selector in ((NS, f"app.kubernetes.io/name={EXPORTER}"), (WORK, None)):
            query = {"labelSelector": selector} if selector else {}
            for pod in plane.admin.items(f"/api/v1/namespaces/{namespace}/pods", **query):
                if pod["metadata"]["uid"] in bound:
                    continue
                if namespace == NS:
                    node = daemon_node(pod)
                    todo.append((pod, node, exporter_ip(index[node])))
                    continue
                slots = free_slots[int(pod["metadata"]["labels"]["app"].rsplit("-", 1)[1])]
                if slots:
                    slot = slots.pop()
                    todo.append((pod, node_name(slot), trainer_ip(slot)))
        with ThreadPoolExecutor(max_workers=8) as pool:
            list(pool.map(lambda t: bind_and_run(plane, *t), todo))
        bound |= {p["metadata"]["uid"] for p, _, _ in todo}
        if len(bound) < want:
            time.sleep(1.0)
    if len(bound) < want:
        raise RuntimeError(f"only {len(bound)} of {want} pods were made by the controllers in 10 minutes")
    return token, len(budgets)


class Proxy(SkewProxy):
    """The harness's policy/v1 skew proxy, passing the API server's answers decompressed: it drops
    Content-Encoding but passed a gzipped body (a list over 128 KiB: 100 nodes) as it came, which no
    client can read."""

    async def start(self) -> None:
        await super().start()
        raw = self._session
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=ssl.create_default_context(cafile=str(self.ca_file)), limit=0),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
        )
        if raw is not None:
            await raw.close()


@contextlib.contextmanager
def skew_proxy(plane: ControlPlane) -> Iterator[str]:
    loop = Loop()
    proxy = Proxy(
        upstream=plane.server,
        ca_file=plane.pki.ca_cert,
        cert_file=plane.pki.serving_cert,
        key_file=plane.pki.serving_key,
        host="127.0.0.1",
    )
    loop.run(proxy.start())
    try:
        yield f"https://127.0.0.1:{proxy.port}"
    finally:
        loop.run(proxy.stop())
        loop.close()


def kubeconfig(path: Path, *, server: str, ca: Path, token: str) -> Path:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "b", "cluster": {"server": server, "certificate-authority": str(ca)}}],
        "users": [{"name": "b", "user": {"token": token}}],
        "contexts": [{"name": "b", "context": {"cluster": "b", "user": "b", "namespace": NS}}],
        "current-context": "b",
    }
    path.write_text(yaml.safe_dump(config))
    return path


# -- the remediator, as shipped, in a process of its own -------------------------------------------------

WRAPPER = """
import cProfile, faulthandler, signal, sys
faulthandler.register(signal.SIGUSR1, all_threads=True)
from remediator.cli import main
profile = sys.argv[1]
prof = cProfile.Profile() if profile else None
if prof is not None:
    prof.enable()
try:
    code = main(sys.argv[2:])
finally:
    if prof is not None:
        prof.disable()
        prof.dump_stats(profile)
sys.exit(code)
"""


class Remediator:
    def __init__(self, argv: list[str], *, workdir: Path, profile: Path | None, stacks: bool) -> None:
        listen = next(a for a in argv if a.startswith("--listen="))
        self.url = "http://" + listen.split("=", 1)[1]
        if profile is not None or stacks:
            command = [sys.executable, "-c", WRAPPER, str(profile or ""), "serve", *argv]
        else:
            command = [str(Path(sys.executable).parent / "accel-health-remediator"), "serve", *argv]
        env = {**os.environ, "POD_NAMESPACE": NS, "POD_NAME": f"{REMEDIATOR}-bench-0"}
        self.process: Process = spawn("remediator", command, log_dir=workdir, env=env)
        self.argv = argv

    @property
    def pid(self) -> int:
        return self.process.popen.pid

    def wait_ready(self, timeout: float) -> None:
        def ready() -> bool:
            if self.process.popen.poll() is not None:
                raise RuntimeError("the remediator exited:\n" + self.process.tail())
            try:
                with urllib.request.urlopen(self.url + "/readyz", timeout=2) as resp:  # noqa: S310  loopback
                    return bool(resp.status == 200)
            except OSError:
                return False

        wait_for("the remediator ready (leader, caches synced)", ready, timeout=timeout, interval=0.25)

    def rss_mib(self) -> float:
        try:
            status = Path(f"/proc/{self.pid}/status").read_text()
        except OSError:
            return float("nan")
        return next(int(line.split()[1]) / 1024 for line in status.splitlines() if line.startswith("VmRSS:"))

    def cpu_seconds(self) -> float:
        try:
            fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return float("nan")
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        self.process.stop(timeout=30)


def metric_values(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    out = []
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        head, _, value = line.rpartition(" ")
        labels = dict(re.findall(r'(\w+)="([^"]*)"', head))
        out.append((labels, float(value)))
    return out


# -- Alertmanager, played -------------------------------------------------------------------------------


@dataclass
class Fired:
    node: str
    at: float
    """Seconds into the storm."""
    labels: dict[str, str]
    fingerprint: str
    starts: str = ""


def make_storm(ship: Shipped, *, nodes: int, alerts: int, ramp: float, seed: int) -> list[Fired]:
    """`alerts` alerts on `nodes` nodes (as even as can be), each node's first at a random moment of
    the ramp and its others within 10 s, each one of the shipped rules (a node never has one rule
    twice), with the labels of the rule and of the exporter series it fires on."""
    rng = random.Random(seed)
    per_node = [alerts // nodes + (1 if i < alerts % nodes else 0) for i in range(nodes)]
    rng.shuffle(per_node)
    fired = []
    for i, count in enumerate(per_node):
        node = node_name(i)
        first = rng.uniform(0, ramp)
        for k, rule in enumerate(rng.sample(ship.rules, min(count, len(ship.rules)))):
            gpu = rng.randrange(8)
            labels = {
                **rule,
                "node": node,
                "gpu": str(gpu),
                "pci_bus_id": f"0000:{0x18 + gpu * 0x10:02x}:00.0",
                "uuid": f"GPU-{i:08x}-0000-4000-8000-{gpu:012x}",
                "instance": f"{exporter_ip(i)}:{EXPORTER_PORT}",
                "job": EXPORTER,
                "namespace": NS,
                "pod": f"{EXPORTER}-{i:05x}",
                "container": "exporter",
                "endpoint": "metrics",
                "service": EXPORTER,
                "prometheus": "monitoring/k8s",
            }
            if rule["alertname"].startswith("AccelGPU") and "Xid" in rule["alertname"]:
                labels["xid"] = "79"
            text = json.dumps(sorted(labels.items()))
            fp = hashlib.blake2b(text.encode(), digest_size=8).hexdigest()
            at = first if k == 0 else first + rng.uniform(0, 10)
            fired.append(Fired(node=node, at=at, labels=labels, fingerprint=fp))
    return sorted(fired, key=lambda f: f.at)


@dataclass
class Delivery:
    phase: str
    node: str
    alerts: int
    answer: str
    seconds: float


@dataclass
class Alertmanager:
    """GET /api/v2/alerts (what fired so far) and the webhook deliveries of the shipped route."""

    storm: list[Fired]
    remediator: str
    receiver: str
    group_wait: float
    group_interval: float
    deliveries: list[Delivery] = field(default_factory=list)
    api_reads: int = 0
    t0: float = 0.0
    fired: int = 0
    """How many of `storm` (sorted by time) fire now."""
    _session: aiohttp.ClientSession | None = None
    _api_cache: tuple[int, int, bytes] = (-1, -1, b"")

    def doc(self, f: Fired) -> dict[str, Any]:
        return {
            "labels": f.labels,
            "annotations": {
                "summary": f"{f.labels['alertname']} on {f.node} (GPU {f.labels['gpu']})",
                "runbook_url": "https://github.com/accel-health/accel-health/blob/main/alerts/runbook.md#"
                + f.labels["alertname"].lower(),
            },
            "startsAt": f.starts,
            "generatorURL": "http://prometheus-k8s-0:9090/graph?g0.expr=accel",
            "fingerprint": f.fingerprint,
        }

    async def api(self, request: web.Request) -> web.Response:
        self.api_reads += 1
        wanted = request.query.get("receiver", "")
        if wanted and not re.fullmatch(wanted, REMEDIATOR):
            return web.json_response([])
        second = int(time.time())
        count, at, body = self._api_cache
        if count != self.fired or at != second:
            ends = rfc3339(second + 240)
            docs = [
                {
                    **self.doc(f),
                    "endsAt": ends,
                    "updatedAt": rfc3339(second),
                    "status": {"state": "active", "silencedBy": [], "inhibitedBy": []},
                    "receivers": [{"name": REMEDIATOR}],
                }
                for f in self.storm[: self.fired]
            ]
            body = json.dumps(docs).encode()
            self._api_cache = (self.fired, second, body)
        return web.Response(body=body, content_type="application/json")

    async def fire(self) -> None:
        """Each alert at its moment: its API shows it from then on."""
        for i, f in enumerate(self.storm):
            await asyncio.sleep(max(0.0, self.t0 + f.at - time.time()))
            self.fired = i + 1

    async def group(self, node: str, alerts: list[Fired], phase: str) -> None:
        """One aggregation group: its first notification after group_wait, then one per
        group_interval while it changed; one at a time."""
        first = self.t0 + min(f.at for f in alerts) + self.group_wait
        await asyncio.sleep(max(0.0, first - time.time()))
        sent: set[str] = set()
        tick = first
        while True:
            firing = [f for f in alerts if self.t0 + f.at <= time.time()]
            if {f.fingerprint for f in firing} != sent:
                await self.deliver(node, firing, phase)
                sent = {f.fingerprint for f in firing}
            if len(sent) == len(alerts):
                return
            tick += self.group_interval
            await asyncio.sleep(max(0.0, tick - time.time()))

    async def resend(self, node: str, alerts: list[Fired], at: float) -> None:
        await asyncio.sleep(max(0.0, at - time.time()))
        await self.deliver(node, alerts, "resend")

    async def deliver(self, node: str, alerts: list[Fired], phase: str) -> None:
        assert self._session is not None
        docs = [{**self.doc(f), "status": "firing", "endsAt": "0001-01-01T00:00:00Z"} for f in alerts]
        common = {k: v for k, v in alerts[0].labels.items() if all(f.labels.get(k) == v for f in alerts)}
        body = {
            "version": "4",
            "groupKey": '{}/{remediation=~"drain|cordon|taint|replace",severity="critical"}:'
            + f'{{node="{node}"}}',
            "truncatedAlerts": 0,
            "status": "firing",
            "receiver": REMEDIATOR,
            "groupLabels": {"node": node},
            "commonLabels": common,
            "commonAnnotations": {},
            "externalURL": "http://alertmanager-main-0:9093",
            "alerts": docs,
        }
        started = time.perf_counter()
        try:
            async with self._session.post(
                self.remediator + "/alerts", json=body, headers={"Authorization": f"Bearer {WEBHOOK_TOKEN}"}
            ) as resp:
                await resp.read()
                answer = str(resp.status)
        except TimeoutError:
            answer = "timeout"
        except aiohttp.ClientError as exc:
            answer = type(exc).__name__
        self.deliveries.append(Delivery(phase, node, len(alerts), answer, time.perf_counter() - started))

    async def storm_phase(self) -> None:
        by_node: dict[str, list[Fired]] = {}
        for f in self.storm:
            f.starts = rfc3339(self.t0 + f.at)
            by_node.setdefault(f.node, []).append(f)
        await asyncio.gather(self.fire(), *(self.group(n, a, "storm") for n, a in by_node.items()))

    async def resend_phase(self, ramp: float) -> None:
        by_node: dict[str, list[Fired]] = {}
        for f in self.storm:
            by_node.setdefault(f.node, []).append(f)
        rng = random.Random(7)
        start = time.time()
        await asyncio.gather(
            *(self.resend(n, a, start + rng.uniform(0, ramp)) for n, a in sorted(by_node.items()))
        )


# -- the exporters, played ----------------------------------------------------------------------------


class Exporters:
    """GET /evidence and GET /checks of every node's exporter pod, on its pod IP (a loopback
    address), with the checks token."""

    def __init__(self, nodes: int) -> None:
        self.nodes = nodes
        self.requests: Counter[str] = Counter()
        self._runner: web.AppRunner | None = None

    async def evidence(self, request: web.Request) -> web.Response:
        self.requests["evidence"] += 1
        if request.headers.get("Authorization") != f"Bearer {CHECKS_TOKEN}":
            return web.Response(status=401)
        host = request.transport.get_extra_info("sockname")[0] if request.transport else ""
        node = node_name(self._index(host))
        return web.json_response(evidence_doc(node))

    async def checks(self, request: web.Request) -> web.Response:
        self.requests["checks"] += 1
        if request.headers.get("Authorization") != f"Bearer {CHECKS_TOKEN}":
            return web.Response(status=401)
        names = (request.query.get("checks") or "remapped,power").split(",")
        return web.json_response(
            {"verdict": "pass", "results": [{"check": n, "verdict": "pass", "message": ""} for n in names]}
        )

    @staticmethod
    def _index(host: str) -> int:
        _, _, a, b = (int(x) for x in host.split("."))
        return a * 250 + b - 1

    async def start(self) -> int:
        app = web.Application()
        app.router.add_get("/evidence", self.evidence)
        app.router.add_get("/checks", self.checks)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        bound = 0
        for i in range(self.nodes):
            with contextlib.suppress(OSError):  # someone else's :9835 on every address: unreachable
                await web.TCPSite(self._runner, exporter_ip(i), EXPORTER_PORT, backlog=16).start()
                bound += 1
        return bound

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


# -- measuring -------------------------------------------------------------------------------------------


@dataclass
class Sampler:
    remediator: Remediator
    stacks_every: float
    armed: bool = False
    """Dumps only once it is ready (before, SIGUSR1 could come before faulthandler is registered)."""
    rss: list[tuple[float, float]] = field(default_factory=list)
    cpu: list[tuple[float, float]] = field(default_factory=list)
    dumps: int = 0

    async def run(self) -> None:
        last_dump = 0.0
        while True:
            now = time.time()
            self.rss.append((now, self.remediator.rss_mib()))
            self.cpu.append((now, self.remediator.cpu_seconds()))
            if (
                self.armed
                and self.stacks_every
                and now - last_dump >= self.stacks_every
                and self.busy(now, 2.0) > 0.5
            ):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.remediator.pid, signal.SIGUSR1)
                    self.dumps += 1
                last_dump = now
            await asyncio.sleep(0.25)

    def busy(self, now: float, window: float) -> float:
        """The share of one CPU the process used over the last `window` seconds."""
        past = [(t, c) for t, c in self.cpu if t >= now - window]
        if len(past) < 2:
            return 0.0
        return (past[-1][1] - past[0][1]) / max(past[-1][0] - past[0][0], 1e-6)

    def between(self, start: float, end: float) -> tuple[float, float]:
        """(max RSS MiB, CPU share) between two moments."""
        rss = [r for t, r in self.rss if start <= t <= end] or [float("nan")]
        cpu = [(t, c) for t, c in self.cpu if start <= t <= end]
        share = (cpu[-1][1] - cpu[0][1]) / max(cpu[-1][0] - cpu[0][0], 1e-6) if len(cpu) > 1 else float("nan")
        return max(rss), share


@dataclass
class AuditTail:
    path: Path
    offset: int = 0

    def skip(self) -> None:
        self.offset = self.path.stat().st_size

    def read(self) -> list[tuple[str, str, int]]:
        """(verb, resource[/subresource], code) of the remediator's requests since the last read."""
        with self.path.open("rb") as f:
            f.seek(self.offset)
            data = f.read()
        end = data.rfind(b"\n") + 1
        self.offset += end
        out = []
        for line in data[:end].splitlines():
            event = json.loads(line)
            if event.get("user", {}).get("username") != USER or event.get("stage") != "ResponseComplete":
                continue
            verb, resource = request_of(event)
            out.append((verb, resource, int((event.get("responseStatus") or {}).get("code", 0))))
        return out


def stack_summary(log: Path, limit: int = 12) -> list[str]:
    """The innermost frames of the event loop's thread in the faulthandler dumps of the log."""
    text = log.read_text(errors="replace")
    tops: Counter[str] = Counter()
    paths: Counter[str] = Counter()
    for block in re.split(r"\n(?=Thread 0x|Current thread 0x)", text):
        if "asyncio" not in block and "aiohttp" not in block and "remediator" not in block:
            continue
        frames = re.findall(r'File "([^"]+)", line (\d+) in (\S+)', block)
        ours = [(f, ln, fn) for f, ln, fn in frames if "/remediator/" in f]
        if frames and ("run_forever" in block or "_run_once" in block):
            f, ln, fn = frames[0]
            tops[f"{_short(f)}:{ln} {fn}"] += 1
            if ours:
                chain = " <- ".join(f"{_short(f)}:{fn}" for f, _, fn in ours[:4])
                paths[chain] += 1
    out = [f"{n:4d}  {where}" for where, n in tops.most_common(limit)]
    out += ["  remediator frames (innermost first):"]
    out += [f"{n:4d}  {chain}" for chain, n in paths.most_common(limit)]
    return out


def _short(path: str) -> str:
    for marker in ("/remediator/", "/site-packages/", "/lib/python3"):
        if marker in path:
            return path[path.index(marker) + 1 :]
    return path


def profile_summary(path: Path, limit: int = 25) -> list[str]:
    if not path.exists():
        return [f"no profile written at {path} (the process did not exit cleanly)"]
    stream = io.StringIO()
    stats = pstats.Stats(str(path), stream=stream)
    stats.sort_stats("tottime").print_stats(limit)
    stats.sort_stats("cumulative").print_stats(limit)
    return [line for line in stream.getvalue().splitlines() if line.strip()]


# -- the benchmark ----------------------------------------------------------------------------------------


@contextlib.contextmanager
def workdir_of(path: str | None) -> Iterator[Path]:
    if path:
        Path(path).mkdir(parents=True, exist_ok=True)
        yield Path(path)
        return
    with tempfile.TemporaryDirectory(prefix="accel-health-bench-") as tmp:
        yield Path(tmp)


def node_actions(metrics: str) -> Counter[str]:
    done: Counter[str] = Counter()
    for labels, value in metric_values(metrics, "accel_remediator_actions_total"):
        outcome, action = labels.get("outcome"), labels.get("action")
        # An evidence capture that failed still writes its node (the step's record), as it says.
        wrote = outcome in ("done", "started") or (action == "evidence" and outcome == "failed")
        if labels.get("dry_run") == "false" and wrote:
            done[f"{action} {outcome}"] += int(value)
    return done


def verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def latency_line(items: list[Delivery]) -> str:
    lat = [d.seconds for d in items]
    if not lat:
        return "none"
    return (
        f"{len(lat)} deliveries, p50 {statistics.median(lat) * 1000:.0f} ms, "
        f"p99 {pct(lat, 0.99) * 1000:.0f} ms, max {max(lat) * 1000:.0f} ms"
    )


async def run(args: argparse.Namespace) -> bool:  # noqa: PLR0915  one scenario, told in order
    ship = shipped()
    storm = make_storm(ship, nodes=args.nodes, alerts=args.alerts, ramp=args.ramp, seed=args.seed)
    with workdir_of(args.workdir) as workdir:
        t0 = time.monotonic()
        with control_plane(workdir / "control-plane") as plane, skew_proxy(plane) as proxy:
            token, pdbs = await asyncio.to_thread(populate, plane, workdir, ship, args.nodes)
            print(
                f"real API server with {args.nodes} nodes, {2 * args.nodes} pods (an exporter and a "
                f"trainer each), {pdbs} PodDisruptionBudgets, up in {time.monotonic() - t0:.0f} s; "
                f"logs in {workdir}",
                flush=True,
            )
            files = workdir / "volumes"
            for volume, name, text in (
                ("token", "token", WEBHOOK_TOKEN),
                ("policy", "policy.yaml", ship.policy),
                ("checks-token", "token", CHECKS_TOKEN),
            ):
                (files / volume).mkdir(parents=True, exist_ok=True)
                (files / volume / name).write_text(text)
            exporters = Exporters(args.nodes)
            listening = await exporters.start()
            am_port = free_port()
            route = ship.route
            async with aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=args.timeout)
            ) as session:
                argv = remediator_argv(
                    ship,
                    port=free_port(),
                    files=files,
                    kubeconfig=kubeconfig(
                        workdir / "remediator.kubeconfig", server=proxy, ca=plane.pki.ca_cert, token=token
                    ),
                    alertmanager=f"http://127.0.0.1:{am_port}",
                )
                am = Alertmanager(
                    storm=storm,
                    remediator="",
                    receiver=ship.env.get("ALERTMANAGER_RECEIVER", ""),
                    group_wait=seconds(route.get("group_wait", "30s")),
                    group_interval=seconds(route.get("group_interval", "5m")),
                )
                am._session = session
                app = web.Application()
                app.router.add_get("/api/v2/alerts", am.api)
                runner = web.AppRunner(app, access_log=None)
                await runner.setup()
                await web.TCPSite(runner, "127.0.0.1", am_port).start()
                profile = Path(args.profile) if args.profile else None
                remediator = Remediator(argv, workdir=workdir, profile=profile, stacks=bool(args.stacks))
                am.remediator = remediator.url
                print(f"remediator: accel-health-remediator serve {' '.join(remediator.argv)}")
                print(
                    f"policy: deploy/overlays/{OVERLAY}'s {REMEDIATOR}-policy; exporters listening on "
                    f"{listening} of {args.nodes} pod IPs; {len(ship.rules)} shipped rules routed at once "
                    f"(group_wait {route.get('group_wait')}, group_interval {route.get('group_interval')})",
                    flush=True,
                )
                sampler = Sampler(remediator, stacks_every=args.stacks)
                sampling = asyncio.create_task(sampler.run())
                audit = AuditTail(plane.workdir / "audit.log")
                try:
                    started = time.time()
                    await asyncio.to_thread(remediator.wait_ready, 300)
                    ready = time.time()
                    sampler.armed = True
                    print(
                        f"remediator ready (leader, node cache synced) in {ready - started:.1f} s", flush=True
                    )
                    await asyncio.sleep(2)
                    audit.skip()
                    idle_rss, idle_cpu = sampler.between(ready, time.time())
                    am.t0 = time.time() + 0.5
                    print(
                        f"storm: {len(storm)} alerts on {args.nodes} nodes over {args.ramp:g} s ...",
                        flush=True,
                    )
                    await am.storm_phase()
                    storm_end = time.time()
                    print(
                        f"  last delivery answered {storm_end - am.t0:.0f} s after the first alert",
                        flush=True,
                    )
                    await asyncio.sleep(args.hold)
                    hold_end = time.time()
                    writes = await asyncio.to_thread(audit.read)
                    print(f"resend of every group over {args.ramp:g} s ...", flush=True)
                    await am.resend_phase(args.ramp)
                    resend_end = time.time()
                    await asyncio.sleep(3)
                    resend_writes = await asyncio.to_thread(audit.read)
                    async with session.get(remediator.url + "/metrics") as resp:
                        metrics = await resp.text()
                    (workdir / "remediator-metrics.txt").write_text(metrics)
                    async with session.get(
                        remediator.url + "/state", headers={"Authorization": f"Bearer {WEBHOOK_TOKEN}"}
                    ) as resp:
                        state = await resp.text()
                finally:
                    sampling.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await sampling
                    await asyncio.to_thread(remediator.stop)
                    await runner.cleanup()
                    await exporters.stop()
    return report(
        args=args,
        am=am,
        sampler=sampler,
        moments=(ready, am.t0, storm_end, hold_end, resend_end),
        idle=(idle_rss, idle_cpu),
        writes=writes,
        resend_writes=resend_writes,
        metrics=metrics,
        state=state,
        exporters=exporters,
        remediator=remediator,
        profile=profile,
    )


def report(
    *,
    args: argparse.Namespace,
    am: Alertmanager,
    sampler: Sampler,
    moments: tuple[float, float, float, float, float],
    idle: tuple[float, float],
    writes: list[tuple[str, str, int]],
    resend_writes: list[tuple[str, str, int]],
    metrics: str,
    state: str,
    exporters: Exporters,
    remediator: Remediator,
    profile: Path | None,
) -> bool:
    ready, t0, storm_end, hold_end, resend_end = moments
    ds = am.deliveries
    answers = Counter(d.answer for d in ds)
    print(f"\nStorm with the shipped policy and overlay: {args.alerts} firing alerts on {args.nodes} nodes")
    print(
        f"  deliveries: {len(ds)}; answers {dict(sorted(answers.items()))}; "
        f"Alertmanager API read {am.api_reads} times"
    )
    for phase in ("storm", "resend"):
        print(f"  {phase:6}: {latency_line([d for d in ds if d.phase == phase])}")
    print(f"  all   : {latency_line(ds)}")
    peak = max((r for _, r in sampler.rss), default=float("nan"))
    print(f"  remediator RSS: max {peak:.1f} MiB (ready and idle: {idle[0]:.1f} MiB)")
    for label, (a, b) in (
        ("idle after ready", (ready, t0)),
        ("storm (deliveries)", (t0, storm_end)),
        (f"hold ({args.hold:g} s, no delivery)", (storm_end, hold_end)),
        ("resend", (hold_end, resend_end)),
    ):
        rss, cpu = sampler.between(a, b)
        print(f"  {label:32} {b - a:6.1f} s  CPU {cpu * 100:5.1f} % of a core, RSS max {rss:6.1f} MiB")
    done = node_actions(metrics)
    actions = sum(n for k, n in done.items() if k.split()[0] in NODE_ACTIONS)
    by = Counter((v, r) for v, r, _ in writes if v in WRITES)
    node_writes = sum(n for (_, r), n in by.items() if r in ("nodes", "nodes/status"))
    events = sum(n for (_, r), n in by.items() if r == "events")
    print(
        f"  node actions taken (done, a drain started, an evidence capture failed): {actions}: "
        + ", ".join(f"{k} {n}" for k, n in sorted(done.items()))
    )
    print(f"  writes during the storm and the hold (audit log), by verb and resource: {len(writes)} requests")
    for (verb, resource), n in sorted(by.items(), key=lambda kv: -kv[1]):
        print(f"    {n:6d} {verb} {resource}")
    reads = Counter((v, r) for v, r, _ in writes if v not in WRITES)
    print(
        "    reads: "
        + ", ".join(f"{v} {r} {n}" for (v, r), n in sorted(reads.items(), key=lambda kv: -kv[1]))
    )
    failed = Counter((v, r, c) for v, r, c in writes if c >= 400)
    if failed:
        print("    refused or failed: " + ", ".join(f"{v} {r} {c} x{n}" for (v, r, c), n in failed.items()))
    resend_by = Counter((v, r) for v, r, _ in resend_writes if v in WRITES and r != "leases")
    print(
        f"  per node action: {node_writes / max(actions, 1):.2f} node writes, "
        f"{events / max(actions, 1):.2f} Events"
        f"; writes during the resends (leases aside): {sum(resend_by.values())}"
        + (f" ({dict(resend_by)})" if resend_by else "")
    )
    gates = metric_values(metrics, "accel_remediator_breaker_open")
    polls = metric_values(metrics, "accel_remediator_alertmanager_polls_total")
    print(
        f"  breaker open: {gates[0][1] if gates else '?'}; Alertmanager reads by the remediator: "
        + ", ".join(f"{lab.get('result')} {int(v)}" for lab, v in polls)
        + f"; exporter requests {dict(exporters.requests)}"
    )
    with contextlib.suppress(ValueError):
        doc = json.loads(state)
        print("  /state: " + json.dumps({k: doc[k] for k in list(doc)[:12]})[:600])
    if args.stacks:
        print(
            f"  where the event loop was in {sampler.dumps} dumps while busy (faulthandler, innermost frame):"
        )
        for line in stack_summary(remediator.process.log):
            print("    " + line)
    if profile is not None:
        print(f"  cProfile of the remediator ({profile}):")
        for line in profile_summary(profile):
            print("    " + line)
    ok_2xx = all(d.answer.isdigit() and 200 <= int(d.answer) < 300 for d in ds) and bool(ds)
    lat = [d.seconds for d in ds]
    ok_p99 = bool(lat) and pct(lat, 0.99) <= 1.0
    ok_rss = peak <= 150
    ok_writes = node_writes == actions and events <= actions and not resend_by
    print(
        f"targets: every delivery 2xx {verdict(ok_2xx)}; p99 <= 1 s {verdict(ok_p99)}; "
        f"RSS <= 150 MiB {verdict(ok_rss)}; one node write per action (+ <= 1 Event), none for a "
        f"resend {verdict(ok_writes)}"
    )
    return ok_2xx and ok_p99 and ok_rss and ok_writes


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=2000)
    parser.add_argument("--alerts", type=int, default=5000)
    parser.add_argument(
        "--ramp", type=float, default=60.0, help="seconds over which the nodes start alerting"
    )
    parser.add_argument("--hold", type=float, default=60.0, help="seconds with no delivery after the storm")
    parser.add_argument("--timeout", type=float, default=30.0, help="a delivery's limit (s)")
    parser.add_argument("--seed", type=int, default=34)
    parser.add_argument("--stacks", type=float, default=0.0, help="dump its threads every S s while busy")
    parser.add_argument("--profile", help="run the remediator under cProfile, stats to this file")
    parser.add_argument("--workdir", help="keep the control plane's and the remediator's files and logs here")
    args = parser.parse_args()
    if args.profile:
        args.profile = str(Path(args.profile).resolve())
    reason = control_plane_skip_reason()
    if reason:
        print(f"skipped: {reason}")
        return 0
    return 0 if asyncio.run(run(args)) else 1


if __name__ == "__main__":
    sys.exit(main())
