"""The `evidence` step (issue 26): the policy field and its errors; a capture through the engine from a
real HTTP server playing the exporter's GET /evidence, with the node annotation, the Event and the
metric; a node whose exporter does not answer, refuses the token or answers too late (the capture
fails, is recorded and stored without the node's part, and the drain still runs within the deadline);
a store that hangs; resends and a restarted engine that never capture twice; a dry run that fetches
and stores nothing; the size bound; the retention (pure); the S3 store against moto; and the report
and the `accel-health evidence` command."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import boto3
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from remediator import cli, fleet_cli
from remediator.cluster import Node
from remediator.evidence import cli as evidence_cli
from remediator.evidence.bundle import (
    ANNOTATION,
    MAX_STORED_BYTES,
    SCHEMA,
    FetchResult,
    build_capture,
    configmap_name,
    encode,
    node_label_value,
    s3_key,
)
from remediator.evidence.fetch import ExporterEvidence
from remediator.evidence.report import render
from remediator.evidence.store import (
    EvidenceRetention,
    MemoryEvidenceStore,
    S3EvidenceStore,
    StoredEvidence,
    expired,
    latest,
)
from remediator.executors.snapshot import RecordingAws, SnapshotCluster
from remediator.intake.payload import parse_payload
from remediator.lifecycle.engine import Engine
from remediator.lifecycle.model import EngineSettings
from remediator.lifecycle.record import EPISODES
from remediator.lifecycle.repair import url_template_endpoint
from remediator.metrics import RemediatorMetrics
from remediator.policy import CaptureEvidence, PolicyError, load_policy, parse_policy
from tests.remediator.conftest import SNAPSHOT, FakeClock
from tests.remediator.evidence_server import (
    GPU4_SERIAL,
    GPU4_UUID,
    TOKEN,
    XID_LINE,
    EvidenceServer,
    evidence_doc,
)

AiohttpServer = Callable[[web.Application], Awaitable[TestServer]]

POLICY = """
rules:
  - name: drain
    match: ['remediation="drain"']
    actions:
      - {type: condition}
      - {type: cordon}
      - {type: evidence, timeout_seconds: 2}
      - {type: drain, timeout_seconds: 60}
