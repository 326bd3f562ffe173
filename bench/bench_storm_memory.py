"""Memory of the remediator over a sustained alert storm: flat, or what grows.

An alert storm is played against the engine for `--minutes` (default 10) on a 2,000-node cluster: the
real API server of tests/kube (`--cluster kube`, the default when the control plane binaries are
there; the engine runs over the real Kubernetes executor and its node cache) or the in-memory
snapshot backend (`--cluster snapshot`). Every 2 s (a tick):

- alerts resolve (each with a small chance per tick), and a few stop being sent without a resolve
  (Alertmanager lost them: the expiry, or the next read of Alertmanager's API, ends them);
- new ones fire up to the storm's level: mostly new label sets (new fingerprints: node, GPU, alert
  name), some label sets that fired before (a new episode: same fingerprint, new startsAt). The level
  is 8 % of the nodes, with a surge to 40 % for a minute in every four (the storm breaker opens, and
  closes again after its cooldown);
- Alertmanager's grouping is the shipped one (by node): every node whose alerts changed gets a
  delivery (firing and just-resolved alerts), and a tenth of the other groups are resent, so each
  group is resent every 20 s or so;
- every 30 s Alertmanager's API v2 view of what fires is reconciled, with one alert in twenty silenced.

The policy is the shipped default's shape (condition, then cordon or taint; budget 2; Events for
everything) with reversal on resolve, a rate limit, a 60 s breaker cooldown and a 120 s alert expiry,
so that every gate keeps state. Every 30 s the process's resident memory (RSS), the sizes of the
engine's bookkeeping, the gate-state documents written so far (count and MiB) and, on the real API
server, the size of etcd's database are sampled (with `--tracemalloc`, also the Python heap traced,
and the allocation sites that grew most since minute 2 are listed; RSS then includes tracemalloc's own
cost). Printed: the series and the growth between minute 2 (after the warm-up: caches and the decision
log full, a whole surge seen) and the end. Target: RSS growth from minute 2 to the end <= 5 % and
<= 8 MiB, every bookkeeping size bounded by what fires now (or by its own cap). A storm the backend
cannot take (the API server failing) stops early and is reported as missing the target.

Other work on the machine slows the ticks down (they are reported); memory does not depend on it.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import hashlib
import json
import logging
import random
import statistics
import sys
import tempfile
import time
import tracemalloc
import urllib.request
from collections import Counter
from collections.abc import Mapping
from contextlib import AsyncExitStack, ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the control-plane harness lives in tests/kube

from bench_reconcile_api import NODES, connection, node_name, populate, record_bytes  # noqa: E402  same harness

from remediator.cluster import BackendUnavailable, Cluster, Node  # noqa: E402  after sys.path
from remediator.desired.alertmanager import AlertmanagerView, ShownAlert  # noqa: E402  after sys.path
from remediator.executors.kubernetes import KubernetesCluster  # noqa: E402  after sys.path
from remediator.executors.snapshot import RecordingAws, SnapshotCluster  # noqa: E402  after sys.path
from remediator.intake.payload import parse_body  # noqa: E402  after sys.path
from remediator.lifecycle.engine import Engine  # noqa: E402  after sys.path
from remediator.lifecycle.model import EngineSettings  # noqa: E402  after sys.path
from remediator.policy import parse_policy  # noqa: E402  after sys.path
from tests.kube.conftest import control_plane_skip_reason  # noqa: E402  after sys.path
from tests.kube.controlplane import ControlPlane, control_plane  # noqa: E402  after sys.path

GPUS = 8
TICK = 2.0
SAMPLE = 30.0
BASELINE = 120.0  # seconds: the warm-up (caches and the decision log full, a whole surge seen)
BASE_SHARE, SURGE_SHARE = 0.08, 0.40
CYCLE, SURGE, WARM = 240.0, 60.0, 30.0  # seconds: a 1-minute surge every 4 minutes from 0.5 min
RESOLVE_P, VANISH_P, EPISODE_P = 0.02, 0.002, 0.3
NEW_PER_TICK = 60  # at most this many alerts start per tick (Prometheus's rules fire over a few cycles)
RESEND_SHARE = 0.1
ALERTS = (
    ("AccelGPUFatalXid", "cordon", "GPU has fallen off the bus"),
    ("AccelGPURowRemapFailure", "cordon", "row remapping failed"),
    ("AccelGPUUncorrectableECC", "cordon", "uncorrectable ECC errors"),
    ("AccelPCIeAERFatal", "taint", "PCIe fatal AER"),
    ("AccelInfiniBandPortDown", "taint", "InfiniBand port down"),
)
POLICY = parse_policy(
    """
