"""``accel-health check``: runs active checks on many nodes through their exporter pods.

    accel-health check [--host a,b] [--check pciebw,dcgm] [--batch N] [-r 2] [--token-file FILE]

Finds the exporter pods through the Kubernetes API (your kubeconfig, or the in-cluster account):
pods labelled ``app.kubernetes.io/name=accel-health-exporter`` in ``--namespace``, one per node, each
reached at ``http://<pod IP>:9835/checks``. ``--endpoints node=URL,...`` names them instead (a
port-forward, a demo). At most ``--batch`` nodes run at once. Prints one table per run, a row per node,
check and quantity, a column per GPU (failed values marked ``!``, GPUs left out because in use
``busy``); network checks (``ping``, ``iperf``) a row per interface and peer; then a summary.
``--json`` prints the nodes' answers instead.

Exit status: 0 when every node passed (or had nothing idle to check), 1 when a node failed a check, a
check could not measure, or a node did not answer; 2 for a usage error.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import urlencode

import aiohttp

from exporter.checks.base import CheckResult, DeviceResult, Verdict, worst
from exporter.checks.network import EXPORTER_SELECTOR

EXPORTER_PORT = 9835
NETWORK_CHECKS = frozenset({"ping", "iperf"})
"""Checks whose devices are ``interface/peer``: a row each, not a GPU column."""

_UNITS = {
    "host_to_device": ("h2d GB/s", 1e9),
    "device_to_host": ("d2h GB/s", 1e9),
    "device_to_device": ("mem GB/s", 1e9),
}


class UsageError(Exception):
    """Bad arguments; exit status 2."""


@dataclass(frozen=True)
class NodeAnswer:
    node: str
    verdict: Verdict
    results: tuple[CheckResult, ...] = ()
    error: str = ""
    """Why the node gave no answer (unreachable, 401, bad JSON)."""


def discover(namespace: str, selector: str) -> dict[str, str]:
    """node -> checks URL of its exporter pod, from the Kubernetes API (kubeconfig or in-cluster)."""
    config: Any = importlib.import_module("kubernetes.config")
    client: Any = importlib.import_module("kubernetes.client")
    try:
        config.load_config()
    except Exception as exc:  # the client raises its own ConfigException, or OSError for a bad file
        raise UsageError(f"no Kubernetes configuration: {exc}") from None
    pods = client.CoreV1Api().list_namespaced_pod(namespace, label_selector=selector, _request_timeout=30)
    found = {}
    for pod in pods.items:
        node, ip = pod.spec.node_name, pod.status.pod_ip
        if node and ip and pod.status.phase == "Running":
            host = f"[{ip}]" if ":" in ip else ip
            found[node] = f"http://{host}:{EXPORTER_PORT}/checks"
    return found


def parse_endpoints(text: str) -> dict[str, str]:
    found = {}
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        node, sep, url = item.partition("=")
        if not sep or not node or not url.startswith(("http://", "https://")):
            raise UsageError(f"--endpoints: expected node=http://host:port, got {item!r}")
        found[node] = url.rstrip("/") + ("" if url.rstrip("/").endswith("/checks") else "/checks")
    return found


async def _ask(
    session: aiohttp.ClientSession,
    node: str,
    url: str,
    query: str,
    *,
    token: str | None,
    limit: asyncio.Semaphore,
    seconds: float,
) -> NodeAnswer:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with limit:
        try:
            async with session.get(
                f"{url}?{query}", headers=headers, timeout=aiohttp.ClientTimeout(total=seconds)
            ) as response:
                text = await response.text()
                if response.status != 200:
                    return NodeAnswer(node, "error", error=f"HTTP {response.status}: {text.strip()[:200]}")
                body = json.loads(text)
                results = tuple(CheckResult.from_json(r) for r in body["results"])
        except (aiohttp.ClientError, TimeoutError) as exc:
            return NodeAnswer(node, "error", error=f"{type(exc).__name__}: {exc}".rstrip(": "))
        except (ValueError, KeyError, TypeError) as exc:
            return NodeAnswer(node, "error", error=f"unreadable answer: {exc}")
    return NodeAnswer(node, worst([r.verdict for r in results]), results)


async def run_checks(
    endpoints: Mapping[str, str],
    *,
    checks: Sequence[str],
    params: Mapping[str, str],
    token: str | None,
    batch: int,
    seconds: float,
) -> list[NodeAnswer]:
    """Every node's answer, in node-name order; at most ``batch`` requests at once."""
    query = urlencode({**({"check": ",".join(checks)} if checks else {}), **params})
    limit = asyncio.Semaphore(batch)
    async with aiohttp.ClientSession() as session:
        answers = await asyncio.gather(
            *(
                _ask(session, node, endpoints[node], query, token=token, limit=limit, seconds=seconds)
                for node in sorted(endpoints)
            )
        )
    return list(answers)


def _cell(device: DeviceResult, quantity: str) -> str:
    if device.verdict == "skipped":
        return "busy" if device.detail else "-"
    if device.verdict == "error":
        return "ERR"
    mark = "!" if device.verdict == "fail" else ""
    if quantity in _UNITS:
        value = device.values.get(quantity)
        return "-" if value is None else f"{value / _UNITS[quantity][1]:.1f}{mark}"
    return "FAIL" if device.verdict == "fail" else "ok"


