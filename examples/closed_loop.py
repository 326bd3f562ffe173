"""The closed loop on the demo's cluster snapshot: a GPU falls off the bus, the node is taken out, its
evidence is captured, it is drained, it reboots, the post-repair checks pass and it is back in the pool.

Everything runs in this process against examples/cluster-snapshot.yaml in memory (the snapshot
backend; nothing outside changes), with the shipped default policy, acting for real on the snapshot:
the engine takes the alert Alertmanager delivered in the first part of the demo; its `evidence` step
fetches the node's evidence from the exporter's own `GET /evidence` handler over HTTP (the Xid 79
line, read by the exporter's kernel-log parser from gpu-node-1's kernel log, and the GPUs' serials and
UUIDs) and stores it in memory (a cluster keeps it in an immutable ConfigMap or S3); the repair loop
(remediator/lifecycle/repair.py) records the quarantine, the demo plays the machine and reboots it (a new boot
id; the exporter's since-boot counter restarts at zero, so the alert resolves), and the loop runs the
default checks (`remapped`, `power`) through the exporter's `GET /checks` handler. There is no GPU
here: NVML is an NVML stand-in holding an 8-GPU H100 snapshot (tests/exporter/fake_nvml.py), read
through the exporter's own reader.
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import ThreadingHTTPServer
from pathlib import Path

from examples.pipeline import DEMO_FAULTS, NODES_DIR, SNAPSHOT
from exporter.auth import BearerToken
from exporter.checks.endpoint import ChecksEndpoint
from exporter.checks.nvml_checks import PowerSlowdownCheck, RemappedRowsCheck
from exporter.checks.runner import CheckRunner
from exporter.cli import check_summaries, checks_source, make_handler
from exporter.evidence import EvidenceEndpoint, EvidenceSources, EvidenceStore
from exporter.readers.kmsg import KmsgTally
from exporter.readers.nvml import PynvmlReader
from exporter.sources import build_registry
from remediator.audit import DecisionRecord
from remediator.evidence.bundle import rfc3339_ms
from remediator.evidence.fetch import ExporterEvidence
from remediator.evidence.report import render
from remediator.evidence.store import MemoryEvidenceStore, latest
from remediator.executors.snapshot import RecordingAws, SnapshotCluster
from remediator.intake.payload import parse_payload
from remediator.lifecycle.engine import Engine
from remediator.lifecycle.model import EngineSettings
from remediator.lifecycle.repair import ExporterChecks, RepairLoop, url_template_endpoint
from remediator.policy import load_policy
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
    "fingerprint": "demo-xid79-gpu-node-1",
}


@dataclass(frozen=True)
class Step:
    """One line of the loop's timeline."""

    at: float
    """Seconds since the alert reached the remediator."""
    text: str
    detail: str = ""
    """Lines shown under the step (the evidence report); empty for most steps."""


_RECORD_PREFIX = re.compile(r"^\d+,(\d+),(\d+),")


def _kernel_log() -> tuple[list[str], int]:
    """gpu-node-1's kernel log (examples/nodes) with the demo's Xid 79 record appended, in /dev/kmsg
    format, one second after its last record (as the first part of the demo writes it); and that
    record's timestamp (microseconds since boot)."""
    lines = (NODES_DIR / SNAPSHOT_NODE / "kmsg").read_text().splitlines()
    seq, ts = 0, 0
    for line in lines:
        if match := _RECORD_PREFIX.match(line):
            seq, ts = int(match.group(1)), int(match.group(2))
    fault = next(f for f in DEMO_FAULTS if f.alert_labels.get("xid") == "79")
    return [*lines, f"3,{seq + 1},{ts + 1_000_000},-;{fault.message}"], ts + 1_000_000


def _evidence_store(workdir: Path, boot_id: str) -> EvidenceStore:
    """The exporter's evidence of this boot: the kernel log read by the exporter's own parser, which
    hands each counted fault record to the store, as the exporter's kernel-log follower does. The
    node's clock reads as if the Xid 79 record was written half a second ago."""
    boot_id_path = workdir / "boot_id"
    boot_id_path.write_text(boot_id + "\n")
    lines, xid_us = _kernel_log()
    uptime, started = xid_us / 1e6 + 0.5, time.monotonic()
    store = EvidenceStore(
        directory=None, boot_id_path=boot_id_path, monotonic=lambda: uptime + time.monotonic() - started
    )
    tally = KmsgTally()
    tally.sink = store
    tally.add_lines(lines)
    return store