safety:
  max_disrupted_nodes: 2
  rate_limits: {cordon: {max_actions: 5, window_seconds: 120}}
  storm_breaker: {threshold_percent: 30, min_nodes: 3, cooldown_seconds: 60}
  alert_expiry_seconds: 120
events: all
rules:
  - name: cordon
    match: ['remediation="cordon"']
    actions: [{type: condition, condition_type: AcceleratorHealthy}, {type: cordon}]
    on_resolved: [{type: uncordon}, {type: condition, condition_type: AcceleratorHealthy}]
  - name: taint
    match: ['remediation="taint"']
    actions:
      - {type: condition, condition_type: AcceleratorHealthy}
      - {type: taint, key: accel-health.io/unhealthy, value: "true", effect: NoSchedule}
    on_resolved:
      - {type: untaint, key: accel-health.io/unhealthy}
      - {type: condition, condition_type: AcceleratorHealthy}
""",
    source="bench: storm",
)


def rfc3339(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t * 1000) % 1000:03d}Z"


# -- the storm ----------------------------------------------------------------------------------------


@dataclass
class Firing:
    labels: dict[str, str]
    starts: str
    summary: str


@dataclass
class Storm:
    """Alertmanager's view of a storm: what fires, what just resolved, grouped by node."""

    rng: random.Random
    firing: dict[str, Firing] = field(default_factory=dict)  # fingerprint -> alert
    resolved: dict[str, tuple[Firing, int]] = field(default_factory=dict)  # fp -> (alert, sends left)
    dormant: dict[str, Firing] = field(default_factory=dict)  # fired before, may fire again
    started: int = 0
    episodes: int = 0
    resolves: int = 0
    vanished: int = 0

    @staticmethod
    def fingerprint(labels: dict[str, str]) -> str:
        text = json.dumps(sorted(labels.items()))
        return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()

    def _new_labels(self) -> tuple[dict[str, str], str]:
        alertname, remediation, summary = self.rng.choice(ALERTS)
        labels = {
            "alertname": alertname,
            "node": node_name(self.rng.randrange(NODES)),
            "gpu": str(self.rng.randrange(GPUS)),
            "remediation": remediation,
            "severity": "critical",
        }
        return labels, summary

    def tick(self, now: float, level: int) -> set[str]:
        """One tick; the nodes whose group changed."""
        changed: set[str] = set()
        for fp, (_, left) in list(self.resolved.items()):
            if left <= 0:  # sent twice (or forgotten, as Alertmanager forgets resolved alerts)
                del self.resolved[fp]
        for fp, alert in list(self.firing.items()):
            roll = self.rng.random()
            if roll < RESOLVE_P:
                del self.firing[fp]
                self.resolved[fp] = (alert, 2)  # sent resolved with its group's next two deliveries
                self.dormant[fp] = alert
                self.resolves += 1
                changed.add(alert.labels["node"])
            elif roll < RESOLVE_P + VANISH_P:
                del self.firing[fp]  # never resolved: expiry (or the API) ends it
                self.vanished += 1
        new = 0
        while len(self.firing) < level and new < NEW_PER_TICK:
            if self.dormant and self.rng.random() < EPISODE_P:
                fp = self.rng.choice(list(self.dormant))
                old = self.dormant.pop(fp)
                if fp in self.firing or fp in self.resolved:
                    continue
                alert = Firing(labels=old.labels, starts=rfc3339(now), summary=old.summary)
                self.episodes += 1
            else:
                labels, summary = self._new_labels()
                fp = self.fingerprint(labels)
                if fp in self.firing or fp in self.resolved:
                    continue
                alert = Firing(labels=labels, starts=rfc3339(now), summary=summary)
            self.firing[fp] = alert
            self.started += 1
            new += 1
            changed.add(alert.labels["node"])
        while len(self.dormant) > 20_000:  # Alertmanager forgets resolved alerts too
            self.dormant.pop(next(iter(self.dormant)))
        return changed

    def _doc(self, fp: str, alert: Firing, status: str, now: float) -> dict[str, Any]:
        return {
            "status": status,
            "labels": alert.labels,
            "annotations": {"summary": alert.summary},
            "startsAt": alert.starts,
            "endsAt": rfc3339(now) if status == "resolved" else "0001-01-01T00:00:00Z",
            "generatorURL": "http://prometheus:9090/graph",
            "fingerprint": fp,
        }

    def deliveries(self, nodes: set[str], now: float) -> list[bytes]:
        """One webhook body per node group (firing alerts and those resolved lately)."""
        groups: dict[str, list[dict[str, Any]]] = {n: [] for n in nodes}
        for fp, alert in self.firing.items():
            if alert.labels["node"] in groups:
                groups[alert.labels["node"]].append(self._doc(fp, alert, "firing", now))
        for fp, (alert, left) in list(self.resolved.items()):
            if alert.labels["node"] in groups:
                groups[alert.labels["node"]].append(self._doc(fp, alert, "resolved", now))
                self.resolved[fp] = (alert, left - 1)
        bodies = []
        for node, alerts in sorted(groups.items()):
            if not alerts:
                continue
            status = "firing" if any(a["status"] == "firing" for a in alerts) else "resolved"
            body = {
                "version": "4",
                "groupKey": f'{{}}:{{node="{node}"}}',
                "status": status,
                "receiver": "accel-health-remediator",
                "groupLabels": {"node": node},
                "alerts": alerts,
            }
            bodies.append(json.dumps(body).encode())
        return bodies

    def resend_some(self) -> set[str]:
        """A tenth of the groups (nodes with alerts firing or just resolved) are sent again."""
        nodes = {a.labels["node"] for a in self.firing.values()}
        nodes |= {a.labels["node"] for a, _ in self.resolved.values()}
        return {n for n in sorted(nodes) if self.rng.random() < RESEND_SHARE}

    def view(self, now: float) -> AlertmanagerView:
        """Alertmanager's API v2: what fires now, one alert in twenty silenced."""
        shown = {}
        for fp, alert in self.firing.items():
            doc = {"version": "4", "alerts": [self._doc(fp, alert, "firing", now)]}
            parsed = parse_body(json.dumps(doc).encode())
            why = "silenced in Alertmanager by bench" if int(fp, 16) % 20 == 0 else ""
            shown[fp] = ShownAlert(alert=parsed.alerts[0], suppressed=why)
        return AlertmanagerView(alerts=shown, reached=("http://alertmanager:9093",))


