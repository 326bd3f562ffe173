"""``accel-health-exporter``: serves /metrics (and its two halves, /metrics/fast and /metrics/slow,
see :mod:`exporter.paths`) and /healthz for one node, active checks on ``GET /checks`` (with
``--checks``; see :mod:`exporter.checks`), and this boot's evidence on ``GET /evidence`` (fault lines,
device identity, latest check results; see :mod:`exporter.evidence`) behind the checks' bearer token.

Stops cleanly (exit 0) on SIGTERM or SIGINT. :func:`main`'s ``nvml_library`` and ``cuda_library`` stand
in for the ``pynvml`` module and ``cuda.bindings.driver`` (the demo's simulated GPU node,
``examples/fake_gpus.py``); None, the default, loads the real ones.
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import ipaddress
import logging
import os
import shutil
import signal
import threading
from collections.abc import Callable, Mapping, Sequence
from http import HTTPStatus
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from exporter.auth import BearerToken
from exporter.collectors.boot import BootCollector
from exporter.collectors.framework import Source, SourcesCollector
from exporter.evidence import EvidenceEndpoint, EvidenceSources, EvidenceStore, check_summary
from exporter.exposition import CONTENT_TYPE, generate_text
from exporter.metric import CollectorRegistry
from exporter.paths import FAST_INFINIBAND_COUNTERS, PathCollector
from exporter.privileges import settle
from exporter.readers.kmsg import KmsgFollower, KmsgStateStore
from exporter.readers.nvml import DEFAULT_TIMEOUT, PynvmlReader
from exporter.rises import CounterRises
from exporter.server import IPv6Server, Request, RequestHandler, Response, Server
from exporter.sources import ExporterSettings, build_registry, build_sources

if TYPE_CHECKING:  # the checks are imported where --checks asks for them (see _build_checks)
    from exporter.checks.endpoint import ChecksEndpoint
    from exporter.checks.runner import CheckRunner
    from exporter.checks.schedule import Scheduler

logger = logging.getLogger("exporter")

DEFAULT_LISTEN = "0.0.0.0:9835"


def parse_listen(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:9835`` for IPv6) -> (host, port)."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


def positive_seconds(text: str) -> float:
    """A positive number of seconds."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="accel-health-exporter", description="Raw accelerator and fabric health as Prometheus series."
    )
    parser.add_argument(
        "--listen", type=parse_listen, default=parse_listen(DEFAULT_LISTEN), metavar="HOST:PORT"
    )
    parser.add_argument("--kmsg", type=Path, default=Path("/dev/kmsg"), metavar="PATH")
    parser.add_argument("--sysfs-root", type=Path, default=Path("/sys"), metavar="DIR")
    parser.add_argument(
        "--state-dir",
        type=Path,
        metavar="DIR",
        help="keep kernel-log counts, InfiniBand counter readings and evidence here (a hostPath) so a "
        "restart within one boot neither loses events (overwritten in the ring buffer, or while no "
        "exporter ran) nor counts any twice",
    )
    parser.add_argument("--nvml", choices=("auto", "on", "off"), default="auto")
    parser.add_argument(
        "--nvml-timeout",
        type=positive_seconds,
        default=DEFAULT_TIMEOUT,
        metavar="SECONDS",
        help="bound on NVML calls per scrape, all GPUs together; a call still running is abandoned "
        f"and reported (default {DEFAULT_TIMEOUT:g})",
    )
    parser.add_argument(
        "--nvlink-per-link",
        action="store_true",
        help="also publish every NVLink's own state and error counters (accel_gpu_nvlink_link_up, "
        "accel_gpu_nvlink_link_errors_total: 90 series a GPU); by default NVLink is published per GPU, "
        "all links together",
    )
    checks = parser.add_argument_group("active checks")
    checks.add_argument(
        "--checks",
        type=_check_names,
        default=(),
        metavar="NAMES",
        help="checks this node offers on GET /checks and runs on a schedule: comma-separated "
        "pciebw,gpumem,remapped,power,dcgm,ping,iperf, or all (default: none)",
    )
    checks.add_argument(
        "--checks-token-file",
        type=Path,
        metavar="FILE",
        help="bearer token GET /checks and GET /evidence require (GET /evidence: with or without --checks)",
    )
    checks.add_argument(
        "--checks-insecure-no-auth",
        action="store_true",
        help="serve GET /checks and GET /evidence without a token (only for a loopback address)",
    )
    checks.add_argument(
        "--checks-schedule",
        metavar="FILE|off",
        default="",
        help="YAML with per-check interval/deadline/params/enabled (default: cheap checks hourly, "
        "invasive ones daily); `off` runs checks only on demand",
    )
    checks.add_argument(
        "--checks-node-pods",
        action="store_true",
        help="ask the Kubernetes API (in-cluster) for this node's pods: a pod requesting accelerators "
        "keeps invasive checks off the node (needs NODE_NAME and RBAC to list pods)",
    )
    checks.add_argument(
        "--checks-peers-namespace",
        default=os.environ.get("POD_NAMESPACE", "accel-health"),
        metavar="NAMESPACE",
        help="where ping/iperf find the other exporter pods (default: $POD_NAMESPACE or accel-health)",
    )
    checks.add_argument(
        "--node-name", default=os.environ.get("NODE_NAME", ""), help="this node's name (default: $NODE_NAME)"
    )
    parser.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info")
    return parser


