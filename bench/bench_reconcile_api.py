"""API requests per delivery and decision latency at 2,000 nodes, on the real API server.

A real control plane (tests/kube: etcd, kube-apiserver, kube-controller-manager) holds 2,000 accelerator
nodes (8 `nvidia.com/gpu` each, as the tests make them). The remediator's engine runs in enforce mode
over the real Kubernetes executor, as a ServiceAccount of its own (bound to cluster-admin, so that
only what it asks for is measured), so the API server's audit log tells its requests apart.

1. Requests per delivery. After the start (one LIST and one WATCH of nodes for the cache, one read of
   the gates ConfigMap), webhook payloads are delivered one after another: two faults firing, resends of
   them, a new episode of one (new startsAt), a resolve and its resend, 100 faults at once of which
   the disruption budget defers most, their resend, and Alertmanager's API v2 view of the same alerts.
   For each, the requests the remediator made are counted from the audit log, by verb and resource,
   and set against the actions taken (decisions done). The policy is the shipped default's `cordon`
   rule (condition, then cordon; budget 2; breaker at 30 %; Events for everything) with an
   `on_resolved` that gives the node back. Goal: no LIST after the start, <= 2 writes per action
   (a write is a PATCH, PUT, POST or DELETE; an action's own write and its Event are two), and none
   for a delivery that takes no action.

2. Decision latency for 1,000 firing alerts (on 1,000 nodes other than part 1's): Alertmanager's API v2
   view reconciled (`Engine.reconcile`) and the same alerts as one webhook (`Engine.handle`), each
   with a fresh engine (the gates ConfigMap and the nodes set back between runs), in dry-run and
   enforce, with the storm breaker off (only the budget caps: every node gets its condition, 2 are
   cordoned) and with the shipped default policy (1,000 of 2,000 nodes alerting is a storm: its
   breaker opens and nothing runs). Prints p50, p95 (of 5 runs: the slowest) and max over `--runs`
   runs, the requests made and the largest annotations of this service on a node (its record).
   Target: <= 1 s for a decision without writes; with writes, what the API server's round trips
   cost (reported).

3. One alert per delivery: Alertmanager's shipped routing groups by node, so a storm arrives as many
   small deliveries, each paying what any delivery costs at 2,000 nodes (every node read for the
   budget and the breaker, the node's record written with each action). 100 new faults on nodes of their
   own, then 100 resends; p50, p95 and max, and the requests per delivery. Reported.

Needs root (the harness) and the control plane binaries (scripts/build-control-plane.sh). Other work
on the machine makes timings noisy: compare runs taken together.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubernetes.aio import client as k8s

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the control-plane harness lives in tests/kube

from remediator.audit import DecisionRecord  # noqa: E402  after sys.path
from remediator.cluster import Node  # noqa: E402  after sys.path
from remediator.desired.alertmanager import AlertmanagerView, ShownAlert  # noqa: E402  after sys.path
from remediator.executors.kubernetes import KubernetesCluster, KubernetesSettings  # noqa: E402
from remediator.executors.snapshot import RecordingAws  # noqa: E402  after sys.path
from remediator.intake.payload import parse_body  # noqa: E402  after sys.path
from remediator.lifecycle.engine import Engine  # noqa: E402  after sys.path
from remediator.lifecycle.model import AlertPlan, EngineSettings  # noqa: E402  after sys.path
from remediator.lifecycle.record import PREFIX  # noqa: E402  after sys.path
from remediator.policy import Policy, load_policy, parse_policy  # noqa: E402  after sys.path
from tests.kube.conftest import control_plane_skip_reason  # noqa: E402  after sys.path
from tests.kube.controlplane import ControlPlane, control_plane, request_of  # noqa: E402
from tests.kube.kubelet import FakeKubelet  # noqa: E402  after sys.path
from tests.kube.rest import ApiError, Obj  # noqa: E402  after sys.path

NODES = 2000
NS = "accel-health"
SA = "bench-remediator"
USER = f"system:serviceaccount:{NS}:{SA}"
STATE_CM = "accel-health-remediator-gates"
CONDITION = "AcceleratorHealthy"
WRITES = ("create", "update", "patch", "delete", "deletecollection")
STARTS = "2025-11-22T20:00:00.000Z"

_DEFAULT = load_policy()
_SAFETY = "safety: {max_disrupted_nodes: 2, storm_breaker: {threshold_percent: 30, min_nodes: 3}}\n"
_RULE = (
    "rules:\n"
    "  - name: cordon\n"
    "    match: ['remediation=\"cordon\"']\n"
    f"    actions: [{{type: condition, condition_type: {CONDITION}}}, {{type: cordon}}]\n"
)
REQUESTS_POLICY = parse_policy(
    _SAFETY
    + "events: all\n"
    + _RULE
    + f"    on_resolved: [{{type: uncordon}}, {{type: condition, condition_type: {CONDITION}}}]\n",
    source="bench: the default cordon rule, given back on resolve",
)
BUDGET_ONLY = parse_policy(
    "safety: {max_disrupted_nodes: 2, storm_breaker: {enabled: false}}\nevents: all\n" + _RULE,
    source="bench: breaker off",
)


def node_name(i: int) -> str:
    return f"gpu-{i:04d}"


# -- the cluster -----------------------------------------------------------------------------------


def populate(plane: ControlPlane, workdir: Path) -> str:
    """2,000 accelerator nodes and the remediator's ServiceAccount (cluster-admin); its token."""
    fake = FakeKubelet(plane=plane, workdir=workdir)
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(
            pool.map(
                lambda i: fake.add_node(
                    node_name(i), labels={"pool": "gpu"}, capacity={"nvidia.com/gpu": "8"}
                ),
                range(NODES),
            )
        )
    return plane.cluster_admin_account(NS, SA)