def _rows(answer: NodeAnswer) -> list[tuple[str, str, str, str, dict[str, str], str]]:
    """(node, check, quantity, verdict, {gpu: cell}, note) for one node."""
    if answer.error:
        return [(answer.node, "-", "", "ERROR", {}, answer.error)]
    rows = []
    for result in answer.results:
        if result.check in NETWORK_CHECKS:
            rows.extend(_network_rows(answer.node, result))
            continue
        gpus = [d for d in result.devices if d.device]
        quantities = [q for q in _UNITS if any(q in d.values for d in gpus)] or [""]
        for i, quantity in enumerate(quantities):
            cells = {d.device: _cell(d, quantity) for d in gpus}
            note = result.message if i == 0 else ""
            label = _UNITS[quantity][0] if quantity in _UNITS else ""
            verdict = result.verdict.upper() if i == 0 else ""
            rows.append(
                (answer.node if i == 0 else "", result.check if i == 0 else "", label, verdict, cells, note)
            )
    return rows


def _network_note(device: DeviceResult) -> str:
    parts = []
    if "rtt_seconds" in device.values:
        parts.append(f"rtt {device.values['rtt_seconds'] * 1000:.2f} ms")
    if "bytes_per_second" in device.values:
        parts.append(f"{device.values['bytes_per_second'] * 8 / 1e9:.2f} Gbit/s")
    return ", ".join([*parts, device.detail] if device.detail else parts)


def _network_rows(node: str, result: CheckResult) -> list[tuple[str, str, str, str, dict[str, str], str]]:
    """One row per interface/peer (no GPU columns): the peer's verdict and what was measured."""
    if not result.devices:
        return [(node, result.check, "", result.verdict.upper(), {}, result.message)]
    return [
        (
            node if i == 0 else "",
            result.check if i == 0 else "",
            device.device,
            device.verdict.upper(),
            {},
            _network_note(device),
        )
        for i, device in enumerate(result.devices)
    ]


def render(answers: Sequence[NodeAnswer], out: TextIO, *, width: int = 60) -> None:
    """The per-node table and the summary."""
    rows = [row for answer in answers for row in _rows(answer)]
    gpus = sorted({gpu for row in rows for gpu in row[4]}, key=lambda g: (len(g), g))
    header = ("NODE", "CHECK", "", "VERDICT", *(f"GPU{g}" for g in gpus), "NOTE")
    table = [header] + [
        (node, check, quantity, verdict, *(cells.get(g, "") for g in gpus), note[:width])
        for node, check, quantity, verdict, cells, note in rows
    ]
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    for row in table:
        out.write("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip() + "\n")
    failed = [a for a in answers if a.verdict in ("fail", "error")]
    out.write(f"\n{len(answers)} node(s) checked, {len(failed)} failed")
    if failed:
        parts = []
        for answer in failed:
            bad = [r.check for r in answer.results if r.verdict in ("fail", "error")] or ["unreachable"]
            parts.append(f"{answer.node} ({', '.join(bad)})")
        out.write(": " + ", ".join(parts))
    out.write("\n")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="accel-health", description="accel-health fleet tools.")
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("check", help="run active checks on nodes through their exporters")
    check.add_argument("--host", default="", help="comma-separated node names (default: every node)")
    check.add_argument("--check", default="", help="comma-separated checks (default: the node's defaults)")
    check.add_argument("--batch", type=int, default=0, help="nodes checked at once (default: all)")
    check.add_argument("-r", dest="level", choices=("1", "2", "3", "4"), help="dcgmi diag level")
    check.add_argument("--param", action="append", default=[], metavar="KEY=VALUE", help="check parameter")
    check.add_argument("--token-file", type=Path, help="bearer token the exporters require")
    check.add_argument("--namespace", default="accel-health")
    check.add_argument("--selector", default=EXPORTER_SELECTOR)
    check.add_argument("--endpoints", default="", help="node=URL,... instead of asking Kubernetes")
    check.add_argument("--timeout", type=float, default=1800.0, help="seconds to wait for one node")
    check.add_argument("--json", action="store_true", help="print the answers as JSON")
    return parser


def _params(items: Sequence[str], *, level: str | None) -> dict[str, str]:
    params = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--param: expected KEY=VALUE, got {item!r}")
        params[key] = value
    if level:
        params["r"] = level
    return params


def main(argv: Sequence[str] | None = None, *, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    try:
        if args.batch < 0:
            raise UsageError("--batch must be positive")
        params = _params(args.param, level=args.level)
        token = None
        if args.token_file is not None:
            try:
                token = args.token_file.read_text(encoding="utf-8").strip()
            except OSError as exc:
                raise UsageError(f"cannot read --token-file: {exc.strerror or exc}") from None
        endpoints = (
            parse_endpoints(args.endpoints) if args.endpoints else discover(args.namespace, args.selector)
        )
        hosts = [h.strip() for h in args.host.split(",") if h.strip()]
        missing = [h for h in hosts if h not in endpoints]
        if missing:
            raise UsageError(f"no exporter found on node(s) {', '.join(missing)}")
        if hosts:
            endpoints = {h: endpoints[h] for h in hosts}
        if not endpoints:
            raise UsageError("no exporter pods found")
    except UsageError as exc:
        print(f"accel-health check: {exc}", file=sys.stderr)
        return 2
    checks = [c.strip() for c in args.check.split(",") if c.strip()]
    answers = asyncio.run(
        run_checks(
            endpoints,
            checks=checks,
            params=params,
            token=token,
            batch=args.batch or len(endpoints),
            seconds=args.timeout,
        )
    )
    if args.json:
        document = [
            {
                "node": a.node,
                "verdict": a.verdict,
                "error": a.error,
                "results": [r.to_json() for r in a.results],
            }
            for a in answers
        ]
        out.write(json.dumps(document, indent=1) + "\n")
    else:
        render(answers, out)
    return 1 if any(a.verdict in ("fail", "error") for a in answers) else 0
