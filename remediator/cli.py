"""`accel-health-remediator [serve] ...` (the service), and the operator's commands it also answers
(`accel-health` is their home: remediator/fleet_cli.py): `status`, `explain`, `holds` (the nodes held,
what `status` grew from), `evidence NODE`."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import ssl
import sys
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any, TextIO

import aiohttp
from aiohttp import web
from kubernetes.aio import client as k8s

from remediator import leader
from remediator.cluster import Aws, BackendUnavailable, Cluster, Node
from remediator.desired.alertmanager import (
    DEFAULT_INTERVAL_SECONDS,
    AlertmanagerClient,
    AlertmanagerPoller,
    AlertmanagerSettings,
)
from remediator.evidence import cli as evidence_cli
from remediator.evidence.fetch import ExporterEvidence
from remediator.evidence.store import (
    ConfigMapEvidenceStore,
    EvidenceRetention,
    EvidenceStore,
    MemoryEvidenceStore,
    S3EvidenceStore,
    s3_client,
)
from remediator.executors.kubernetes import TLS_CLOSE_GRACE_SECONDS, KubernetesCluster, KubernetesSettings
from remediator.executors.kubernetes import api as kubernetes_api
from remediator.executors.snapshot import AwsOff, RecordingAws, SnapshotCluster, SnapshotError
from remediator.intake.app import ENGINE, MAX_BODY_BYTES, create_app
from remediator.intake.payload import PayloadError, parse_body
from remediator.lifecycle import repairservice
from remediator.lifecycle.engine import Engine
from remediator.lifecycle.holds import as_json as holds_json
from remediator.lifecycle.holds import as_text as holds_text
from remediator.lifecycle.holds import held_nodes
from remediator.lifecycle.model import AlertPlan, EngineSettings
from remediator.lifecycle.repair import ExporterChecks, exporter_pod_endpoint, url_template_endpoint
from remediator.lifecycle.status import as_json as status_json
from remediator.lifecycle.status import as_text as status_text
from remediator.lifecycle.status import node_statuses
from remediator.policy import Policy, PolicyError, load_policy

DEFAULT_LISTEN = "0.0.0.0:9836"
DEFAULT_EVIDENCE_PREFIX = "accel-health/evidence"
EXIT_USAGE = 2
DEFAULT_LEASE_SECONDS = 15
NODE_CACHE_WAIT_SECONDS = 60
MIN_LEASE_SECONDS = 3
"""The library's timing checks need renew deadline (2/3 of it) > 1.2 x retry period (at least 1 s)."""
logger = logging.getLogger("remediator")


class UsageError(Exception):
    """Bad command line or start-up configuration: message to stderr, exit 2."""