def connection(plane: ControlPlane, token: str) -> tuple[k8s.ApiClient, KubernetesSettings]:
    """The API client and executor settings of the remediator's ServiceAccount."""
    settings = KubernetesSettings(state_namespace=NS, request_timeout_seconds=30.0, instance="bench")
    return plane.api_client(token=token), settings


def executor(plane: ControlPlane, token: str) -> KubernetesCluster:
    api, settings = connection(plane, token)
    return KubernetesCluster(api=api, settings=settings)


def reset(plane: ControlPlane, names: set[str]) -> None:
    """Nodes in `names` as they were (no cordon, annotation or condition of the remediator) and no
    gates ConfigMap: the next engine starts from scratch."""
    try:
        plane.admin.delete(f"/api/v1/namespaces/{NS}/configmaps/{STATE_CM}")
    except ApiError as exc:
        if exc.status != 404:
            raise

    def clean(node: Obj) -> None:
        name = node["metadata"]["name"]
        annotations = {k: None for k in node["metadata"].get("annotations") or {} if "accel-health" in k}
        if annotations or node["spec"].get("unschedulable"):
            patch = {"spec": {"unschedulable": None}, "metadata": {"annotations": annotations}}
            plane.admin.merge_patch(f"/api/v1/nodes/{name}", patch)
        if any(c["type"] == CONDITION for c in node["status"].get("conditions") or []):
            plane.admin.request(
                "PATCH",
                f"/api/v1/nodes/{name}/status",
                {"status": {"conditions": [{"type": CONDITION, "$patch": "delete"}]}},
                content_type="application/strategic-merge-patch+json",
            )

    nodes = [n for n in plane.admin.items("/api/v1/nodes") if n["metadata"]["name"] in names]
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(clean, nodes))


@dataclass
class AuditTail:
    """The remediator's requests from the audit log, read on from where the last read stopped."""

    path: Path
    offset: int = 0

    def skip(self) -> None:
        self.offset = self.path.stat().st_size

    def read(self) -> list[tuple[str, str]]:
        """(verb, resource[/subresource]) of the requests made since the last read."""
        with self.path.open("rb") as f:
            f.seek(self.offset)
            data = f.read()
        end = data.rfind(b"\n") + 1
        self.offset += end
        out = []
        for line in data[:end].splitlines():
            event = json.loads(line)
            if event.get("user", {}).get("username") != USER:
                continue
            stage, verb = event.get("stage"), event.get("verb")
            if stage != "ResponseComplete" and not (stage == "ResponseStarted" and verb == "watch"):
                continue
            out.append(request_of(event))
        return out

    async def settle(self) -> list[tuple[str, str]]:
        """Read until nothing new arrives for a moment (the audit log is written in blocking mode, so
        this is only a margin)."""
        made = self.read()
        for _ in range(10):
            await asyncio.sleep(0.05)
            more = self.read()
            if not more:
                return made
            made += more
        return made


# -- alerts ------------------------------------------------------------------------------------------


