"""The remediator's record on the nodes it acts on (issue 23), measured on the real API server at 2,000 nodes.

A real control plane (tests/kube: etcd, kube-apiserver, kube-controller-manager) holds 2,000 accelerator
nodes. The remediator runs as shipped, as a process of its own (`accel-health-remediator` with a
kubeconfig of a ServiceAccount of its own, so that the API server's audit log tells its requests apart,
one replica, no leader election), fed Alertmanager webhook deliveries over HTTP.

1. Writes per action (audit log). A policy with every node action (condition, cordon, taint, drain,
   aws_set_unhealthy; on resolve uncordon, untaint, condition). Two faults fire, are resent twice,
   resolve, and the resolve is resent. Counted per delivery: writes to `nodes` and `nodes/status`,
   Events, any other write, and every request of a resend. A drain is two writes of its node, its
   start and its end. Goal: one node write per action (+ at most one Event), no other write, and not
   one request for a resend.
2. 5,000 firing alerts with 16 labels each on the 2,000 nodes, delivered as the shipped routing
   groups them (by node: one delivery per node), each acting (condition, cordon; budget and breaker
   out of the way); then every delivery resent (a resend decides nothing), then every alert resolved
   (the policy gives the node back). Printed: deliveries answered 2xx, latency of the resends (p50,
   p99, max), the remediator's RSS, the largest annotations of this service on one node, the bytes
   the record costs per episode (and its idempotency part: fingerprint, startsAt and steps), writes
   made outside nodes and their largest size, and, once every alert resolved, the nodes that still
   carry a record. Goals: every delivery 2xx, p99 <= 1 s for a resend, RSS <= 150 MiB, <= 3 KiB of
   annotations on any node, <= 64 B of idempotency per episode, nothing left once all resolved.

Needs root (the harness) and the control-plane binaries (scripts/build-control-plane.sh).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the control-plane harness lives in tests/kube

from bench_reconcile_api import NODES, NS, AuditTail, node_name, populate  # noqa: E402  same harness

from examples.pipeline import free_port  # noqa: E402  after sys.path
from remediator.lifecycle.record import EPISODES, PREFIX, read  # noqa: E402  after sys.path
from tests.kube.conftest import control_plane_skip_reason  # noqa: E402  after sys.path
from tests.kube.controlplane import ControlPlane, control_plane, spawn, wait_for  # noqa: E402

WRITES = ("create", "update", "patch", "delete", "deletecollection")
TOKEN = "bench-token-0123456789"  # noqa: S105  the webhook token of a throwaway process
STARTS = "2025-11-22T20:00:00.000Z"

ALL_ACTIONS = """
safety: {max_disrupted_nodes: 10, storm_breaker: {enabled: false}}
events: all
rules:
  - name: everything
    actions:
      - {type: condition, condition_type: AcceleratorHealthy}
      - cordon
      - {type: taint, key: accel-health.io/unhealthy, value: "true", effect: NoSchedule}
      - {type: drain, timeout_seconds: 60}
      - aws_set_unhealthy
    on_resolved:
      - uncordon
      - {type: untaint, key: accel-health.io/unhealthy}
      - {type: condition, condition_type: AcceleratorHealthy}
"""
MANY = """
safety: {max_disrupted_nodes: 2000, storm_breaker: {enabled: false}}
events: none
repair: {enabled: false}
rules:
  - name: cordon
    actions: [{type: condition, condition_type: AcceleratorHealthy}, cordon]
    on_resolved: [uncordon, {type: condition, condition_type: AcceleratorHealthy}]