def level_at(elapsed: float) -> int:
    """How many alerts fire at this point of the storm: a surge for one minute in every four, from
    0.5 min on, so that minute 2 (the baseline) comes after a whole surge, as the end does."""
    phase = (elapsed - WARM) % CYCLE if elapsed >= WARM else CYCLE
    share = SURGE_SHARE if phase < SURGE else BASE_SHARE
    return int(share * NODES * 1.2)  # 1.2 alerts per faulty node


# -- the clusters, their writes of the gates document counted -------------------------------------------


def _size(document: Mapping[str, Any]) -> int:
    return len(json.dumps(document, separators=(",", ":"), sort_keys=True))


class CountedKube(KubernetesCluster):
    """The Kubernetes executor, counting the gates documents it writes (the one object outside nodes)."""

    state_writes = 0
    state_bytes = 0
    state_largest = 0

    async def save_gates(self, document: Mapping[str, Any]) -> None:
        await super().save_gates(document)
        self.state_writes += 1
        self.state_bytes += _size(document)
        self.state_largest = max(self.state_largest, _size(document))


class CountedSnapshot(SnapshotCluster):
    """The in-memory backend, counting the gates documents it writes."""

    state_writes = 0
    state_bytes = 0
    state_largest = 0

    async def save_gates(self, document: Mapping[str, Any]) -> None:
        await super().save_gates(document)
        self.state_writes += 1
        self.state_bytes += _size(document)
        self.state_largest = max(self.state_largest, _size(document))