def _listen(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {value!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


def _lease_seconds(value: str) -> int:
    """--lease-duration: whole seconds, as Lease.spec.leaseDurationSeconds is."""
    try:
        seconds = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of seconds, got {value!r}") from None
    if seconds < MIN_LEASE_SECONDS:
        raise argparse.ArgumentTypeError(f"must be at least {MIN_LEASE_SECONDS} seconds, got {seconds}")
    return seconds


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
    parser.add_argument("--token-file", type=Path, help="file holding the bearer token Alertmanager sends")
    parser.add_argument(
        "--basic-auth-file",
        type=Path,
        help="file holding USER:PASSWORD for HTTP basic auth (Alertmanager http_config.basic_auth)",
    )
    parser.add_argument("--insecure-no-auth", action="store_true", help="accept unauthenticated webhooks")
    parser.add_argument("--tls-cert-file", type=Path, help="serve HTTPS with this certificate (PEM chain)")
    parser.add_argument("--tls-key-file", type=Path, help="private key of --tls-cert-file (PEM)")
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=MAX_BODY_BYTES,
        help=f"largest webhook body accepted, bytes (default {MAX_BODY_BYTES}); larger ones get 413",
    )
    parser.add_argument(
        "--paused",
        action="store_true",
        help="start with remediation paused (kept in the gate state until POST /resume)",
    )
    kube = parser.add_argument_group("Kubernetes (used unless --cluster-snapshot is given)")
    where = kube.add_mutually_exclusive_group()
    where.add_argument(
        "--kubeconfig",
        type=Path,
        help="kubeconfig file (default, as client-go: $KUBECONFIG, else the pod's service account when "
        "run in a pod, else ~/.kube/config)",
    )
    where.add_argument(
        "--in-cluster", action="store_true", help="use the pod's service account and nothing else"
    )
    kube.add_argument("--context", help="kubeconfig context (default: the current one)")
    kube.add_argument(
        "--no-leader-election",
        dest="leader_election",
        action="store_false",
        help="act without holding the Lease (only when exactly one replica runs)",
    )
    kube.add_argument(
        "--leader-election-namespace",
        help="namespace of the leader Lease (default: the pod's namespace, $POD_NAMESPACE, or default)",
    )
    kube.add_argument("--lease-name", default="accel-health-remediator", help="leader Lease name")
    kube.add_argument(
        "--lease-duration",
        type=_lease_seconds,
        default=DEFAULT_LEASE_SECONDS,
        help=f"whole seconds before a dead leader is replaced, at least {MIN_LEASE_SECONDS} "
        f"(default {DEFAULT_LEASE_SECONDS}; renewals every 2/15 of it, at least 1 s)",
    )
    repair = parser.add_argument_group("repair loop (the policy's `repair:` section says what it does)")
    repair.add_argument(
        "--repair-checks-url",
        metavar="TEMPLATE",
        help="URL of a node's checks endpoint, {node} replaced by the node name (default: the "
        "exporter pod on the node, http://<pod IP>:9835/checks)",
    )
    repair.add_argument(
        "--repair-checks-token-file",
        type=Path,
        help="bearer token of the exporters' GET /checks, read at every verification (may be set later)",
    )
    am = parser.add_argument_group(
        "Alertmanager API (the alerts firing now; without it, the webhook deliveries with their expiry)"
    )
    am.add_argument(
        "--alertmanager-url",
        action="append",
        default=[],
        metavar="URL",
        help="Alertmanager base URL, e.g. http://alertmanager:9093; one per member of an HA cluster, "
        "repeated or comma-separated in one value (one setting a Deployment fills from a ConfigMap)",
    )
    am.add_argument(
        "--alertmanager-receiver",
        default="",
        help="only alerts routed to receivers matching this regex (default: every alert)",
    )
    am.add_argument("--alertmanager-bearer-token-file", type=Path, help="bearer token for the API")
    am.add_argument("--alertmanager-basic-auth-file", type=Path, help="USER:PASSWORD for the API")
    am.add_argument("--alertmanager-ca-file", type=Path, help="CA bundle for https Alertmanager URLs")
    am.add_argument(
        "--alertmanager-interval",
        type=float,
        default=DEFAULT_INTERVAL_SECONDS,
        help=f"seconds between two reads while leading (default {DEFAULT_INTERVAL_SECONDS:g})",
    )
    aws = parser.add_argument_group(
        "AWS (without --aws, AWS actions are skipped, saying so; in dry-run or on a snapshot, recorded)"
    )
    aws.add_argument("--aws", action="store_true", help="call Auto Scaling and CloudWatch for AWS actions")
    aws.add_argument("--aws-region", help="AWS region (default: from the environment)")
    aws.add_argument(
        "--aws-endpoint-url", help="override the AWS endpoint (VPC endpoints, local test servers)"
    )
    aws.add_argument("--aws-retry-mode", choices=["standard", "adaptive"], default="standard")
    aws.add_argument("--aws-max-attempts", type=int, default=5, help="attempts per AWS call (default 5)")
    aws.add_argument(
        "--aws-respect-grace-period",
        action="store_true",
        help="SetInstanceHealth waits for the group's health-check grace period (default: replace at once)",
    )
    aws.add_argument(
        "--cloudwatch-namespace", help="CloudWatch namespace for every metric (default: the policy's)"
    )
    aws.add_argument(
        "--cloudwatch-dimension",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="extra dimension on every metric, e.g. Cluster=prod-a (repeatable)",
    )
    _evidence_flags(parser)
    return parser


def _evidence_flags(parser: argparse.ArgumentParser) -> None:
    evidence = parser.add_argument_group(
        "evidence (the policy's `evidence` step: the node's evidence stored before anything disruptive; "
        "in S3 with --evidence-bucket, else in immutable ConfigMaps in the remediator's namespace)"
    )
    evidence.add_argument("--evidence-bucket", help="S3 bucket for captures (default: ConfigMaps)")
    evidence.add_argument(
        "--evidence-prefix",
        default=DEFAULT_EVIDENCE_PREFIX,
        help=f"key prefix in the bucket (default {DEFAULT_EVIDENCE_PREFIX}); "
        "keys are PREFIX/NODE/TIME-ALERT.json",
    )
    evidence.add_argument(
        "--evidence-url",
        metavar="TEMPLATE",
        help="URL of a node's evidence, {node} replaced by the node name (default: the exporter pod on "
        "the node, http://<pod IP>:9835/evidence)",
    )
    evidence.add_argument(
        "--evidence-token-file",
        type=Path,
        help="bearer token of the exporters' GET /evidence (default: --repair-checks-token-file, the "
        "checks token), read at every capture",
    )
    evidence.add_argument(
        "--evidence-keep-per-node",
        type=int,
        default=EvidenceRetention.per_node,
        help=f"ConfigMaps: newest captures kept per node (default {EvidenceRetention.per_node})",
    )
    evidence.add_argument(
        "--evidence-keep-total",
        type=int,
        default=EvidenceRetention.total,
        help=f"ConfigMaps: newest captures kept in all (default {EvidenceRetention.total})",
    )
    evidence.add_argument(
        "--evidence-retention-days",
        type=float,
        default=EvidenceRetention.max_age_seconds / 86400,
        help="ConfigMaps: captures older than this are deleted (default 30); in S3 the bucket's "
        "lifecycle rules decide",
    )


def _holds_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="accel-health-remediator holds",
        description="List the nodes accel-health holds, from the nodes alone (their records): since when, "
        "what of its is on each, and per alert episode the steps done and the next one.",
    )
    parser.add_argument("--config", type=Path, help="policy YAML (default: the shipped default policy)")
    parser.add_argument("--kubeconfig", type=Path, help="kubeconfig file (default: as client-go finds one)")
    parser.add_argument("--context", help="kubeconfig context (default: the current one)")
    parser.add_argument("--cluster-snapshot", type=Path, help="read the nodes from this snapshot instead")
    parser.add_argument("--json", action="store_true", help="JSON, one key per node")
    return parser