def _check_names(text: str) -> tuple[str, ...]:
    if not text.replace(",", "").strip():  # `--checks=`: none, and nothing of the checks imported
        return ()
    from exporter.checks.catalog import parse_names  # noqa: PLC0415  only where checks are asked for

    try:
        return parse_names(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def make_handler(
    registry: CollectorRegistry,
    checks: ChecksEndpoint | None = None,
    *,
    fast: CollectorRegistry | None = None,
    slow: CollectorRegistry | None = None,
    evidence: EvidenceEndpoint | None = None,
) -> type[RequestHandler]:
    """An HTTP handler class serving ``registry`` on /metrics (``fast`` and ``slow`` on /metrics/fast
    and /metrics/slow, when given), liveness on /healthz, with ``checks`` active checks on /checks and
    with ``evidence`` this boot's evidence on /evidence."""
    registries = {"/metrics": registry, "/metrics/fast": fast, "/metrics/slow": slow}

    def json_answer(path: str, request: Request) -> Response:
        authorization = request.headers.get("authorization")
        if path == "/evidence":
            if evidence is None:
                return Response(HTTPStatus.NOT_FOUND, b"no evidence on this exporter\n")
            status, body = evidence.handle(request.query, authorization)
        else:
            if checks is None:
                return Response(HTTPStatus.NOT_FOUND, b"no checks on this node (--checks)\n")
            from exporter.checks.endpoint import encode  # noqa: PLC0415  loaded with the checks

            status, answer = checks.handle(request.query, authorization)
            body = encode(answer)
        challenge = (("WWW-Authenticate", 'Bearer realm="accel-health"'),)
        return Response(
            status, body, "application/json", challenge if status == HTTPStatus.UNAUTHORIZED else ()
        )

    class Handler(RequestHandler):
        def answer(self, request: Request) -> Response:
            path = request.path
            served = registries.get(path.rstrip("/") or path)
            if served is not None:
                return Response(HTTPStatus.OK, generate_text(served), CONTENT_TYPE)
            if path in ("/checks", "/evidence"):
                return json_answer(path, request)
            if path == "/healthz":
                return Response(HTTPStatus.OK, b"ok\n")
            return Response(HTTPStatus.NOT_FOUND, b"not found\n")

    return Handler


def main(argv: Sequence[str] | None = None, *, nvml_library: Any = None, cuda_library: Any = None) -> int:
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error argparse already reported
        return exc.code if isinstance(exc.code, int) else 2
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    settings = ExporterSettings(
        kmsg_path=args.kmsg,
        sysfs_root=args.sysfs_root,
        nvml=args.nvml,
        nvml_timeout=args.nvml_timeout,
        state_dir=args.state_dir,
        nvlink_per_link=args.nvlink_per_link,
    )
    host, port = args.listen

    settle(settings.state_dir)  # first, before any thread starts: capabilities are per thread
    follower, evidence_store = _kernel_log(settings)
    nvml = (
        None if settings.nvml == "off" else PynvmlReader(timeout=settings.nvml_timeout, library=nvml_library)
    )
    if nvml is not None and settings.nvml == "on" and not (reading := nvml.read()).available:
        logger.error("--nvml=on but %s", reading.reason)
    try:
        built = _build_checks(args, nvml=nvml, nvml_library=nvml_library, cuda_library=cuda_library)
        endpoint, scheduler = built if built is not None else (None, None)
        evidence = _evidence_endpoint(args, settings, store=evidence_store, nvml=nvml, checks=endpoint)
    except (ValueError, OSError) as exc:
        logger.error("%s", exc)
        return 2
    handler = _handler(settings, follower, nvml, endpoint=endpoint, scheduler=scheduler, evidence=evidence)
    try:
        server = (IPv6Server if ":" in host else Server)((host, port), handler)
    except OSError as exc:
        logger.error("cannot listen on %s:%d: %s", host, port, exc.strerror or exc)
        return 1

    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        logger.info("received %s, shutting down", signal.Signals(signum).name)
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    follower.start()
    if nvml is not None:  # the GPUs' identity, read once at start and kept (a lost GPU tells none)
        threading.Thread(target=_remember_identity, args=(nvml, evidence_store), daemon=True).start()
    if scheduler is not None:
        scheduler.start()
    serving = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.1}, name="http", daemon=True
    )
    serving.start()
    bound_host, bound_port = server.server_address[:2]
    logger.info("listening on %s:%s", bound_host, bound_port)
    try:
        while not stop.wait(1.0):
            pass
    finally:
        server.shutdown()
        server.server_close()
        if scheduler is not None:
            scheduler.stop()
        follower.stop(timeout=0.5)
        evidence_store.save(force=True)
        if nvml is not None:
            nvml.close()
        for sig, restored in previous.items():
            signal.signal(sig, restored)
    return 0