"""
ALERTNAMES = ("AccelGPUFatalXid", "AccelGPURowRemapFailure", "AccelInfinibandLinkDown")


def alert(node: int, *, kind: int = 0, status: str = "firing", labels: int = 4) -> dict[str, Any]:
    name = ALERTNAMES[kind % len(ALERTNAMES)]
    label_set = {"alertname": name, "node": node_name(node), "severity": "critical"}
    for i in range(labels - len(label_set)):  # realistic extra labels: job, instance, gpu, pci_bus_id...
        label_set[f"label_{i:02d}"] = f"value-{node:04d}-{kind}-{i:02d}"
    return {
        "status": status,
        "labels": label_set,
        "annotations": {"summary": f"{name} on {node_name(node)}"},
        "startsAt": STARTS,
        "endsAt": "2025-11-22T21:00:00.000Z" if status == "resolved" else "0001-01-01T00:00:00Z",
        "generatorURL": "http://prometheus/graph",
        "fingerprint": f"{node:08x}{kind:08x}",
    }


def webhook(alerts: list[dict[str, Any]]) -> dict[str, Any]:
    status = "firing" if any(a["status"] == "firing" for a in alerts) else "resolved"
    return {"version": "4", "status": status, "receiver": "remediator", "groupKey": "{}:{}", "alerts": alerts}


# -- the remediator as shipped, a process of its own --------------------------------------------------


class Remediator:
    """`accel-health-remediator serve` against the control plane, as the benchmark's ServiceAccount."""

    def __init__(self, plane: ControlPlane, workdir: Path, token: str, policy: str) -> None:
        self.port = free_port()
        kubeconfig = workdir / "remediator.kubeconfig"
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "b",
                    "cluster": {"server": plane.server, "certificate-authority": str(plane.pki.ca_cert)},
                }
            ],
            "users": [{"name": "b", "user": {"token": token}}],
            "contexts": [{"name": "b", "context": {"cluster": "b", "user": "b"}}],
            "current-context": "b",
        }
        kubeconfig.write_text(yaml.safe_dump(config))
        (workdir / "policy.yaml").write_text(policy)
        (workdir / "token").write_text(TOKEN)
        argv = [
            str(Path(sys.executable).parent / "accel-health-remediator"),
            f"--listen=127.0.0.1:{self.port}",
            f"--kubeconfig={kubeconfig}",
            f"--config={workdir / 'policy.yaml'}",
            f"--token-file={workdir / 'token'}",
            "--no-leader-election",
            "--log-level=warning",
        ]
        env = {**os.environ, "POD_NAMESPACE": NS}
        self.process = spawn(f"remediator-{self.port}", argv, log_dir=workdir, env=env)
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self) -> None:
        def ready() -> bool:
            if self.process.popen.poll() is not None:
                raise RuntimeError("the remediator exited:\n" + self.process.tail())
            try:
                with urllib.request.urlopen(self.url + "/readyz", timeout=2) as resp:  # noqa: S310  loopback
                    return bool(resp.status == 200)
            except OSError:
                return False

        wait_for("the remediator ready", ready, timeout=120, interval=0.2)

    def rss_mib(self) -> float:
        status = Path(f"/proc/{self.process.popen.pid}/status").read_text()
        return next(int(line.split()[1]) / 1024 for line in status.splitlines() if line.startswith("VmRSS:"))

    def stop(self) -> None:
        self.process.stop()


async def post(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, float]:
    started = time.perf_counter()
    async with session.post(url + "/alerts", json=body, headers={"Authorization": f"Bearer {TOKEN}"}) as resp:
        await resp.read()
        return resp.status, time.perf_counter() - started


def count(made: list[tuple[str, str]]) -> dict[str, int]:
    writes = [(v, r) for v, r in made if v in WRITES]
    return {
        "requests": len(made),
        "node": sum(1 for _, r in writes if r in ("nodes", "nodes/status")),
        "event": sum(1 for _, r in writes if r == "events"),
        # The repair loop's durable copy of a quarantine (one ConfigMap per quarantined node, under
        # 1 KiB: created when the quarantine starts, deleted when it ends); not the delivery's.
        "copy": sum(1 for _, r in writes if r == "configmaps"),
        "other": sum(1 for _, r in writes if r not in ("nodes", "nodes/status", "events", "configmaps")),
    }


# -- part 1 ----------------------------------------------------------------------------------------------