async def _read_nodes(args: argparse.Namespace) -> list[Node]:
    try:
        found = await KubernetesCluster.configuration(kubeconfig=args.kubeconfig, context=args.context)
    except ValueError as exc:
        raise UsageError(f"{exc} (pass --kubeconfig or --cluster-snapshot FILE)") from exc
    cluster = KubernetesCluster(api=k8s.ApiClient(found.configuration))
    try:
        return await cluster.list_nodes()
    except BackendUnavailable as exc:
        raise UsageError(f"cannot list the nodes: {exc}") from exc
    finally:
        await cluster.close()
        # The event loop ends with this command: give the TLS connections just closed the moment
        # they need to close their sockets (else they are left to the garbage collector).
        await asyncio.sleep(TLS_CLOSE_GRACE_SECONDS)


def holds(argv: Sequence[str], *, out: TextIO) -> int:
    args = _holds_parser().parse_args(argv)
    policy = _load_policy(args.config)
    if args.cluster_snapshot is not None:
        _, snapshot = _load(args.config, args.cluster_snapshot)
        nodes = list(snapshot.nodes.values())
    else:
        nodes = asyncio.run(_read_nodes(args))
    held = held_nodes(nodes, policy)
    if args.json:
        print(json.dumps(holds_json(held), indent=2, sort_keys=True), file=out)
    else:
        print(holds_text(held), end="", file=out)
    return 0


def _status_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Where each node is in its remediation, from the nodes alone (their records): its "
        "phase and since when, its alerts, the next step and what it waits on. With --remediator, what "
        "only the running remediator knows (an action deferred by the budget, the storm breaker or the "
        "pause) is added.",
    )
    parser.add_argument("--config", type=Path, help="policy YAML (default: the shipped default policy)")
    parser.add_argument("--kubeconfig", type=Path, help="kubeconfig file (default: as client-go finds one)")
    parser.add_argument("--context", help="kubeconfig context (default: the current one)")
    parser.add_argument("--cluster-snapshot", type=Path, help="read the nodes from this snapshot instead")
    parser.add_argument(
        "--remediator",
        metavar="URL",
        help="the remediator's base URL (e.g. a port-forward, http://127.0.0.1:9836): its deferred actions",
    )
    parser.add_argument("--token-file", type=Path, help="the remediator's bearer token (with --remediator)")
    parser.add_argument("--json", action="store_true", help="JSON, one key per node")
    return parser


