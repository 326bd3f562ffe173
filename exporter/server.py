"""The exporter's HTTP server: one GET, one answer, connection closed, on :mod:`socketserver` alone.

``http.server`` would do, but it imports ``http.client``, and with it ``ssl`` and ``email``: 6 MB of
resident memory in a process that answers a handful of GETs and never speaks TLS. This reads what an
HTTP/1.x client sends (request line, header lines, blank line), hands a :class:`Request` to
:meth:`RequestHandler.answer`, writes the :class:`Response` in one ``sendall`` and closes the
connection, as ``BaseHTTPRequestHandler`` does with its default ``HTTP/1.0``; Prometheus, curl and
the kubelet's probes read that alike.

Each connection gets a thread (``ThreadingMixIn``), so a long ``GET /checks`` never holds up a scrape.
A client has :attr:`RequestHandler.timeout` seconds to send its request; one that sends nothing holds
its thread that long, not forever. Limits: 8 KiB per line and 100 header lines (431 past either),
only GET and HEAD (501 for the rest), 400 for anything that is not an HTTP/1.x request.
"""

from __future__ import annotations

import logging
import socket
import socketserver
from collections.abc import Mapping
from dataclasses import dataclass, field
from http import HTTPStatus

logger = logging.getLogger(__name__)

MAX_LINE = 8192
MAX_HEADERS = 100


@dataclass(frozen=True)
class Request:
    """One request as the handler sees it."""

    method: str
    """``GET`` or ``HEAD`` (others are answered 501 before any handler sees them)."""
    path: str
    """The target up to ``?``, e.g. ``/metrics``."""
    query: str = ""
    """The target after ``?``, undecoded."""
    headers: Mapping[str, str] = field(default_factory=dict)
    """Header names lower-cased; a repeated header keeps its last value."""


@dataclass(frozen=True)
class Response:
    """One answer."""

    status: HTTPStatus
    body: bytes
    content_type: str = "text/plain; charset=utf-8"
    headers: tuple[tuple[str, str], ...] = ()
    """Extra header lines, e.g. ``WWW-Authenticate``."""


class _BadRequestError(Exception):
    def __init__(self, status: HTTPStatus, reason: str) -> None:
        super().__init__(reason)
        self.status = status


def _line(raw: bytes) -> str:
    if len(raw) > MAX_LINE:
        raise _BadRequestError(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, "line too long")
    if not raw.endswith(b"\n"):
        raise _BadRequestError(HTTPStatus.BAD_REQUEST, "incomplete request")
    return raw.decode("iso-8859-1").rstrip("\r\n")


class RequestHandler(socketserver.StreamRequestHandler):
    """Reads one request and writes :meth:`answer`'s response; subclasses say what to answer."""

    timeout = 10.0
    """Seconds a client has for each read of its request (``StreamRequestHandler`` sets it on the
    socket), and for the answer to be taken."""

    def answer(self, request: Request) -> Response:
        """The response to ``request`` (GET or HEAD); 404 unless a subclass knows the path."""
        return Response(HTTPStatus.NOT_FOUND, b"not found\n")

    def handle(self) -> None:
        try:
            request = self._read()
        except _BadRequestError as exc:
            logger.debug("http: %s from %s: %s", exc.status.value, self.client_address[0], exc)
            self._write(Response(exc.status, f"{exc}\n".encode()), head=False)
            return
        except OSError as exc:  # timed out or reset before a whole request came
            logger.debug("http: no request from %s: %s", self.client_address[0], exc)
            return
        if request is None:  # connected and closed without a word (a TCP probe)
            return
        try:
            response = self.answer(request)
        except Exception:  # a fault in a handler: a 500 and its traceback in the log, not a dead thread
            logger.exception("http: answering %s %s failed", request.method, request.path)
            response = Response(HTTPStatus.INTERNAL_SERVER_ERROR, b"internal error\n")
        logger.debug("http: %s %s %d", request.method, request.path, response.status.value)
        self._write(response, head=request.method == "HEAD")

    def _read(self) -> Request | None:
        first = self.rfile.readline(MAX_LINE + 1)
        if not first:
            return None
        parts = _line(first).split()
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            raise _BadRequestError(HTTPStatus.BAD_REQUEST, "not an HTTP/1.x request line")
        method, target, _version = parts
        headers: dict[str, str] = {}
        for _ in range(MAX_HEADERS + 1):
            line = _line(self.rfile.readline(MAX_LINE + 1))
            if not line:
                break
            name, colon, value = line.partition(":")
            if not colon or not name or name != name.strip():
                raise _BadRequestError(HTTPStatus.BAD_REQUEST, "malformed header line")
            headers[name.lower()] = value.strip()
        else:
            raise _BadRequestError(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, "too many header lines")
        if method not in ("GET", "HEAD"):
            raise _BadRequestError(HTTPStatus.NOT_IMPLEMENTED, f"method {method} not supported")
        path, _, query = target.partition("?")
        return Request(method=method, path=path, query=query, headers=headers)

    def _write(self, response: Response, *, head: bool) -> None:
        status = response.status
        lines = [
            f"HTTP/1.0 {status.value} {status.phrase}",
            f"Content-Type: {response.content_type}",
            f"Content-Length: {len(response.body)}",
            "Connection: close",
            *(f"{name}: {value}" for name, value in response.headers),
        ]
        head_bytes = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        try:  # one write: a second small one could wait for the first's delayed ACK
            self.connection.sendall(head_bytes if head else head_bytes + response.body)
        except OSError as exc:  # the client went away; nothing to tell it
            logger.debug("http: answer to %s not delivered: %s", self.client_address[0], exc)


class Server(socketserver.ThreadingMixIn, socketserver.TCPServer):
    """A thread per connection; threads are daemons, so a stuck client never holds up an exit."""

    daemon_threads = True
    allow_reuse_address = True


class IPv6Server(Server):
    address_family = socket.AF_INET6
