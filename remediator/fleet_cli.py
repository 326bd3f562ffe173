"""`accel-health`, the operators' one command (the service is `accel-health-remediator`):

accel-health status [--json] [--remediator URL]   where each node is in its remediation
accel-health check ...                            the exporters' active checks (exporter/checks/)
accel-health evidence NODE                        the evidence captured before a node was acted on
accel-health explain --alerts FILE --cluster-snapshot FILE   what the remediator would do
accel-health pause [--reason TEXT] | resume       the remediator's pause switch (over its HTTP API)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

import aiohttp

from exporter.checks import fanout
from remediator import cli as remediator_cli
from remediator.evidence import cli as evidence_cli

COMMANDS = (
    "\ncommands:\n"
    "  status                where each node is in its remediation: phase, since, alerts, next step "
    "and what it waits on (`accel-health status --help`)\n"
    "  check                 run the exporters' active checks (the default: `accel-health --help` above)\n"
    "  evidence NODE         print the evidence captured for NODE before accel-health acted on it\n"
    "  explain               what the remediator would do with a webhook payload on a cluster snapshot\n"
    "  pause | resume        stop every action of the running remediator, or let it act again\n"
)
DEFAULT_REMEDIATOR = "http://127.0.0.1:9836"


def _switch_parser(verb: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"accel-health {verb}",
        description="Pause every action of the running remediator until `accel-health resume` (kept in "
        "the cluster: survives restarts and fail-overs)"
        if verb == "pause"
        else "Let the paused remediator act again.",
    )
    parser.add_argument(
        "--remediator",
        metavar="URL",
        default=DEFAULT_REMEDIATOR,
        help=f"the remediator's base URL, e.g. through `kubectl port-forward` (default {DEFAULT_REMEDIATOR})",
    )
    parser.add_argument("--token-file", type=Path, help="the remediator's bearer token")
    if verb == "pause":
        parser.add_argument("--reason", default="", help="why (shown in every deferral and GET /state)")
    return parser


async def _post(url: str, token: str | None, body: dict[str, str] | None) -> tuple[int, str]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session,
        session.post(url, json=body, headers=headers) as response,
    ):
        return response.status, await response.text()


def switch(verb: str, argv: Sequence[str], *, out: TextIO) -> int:
    """`accel-health pause|resume`: POST /pause or /resume to the running remediator."""
    args = _switch_parser(verb).parse_args(argv)
    token = remediator_cli._read_token(args.token_file) if args.token_file is not None else None
    body = {"reason": args.reason} if verb == "pause" and args.reason else None
    url = args.remediator.rstrip("/") + f"/{verb}"
    try:
        code, text = asyncio.run(_post(url, token, body))
    except (aiohttp.ClientError, TimeoutError) as exc:
        print(f"accel-health {verb}: cannot reach {url}: {exc}", file=sys.stderr)
        return 1
    if code != 200:
        print(f"accel-health {verb}: {url} answered {code}: {text.strip()[:300]}", file=sys.stderr)
        return 1
    answer = json.loads(text)
    state = "paused" if answer.get("paused") else "acting"
    print(f"remediator {state}" + ("" if answer.get("changed") else " (it was already)"), file=out)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `accel-health` console script."""
    args = list(sys.argv[1:] if argv is None else argv)
    command = args[0] if args else ""
    try:
        if command == "status":
            return remediator_cli.status(args[1:], out=sys.stdout)
        if command == "evidence":
            return evidence_cli.main(args[1:])
        if command == "explain":
            return remediator_cli.explain(args[1:], out=sys.stdout, prog="accel-health explain")
        if command in ("pause", "resume"):
            return switch(command, args[1:], out=sys.stdout)
    except remediator_cli.UsageError as exc:
        print(f"accel-health {command}: {exc}", file=sys.stderr)
        return remediator_cli.EXIT_USAGE
    code = fanout.main(args)  # `check ...` (its parser names the subcommand)
    if not args or args[0] in ("-h", "--help"):
        print(COMMANDS, file=sys.stdout if args else sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