async def writes_per_action(plane: ControlPlane, workdir: Path, token: str) -> bool:
    audit = AuditTail(plane.workdir / "audit.log")
    remediator = Remediator(plane, workdir / "part1", token, ALL_ACTIONS)
    ok = True
    try:
        remediator.wait_ready()
        audit.skip()
        two = [alert(0), alert(1)]
        steps = [
            ("2 faults fire (2 nodes)", webhook(two), True),
            ("resend of the same", webhook(two), False),
            ("resend again", webhook(two), False),
            ("both resolve", webhook([alert(0, status="resolved"), alert(1, status="resolved")]), True),
            (
                "resend of the resolve",
                webhook([alert(0, status="resolved"), alert(1, status="resolved")]),
                False,
            ),
        ]
        print(f"Part 1: writes per action, {NODES} nodes, the remediator as a process of its own")
        print(
            f"{'delivery':30} {'actions':>7} {'requests':>8} {'node writes':>11} {'Events':>6} "
            + f"{'other':>5} {'quarantine copies':>17}"
        )
        async with aiohttp.ClientSession() as session:
            for label, body, acts in steps:
                before = await _actions(session, remediator.url)
                status, _ = await post(session, remediator.url, body)
                await asyncio.sleep(0.5 if acts else 0.2)  # the drains end in the background
                made = count(await audit.settle())
                after = await _actions(session, remediator.url)
                actions = _node_actions(after[len(before) :])
                print(
                    f"{label:30} {actions:7d} {made['requests']:8d} {made['node']:11d} "
                    + f"{made['event']:6d} {made['other']:5d} {made['copy']:17d}"
                )
                if status != 200:
                    ok = False
                if acts:
                    ok = ok and made["node"] == actions and made["event"] <= actions and made["other"] == 0
                else:
                    ok = ok and made["requests"] == 0
    finally:
        remediator.stop()
    print(
        "goal: one write of the node per action (a drain: its start and its end), at most one Event each, "
        "no other write, no request for a resend: " + ("met" if ok else "MISSED")
    )
    return ok


async def _actions(session: aiohttp.ClientSession, url: str) -> list[dict[str, Any]]:
    async with session.get(url + "/actions", headers={"Authorization": f"Bearer {TOKEN}"}) as resp:
        records: list[dict[str, Any]] = await resp.json()
        return records


def _node_actions(records: list[dict[str, Any]]) -> int:
    """Decisions that wrote the node: each action done, and a drain's start and its end (AWS
    actions write their intent on the node before the call)."""
    writes = {"condition", "cordon", "taint", "uncordon", "untaint", "aws_set_unhealthy", "drain"}
    return sum(1 for r in records if r["action"] in writes and r["outcome"] in ("done", "started"))


# -- part 2 ----------------------------------------------------------------------------------------------


def storm(per_node: dict[int, int], *, status: str = "firing") -> list[dict[str, Any]]:
    return [
        webhook([alert(n, kind=k, status=status, labels=16) for k in range(count)])
        for n, count in per_node.items()
    ]


def _idempotency_bytes(fingerprint: str, start: int, steps: int) -> int:
    """What identifies an episode and its decided steps in the record: `"fp":[..,..,start,steps]`."""
    return len(json.dumps({fingerprint: [start, steps]}, separators=(",", ":"))) - 2


def node_records(plane: ControlPlane) -> tuple[int, int, int, int, int]:
    """(largest annotations of this service on a node, nodes with a record, episodes, their bytes,
    their idempotency bytes) as the API server has them."""
    largest = with_record = episodes = record_bytes = idem = 0
    for node in plane.admin.items("/api/v1/nodes"):
        annotations = node["metadata"].get("annotations") or {}
        ours = sum(len(k) + len(v) for k, v in annotations.items() if k.startswith(PREFIX))
        largest = max(largest, ours)
        text = annotations.get(EPISODES)
        if text:
            with_record += 1
            record = read(annotations)
            episodes += len(record.episodes)
            record_bytes += len(text)
            # fingerprint, startsAt and steps, as the record writes them: "fp":[..,..,start,steps],
            idem += sum(
                len(json.dumps({e.fingerprint: [e.start, e.steps]}, separators=(",", ":"))) - 2
                for e in record.episodes.values()
            )
    return largest, with_record, episodes, record_bytes, idem


