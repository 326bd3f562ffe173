"""A capture as the text report `accel-health evidence NODE` prints (pure): the node, the alerts, each
GPU's identity, driver and CUDA, each fault record group with its lines, the checks, the decisions and
the timeline, and where it is stored. Every field may be missing or null (an exporter that did not
answer, an older schema): shown as `-`, never a traceback."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def _s(value: Any) -> str:
    if value is None or value == "":
        return "-"
    return str(value)


def _map(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _list(value: Any) -> list[Mapping[str, Any]]:
    return [v for v in value if isinstance(v, Mapping)] if isinstance(value, list) else []


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
    return [
        indent + "  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip()
        for row in (header, *rows)
    ]


def _kernel_time(rec: Mapping[str, Any]) -> str:
    us = rec.get("monotonic_us")
    if isinstance(us, int) and not isinstance(us, bool):
        return f"[{us // 1_000_000:>6}.{us % 1_000_000:06d}]"
    return "[      -      ]"


def _record_lines(title: str, recs: list[Mapping[str, Any]]) -> list[str]:
    out = [f"    {title}:"] if recs else []
    for rec in recs:
        seq = f"#{rec['seq']} " if rec.get("seq") is not None else ""
        out.append(f"      {_s(rec.get('time'))} {_kernel_time(rec)} {seq}{_s(rec.get('line'))}")
    return out


def _header(capture: Mapping[str, Any], ev: Mapping[str, Any], location: str) -> list[str]:
    kube = _map(capture.get("kubernetes"))
    host = _map(ev.get("host"))
    labels = _map(kube.get("labels"))
    boot = ev.get("boot_id") or kube.get("boot_id")
    lines = [
        f"Evidence for node {_s(capture.get('node'))}",
        f"  captured at   {_s(capture.get('captured_at'))}",
        f"  stored at     {location}",
        f"  boot id       {_s(boot)}",
        f"  provider id   {_s(kube.get('provider_id'))}",
        f"  instance type {_s(labels.get('node.kubernetes.io/instance-type'))}"
        f"  zone {_s(labels.get('topology.kubernetes.io/zone'))}",
        f"  driver        {_s(host.get('driver_version'))}   CUDA {_s(host.get('cuda_driver_version'))}"
        f"   kernel {_s(host.get('kernel'))}",
        f"  exporter      {_s(ev.get('exporter_version'))}, collected at {_s(ev.get('collected_at'))}",
    ]
    fetch = _map(capture.get("fetch"))
    if fetch and not fetch.get("ok"):
        lines.append(f"  NODE EVIDENCE MISSING: {_s(fetch.get('error'))} (asked {_s(fetch.get('url'))})")
    return lines


def _alerts(capture: Mapping[str, Any]) -> list[str]:
    alerts = _list(capture.get("alerts"))
    lines = ["", "Alerts"] if alerts else []
    for alert in alerts:
        alabels = _map(alert.get("labels"))
        shown = ", ".join(f"{k}={v}" for k, v in sorted(alabels.items()) if k not in ("alertname", "node"))
        lines.append(
            f"  {_s(alert.get('alertname'))} {_s(alert.get('status'))} since {_s(alert.get('starts_at'))}"
            + (f"  {{{shown}}}" if shown else "")
        )
        summary = _map(alert.get("annotations")).get("summary")
        if summary:
            lines.append(f"      {summary}")
    return lines


def _devices(ev: Mapping[str, Any]) -> list[str]:
    lines: list[str] = []
    gpus = _list(ev.get("gpus"))
    if gpus:
        lines += ["", "GPUs"]
        keys = (
            "index",
            "serial",
            "uuid",
            "board_part_number",
            "vbios_version",
            "inforom_image_version",
            "pci_bus_id",
            "name",
        )
        header = ["GPU", "SERIAL", "UUID", "PART NUMBER", "VBIOS", "INFOROM", "PCI BUS", "NAME"]
        lines += _table(header, [[_s(g.get(k)) for k in keys] for g in gpus])
    neuron = _list(ev.get("neuron_devices"))
    if neuron:
        lines += ["", "Neuron devices"]
        for dev in neuron:
            rest = ", ".join(f"{k}={_s(v)}" for k, v in sorted(dev.items()) if k != "neuron_device")
            lines.append(f"  neuron{_s(dev.get('neuron_device'))}: {rest}")
    hcas = _list(ev.get("hcas"))
    if hcas:
        lines += ["", "InfiniBand HCAs"]
        hca_keys = ("device", "board_id", "fw_ver", "node_guid")
        lines += _table(
            ["DEVICE", "BOARD ID", "FIRMWARE", "NODE GUID"], [[_s(h.get(k)) for k in hca_keys] for h in hcas]
        )
    return lines


def _records(ev: Mapping[str, Any]) -> list[str]:
    records = _list(ev.get("records"))
    lines = ["", "Fault records" + ("" if records else ": none")]
    for group in records:
        code = f" {group['code']}" if group.get("code") not in (None, "") else ""
        lines.append(
            f"  {_s(group.get('kind'))}{code} on {_s(group.get('device'))}: seen {_s(group.get('seen'))}, "
            f"{_s(group.get('dropped'))} not kept"
        )
        first = _list(group.get("first"))
        shown = {(r.get("seq"), r.get("line")) for r in first}
        lines += _record_lines("first", first)
        lines += _record_lines(
            "last", [r for r in _list(group.get("last")) if (r.get("seq"), r.get("line")) not in shown]
        )
    checks = _list(ev.get("checks"))
    if checks:
        lines += ["", "Checks"]
        keys = ("check", "verdict", "finished_at", "message")
        lines += _table(
            ["CHECK", "VERDICT", "FINISHED", "MESSAGE"], [[_s(c.get(k)) for k in keys] for c in checks]
        )
    return lines


def _story(capture: Mapping[str, Any]) -> list[str]:
    lines: list[str] = []
    decisions = _list(capture.get("decisions"))
    if decisions:
        lines += ["", "Decisions of accel-health for the node"]
        for d in decisions:
            dry = " (dry-run)" if d.get("dry_run") else ""
            what = f"{_s(d.get('action'))} {_s(d.get('outcome'))}{dry}"
            lines.append(f"  {_s(d.get('time'))} {what}: {_s(d.get('reason'))}")
    timeline = _list(capture.get("timeline"))
    if timeline:
        lines += ["", "Timeline"]
        lines += [f"  {_s(t.get('at'))}  {_s(t.get('what'))}" for t in timeline]
    notes = [n for n in capture.get("notes") or [] if isinstance(n, str)]
    if notes:
        lines += ["", "Notes"] + [f"  {n}" for n in notes]
    return lines


def render(capture: Mapping[str, Any], *, location: str) -> str:
    """The report of one capture stored at `location`."""
    ev = _map(capture.get("node_evidence"))
    lines = [
        *_header(capture, ev, location),
        *_alerts(capture),
        *_devices(ev),
        *_records(ev),
        *_story(capture),
    ]
    return "\n".join(lines) + "\n"