def alert_doc(i: int, *, status: str = "firing", starts: str = STARTS) -> dict[str, Any]:
    return {
        "status": status,
        "labels": {
            "alertname": "AccelGPURowRemapFailure",
            "node": node_name(i),
            "remediation": "cordon",
            "severity": "critical",
        },
        "annotations": {"summary": "row remapping failed"},
        "startsAt": starts,
        "endsAt": "2025-11-22T21:00:00.000Z" if status == "resolved" else "0001-01-01T00:00:00Z",
        "generatorURL": "http://prometheus/graph",
        "fingerprint": f"{i:016x}",
    }


def webhook(alerts: list[dict[str, Any]]) -> bytes:
    status = "firing" if any(a["status"] == "firing" for a in alerts) else "resolved"
    body = {"version": "4", "status": status, "receiver": "remediator", "groupKey": "{}:{}", "alerts": alerts}
    return json.dumps(body).encode()


def api_view(alerts: list[dict[str, Any]]) -> AlertmanagerView:
    shown = {}
    for doc in alerts:
        alert = parse_body(webhook([doc])).alerts[0]
        shown[alert.fingerprint] = ShownAlert(alert=alert, suppressed="")
    return AlertmanagerView(alerts=shown, reached=("http://alertmanager:9093",))


# -- part 1: requests per delivery ---------------------------------------------------------------------


def record_bytes(nodes: list[Node]) -> int:
    """The largest total of this service's annotations on one node (its record and ownership)."""
    return max(
        (sum(len(k) + len(v) for k, v in n.annotations.items() if k.startswith(PREFIX)) for n in nodes),
        default=0,
    )


def taken(plans: list[AlertPlan]) -> list[DecisionRecord]:
    return [r for p in plans for r in p.records if r.outcome in ("done", "started")]


def count(made: list[tuple[str, str]]) -> dict[str, Any]:
    verbs = Counter(v for v, _ in made)
    writes = [(v, r) for v, r in made if v in WRITES]
    return {
        "list": verbs["list"],
        "watch": verbs["watch"],
        "get": verbs["get"],
        "writes": len(writes),
        "node": sum(1 for _, r in writes if r.startswith("nodes")),
        "event": sum(1 for _, r in writes if r == "events"),
        "state": sum(1 for _, r in writes if r == "configmaps"),
        "detail": ", ".join(f"{n} {v} {r}" for (v, r), n in sorted(Counter(made).items())),
    }


async def requests_per_delivery(plane: ControlPlane, token: str) -> bool:
    audit = AuditTail(plane.workdir / "audit.log")
    audit.skip()
    cluster = executor(plane, token)
    engine = Engine(
        policy=REQUESTS_POLICY,
        cluster=cluster,
        aws=RecordingAws(),
        settings=EngineSettings(),
        clock=time.time,
    )
    rows: list[tuple[str, bool, int, dict[str, Any]]] = []
    cache = (0, 0)
    try:
        assert await cluster.start_cache(wait_seconds=120), "the node cache did not sync"
        await engine.start()
        rows.append(("start (node cache, gates read)", True, 0, {**count(await audit.settle()), "doc": 0}))
        hundred = [alert_doc(i) for i in range(100, 200)]
        two = [alert_doc(0), alert_doc(1)]
        episode = alert_doc(0, starts="2025-11-22T20:30:00.000Z")
        resolve = [alert_doc(1, status="resolved")]

        def deliver(alerts: list[dict[str, Any]]) -> Callable[[], Awaitable[list[AlertPlan]]]:
            return lambda: engine.handle(parse_body(webhook(alerts)))

        # (what, whether it brings anything new, delivery)
        steps: list[tuple[str, bool, Callable[[], Awaitable[list[AlertPlan]]]]] = [
            ("2 faults fire (2 nodes)", True, deliver(two)),
            ("resend of the same", False, deliver(two)),
            ("resend again", False, deliver(two)),
            ("new episode of one (new startsAt)", True, deliver([episode, alert_doc(1)])),
            ("1 resolves", True, deliver(resolve)),
            ("resend of the resolve", False, deliver(resolve)),
            ("100 faults fire (budget defers most)", True, deliver(hundred)),
            ("resend of the 100", False, deliver(hundred)),
            ("API v2 view of the 101 firing", False, lambda: engine.reconcile(api_view([episode, *hundred]))),
        ]
        for label, new, step in steps:
            plans = await step()
            made = count(await audit.settle())
            made["doc"] = record_bytes(await cluster.list_nodes())
            rows.append((label, new, len(taken(plans)), made))
        cache = (cluster.nodes.lists, cluster.nodes.watches)
    finally:
        await cluster.close()
    print(f"Part 1: API requests per delivery, {NODES} nodes, enforce (as {USER})")
    print(
        f"{'delivery':38} {'actions':>7} {'LIST':>4} {'GET':>4} {'writes':>6} {'node':>4}"
        f" {'Event':>5} {'gates':>5} {'record KB':>9}  {'writes/action':>13} {'w/o Events':>10}"
    )
    lists = worst = worst_events = 0.0
    quiet_writes = 0
    for label, new, actions, c in rows:
        plain = c["writes"] - c["event"]
        print(
            f"{label:38} {actions:7d} {c['list']:4d} {c['get']:4d} {c['writes']:6d}"
            f" {c['node']:4d} {c['event']:5d} {c['state']:5d} {c['doc'] / 1024:9.1f}"
            f"  {_ratio(c['writes'], actions):>13}"
            f" {_ratio(plain, actions):>10}"
        )
        if label.startswith("start"):
            continue
        lists += c["list"]
        if not new:
            quiet_writes += c["writes"]
        elif actions:
            worst = max(worst, plain / actions)
            worst_events = max(worst_events, c["writes"] / actions)
    print(
        f"  the node cache over the whole run: {cache[0]} LIST ({NODES // 500} pages of 500), "
        f"{cache[1]} WATCH (its own counters; a watch reaches the audit log only when its answer starts)"
    )
    print("  requests:")
    for label, _, _, c in rows:
        print(f"    {label}: {c['detail'] or 'none'}")
    ok = lists == 0 and worst <= 2 and quiet_writes == 0
    print(
        f"goal: no LIST after the start ({lists:.0f}), <= 2 writes per action (node and gates: "
        f"{worst:.2f}; with the Events of `events: all`: {worst_events:.2f}), none for a delivery that "
        f"brings nothing new ({quiet_writes}): " + ("met" if ok else "MISSED")
    )
    return ok


