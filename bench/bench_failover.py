"""Fail-over of the remediator on the real API server at 2,000 nodes (issue 23, figures 5 and 6).

A real control plane (tests/kube: etcd, kube-apiserver, kube-controller-manager) holds 2,000
accelerator nodes, each an instance of one Auto Scaling group in moto's server (spec.providerID).
The remediator runs as shipped, `accel-health-remediator serve` in processes of their own: two
replicas with leader election on the Lease (`--lease-duration 4`: renew deadline 2.7 s, retry period
1 s), each as a ServiceAccount of its own (bound to cluster-admin) so that the API server's audit log
tells their requests apart, each reading Alertmanager's API v2 as the shipped Deployment does, with
`--aws` against moto. Alertmanager is played by this benchmark: faults fire and resolve on random
nodes by a seeded script (about one a second, each for 20 to 120 s, so 40 to 80 nodes alert at once
against a budget of 20); its API v2 serves the alerts firing now; its webhook deliveries (one group
per node, as the shipped routing) go to the replica whose /readyz is 200 (as a Service would), are
retried until one answers 200, resent every minute, and a resolve is sometimes resent. The policy:
condition, cordon, taint, aws_set_unhealthy; on resolve uncordon, untaint, condition; at most 20
nodes disrupted; no storm breaker; no Events, no drains (no pods on the nodes), no reboots.

Figure 5, fail-over time:
- `--kills` times (default 20), at a random moment 0.5 to 5 s after both replicas are up, the leader
  (the replica whose /readyz is 200 and whose identity the Lease's holderIdentity shows) gets
  SIGKILL. The Lease is read every 50 ms (holderIdentity, acquireTime), both replicas' /readyz too.
  Printed per kill: the Lease taken (acquireTime) after the kill, the new leader's /readyz 200 after
  it took the Lease, and after the kill; p50 and max. Goal: ready <= 2 s after taking the Lease. A
  replacement replica is started once the new leader is ready, so two always run.
- A failed read at election, `--failed-reads` times (default 3): the follower is replaced by one that
  reaches the API server through a fault-injecting proxy; with the faults on, every request of it
  but the Lease's is answered 503 (its watch of the nodes, open before, keeps streaming); the leader
  gets SIGKILL; the faulty replica takes the Lease, its rebuild fails (the gates ConfigMap read) and
  is retried with back-off, /readyz stays 503; 2 to 8 s after the takeover the faults stop ("the API
  comes back"). Printed: the failed rebuilds (its log) and its /readyz 200 after the API came back.
  Goal: <= 10 s.

Figure 6, the invariants across those kills and with two leaders at once. The benchmark watches
every node (as admin) and checks:
- every cordon (spec.unschedulable false -> true) and every taint of the policy appearing is made by
  a write that carries this service's ownership annotation and records the episode it is for
  (`accel-health.io/episodes`: an episode whose cordon or taint step is newly decided in that write);
- per node and episode (fingerprint + startsAt) at most one cordon, one taint and one
  SetInstanceHealth over the whole run (moto's calls, through a counting proxy, each counted for the
  episodes whose intent the node's record showed);
- every second: the nodes this service holds (cordoned by it, or carrying a taint it added) are at
  most the budget, and each carries the record of an episode of the rule that cordons and taints;
- two leaders at once, `--stops` times (default 3): the leader gets SIGSTOP at a random moment (a
  replica paused past its Lease: when it runs again it still believes it leads), a webhook delivery
  of new faults is queued to it, the other replica takes over and acts; then SIGCONT. The paused
  replica must write nothing once it runs again (the audit log: writes by its ServiceAccount
  received after SIGCONT), and the queued delivery must not be answered 200;
- two leaders at once, `--partitions` times (default 3): the leader's requests to the Lease fail
  (through the proxy) while everything else, webhook deliveries included, still reaches it. It must
  stop (/readyz not 200, no write in the audit log) before the other replica's acquireTime;
- once every alert resolved (the script stops, every firing alert is resolved and delivered), nothing
  of this service is left on any node (cordon, taint, annotation) within 60 s;
- a fail-over at minute 5 ends in the same state as the run without it: the same seeded script of
  `--compare-seconds` (default 360; faults arrive until 90 s before its end, last 30 to 80 s, and 12
  of them never resolve) is played twice on a clean cluster (nodes reset, instances Healthy) with
  fresh replicas, once with the leader killed at `--compare-kill-at` (default 300 s); after the
  script and a resend of every group, the cordons, taints and condition statuses of every node are
  compared, and the invariants above are checked in both runs.

`--lifecycle` (issue 34, "Done when" 3): the fail-over bench extended to drains, reboots and Events,
at 200 nodes by default (2,000 nodes with pods and a kubelet stand-in is more than a 2-core machine
plays; `--nodes` changes it). Each node gets pods (tests/kube/kubelet.py FakeKubelet plays kubelet
and scheduler: evicted pods terminate, their ReplicaSets make new ones elsewhere): a `web` pod each,
and on every third node a `guarded` pod under a PodDisruptionBudget that lets one go at a time, so
that drains wait for each other and span kills. The replicas reach the API server through the
policy/v1 proxy (tests/kube/network.py). The policy: condition, cordon, taint, a drain (300 s), then
aws_reboot for AccelGPUFatalXid and aws_set_unhealthy for the other alerts; on resolve uncordon,
untaint, condition; `events: all`; budget 20. A RebootInstances makes the node boot again (a new boot
id) 5 to 20 s later. Faults fire about 0.3 a second for 30 to 90 s (two of one kind on one node at
least 30 s apart); 30 s after they start, `--kills` SIGKILLs of the leader as in figure 5 (its
timings printed, not part of the verdict), then 20 s more. Counted per node and episode
(fingerprint + startsAt), over the whole run: cordons and taints (as figure 6), drain starts (a new
`drain-started` stamp with `drain-status: in-progress`, given to the episodes its write records whose
drain is not decided yet; a drain resumed by a new leader keeps its stamp), RebootInstances and
SetInstanceHealth (moto's, through the counting proxy, given to the episodes whose intent appeared on
the node's record since the last such call, or again to those it shows), and the Events of each
reason (the Event objects, their `count` summed, each given to the newest fault of the alertname its
message names fired on its node before it). Then every alert resolves: within 300 s no node may be
cordoned, tainted, carry the record, an ownership annotation or a running drain, or keep
AcceleratorHealthy=False, and after 10 s without a change the leader's GET /state must show no budget
holder, no drain and no hold. PASS: at most one of each per node and episode, every one recorded on
its node, the budget kept, and nothing left. `--nodes 50 --kills 3` for a quick look.

Needs root (the harness), the control-plane binaries (scripts/build-control-plane.sh) and moto's
server (the test extra). Other work on the machine makes timings noisy. `--nodes 200 --kills 3
--compare-seconds 120 --compare-kill-at 60` for a quick look; `--workdir DIR` keeps every log.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import signal
import ssl
import statistics
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import boto3
import yaml
from aiohttp import web

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the control-plane harness lives in tests/kube

from bench_reconcile_api import NS, node_name  # noqa: E402  same cluster layout

from examples.pipeline import free_port  # noqa: E402  after sys.path
from remediator.lifecycle.record import (  # noqa: E402  after sys.path
    CORDONED_BY,
    DRAIN_STARTED,
    DRAIN_STATUS,
    EPISODES,
    MANAGER,
    PREFIX,
    TAINTS_ADDED,
    Episode,
    owned_taints,
    read,
    rfc3339,
    taint_id,
)
from tests.kube.conftest import control_plane_skip_reason  # noqa: E402  after sys.path
from tests.kube.controlplane import (  # noqa: E402  after sys.path
    ControlPlane,
    Process,
    apply_objects,
    control_plane,
    deployment,
    spawn,
)
from tests.kube.kubelet import FakeKubelet, KubeletSettings  # noqa: E402  after sys.path
from tests.kube.network import skew_proxy  # noqa: E402  after sys.path
from tests.kube.rest import Obj  # noqa: E402  after sys.path

LEASE = "accel-health-remediator"
LEASE_SECONDS = 4
"""--lease-duration of the replicas: renew deadline 2.7 s, retry period 1 s (client-go's proportions)."""
TOKEN = "bench-token-0123456789"  # noqa: S105  the webhook token of throwaway processes
CONDITION = "AcceleratorHealthy"
TAINT_KEY = "accel-health.io/unhealthy"
TAINT = taint_id(TAINT_KEY, "NoSchedule")
BUDGET = 20
RULE = "fault"
STEP_CORDON, STEP_TAINT, STEP_AWS = 1, 2, 3
"""Indices of the cordon, the taint and aws_set_unhealthy among the rule's actions (the record's
step bits)."""
POLICY = f"""
safety: {{max_disrupted_nodes: {BUDGET}, storm_breaker: {{enabled: false}}}}
events: none
repair: {{enabled: false}}
rules:
  - name: {RULE}
    actions:
      - {{type: condition, condition_type: {CONDITION}}}
      - cordon
      - {{type: taint, key: {TAINT_KEY}, value: "true", effect: NoSchedule}}
      - aws_set_unhealthy
    on_resolved:
      - uncordon
      - {{type: untaint, key: {TAINT_KEY}}}
      - {{type: condition, condition_type: {CONDITION}}}
"""
REGION = "us-west-2"
AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": REGION,
}
"""moto's: any credentials do."""
ALERTNAMES = ("AccelGPUFatalXid", "AccelGPURowRemapFailure", "AccelInfinibandLinkDown")
SCRIPT_EPOCH = 1_764_000_000
"""The script's time 0 as startsAt (2025-11-24): the same alerts, fingerprints and startsAt in both
runs of the comparison."""
POLL_SECONDS = 0.05
"""How often the Lease and each replica's /readyz are read."""
REPEAT_SECONDS = 60.0
"""A group is resent this often (Alertmanager's repeat_interval, shortened)."""
WRITES = ("create", "update", "patch", "delete", "deletecollection")
IDENTITY = re.compile(r"leader election on Lease \S+ as (\S+)")
FAILED_REBUILD = "rebuilding after becoming leader failed"


def now() -> float:
    return time.time()


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def parse_time(text: str | None) -> float | None:
    """An RFC 3339 time (the Lease's MicroTime, an audit event's timestamp) as unix seconds."""
    if not text:
        return None
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


# -- the cluster -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Account:
    """A ServiceAccount a replica runs as (cluster-admin), so the audit log tells replicas apart."""

    name: str
    token: str

    @property
    def user(self) -> str:
        return f"system:serviceaccount:{NS}:{self.name}"


def populate(
    plane: ControlPlane, workdir: Path, instances: list[str], fake: FakeKubelet | None = None
) -> None:
    """An accelerator node (8 `nvidia.com/gpu`, as bench_reconcile_api makes them) per EC2 instance
    (registered by `fake`, the kubelet stand-in that plays them, when given)."""
    fake = fake or FakeKubelet(plane=plane, workdir=workdir)
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(
            pool.map(
                lambda i: fake.add_node(
                    node_name(i),
                    labels={"pool": "gpu"},
                    capacity={"nvidia.com/gpu": "8"},
                    provider_id=f"aws:///{REGION}a/{instances[i]}",
                ),
                range(len(instances)),
            )
        )