def etcd_mib(plane: ControlPlane) -> float:
    """etcd's database file size (what its 2 GiB quota is counted against), from its /metrics."""
    etcd = next(p for p in plane.processes if p.name == "etcd")
    args = etcd.popen.args
    assert isinstance(args, list)  # the harness starts every process from a list of arguments
    url = next(a.split("=", 1)[1] for a in map(str, args) if a.startswith("--listen-client-urls="))
    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:  # noqa: S310  loopback http
        for line in resp.read().decode().splitlines():
            if line.startswith("etcd_mvcc_db_total_size_in_bytes "):
                return float(line.split()[1]) / 2**20
    return float("nan")


# -- measuring -------------------------------------------------------------------------------------


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def sizes(engine: Engine, cluster: Cluster) -> dict[str, int]:
    """The engine's bookkeeping, by what it is keyed on, and what it wrote outside nodes."""
    gates = engine.gates
    out = {
        "decided": len(engine.decided),
        "pending": len(engine.pending),
        "log": len(engine.log),
        "held": sum(len(v) for v in engine.reconciler.held.values()),
        "firing": len(engine.firing.all()),
        "suppressed": len(engine.suppressed),
        "budget": len(gates.budget.holders()),
        "others": len(gates.budget.others),
        "rate": sum(gates.rate.usage().values()),
        "record_B": record_bytes(await cluster.list_nodes()),
    }
    if isinstance(cluster, KubernetesCluster):
        out["event_keys"] = cluster.event_series
        out["cached_nodes"] = len(cluster.nodes.objects())
    if isinstance(cluster, CountedKube | CountedSnapshot):
        out["state_writes"] = cluster.state_writes
        out["state_B"] = cluster.state_largest
    return out


class LogCounter(logging.Handler):
    """Counts warnings and errors by logger (the decision lines are INFO and not formatted at all)."""

    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.counts: Counter[str] = Counter()
        self.last: dict[str, str] = {}

    def emit(self, record: logging.LogRecord) -> None:
        key = f"{record.name} {record.levelname}"
        self.counts[key] += 1
        self.last[key] = record.getMessage()[:160]


@dataclass
class Sample:
    minute: float
    rss: float
    traced: float
    sizes: dict[str, int]
    ticks: int
    deliveries: int


# -- the run -----------------------------------------------------------------------------------------


