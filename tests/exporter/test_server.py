"""The exporter's HTTP server (exporter.server) over real sockets: what it answers to well-formed and
malformed requests, and that a slow or silent client holds up nobody else."""

from __future__ import annotations

import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from http import HTTPStatus

import pytest

from exporter.server import MAX_HEADERS, MAX_LINE, Request, RequestHandler, Response, Server

SLOW_PATH_SECONDS = 1.0


class Echo(RequestHandler):
    """Answers with what it was asked; /slow after a second; /boom raises."""

    timeout = 0.5

    def answer(self, request: Request) -> Response:
        if request.path == "/boom":
            raise RuntimeError("a fault in a handler")
        if request.path == "/slow":
            time.sleep(SLOW_PATH_SECONDS)
        body = f"{request.method} {request.path} {request.query} {request.headers.get('x-probe', '')}\n"
        return Response(HTTPStatus.OK, body.encode(), headers=(("X-Answer", "yes"),))


@pytest.fixture
def server() -> Iterator[Server]:
    running = Server(("127.0.0.1", 0), Echo)
    thread = threading.Thread(target=running.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield running
    running.shutdown()
    running.server_close()


def url(server: Server, path: str) -> str:
    host, port = server.server_address[:2]
    return f"http://{host!s}:{port}{path}"


def raw(server: Server, data: bytes, *, timeout: float = 5.0) -> bytes:
    """Sends ``data`` as is and reads the answer until the server closes the connection."""
    host, port = server.server_address[:2]
    with socket.create_connection((str(host), int(port)), timeout=timeout) as conn:
        conn.sendall(data)
        chunks = []
        while chunk := conn.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def test_a_get_is_answered_with_its_path_query_and_headers_and_the_connection_closed(server: Server) -> None:
    request = urllib.request.Request(url(server, "/metrics?x=1"), headers={"X-Probe": "here"})  # noqa: S310
    with urllib.request.urlopen(request, timeout=5) as answer:  # noqa: S310  loopback
        assert answer.status == 200
        assert answer.headers["Content-Type"] == "text/plain; charset=utf-8"
        assert answer.headers["X-Answer"] == "yes"
        assert answer.headers["Connection"] == "close"
        assert answer.read() == b"GET /metrics x=1 here\n"


def test_a_head_gets_the_headers_of_a_get_and_no_body(server: Server) -> None:
    answer = raw(server, b"HEAD /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 200 OK\r\n")
    echoed = b"HEAD /healthz  \n"
    assert b"Content-Length: %d\r\n" % len(echoed) in head  # the length of the answer a GET would get
    assert body == b""


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"POST /metrics HTTP/1.1\r\n\r\n", b"501"),
        (b"GET /metrics\r\n\r\n", b"400"),  # HTTP/0.9
        (b"GET /metrics SPDY/3\r\n\r\n", b"400"),
        (b"GET /metrics HTTP/1.1\r\nno colon here\r\n\r\n", b"400"),
        (b"GET /metrics HTTP/1.1\r\n folded: x\r\n\r\n", b"400"),
        (b"GET /" + b"a" * MAX_LINE + b" HTTP/1.1\r\n\r\n", b"431"),
        (b"GET / HTTP/1.1\r\n" + b"X-A: b\r\n" * (MAX_HEADERS + 1) + b"\r\n", b"431"),
    ],
)
def test_what_is_not_a_plain_get_or_head_is_refused_with_its_status(
    server: Server, request_bytes: bytes, status: bytes
) -> None:
    assert raw(server, request_bytes).startswith(b"HTTP/1.0 " + status + b" ")


def test_a_fault_in_the_handler_is_a_500_and_a_log_line(
    server: Server, caplog: pytest.LogCaptureFixture
) -> None:
    with pytest.raises(urllib.error.HTTPError) as raised:
        urllib.request.urlopen(url(server, "/boom"), timeout=5)  # noqa: S310  loopback
    assert raised.value.code == 500
    raised.value.close()
    assert "answering GET /boom failed" in caplog.text
    with urllib.request.urlopen(url(server, "/after"), timeout=5) as answer:  # noqa: S310  loopback
        assert answer.read() == b"GET /after  \n"  # the server still serves


def test_a_silent_client_is_dropped_after_the_timeout_and_holds_up_nobody(server: Server) -> None:
    host, port = server.server_address[:2]
    with socket.create_connection((str(host), int(port)), timeout=5) as silent:
        silent.sendall(b"GET /metrics HTTP/1.1\r\n")  # and never the blank line
        with urllib.request.urlopen(url(server, "/meanwhile"), timeout=5) as answer:  # noqa: S310  loopback
            assert answer.read() == b"GET /meanwhile  \n"
        started = time.monotonic()
        assert silent.recv(100) == b""  # closed by the server, unanswered
        assert time.monotonic() - started < 2.0


def test_a_slow_answer_runs_beside_quick_ones(server: Server) -> None:
    def fetch_slow() -> None:
        with urllib.request.urlopen(url(server, "/slow"), timeout=5) as answer:  # noqa: S310  loopback
            answer.read()

    slow = threading.Thread(target=fetch_slow)
    slow.start()
    time.sleep(0.1)
    started = time.monotonic()
    with urllib.request.urlopen(url(server, "/quick"), timeout=5) as answer:  # noqa: S310  loopback
        answer.read()
    assert time.monotonic() - started < SLOW_PATH_SECONDS / 2
    slow.join()


def test_a_client_that_connects_and_closes_is_no_error(
    server: Server, caplog: pytest.LogCaptureFixture
) -> None:
    assert raw(server, b"") == b""
    assert "Traceback" not in caplog.text