def _ratio(writes: int, actions: int) -> str:
    if actions:
        return f"{writes / actions:.2f}"
    return "-" if not writes else f"{writes}/0"


# -- part 2: decision latency ---------------------------------------------------------------------------


@dataclass
class Sample:
    seconds: float
    decisions: int
    taken: int
    deferred: int
    requests: dict[str, Any]
    doc: int


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


@contextmanager
def quiet() -> Iterator[None]:
    """No decision log lines (they would measure the terminal, not the engine), nor the breaker's
    (it opens on every fresh engine of the default policy)."""
    logging.disable(logging.CRITICAL)
    try:
        yield
    finally:
        logging.disable(logging.NOTSET)


async def one_decision(
    plane: ControlPlane, cluster: KubernetesCluster, *, policy: Policy, dry_run: bool, path: str
) -> Sample:
    docs = [alert_doc(i) for i in range(NODES // 2, NODES)]
    view = api_view(docs)
    body = webhook(docs)
    audit = AuditTail(plane.workdir / "audit.log")
    engine = Engine(
        policy=policy,
        cluster=cluster,
        aws=RecordingAws(),
        settings=EngineSettings(dry_run=dry_run),
        clock=time.time,
    )
    await engine.start()
    audit.skip()
    with quiet():
        started = time.perf_counter()
        if path == "api":
            plans = await engine.reconcile(view)
        else:
            plans = await engine.handle(parse_body(body))
        elapsed = time.perf_counter() - started
    records = [r for p in plans for r in p.records]
    return Sample(
        seconds=elapsed,
        decisions=len(records),
        taken=sum(1 for r in records if r.outcome in ("done", "started", "planned")),
        deferred=sum(1 for r in records if r.outcome == "deferred"),
        requests=count(await audit.settle()),
        doc=record_bytes(await engine.view.all()),
    )


async def decision_latency(plane: ControlPlane, token: str, runs: int) -> float:
    cluster = executor(plane, token)
    configs = [
        ("dry-run, breaker off", BUDGET_ONLY, True),
        ("dry-run, default policy", _DEFAULT, True),
        ("enforce, breaker off", BUDGET_ONLY, False),
        ("enforce, default policy", _DEFAULT, False),
    ]
    names = {node_name(i) for i in range(NODES // 2, NODES)}
    worst_quiet = 0.0
    print(f"\nPart 2: decision latency, {NODES // 2} firing alerts on {NODES} nodes ({runs} runs each)")
    print(f"{'configuration':26} {'path':8} {'p50 s':>6} {'p95 s':>6} {'max s':>6}  per run")
    try:
        assert await cluster.start_cache(wait_seconds=120), "the node cache did not sync"
        for label, policy, dry in configs:
            for path in ("api", "webhook"):
                samples = []
                for _ in range(runs):
                    samples.append(await one_decision(plane, cluster, policy=policy, dry_run=dry, path=path))
                    if not dry:
                        await asyncio.to_thread(reset, plane, names)
                times = [s.seconds for s in samples]
                last = samples[-1]
                print(
                    f"{label:26} {path:8} {statistics.median(times):6.2f} {_pct(times, 0.95):6.2f}"
                    f" {max(times):6.2f}  {last.decisions} decisions, {last.taken} taken, "
                    f"{last.deferred} deferred; {last.requests['list']} LIST, {last.requests['get']} GET, "
                    f"{last.requests['writes']} writes ({last.requests['node']} node, "
                    f"{last.requests['event']} Event, {last.requests['state']} state); "
                    f"largest record on a node {last.doc / 1024:.1f} KB"
                )
                print("    runs: " + ", ".join(f"{t:.2f}" for t in times))
                if last.requests["writes"] == 0:
                    worst_quiet = max(worst_quiet, *times)
    finally:
        await cluster.close()
    print(
        f"worst decision without writes: {worst_quiet:.2f} s (target <= 1 s): "
        + ("ok" if worst_quiet <= 1 else "SLOW")
    )
    return worst_quiet


# -- part 3: one alert per delivery ---------------------------------------------------------------------


async def small_deliveries(plane: ControlPlane, token: str, count_: int) -> float:
    """Alertmanager's shipped routing groups by node: a storm is many one-node deliveries, each paying
    what a delivery costs whatever its size (reading every node for the budget and the breaker,
    writing the node's record)."""
    cluster = executor(plane, token)
    engine = Engine(
        policy=BUDGET_ONLY, cluster=cluster, aws=RecordingAws(), settings=EngineSettings(), clock=time.time
    )
    audit = AuditTail(plane.workdir / "audit.log")
    print(f"\nPart 3: one alert per delivery (the shipped routing groups by node), {NODES} nodes, enforce")
    results = []
    try:
        assert await cluster.start_cache(wait_seconds=120), "the node cache did not sync"
        await engine.start()
        audit.skip()
        kinds = [
            ("a new fault on a node of its own", [[alert_doc(i)] for i in range(count_)]),
            ("a resend of one of them", [[alert_doc(i % count_)] for i in range(count_)]),
        ]
        for label, bodies in kinds:
            times = []
            with quiet():
                for alerts in bodies:
                    body = webhook(alerts)
                    started = time.perf_counter()
                    await engine.handle(parse_body(body))
                    times.append(time.perf_counter() - started)
            made = count(await audit.settle())
            results.append((label, times, made))
    finally:
        await cluster.close()
    print(f"{'delivery':34} {'n':>4} {'p50 ms':>7} {'p95 ms':>7} {'max ms':>7}  requests per delivery")
    for label, times, made in results:
        n = len(times)
        print(
            f"{label:34} {n:4d} {statistics.median(times) * 1000:7.1f} {_pct(times, 0.95) * 1000:7.1f}"
            f" {max(times) * 1000:7.1f}  {made['get'] / n:.1f} GET, {made['writes'] / n:.1f} writes"
            f" ({made['node'] / n:.1f} node, {made['event'] / n:.1f} Event, {made['state'] / n:.1f} state)"
        )
    return statistics.median(results[-1][1])


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="runs per latency configuration")
    parser.add_argument("--small", type=int, default=100, help="one-alert deliveries in part 3")
    parser.add_argument("--parts", default="123", help="which parts to run, e.g. 13")
    args = parser.parse_args()
    reason = control_plane_skip_reason()
    if reason:
        print(f"skipped: {reason}")
        return 0
    with tempfile.TemporaryDirectory(prefix="accel-health-bench-") as tmp:
        workdir = Path(tmp)
        t0 = time.monotonic()
        with control_plane(workdir / "control-plane") as plane:
            token = populate(plane, workdir)
            print(f"control plane with {NODES} nodes up in {time.monotonic() - t0:.0f} s")
            everything = {node_name(i) for i in range(NODES)}
            ok = True
            if "1" in args.parts:
                ok = asyncio.run(requests_per_delivery(plane, token))
            if "2" in args.parts:
                reset(plane, everything)
                asyncio.run(decision_latency(plane, token, args.runs))
            if "3" in args.parts:
                reset(plane, everything)
                asyncio.run(small_deliveries(plane, token, args.small))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
