"""The bearer token ``GET /checks`` and ``GET /evidence`` require, read from a file on every request.

``Authorization: Bearer <token>``, compared in constant time. The token file (a Secret) is read on
every request, so a rotated Secret takes effect without a restart; while it is missing or empty the
endpoints answer 503, and /metrics is served as ever. No module here imports the checks.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from http import HTTPStatus
from pathlib import Path


@dataclass(frozen=True)
class BearerToken:
    """The token requests must carry; with neither ``token`` nor ``token_file``, none is required
    (``--checks-insecure-no-auth``)."""

    token: str | None = None
    """A fixed token (tests); ignored when ``token_file`` is given."""
    token_file: Path | None = None
    """Where the token is read from on every request (``--checks-token-file``)."""

    def expected(self) -> str | None:
        """The token requests must carry now; "" while the token file is missing or empty; None when
        no token is required."""
        if self.token_file is None:
            return self.token
        try:
            return self.token_file.read_text(encoding="utf-8").strip()
        except OSError:
            return ""

    def authorised(self, header: str | None, expected: str | None = None) -> bool:
        """Whether the ``Authorization`` header carries the token (``expected``, or read now)."""
        expected = self.expected() if expected is None else expected
        if expected is None:
            return True
        scheme, _, given = (header or "").partition(" ")
        if scheme.lower() != "bearer" or not expected:
            return False
        return hmac.compare_digest(given.strip().encode(), expected.encode())

    def refusal(self, header: str | None, *, what: str) -> tuple[HTTPStatus, str] | None:
        """Why a request is refused (503, ``what`` and why, while there is no token yet; 401 without the
        right one), or None when it may go on."""
        expected = self.expected()
        if expected == "":
            return HTTPStatus.SERVICE_UNAVAILABLE, f"{what} until {self.token_file} holds a token"
        if not self.authorised(header, expected):
            return HTTPStatus.UNAUTHORIZED, "missing or wrong bearer token"
        return None