def reset_nodes(plane: ControlPlane) -> int:
    """Every node as created: no cordon, taint, annotation or condition of this service; how many
    nodes it changed."""

    def clean(node: Obj) -> bool:
        name = node["metadata"]["name"]
        annotations = {k: None for k in node["metadata"].get("annotations") or {} if k.startswith(PREFIX)}
        taints = node["spec"].get("taints") or []
        kept = [t for t in taints if t.get("key") != TAINT_KEY]
        changed = False
        if annotations or node["spec"].get("unschedulable") or len(kept) != len(taints):
            patch = {
                "spec": {"unschedulable": None, "taints": kept},
                "metadata": {"annotations": annotations},
            }
            plane.admin.merge_patch(f"/api/v1/nodes/{name}", patch)
            changed = True
        if any(c["type"] == CONDITION for c in node["status"].get("conditions") or []):
            plane.admin.request(
                "PATCH",
                f"/api/v1/nodes/{name}/status",
                {"status": {"conditions": [{"type": CONDITION, "$patch": "delete"}]}},
                content_type="application/strategic-merge-patch+json",
            )
            changed = True
        return changed

    with ThreadPoolExecutor(max_workers=8) as pool:
        return sum(pool.map(clean, plane.admin.items("/api/v1/nodes")))


# -- a replica: the shipped process ------------------------------------------------------------------


