"""``dcgm``: NVIDIA DCGM's diagnostic (``dcgmi diag -r N -j``) where DCGM is installed, per test and GPU.

Two JSON shapes are in the field, both read here:

- DCGM 3.x: ``{"DCGM GPU Diagnostic": {"test_categories": [{"category", "tests": [{"name", "results":
  [{"gpu_ids": "0", "status": "Pass", "warnings": ["..."]}]}]}]}}``; a deployment test's ``gpu_ids``
  is a comma-separated list of every GPU it covered.
- DCGM 4.x: ``{"DCGM Diagnostic": {"test_categories": [... "results": [{"entity_group": "GPU",
  "entity_id": 0, "status": "Fail", "warnings": [{"warning": "...", "error_id": 29}]}]}]},
  "metadata": {"version": ...}}``; results of other entity groups (CPUs, switches) are left out.

Statuses become ``pass``/``fail``/``warn``/``skip``. ``dcgmi`` exits non-zero when a test fails and may
print a line before the JSON document; the document, not the exit status, is the verdict, and a run that
prints no document is an ``error`` carrying its output.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from exporter.checks.base import CheckInputError, CheckRequest, CheckResult, DeviceResult, Verdict, worst

TestStatus = Literal["pass", "fail", "warn", "skip"]

_STATUSES: Mapping[str, TestStatus] = {
    "pass": "pass",
    "fail": "fail",
    "warn": "warn",
    "warning": "warn",
    "skip": "skip",
    "skipped": "skip",
    "not run": "skip",
}


class DcgmOutputError(ValueError):
    """dcgmi printed nothing this module can read as a diagnostic."""


@dataclass(frozen=True)
class DcgmTestResult:
    test: str
    """The test's name as DCGM prints it (``PCIe``, ``memory``, ``Diagnostic``, ``software`` ...)."""
    gpu: str
    """GPU id (DCGM's, which is NVML's index)."""
    status: TestStatus
    warnings: tuple[str, ...] = ()


def _json_document(text: str) -> Any:
    start = text.find("{")
    end = text.rfind("}")
    if start < 0 or end < start:
        raise DcgmOutputError("no JSON document in dcgmi's output")
    try:
        return json.loads(text[start : end + 1])
    except json.JSONDecodeError as exc:
        raise DcgmOutputError(f"dcgmi's JSON does not parse: {exc}") from None


def _warnings(result: Mapping[str, Any]) -> tuple[str, ...]:
    found = []
    for warning in result.get("warnings") or []:
        text = warning.get("warning", "") if isinstance(warning, Mapping) else warning
        found.append(str(text))
    return tuple(found)


def _gpus(result: Mapping[str, Any]) -> list[str]:
    if "entity_group" in result:
        if str(result["entity_group"]).upper() != "GPU":
            return []
        return [str(int(result["entity_id"]))]
    ids = result.get("gpu_ids", result.get("gpu_id"))
    if ids is None:
        return []
    return [part.strip() for part in str(ids).split(",") if part.strip()]


def _tests(document: Any) -> Iterator[Mapping[str, Any]]:
    if not isinstance(document, Mapping):
        raise DcgmOutputError("dcgmi's JSON is not an object")
    root = document.get("DCGM GPU Diagnostic") or document.get("DCGM Diagnostic")
    if isinstance(root, Mapping) and isinstance(root.get("test_categories"), list):
        for category in root["test_categories"]:
            yield from category.get("tests") or []
    elif isinstance(document.get("tests"), list):
        yield from document["tests"]
    else:
        raise DcgmOutputError("dcgmi's JSON has no test_categories")


def parse_diag(text: str) -> list[DcgmTestResult]:
    """Per-test, per-GPU results of ``dcgmi diag -j`` output; raises :class:`DcgmOutputError`."""
    results: list[DcgmTestResult] = []
    try:
        for test in _tests(_json_document(text)):
            name = str(test["name"])
            for result in test.get("results") or []:
                raw = str(result.get("status", "")).strip().lower()
                status = _STATUSES.get(raw)
                if status is None:
                    raise DcgmOutputError(f"test {name!r}: unknown status {result.get('status')!r}")
                results.extend(DcgmTestResult(name, gpu, status, _warnings(result)) for gpu in _gpus(result))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        if isinstance(exc, DcgmOutputError):
            raise
        raise DcgmOutputError(f"unexpected dcgmi JSON: {type(exc).__name__}: {exc}") from None
    return results