def _kernel_log(settings: ExporterSettings) -> tuple[KmsgFollower, EvidenceStore]:
    """The kernel-log follower, and the evidence store it hands each fault record; both resume this
    boot's state from ``--state-dir``."""
    store = (
        None
        if settings.state_dir is None
        else KmsgStateStore(settings.state_dir, boot_id_path=settings.boot_id_path)
    )
    evidence = EvidenceStore(directory=settings.state_dir, boot_id_path=settings.boot_id_path)
    # Evidence that cannot be resumed (its file damaged or gone) while the counts are: the records
    # the ring buffer still holds are taken again from it.
    resumed = evidence.load()
    follower = KmsgFollower(settings.kmsg_path, state_store=store, sink=evidence, replay=not resumed)
    return follower, evidence


def _handler(
    settings: ExporterSettings,
    follower: KmsgFollower,
    nvml: PynvmlReader | None,
    *,
    endpoint: ChecksEndpoint | None,
    scheduler: Scheduler | None,
    evidence: EvidenceEndpoint,
) -> type[RequestHandler]:
    """The HTTP handler over the three scrape paths (see :mod:`exporter.paths`) and /evidence."""
    store = evidence.store
    rises = CounterRises(
        FAST_INFINIBAND_COUNTERS, directory=settings.state_dir, boot_id_path=settings.boot_id_path
    )
    rises.load()
    sources = build_sources(settings, kmsg=follower, nvml=nvml, evidence=store, rises=rises)
    sources.extend([checks_source(endpoint.runner, scheduler)] if endpoint is not None else [])
    brief = build_sources(settings, kmsg=follower, nvml=nvml, brief=True, evidence=store, rises=rises)
    full, slow = CollectorRegistry(), CollectorRegistry()
    collector = SourcesCollector(sources)  # one, so a source going down is logged once
    full.register(collector)
    slow.register(PathCollector(collector, "slow"))
    boot = BootCollector(boot_id=store.boot_id, boot_time=store.boot_time)
    full.register(boot)
    slow.register(boot)
    return make_handler(full, endpoint, fast=build_registry(brief, "fast"), slow=slow, evidence=evidence)


