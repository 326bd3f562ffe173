"""Fault to cordon, as shipped: kernel-log line -> series scraped -> alert firing -> webhook -> node
cordoned, on the real control plane with deploy/overlays/enforce, the shipped Prometheus
configuration (deploy/prometheus/prometheus.yaml) and rules, and the shipped Alertmanager routing.

FAULTS fatal Xids are written at random moments over WINDOW seconds, one per GPU node, so each lands
at a random phase of the scrape and evaluation cycles. For each it takes the time of:
- written: the line appended to the node's kernel log;
- scraped: the timestamp of the first Prometheus sample carrying it (the scrape's start);
- firing: the alert's activeAt (the rule evaluation that first saw it);
- webhook: the remediator's decision record for the node (the delivery Alertmanager made, or the
  leader's read of Alertmanager's API, whichever came first: the overlay reads both);
- cordoned: the API server's audit record of the remediator's cordon (stageTimestamp).

Only the safety gates are widened (budget and storm breaker, which would otherwise hold nodes back on
purpose: this measures latency, not the gates). Needs root (pod network namespaces), the control
plane binaries (scripts/build-control-plane.sh), Prometheus and Alertmanager: `make bench-deployed`.
Prints p50, p95, p99 and max of every stage and what Prometheus spends.

`--fleet N` has Prometheus carry N more nodes while the faults are measured: simulated 8-GPU nodes
(bench/fleet.py, served from this process) that pod discovery lists as exporter pods beside the
cluster's, so the shipped scrape jobs and relabeling take them as they take the real ones.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fleet import (
    FleetServer,
    ScrapeJob,
    exporter_job_regex,
    exporter_jobs,
    exporter_template,
    load_bodies,
    load_config,
)

from tests.kube.conftest import deployed_skip_reason
from tests.kube.deployed import NAMESPACE, REMEDIATOR, Deployment
from tests.kube.rest import Obj

XID = "NVRM: Xid (PCI:0000:9d:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
SA_USER = f"system:serviceaccount:{NAMESPACE}:{REMEDIATOR}"
WIDE_GATES = {
    "safety": {
        "max_disrupted_nodes": 1000,
        "storm_breaker": {"enabled": False},
    }
}


def _ts(value: str) -> float:
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _cordons(d: Deployment, written: dict[str, float], cordoned: dict[str, float]) -> None:
    """Fill `cordoned` from the audit log: the remediator's successful patch of each faulty node."""
    assert d.plane is not None
    for e in d.plane.audit(user=SA_USER):
        ref = e.get("objectRef") or {}
        name = ref.get("name")
        if (
            ref.get("resource") == "nodes"
            and not ref.get("subresource")
            and e["verb"] == "patch"
            and e["responseStatus"]["code"] == 200
            and name in written
            and name not in cordoned
            and d.node(name)["spec"].get("unschedulable")
        ):
            cordoned[name] = _ts(e["stageTimestamp"])


def _stages(d: Deployment, written: dict[str, float]) -> tuple[dict[str, float], ...]:
    """(scraped, firing, webhook) time per node, from Prometheus and the leader's decision records."""
    leader = d.leader()
    records = d.remediator_get(leader, "/actions") if leader else []
    if isinstance(records, dict):
        records = records.get("actions", [])
    webhook: dict[str, float] = {}
    for r in records:
        if r.get("node") in written and r["node"] not in webhook and r.get("time"):
            webhook[r["node"]] = _ts(str(r["time"]))
    firing: dict[str, float] = {}
    scraped: dict[str, float] = {}
    alerts = [a for a in d.firing() if a.get("alertname") == "AccelGPUFatalXid"]
    for node in written:
        mine = [a for a in alerts if a.get("node") == node]
        if mine:
            firing[node] = min(_ts(a["activeAt"]) for a in mine)
        q = d.query(f'min_over_time(timestamp(accel_gpu_xid_errors_total{{node="{node}",xid="79"}})[10m:1s])')
        if q:
            scraped[node] = float(q[0]["value"][1])
    return scraped, firing, webhook


def _prometheus_own(d: Deployment) -> dict[str, float]:
    """Prometheus's own metrics (it does not scrape itself in the shipped configuration), summed by name."""
    totals: dict[str, float] = {}
    with urllib.request.urlopen(f"http://{d.prometheus_host}/metrics", timeout=5) as resp:
        for line in resp.read().decode().splitlines():
            if line and not line.startswith("#"):
                name = line.split("{", 1)[0].split(" ", 1)[0]
                totals[name] = totals.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return totals


