"""One webhook payload with 1,000 alerts for 1,000 nodes: how long the engine takes to decide it.

A synthetic 1,000-node cluster (8 training pods per node, one PodDisruptionBudget) is built in memory
and one Alertmanager payload naming every node is parsed and decided, in dry-run, twice:

- with the storm breaker off, so that only the disruption budget caps the actions;
- with the shipped default policy, whose storm breaker holds everything back (1,000 of 1,000 nodes
  alerting is a storm, not 1,000 faults).

Target: <= 1 s per payload, with disruptive actions capped by the budget (2 nodes).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter

from remediator.cluster import LabelSelector, Node, OwnerReference, Pod, PodDisruptionBudget
from remediator.executors.snapshot import RecordingAws, SnapshotCluster
from remediator.intake.payload import parse_body
from remediator.lifecycle.engine import Engine
from remediator.lifecycle.model import EngineSettings
from remediator.policy import Policy, load_policy, parse_policy

NODES = 1000
PODS_PER_NODE = 8
BUDGET_ONLY = """
safety:
  max_disrupted_nodes: 2
  storm_breaker: {enabled: false}
rules:
  - name: drain
    match: ['remediation="drain"']
    actions: [{type: condition}, {type: cordon}, {type: drain, delete_emptydir_data: true}]
"""


def synthetic_cluster() -> SnapshotCluster:
    job = (OwnerReference(kind="Job", name="train", controller=True),)
    nodes = [
        Node(name=f"gpu-{i:04d}", labels={"node.kubernetes.io/instance-type": "p5.48xlarge"})
        for i in range(NODES)
    ]
    pods = [
        Pod(
            namespace="ml",
            name=f"train-{i:04d}-{j}",
            node_name=f"gpu-{i:04d}",
            labels={"app": "train"},
            owners=job,
        )
        for i in range(NODES)
        for j in range(PODS_PER_NODE)
    ]
    pdb = PodDisruptionBudget(
        namespace="ml",
        name="train",
        selector=LabelSelector(match_labels={"app": "train"}),
        disruptions_allowed=50,
    )
    return SnapshotCluster(nodes=nodes, pods=pods, pdbs=[pdb], source="<synthetic 1000 nodes>")


def payload() -> bytes:
    alerts = [
        {
            "status": "firing",
            "labels": {
                "alertname": "AccelGPUFatalXid",
                "node": f"gpu-{i:04d}",
                "remediation": "drain",
                "severity": "critical",
                "xid": "79",
            },
            "annotations": {"summary": "GPU has fallen off the bus"},
            "startsAt": "2025-11-22T20:00:00Z",
            "endsAt": "0001-01-01T00:00:00Z",
            "generatorURL": "http://prometheus/graph",
            "fingerprint": f"{i:016x}",
        }
        for i in range(NODES)
    ]
    return json.dumps(
        {"version": "4", "status": "firing", "receiver": "remediator", "alerts": alerts}
    ).encode()


def run(policy: Policy, label: str) -> float:
    body = payload()
    engine = Engine(
        policy=policy,
        cluster=synthetic_cluster(),
        aws=RecordingAws(),
        settings=EngineSettings(dry_run=True),
        clock=time.time,
    )
    asyncio.run(engine.start())
    started = time.perf_counter()
    plans = asyncio.run(engine.handle(parse_body(body)))
    elapsed = time.perf_counter() - started
    records = [r for p in plans for r in p.records]
    by_outcome = Counter((r.action, r.outcome, r.gate) for r in records)
    acted_nodes = {r.node for r in records if r.action in ("cordon", "drain") and r.outcome == "planned"}
    print(f"{label}: {len(plans)} alerts, {len(records)} decisions in {elapsed * 1000:.0f} ms")
    print(f"  nodes planned for cordon/drain: {len(acted_nodes)} (budget {engine.budget.capacity})")
    for (action, outcome, gate), count in sorted(by_outcome.items(), key=lambda kv: -kv[1])[:6]:
        print(f"  {count:5d} x {action} {outcome}{f' [{gate}]' if gate else ''}")
    return elapsed


def main() -> None:
    logging.disable(logging.INFO)  # the decision log lines would measure the terminal, not the engine
    budget_only = run(parse_policy(BUDGET_ONLY, source="bench (breaker off)"), "budget only")
    default = run(load_policy(), "default policy")
    worst = max(budget_only, default)
    print(
        f"worst: {worst * 1000:.0f} ms per 1000-alert payload (target <= 1000 ms): "
        + ("ok" if worst <= 1 else "SLOW")
    )


if __name__ == "__main__":
    main()
