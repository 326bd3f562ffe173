"""The node's evidence from its exporter: `GET /evidence` with the checks token (the same token and the
same pod-IP discovery as the repair loop's `GET /checks`, remediator/lifecycle/repair.py)."""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Protocol

import aiohttp

from remediator.cluster import BackendUnavailable
from remediator.evidence.bundle import FetchResult

MAX_ANSWER_BYTES = 4 * 1024 * 1024
"""A larger answer is refused (the exporter bounds its document to 256 KiB)."""


class EvidenceFetcher(Protocol):
    """Fetches a node's evidence; never raises for a node that does not answer (the result says why)."""

    async def fetch(self, node: str) -> FetchResult: ...


class ExporterEvidence:
    """EvidenceFetcher over the exporter's `GET /evidence`."""

    def __init__(
        self,
        *,
        endpoint: Callable[[str], Awaitable[str | None]],
        token: str | None = None,
        token_file: Path | None = None,
        timeout_seconds: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._endpoint = endpoint
        """node -> the URL of its exporter's /evidence, or None (no exporter pod found)."""
        self._token = token
        self._token_file = token_file
        """Read at every fetch: the Secret may be set or rotated after the start."""
        self._timeout = timeout_seconds
        """The HTTP request's own limit (the engine's deadline is usually shorter)."""
        self._clock = clock

    def _current_token(self) -> tuple[str | None, str]:
        if self._token_file is None:
            return self._token, ""
        try:
            token = self._token_file.read_text(encoding="utf-8").strip()
        except OSError as exc:
            return None, f"cannot read the checks token {self._token_file}: {exc.strerror or exc}"
        return (token, "") if token else (None, f"the checks token file {self._token_file} is empty")

    async def fetch(self, node: str) -> FetchResult:  # noqa: PLR0911  one return per way it fails
        started = self._clock()

        def failed(
            error: str, url: str | None = None, status: int | None = None, size: int = 0
        ) -> FetchResult:
            return FetchResult(url, None, error, status, self._clock() - started, size)

        token, problem = self._current_token()
        if problem:
            return failed(problem)
        try:
            url = await self._endpoint(node)
        except BackendUnavailable as exc:
            return failed(f"cannot find the node's exporter pod: {exc}")
        if url is None:
            return failed("no running exporter pod with an IP on the node")
        headers = {"Accept": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        try:
            timeout = aiohttp.ClientTimeout(total=self._timeout)
            async with (
                aiohttp.ClientSession(timeout=timeout) as session,
                session.get(url, headers=headers) as resp,
            ):
                body = await _read_capped(resp.content, MAX_ANSWER_BYTES + 1)
                status = resp.status
        except (aiohttp.ClientError, TimeoutError) as exc:
            return failed(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__, url)
        if len(body) > MAX_ANSWER_BYTES:
            return failed(f"answer larger than {MAX_ANSWER_BYTES} bytes: refused", url, status, len(body))
        if status != 200:
            text = body[:200].decode("utf-8", "replace").strip()
            return failed(f"HTTP {status}: {text}" if text else f"HTTP {status}", url, status, len(body))
        try:
            document = json.loads(body)
        except ValueError as exc:
            return failed(f"answer is not JSON: {exc}", url, status, len(body))
        if not isinstance(document, dict):
            return failed("answer is not a JSON object", url, status, len(body))
        return FetchResult(url, document, "", status, self._clock() - started, len(body))


async def _read_capped(stream: aiohttp.StreamReader, limit: int) -> bytes:
    """The body up to its end, or its first `limit` bytes (a read returns what one chunk held)."""
    parts: list[bytes] = []
    size = 0
    while size < limit:
        chunk = await stream.read(limit - size)
        if not chunk:
            break
        parts.append(chunk)
        size += len(chunk)
    return b"".join(parts)
