"""A small synchronous JSON client for the test harness (the kubelet stand-in, fixtures, assertions).

The product talks to the API server through the official client; the harness uses plain HTTP so that
what it does to the cluster is visible in a few lines and independent of the code under test.
"""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

Obj = dict[str, Any]


class ApiError(Exception):
    """A non-2xx answer: `status` and the server's Status object (or text)."""

    def __init__(self, method: str, path: str, status: int, body: Any) -> None:
        reason = body.get("message") if isinstance(body, dict) else str(body)[:300]
        super().__init__(f"{method} {path}: HTTP {status}: {reason}")
        self.status = status
        self.body = body


class Rest:
    """JSON over HTTPS with a bearer token, verified against the test CA."""

    def __init__(self, *, server: str, token: str, ca_file: Path, timeout: float = 10.0) -> None:
        self.server = server.rstrip("/")
        self.token = token
        self.timeout = timeout
        self._context = ssl.create_default_context(cafile=str(ca_file))

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        content_type: str = "application/json",
        query: dict[str, str] | None = None,
    ) -> Any:
        url = self.server + path
        if query:
            url += "?" + urllib.parse.urlencode(query)
        data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
        req = urllib.request.Request(url, data=data, method=method)  # noqa: S310 -- https to the test server
        req.add_header("Authorization", f"Bearer {self.token}")
        req.add_header("Accept", "application/json")
        if data is not None:
            req.add_header("Content-Type", content_type)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout, context=self._context) as resp:  # noqa: S310
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            raw = exc.read()
            try:
                parsed = json.loads(raw)
            except ValueError:
                parsed = raw.decode(errors="replace")
            raise ApiError(method, path, exc.code, parsed) from None
        return json.loads(raw) if raw else None

    def get(self, path: str, **query: str) -> Any:
        return self.request("GET", path, query=query or None)

    def items(self, path: str, **query: str) -> list[Obj]:
        result: list[Obj] = self.get(path, **query)["items"]
        return result

    def create(self, path: str, obj: Obj) -> Any:
        return self.request("POST", path, obj)

    def merge_patch(self, path: str, patch: Obj) -> Any:
        return self.request("PATCH", path, patch, content_type="application/merge-patch+json")

    def strategic_patch(self, path: str, patch: Obj) -> Any:
        return self.request("PATCH", path, patch, content_type="application/strategic-merge-patch+json")

    def delete(self, path: str, body: Obj | None = None) -> Any:
        return self.request("DELETE", path, body)

    def exists(self, path: str) -> bool:
        try:
            self.get(path)
        except ApiError as exc:
            if exc.status == 404:
                return False
            raise
        return True
