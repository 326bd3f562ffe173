"""``ping`` and ``iperf``: every peer node over each secondary network interface.

Peers are the other exporter pods, found through the Kubernetes API (``list_pods`` answers the pods
labelled ``app.kubernetes.io/name=accel-health-exporter`` as JSON objects). Secondary interfaces are
the pods' network attachments as Multus records them in the ``k8s.v1.cni.cncf.io/network-status``
annotation (``[{"name": "ns/rdma-0", "interface": "net1", "ips": ["10.0.0.5"], "default": false}]``):
this node's exporter pod tells which interface is on which network, a peer's tells its addresses on
that network. The cluster network (``"default": true``) is left out: the kubelet and the scrape
already show it works.

- ``ping``: ``ping -c N -I <interface> <peer address>`` for every (interface, peer), a few at once;
  values ``reachable`` (1/0) and ``rtt_seconds``. A peer that answers nothing fails; one whose pod has
  no address on a network is not tried there.
- ``iperf``: ``iperf3 -c <peer address> -B <own address> -J`` to every peer, one after the other (two
  measurements at once would share the link); value ``bytes_per_second`` (received). It needs an
  ``iperf3 -s`` on every peer, which :class:`IperfServer` runs beside the exporter when ``iperf`` is
  enabled. Where iperf3 is not installed the check is ``skipped``.

``command`` prefixes (``["ip", "netns", "exec", "n1"]``) run the tools elsewhere; tests use them with
network namespaces.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from exporter.checks.base import (
    CheckInputError,
    CheckRequest,
    CheckResult,
    DeviceResult,
    Verdict,
    float_param,
    worst,
)

EXPORTER_SELECTOR = "app.kubernetes.io/name=accel-health-exporter"
"""The label selector of the exporter pods: this node's peers, and the nodes ``accel-health check`` asks."""
NETWORK_STATUS = "k8s.v1.cni.cncf.io/network-status"
IPERF_PORT = 5201
_RECEIVED = re.compile(r"(\d+) packets transmitted, (\d+) (?:packets )?received")
_RTT = re.compile(r"= [\d.]+/([\d.]+)/[\d.]+(?:/[\d.]+)? ms")
_INTERFACE = re.compile(r"^[A-Za-z0-9_.:@-]{1,15}$")

ListPods = Callable[[], list[Mapping[str, Any]]]


@dataclass(frozen=True)
class Attachment:
    """One network a pod is attached to."""

    network: str
    """Multus's name for it (``namespace/name``)."""
    interface: str
    """The interface in the pod (``net1``)."""
    ips: tuple[str, ...]


@dataclass(frozen=True)
class Route:
    """One thing to measure: this node's ``interface`` (address ``source``) to ``peer`` at ``address``."""

    interface: str
    source: str
    peer: str
    address: str

    @property
    def key(self) -> str:
        return f"{self.interface}/{self.peer}"


def attachments(pod: Mapping[str, Any]) -> list[Attachment]:
    """The pod's secondary networks from its Multus network-status annotation (none if it has none or
    the annotation is not valid JSON)."""
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    try:
        status = json.loads(annotations.get(NETWORK_STATUS, "[]"))
    except (TypeError, ValueError):
        return []
    found = []
    for entry in status if isinstance(status, list) else []:
        if not isinstance(entry, Mapping) or entry.get("default"):
            continue
        interface, network = str(entry.get("interface") or ""), str(entry.get("name") or "")
        ips = tuple(str(ip) for ip in entry.get("ips") or [])
        if interface and network and _INTERFACE.match(interface):
            found.append(Attachment(network, interface, ips))
    return found


