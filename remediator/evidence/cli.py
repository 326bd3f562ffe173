"""`accel-health evidence NODE` (also `accel-health-remediator evidence NODE`): the newest capture
stored for NODE as a readable report, `--json` for tooling. Read from the ConfigMaps in the
remediator's namespace (default), from S3 (`--bucket`), or fetched now from the node's exporter
(`--live URL`, e.g. through `kubectl port-forward`). A stored capture is kept apart from the Node
object, so it is still there once the node is gone."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from kubernetes.aio import client as k8s

from remediator.evidence.bundle import rfc3339_ms
from remediator.evidence.fetch import ExporterEvidence
from remediator.evidence.report import render
from remediator.evidence.store import (
    ConfigMapEvidenceStore,
    EvidenceStore,
    EvidenceStoreError,
    S3EvidenceStore,
    latest,
    s3_client,
)
from remediator.executors.kubernetes import TLS_CLOSE_GRACE_SECONDS, KubernetesCluster

EXIT_NOT_FOUND = 1
EXIT_USAGE = 2


class EvidenceUsageError(Exception):
    """Bad command line: message to stderr, exit 2."""


def parser(prog: str = "accel-health evidence") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Print the newest evidence captured for NODE before accel-health acted on it: the "
        "alerts, each GPU's serial, UUID, part number and VBIOS, driver and CUDA, the fault's kernel-log "
        "lines with their times, the checks, the decisions and the timeline.",
    )
    p.add_argument("node", metavar="NODE", help="the node's name (its Node object may be gone)")
    p.add_argument("--kubeconfig", type=Path, help="kubeconfig file (default: as client-go finds one)")
    p.add_argument("--context", help="kubeconfig context (default: the current one)")
    p.add_argument(
        "--namespace", default="accel-health", help="the remediator's namespace (default accel-health)"
    )
    p.add_argument("--bucket", help="read from this S3 bucket (the remediator's --evidence-bucket)")
    p.add_argument(
        "--prefix",
        default="accel-health/evidence",
        help="key prefix in the bucket (default accel-health/evidence)",
    )
    p.add_argument("--region", help="AWS region of the bucket (default: from the environment)")
    p.add_argument("--endpoint-url", help="S3 endpoint override (VPC endpoints, local test servers)")
    p.add_argument(
        "--live",
        metavar="URL",
        help="fetch the node's evidence now from this exporter URL (e.g. http://127.0.0.1:9835/evidence "
        "through kubectl port-forward) instead of a stored capture",
    )
    p.add_argument("--token-file", type=Path, help="with --live: the checks token the exporter requires")
    p.add_argument("--json", action="store_true", help="print the stored JSON document")
    return p


async def _from_store(store: EvidenceStore, node: str) -> tuple[str, dict[str, Any]] | None:
    found = await latest(store, node)
    if found is None:
        return None
    item, body = found
    try:
        doc = json.loads(body)
    except ValueError as exc:
        raise EvidenceStoreError(f"{item.location} does not hold JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise EvidenceStoreError(f"{item.location} does not hold a JSON object")
    return item.location, doc


async def _live(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    url = str(args.live)

    async def endpoint(_node: str) -> str:
        return url

    fetched = await ExporterEvidence(endpoint=endpoint, token_file=args.token_file).fetch(args.node)
    if not fetched.ok:
        raise EvidenceStoreError(f"{url}: {fetched.error}")
    doc = {
        "node": args.node,
        "captured_at": rfc3339_ms(time.time()),
        "fetch": fetched.as_json(),
        "node_evidence": fetched.document,
        "notes": ["fetched live from the exporter; not stored"],
    }
    return f"{url} (live, not stored)", doc


async def _kubernetes(args: argparse.Namespace) -> tuple[str, dict[str, Any]] | None:
    try:
        found = await KubernetesCluster.configuration(kubeconfig=args.kubeconfig, context=args.context)
    except ValueError as exc:
        raise EvidenceUsageError(f"{exc} (pass --kubeconfig, or --bucket to read from S3)") from exc
    api = k8s.ApiClient(found.configuration)
    try:
        store = ConfigMapEvidenceStore(core=k8s.CoreV1Api(api), namespace=args.namespace, clock=time.time)
        return await _from_store(store, args.node)
    finally:
        await api.close()  # type: ignore[no-untyped-call]  # untyped upstream
        await asyncio.sleep(TLS_CLOSE_GRACE_SECONDS)  # TLS connections close their sockets


async def _find(args: argparse.Namespace) -> tuple[str, dict[str, Any]] | None:
    if args.live:
        return await _live(args)
    if args.bucket:
        try:
            store = S3EvidenceStore(
                bucket=args.bucket,
                prefix=args.prefix,
                client=s3_client(region=args.region, endpoint_url=args.endpoint_url),
            )
        except ValueError as exc:
            raise EvidenceUsageError(str(exc)) from exc
        return await _from_store(store, args.node)
    return await _kubernetes(args)


def main(
    argv: Sequence[str] | None = None, *, out: TextIO | None = None, prog: str = "accel-health evidence"
) -> int:
    """The command; its exit status (0 printed, 1 nothing found or unreadable, 2 bad usage)."""
    out = out or sys.stdout
    try:
        args = parser(prog).parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    where = (
        f"s3://{args.bucket}/{args.prefix.strip('/')}/{args.node}/"
        if args.bucket
        else f"ConfigMaps in namespace {args.namespace}"
    )
    try:
        found = asyncio.run(_find(args))
    except EvidenceUsageError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except EvidenceStoreError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return EXIT_NOT_FOUND
    if found is None:
        print(f"{prog}: no evidence stored for node {args.node} ({where})", file=sys.stderr)
        return EXIT_NOT_FOUND
    location, doc = found
    if args.json:
        out.write(json.dumps(doc, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
    else:
        out.write(render(doc, location=location))
    return 0