def _evidence_endpoint(
    args: argparse.Namespace,
    settings: ExporterSettings,
    *,
    store: EvidenceStore,
    nvml: PynvmlReader | None,
    checks: ChecksEndpoint | None,
) -> EvidenceEndpoint:
    """GET /evidence over ``store``; ValueError for flags that contradict each other."""
    sources = EvidenceSources(
        sysfs_root=settings.sysfs_root,
        nvml=nvml,
        node=args.node_name,
        checks=check_summaries(checks.runner) if checks is not None else None,
    )
    return EvidenceEndpoint(store, sources, _evidence_auth(args))


def _refuse_insecure_off_loopback(args: argparse.Namespace) -> None:
    """--checks-insecure-no-auth serves GET /checks and /evidence to anyone who reaches the port: it
    is for a loopback --listen address alone (a test, a port-forward), never a pod or node address."""
    if not args.checks_insecure_no_auth:
        return
    host = args.listen[0]
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ValueError(
            f"--checks-insecure-no-auth is only for a loopback --listen address (127.0.0.1, [::1]), "
            f"not {host}: give --checks-token-file FILE instead"
        )


def _evidence_auth(args: argparse.Namespace) -> BearerToken | None:
    """GET /evidence takes the checks' token (with or without --checks); None: no token configured,
    so /evidence is not served. ValueError for flags that contradict each other."""
    if args.checks_token_file is not None and args.checks_insecure_no_auth:
        raise ValueError("--checks-insecure-no-auth contradicts --checks-token-file")
    _refuse_insecure_off_loopback(args)
    if args.checks_token_file is not None:
        return BearerToken(token_file=args.checks_token_file)
    return BearerToken() if args.checks_insecure_no_auth else None


def _remember_identity(nvml: PynvmlReader, store: EvidenceStore) -> None:
    """Reads the GPUs' identity once (bounded by the NVML timeout) into the evidence store."""
    identity = nvml.identity()
    if identity.available:
        store.remember_gpus(identity.gpus)
        store.save(force=True)
    else:
        logger.info("evidence: no GPU identity from NVML: %s", identity.reason)


def check_summaries(runner: CheckRunner) -> Callable[[], list[dict[str, object]]]:
    """The latest result of each check, as the evidence document lists them."""

    def latest() -> list[dict[str, object]]:
        return [
            check_summary(
                check=result.check,
                verdict=result.verdict,
                message=result.message,
                started=result.started,
                duration=result.duration,
                devices=result.to_json()["devices"],
            )
            for _name, result in sorted(runner.latest().items())
        ]

    return latest


def checks_source(runner: CheckRunner, scheduler: Scheduler | None) -> Source:
    """The ``checks`` source: the runner's latest results as series."""
    from exporter.checks.metrics import check_metrics  # noqa: PLC0415  only with --checks

    intervals = {} if scheduler is None else {name: s.interval for name, s in scheduler.schedule.items()}
    return Source(
        "checks", lambda: check_metrics(runner.latest(), runner.runs(), runner.skipped_gpus(), intervals)
    )


def _warn_without_token(path: Path) -> None:
    """A token file that is missing or empty at start is not fatal: a Secret whose token is set after
    the DaemonSet keeps /metrics and the schedule running; GET /checks answers 503 meanwhile."""
    try:
        empty = not path.read_text(encoding="utf-8").strip()
    except OSError as exc:
        logger.warning(
            "--checks-token-file %s: %s; GET /checks answers 503 until it holds a token", path, exc
        )
        return
    if empty:
        logger.warning(
            "--checks-token-file %s is empty; GET /checks answers 503 until it holds a token", path
        )


def _list_node_pods(node: str) -> list[Mapping[str, Any]]:
    """This node's pods through the in-cluster Kubernetes API (the client is untyped: used as Any)."""
    config: Any = importlib.import_module("kubernetes.config")
    client: Any = importlib.import_module("kubernetes.client")
    config.load_incluster_config()
    pods = client.CoreV1Api().list_pod_for_all_namespaces(
        field_selector=f"spec.nodeName={node}", _request_timeout=10
    )
    serialise = client.ApiClient().sanitize_for_serialization
    return [serialise(pod) for pod in pods.items]