@dataclass
class Run:
    """The storm against one engine, with what it measured."""

    engine: Engine
    cluster: Cluster
    weather: Storm
    api: bool
    trace: Path | None
    """Where the minute-2 tracemalloc snapshot goes (on disk, so that holding it costs no memory)."""
    plane: ControlPlane | None = None
    failure: str = ""
    """Why the storm stopped early (the backend failed), if it did."""
    samples: list[Sample] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    ticks: int = 0
    late_ticks: int = 0
    deliveries: int = 0
    traced_at_2: bool = False

    async def tick(self, now: float, elapsed: float) -> None:
        """One tick of the storm: the deliveries Alertmanager would make now."""
        weather = self.weather
        changed = weather.tick(now, level_at(elapsed))
        bodies = weather.deliveries(changed | weather.resend_some(), now)
        for body in bodies:
            started = time.perf_counter()
            await self.engine.handle(parse_body(body))
            self.latencies.append(time.perf_counter() - started)
            if isinstance(self.cluster, SnapshotCluster):  # the in-memory backend's record for tests
                self.cluster.mutations.clear()
                self.cluster.events.clear()
        self.deliveries += len(bodies)
        self.engine.status()  # as a metrics scrape does: the breaker closes by the clock
        self.ticks += 1

    async def read_api(self, now: float) -> None:
        started = time.perf_counter()
        await self.engine.reconcile(self.weather.view(now))
        self.latencies.append(time.perf_counter() - started)

    async def sample(self, elapsed: float) -> None:
        gc.collect()
        traced = tracemalloc.get_traced_memory()[0] / 2**20 if self.trace else float("nan")
        counts = await sizes(self.engine, self.cluster)
        if self.plane is not None:
            counts["etcd_MiB"] = round(etcd_mib(self.plane))
        sample = Sample(elapsed / 60, rss_mib(), traced, counts, self.ticks, self.deliveries)
        self.samples.append(sample)
        print_sample(sample, first=len(self.samples) == 1)
        if self.trace and not self.traced_at_2 and elapsed >= BASELINE - 1:
            tracemalloc.take_snapshot().dump(str(self.trace))
            self.traced_at_2 = True

    async def play(self, minutes: float) -> None:
        t0 = time.time()
        next_sample, next_view, end = t0, t0 + SAMPLE, t0 + minutes * 60
        while True:
            now = time.time()
            if now >= next_sample:
                await self.sample(now - t0)
                next_sample += SAMPLE
                if now >= end:
                    return
            try:
                await self.tick(now, now - t0)
                if self.api and now >= next_view:
                    await self.read_api(now)
                    next_view += SAMPLE
            except BackendUnavailable as exc:
                self.failure = f"at minute {(time.time() - t0) / 60:.1f}: {exc}"
                await self.sample(time.time() - t0)
                return
            spent = time.time() - now
            self.late_ticks += spent > TICK
            await asyncio.sleep(max(0.0, TICK - spent))

    def stats(self) -> dict[str, Any]:
        w, lat = self.weather, sorted(self.latencies)
        out: dict[str, Any] = {
            "ticks": self.ticks,
            "late_ticks": self.late_ticks,
            "deliveries": self.deliveries,
            "alerts_started": w.started,
            "new_episodes": w.episodes,
            "resolves": w.resolves,
            "vanished": w.vanished,
            "breaker_trips": self.engine.gates.breaker.trips,
        }
        if lat:
            out["delivery_ms"] = {
                "p50": round(statistics.median(lat) * 1000, 1),
                "p95": round(lat[int(0.95 * (len(lat) - 1))] * 1000, 1),
                "max": round(lat[-1] * 1000, 1),
            }
        return out

    def growth(self) -> list[str]:
        if not (self.trace and self.traced_at_2):
            return []
        assert self.trace is not None
        return top_growth(tracemalloc.Snapshot.load(str(self.trace)), tracemalloc.take_snapshot())


def top_growth(before: tracemalloc.Snapshot, after: tracemalloc.Snapshot, limit: int = 12) -> list[str]:
    keep = [tracemalloc.Filter(inclusive=False, filename_pattern=tracemalloc.__file__)]
    diff = after.filter_traces(keep).compare_to(before.filter_traces(keep), "lineno")
    out = []
    for stat in diff[:limit]:
        frame = stat.traceback[0]
        where = str(Path(frame.filename).resolve())
        where = where.replace(str(ROOT) + "/", "").replace(str(Path(sys.prefix).resolve()) + "/", "")
        out.append(f"{stat.size_diff / 1024:+9.1f} KiB {stat.count_diff:+8d} blocks  {where}:{frame.lineno}")
    return out


COLUMNS = (
    "decided",
    "pending",
    "log",
    "held",
    "firing",
    "suppressed",
    "budget",
    "event_keys",
    "record_B",
    "state_writes",
    "state_B",
    "etcd_MiB",
)


def print_sample(s: Sample, *, first: bool) -> None:
    names = [c for c in COLUMNS if c in s.sizes]
    if first:
        print(
            f"{'min':>5} {'RSS MiB':>8} {'traced':>7} {'ticks':>5} {'deliv':>6}  "
            + " ".join(f"{n:>9}" for n in names)
        )
    print(
        f"{s.minute:5.1f} {s.rss:8.1f} {s.traced:7.1f} {s.ticks:5d} {s.deliveries:6d}  "
        + " ".join(f"{s.sizes[n]:9d}" for n in names),
        flush=True,
    )