def paths(pods: Sequence[Mapping[str, Any]], node: str) -> tuple[list[Route], str]:
    """What to measure from ``node``: (interface, peer) paths over shared secondary networks, and why
    there is nothing when there is nothing ("" otherwise)."""
    by_node: dict[str, Mapping[str, Any]] = {}
    for pod in pods:
        name = (pod.get("spec") or {}).get("nodeName")
        if name and (pod.get("status") or {}).get("phase", "Running") == "Running":
            by_node[str(name)] = pod
    own = by_node.pop(node, None)
    if own is None:
        return [], f"no running exporter pod on node {node!r}"
    mine = [a for a in attachments(own) if a.ips]
    if not mine:
        return [], "this node's exporter pod has no secondary network (Multus network-status)"
    if not by_node:
        return [], "no peer exporter pods"
    found = []
    for attachment in mine:
        for peer in sorted(by_node):
            for theirs in attachments(by_node[peer]):
                if theirs.network == attachment.network and theirs.ips:
                    found.append(Route(attachment.interface, attachment.ips[0], peer, theirs.ips[0]))
    if not found:
        return [], "no peer shares a secondary network with this node"
    return found, ""


def parse_ping(output: str) -> tuple[int, int, float | None]:
    """(sent, received, average rtt in seconds) from iputils ping's summary; raises ValueError."""
    counts = _RECEIVED.search(output)
    if counts is None:
        raise ValueError("no packet summary in ping's output")
    rtt = _RTT.search(output)
    return int(counts[1]), int(counts[2]), (float(rtt[1]) / 1000.0 if rtt else None)


def parse_iperf(output: str) -> float:
    """Bits per second the receiver counted, from ``iperf3 -J``; raises ValueError (with iperf3's own
    error when it reports one)."""
    try:
        document = json.loads(output)
    except ValueError:
        raise ValueError("iperf3 printed no JSON document") from None
    if document.get("error"):
        raise ValueError(f"iperf3: {document['error']}")
    try:
        return float(document["end"]["sum_received"]["bits_per_second"])
    except (KeyError, TypeError, ValueError):
        raise ValueError("iperf3's JSON has no end.sum_received.bits_per_second") from None


def _result(name: str, started: float, begun: float, devices: list[DeviceResult], empty: str) -> CheckResult:
    duration = time.monotonic() - begun
    if not devices:
        return CheckResult(name, "skipped", started, duration, message=empty)
    verdict = worst([d.verdict for d in devices])
    message = "; ".join(f"{d.device}: {d.detail}" for d in devices if d.verdict in ("fail", "error"))
    return CheckResult(name, verdict, started, duration, tuple(devices), message)


class _NetworkCheck:
    invasive = False
    name = ""

    def __init__(self, list_pods: ListPods, *, node: str, command: Sequence[str] = ()) -> None:
        self._list_pods = list_pods
        self._node = node
        self._prefix = list(command)

    def _paths(self) -> tuple[list[Route], str]:
        if not self._node:
            return [], "this node's name is unknown (--node-name or NODE_NAME)"
        try:
            pods = self._list_pods()
        except Exception as exc:  # the API unreachable or forbidden: the check cannot know its peers
            return [], f"cannot list the exporter pods: {exc}"
        return paths(pods, self._node)


class PingCheck(_NetworkCheck):
    """``ping``: reachability and round-trip time of every peer over each secondary interface."""

    name = "ping"

    def __init__(
        self, list_pods: ListPods, *, node: str, command: Sequence[str] = (), ping: str = "ping"
    ) -> None:
        super().__init__(list_pods, node=node, command=command)
        self._ping = ping

    def validate(self, params: Mapping[str, str]) -> None:
        self._settings(params)

    def _settings(self, params: Mapping[str, str]) -> tuple[int, float]:
        count = float_param(params, "count", 3, low=1, high=20)
        if count != int(count):
            raise CheckInputError(f"count={params['count']!r} is not a whole number")
        return int(count), float_param(params, "wait", 1.0, low=0.1, high=10.0)

    def run(self, request: CheckRequest) -> CheckResult:
        started, begun = time.time(), time.monotonic()
        count, wait = self._settings(request.params)
        if self._prefix == [] and shutil.which(self._ping) is None:
            return CheckResult(self.name, "skipped", started, 0.0, message=f"{self._ping} is not installed")
        found, why = self._paths()
        if not found:
            verdict: Verdict = "error" if why.startswith("cannot") else "skipped"
            return CheckResult(self.name, verdict, started, time.monotonic() - begun, message=why)
        seconds = count * wait + 2.0

        def one(path: Route) -> DeviceResult:
            argv = [*self._prefix, self._ping, "-n", "-q", "-c", str(count), "-W", f"{wait:g}"]
            argv += ["-i", "0.2", "-I", path.interface, path.address]
            try:
                done = subprocess.run(argv, capture_output=True, text=True, timeout=seconds, check=False)
                sent, received, rtt = parse_ping(done.stdout)
            except (OSError, subprocess.TimeoutExpired, ValueError) as exc:
                return DeviceResult(path.key, "error", detail=f"ping {path.address}: {exc}")
            values = {"reachable": 1.0 if received else 0.0}
            if rtt is not None:
                values["rtt_seconds"] = rtt
            if not received:
                return DeviceResult(path.key, "fail", values, detail=f"{path.address} unreachable")
            detail = f"{sent - received} of {sent} lost" if received < sent else ""
            return DeviceResult(path.key, "pass", values, detail=detail)

        with ThreadPoolExecutor(max_workers=min(16, len(found)), thread_name_prefix="ping") as pool:
            devices = list(pool.map(one, found))
        return _result(self.name, started, begun, devices, why)