class Replica:
    """`accel-health-remediator serve` with leader election, as `account`, against `server` (the API
    server, or a proxy in front of it); its /readyz is read every 50 ms while it runs."""

    def __init__(
        self,
        *,
        name: str,
        plane: ControlPlane,
        workdir: Path,
        account: Account,
        alertmanager: str,
        aws: str,
        server: str | None = None,
    ) -> None:
        self.name = name
        self.account = account
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cluster: dict[str, Any] = {"server": server or plane.server}
        if cluster["server"].startswith("https:"):
            cluster["certificate-authority"] = str(plane.pki.ca_cert)
        kubeconfig = workdir / f"{name}.kubeconfig"
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "b", "cluster": cluster}],
            "users": [{"name": "b", "user": {"token": account.token}}],
            "contexts": [{"name": "b", "context": {"cluster": "b", "user": "b"}}],
            "current-context": "b",
        }
        kubeconfig.write_text(yaml.safe_dump(config))
        argv = [
            str(Path(sys.executable).parent / "accel-health-remediator"),
            "serve",
            f"--listen=127.0.0.1:{self.port}",
            f"--kubeconfig={kubeconfig}",
            f"--config={workdir / 'policy.yaml'}",
            f"--token-file={workdir / 'token'}",
            f"--lease-duration={LEASE_SECONDS}",
            f"--alertmanager-url={alertmanager}",
            "--aws",
            f"--aws-endpoint-url={aws}",
            f"--aws-region={REGION}",
            "--log-level=info",
        ]
        env = {**os.environ, **AWS_ENV, "POD_NAMESPACE": NS}
        self.process: Process = spawn(name, argv, log_dir=workdir, env=env)
        self.ready = False
        """/readyz answered 200 at the last read."""
        self.ready_at = 0.0
        """When /readyz last turned 200 (unix time of the answer)."""
        self.unready_at = 0.0
        """When /readyz last stopped answering 200."""
        self.up = False
        """It answered HTTP at least once (it listens once its node cache synced)."""
        self.stopped = False
        """SIGSTOP sent and no SIGCONT yet."""
        self.answer = ""
        """What the last /readyz read got: its status, or the error."""
        self._identity: str | None = None

    @property
    def alive(self) -> bool:
        return self.process.popen.poll() is None

    @property
    def identity(self) -> str | None:
        """Its holderIdentity (from its log)."""
        if self._identity is None:
            match = IDENTITY.search(self.process.log.read_text(errors="replace"))
            self._identity = match.group(1) if match else None
        return self._identity

    def log_count(self, text: str) -> int:
        return self.process.log.read_text(errors="replace").count(text)

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.process.popen.pid, sig)
        if sig == signal.SIGSTOP:
            self.stopped = True
        elif sig == signal.SIGCONT:
            self.stopped = False
        elif sig == signal.SIGKILL:
            self.process.popen.wait()

    def state(self) -> str:
        """The process's state letter (R running, S sleeping, T stopped, ...)."""
        try:
            return Path(f"/proc/{self.process.popen.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return "gone"

    def stop(self) -> None:
        if self.stopped:
            self.signal(signal.SIGCONT)
        self.process.stop()

    async def probe(self, session: aiohttp.ClientSession) -> None:
        """Read /readyz every POLL_SECONDS until the process ends."""
        timeout = aiohttp.ClientTimeout(total=1.0)
        while self.alive:
            try:
                async with session.get(self.url + "/readyz", timeout=timeout) as resp:
                    await resp.read()
                    ok = resp.status == 200
                    self.up = True
                    self.answer = str(resp.status)
            except (aiohttp.ClientError, TimeoutError) as exc:
                ok = False
                self.answer = type(exc).__name__
            if ok and not self.ready:
                self.ready_at = now()
            if self.ready and not ok:
                self.unready_at = now()
            self.ready = ok
            await asyncio.sleep(POLL_SECONDS)
        self.ready = False


# -- the Lease, the nodes and the audit log, as the admin sees them ------------------------------------


@dataclass
class LeaseSeen:
    holder: str | None
    acquired: float | None
    """spec.acquireTime (the new holder's clock: this machine's)."""
    seen: float
    """When this benchmark first read it."""


class LeaseWatch:
    """The leader Lease, read every 50 ms."""

    def __init__(self, api: aiohttp.ClientSession, server: str) -> None:
        self._api = api
        self._url = f"{server}/apis/coordination.k8s.io/v1/namespaces/{NS}/leases/{LEASE}"
        self.current = LeaseSeen(holder=None, acquired=None, seen=0.0)
        self.history: list[LeaseSeen] = []

    async def run(self) -> None:
        while True:
            try:
                async with self._api.get(self._url, timeout=aiohttp.ClientTimeout(total=2)) as resp:
                    body = await resp.json() if resp.status == 200 else None
            except (aiohttp.ClientError, TimeoutError):
                body = None
            if body is not None:
                spec = body.get("spec") or {}
                holder, acquired = spec.get("holderIdentity"), parse_time(spec.get("acquireTime"))
                if (holder, acquired) != (self.current.holder, self.current.acquired):
                    self.current = LeaseSeen(holder=holder, acquired=acquired, seen=now())
                    self.history.append(self.current)
            await asyncio.sleep(POLL_SECONDS)

    async def held_by(self, identity: str | None, within: float) -> LeaseSeen | None:
        deadline = now() + within
        while now() < deadline:
            if identity is not None and self.current.holder == identity:
                return self.current
            await asyncio.sleep(POLL_SECONDS / 2)
        return None


def _annotations(obj: Obj) -> dict[str, str]:
    return dict(obj["metadata"].get("annotations") or {})


def _unschedulable(obj: Obj) -> bool:
    return bool(obj["spec"].get("unschedulable"))


def _tainted(obj: Obj) -> bool:
    return any(t.get("key") == TAINT_KEY for t in obj["spec"].get("taints") or [])


def _condition(obj: Obj) -> str | None:
    for c in obj.get("status", {}).get("conditions") or []:
        if c.get("type") == CONDITION:
            return str(c.get("status"))
    return None


def held(obj: Obj) -> tuple[bool, bool]:
    """(cordoned by this service, carrying a taint this service added), as the node shows it."""
    annotations = _annotations(obj)
    cordon = _unschedulable(obj) and annotations.get(CORDONED_BY) == MANAGER
    taint = _tainted(obj) and TAINT in owned_taints(annotations)
    return cordon, taint


def ours(obj: Obj) -> list[str]:
    """What of this service is on the node: cordon, taint, annotations."""
    out = []
    if _unschedulable(obj):
        out.append("cordon")
    if _tainted(obj):
        out.append("taint")
    out += [k.removeprefix(PREFIX) for k in _annotations(obj) if k.startswith(PREFIX)]
    return out


@dataclass
class Violations:
    """Invariant breaches seen, with a few examples each."""

    counts: Counter[str] = field(default_factory=Counter)
    examples: dict[str, list[str]] = field(default_factory=dict)

    def add(self, kind: str, example: str) -> None:
        self.counts[kind] += 1
        shown = self.examples.setdefault(kind, [])
        if len(shown) < 5:
            shown.append(example)


class Observer:
    """Every node, through a watch of the admin's; checks each cordon and taint as it appears and,
    every second, the budget and that every hold names its episode."""

    def __init__(self, api: aiohttp.ClientSession, server: str) -> None:
        self._api = api
        self._server = server
        self.nodes: dict[str, Obj] = {}
        self.synced = asyncio.Event()
        self.per_episode: Counter[tuple[str, str, int, str]] = Counter()
        """(node, fingerprint, startsAt, cordon|taint) -> how often it appeared for that episode."""
        self.transitions: Counter[str] = Counter()
        self.violations = Violations()
        self.samples = 0
        self.max_held = 0
        self.relists = 0
        self.changed_at = 0.0
        """When a node last changed in a way the comparison looks at."""
        self.aws_episodes: dict[str, set[tuple[str, int]]] = {}
        """node -> the episodes of the last record seen on it that asked for aws_set_unhealthy."""
        self.t0 = now()
        # What the policy's rules look like (the default: POLICY; --lifecycle: LIFECYCLE_POLICY).
        self.rules: frozenset[str] = frozenset({RULE})
        """The rules that cordon and taint."""
        self.step_cordon, self.step_taint, self.step_aws = STEP_CORDON, STEP_TAINT, STEP_AWS
        self.step_drain: int | None = None
        """The drain's index among the rules' actions (None: no drain)."""
        self.reboot_rule = ""
        """The rule whose AWS step is aws_reboot (empty: none)."""
        self.asked: dict[str, dict[str, set[tuple[str, int]]]] = {}
        """call -> node -> the episodes of the last record seen on it that asked for that call
        (kept when a later record asks for none)."""
        self.charged: dict[str, dict[str, set[tuple[str, int]]]] = {}
        """call -> node -> the episodes a call was already counted for."""

    def reset_stats(self) -> None:
        self.per_episode.clear()
        self.transitions.clear()
        self.violations = Violations()
        self.samples = self.max_held = 0

    def clock(self) -> str:
        return f"t+{now() - self.t0:.1f}s"

    async def run(self) -> None:
        while True:
            version = await self._list()
            try:
                await self._watch(version)
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                self.violations.add("observer watch broke (transitions may be missed)", str(exc))
            self.relists += 1

    async def _list(self) -> str:
        async with self._api.get(f"{self._server}/api/v1/nodes") as resp:
            body = await resp.json()
        for obj in body["items"]:
            self._update(obj)
        self.synced.set()
        return str(body["metadata"]["resourceVersion"])

    async def _watch(self, version: str) -> None:
        while True:
            params = {
                "watch": "1",
                "resourceVersion": version,
                "allowWatchBookmarks": "true",
                "timeoutSeconds": "240",
            }
            async with self._api.get(
                f"{self._server}/api/v1/nodes", params=params, timeout=aiohttp.ClientTimeout(total=None)
            ) as resp:
                if resp.status != 200:
                    return
                async for line in resp.content:
                    event = json.loads(line)
                    obj = event["object"]
                    if event["type"] == "ERROR":
                        return  # 410 Gone: list again
                    version = obj["metadata"]["resourceVersion"]
                    if event["type"] in ("ADDED", "MODIFIED"):
                        self._update(obj)
                    elif event["type"] == "DELETED":
                        self.nodes.pop(obj["metadata"]["name"], None)

    def _update(self, new: Obj) -> None:
        name = new["metadata"]["name"]
        old = self.nodes.get(name)
        self.nodes[name] = new
        annotations = _annotations(new)
        if EPISODES in annotations:
            episodes = read(annotations).episodes.values()
            asked = {(e.fingerprint, e.start) for e in episodes if e.done(self.step_aws)}
            if asked:
                self.aws_episodes[name] = asked
            rebooted = {
                (e.fingerprint, e.start)
                for e in episodes
                if e.done(self.step_aws) and e.rule == self.reboot_rule and not e.released
            }
            for call, seen in (("SetInstanceHealth", asked), ("RebootInstances", rebooted)):
                if seen:
                    self.asked.setdefault(call, {})[name] = seen
        if old is None:
            return
        if (_unschedulable(old), _tainted(old), _condition(old)) != (
            _unschedulable(new),
            _tainted(new),
            _condition(new),
        ):
            self.changed_at = now()
        if not _unschedulable(old) and _unschedulable(new):
            self._appeared("cordon", self.step_cordon, name, old, new, owned=held(new)[0])
        if not _tainted(old) and _tainted(new):
            self._appeared("taint", self.step_taint, name, old, new, owned=held(new)[1])
        if self.step_drain is not None:
            self._drain_started(name, old, new)

    def _drain_started(self, name: str, old: Obj, new: Obj) -> None:
        """A drain started (a new `drain-started` stamp with `drain-status: in-progress`; a drain resumed
        by a new leader keeps its stamp): counted for the episodes its write records whose drain step
        is not decided yet (the step is decided when the drain ends)."""
        before, after = _annotations(old), _annotations(new)
        stamp = after.get(DRAIN_STARTED)
        if stamp is None or stamp == before.get(DRAIN_STARTED) or after.get(DRAIN_STATUS) != "in-progress":
            return
        assert self.step_drain is not None
        self.transitions["drain"] += 1
        episodes = read(after).episodes.values()
        waiting = [e for e in episodes if e.rule in self.rules and not e.done(self.step_drain)]
        if not waiting:
            where = f"{name} at {self.clock()} (rv {new['metadata']['resourceVersion']})"
            self.violations.add("drain start with no episode waiting for it in its record", where)
            return
        for e in waiting:
            self.per_episode[(name, e.fingerprint, e.start, "drain start")] += 1

    def call_made(self, call: str, node: str) -> None:
        """An AWS call (SetInstanceHealth Unhealthy, RebootInstances) of the node's instance was made
        a moment ago (the watch has shown the intent written before it): counted for the episodes
        whose intent appeared since the last such call, or, when none did, again for those whose
        intent the record shows (a repeated call)."""
        self.transitions[call] += 1
        asked = self.asked.get(call, {}).get(node, set())
        if not asked:
            self.violations.add(f"{call} with no intent recorded on its node", f"{node} at {self.clock()}")
            return
        charged = self.charged.setdefault(call, {}).setdefault(node, set())
        fresh = asked - charged
        for fingerprint, start in fresh or asked:
            self.per_episode[(node, fingerprint, start, call)] += 1
        charged |= asked

    def _appeared(self, what: str, step: int, name: str, old: Obj, new: Obj, *, owned: bool) -> None:
        """A cordon or taint appeared: the same write must claim it and record its episode."""
        self.transitions[what] += 1
        where = f"{name} at {self.clock()} (rv {new['metadata']['resourceVersion']})"
        if not owned:
            self.violations.add(f"{what} without this service's ownership annotation", where)
        before = read(_annotations(old)).episodes
        after = read(_annotations(new)).episodes

        def newly(e: Episode) -> bool:
            b = before.get(e.fingerprint)
            return e.done(step) and not (b is not None and b.start == e.start and b.done(step))

        fresh = [e for e in after.values() if newly(e)]
        if not fresh:
            again = [e for e in after.values() if e.done(step)]
            if again:
                # The record already said this step was decided: a second one for the same episode.
                for e in again:
                    self.per_episode[(name, e.fingerprint, e.start, what)] += 1
                return
            self.violations.add(f"{what} recording no episode in its own write", where)
            return
        for e in fresh:
            self.per_episode[(name, e.fingerprint, e.start, what)] += 1

    def set_instance_health(self, node: str) -> None:
        """A SetInstanceHealth of the node's instance was made (a moment ago, so that the watch has
        shown the intent written before it): counted for the episodes that asked for it."""
        self.transitions["SetInstanceHealth"] += 1
        asked = self.aws_episodes.get(node)
        if not asked:
            self.violations.add(
                "SetInstanceHealth with no intent recorded on its node", f"{node} at {self.clock()}"
            )
            return
        for fingerprint, start in asked:
            self.per_episode[(node, fingerprint, start, "SetInstanceHealth")] += 1

    def sample(self) -> int:
        """The nodes this service holds now; checks the budget and that each names its episode."""
        count = 0
        for name, obj in self.nodes.items():
            cordon, taint = held(obj)
            annotations = _annotations(obj)
            if _unschedulable(obj) and not cordon:
                self.violations.add("cordoned, not claimed by this service (sampled)", name)
            if _tainted(obj) and not taint:
                self.violations.add("tainted, not claimed by this service (sampled)", name)
            if not (cordon or taint):
                continue
            count += 1
            episodes = read(annotations).episodes.values() if EPISODES in annotations else []
            if not any(e.rule in self.rules for e in episodes):  # the rules that cordon and taint
                what = " and ".join(w for w, h in (("cordon", cordon), ("taint", taint)) if h)
                self.violations.add(
                    f"{what} with no episode on its node (sampled)", f"{name} at {self.clock()}"
                )
        self.samples += 1
        self.max_held = max(self.max_held, count)
        if count > BUDGET:
            self.violations.add("budget exceeded (sampled)", f"{count} nodes held at {self.clock()}")
        return count

    async def sampler(self) -> None:
        await self.synced.wait()
        while True:
            self.sample()
            await asyncio.sleep(1.0)

    def leftovers(self) -> dict[str, list[str]]:
        """Nodes with anything of this service on them (condition aside)."""
        return {name: marks for name, obj in self.nodes.items() if (marks := ours(obj))}

    def state(self) -> dict[str, tuple[bool, bool, str | None]]:
        """node -> (cordoned, tainted, condition status) for nodes with any of them."""
        out = {}
        for name, obj in self.nodes.items():
            seen = (_unschedulable(obj), _tainted(obj), _condition(obj))
            if seen != (False, False, None):
                out[name] = seen
        return out


@dataclass(frozen=True)
class AuditEvent:
    at: float
    """requestReceivedTimestamp."""
    user: str
    verb: str
    resource: str
    code: int
    name: str = ""
    """objectRef.name (an Event's name starts with its node's)."""


class Audit:
    """The replicas' requests from the API server's audit log (ResponseComplete events)."""

    def __init__(self, path: Path, users: set[str]) -> None:
        self.path = path
        self.users = users
        self.events: list[AuditEvent] = []
        self._offset = 0

    def read(self) -> list[AuditEvent]:
        with self.path.open("rb") as f:
            f.seek(self._offset)
            data = f.read()
        end = data.rfind(b"\n") + 1
        self._offset += end
        for line in data[:end].splitlines():
            event = json.loads(line)
            user = event.get("user", {}).get("username")
            if user not in self.users or event.get("stage") != "ResponseComplete":
                continue
            ref = event.get("objectRef") or {}
            resource = str(ref.get("resource", "")) + (
                f"/{ref['subresource']}" if ref.get("subresource") else ""
            )
            self.events.append(
                AuditEvent(
                    at=parse_time(event.get("requestReceivedTimestamp")) or 0.0,
                    user=str(user),
                    verb=str(event.get("verb")),
                    resource=resource,
                    code=int((event.get("responseStatus") or {}).get("code", 0)),
                    name=str(ref.get("name", "")),
                )
            )
        return self.events

    def skip(self) -> None:
        self._offset = self.path.stat().st_size


# -- the fault: a proxy in front of the API server ---------------------------------------------------

_HOP = {"host", "content-length", "transfer-encoding", "connection"}
"""Hop-by-hop headers; Content-Encoding passes through, with the body as the API server sent it."""


class FaultProxy:
    """http://127.0.0.1:PORT in front of the API server for one replica, passing its requests with
    its own token; `failing` "reads": every request but the Lease's is answered 503 (a watch already
    open keeps streaming); "lease": the Lease's requests are (a partial partition)."""

    def __init__(self, plane: ControlPlane) -> None:
        self._upstream = plane.server
        self._ca = plane.pki.ca_cert
        self.failing = ""
        self.faulted = 0
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=ssl.create_default_context(cafile=str(self._ca)), limit=0),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
            auto_decompress=False,
        )
        app = web.Application(client_max_size=16 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0, handler_cancellation=True)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        assert self._session is not None
        lease = request.path.startswith("/apis/coordination.k8s.io/")
        if (self.failing == "reads" and not lease) or (self.failing == "lease" and lease):
            self.faulted += 1
            status = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 503}
            return web.json_response(
                {**status, "message": "injected", "reason": "ServiceUnavailable"}, status=503
            )
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        url = self._upstream + request.path + (f"?{request.query_string}" if request.query_string else "")
        async with self._session.request(request.method, url, headers=headers, data=body or None) as up:
            out = {k: v for k, v in up.headers.items() if k.lower() not in _HOP}
            if "watch" not in request.query:
                return web.Response(status=up.status, headers=out, body=await up.read())
            response = web.StreamResponse(status=up.status, headers=out)
            await response.prepare(request)
            async for chunk in up.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response


# -- AWS: moto's server behind a proxy that counts SetInstanceHealth ------------------------------------