def report(run: Run) -> bool:
    print("storm: " + json.dumps(run.stats()))
    if run.failure:
        print(f"STOPPED EARLY: the backend failed {run.failure}")
    samples = run.samples
    base = next((s for s in samples if s.minute >= (BASELINE - 1) / 60), None)
    last = samples[-1]
    if base is None or base is last:
        print("too short to compare minute 2 with the end (use --minutes 3 or more)")
        return True
    grew = last.rss - base.rss
    share = 100 * grew / base.rss
    print(
        f"RSS at minute {base.minute:.1f}: {base.rss:.1f} MiB, at the end ({last.minute:.1f}): "
        f"{last.rss:.1f} MiB: {grew:+.1f} MiB ({share:+.1f} %)"
        + (f"; traced Python heap {last.traced - base.traced:+.1f} MiB" if run.trace else "")
    )
    print(
        "bookkeeping, minute 2 -> end: "
        + ", ".join(f"{k} {base.sizes[k]} -> {last.sizes[k]}" for k in last.sizes)
    )
    if growth := run.growth():
        print("allocation sites that grew most since minute 2 (tracemalloc):")
        for line in growth:
            print("  " + line)
    ok = share <= 5 and grew <= 8 and not run.failure
    print("target: RSS growth <= 5 % and <= 8 MiB from minute 2 to the end: " + ("met" if ok else "MISSED"))
    return ok


# -- clusters ----------------------------------------------------------------------------------------


def snapshot_cluster() -> CountedSnapshot:
    nodes = [
        Node(name=node_name(i), labels={"pool": "gpu"}, accelerators=("nvidia.com/gpu",))
        for i in range(NODES)
    ]
    return CountedSnapshot(nodes=nodes, pods=[], pdbs=[], source=f"<synthetic {NODES} nodes>")


async def kube_cluster(stack: AsyncExitStack, sync: ExitStack) -> tuple[CountedKube, ControlPlane]:
    """The 2,000-node real API server of bench_reconcile_api, and the executor over it."""
    workdir = Path(sync.enter_context(tempfile.TemporaryDirectory(prefix="accel-health-bench-")))
    t0 = time.monotonic()
    plane = sync.enter_context(control_plane(workdir / "control-plane"))
    token = await asyncio.to_thread(populate, plane, workdir)
    api, settings = connection(plane, token)
    kube = CountedKube(api=api, settings=settings)
    stack.push_async_callback(kube.close)
    assert await kube.start_cache(wait_seconds=120), "the node cache did not sync"
    print(f"real API server with {NODES} nodes up in {time.monotonic() - t0:.0f} s")
    return kube, plane


async def run(args: argparse.Namespace) -> bool:
    counter = LogCounter()
    logging.getLogger().addHandler(counter)
    logging.getLogger().setLevel(logging.WARNING)
    if args.tracemalloc:
        tracemalloc.start(1)
    with ExitStack() as sync, tempfile.TemporaryDirectory(prefix="accel-health-trace-") as tmp:
        async with AsyncExitStack() as stack:
            cluster: CountedKube | CountedSnapshot
            plane = None
            if args.cluster == "kube":
                cluster, plane = await kube_cluster(stack, sync)
            else:
                cluster = snapshot_cluster()
            print(
                f"storm for {args.minutes:g} min on {NODES} nodes ({args.cluster}), a tick every {TICK:g} s, "
                f"a sample every {SAMPLE:g} s"
                + ("" if args.api else ", webhooks only (no Alertmanager API)")
                + (", tracemalloc on (RSS includes its cost)" if args.tracemalloc else "")
            )
            engine = Engine(
                policy=POLICY, cluster=cluster, aws=RecordingAws(), settings=EngineSettings(), clock=time.time
            )
            await engine.start()
            trace = Path(tmp) / "minute2.trace" if args.tracemalloc else None
            weather = Storm(rng=random.Random(args.seed))
            play = Run(engine, cluster, weather, api=args.api, trace=trace, plane=plane)
            await play.play(args.minutes)
            ok = report(play)
    if counter.counts:
        print(
            "warnings and errors logged: " + ", ".join(f"{k} x{n}" for k, n in counter.counts.most_common())
        )
        for key, message in counter.last.items():
            print(f"  last {key}: {message}")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--cluster", choices=("kube", "snapshot"), default=None)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--no-api", dest="api", action="store_false", help="webhooks only")
    parser.add_argument("--tracemalloc", action="store_true", help="also show where memory grew")
    args = parser.parse_args()
    if args.cluster is None:
        reason = control_plane_skip_reason()
        args.cluster = "snapshot" if reason else "kube"
        if reason:
            print(f"the real API server is not available ({reason}); running on the in-memory snapshot")
    return 0 if asyncio.run(run(args)) else 1


if __name__ == "__main__":
    sys.exit(main())
