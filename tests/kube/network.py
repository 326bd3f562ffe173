"""The two pieces of cluster networking the harness plays, on one event loop in a thread:

- `SkewProxy`: the API server as pods see it (KUBERNETES_SERVICE_HOST:PORT), on the pod bridge. It
  passes every request through with the caller's own token (so RBAC is the API server's, on the
  caller's identity) and bridges one version skew of the 1.20 server: policy/v1 (PodDisruptionBudget,
  Eviction) is served there only as policy/v1beta1, so those requests are rewritten to v1beta1 and the
  answers back to v1 (a watch's events one line at a time, as they come). The product keeps speaking
  policy/v1, as it must on current clusters. A client that goes away ends its request upstream too,
  so a watch it closed ends at the API server at once, as it would without the proxy.
- `ServiceProxy`: kube-proxy for one Service: connections to a loopback port go to one of the
  Service's ready endpoints (the endpoints controller fills them from pod readiness), like a ClusterIP.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import ssl
import threading
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
from aiohttp import web

from tests.kube.controlplane import ControlPlane
from tests.kube.rest import ApiError, Rest

_POLICY_V1 = re.compile(r"^/apis/policy/v1(/|$)")
_EVICTION = re.compile(r"^/api/v1/namespaces/[^/]+/pods/[^/]+/eviction$")
T = TypeVar("T")
_HOP_HEADERS = {
    "host",
    "content-length",
    "transfer-encoding",
    "connection",
    "content-encoding",
    "accept-encoding",
}


class Loop:
    """An asyncio loop in a daemon thread, for servers the synchronous tests run beside them."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="harness-net", daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
        self.loop.close()


@dataclass
class SkewProxy:
    upstream: str
    ca_file: Path
    cert_file: Path
    key_file: Path
    host: str
    port: int = 0
    requests: list[tuple[str, str, int]] = field(default_factory=list)
    """(method, path as asked, status) of every request, for the tests' eyes."""
    _runner: web.AppRunner | None = None
    _session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        upstream_ssl = ssl.create_default_context(cafile=str(self.ca_file))
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=upstream_ssl, limit=0),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
            auto_decompress=False,
        )
        app = web.Application(client_max_size=16 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        # Watches stream for minutes: on stop, cut them after a second instead of waiting for them.
        # A client that disconnects cancels its handler, which closes the upstream request.
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0, handler_cancellation=True)
        await self._runner.setup()
        serving = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        serving.load_cert_chain(str(self.cert_file), str(self.key_file))
        site = web.TCPSite(self._runner, self.host, self.port, ssl_context=serving)
        await site.start()
        if self.port == 0:
            server = site._server
            assert server is not None
            self.port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()
            # Watches cut short closed their upstream TLS connections outside the pool, which the
            # session's close does not wait for: let their shutdown finish before the loop ends, or
            # the sockets are left to the garbage collector (an unclosed-socket warning in whatever
            # test runs then).
            await asyncio.sleep(0.25)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        assert self._session is not None
        path = request.path
        body = await request.read()
        skewed = bool(_POLICY_V1.match(path)) or (bool(_EVICTION.match(path)) and b"policy/v1" in body)
        if _POLICY_V1.match(path):
            path = _POLICY_V1.sub(r"/apis/policy/v1beta1\1", path)
        if skewed:
            body = body.replace(b'"policy/v1"', b'"policy/v1beta1"')
        # Answers come uncompressed: the upstream session does not decompress, and a gzipped answer
        # (the API server compresses those over 128 KiB, a list of many nodes) would reach the client
        # without its Content-Encoding, and could not be rewritten.
        headers = {
            k: v for k, v in request.headers.items() if k.lower() not in (*_HOP_HEADERS, "accept-encoding")
        }
        headers["Accept-Encoding"] = "identity"
        url = self.upstream + path + (f"?{request.query_string}" if request.query_string else "")
        async with self._session.request(request.method, url, headers=headers, data=body or None) as up:
            self.requests.append((request.method, request.path, up.status))
            out_headers = {k: v for k, v in up.headers.items() if k.lower() not in _HOP_HEADERS}
            if "watch" not in request.query:
                data = await up.read()
                if skewed:
                    data = data.replace(b'"policy/v1beta1"', b'"policy/v1"')
                return web.Response(status=up.status, headers=out_headers, body=data)
            response = web.StreamResponse(status=up.status, headers=out_headers)
            await response.prepare(request)
            if skewed:  # one event per line: rewritten whole, never split across chunks
                async for line in up.content:
                    await response.write(line.replace(b'"policy/v1beta1"', b'"policy/v1"'))
            else:
                async for chunk in up.content.iter_any():
                    await response.write(chunk)
            await response.write_eof()
            return response


@dataclass
class ServiceProxy:
    """Forwards 127.0.0.1:port to a ready endpoint of Service namespace/name (port `target_port`)."""

    rest: Rest
    namespace: str
    name: str
    target_port: int
    port: int = 0
    source: str | None = None
    """The address the endpoint sees the connections come from (kube-proxy keeps the client's): one
    the harness gave the client on the pod network; None: the host's."""
    _server: asyncio.AbstractServer | None = None
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    def endpoints(self) -> list[str]:
        try:
            obj = self.rest.get(f"/api/v1/namespaces/{self.namespace}/endpoints/{self.name}")
        except ApiError:
            return []
        return [a["ip"] for s in obj.get("subsets") or [] for a in s.get("addresses") or []]

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._connection, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        ips = await asyncio.to_thread(self.endpoints)
        if not ips:
            writer.close()  # no ready endpoint: connection refused, as a ClusterIP without endpoints
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(
                ips[0], self.target_port, local_addr=(self.source, 0) if self.source else None
            )
        except OSError:
            writer.close()
            return

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            with contextlib.suppress(OSError):
                dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))


@contextlib.contextmanager
def skew_proxy(plane: ControlPlane, *, host: str = "127.0.0.1") -> Iterator[str]:
    """A SkewProxy in front of `plane` on `host`, on a loop of its own; yields its https URL."""
    loop = Loop()
    proxy = SkewProxy(
        upstream=plane.server,
        ca_file=plane.pki.ca_cert,
        cert_file=plane.pki.serving_cert,
        key_file=plane.pki.serving_key,
        host=host,
    )
    loop.run(proxy.start())
    try:
        yield f"https://{host}:{proxy.port}"
    finally:
        loop.run(proxy.stop())
        loop.close()


def run_sync(loop: Loop, start: Callable[[], Awaitable[None]]) -> None:
    async def go() -> None:
        await start()

    loop.run(go())
