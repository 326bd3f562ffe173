"""The closed loop on the demo's cluster snapshot: a GPU falls off the bus, the node is taken out and
drained, it reboots, the post-repair checks pass and it is back in the pool.

Everything runs in this process against examples/cluster-snapshot.yaml in memory (the snapshot
backend; nothing outside changes), with the shipped default policy, acting for real on the snapshot:
the engine takes the alert Alertmanager delivered in the first part of the demo, the repair loop
(remediator/repair.py) records the quarantine, the demo plays the machine and reboots it (a new boot
id; the exporter's since-boot counter restarts at zero, so the alert resolves), and the loop runs the
default checks (`remapped`, `power`) through the exporter's own `GET /checks` handler over HTTP. There
is no GPU here: those checks read NVML through the exporter's reader from an NVML stand-in holding an
8-GPU H100 snapshot (tests/exporter/fake_nvml.py).
"""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import ThreadingHTTPServer

from examples.pipeline import SNAPSHOT
from exporter.checks.endpoint import ChecksEndpoint
from exporter.checks.nvml_checks import PowerSlowdownCheck, RemappedRowsCheck
from exporter.checks.runner import CheckRunner
from exporter.cli import checks_source, make_handler
from exporter.readers.nvml import PynvmlReader
from exporter.sources import build_registry
from remediator.audit import DecisionRecord
from remediator.engine import Engine, EngineSettings
from remediator.executors.snapshot import RecordingAws, SnapshotCluster
from remediator.payload import parse_payload
from remediator.policy import load_policy
from remediator.repair import ExporterChecks, RepairLoop, url_template_endpoint
from tests.exporter.fake_nvml import FakeNvml  # the NVML stand-in: there is no GPU here

SNAPSHOT_NODE = "gpu-node-1"
ALERT = {
    "labels": {
        "alertname": "AccelGPUFatalXid",
        "node": SNAPSHOT_NODE,
        "xid": "79",
        "gpu": "4",
        "pci_bus_id": "0000:9d:00",
        "severity": "critical",
        "remediation": "drain",
    },
    "annotations": {"summary": "GPU 4 (0000:9d:00) on gpu-node-1 fell off the bus (Xid 79)"},
    "startsAt": "2025-11-22T20:00:00Z",
    "fingerprint": "demo-xid79-gpu-node-1",
}


@dataclass(frozen=True)
class Step:
    """One line of the loop's timeline."""

    at: float
    """Seconds since the alert reached the remediator."""
    text: str


@contextmanager
def checks_server(token: str) -> Iterator[str]:
    """The exporter's HTTP handler with the remapped and power checks on the NVML stand-in."""
    reader = PynvmlReader(library=FakeNvml.from_fixture("h100x8"), timeout=5.0)
    runner = CheckRunner([RemappedRowsCheck(reader), PowerSlowdownCheck(reader)], nvml=reader)
    endpoint = ChecksEndpoint(runner, token, node=SNAPSHOT_NODE)
    server = ThreadingHTTPServer(
        ("127.0.0.1", 0), make_handler(build_registry([checks_source(runner, None)]), endpoint)
    )
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/checks"
    finally:
        server.shutdown()
        server.server_close()


def _payload(status: str) -> dict[str, object]:
    alert = {**ALERT, "status": status}
    return {"version": "4", "status": status, "alerts": [alert]}


async def run_loop(on_step: Callable[[Step], None] = lambda _step: None) -> list[Step]:
    """Fault -> out of the pool -> drained -> rebooted -> checks pass -> back; the timeline."""
    steps: list[Step] = []
    t0 = time.monotonic()

    def step(text: str) -> None:
        steps.append(Step(time.monotonic() - t0, text))
        on_step(steps[-1])

    def shown(record: DecisionRecord) -> None:
        if record.outcome in ("done", "started", "failed"):
            step(f"decision  {record.action} -> {record.outcome}: {record.reason}")

    cluster = SnapshotCluster.from_file(SNAPSHOT)
    policy = load_policy()
    engine = Engine(
        policy=policy, cluster=cluster, aws=RecordingAws(), settings=EngineSettings(), clock=time.time
    )
    engine.subscribe(shown)
    token = secrets.token_urlsafe(16)
    with checks_server(token) as url:
        repair = RepairLoop(
            policy=policy,
            cluster=cluster,
            verifier=ExporterChecks(endpoint=url_template_endpoint(url), token=token, timeout_seconds=10),
            firing=engine.causes,
            publish=engine.publish,
        )
        node = cluster.nodes[SNAPSHOT_NODE]
        step(f"alert     AccelGPUFatalXid (Xid 79: GPU 4 fell off the bus), boot {node.boot_id[:8]}")
        await engine.handle(parse_payload(_payload("firing")))
        await engine.drained()
        await repair.reconcile()
        node = cluster.nodes[SNAPSHOT_NODE]
        left = len(await cluster.list_pods(node.name))
        step(f"node      unschedulable={node.unschedulable}; pods left on it: {left}")
        boot = "e41d9b27-0c3a-4f15-8d7e-00000000b002"
        cluster.rebooted(SNAPSHOT_NODE, boot)
        step(f"reboot    (in the snapshot) {SNAPSHOT_NODE} is back with boot id {boot[:8]}")
        await engine.handle(parse_payload(_payload("resolved")))
        step("alert     resolved: the since-boot Xid counter started again at zero")
        await repair.reconcile()
        node = cluster.nodes[SNAPSHOT_NODE]
        healthy = next(c for c in node.conditions if c.type == "AcceleratorHealthy")
        step(
            f"node      unschedulable={node.unschedulable}; AcceleratorHealthy={healthy.status} "
            f"({healthy.reason}): back in the pool"
        )
    return steps


def main() -> int:
    for item in asyncio.run(run_loop()):
        print(f"  +{item.at:6.3f}s  {item.text}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