async def _deferred_from(url: str, token_file: Path | None) -> dict[str, str]:
    """node -> why its next step waits, from a running remediator's GET /state."""
    headers = {"Authorization": f"Bearer {_read_token(token_file)}"} if token_file is not None else {}
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session,
            session.get(url.rstrip("/") + "/state", headers=headers) as response,
        ):
            if response.status != 200:
                raise UsageError(f"{url}/state answered {response.status}: {(await response.text())[:200]}")
            state = await response.json()
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        raise UsageError(f"cannot read {url}/state: {exc}") from exc
    out: dict[str, str] = {}
    for pending in state.get("pending", []) if isinstance(state, dict) else []:
        node = pending.get("node") if isinstance(pending, dict) else None
        if isinstance(node, str) and node not in out:
            out[node] = f"gate {pending.get('gate')}: {pending.get('reason')}"
    return out


def status(argv: Sequence[str], *, out: TextIO, prog: str = "accel-health status") -> int:
    """Print where each node is in its remediation (see `_status_parser`)."""
    args = _status_parser(prog).parse_args(argv)
    policy = _load_policy(args.config)
    if args.cluster_snapshot is not None:
        _, snapshot = _load(args.config, args.cluster_snapshot)
        nodes = list(snapshot.nodes.values())
    else:
        nodes = asyncio.run(_read_nodes(args))
    deferred = asyncio.run(_deferred_from(args.remediator, args.token_file)) if args.remediator else {}
    statuses = node_statuses(nodes, policy, deferred=deferred)
    if args.json:
        print(json.dumps(status_json(statuses), indent=2, sort_keys=True), file=out)
    else:
        print(status_text(statuses), end="", file=out)
    return 0


def _explain_parser(prog: str = "accel-health-remediator explain") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Print what the remediator would do with a webhook payload against a cluster snapshot.",
    )
    _common(parser)
    parser.add_argument("--alerts", type=Path, required=True, help="Alertmanager webhook v4 payload (JSON)")
    return parser


def _load_policy(config: Path | None) -> Policy:
    try:
        return load_policy(config)
    except PolicyError as exc:
        raise UsageError(str(exc)) from exc


def _load(config: Path | None, snapshot: Path | None) -> tuple[Policy, SnapshotCluster]:
    policy = _load_policy(config)
    if snapshot is None:
        raise UsageError("--cluster-snapshot is required here")
    try:
        cluster = SnapshotCluster.from_file(snapshot)
    except SnapshotError as exc:
        raise UsageError(str(exc)) from exc
    return policy, cluster


def _aws(args: argparse.Namespace, *, acts: bool) -> Aws:
    """The AWS seam: boto3 with --aws; without it, a service on a real cluster (enforcing or dry-run)
    calls nothing and says so (AWS actions skipped, never reported done, a dry run saying it would
    skip them); a cluster snapshot records what would have been called."""
    if not args.aws:
        return AwsOff() if acts else RecordingAws()
    dims = {}
    for item in args.cloudwatch_dimension:
        name, sep, value = item.partition("=")
        if not sep or not name or not value:
            raise UsageError(f"--cloudwatch-dimension expects NAME=VALUE, got {item!r}")
        dims[name] = value
    if args.aws_max_attempts < 1:
        raise UsageError("--aws-max-attempts must be at least 1")
    # boto3 is imported only by a service that calls AWS (about 8 MiB of memory otherwise spent).
    from remediator.executors.aws import AwsExecutor, AwsSettings  # noqa: PLC0415  see above

    return AwsExecutor(
        settings=AwsSettings(
            region=args.aws_region,
            endpoint_url=args.aws_endpoint_url,
            retry_mode=args.aws_retry_mode,
            max_attempts=args.aws_max_attempts,
            respect_grace_period=args.aws_respect_grace_period,
            namespace=args.cloudwatch_namespace,
            extra_dimensions=dims,
        )
    )