@contextmanager
def node_exporter(token: str, *, boot_id: str) -> Iterator[str]:
    """The exporter's HTTP handler on the NVML stand-in: the remapped and power checks on `GET /checks`
    and this boot's evidence on `GET /evidence`, both behind `token`; yields its base URL."""
    reader = PynvmlReader(library=FakeNvml.from_fixture("h100x8"), timeout=5.0)
    runner = CheckRunner([RemappedRowsCheck(reader), PowerSlowdownCheck(reader)], nvml=reader)
    endpoint = ChecksEndpoint(runner, token, node=SNAPSHOT_NODE)
    with tempfile.TemporaryDirectory(prefix="accel-health-closed-loop-") as workdir:
        evidence = EvidenceEndpoint(
            _evidence_store(Path(workdir), boot_id),
            EvidenceSources(
                sysfs_root=NODES_DIR / SNAPSHOT_NODE / "sys",
                nvml=reader,
                node=SNAPSHOT_NODE,
                checks=check_summaries(runner),
            ),
            BearerToken(token=token),
        )
        registry = build_registry([checks_source(runner, None)])
        server = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(registry, endpoint, evidence=evidence))
        thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        thread.start()
        try:
            yield f"http://127.0.0.1:{server.server_address[1]}"
        finally:
            server.shutdown()
            server.server_close()
            reader.close()


def _payload(status: str, *, starts_at: str) -> dict[str, object]:
    alert = {**ALERT, "status": status, "startsAt": starts_at}
    return {"version": "4", "status": status, "alerts": [alert]}


async def run_loop(on_step: Callable[[Step], None] = lambda _step: None) -> list[Step]:
    """Fault -> out of the pool -> drained -> rebooted -> checks pass -> back; the timeline."""
    steps: list[Step] = []
    t0 = time.monotonic()

    def step(text: str, detail: str = "") -> None:
        steps.append(Step(time.monotonic() - t0, text, detail))
        on_step(steps[-1])

    def shown(record: DecisionRecord) -> None:
        if record.outcome in ("done", "started", "failed"):
            step(f"decision  {record.action} -> {record.outcome}: {record.reason}")

    cluster = SnapshotCluster.from_file(SNAPSHOT)
    policy = load_policy()
    token = secrets.token_urlsafe(16)
    evidence = MemoryEvidenceStore()
    with node_exporter(token, boot_id=cluster.nodes[SNAPSHOT_NODE].boot_id) as url:
        engine = Engine(
            policy=policy,
            cluster=cluster,
            aws=RecordingAws(),
            settings=EngineSettings(),
            clock=time.time,
            evidence_fetcher=ExporterEvidence(
                endpoint=url_template_endpoint(f"{url}/evidence"), token=token, timeout_seconds=10
            ),
            evidence_store=evidence,
        )
        engine.subscribe(shown)
        repair = RepairLoop(
            policy=policy,
            cluster=cluster,
            verifier=ExporterChecks(
                endpoint=url_template_endpoint(f"{url}/checks"), token=token, timeout_seconds=10
            ),
            firing=engine.causes,
            publish=engine.publish,
            node_lock=engine.queue.lock,
        )
        node = cluster.nodes[SNAPSHOT_NODE]
        step(f"alert     AccelGPUFatalXid (Xid 79: GPU 4 fell off the bus), boot {node.boot_id[:8]}")
        starts_at = rfc3339_ms(time.time())  # the Xid record was written half a second before
        await engine.handle(parse_payload(_payload("firing", starts_at=starts_at)))
        await engine.drained()
        await repair.reconcile()
        node = cluster.nodes[SNAPSHOT_NODE]
        left = len(await cluster.list_pods(node.name))
        step(f"node      unschedulable={node.unschedulable}; pods left on it: {left}")
        captured = await latest(evidence, SNAPSHOT_NODE)
        if captured is None:
            step("evidence  none stored")
        else:
            item, body = captured
            step(
                f"evidence  stored at {item.location} before the reboot; "
                f"`accel-health evidence {SNAPSHOT_NODE}` prints it:",
                render(json.loads(body), location=item.location),
            )
        boot = "e41d9b27-0c3a-4f15-8d7e-00000000b002"
        cluster.rebooted(SNAPSHOT_NODE, boot)
        step(f"reboot    (in the snapshot) {SNAPSHOT_NODE} is back with boot id {boot[:8]}")
        await engine.handle(parse_payload(_payload("resolved", starts_at=starts_at)))
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
        for line in item.detail.splitlines():
            print(f"      | {line}".rstrip())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