def _report(
    nodes: list[str],
    written: dict[str, float],
    cordoned: dict[str, float],
    stages: tuple[dict[str, float], ...],
) -> list[str]:
    scraped, firing, webhook = stages
    done = [n for n in nodes if n in cordoned and n in written]
    series: dict[str, list[float]] = {
        "line -> scraped": [scraped[n] - written[n] for n in done if n in scraped],
        "scraped -> firing": [firing[n] - scraped[n] for n in done if n in scraped and n in firing],
        "firing -> webhook": [webhook[n] - firing[n] for n in done if n in firing and n in webhook],
        "webhook -> cordoned": [cordoned[n] - webhook[n] for n in done if n in webhook],
        "line -> cordoned (total)": [cordoned[n] - written[n] for n in done],
    }
    missing = sorted(set(nodes) - set(done))
    print(
        f"{len(done)} of {len(nodes)} faults reached a cordon" + (f"; missing {missing}" if missing else "")
    )
    print(f"{'stage':28} {'p50':>7} {'p95':>7} {'p99':>7} {'max':>7}   (seconds)")
    for stage, values in series.items():
        if values:
            print(
                f"{stage:28} {statistics.median(values):7.2f} {_pct(values, 0.95):7.2f} "
                f"{_pct(values, 0.99):7.2f} {max(values):7.2f}"
            )
    return missing


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--faults", type=int, default=22)
    parser.add_argument("--window", type=float, default=180.0, help="seconds over which faults are spread")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--fleet", type=int, default=0, metavar="N", help="simulated nodes Prometheus carries meanwhile"
    )
    args = parser.parse_args()
    reason = deployed_skip_reason()
    if reason:
        print(f"skipped: {reason}")
        return 0
    rng = random.Random(args.seed)
    nodes = [f"gpu-node-{i}" for i in range(1, args.faults + 1)]
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="accel-health-bench-"))
        t_start = time.monotonic()
        fleet = stack.enter_context(_fleet(args.fleet, overlay="enforce")) if args.fleet else None
        deployment = Deployment(
            workdir=Path(tmp),
            overlay="enforce",
            gpu_nodes=args.faults,
            cpu_nodes=2,
            policy_override=WIDE_GATES,
            extra_pods=fleet.pods if fleet else [],
        )
        with deployment as d:
            d.wait_ready(timeout=180 + args.fleet / 10)
            print(
                f"harness up in {time.monotonic() - t_start:.1f} s ({args.faults} GPU nodes, 2 CPU nodes, "
                f"{args.fleet} simulated nodes); loadavg {_loadavg()}"
            )
            written: dict[str, float] = {}
            moments = sorted((rng.uniform(0, args.window), node) for node in nodes)
            own0, t0 = _prometheus_own(d), time.time()
            sim0 = fleet.server.cpu_seconds() if fleet else 0.0

            def writer() -> None:
                for at, node in moments:
                    time.sleep(max(0.0, t0 + at - time.time()))
                    d.write_fault(node, XID)
                    written[node] = time.time()

            thread = threading.Thread(target=writer)
            thread.start()
            cordoned: dict[str, float] = {}
            deadline = time.time() + args.window + 90
            while time.time() < deadline and len(cordoned) < len(nodes):
                _cordons(d, written, cordoned)
                time.sleep(0.5)
            thread.join()
            stages = _stages(d, written)
            cost = _prometheus_cost(d, own0, time.time() - t0)
            if fleet:
                cost["simulator_cpu_cores"] = round(
                    (fleet.server.cpu_seconds() - sim0) / (time.time() - t0), 4
                )
                cost["exporter_targets_up"] = len(
                    d.query(f'up{{job=~"{exporter_job_regex(fleet.jobs)}"}} == 1')
                )
            print(f"loadavg at the end {_loadavg()}")
    missing = _report(nodes, written, cordoned, stages)
    print("Prometheus: " + json.dumps(cost))
    return 0 if not missing else 1


@dataclass
class _Fleet:
    server: FleetServer
    jobs: list[ScrapeJob]
    pods: list[Obj]


@contextlib.contextmanager
def _fleet(nodes: int, *, overlay: str) -> Iterator[_Fleet]:
    """`nodes` simulated exporter nodes served from this process, as pods for the harness's discovery."""
    config, template = load_config(), exporter_template(overlay)
    jobs = exporter_jobs(config, template)
    with FleetServer(load_bodies(jobs), nodes) as server:
        yield _Fleet(server=server, jobs=jobs, pods=server.pods(template, jobs))


def _loadavg() -> str:
    return Path("/proc/loadavg").read_text().strip()


def _prometheus_cost(d: Deployment, before: dict[str, float], seconds: float) -> dict[str, Any]:
    own = _prometheus_own(d)
    samples = d.query('avg(scrape_samples_scraped{job="accel-health-exporter"})')
    return {
        "cpu_cores": round(
            (own["process_cpu_seconds_total"] - before["process_cpu_seconds_total"]) / seconds, 4
        ),
        "rule_eval_seconds_per_cycle": round(own.get("prometheus_rule_group_last_duration_seconds", 0.0), 4),
        "rules": int(own.get("prometheus_rule_group_rules", 0)),
        "head_series": int(own.get("prometheus_tsdb_head_series", 0)),
        "resident_memory_mib": round(own.get("process_resident_memory_bytes", 0.0) / 2**20, 1),
        "samples_per_exporter_scrape": round(float(samples[0]["value"][1]), 1) if samples else None,
    }


if __name__ == "__main__":
    sys.exit(main())