"""
NODE = "gpu-node-1"
NOW = 1_763_843_468.0
"""2025-11-22T20:31:08Z: a second after the alert started."""


def cluster() -> SnapshotCluster:
    node = Node(
        name=NODE,
        labels={"node.kubernetes.io/instance-type": "p5.48xlarge", "team": "not-kept"},
        provider_id="aws:///us-west-2a/i-0a1b2c3d4e5f60001",
        accelerators=("nvidia.com/gpu",),
        uid="uid-1",
        boot_id="3f1e2d4c-8b7a-4c2d-9e1f-0a1b2c3d4e5f",
    )
    return SnapshotCluster(nodes=[node], pods=[], pdbs=[])


def firing(node: str = NODE) -> Any:
    return parse_payload(
        {
            "version": "4",
            "status": "firing",
            "alerts": [
                {
                    "status": "firing",
                    "labels": {
                        "alertname": "AccelGPUFatalXid",
                        "node": node,
                        "remediation": "drain",
                        "gpu": "4",
                        "xid": "79",
                    },
                    "annotations": {"summary": "GPU 4 on gpu-node-1 reported fatal Xid 79"},
                    "startsAt": "2025-11-22T20:31:07.412Z",
                    "fingerprint": "fp-xid",
                }
            ],
        }
    )


def engine_over(
    snapshot: SnapshotCluster,
    url: str,
    store: Any,
    *,
    dry_run: bool = False,
    policy: str = POLICY,
    token: str = TOKEN,
) -> Engine:
    return Engine(
        policy=parse_policy(policy),
        cluster=snapshot,
        aws=RecordingAws(),
        settings=EngineSettings(dry_run=dry_run),
        clock=FakeClock(NOW),
        evidence_fetcher=ExporterEvidence(
            endpoint=url_template_endpoint(url + "/{node}/evidence"), token=token
        ),
        evidence_store=store,
    )


async def serve(aiohttp_server: AiohttpServer, exporter: EvidenceServer) -> str:
    server = await aiohttp_server(exporter.app())
    return str(server.make_url("")).rstrip("/")


def decisions(engine: Engine, action: str) -> list[Any]:
    return [r for r in engine.log.records() if r.action == action]


# -- the policy ---------------------------------------------------------------------------------


def test_the_evidence_step_parses_with_its_default_deadline_and_bad_fields_are_named() -> None:
    rule = parse_policy("rules: [{name: r, actions: [evidence]}]").rules[0]
    assert rule.actions == (CaptureEvidence(timeout_seconds=10),)
    bad = {
        "{type: evidence, timeout_seconds: 0}": (
            "rules[0] (r).actions[0].timeout_seconds: the evidence deadline must be 1 to 120 seconds, got 0"
        ),
        "{type: evidence, timeout_seconds: 600}": "must be 1 to 120 seconds, got 600",
        "{type: evidence, timeout_seconds: soon}": "timeout_seconds: expected an integer, got str 'soon'",
        "{type: evidence, bucket: b}": "bucket: unknown field for action evidence (known: timeout_seconds)",
    }
    for action, problem in bad.items():
        with pytest.raises(PolicyError) as caught:
            parse_policy(f"rules: [{{name: r, actions: [{action}]}}]")
        assert problem in str(caught.value)
    with pytest.raises(PolicyError, match="evidence is not allowed when an alert resolves"):
        parse_policy("rules: [{name: r, actions: [], on_resolved: [evidence]}]")


def test_the_default_policy_captures_before_the_drain_of_a_fatal_fault() -> None:
    for rule in load_policy().rules:
        types = [a.type for a in rule.actions]
        if "drain" in types:
            assert types.index("evidence") == types.index("drain") - 1, rule.name
        if any(t in types for t in ("aws_reboot", "aws_set_unhealthy")):
            assert "evidence" in types, rule.name


# -- the engine's step ------------------------------------------------------------------------


async def test_a_capture_fetches_the_node_evidence_stores_it_annotates_the_node_and_never_repeats(
    aiohttp_server: AiohttpServer,
) -> None:
    exporter = EvidenceServer()
    url = await serve(aiohttp_server, exporter)
    snapshot, store = cluster(), MemoryEvidenceStore()
    engine = engine_over(snapshot, url, store)
    metrics = RemediatorMetrics(status=engine.status)
    engine.subscribe(metrics.observe)

    await engine.handle(firing())
    await engine.drained()

    (rec,) = decisions(engine, "evidence")
    assert (rec.outcome, rec.details["capture"]) == ("done", "captured")
    location = rec.details["location"]
    assert snapshot.nodes[NODE].annotations[ANNOTATION] == location
    assert [d.outcome for d in decisions(engine, "drain")] == ["started", "done"]  # the step after it ran
    events = [e for e in snapshot.events if e["reason"] == "AccelEvidenceCaptured"]
    assert len(events) == 1
    assert location in events[0]["message"]
    found = await latest(store, NODE)
    assert found is not None
    doc = json.loads(found[1])
    assert doc["schema"] == SCHEMA
    assert doc["node"] == NODE
    assert doc["node_evidence"]["gpus"][4]["serial"] == GPU4_SERIAL
    assert doc["node_evidence"]["records"][0]["first"][0]["line"] == XID_LINE
    assert doc["alerts"][0]["labels"]["xid"] == "79"
    assert [d["action"] for d in doc["decisions"]] == ["condition", "cordon"]  # what came before it
    assert doc["kubernetes"]["labels"] == {"node.kubernetes.io/instance-type": "p5.48xlarge"}
    assert doc["kubernetes"]["provider_id"].endswith("i-0a1b2c3d4e5f60001")
    whats = [t["what"] for t in doc["timeline"]]
    assert whats[:2] == ["first xid 79 record on 0000:9d:00", "AccelGPUFatalXid started firing"]
    assert "captured" in whats
    assert "the exporter collected the node's evidence" in whats
    assert [t["at"] for t in doc["timeline"]] == sorted(t["at"] for t in doc["timeline"])
    assert (
        metrics.registry.get_sample_value("accel_remediator_evidence_captures_total", {"outcome": "captured"})
        == 1.0
    )
    assert '"e"' in snapshot.nodes[NODE].annotations[EPISODES]  # the step is in the node's record

    await engine.handle(firing())  # Alertmanager resends
    again = engine_over(snapshot, url, store)  # a restarted service, or a new leader
    await again.start()
    await again.handle(firing())
    await again.drained()
    assert exporter.requests == [NODE]
    assert len(store.items[NODE]) == 1
    assert decisions(again, "evidence") == []


@pytest.mark.parametrize(
    ("exporter", "token", "error"),
    [
        (EvidenceServer(), "wrong-token", "HTTP 401"),
        (EvidenceServer(status=500), TOKEN, "HTTP 500"),
        (EvidenceServer(delay=30), TOKEN, "no answer within 1.2 s"),
    ],
    ids=["refused-token", "server-error", "too-slow"],
)
async def test_an_exporter_that_does_not_answer_fails_the_capture_visibly_and_the_drain_still_runs(
    aiohttp_server: AiohttpServer, exporter: EvidenceServer, token: str, error: str
) -> None:
    url = await serve(aiohttp_server, exporter)
    snapshot, store = cluster(), MemoryEvidenceStore()
    engine = engine_over(snapshot, url, store, token=token)
    metrics = RemediatorMetrics(status=engine.status)
    engine.subscribe(metrics.observe)

    began = time.monotonic()
    await engine.handle(firing())
    took = time.monotonic() - began
    await engine.drained()

    assert took < 2.5  # the step's deadline is 2 s: the drain is not held back longer
    (rec,) = decisions(engine, "evidence")
    assert rec.outcome == "failed"
    assert rec.details["capture"] == "fetch_failed"
    assert error in rec.reason
    assert rec.details["location"] in rec.reason
    assert [d.outcome for d in decisions(engine, "drain")] == ["started", "done"]
    (event,) = [e for e in snapshot.events if e["reason"] == "AccelEvidenceCaptureFailed"]
    assert event["type"] == "Warning"
    assert error in event["message"]
    assert (
        metrics.registry.get_sample_value(
            "accel_remediator_evidence_captures_total", {"outcome": "fetch_failed"}
        )
        == 1.0
    )
    # This service's part is stored all the same, with the error, and the node says where.
    found = await latest(store, NODE)
    assert found is not None
    doc = json.loads(found[1])
    assert doc["node_evidence"] is None
    assert error in doc["fetch"]["error"]
    assert [a["alertname"] for a in doc["alerts"]] == ["AccelGPUFatalXid"]
    assert snapshot.nodes[NODE].annotations[ANNOTATION] == found[0].location
    assert "NODE EVIDENCE MISSING" in render(doc, location=found[0].location)


async def test_a_large_document_arriving_in_many_chunks_is_read_whole(aiohttp_server: AiohttpServer) -> None:
    url = await serve(aiohttp_server, EvidenceServer(padding=3000))
    fetched = await ExporterEvidence(
        endpoint=url_template_endpoint(url + "/{node}/evidence"), token=TOKEN
    ).fetch(NODE)
    assert fetched.error == ""
    assert fetched.size > 256 * 1024
    assert fetched.document is not None
    assert len(fetched.document["records"][1]["first"]) == 3000


async def test_a_node_with_no_exporter_pod_is_a_failed_fetch_not_an_error() -> None:
    async def nowhere(_node: str) -> str | None:
        return None

    fetched = await ExporterEvidence(endpoint=nowhere, token=TOKEN).fetch(NODE)
    assert not fetched.ok
    assert fetched.error == "no running exporter pod with an IP on the node"


class HangingStore(MemoryEvidenceStore):
    """A store that never answers (an API server or S3 endpoint that hangs)."""

    async def put(self, *, node: str, captured_at: float, alertname: str, body: bytes) -> str:
        await asyncio.sleep(3600)
        raise AssertionError("not reached")


async def test_a_store_that_hangs_fails_the_capture_at_the_deadline_and_the_drain_runs(
    aiohttp_server: AiohttpServer,
) -> None:
    url = await serve(aiohttp_server, EvidenceServer())
    snapshot = cluster()
    engine = engine_over(snapshot, url, HangingStore())
    began = time.monotonic()
    await engine.handle(firing())
    assert time.monotonic() - began < 2.5
    await engine.drained()
    (rec,) = decisions(engine, "evidence")
    assert (rec.outcome, rec.details["capture"]) == ("failed", "store_failed")
    assert "not stored within the 2 s deadline" in rec.reason
    assert ANNOTATION not in snapshot.nodes[NODE].annotations
    assert [d.outcome for d in decisions(engine, "drain")] == ["started", "done"]


async def test_a_dry_run_plans_the_capture_and_fetches_and_stores_nothing(
    aiohttp_server: AiohttpServer,
) -> None:
    exporter = EvidenceServer()
    url = await serve(aiohttp_server, exporter)
    snapshot, store = cluster(), MemoryEvidenceStore()
    engine = engine_over(snapshot, url, store, dry_run=True)
    await engine.handle(firing())
    (rec,) = decisions(engine, "evidence")
    assert rec.outcome == "planned"
    assert "would fetch the node's evidence" in rec.reason
    assert exporter.requests == []
    assert store.items == {}
    assert ANNOTATION not in snapshot.nodes[NODE].annotations
    assert snapshot.mutations == []


async def test_a_service_without_a_store_skips_the_step_saying_so() -> None:
    engine = Engine(
        policy=parse_policy(POLICY),
        cluster=cluster(),
        aws=RecordingAws(),
        settings=EngineSettings(),
        clock=FakeClock(),
    )
    await engine.handle(firing())
    (rec,) = decisions(engine, "evidence")
    assert (rec.outcome, rec.reason) == ("skipped", "evidence capture is not configured in this service")


# -- the document, its bound and its names ----------------------------------------------------


def test_a_capture_over_the_limit_is_cut_down_with_a_note_and_stays_json() -> None:
    huge = {
        "schema": SCHEMA,
        "node": NODE,
        "notes": [],
        "decisions": [],
        "node_evidence": evidence_doc(NODE, padding=20_000),
    }
    body = encode(huge)
    assert len(body) <= MAX_STORED_BYTES
    doc = json.loads(body)
    (xid13,) = [g for g in doc["node_evidence"]["records"] if g["code"] == "13"]
    assert len(xid13["first"]) == 1
    assert xid13["dropped"] == 19_999
    assert "one first and one last line kept" in doc["notes"][0]
    small = encode(huge, limit=2_000)
    assert len(small) <= 2_000
    assert json.loads(small)["node_evidence"] is None


def test_names_fit_kubernetes_and_s3_and_sort_by_time() -> None:
    long = "ip-10-0-0-1." + "a" * 240
    assert node_label_value(NODE) == NODE
    assert len(node_label_value(long)) <= 63
    assert node_label_value(long) == node_label_value(long)
    name = configmap_name(long, 1_763_843_467.412)
    assert len(name) <= 253
    assert name == name.lower()
    assert configmap_name(NODE, 1_763_843_467.412) == "accel-health-evidence-gpu-node-1-20251122t203107-412z"
    assert s3_key("/accel-health/evidence/", NODE, 1_763_843_467.412, "AccelGPUFatalXid") == (
        "accel-health/evidence/gpu-node-1/20251122T203107.412Z-AccelGPUFatalXid.json"
    )
    assert s3_key("", NODE, 0, "") == "gpu-node-1/19700101T000000.000Z-alert.json"


def test_the_retention_keeps_the_newest_per_node_and_in_total_and_drops_the_old() -> None:
    day = 86400.0
    now = 100 * day
    items = [StoredEvidence(f"cm/a{i}", "a", now - i, "X") for i in range(5)]
    items += [StoredEvidence(f"cm/b{i}", "b", now - 10 - i, "X") for i in range(2)]
    items += [StoredEvidence("cm/old", "c", now - 31 * day, "X")]
    retention = EvidenceRetention(per_node=3, total=4, max_age_seconds=30 * day)
    doomed = {i.location for i in expired(items, now=now, retention=retention, keep="cm/a0")}
    assert doomed == {"cm/a3", "cm/a4", "cm/b1", "cm/old"}  # a: 3 newest; total 4: b1 goes; c too old
    with pytest.raises(ValueError, match="keep at least 1 capture"):
        EvidenceRetention(per_node=0)


# -- the report and the command ----------------------------------------------------------------


def _stored_capture() -> dict[str, Any]:
    alert = firing().alerts[0]
    fetch = FetchResult("http://10.0.12.31:9835/evidence", evidence_doc(NODE), status=200, seconds=0.01)
    return build_capture(
        node_name=NODE,
        node=cluster().nodes[NODE],
        alert=alert,
        rule="drain",
        others=[],
        decisions=[],
        fetch=fetch,
        captured_at=1_763_843_468.0,
        version="0.1.0",
    )


def test_the_report_shows_the_gpu_serials_the_xid_line_and_where_it_is_stored() -> None:
    text = render(_stored_capture(), location="s3://b/k.json")
    assert "Evidence for node gpu-node-1" in text
    assert "stored at     s3://b/k.json" in text
    gpu4 = next(line for line in text.splitlines() if GPU4_SERIAL in line)
    assert GPU4_UUID in gpu4
    assert "692-2G520-0200-000" in gpu4
    assert "96.00.89.00.01" in gpu4
    assert "driver        550.54.15   CUDA 12.4" in text
    assert "xid 79 on 0000:9d:00: seen 1, 0 not kept" in text
    assert f"2025-11-22T20:31:05.118Z [  1234.567932] #42 {XID_LINE}" in text
    assert "AccelGPUFatalXid firing since 2025-11-22T20:31:07.412Z" in text
    assert "remapped  pass" in text
    assert render({}, location="x").startswith("Evidence for node -")  # nothing known: no traceback


REGION = "us-west-2"


@pytest.fixture
def s3(moto: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    for key, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": REGION,
    }.items():
        monkeypatch.setenv(key, value)
    client = boto3.session.Session(region_name=REGION).client("s3", endpoint_url=moto)
    client.create_bucket(Bucket="evidence", CreateBucketConfiguration={"LocationConstraint": REGION})
    return client


async def test_captures_go_to_s3_once_each_and_the_command_prints_the_newest(
    s3: Any, moto: str, aiohttp_server: AiohttpServer
) -> None:
    url = await serve(aiohttp_server, EvidenceServer())
    store = S3EvidenceStore(bucket="evidence", prefix="accel-health/evidence", client=s3)
    engine = engine_over(cluster(), url, store)
    await engine.handle(firing())
    await engine.drained()
    (rec,) = decisions(engine, "evidence")
    assert rec.outcome == "done"
    assert rec.details["location"].startswith("s3://evidence/accel-health/evidence/gpu-node-1/")
    await store.put(node=NODE, captured_at=1.0, alertname="Older", body=b"{}")
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket="evidence")["Contents"]]
    assert len(keys) == 2
    newest = await store.captures(NODE)
    assert newest[0].location == rec.details["location"]
    assert newest[1].alertname == "Older"

    out = io.StringIO()
    argv = ["evidence", NODE, "--bucket", "evidence", "--endpoint-url", moto, "--region", REGION]
    assert await asyncio.to_thread(fleet_cli_main, argv, out) == 0
    assert GPU4_SERIAL in out.getvalue()
    assert XID_LINE in out.getvalue()
    out = io.StringIO()
    assert await asyncio.to_thread(evidence_cli.main, [*argv[1:], "--json"], out=out) == 0
    assert json.loads(out.getvalue())["node_evidence"]["gpus"][4]["uuid"] == GPU4_UUID
    missing = await asyncio.to_thread(evidence_cli.main, ["gone-node", *argv[2:]], out=io.StringIO())
    assert missing == evidence_cli.EXIT_NOT_FOUND


def fleet_cli_main(argv: list[str], out: io.StringIO) -> int:
    """`accel-health evidence ...` with its output caught (the console script writes to stdout)."""
    with contextlib.redirect_stdout(out):
        return fleet_cli.main(argv)


async def test_the_command_reads_a_node_live_from_its_exporter(
    aiohttp_server: AiohttpServer, tmp_path: Any
) -> None:
    url = await serve(aiohttp_server, EvidenceServer())
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    out = io.StringIO()
    argv = [NODE, "--live", f"{url}/{NODE}/evidence", "--token-file", str(token)]
    assert await asyncio.to_thread(evidence_cli.main, argv, out=out) == 0
    assert GPU4_SERIAL in out.getvalue()
    assert "(live, not stored)" in out.getvalue()
    token.write_text("wrong\n")
    assert await asyncio.to_thread(evidence_cli.main, argv, out=io.StringIO()) == evidence_cli.EXIT_NOT_FOUND


def test_the_service_flags_choose_the_store(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    base = ["--insecure-no-auth", f"--cluster-snapshot={SNAPSHOT}"]
    args = cli._serve_parser().parse_args(base)
    assert isinstance(cli._evidence_store(args, cluster(), leading=lambda: True), MemoryEvidenceStore)
    args = cli._serve_parser().parse_args([*base, "--evidence-bucket=b", "--evidence-prefix=/p/"])
    s3 = cli._evidence_store(args, cluster(), leading=lambda: True)
    assert isinstance(s3, S3EvidenceStore)
    assert s3.describe() == "s3://b/p/"
    args = cli._serve_parser().parse_args([*base, "--evidence-keep-per-node=0"])
    with pytest.raises(cli.UsageError, match="keep at least 1 capture per node"):
        cli._evidence_store(args, cluster(), leading=lambda: True)