async def many_alerts(plane: ControlPlane, workdir: Path, token: str) -> bool:
    audit = AuditTail(plane.workdir / "audit.log")
    remediator = Remediator(plane, workdir / "part2", token, MANY)
    per_node = {n: 2 + (n % 2) for n in range(NODES)}  # 2 or 3 alerts a node: 5,000 on 2,000 nodes
    while sum(per_node.values()) > 5000:
        per_node[max(per_node)] -= 1
    firing, resolved = storm(per_node), storm(per_node, status="resolved")
    total = sum(len(b["alerts"]) for b in firing)
    ok = True
    try:
        remediator.wait_ready()
        audit.skip()
        async with aiohttp.ClientSession() as session:
            t0 = time.perf_counter()
            first = [await post(session, remediator.url, b) for b in firing]
            took = time.perf_counter() - t0
            made = count(await audit.settle())
            resent = [await post(session, remediator.url, b) for b in firing]
            resend_made = count(await audit.settle())
            rss = remediator.rss_mib()
            largest, with_record, episodes, record_bytes, idem = node_records(plane)
            gone = [await post(session, remediator.url, b) for b in resolved]
            await audit.settle()
            _, left, left_episodes, _, _ = node_records(plane)
    finally:
        remediator.stop()
    codes = Counter(s for s, _ in (*first, *resent, *gone))
    lat = sorted(t for _, t in resent)
    p99 = lat[int(0.99 * (len(lat) - 1))]
    print(f"Part 2: {total} firing alerts with 16 labels on {NODES} nodes, one delivery per node")
    print(
        f"  first deliveries: {len(first)} in {took:.0f} s; requests {made['requests']}, "
        + f"node writes {made['node']}, other writes {made['other']}, quarantine copies {made['copy']}"
    )
    print(f"  answers: {dict(codes)}")
    print(
        f"  resends (decide nothing): p50 {statistics.median(lat) * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms, "
        f"max {lat[-1] * 1000:.1f} ms; requests made {resend_made['requests']}"
    )
    print(f"  remediator RSS: {rss:.0f} MiB")
    print(
        f"  records: {with_record} nodes, {episodes} episodes, "
        + f"{record_bytes / max(episodes, 1):.0f} B per episode "
        f"({idem / max(episodes, 1):.0f} B of it idempotency: fingerprint, startsAt, steps); largest "
        f"annotations of this service on a node: {largest} B"
    )
    print(f"  once every alert resolved: {left} nodes still carry a record ({left_episodes} episodes)")
    ok = (
        set(codes) == {200}
        and p99 <= 1.0
        and rss <= 150
        and largest <= 3 * 1024
        and idem / max(episodes, 1) <= 64
        and left == 0
        and made["other"] == 0
    )
    print(
        "goal: every delivery 2xx, p99 <= 1 s for a resend, RSS <= 150 MiB, <= 3 KiB on a node, <= 64 B "
        "of idempotency per episode, nothing left once all resolved: " + ("met" if ok else "MISSED")
    )
    return ok


async def run(parts: set[str]) -> bool:
    with tempfile.TemporaryDirectory(prefix="accel-health-bench-") as tmp:
        workdir = Path(tmp)
        (workdir / "part1").mkdir()
        (workdir / "part2").mkdir()
        t0 = time.monotonic()
        with control_plane(workdir / "control-plane") as plane:
            token = await asyncio.to_thread(populate, plane, workdir)
            print(f"real API server with {NODES} nodes up in {time.monotonic() - t0:.0f} s")
            ok = True
            if "1" in parts:
                ok = await writes_per_action(plane, workdir, token) and ok
            if "2" in parts:
                ok = await many_alerts(plane, workdir, token) and ok
            return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--parts", default="12", help="which parts to run (default: 12)")
    args = parser.parse_args()
    reason = control_plane_skip_reason()
    if reason:
        print(f"skipped: {reason}")
        return 0
    return 0 if asyncio.run(run(set(args.parts))) else 1


if __name__ == "__main__":
    sys.exit(main())