class Aws:
    """moto's server (EC2, Auto Scaling) as a process of its own, and in front of it, on this loop, a
    proxy the replicas call (`url`) that notes every SetInstanceHealth: (when, instance)."""

    def __init__(self, workdir: Path) -> None:
        self._workdir = workdir
        self.moto = f"http://127.0.0.1:{free_port()}"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.unhealthy: list[tuple[float, str]] = []
        """SetInstanceHealth Unhealthy calls: (when, instance)."""
        self.describes = 0
        self.on_unhealthy: Callable[[str], None] = lambda _instance: None
        self.reboots: list[tuple[float, str]] = []
        """RebootInstances calls: (when, instance), one per instance named."""
        self.on_reboot: Callable[[str], None] = lambda _instance: None
        self._process: Process | None = None
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    def client(self, service: str) -> Any:
        return boto3.Session(region_name=REGION).client(service, endpoint_url=self.moto)

    def start_moto(self) -> None:
        port = self.moto.rsplit(":", 1)[1]
        argv = [str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", port]
        self._process = spawn("moto", argv, log_dir=self._workdir, env={**os.environ, **AWS_ENV})
        deadline = now() + 60
        while now() < deadline:
            try:
                with urllib.request.urlopen(self.moto + "/moto-api/", timeout=2):  # noqa: S310  loopback
                    return
            except OSError:
                time.sleep(0.2)
        raise TimeoutError("moto_server did not answer")

    def make_group(self, size: int) -> list[str]:
        """An Auto Scaling group of `size` instances; their ids."""
        os.environ.update(AWS_ENV)
        ec2, asg = self.client("ec2"), self.client("autoscaling")
        name = "gpu-nodes"
        ec2.create_launch_template(
            LaunchTemplateName=name,
            LaunchTemplateData={"ImageId": "ami-12c6146b", "InstanceType": "p5.48xlarge"},
        )
        asg.create_auto_scaling_group(
            AutoScalingGroupName=name,
            MinSize=size,
            MaxSize=size,
            DesiredCapacity=size,
            LaunchTemplate={"LaunchTemplateName": name},
            AvailabilityZones=[f"{REGION}a"],
        )
        found = asg.describe_auto_scaling_groups(AutoScalingGroupNames=[name])["AutoScalingGroups"][0]
        return [str(i["InstanceId"]) for i in found["Instances"]]

    def heal(self) -> int:
        """Every instance Healthy again (between the runs of the comparison); how many were not."""
        asg = self.client("autoscaling")
        found = asg.describe_auto_scaling_groups(AutoScalingGroupNames=["gpu-nodes"])["AutoScalingGroups"][0]
        sick = [i["InstanceId"] for i in found["Instances"] if i["HealthStatus"] != "Healthy"]
        for instance in sick:
            asg.set_instance_health(InstanceId=instance, HealthStatus="Healthy")
        return len(sick)

    async def start_proxy(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()
        if self._process is not None:
            self._process.stop()

    async def _handle(self, request: web.Request) -> web.Response:
        assert self._session is not None
        body = await request.read()
        form = urllib.parse.parse_qs(body.decode("utf-8", "replace"))
        action = (form.get("Action") or [""])[0]
        if action == "DescribeAutoScalingInstances":
            self.describes += 1
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        url = self.moto + request.path_qs
        async with self._session.request(request.method, url, headers=headers, data=body) as up:
            data = await up.read()
            out = {k: v for k, v in up.headers.items() if k.lower() not in (*_HOP, "content-encoding")}
            answer = web.Response(status=up.status, headers=out, body=data)
        if action == "SetInstanceHealth" and (form.get("HealthStatus") or [""])[0] == "Unhealthy":
            instance = (form.get("InstanceId") or [""])[0]
            self.unhealthy.append((now(), instance))
            if up.status == 200:
                self.on_unhealthy(instance)
        if action == "RebootInstances":
            for key, values in sorted(form.items()):
                if key.startswith("InstanceId."):
                    self.reboots.append((now(), values[0]))
                    if up.status == 200:
                        self.on_reboot(values[0])
        return answer


# -- Alertmanager, played: the script, the API v2, the webhook deliveries ------------------------------


@dataclass(frozen=True)
class Fault:
    node: int
    kind: int
    fire_at: float
    """Seconds into the script."""
    resolve_at: float | None
    """Seconds into the script; None: it fires until the script is stopped."""
    fingerprint: str

    @property
    def starts_at(self) -> str:
        return rfc3339(SCRIPT_EPOCH + self.fire_at)


def make_script(
    seed: int,
    *,
    tag: int,
    nodes: int,
    seconds: float,
    rate: float,
    durations: tuple[float, float],
    persistent: int = 0,
    gap: float = 1.0,
) -> list[Fault]:
    """Faults arriving at `rate` a second for `seconds`, each lasting `durations` (uniform), on random
    nodes (never two of one kind at once on a node, nor within `gap` s of each other), plus
    `persistent` that never resolve."""
    rng = random.Random(seed)
    faults: list[Fault] = []
    busy: dict[tuple[int, int], float] = {}
    t = 0.0

    def fingerprint(node: int, kind: int) -> str:
        return f"{tag:02x}{len(faults):06x}{node:06x}{kind:02x}"

    while True:
        t += rng.expovariate(rate)
        if t >= seconds:
            break
        node, kind = rng.randrange(nodes), rng.randrange(len(ALERTNAMES))
        if busy.get((node, kind), -1.0) > t:
            continue
        end = t + rng.uniform(*durations)
        busy[(node, kind)] = end + gap
        faults.append(
            Fault(node=node, kind=kind, fire_at=t, resolve_at=end, fingerprint=fingerprint(node, kind))
        )
    while persistent:
        t, node, kind = rng.uniform(0, seconds), rng.randrange(nodes), rng.randrange(len(ALERTNAMES))
        if any(f.node == node for f in faults if f.resolve_at is None):
            continue
        faults.append(
            Fault(node=node, kind=kind, fire_at=t, resolve_at=None, fingerprint=fingerprint(node, kind))
        )
        persistent -= 1
    return sorted(faults, key=lambda f: f.fire_at)


def labels_of(f: Fault) -> dict[str, str]:
    return {
        "alertname": ALERTNAMES[f.kind],
        "node": node_name(f.node),
        "severity": "critical",
        "instance": f"{node_name(f.node)}:9835",
        "job": "accel-health-exporter",
    }


def alert_doc(f: Fault, *, resolved: bool) -> dict[str, Any]:
    return {
        "status": "resolved" if resolved else "firing",
        "labels": labels_of(f),
        "annotations": {"summary": f"{ALERTNAMES[f.kind]} on {node_name(f.node)}"},
        "startsAt": f.starts_at,
        "endsAt": rfc3339(now()) if resolved else "0001-01-01T00:00:00Z",
        "generatorURL": "http://prometheus/graph",
        "fingerprint": f.fingerprint,
    }


def webhook(alerts: list[dict[str, Any]], group: str) -> dict[str, Any]:
    status = "firing" if any(a["status"] == "firing" for a in alerts) else "resolved"
    return {
        "version": "4",
        "status": status,
        "receiver": "remediator",
        "groupKey": f'{{}}:{{node="{group}"}}',
        "alerts": alerts,
    }


@dataclass
class Group:
    """One notification group (one node), as Alertmanager keeps it."""

    firing: dict[str, Fault] = field(default_factory=dict)
    resolved: dict[str, Fault] = field(default_factory=dict)
    """Resolved, to be notified (once, sometimes twice)."""
    version: int = 0
    """Bumped on every change."""
    sent_version: int = -1
    """The version last delivered with a 200."""
    next_repeat: float = 0.0
    sending: bool = False


class Alertmanager:
    """The alerts firing now (GET /api/v2/alerts) and their webhook deliveries, one group per node,
    to the ready replica; a delivery not answered 200 is tried again."""

    def __init__(
        self, *, http: aiohttp.ClientSession, target: Callable[[], Replica | None], seed: int
    ) -> None:
        self._http = http
        self._target = target
        self._rng = random.Random(seed)
        self.groups: dict[int, Group] = {}
        self.active: dict[str, Fault] = {}
        self.answers: Counter[str] = Counter()
        self.api_reads = 0
        self.fired = 0
        self.nodes: set[int] = set()
        self._limit = asyncio.Semaphore(4)
        self._resend_resolved: set[str] = set()
        self.fired_at: dict[str, float] = {}
        """Fingerprint -> when the script fired it (this machine's clock)."""
        self.resolved_at: dict[str, float] = {}
        self.faults: dict[str, Fault] = {}

    # the script's side

    def fire(self, f: Fault) -> None:
        g = self.groups.setdefault(f.node, Group())
        g.firing[f.fingerprint] = f
        g.resolved.pop(f.fingerprint, None)
        g.version += 1
        self.active[f.fingerprint] = f
        self.fired += 1
        self.nodes.add(f.node)
        self.fired_at.setdefault(f.fingerprint, now())
        self.faults[f.fingerprint] = f

    def resolve(self, f: Fault) -> None:
        g = self.groups.setdefault(f.node, Group())
        if g.firing.pop(f.fingerprint, None) is None:
            return
        g.resolved[f.fingerprint] = f
        self.resolved_at.setdefault(f.fingerprint, now())
        if self._rng.random() < 0.25:
            self._resend_resolved.add(f.fingerprint)
        g.version += 1
        self.active.pop(f.fingerprint, None)

    def resolve_all(self) -> None:
        for f in list(self.active.values()):
            self.resolve(f)

    def repeat_all(self) -> None:
        """Every group with alerts firing is due for a resend now."""
        for g in self.groups.values():
            if g.firing:
                g.next_repeat = 0.0

    @property
    def settled(self) -> bool:
        """Every group's last state delivered."""
        return all(g.sent_version == g.version and not g.sending for g in self.groups.values())

    # the API v2

    async def api(self, _request: web.Request) -> web.Response:
        self.api_reads += 1
        ends = rfc3339(now() + 240)
        body = [
            {
                **{k: v for k, v in alert_doc(f, resolved=False).items() if k != "status"},
                "endsAt": ends,
                "status": {"state": "active", "silencedBy": [], "inhibitedBy": []},
                "receivers": [{"name": "remediator"}],
            }
            for f in self.active.values()
        ]
        return web.json_response(body)

    # the deliveries

    async def run(self) -> None:
        tasks: set[asyncio.Task[None]] = set()
        while True:
            target = self._target()
            if target is not None:
                t = now()
                for node, g in self.groups.items():
                    if g.sending:
                        continue
                    if g.sent_version != g.version or (g.firing and t >= g.next_repeat):
                        g.sending = True
                        task = asyncio.create_task(self._send(node, g, target))
                        tasks.add(task)
                        task.add_done_callback(tasks.discard)
            await asyncio.sleep(0.2)

    async def _send(self, node: int, g: Group, target: Replica) -> None:
        version = g.version
        resolved = list(g.resolved.values())
        alerts = [alert_doc(f, resolved=False) for f in g.firing.values()]
        alerts += [alert_doc(f, resolved=True) for f in resolved]
        try:
            async with self._limit:
                if not alerts:
                    g.sent_version = version
                    return
                answer = await post(self._http, target, webhook(alerts, node_name(node)))
        finally:
            g.sending = False
        self.answers[answer] += 1
        if answer != "200":
            return
        g.sent_version = version
        g.next_repeat = now() + REPEAT_SECONDS * self._rng.uniform(0.8, 1.2)
        for f in resolved:
            if f.fingerprint in self._resend_resolved:
                self._resend_resolved.discard(f.fingerprint)  # sent once more with the next delivery
                g.version += 1
            elif g.resolved.get(f.fingerprint) is f:
                del g.resolved[f.fingerprint]


async def post(
    http: aiohttp.ClientSession, target: Replica, body: dict[str, Any], *, within: float = 15.0
) -> str:
    """A webhook delivery; the answer's status, or what went wrong."""
    try:
        async with http.post(
            target.url + "/alerts",
            json=body,
            headers={"Authorization": f"Bearer {TOKEN}"},
            timeout=aiohttp.ClientTimeout(total=within),
        ) as resp:
            await resp.read()
            return str(resp.status)
    except TimeoutError:
        return "timeout"
    except aiohttp.ClientError as exc:
        return type(exc).__name__


async def play(am: Alertmanager, script: list[Fault], *, stop: asyncio.Event | None = None) -> None:
    """Fire and resolve the script's faults at their times (from now), until `stop` is set."""
    start = now()
    events = sorted(
        [(f.fire_at, 0, f) for f in script]
        + [(f.resolve_at, 1, f) for f in script if f.resolve_at is not None],
        key=lambda e: (e[0], e[1]),
    )
    for at, kind, f in events:
        delay = start + at - now()
        if delay > 0:
            if stop is None:
                await asyncio.sleep(delay)
            else:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), delay)
        if stop is not None and stop.is_set():
            return
        (am.fire if kind == 0 else am.resolve)(f)


