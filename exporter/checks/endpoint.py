"""``GET /checks?check=pciebw,dcgm&r=1`` on the exporter: runs checks now, answers JSON.

Authenticated like the remediator's webhook: ``Authorization: Bearer <token>``, the token read from a
file (a Secret); compared in constant time. Answers:

- 200 with ``{"node", "verdict", "results": [...]}`` whether the checks passed or not (the verdict says);
- 400 for an unknown check or a bad parameter (nothing runs);
- 401 without the right token; 404 where the exporter offers no checks;
- 503 while the token file is missing or empty (a Secret whose token has not been set yet).

The token file is read on every request, so a rotated Secret takes effect without a restart, and an
exporter whose token is not set yet still serves /metrics and runs its scheduled checks.

Without ``check=`` (or with ``check=all``) it runs every check this exporter offers except ``iperf``,
which loads other nodes too; name it to run it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from http import HTTPStatus
from pathlib import Path
from urllib.parse import parse_qs

from exporter.auth import BearerToken
from exporter.checks.base import CheckInputError, worst
from exporter.checks.runner import CheckRunner

ON_DEMAND_DEFAULT_EXCLUDED = frozenset({"iperf"})


@dataclass(frozen=True)
class ChecksEndpoint:
    runner: CheckRunner
    token: str | None
    """The bearer token; None with no ``token_file`` serves without authentication
    (``--checks-insecure-no-auth``)."""
    node: str = ""
    token_file: Path | None = None
    """Where the token is read from on every request (``--checks-token-file``); overrides ``token``."""

    def _auth(self) -> BearerToken:
        return BearerToken(token=self.token, token_file=self.token_file)

    def expected_token(self) -> str | None:
        """The token requests must carry now; "" while the token file is missing or empty."""
        return self._auth().expected()

    def authorised(self, header: str | None, expected: str | None = None) -> bool:
        return self._auth().authorised(header, expected)

    def handle(self, query: str, authorization: str | None) -> tuple[HTTPStatus, dict[str, object]]:
        refused = self._auth().refusal(authorization, what="on-demand checks are off")
        if refused is not None:
            return refused[0], {"error": refused[1]}
        try:
            fields = parse_qs(query, keep_blank_values=True, strict_parsing=bool(query), max_num_fields=50)
        except ValueError as exc:
            return HTTPStatus.BAD_REQUEST, {"error": f"malformed query: {exc}"}
        params: Mapping[str, str] = {key: values[-1] for key, values in fields.items() if key != "check"}
        wanted = [n.strip() for v in fields.get("check", []) for n in v.split(",") if n.strip()]
        if not wanted or wanted == ["all"]:
            wanted = [n for n in self.runner.checks if n not in ON_DEMAND_DEFAULT_EXCLUDED]
        wanted = list(dict.fromkeys(wanted))
        try:
            self.runner.validate(wanted, params)
        except CheckInputError as exc:
            return HTTPStatus.BAD_REQUEST, {"error": str(exc)}
        results = [self.runner.run(name, params) for name in wanted]
        body: dict[str, object] = {
            "node": self.node,
            "verdict": worst([r.verdict for r in results]),
            "results": [r.to_json() for r in results],
        }
        return HTTPStatus.OK, body


def encode(body: Mapping[str, object]) -> bytes:
    return (json.dumps(body, indent=1, sort_keys=False) + "\n").encode()
