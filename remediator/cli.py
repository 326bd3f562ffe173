"""`accel-health-remediator [serve] ...` and `accel-health-remediator explain ...`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from aiohttp import web

from remediator.app import create_app
from remediator.engine import AlertPlan, Engine, EngineSettings
from remediator.executors.snapshot import RecordingAws, SnapshotCluster, SnapshotError
from remediator.payload import PayloadError, parse_body
from remediator.policy import Policy, PolicyError, load_policy

DEFAULT_LISTEN = "0.0.0.0:9836"
EXIT_USAGE = 2
logger = logging.getLogger("remediator")


class UsageError(Exception):
    """Bad command line or start-up configuration: message to stderr, exit 2."""


def _listen(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {value!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, help="policy YAML (default: the shipped default policy)")
    parser.add_argument(
        "--cluster-snapshot",
        type=Path,
        help="output of `kubectl get nodes,pods,poddisruptionbudgets -A -o yaml`; acted on in memory only",
    )
    parser.add_argument("--node-label", default="node", help="alert label naming the node (default: node)")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def _serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="accel-health-remediator serve",
        description="Alertmanager webhook that turns alerts into node actions.",
    )
    _common(parser)
    parser.add_argument("--dry-run", action="store_true", help="decide and record, change nothing")
    parser.add_argument(
        "--listen", type=_listen, default=_listen(DEFAULT_LISTEN), help=f"default {DEFAULT_LISTEN}"
    )
    auth = parser.add_mutually_exclusive_group()
    auth.add_argument("--token-file", type=Path, help="file holding the bearer token Alertmanager sends")
    auth.add_argument("--insecure-no-auth", action="store_true", help="accept unauthenticated webhooks")
    return parser


def _explain_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="accel-health-remediator explain",
        description="Print what the remediator would do with a webhook payload against a cluster snapshot.",
    )
    _common(parser)
    parser.add_argument("--alerts", type=Path, required=True, help="Alertmanager webhook v4 payload (JSON)")
    return parser


def _load(config: Path | None, snapshot: Path | None) -> tuple[Policy, SnapshotCluster]:
    try:
        policy = load_policy(config)
    except PolicyError as exc:
        raise UsageError(str(exc)) from exc
    if snapshot is None:
        raise UsageError(
            "--cluster-snapshot is required: only the in-memory snapshot backend exists yet "
            "(the Kubernetes backend comes in a later release)"
        )
    try:
        cluster = SnapshotCluster.from_file(snapshot)
    except SnapshotError as exc:
        raise UsageError(str(exc)) from exc
    return policy, cluster


def _read_token(path: Path) -> str:
    try:
        token = path.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise UsageError(f"cannot read --token-file {path}: {exc.strerror or exc}") from exc
    if not token:
        raise UsageError(f"--token-file {path} is empty")
    return token


def serve(argv: Sequence[str]) -> int:
    args = _serve_parser().parse_args(argv)
    _configure_logging(args.log_level)
    if args.token_file is None and not args.insecure_no_auth:
        raise UsageError(
            "refusing to start without authentication: pass --token-file FILE (the bearer token Alertmanager "
            "sends) or, for local experiments only, --insecure-no-auth"
        )
    token = _read_token(args.token_file) if args.token_file is not None else None
    policy, cluster = _load(args.config, args.cluster_snapshot)
    engine = Engine(
        policy=policy,
        cluster=cluster,
        aws=RecordingAws(),
        settings=EngineSettings(dry_run=args.dry_run, node_label=args.node_label),
        clock=time.time,
    )
    app = create_app(engine=engine, token=token)
    host, port = args.listen
    suffix = " (dry-run)" if args.dry_run else ""
    if token is None:
        logger.warning("authentication disabled (--insecure-no-auth): anyone who can reach the port can act")
    logger.info(
        "cluster backend: snapshot %s (in memory; nothing outside this process changes)", cluster.source
    )

    def started(_message: str) -> None:
        logger.info("listening on %s:%d%s", host, port, suffix)

    web.run_app(app, host=host, port=port, print=started, access_log=None, handle_signals=True)
    return 0


def _format_plan(plans: Sequence[AlertPlan], out: TextIO) -> None:
    for plan in plans:
        alert = plan.alert
        name = alert.labels.get("alertname", "<no alertname>")
        print(
            f"alert {name} ({alert.status}) on node {plan.node or '-'}, fingerprint {alert.fingerprint}",
            file=out,
        )
        for note in plan.notes:
            print(f"  {note}", file=out)
        for record in plan.records:
            gate = f" [gate {record.gate}]" if record.gate else ""
            print(f"  -> {record.action}: {record.outcome}{gate}: {record.reason}", file=out)
            if record.action == "drain":
                for key, title in (("evict", "evict"), ("skip", "skip"), ("blocked", "blocked")):
                    for pod in record.details.get(key, []):
                        extra = pod.get("owner") if key == "evict" else pod.get("reason")
                        print(
                            f"       {title:7} {pod['namespace']}/{pod['name']}  ({extra or 'no owner'})",
                            file=out,
                        )
        print(file=out)


def explain(argv: Sequence[str], *, out: TextIO) -> int:
    args = _explain_parser().parse_args(argv)
    _configure_logging("warning" if args.log_level == "info" else args.log_level)
    policy, cluster = _load(args.config, args.cluster_snapshot)
    try:
        payload = parse_body(args.alerts.read_bytes())
    except OSError as exc:
        raise UsageError(f"cannot read --alerts {args.alerts}: {exc.strerror or exc}") from exc
    except PayloadError as exc:
        raise UsageError(f"{args.alerts}: {exc}") from exc
    engine = Engine(
        policy=policy,
        cluster=cluster,
        aws=RecordingAws(),
        settings=EngineSettings(dry_run=True, node_label=args.node_label),
        clock=time.time,
    )
    plans = asyncio.run(engine.handle(payload))
    print(
        f"policy: {policy.source}; cluster snapshot: {cluster.source}; dry-run (nothing is changed)", file=out
    )
    print(file=out)
    _format_plan(plans, out)
    return 0


def _configure_logging(level: str) -> None:
    logging.basicConfig(
        stream=sys.stderr, level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        if args and args[0] == "explain":
            return explain(args[1:], out=sys.stdout)
        if args and args[0] == "serve":
            args = args[1:]
        return serve(args)
    except UsageError as exc:
        print(f"accel-health-remediator: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