# -- the benchmark -------------------------------------------------------------------------------------


@dataclass
class KillResult:
    killed: float
    taken: LeaseSeen | None
    ready: float | None

    @property
    def lease_after_kill(self) -> float | None:
        return (
            None if self.taken is None or self.taken.acquired is None else self.taken.acquired - self.killed
        )

    @property
    def ready_after_lease(self) -> float | None:
        if self.taken is None or self.taken.acquired is None or self.ready is None:
            return None
        return self.ready - self.taken.acquired


@dataclass
class FailedRead:
    faulted_for: float
    """Seconds from the Lease taken to the API back."""
    failed_rebuilds: int
    requests_refused: int
    ready_before_back: bool
    ready_after_back: float | None


@dataclass
class Fence:
    stopped_for: float
    taken: bool
    answer: str
    """What the delivery queued to the paused leader was answered."""
    writes_after: list[AuditEvent]
    """Writes by the paused replica's account received after SIGCONT."""
    requests_after: int
    state: str
    """The paused replica's process state a second after SIGCONT (T: still stopped)."""


@dataclass
class Partition:
    unready: float | None
    """Seconds from the cut to the old leader's /readyz no longer 200."""
    taken: float | None
    """Seconds from the cut to the other replica's acquireTime."""
    last_write: float | None
    """Seconds from the cut to the old leader's last write before that."""
    writes_after: list[AuditEvent]
    """Its writes received after the other replica took the Lease."""


class Bench:
    def __init__(
        self,
        *,
        plane: ControlPlane,
        workdir: Path,
        accounts: list[Account],
        api: aiohttp.ClientSession,
        http: aiohttp.ClientSession,
        aws: Aws,
        instances: list[str],
        seed: int,
        policy: str = POLICY,
        server: str | None = None,
    ) -> None:
        self.plane = plane
        self.policy = policy
        self.server = server
        """Where replicas reach the API server (None: directly)."""
        self.aws = aws
        self.node_of = {instance: node_name(i) for i, instance in enumerate(instances)}
        self.workdir = workdir
        self.accounts = accounts
        self.api = api
        self.http = http
        self.rng = random.Random(seed)
        self.seed = seed
        self.replicas: list[Replica] = []
        self.proxies: list[FaultProxy] = []
        self.proxy_of: dict[str, FaultProxy] = {}
        """Replica name -> the proxy it reaches the API server through."""
        self.lease = LeaseWatch(api, plane.server)
        self.observer = Observer(api, plane.server)
        self.audit = Audit(plane.workdir / "audit.log", {a.user for a in accounts})
        self.am = Alertmanager(http=http, target=self.target, seed=seed)
        self.am_port = free_port()
        self.pods = 0
        """Pods on the nodes (--lifecycle)."""
        self._count = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._runners: list[web.AppRunner] = []

    # processes

    def spawn(self, server: str | None = None) -> Replica:
        busy = {r.account for r in self.replicas if r.alive}
        account = next(a for a in self.accounts if a not in busy)
        self._count += 1
        replica = Replica(
            name=f"replica-{self._count:02d}",
            plane=self.plane,
            workdir=self.workdir,
            account=account,
            alertmanager=f"http://127.0.0.1:{self.am_port}",
            aws=self.aws.url,
            server=server or self.server,
        )
        self.replicas.append(replica)
        self._tasks.append(asyncio.create_task(replica.probe(self.http)))
        return replica

    def live(self) -> list[Replica]:
        return [r for r in self.replicas if r.alive]

    def target(self) -> Replica | None:
        """Where the Service would send a delivery: a replica whose /readyz is 200."""
        ready = [r for r in self.live() if r.ready]
        return max(ready, key=lambda r: r.ready_at) if ready else None

    async def pair(self, within: float = 120.0) -> tuple[Replica, Replica]:
        """(leader, follower): the leader ready and holding the Lease, the follower listening."""
        deadline = now() + within
        while now() < deadline:
            live = self.live()
            leaders = [r for r in live if r.ready and r.identity == self.lease.current.holder]
            others = [r for r in live if r not in leaders and r.up and r.identity and not r.stopped]
            if len(live) == 2 and len(leaders) == 1 and len(others) == 1:
                return leaders[0], others[0]
            await asyncio.sleep(POLL_SECONDS)
        states = [(r.name, r.alive, r.state(), r.answer, r.identity) for r in self.replicas[-4:]]
        raise TimeoutError(
            f"no leader and follower within {within:.0f} s: {states}, Lease {self.lease.current}"
        )

    async def wait_ready(self, replica: Replica, *, after: float, within: float = 60.0) -> float | None:
        deadline = now() + within
        while now() < deadline:
            if replica.ready and replica.ready_at >= after:
                return replica.ready_at
            await asyncio.sleep(POLL_SECONDS / 2)
        return None

    def stop_all(self) -> None:
        for r in self.replicas:
            r.stop()

    async def stop_all_async(self) -> None:
        await asyncio.to_thread(self.stop_all)

    async def start(self) -> None:
        (self.workdir / "policy.yaml").write_text(self.policy)
        (self.workdir / "token").write_text(TOKEN)
        app = web.Application()
        app.router.add_get("/api/v2/alerts", self.am.api)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", self.am_port).start()
        self._runners.append(runner)
        await self.aws.start_proxy()
        loop = asyncio.get_running_loop()

        def unhealthy(instance: str) -> None:
            node = self.node_of.get(instance, instance)
            loop.call_later(2.0, self.observer.set_instance_health, node)

        self.aws.on_unhealthy = unhealthy
        for job in (self.lease.run(), self.observer.run(), self.observer.sampler(), self.am.run()):
            self._tasks.append(asyncio.create_task(job))
        await asyncio.wait_for(self.observer.synced.wait(), 120)

    async def close(self) -> None:
        self.stop_all()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for proxy in self.proxies:
            await proxy.stop()
        for runner in self._runners:
            await runner.cleanup()
        await self.aws.stop()

    # figure 5: SIGKILL

    async def kill_leader(self, *, wait: tuple[float, float] = (0.5, 5.0)) -> KillResult:
        leader, follower = await self.pair()
        await asyncio.sleep(self.rng.uniform(*wait))
        if not leader.ready or self.lease.current.holder != leader.identity:
            leader, follower = await self.pair()
        killed = now()
        leader.signal(signal.SIGKILL)
        taken = await self.lease.held_by(follower.identity, 60)
        ready = await self.wait_ready(follower, after=killed)
        self.spawn()
        return KillResult(killed=killed, taken=taken, ready=ready)

    async def failed_read(self) -> FailedRead:
        leader, follower = await self.pair()
        await asyncio.to_thread(follower.stop)
        proxy = FaultProxy(self.plane)
        await proxy.start()
        self.proxies.append(proxy)
        faulty = self.spawn(server=proxy.url)
        self.proxy_of[faulty.name] = proxy
        leader, follower = await self.pair()
        assert follower is faulty
        await asyncio.sleep(self.rng.uniform(0.5, 3.0))
        proxy.failing = "reads"
        killed = now()
        leader.signal(signal.SIGKILL)
        taken = await self.lease.held_by(faulty.identity, 60)
        hold = self.rng.uniform(2.0, 8.0)
        took = taken.acquired or taken.seen if taken is not None else killed
        ready_before = False
        while now() < took + hold:
            ready_before = ready_before or faulty.ready
            await asyncio.sleep(POLL_SECONDS)
        back = now()
        proxy.failing = ""
        ready = await self.wait_ready(faulty, after=back)
        self.spawn()
        return FailedRead(
            faulted_for=back - took,
            failed_rebuilds=faulty.log_count(FAILED_REBUILD),
            requests_refused=proxy.faulted,
            ready_before_back=ready_before,
            ready_after_back=None if ready is None else ready - back,
        )

    async def fence(self) -> Fence:
        """SIGSTOP the leader past its Lease with a delivery queued to it; SIGCONT once the other
        replica leads; what the paused one writes afterwards."""
        leader, follower = await self.pair()
        await asyncio.sleep(self.rng.uniform(0.5, 4.0))
        stopped = now()
        leader.signal(signal.SIGSTOP)
        # New faults, which a leader would act on: none of them may be acted on by this one.
        fresh = [
            Fault(node=n, kind=0, fire_at=stopped - SCRIPT_EPOCH, resolve_at=None, fingerprint=f"f0{n:014x}")
            for n in self.rng.sample(range(len(self.observer.nodes)), 10)
        ]
        alerts = [alert_doc(f, resolved=False) for f in fresh]
        queued = asyncio.create_task(post(self.http, leader, webhook(alerts, "fence"), within=60))
        taken = await self.lease.held_by(follower.identity, 60)
        await self.wait_ready(follower, after=stopped)
        await asyncio.sleep(3.0)  # the new leader acts meanwhile
        resumed = now()
        leader.signal(signal.SIGCONT)
        await asyncio.sleep(1.0)
        state = leader.state()
        answer = await queued
        await asyncio.sleep(5.0)
        events = [
            e
            for e in await asyncio.to_thread(self.audit.read)
            if e.user == leader.account.user and e.at >= resumed
        ]
        return Fence(
            stopped_for=resumed - stopped,
            taken=taken is not None,
            answer=answer,
            writes_after=[e for e in events if e.verb in WRITES],
            requests_after=len(events),
            state=state,
        )

    async def partition(self) -> Partition:
        """The leader's requests to the Lease fail while everything else, webhook deliveries included,
        still reaches it (a partial partition): it must stop acting before the other replica takes
        the Lease (the audit log: its writes, by its ServiceAccount, against the new acquireTime)."""
        leader, follower = await self.pair()
        proxy = self.proxy_of.get(leader.name)
        if proxy is None:  # leadership to a replica behind a proxy: the follower replaced by one...
            await asyncio.to_thread(follower.stop)
            proxy = FaultProxy(self.plane)
            await proxy.start()
            self.proxies.append(proxy)
            proxied = self.spawn(server=proxy.url)
            self.proxy_of[proxied.name] = proxy
            leader, follower = await self.pair()
            await asyncio.to_thread(leader.stop)  # ...then the leader stopped: it hands the Lease back
            self.spawn()
            leader, follower = await self.pair()
            assert leader is proxied
        await asyncio.sleep(self.rng.uniform(0.5, 3.0))
        cut = now()
        proxy.failing = "lease"
        taken = await self.lease.held_by(follower.identity, 60)
        await self.wait_ready(follower, after=cut)
        await asyncio.sleep(3.0)  # both get deliveries, if both say ready
        proxy.failing = ""
        await asyncio.sleep(3.0)
        acquired = taken.acquired if taken is not None else None
        writes = [
            e
            for e in await asyncio.to_thread(self.audit.read)
            if e.user == leader.account.user
            and e.at >= cut - 10
            and e.verb in WRITES
            and e.resource != "leases"
        ]
        before = [e.at for e in writes if acquired is None or e.at < acquired]
        return Partition(
            unready=leader.unready_at - cut if leader.unready_at >= cut else None,
            taken=None if acquired is None else acquired - cut,
            last_write=max(before) - cut if before else None,
            writes_after=[e for e in writes if acquired is not None and e.at >= acquired],
        )

    async def recover(self) -> None:
        """After a trial that found no leader and follower in time: each live replica that answers
        /readyz nothing at all is killed (said, with its process state), and replicas are started
        until two run, so that the next trial has its pair."""
        for r in self.live():
            if r.answer not in ("200", "503"):
                print(
                    f"     {r.name} answers /readyz nothing ({r.answer}), process state {r.state()}: killed"
                )
                r.signal(signal.SIGKILL)
        while len(self.live()) < 2:
            self.spawn()
        with contextlib.suppress(TimeoutError):
            await self.pair()

    async def until_clean(self, within: float) -> float | None:
        """Seconds until nothing of this service is left on any node (None: not within `within` s)."""
        start = now()
        while now() - start < within:
            if self.am.settled and not self.observer.leftovers():
                return now() - start
            await asyncio.sleep(0.2)
        return None

    async def settle(self, quiet: float = 10.0, within: float = 120.0) -> bool:
        """Every group delivered and no node changed for `quiet` seconds."""
        start = now()
        while now() - start < within:
            if self.am.settled and now() - self.observer.changed_at >= quiet:
                return True
            await asyncio.sleep(0.5)
        return False


