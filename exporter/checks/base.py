"""The one interface every active check implements, and the typed result it returns."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

Verdict = Literal["pass", "fail", "error", "skipped"]
"""``pass``: measured and healthy; ``fail``: measured and a device is faulty; ``error``: the check could
not measure (no driver, a call failed, its deadline passed); ``skipped``: nothing to run on (every GPU
in use, or the tool the check needs is not installed)."""

VERDICT_ORDER: Mapping[Verdict, int] = {"pass": 0, "skipped": 1, "fail": 2, "error": 3}
"""Worst wins when verdicts are combined: an error hides more than a failure tells."""


class CheckInputError(ValueError):
    """A request parameter a check cannot accept (answered 400, nothing runs)."""


@dataclass(frozen=True)
class DeviceResult:
    """One device's outcome in one run: a GPU (``device`` is its index) or a network peer."""

    device: str
    """GPU index (PCI bus order, as NVML numbers them), or ``interface/peer`` for network checks."""
    verdict: Verdict
    values: Mapping[str, float] = field(default_factory=dict)
    """Measured values by quantity, in base units (bytes per second, seconds, 0/1 flags)."""
    pci_bus_id: str = ""
    """Normalised ``0000:1b:00`` for GPUs; empty for peers."""
    detail: str = ""
    """Why a device failed or was skipped, in words."""


@dataclass(frozen=True)
class CheckResult:
    """One run of one check on one node."""

    check: str
    verdict: Verdict
    started: float
    """Unix time the run began."""
    duration: float
    """Seconds the run took."""
    devices: tuple[DeviceResult, ...] = ()
    message: str = ""
    """A line for people: what failed, or why nothing was measured."""
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Check-specific structured output (DCGM's per-test results), carried into the JSON answer."""

    def to_json(self) -> dict[str, Any]:
        return {
            "check": self.check,
            "verdict": self.verdict,
            "started": self.started,
            "duration": self.duration,
            "message": self.message,
            "devices": [
                {
                    "device": d.device,
                    "pci_bus_id": d.pci_bus_id,
                    "verdict": d.verdict,
                    "values": dict(d.values),
                    "detail": d.detail,
                }
                for d in self.devices
            ],
            **({"extra": dict(self.extra)} if self.extra else {}),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CheckResult:
        """The inverse of :meth:`to_json`; raises KeyError/TypeError/ValueError on a malformed document."""
        verdict = _verdict(data["verdict"])
        devices = tuple(
            DeviceResult(
                device=str(d["device"]),
                verdict=_verdict(d["verdict"]),
                values={str(k): float(v) for k, v in dict(d.get("values", {})).items()},
                pci_bus_id=str(d.get("pci_bus_id", "")),
                detail=str(d.get("detail", "")),
            )
            for d in data.get("devices", [])
        )
        return cls(
            check=str(data["check"]),
            verdict=verdict,
            started=float(data["started"]),
            duration=float(data["duration"]),
            devices=devices,
            message=str(data.get("message", "")),
            extra=dict(data.get("extra", {})),
        )


def _verdict(value: object) -> Verdict:
    if value not in VERDICT_ORDER:
        raise ValueError(f"not a verdict: {value!r}")
    verdict: Verdict = value  # type: ignore[assignment]  # checked against the Literal's members above
    return verdict


def worst(verdicts: Sequence[Verdict], *, empty: Verdict = "skipped") -> Verdict:
    """The worst of ``verdicts`` (see :data:`VERDICT_ORDER`); ``empty`` when there are none."""
    return max(verdicts, key=VERDICT_ORDER.__getitem__) if verdicts else empty


@dataclass(frozen=True)
class Gpu:
    """A GPU a check may use."""

    index: int
    """PCI bus order, as NVML numbers GPUs (the ``gpu`` label everywhere in accel-health)."""
    pci_bus_id: str
    """Normalised ``0000:1b:00``."""


@dataclass(frozen=True)
class CheckRequest:
    """What one run of a check may touch and how it is asked to run."""

    gpus: tuple[Gpu, ...] | None = None
    """The GPUs the runner reserved for this run (idle, not under another check); None: the check
    touches no GPU (NVML reads, network) or finds them itself."""
    params: Mapping[str, str] = field(default_factory=dict)
    """Query parameters of the request (``r=2`` for DCGM), already validated by :meth:`Check.validate`."""
    deadline: float = 60.0
    """Seconds the run may take; a check that starts a subprocess passes it on."""


class Check(Protocol):
    """An active health check."""

    @property
    def name(self) -> str:
        """The ``check`` label, and its name in ``GET /checks?check=``."""
        ...

    @property
    def invasive(self) -> bool:
        """Whether it loads the GPU (copies, kernels, diagnostics): runs only on idle GPUs, one check
        per GPU at a time."""
        ...

    def validate(self, params: Mapping[str, str]) -> None:
        """Raises :class:`CheckInputError` for parameters this check cannot take."""
        ...

    def run(self, request: CheckRequest) -> CheckResult: ...


def below_node_median(values: Mapping[str, float], *, ratio: float) -> set[str]:
    """The keys whose value is below ``ratio`` times the median of all values (of at least 3 devices:
    with fewer, the median says nothing about which device is the odd one)."""
    if len(values) < 3:
        return set()
    median = statistics.median(values.values())
    return {key for key, value in values.items() if value < ratio * median}


def float_param(params: Mapping[str, str], key: str, default: float, *, low: float, high: float) -> float:
    """A numeric parameter within [low, high]; raises :class:`CheckInputError` otherwise."""
    text = params.get(key)
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        raise CheckInputError(f"{key}={text!r} is not a number") from None
    if not low <= value <= high:
        raise CheckInputError(f"{key}={text!r} is outside [{low:g}, {high:g}]")
    return value