def alertmanager_urls(values: list[str]) -> tuple[str, ...]:
    """The `--alertmanager-url` values as URLs: each value one URL or a comma-separated list of them
    (blanks around commas ignored), the first of each URL kept, in order."""
    urls: list[str] = []
    for value in values:
        for part in value.split(","):
            url = part.strip()
            if not url.startswith(("http://", "https://")):
                raise UsageError(f"--alertmanager-url expects http:// or https:// URLs, got {part!r}")
            if url not in urls:
                urls.append(url)
    return tuple(urls)


def _alertmanager(args: argparse.Namespace) -> AlertmanagerSettings | None:
    if not args.alertmanager_url:
        return None
    urls = alertmanager_urls(args.alertmanager_url)
    if args.alertmanager_interval < 1:
        raise UsageError(
            f"--alertmanager-interval must be at least 1 second, got {args.alertmanager_interval}"
        )
    if args.alertmanager_bearer_token_file is not None and args.alertmanager_basic_auth_file is not None:
        raise UsageError(
            "--alertmanager-bearer-token-file and --alertmanager-basic-auth-file exclude each other"
        )
    token = basic = None
    if args.alertmanager_bearer_token_file is not None:
        token = _read_token(args.alertmanager_bearer_token_file, flag="--alertmanager-bearer-token-file")
    if args.alertmanager_basic_auth_file is not None:
        basic = _read_basic_auth(args.alertmanager_basic_auth_file, flag="--alertmanager-basic-auth-file")
    if args.alertmanager_ca_file is not None and not args.alertmanager_ca_file.is_file():
        raise UsageError(f"--alertmanager-ca-file {args.alertmanager_ca_file}: no such file")
    return AlertmanagerSettings(
        urls=urls,
        receiver=args.alertmanager_receiver,
        bearer_token=token,
        basic_auth=basic,
        ca_file=args.alertmanager_ca_file,
        interval_seconds=args.alertmanager_interval,
    )


def _evidence_retention(args: argparse.Namespace) -> EvidenceRetention:
    try:
        return EvidenceRetention(
            per_node=args.evidence_keep_per_node,
            total=args.evidence_keep_total,
            max_age_seconds=args.evidence_retention_days * 86400,
        )
    except ValueError as exc:
        raise UsageError(
            f"--evidence-keep-per-node/--evidence-keep-total/--evidence-retention-days: {exc}"
        ) from exc


def _evidence_store(
    args: argparse.Namespace, cluster: Cluster, *, leading: Callable[[], bool]
) -> EvidenceStore:
    """S3 with --evidence-bucket; else ConfigMaps in the remediator's namespace on a real cluster, or
    this process's memory on a cluster snapshot."""
    retention = _evidence_retention(args)
    if args.evidence_bucket:
        try:
            return S3EvidenceStore(
                bucket=args.evidence_bucket,
                prefix=args.evidence_prefix,
                client=s3_client(region=args.aws_region, endpoint_url=args.aws_endpoint_url),
            )
        except ValueError as exc:
            raise UsageError(f"--evidence-bucket: {exc}") from exc
    if isinstance(cluster, KubernetesCluster):
        return ConfigMapEvidenceStore(
            core=k8s.CoreV1Api(cluster.api),
            namespace=cluster.settings.state_namespace,
            retention=retention,
            manager=cluster.settings.manager,
            should_act=leading,
            clock=time.time,
        )
    return MemoryEvidenceStore(per_node=retention.per_node)


def _lease_namespace(args: argparse.Namespace) -> str:
    if args.leader_election_namespace:
        return str(args.leader_election_namespace)
    if os.environ.get("POD_NAMESPACE"):
        return os.environ["POD_NAMESPACE"]
    try:
        namespace_file = kubernetes_api.SERVICE_ACCOUNT_DIR / "namespace"
        return namespace_file.read_text(encoding="utf-8").strip() or "default"
    except OSError:
        return "default"


