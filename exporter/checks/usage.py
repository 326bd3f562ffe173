"""Who is using the GPUs: an invasive check runs only on a GPU nothing uses.

Two probes, both failing safe (a probe that cannot tell reports every GPU in use):

- :class:`NvmlProcesses`: compute and graphics processes on each GPU, per NVML.
- :class:`PodAccelerators`: a pod on this node (not finished) that requests accelerators
  (``nvidia.com/gpu``, MIG slices, ``aws.amazon.com/neuron*``) holds every GPU of the node: the device
  plugin, not this process, knows which GPUs it was given, and a pod between two batches may have no
  process on its GPU right now.
"""

from __future__ import annotations

import importlib
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from exporter.checks.base import Gpu

logger = logging.getLogger(__name__)

ACCELERATOR_RESOURCES = re.compile(
    r"^(nvidia\.com/(gpu|mig-.+)|aws\.amazon\.com/neuron(core|device)?|amd\.com/gpu)$"
)


class UsageProbe(Protocol):
    def in_use(self, gpus: Sequence[Gpu]) -> dict[int, str]:
        """GPU index -> why it is in use, for the GPUs of ``gpus`` something uses."""
        ...


class NvmlProcesses:
    """Processes on each GPU (``nvmlDeviceGetComputeRunningProcesses``, ``...GraphicsRunningProcesses``)."""

    def __init__(self, *, library: Any = None) -> None:
        self._library = library

    def in_use(self, gpus: Sequence[Gpu]) -> dict[int, str]:
        try:
            nvml = self._library or importlib.import_module("pynvml")
            nvml.nvmlInit()
        except Exception as exc:  # no driver, no library: cannot tell, so every GPU counts as used
            return {gpu.index: f"cannot list GPU processes: {exc}" for gpu in gpus}
        try:
            busy = {}
            for gpu in gpus:
                try:
                    handle = nvml.nvmlDeviceGetHandleByIndex(gpu.index)
                    processes = list(nvml.nvmlDeviceGetComputeRunningProcesses(handle))
                    processes += list(nvml.nvmlDeviceGetGraphicsRunningProcesses(handle))
                except nvml.NVMLError as exc:
                    busy[gpu.index] = f"cannot list GPU processes: {exc}"
                    continue
                if processes:
                    pids = sorted({int(p.pid) for p in processes})
                    busy[gpu.index] = (
                        f"{len(pids)} process(es) on the GPU (pid {', '.join(map(str, pids[:5]))})"
                    )
            return busy
        finally:
            nvml.nvmlShutdown()


def requests_accelerators(pod: Mapping[str, Any]) -> str | None:
    """The accelerator resource a running or pending pod requests, None if it requests none or is done."""
    status = pod.get("status") or {}
    if status.get("phase") in ("Succeeded", "Failed"):
        return None
    spec = pod.get("spec") or {}
    for container in [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]:
        resources = container.get("resources") or {}
        for kind in ("limits", "requests"):
            for name, amount in (resources.get(kind) or {}).items():
                if ACCELERATOR_RESOURCES.match(name) and str(amount) not in ("0", ""):
                    return f"{name}={amount}"
    return None


class PodAccelerators:
    """Pods on this node requesting accelerators, from ``list_pods`` (the node's pods as JSON objects)."""

    def __init__(self, list_pods: Callable[[], list[Mapping[str, Any]]]) -> None:
        self._list_pods = list_pods

    def in_use(self, gpus: Sequence[Gpu]) -> dict[int, str]:
        try:
            pods = self._list_pods()
        except Exception as exc:  # the API unreachable or forbidden: cannot tell, so every GPU is in use
            logger.warning("checks: cannot list this node's pods: %s", exc)
            return {gpu.index: f"cannot list this node's pods: {exc}" for gpu in gpus}
        for pod in pods:
            resource = requests_accelerators(pod)
            if resource is not None:
                meta = pod.get("metadata") or {}
                why = f"pod {meta.get('namespace', '')}/{meta.get('name', '')} requests {resource}"
                return {gpu.index: why for gpu in gpus}
        return {}