def _list_exporter_pods(namespace: str) -> list[Mapping[str, Any]]:
    """The exporter pods (this one's peers, for ``ping``/``iperf``) through the in-cluster API."""
    from exporter.checks.network import EXPORTER_SELECTOR  # noqa: PLC0415  only with --checks

    config: Any = importlib.import_module("kubernetes.config")
    client: Any = importlib.import_module("kubernetes.client")
    config.load_incluster_config()
    pods = client.CoreV1Api().list_namespaced_pod(
        namespace, label_selector=EXPORTER_SELECTOR, _request_timeout=10
    )
    serialise = client.ApiClient().sanitize_for_serialization
    return [serialise(pod) for pod in pods.items]


def _build_checks(
    args: argparse.Namespace,
    *,
    nvml: PynvmlReader | None,
    nvml_library: Any = None,
    cuda_library: Any = None,
) -> tuple[ChecksEndpoint, Scheduler | None] | None:
    """The checks endpoint and schedule the flags ask for; None without --checks; ValueError for
    flags that contradict each other or a bad schedule.

    The checks' modules are imported here, not with this module: a node that offers no checks loads
    none of them (nor what they use: YAML, the CUDA bindings, the Kubernetes client)."""
    if not args.checks:
        return None
    from exporter.checks.catalog import build_checks  # noqa: PLC0415  see the docstring
    from exporter.checks.cuda import CudaBindingsDriver  # noqa: PLC0415  see the docstring
    from exporter.checks.endpoint import ChecksEndpoint  # noqa: PLC0415  see the docstring
    from exporter.checks.network import IperfServer  # noqa: PLC0415  see the docstring
    from exporter.checks.runner import CheckRunner  # noqa: PLC0415  see the docstring
    from exporter.checks.schedule import (  # noqa: PLC0415  see the docstring
        ScheduleError,
        Scheduler,
        load_schedule,
    )
    from exporter.checks.usage import (  # noqa: PLC0415  see the docstring
        NvmlProcesses,
        PodAccelerators,
        UsageProbe,
    )

    if args.checks_token_file is None and not args.checks_insecure_no_auth:
        raise ValueError("--checks needs --checks-token-file FILE (or --checks-insecure-no-auth)")
    if args.checks_token_file is not None and args.checks_insecure_no_auth:
        raise ValueError("--checks-insecure-no-auth contradicts --checks-token-file")
    _refuse_insecure_off_loopback(args)
    if args.checks_token_file is not None:
        _warn_without_token(args.checks_token_file)
    namespace = args.checks_peers_namespace
    checks = build_checks(
        args.checks,
        nvml=nvml,
        cuda=CudaBindingsDriver(library=cuda_library),
        peers=lambda: _list_exporter_pods(namespace),
        node=args.node_name,
    )
    if "iperf" in args.checks and shutil.which("iperf3"):
        server = IperfServer()  # peers measure to this node through it
        server.start()
        atexit.register(server.stop)
    usage: list[UsageProbe] = []
    if nvml is not None:
        usage.append(NvmlProcesses(library=nvml_library))
    if args.checks_node_pods:
        if not args.node_name:
            raise ValueError("--checks-node-pods needs --node-name (or NODE_NAME)")
        node = args.node_name
        usage.append(PodAccelerators(lambda: _list_node_pods(node)))
    runner = CheckRunner(checks, nvml=nvml, usage=usage)
    endpoint = ChecksEndpoint(runner, None, node=args.node_name, token_file=args.checks_token_file)
    if args.checks_schedule == "off":
        return endpoint, None
    try:
        schedule = load_schedule(Path(args.checks_schedule) if args.checks_schedule else None, runner)
    except ScheduleError as exc:
        raise ValueError(str(exc)) from None
    return endpoint, Scheduler(runner, schedule, node=args.node_name)