# -- the phases ----------------------------------------------------------------------------------------


T = TypeVar("T")


async def attempt(bench: Bench, index: int, run: Callable[[], Awaitable[T]]) -> T | None:
    """One trial; None (said) when it found no leader and follower in time."""
    try:
        return await run()
    except TimeoutError as exc:
        print(f"{index + 1:4d} FAILED: {exc}")
        await bench.recover()
        return None


def _fmt(value: float | None, unit: str = " s") -> str:
    return "-" if value is None else f"{value:.2f}{unit}"


async def figures(bench: Bench, args: argparse.Namespace) -> bool:
    """Figures 5 and 6 but the comparison: kills, failed reads and fencing while the script plays."""
    script = make_script(
        args.seed,
        tag=0xA0,
        nodes=args.nodes,
        seconds=3600,
        rate=args.rate,
        durations=(20.0, 120.0),
    )
    for _ in range(2):
        bench.spawn()
    await bench.pair(within=180)
    stop = asyncio.Event()
    player = asyncio.create_task(play(bench.am, script, stop=stop))
    t0 = now()
    bench.audit.skip()
    await asyncio.sleep(20)  # alerts arrive and the budget fills before the first kill
    ok5 = await figure_kills(bench, args, t0)
    ok_read = await figure_failed_reads(bench, args)
    ok_fence = await figure_stops(bench, args)
    ok_part = await figure_partitions(bench, args)
    stop.set()
    await player
    played = now() - t0
    bench.am.resolve_all()
    left_after = await bench.until_clean(120)
    ok6 = report_invariants(bench, played=played, left_after=left_after)
    return ok5 and ok_read and ok_fence and ok_part and ok6


async def figure_kills(bench: Bench, args: argparse.Namespace, t0: float) -> bool:
    kills: list[KillResult] = []
    print(f"\nFigure 5: {args.kills} SIGKILL fail-overs at {args.nodes} nodes (Lease {LEASE_SECONDS} s)")
    print(
        f"{'kill':>4} {'at':>7} {'Lease taken after kill':>22} {'ready after Lease':>17}"
        f" {'ready after kill':>16}"
    )
    for i in range(args.kills):
        k = await attempt(bench, i, bench.kill_leader)
        if k is None:
            continue
        kills.append(k)
        print(
            f"{i + 1:4d} {k.killed - t0:6.0f}s {_fmt(k.lease_after_kill):>22} {_fmt(k.ready_after_lease):>17}"
            f" {_fmt(None if k.ready is None else k.ready - k.killed):>16}"
        )
    after = [k.ready_after_lease for k in kills]
    measured = [a for a in after if a is not None]
    ok5 = len(measured) == args.kills and max(measured, default=99.0) <= 2.0
    if measured:
        print(
            f"ready after taking the Lease: p50 {statistics.median(measured):.2f} s, "
            f"max {max(measured):.2f} s over {len(measured)} of {len(kills)} kills (goal <= 2 s): "
            + verdict(ok5)
        )
    else:
        print(f"no new leader got ready: {verdict(False)}")
    return ok5


async def figure_failed_reads(bench: Bench, args: argparse.Namespace) -> bool:
    reads: list[FailedRead] = []
    print(
        f"\nA failed read at election ({args.failed_reads} times): every request but the Lease's "
        "answered 503 from before the kill until 2 to 8 s after the takeover"
    )
    print(
        f"{'trial':>5} {'faulted after Lease':>19} {'failed rebuilds':>15} {'503s':>5}"
        f" {'ready after API back':>20}"
    )
    for i in range(args.failed_reads):
        r = await attempt(bench, i, bench.failed_read)
        if r is None:
            continue
        reads.append(r)
        ready = _fmt(r.ready_after_back) + (" (ready while faulted!)" if r.ready_before_back else "")
        print(
            f"{i + 1:5d} {r.faulted_for:18.1f}s {r.failed_rebuilds:15d} {r.requests_refused:5d} {ready:>20}"
        )
    back = [r.ready_after_back for r in reads]
    ok_read = (
        len(reads) == args.failed_reads
        and all(b is not None and b <= 10.0 for b in back)
        and all(r.failed_rebuilds > 0 and not r.ready_before_back for r in reads)
    )
    print(
        f"ready after the API came back: max {_fmt(max((b for b in back if b is not None), default=None))} "
        f"(goal <= 10 s, each rebuild failed first): {verdict(ok_read)}"
    )
    return ok_read


async def figure_stops(bench: Bench, args: argparse.Namespace) -> bool:
    fences: list[Fence] = []
    print(
        f"\nTwo leaders at once ({args.stops} times): the leader SIGSTOPped past its Lease, "
        "a delivery queued to it"
    )
    print(
        f"{'stop':>4} {'paused':>7} {'other took over':>15} {'queued delivery':>15}"
        f" {'writes after SIGCONT':>20}"
    )
    for i in range(args.stops):
        f = await attempt(bench, i, bench.fence)
        if f is None:
            continue
        fences.append(f)
        what = ", ".join(f"{e.verb} {e.resource} ({e.code})" for e in f.writes_after) or "none"
        print(
            f"{i + 1:4d} {f.stopped_for:6.1f}s {'yes' if f.taken else 'NO':>15} {f.answer:>15} "
            f"{len(f.writes_after):5d} {what}"
            + (f" (process state {f.state} after SIGCONT)" if f.state not in "RS" else "")
        )
    silent = sum(1 for f in fences if not f.answer.isdigit())
    if silent:
        print(
            f"  the paused replica answered nothing after SIGCONT in {silent} of {len(fences)} (see its log)"
        )
    ok_fence = len(fences) == args.stops and all(
        f.taken and not f.writes_after and f.answer != "200" for f in fences
    )
    print(
        "goal: the paused replica writes nothing once it runs again, its queued delivery is not "
        f"answered 200: {verdict(ok_fence)}"
    )
    return ok_fence


async def figure_partitions(bench: Bench, args: argparse.Namespace) -> bool:
    parts: list[Partition] = []
    print(
        f"\nTwo leaders at once ({args.partitions} times): the leader's Lease requests fail, everything "
        "else (deliveries too) still reaches it"
    )
    print(
        f"{'cut':>4} {'not ready after':>15} {'its last write':>14} {'Lease taken after':>17}"
        f" {'writes after the takeover':>25}"
    )
    for i in range(args.partitions):
        c = await attempt(bench, i, bench.partition)
        if c is None:
            continue
        parts.append(c)
        what = ", ".join(f"{e.verb} {e.resource} ({e.code})" for e in c.writes_after) or "none"
        print(
            f"{i + 1:4d} {_fmt(c.unready):>15} {_fmt(c.last_write):>14} {_fmt(c.taken):>17}"
            f" {len(c.writes_after):5d} {what}"
        )
    ok_part = len(parts) == args.partitions and all(
        c.taken is not None and not c.writes_after and c.unready is not None and c.unready < c.taken
        for c in parts
    )
    print(
        "goal: it stops (not ready, no write) before the other replica takes the Lease: " + verdict(ok_part)
    )
    return ok_part


def report_invariants(bench: Bench, *, played: float, left_after: float | None) -> bool:
    obs, am = bench.observer, bench.am
    print(f"\nFigure 6: the invariants across those fail-overs ({played:.0f} s of alerts)")
    answers = ", ".join(f"{k}: {v}" for k, v in sorted(am.answers.items()))
    print(
        f"  {am.fired} faults fired on {len(am.nodes)} nodes; deliveries answered {answers}; "
        f"Alertmanager API read {am.api_reads} times"
    )
    print(
        f"  cordons made {obs.transitions['cordon']}, taints added {obs.transitions['taint']}, "
        f"SetInstanceHealth Unhealthy {len(bench.aws.unhealthy)} (moto; {bench.aws.describes} "
        f"DescribeAutoScalingInstances); the observer's watch restarted {obs.relists} times"
    )
    worst: dict[str, int] = {}
    for (_, _, _, what), n in obs.per_episode.items():
        worst[what] = max(worst.get(what, 0), n)
    twice = {k: n for k, n in obs.per_episode.items() if n > 1}
    ok_once = not twice
    print(
        f"  per node and episode: at most {worst.get('cordon', 0)} cordon, {worst.get('taint', 0)} taint, "
        f"{worst.get('SetInstanceHealth', 0)} SetInstanceHealth ({len(obs.per_episode)} (episode, action) "
        f"pairs; goal <= 1 each): {verdict(ok_once)}"
    )
    for (node, fp, start, what), n in list(twice.items())[:5]:
        print(f"    {what} {n} times: {node}, episode {fp} @ {rfc3339(start)}")
    budget_broken = obs.violations.counts["budget exceeded (sampled)"]
    ok_budget = budget_broken == 0
    print(
        f"  budget: at most {obs.max_held} nodes held in {obs.samples} samples, one a second "
        f"(goal <= {BUDGET}): {verdict(ok_budget)}"
    )
    other = {k: n for k, n in obs.violations.counts.items() if k != "budget exceeded (sampled)"}
    ok_attr = not other
    print(f"  every cordon and taint attributable to an episode on its node: {verdict(ok_attr)}")
    for kind, n in other.items():
        print(f"    {kind}: {n}, e.g. {'; '.join(obs.violations.examples[kind])}")
    ok_left = left_after is not None and left_after <= 60
    left = obs.leftovers()
    print(
        f"  after every alert resolved: nothing of this service left on any node after {_fmt(left_after)}"
        f" (goal <= 60 s): {verdict(ok_left)}"
        + (f"; still there: {dict(list(left.items())[:5])}" if left else "")
    )
    return ok_once and ok_budget and ok_attr and ok_left


