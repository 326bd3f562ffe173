"""``accel-health-exporter``: serves /metrics and /healthz for one node.

Stops cleanly (exit 0) on SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import threading
from collections.abc import Sequence
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import FrameType

from prometheus_client import CollectorRegistry

from exporter.exposition import CONTENT_TYPE, generate_text
from exporter.readers.kmsg import KmsgFollower, KmsgStateStore
from exporter.readers.nvml import DEFAULT_TIMEOUT, PynvmlReader
from exporter.sources import ExporterSettings, build_registry, build_sources

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
        help="keep kernel-log counts here (a hostPath) so a restart within one boot neither loses "
        "events the ring buffer has overwritten nor counts any twice",
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
    parser.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info")
    return parser


def make_handler(registry: CollectorRegistry) -> type[BaseHTTPRequestHandler]:
    """An HTTP handler class serving ``registry`` on /metrics and liveness on /healthz."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._reply(HTTPStatus.OK, generate_text(registry), CONTENT_TYPE)
            elif path == "/healthz":
                self._reply(HTTPStatus.OK, b"ok\n", "text/plain; charset=utf-8")
            else:
                self._reply(HTTPStatus.NOT_FOUND, b"not found\n", "text/plain; charset=utf-8")

        def _reply(self, status: HTTPStatus, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # `format`: the base class's name
            logger.debug("http: " + format, *args)

    return Handler


class _IPv6Server(ThreadingHTTPServer):
    address_family = socket.AF_INET6


def main(argv: Sequence[str] | None = None) -> int:
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
    )
    host, port = args.listen

    store = (
        None
        if settings.state_dir is None
        else KmsgStateStore(settings.state_dir, boot_id_path=settings.boot_id_path)
    )
    follower = KmsgFollower(settings.kmsg_path, state_store=store)
    nvml = None if settings.nvml == "off" else PynvmlReader(timeout=settings.nvml_timeout)
    if nvml is not None and settings.nvml == "on" and not (reading := nvml.read()).available:
        logger.error("--nvml=on but %s", reading.reason)
    registry = build_registry(build_sources(settings, kmsg=follower, nvml=nvml))
    try:
        server_class = _IPv6Server if ":" in host else ThreadingHTTPServer
        server = server_class((host, port), make_handler(registry))
    except OSError as exc:
        logger.error("cannot listen on %s:%d: %s", host, port, exc.strerror or exc)
        return 1
    server.daemon_threads = True

    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        logger.info("received %s, shutting down", signal.Signals(signum).name)
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    follower.start()
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
        follower.stop(timeout=0.5)
        if nvml is not None:
            nvml.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0