def _service_app(
    args: argparse.Namespace,
    *,
    policy: Policy,
    cluster: Cluster,
    token: str | None,
    basic: tuple[str, str] | None,
    leading: Callable[[], bool] = lambda: True,
) -> web.Application:
    """The engine over ``cluster`` and its aiohttp service, with the intake settings, --paused, the
    Alertmanager poller (reading only while `leading()` and the gate state is read), the evidence
    fetcher and store, and the repair loop (on the leader only)."""
    engine = Engine(
        policy=policy,
        cluster=cluster,
        # A dry run on a real cluster says what the same service would do when it enforces: without
        # --aws that is nothing on AWS, so it gets the same seam (AWS steps skipped, saying why).
        aws=_aws(args, acts=not isinstance(cluster, SnapshotCluster)),
        settings=EngineSettings(dry_run=args.dry_run, node_label=args.node_label),
        clock=time.time,
        evidence_fetcher=ExporterEvidence(
            endpoint=(
                url_template_endpoint(args.evidence_url)
                if args.evidence_url
                else exporter_pod_endpoint(cluster, path="/evidence")
            ),
            token_file=args.evidence_token_file or args.repair_checks_token_file,
        ),
        evidence_store=_evidence_store(args, cluster, leading=leading),
    )
    am_settings = _alertmanager(args)
    poller = None
    if am_settings is not None:
        poller = AlertmanagerPoller(
            client=AlertmanagerClient(am_settings),
            reconcile=engine.reconcile,
            ready=lambda: leading() and engine.synced,
        )
        engine.alertmanager = poller.client.fetch  # a new leader's one read before it is ready
        logger.info("desired state: Alertmanager API at %s", ", ".join(am_settings.urls))
    app = create_app(
        engine=engine,
        token=token,
        basic_auth=basic,
        max_body_bytes=args.max_body_bytes,
        alertmanager=poller,
    )
    if args.paused:

        async def start_paused(_app: web.Application) -> None:
            await engine.set_paused(True, "started with --paused")

        app.on_startup.append(start_paused)
    endpoint = (
        url_template_endpoint(args.repair_checks_url)
        if args.repair_checks_url
        else exporter_pod_endpoint(cluster)
    )
    verifier = ExporterChecks(
        endpoint=endpoint,
        token_file=args.repair_checks_token_file,
        timeout_seconds=policy.repair.check_timeout_seconds,
    )
    repairservice.install(app, cluster=cluster, verifier=verifier, should_run=leading)
    return app


async def _kubernetes_app(
    args: argparse.Namespace, policy: Policy, *, token: str | None, basic: tuple[str, str] | None
) -> web.Application:
    """The service over the Kubernetes executor (and leader election), built inside the event loop."""
    try:
        found = await KubernetesCluster.configuration(
            kubeconfig=args.kubeconfig, context=args.context, in_cluster=args.in_cluster
        )
    except ValueError as exc:
        raise UsageError(f"{exc} (pass --kubeconfig, --in-cluster, or --cluster-snapshot FILE)") from exc
    cfg = found.configuration
    logger.info("Kubernetes credentials: %s", found.source)
    api = k8s.ApiClient(cfg)
    elector: leader.LeaderElector | None = None
    if args.leader_election:
        elector = leader.LeaderElector(
            api=api,
            settings=leader.LeaderSettings.from_lease_duration(
                args.lease_duration, namespace=_lease_namespace(args), lease_name=args.lease_name
            ),
        )
    active = elector
    cluster = KubernetesCluster(
        api=api,
        settings=KubernetesSettings(state_namespace=_lease_namespace(args)),
        should_act=(lambda: active.is_leader) if active else (lambda: True),
    )
    app = _service_app(
        args,
        policy=policy,
        cluster=cluster,
        token=token,
        basic=basic,
        leading=(lambda: active.is_leader) if active else (lambda: True),
    )

    async def close_client(_app: web.Application) -> AsyncIterator[None]:
        # Ready only once the node watch has its first LIST (reads go to the API until then).
        if not await cluster.start_cache(wait_seconds=NODE_CACHE_WAIT_SECONDS):
            logger.warning(
                "node cache not synced after %d s; reading nodes from the API meanwhile",
                NODE_CACHE_WAIT_SECONDS,
            )
        yield
        await cluster.close()

    app.cleanup_ctx.append(close_client)  # registered first, so it runs after the Lease is handed back
    if elector is not None:
        leader.install(app, elector, replica=app[ENGINE])
        logger.info(
            "cluster backend: Kubernetes API %s; leader election on Lease %s/%s as %s",
            cfg.host,
            elector.settings.namespace,
            elector.settings.lease_name,
            elector.settings.identity,
        )
    else:
        logger.warning("cluster backend: Kubernetes API %s; leader election disabled", cfg.host)
    return app