Runner = Callable[[Sequence[str], float], tuple[int, str, str]]
"""(argv, timeout) -> (exit status, stdout, stderr); raises subprocess.TimeoutExpired."""


def _subprocess_runner(argv: Sequence[str], timeout: float) -> tuple[int, str, str]:
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=False)
    return done.returncode, done.stdout, done.stderr


class DcgmDiagCheck:
    """``dcgm``: ``dcgmi diag -r N -j`` on the reserved GPUs (``r`` 1 to 4, default 1)."""

    name = "dcgm"
    invasive = True

    def __init__(self, *, dcgmi: str = "dcgmi", runner: Runner = _subprocess_runner) -> None:
        self._dcgmi = dcgmi
        self._runner = runner

    def validate(self, params: Mapping[str, str]) -> None:
        self._level(params)

    @staticmethod
    def _level(params: Mapping[str, str]) -> int:
        text = params.get("r", "1")
        if text not in ("1", "2", "3", "4"):
            raise CheckInputError(f"r={text!r}: dcgmi diag runs levels 1, 2, 3 or 4")
        return int(text)

    def run(self, request: CheckRequest) -> CheckResult:  # noqa: PLR0911  one return per outcome
        started, begun = time.time(), time.monotonic()

        def done(verdict: Verdict, message: str, **more: Any) -> CheckResult:
            return CheckResult(self.name, verdict, started, time.monotonic() - begun, message=message, **more)

        executable = shutil.which(self._dcgmi)
        if executable is None:
            return done("skipped", f"{self._dcgmi} is not installed (DCGM)")
        argv = [executable, "diag", "-r", str(self._level(request.params)), "-j"]
        if request.gpus is not None:
            if not request.gpus:
                return done("skipped", "no idle GPU to diagnose")
            argv += ["-i", ",".join(str(gpu.index) for gpu in request.gpus)]
        try:
            status, stdout, stderr = self._runner(argv, request.deadline)
        except subprocess.TimeoutExpired:
            return done("error", f"dcgmi diag did not finish within {request.deadline:g} s")
        except OSError as exc:
            return done("error", f"cannot run {executable}: {exc.strerror or exc}")
        try:
            tests = parse_diag(stdout)
        except DcgmOutputError as exc:
            output = (stderr.strip() or stdout.strip())[-300:]
            return done("error", f"{exc} (exit status {status}): {output}")
        if request.gpus is not None:  # only the GPUs it was given (never report on a busy one)
            given = {str(gpu.index) for gpu in request.gpus}
            tests = [t for t in tests if t.gpu in given]
        if not tests:
            return done("error", f"dcgmi diag reported no test results (exit status {status})")
        bus_ids = {str(gpu.index): gpu.pci_bus_id for gpu in request.gpus or ()}
        devices = []
        for gpu in sorted({t.gpu for t in tests}, key=lambda g: (len(g), g)):
            own = [t for t in tests if t.gpu == gpu]
            failed = [t.test for t in own if t.status == "fail"]
            verdict: Verdict = "fail" if failed else "pass"
            values = {"tests_failed": float(len(failed)), "tests_run": float(len(own))}
            detail = "failed: " + ", ".join(failed) if failed else ""
            devices.append(DeviceResult(gpu, verdict, values, bus_ids.get(gpu, ""), detail))
        extra = {
            "level": self._level(request.params),
            "tests": [
                {"test": t.test, "gpu": t.gpu, "status": t.status, "warnings": list(t.warnings)}
                for t in tests
            ],
        }
        message = "; ".join(f"GPU {d.device}: {d.detail}" for d in devices if d.detail)
        return done(worst([d.verdict for d in devices]), message, devices=tuple(devices), extra=extra)