async def compare(bench: Bench, args: argparse.Namespace) -> bool:
    """The same seeded script twice on a clean cluster: without a fail-over, then with one."""
    seconds, kill_at = args.compare_seconds, args.compare_kill_at
    script = make_script(
        args.seed + 1,
        tag=0xC0,
        nodes=args.nodes,
        seconds=max(seconds - 90, 30),
        rate=args.rate,
        durations=(30.0, 80.0),
        persistent=12,
    )
    print(
        f"\nA fail-over at {kill_at:.0f} s of a {seconds:.0f}-s script ({len(script)} faults, 12 never "
        "resolve), against the same script without it"
    )
    states = []
    ok_runs = True
    for with_kill in (False, True):
        await bench.stop_all_async()
        bench.observer.reset_stats()
        changed = await asyncio.to_thread(reset_nodes, bench.plane)
        await asyncio.to_thread(bench.aws.heal)
        await asyncio.sleep(2)
        bench.am.groups.clear()
        bench.am.active.clear()
        for _ in range(2):
            bench.spawn()
        await bench.pair(within=180)
        start = now()
        player = asyncio.create_task(play(bench.am, script))
        kill: KillResult | None = None
        if with_kill:
            await asyncio.sleep(max(0.0, start + kill_at - now()))
            kill = await bench.kill_leader(wait=(0.0, 0.0))
        await asyncio.sleep(max(0.0, start + seconds - now()))
        await player
        bench.am.repeat_all()
        settled = await bench.settle()
        state = bench.observer.state()
        states.append(state)
        held = sum(1 for c, t, _ in state.values() if c or t)
        conditions = Counter(s for _, _, s in state.values())
        print(
            f"  {'with' if with_kill else 'without'} the fail-over: {held} nodes held, conditions "
            f"{dict(conditions)}; settled: {'yes' if settled else 'NO'} (reset {changed} nodes before)"
            + (
                f"; the new leader ready {_fmt(kill.ready_after_lease)} after taking the Lease"
                if kill is not None
                else ""
            )
        )
        obs = bench.observer
        twice = sum(1 for n in obs.per_episode.values() if n > 1)
        print(
            f"    invariants: {obs.transitions['cordon']} cordons, {obs.transitions['taint']} taints, "
            f"{twice} (episode, action) pairs done twice, at most {obs.max_held} held "
            f"(budget {BUDGET}), other breaches {dict(obs.violations.counts) or 'none'}"
        )
        ok_runs = ok_runs and not twice and not obs.violations.counts
        bench.am.resolve_all()
        left = await bench.until_clean(120)
        ok_runs = ok_runs and left is not None
    a, b = states
    differ = sorted(n for n in set(a) | set(b) if a.get(n) != b.get(n))
    for n in differ[:10]:
        print(f"    {n}: without {a.get(n)}, with {b.get(n)}  (cordoned, tainted, condition)")
    ok = not differ
    print(
        f"  same cordons, taints and conditions on all {args.nodes} nodes ({len(differ)} differ): "
        + verdict(ok)
    )
    print(f"  the invariants of figure 6 in both runs, and nothing left once resolved: {verdict(ok_runs)}")
    return ok and ok_runs


# -- --lifecycle: drains, reboots and Events across the kills (issue 34) -------------------------------

WORK = "work"
"""The namespace of the nodes' pods."""
REBOOT_RULE = "reboot"
STEP_DRAIN, STEP_LIFECYCLE_AWS = 3, 4
"""Indices of the drain and of the AWS step (aws_reboot, aws_set_unhealthy) in both lifecycle rules
(the condition is 0, the cordon 1, the taint 2, as in POLICY)."""
DRAIN_TIMEOUT = 300
_LIFECYCLE_ACTIONS = f"""
      - {{type: condition, condition_type: {CONDITION}}}
      - cordon
      - {{type: taint, key: {TAINT_KEY}, value: "true", effect: NoSchedule}}
      - {{type: drain, timeout_seconds: {DRAIN_TIMEOUT}, delete_emptydir_data: true}}"""
_ON_RESOLVED = f"""
    on_resolved:
      - uncordon
      - {{type: untaint, key: {TAINT_KEY}}}
      - {{type: condition, condition_type: {CONDITION}}}"""
LIFECYCLE_POLICY = f"""
safety: {{max_disrupted_nodes: {BUDGET}, storm_breaker: {{enabled: false}}}}
events: all
repair: {{enabled: false}}
rules:
  - name: {REBOOT_RULE}
    match: ['alertname="{ALERTNAMES[0]}"']
    actions:{_LIFECYCLE_ACTIONS}
      - aws_reboot{_ON_RESOLVED}
  - name: {RULE}
    actions:{_LIFECYCLE_ACTIONS}
      - aws_set_unhealthy{_ON_RESOLVED}
"""
REBOOT_SECONDS = (5.0, 20.0)
"""How long after a RebootInstances the node comes back with a new boot id (the kubelet stand-in)."""
EPISODE_GAP = 30.0
"""Seconds between two faults of one kind on one node: an Event is told apart by its alertname and
time."""