def _read_token(path: Path, *, flag: str = "--token-file") -> str:
    try:
        token = path.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise UsageError(f"cannot read {flag} {path}: {exc.strerror or exc}") from exc
    if not token:
        raise UsageError(f"{flag} {path} is empty")
    return token


def _read_basic_auth(path: Path, *, flag: str = "--basic-auth-file") -> tuple[str, str]:
    text = _read_token(path, flag=flag)
    user, sep, password = text.partition(":")
    if not sep or not user or not password:
        raise UsageError(f"{flag} {path}: expected USER:PASSWORD on one line")
    return user, password


def _tls_context(cert: Path | None, key: Path | None) -> ssl.SSLContext | None:
    if cert is None and key is None:
        return None
    if cert is None or key is None:
        raise UsageError("--tls-cert-file and --tls-key-file go together")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(certfile=cert, keyfile=key)
    except (OSError, ssl.SSLError) as exc:
        raise UsageError(f"cannot load --tls-cert-file {cert} / --tls-key-file {key}: {exc}") from exc
    return context


def serve(argv: Sequence[str]) -> int:
    args = _serve_parser().parse_args(argv)
    _configure_logging(args.log_level)
    has_auth = args.token_file is not None or args.basic_auth_file is not None
    if has_auth and args.insecure_no_auth:
        raise UsageError("--insecure-no-auth contradicts --token-file / --basic-auth-file")
    if not has_auth and not args.insecure_no_auth:
        raise UsageError(
            "refusing to start without authentication: pass --token-file FILE (the bearer token Alertmanager "
            "sends) or --basic-auth-file FILE or, for local experiments only, --insecure-no-auth"
        )
    if args.max_body_bytes < 1024:
        raise UsageError(f"--max-body-bytes must be at least 1024, got {args.max_body_bytes}")
    token = _read_token(args.token_file) if args.token_file is not None else None
    basic = _read_basic_auth(args.basic_auth_file) if args.basic_auth_file is not None else None
    tls = _tls_context(args.tls_cert_file, args.tls_key_file)
    app: web.Application | Coroutine[Any, Any, web.Application]
    if args.cluster_snapshot is not None:
        policy, cluster = _load(args.config, args.cluster_snapshot)
        app = _service_app(args, policy=policy, cluster=cluster, token=token, basic=basic)
        logger.info(
            "cluster backend: snapshot %s (in memory; nothing outside this process changes)", cluster.source
        )
    else:
        # Built inside run_app's event loop: the Kubernetes client needs one.
        app = _kubernetes_app(args, _load_policy(args.config), token=token, basic=basic)
    if not args.aws:
        logger.info("AWS actions are recorded, not called (pass --aws to call AWS)")
    host, port = args.listen
    suffix = " (dry-run)" if args.dry_run else ""
    suffix += " (https)" if tls is not None else ""
    if not has_auth:
        logger.warning("authentication disabled (--insecure-no-auth): anyone who can reach the port can act")

    def started(_message: str) -> None:
        logger.info("listening on %s:%d%s", host, port, suffix)

    web.run_app(
        app, host=host, port=port, ssl_context=tls, print=started, access_log=None, handle_signals=True
    )
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


def explain(argv: Sequence[str], *, out: TextIO, prog: str = "accel-health-remediator explain") -> int:
    args = _explain_parser(prog).parse_args(argv)
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
    status = engine.status()
    print(
        f"gates afterwards: budget {status.budget_in_use} of {status.budget_capacity} nodes; "
        f"{status.breaker}; {'PAUSED' if status.paused else 'not paused'}",
        file=out,
    )
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
        if args and args[0] == "holds":
            return holds(args[1:], out=sys.stdout)
        if args and args[0] == "status":
            return status(args[1:], out=sys.stdout, prog="accel-health-remediator status")
        if args and args[0] == "evidence":
            return evidence_cli.main(args[1:], out=sys.stdout, prog="accel-health-remediator evidence")
        if args and args[0] == "serve":
            args = args[1:]
        return serve(args)
    except UsageError as exc:
        print(f"accel-health-remediator: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
