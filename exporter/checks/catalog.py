"""The checks an exporter can offer, by name, built from the readers it already has."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from exporter.checks.bandwidth import MemoryBandwidthCheck, PcieBandwidthCheck
from exporter.checks.base import Check
from exporter.checks.cuda import CudaDriver
from exporter.checks.dcgm import DcgmDiagCheck
from exporter.checks.network import IperfCheck, ListPods, PingCheck
from exporter.checks.nvml_checks import PowerSlowdownCheck, RemappedRowsCheck
from exporter.readers.nvml import NvmlReader

KNOWN = ("pciebw", "gpumem", "remapped", "power", "dcgm", "ping", "iperf")


def parse_names(text: str) -> tuple[str, ...]:
    """``pciebw,dcgm`` / ``all`` / empty -> names; raises ValueError for an unknown one."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if names == ["all"]:
        return KNOWN
    unknown = [n for n in names if n not in KNOWN]
    if unknown:
        raise ValueError(f"unknown check(s) {', '.join(unknown)}; known: {', '.join(KNOWN)}, all")
    return tuple(dict.fromkeys(names))


def _no_api() -> list[Mapping[str, Any]]:
    raise RuntimeError("no Kubernetes API to find peers through")


def build_checks(
    names: Sequence[str],
    *,
    nvml: NvmlReader | None,
    cuda: CudaDriver,
    dcgmi: str = "dcgmi",
    peers: ListPods | None = None,
    node: str = "",
) -> list[Check]:
    """The named checks; raises ValueError for ``remapped``/``power`` without NVML. ``ping`` and
    ``iperf`` find their peers with ``peers`` (the exporter pods, from the Kubernetes API) and skip
    themselves while ``node`` (this node's name) is unknown."""
    checks: list[Check] = []
    for name in names:
        if name == "pciebw":
            checks.append(PcieBandwidthCheck(cuda))
        elif name == "gpumem":
            checks.append(MemoryBandwidthCheck(cuda))
        elif name == "dcgm":
            checks.append(DcgmDiagCheck(dcgmi=dcgmi))
        elif name in ("remapped", "power"):
            if nvml is None:
                raise ValueError(f"check {name} reads NVML, which --nvml=off turns off")
            checks.append(RemappedRowsCheck(nvml) if name == "remapped" else PowerSlowdownCheck(nvml))
        elif name in ("ping", "iperf"):
            found = peers or _no_api
            checks.append(PingCheck(found, node=node) if name == "ping" else IperfCheck(found, node=node))
        else:
            raise ValueError(f"unknown check {name!r}")
    return checks
