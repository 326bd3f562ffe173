"""`accel-health`, the operators' command: `accel-health check ...` (the exporters' active checks,
exporter/checks/fanout.py) and `accel-health evidence NODE` (the evidence captured before a node was
acted on, remediator/evidence/cli.py)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from exporter.checks import fanout
from remediator.evidence import cli as evidence_cli

EVIDENCE_HELP = (
    "\nalso:\n  evidence NODE         print the evidence captured for NODE before accel-health acted on it "
    "(`accel-health evidence --help`)\n"
)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `accel-health` console script."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "evidence":
        return evidence_cli.main(args[1:])
    code = fanout.main(args)
    if not args or args[0] in ("-h", "--help"):
        print(EVIDENCE_HELP, file=sys.stdout if args else sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