def workload(plane: ControlPlane, nodes: int) -> int:
    """Pods on the nodes: `web` (one a node, no budget) and `guarded` (one on every third node) under a
    PodDisruptionBudget that lets one go at a time, so that drains wait for each other; how many."""
    web = deployment("web", WORK, node_selector={"pool": "gpu"}, replicas=nodes)
    guarded = deployment("guarded", WORK, node_selector={"pool": "gpu"}, replicas=max(3, nodes // 3))
    budget: Obj = {
        "apiVersion": "policy/v1beta1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": "guarded", "namespace": WORK},
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": {"app": "guarded"}}},
    }
    namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": WORK}}
    apply_objects(plane.admin, [namespace, web, guarded, budget])
    total = nodes + max(3, nodes // 3)
    deadline = now() + 600
    while now() < deadline:
        pods = plane.admin.items(f"/api/v1/namespaces/{WORK}/pods")
        if sum(1 for p in pods if (p.get("status") or {}).get("phase") == "Running") >= total:
            return total
        time.sleep(1.0)
    raise TimeoutError(f"the {total} pods were not Running within 600 s")


def lifecycle_marks(obj: Obj) -> list[str]:
    """What of this service holds the node (a leftover once every alert resolved): cordon, taint,
    record, ownership annotations, a running drain, the condition still False."""
    annotations = _annotations(obj)
    marks = [m for m, on in (("cordon", _unschedulable(obj)), ("taint", _tainted(obj))) if on]
    marks += [k.removeprefix(PREFIX) for k in (EPISODES, CORDONED_BY, TAINTS_ADDED) if k in annotations]
    if annotations.get(DRAIN_STATUS) == "in-progress":
        marks.append("drain in-progress")
    if _condition(obj) == "False":
        marks.append(f"{CONDITION}=False")
    return marks


def lifecycle_leftovers(obs: Observer) -> dict[str, list[str]]:
    return {name: marks for name, obj in obs.nodes.items() if (marks := lifecycle_marks(obj))}


def kept_annotations(obs: Observer) -> Counter[str]:
    """The annotations of this service left on nodes that hold nothing (kept by design: the drain's
    last status, the `rebooted` annotation that turns a fault after a reboot into a replacement)."""
    out: Counter[str] = Counter()
    for obj in obs.nodes.values():
        for k, v in _annotations(obj).items():
            if k.startswith(PREFIX) and k not in (EPISODES, CORDONED_BY, TAINTS_ADDED):
                out[k.removeprefix(PREFIX) + (f"={v}" if k == DRAIN_STATUS else "")] += 1
    return out


@dataclass
class EventCount:
    per_episode: Counter[tuple[str, str, str]] = field(default_factory=Counter)
    """(node, fingerprint, reason) -> Events written (each Event's count)."""
    reasons: Counter[str] = field(default_factory=Counter)
    objects: int = 0
    unattributed: list[str] = field(default_factory=list)


def count_events(plane: ControlPlane, am: Alertmanager, nodes: int) -> EventCount:
    """This service's Events on nodes, each given to the episode it tells of: its node, the alertname
    its message names, the newest fault of that kind on that node fired before it."""
    index = {node_name(i): i for i in range(nodes)}
    fired: dict[tuple[int, int], list[tuple[float, str]]] = {}
    for fp, f in am.faults.items():
        fired.setdefault((f.node, f.kind), []).append((am.fired_at[fp], fp))
    out = EventCount()
    for ev in plane.admin.items("/api/v1/namespaces/default/events"):
        involved = ev.get("involvedObject") or {}
        reason, message = str(ev.get("reason", "")), str(ev.get("message", ""))
        if involved.get("kind") != "Node" or not reason.startswith("Accel"):
            continue
        out.objects += 1
        if reason == "AccelConditionSet":
            reason += " True" if f"{CONDITION}=True" in message else " False"
        count = int(ev.get("count") or 1)
        out.reasons[reason] += count
        node = str(involved.get("name"))
        kinds = [k for k, a in enumerate(ALERTNAMES) if a in message]
        at = parse_time(ev.get("firstTimestamp") or ev.get("eventTime"))
        before = [
            (t, fp)
            for t, fp in fired.get((index.get(node, -1), kinds[0] if kinds else -1), [])
            if at and t <= at + 1
        ]
        if not before:
            out.unattributed.append(f"{node} {reason}: {message[:100]}")
            continue
        out.per_episode[(node, max(before)[1], reason)] += count
    return out


async def leader_state(bench: Bench) -> dict[str, Any] | None:
    """GET /state of the ready replica (the leader)."""
    target = bench.target()
    if target is None:
        return None
    async with bench.http.get(
        target.url + "/state",
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=aiohttp.ClientTimeout(total=30),
    ) as resp:
        body: dict[str, Any] = await resp.json()
        return body


async def until_released(bench: Bench, within: float) -> float | None:
    """Seconds until every group is delivered and no node holds anything of this service."""
    start = now()
    while now() - start < within:
        if bench.am.settled and not lifecycle_leftovers(bench.observer):
            return now() - start
        await asyncio.sleep(0.5)
    return None


async def lifecycle(bench: Bench, args: argparse.Namespace, kubelet: FakeKubelet) -> bool:
    """The kills while faults fire and resolve under the lifecycle policy; then every alert resolved."""
    obs = bench.observer
    obs.rules = frozenset({RULE, REBOOT_RULE})
    obs.step_drain, obs.step_aws, obs.reboot_rule = STEP_DRAIN, STEP_LIFECYCLE_AWS, REBOOT_RULE
    loop = asyncio.get_running_loop()
    rng = random.Random(args.seed + 7)
    reboots: set[asyncio.Task[Any]] = set()

    def boot(node: str) -> None:
        task = asyncio.create_task(asyncio.to_thread(kubelet.reboot, node))
        reboots.add(task)
        task.add_done_callback(reboots.discard)

    def rebooted(instance: str) -> None:
        node = bench.node_of.get(instance, instance)
        loop.call_later(2.0, obs.call_made, "RebootInstances", node)
        loop.call_later(rng.uniform(*REBOOT_SECONDS), boot, node)

    def unhealthy(instance: str) -> None:
        loop.call_later(2.0, obs.call_made, "SetInstanceHealth", bench.node_of.get(instance, instance))

    bench.aws.on_reboot, bench.aws.on_unhealthy = rebooted, unhealthy
    script = make_script(
        args.seed,
        tag=0xB0,
        nodes=args.nodes,
        seconds=3600,
        rate=args.rate,
        durations=(30.0, 90.0),
        gap=EPISODE_GAP,
    )
    for _ in range(2):
        bench.spawn()
    await bench.pair(within=180)
    stop = asyncio.Event()
    player = asyncio.create_task(play(bench.am, script, stop=stop))
    t0 = now()
    bench.audit.skip()
    await asyncio.sleep(args.warmup)  # alerts arrive, drains start, before the first kill
    ok_kills = await figure_kills(bench, args, t0)
    await asyncio.sleep(args.tail)  # the last kill's new leader carries on
    stop.set()
    await player
    played = now() - t0
    bench.am.resolve_all()
    released = await until_released(bench, 300)
    quiet = await bench.settle(quiet=10.0, within=120.0)
    state = await leader_state(bench)
    ok = await report_lifecycle(
        bench, args, t0=t0, played=played, released=released, quiet=quiet, state=state
    )
    print(
        f"\nlifecycle across {args.kills} SIGKILLs: {'PASS' if ok else 'FAIL'}"
        + ("" if ok_kills else " (the fail-over time goal above was missed: not part of this verdict)")
    )
    return ok


async def report_lifecycle(
    bench: Bench,
    args: argparse.Namespace,
    *,
    t0: float,
    played: float,
    released: float | None,
    quiet: bool,
    state: dict[str, Any] | None,
) -> bool:
    obs = bench.observer
    audit = await asyncio.to_thread(bench.audit.read)
    events = await asyncio.to_thread(count_events, bench.plane, bench.am, args.nodes)
    evictions = Counter(e.code for e in audit if (e.verb, e.resource) == ("create", "pods/eviction"))
    event_writes = Counter(e.verb for e in audit if e.resource == "events" and e.verb in WRITES)
    am = bench.am

    print(f"\nDrains, reboots and Events across {args.kills} SIGKILLs ({played:.0f} s of alerts)")
    answers = ", ".join(f"{k}: {v}" for k, v in sorted(am.answers.items()))
    print(
        f"  {am.fired} faults fired on {len(am.nodes)} nodes ({args.nodes} nodes, {bench.pods} pods); "
        f"deliveries answered {answers}"
    )
    print(
        f"  cordons {obs.transitions['cordon']}, taints {obs.transitions['taint']}, drain starts "
        f"{obs.transitions['drain']}; evictions asked {sum(evictions.values())} "
        f"({', '.join(f'{c}: {n}' for c, n in sorted(evictions.items()))}); RebootInstances "
        f"{len(bench.aws.reboots)}, SetInstanceHealth Unhealthy {len(bench.aws.unhealthy)} (moto)"
    )
    print(
        f"  Events: {events.objects} objects ({event_writes['create']} created, {event_writes['patch']} "
        f"count bumps in the audit log): " + ", ".join(f"{r} {n}" for r, n in sorted(events.reasons.items()))
    )
    worst: dict[str, int] = {}
    for (_, _, _, what), n in obs.per_episode.items():
        worst[what] = max(worst.get(what, 0), n)
    for (_, _, reason), n in events.per_episode.items():
        worst[reason] = max(worst.get(reason, 0), n)
    twice = [(k, n) for k, n in obs.per_episode.items() if n > 1]
    twice_events = [(k, n) for k, n in events.per_episode.items() if n > 1]
    ok_once = not twice and not twice_events and not events.unattributed
    print("  per node and episode, at most (goal <= 1 each):")
    for what in ("cordon", "taint", "drain start", "RebootInstances", "SetInstanceHealth"):
        print(f"    {what:<34} {worst.get(what, 0)}")
    for reason in sorted(events.reasons):
        print(f"    Event {reason:<28} {worst.get(reason, 0)}")
    print(
        f"  ({len(obs.per_episode)} (episode, action) and {len(events.per_episode)} (episode, Event reason) "
        f"pairs): {verdict(ok_once)}"
    )
    for (node, fp, start, what), n in twice[:10]:
        print(f"    {what} {n} times: {node}, episode {fp} @ {rfc3339(start)}")
    for (node, fp, reason), n in twice_events[:10]:
        print(f"    Event {reason} {n} times: {node}, episode {fp} fired at t+{am.fired_at[fp] - t0:.0f}s")
    for line in events.unattributed[:5]:
        print(f"    Event of no episode: {line}")
    other = dict(obs.violations.counts)
    ok_attr = not other
    print(
        f"  budget: at most {obs.max_held} nodes held in {obs.samples} samples (goal <= {BUDGET}); every "
        f"cordon, taint, drain start and AWS call recorded on its node: {verdict(ok_attr)}"
    )
    for kind, n in other.items():
        print(f"    {kind}: {n}, e.g. {'; '.join(obs.violations.examples[kind])}")
    left = lifecycle_leftovers(obs)
    held = {} if state is None else state["budget"]["holders"]
    in_use = None if state is None else state["budget"]["in_use"]
    drains = {} if state is None else state["drains"]
    holds = {} if state is None else state.get("holds", {})
    ok_left = (
        released is not None
        and quiet
        and not left
        and state is not None
        and not held
        and not drains
        and not holds
    )
    print(
        f"  after every alert resolved: nothing held on any node after {_fmt(released)} (goal <= 300 s), "
        f"quiet for 10 s: {'yes' if quiet else 'NO'}; the leader's /state: budget {in_use} in use, "
        f"{len(held)} holders, {len(drains)} drains running, {len(holds)} nodes with a hold: "
        + verdict(ok_left)
    )
    if left:
        print(f"    still held: {dict(list(left.items())[:8])}")
    if held or drains or holds:
        print(f"    holders {list(held)[:8]}, drains {list(drains)[:8]}, holds {list(holds)[:8]}")
    kept = kept_annotations(obs)
    if kept:
        print(
            "    kept by design on released nodes: " + ", ".join(f"{k} {n}" for k, n in sorted(kept.items()))
        )
    return ok_once and ok_attr and ok_left


@contextlib.contextmanager
def workdir_of(path: str | None) -> Iterator[Path]:
    if path:
        Path(path).mkdir(parents=True, exist_ok=True)
        yield Path(path)
        return
    with tempfile.TemporaryDirectory(prefix="accel-health-bench-") as tmp:
        yield Path(tmp)


async def run(args: argparse.Namespace) -> bool:
    with workdir_of(args.workdir) as workdir, contextlib.ExitStack() as stack:
        t0 = now()
        plane = stack.enter_context(control_plane(workdir / "control-plane"))
        aws = Aws(workdir)
        aws.start_moto()  # from this thread: a child dies with the thread that started it
        instances = await asyncio.to_thread(aws.make_group, args.nodes)
        kubelet = None
        if args.lifecycle:
            settings = KubeletSettings(tick=0.5, start_delay=0.5, terminate_delay=0.5)
            kubelet = FakeKubelet(plane=plane, workdir=workdir, settings=settings)
        await asyncio.to_thread(populate, plane, workdir, instances, kubelet)
        accounts = []
        for i in range(3):
            name = f"bench-failover-{i}"
            token = await asyncio.to_thread(plane.cluster_admin_account, NS, name)
            accounts.append(Account(name=name, token=token))
        pods, server = 0, None
        if kubelet is not None:
            kubelet.start()
            stack.callback(kubelet.stop)
            pods = await asyncio.to_thread(workload, plane, args.nodes)
            # The replicas speak policy/v1 (evictions, budgets); this 1.20 server serves v1beta1.
            server = stack.enter_context(skew_proxy(plane))
        print(
            f"real API server with {args.nodes} nodes"
            + (f" and {pods} pods (the kubelet played)" if pods else "")
            + f", moto with as many instances in an Auto Scaling group, up in {now() - t0:.0f} s; "
            f"logs in {workdir}"
        )
        context = ssl.create_default_context(cafile=str(plane.pki.ca_cert))
        async with (
            aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=context),
                headers={"Authorization": f"Bearer {plane.admin_token}"},
                read_bufsize=4 * 1024 * 1024,
            ) as api,
            aiohttp.ClientSession() as http,
        ):
            bench = Bench(
                plane=plane,
                workdir=workdir,
                accounts=accounts,
                api=api,
                http=http,
                aws=aws,
                instances=instances,
                seed=args.seed,
                policy=LIFECYCLE_POLICY if args.lifecycle else POLICY,
                server=server,
            )
            bench.pods = pods
            await bench.start()
            try:
                ok = True
                if kubelet is not None:
                    ok = await lifecycle(bench, args, kubelet)
                elif "f" in args.parts:
                    ok = await figures(bench, args) and ok
                if kubelet is None and "c" in args.parts:
                    ok = await compare(bench, args) and ok
            finally:
                await bench.close()
            return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--lifecycle",
        action="store_true",
        help="drains, reboots and Events across the kills (default 200 nodes, rate 0.3)",
    )
    parser.add_argument("--nodes", type=int, help="default 2000 (--lifecycle: 200)")
    parser.add_argument("--kills", type=int, default=20, help="SIGKILL fail-overs (default 20)")
    parser.add_argument(
        "--failed-reads", type=int, default=3, help="fail-overs with a failed read (default 3)"
    )
    parser.add_argument("--stops", type=int, default=3, help="leaders paused past their Lease (default 3)")
    parser.add_argument(
        "--partitions", type=int, default=3, help="leaders cut off from the Lease only (default 3)"
    )
    parser.add_argument("--rate", type=float, help="faults a second (default 1; --lifecycle: 0.3)")
    parser.add_argument(
        "--warmup", type=float, default=30.0, help="--lifecycle: seconds of faults before the first kill"
    )
    parser.add_argument(
        "--tail", type=float, default=20.0, help="--lifecycle: seconds of faults after the last kill"
    )
    parser.add_argument("--compare-seconds", type=float, default=360.0, help="the comparison's script length")
    parser.add_argument("--compare-kill-at", type=float, default=300.0, help="its fail-over (default 300 s)")
    parser.add_argument("--parts", default="fc", help="f: figures 5 and 6; c: the comparison (default fc)")
    parser.add_argument("--seed", type=int, default=23)
    parser.add_argument("--workdir", help="keep the control plane's and the replicas' files and logs here")
    args = parser.parse_args()
    if args.nodes is None:
        args.nodes = 200 if args.lifecycle else 2000
    if args.rate is None:
        args.rate = 0.3 if args.lifecycle else 1.0
    reason = control_plane_skip_reason()
    if reason:
        print(f"skipped: {reason}")
        return 0
    return 0 if asyncio.run(run(args)) else 1


if __name__ == "__main__":
    sys.exit(main())