class IperfCheck(_NetworkCheck):
    """``iperf``: TCP bandwidth to every peer over each secondary interface, one peer at a time."""

    name = "iperf"

    def __init__(
        self,
        list_pods: ListPods,
        *,
        node: str,
        command: Sequence[str] = (),
        iperf3: str = "iperf3",
        port: int = IPERF_PORT,
    ) -> None:
        super().__init__(list_pods, node=node, command=command)
        self._iperf3 = iperf3
        self._port = port

    def validate(self, params: Mapping[str, str]) -> None:
        float_param(params, "seconds", 5.0, low=1.0, high=60.0)

    def run(self, request: CheckRequest) -> CheckResult:
        started, begun = time.time(), time.monotonic()
        seconds = float_param(request.params, "seconds", 5.0, low=1.0, high=60.0)
        if self._prefix == [] and shutil.which(self._iperf3) is None:
            return CheckResult(self.name, "skipped", started, 0.0, message=f"{self._iperf3} is not installed")
        found, why = self._paths()
        if not found:
            verdict: Verdict = "error" if why.startswith("cannot") else "skipped"
            return CheckResult(self.name, verdict, started, time.monotonic() - begun, message=why)
        devices = []
        for path in found:
            if time.monotonic() - begun + seconds > request.deadline:
                devices.append(DeviceResult(path.key, "skipped", detail="not measured: deadline"))
                continue
            argv = [*self._prefix, self._iperf3, "-c", path.address, "-B", path.source]
            argv += ["-p", str(self._port), "-t", f"{seconds:g}", "-J", "--connect-timeout", "3000"]
            try:
                done = subprocess.run(
                    argv, capture_output=True, text=True, timeout=seconds + 10.0, check=False
                )
                rate = parse_iperf(done.stdout)
            except (OSError, subprocess.TimeoutExpired, ValueError) as exc:
                devices.append(DeviceResult(path.key, "fail", detail=f"iperf3 to {path.address}: {exc}"))
                continue
            devices.append(DeviceResult(path.key, "pass", {"bytes_per_second": rate / 8}))
        return _result(self.name, started, begun, devices, why)


class IperfServer:
    """``iperf3 -s`` beside the exporter, so peers can measure to this node; restarted if it exits."""

    def __init__(
        self, *, command: Sequence[str] = (), iperf3: str = "iperf3", port: int = IPERF_PORT
    ) -> None:
        self._argv = [*command, iperf3, "-s", "-p", str(port)]
        self._stop = threading.Event()
        self._process: subprocess.Popen[bytes] | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        def keep() -> None:
            while not self._stop.is_set():
                try:
                    self._process = subprocess.Popen(
                        self._argv,
                        stdin=subprocess.DEVNULL,
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                    )
                except OSError:
                    return  # not installed: the iperf check says so when it runs
                self._process.wait()
                self._stop.wait(5.0)

        self._thread = threading.Thread(target=keep, name="iperf3-server", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
