"""A simulated fleet of 8-GPU nodes for real Prometheus, cheap enough to run on the same machine.

What Prometheus scrapes, and how, comes from the shipped configuration
(deploy/prometheus/prometheus.yaml), never from this module: :func:`exporter_jobs` plays every scrape
job's ``relabel_configs`` (Prometheus's own semantics, :func:`relabel`) on the targets Kubernetes pod
discovery would give for a pod of the rendered exporter DaemonSet, and keeps the jobs that keep it,
each with the ``metrics_path``, ``scrape_interval`` and ``scrape_timeout`` it scrapes with. One job on
/metrics every 5 s or a fast and a slow job on /metrics/fast and /metrics/slow: both work.

The bodies come from the real exporter: :func:`capture` starts it on the simulated node
examples/nodes/gpu-node-1 with simulated NVML (``python -m examples.fake_gpus``, a short-lived
subprocess) and keeps what each scraped path serves. Every simulated node serves those bodies with its
own per-device identities (GPU UUIDs, serial numbers, GUIDs: :data:`IDENTITY_LABEL`), rewritten
deterministically from the node's name (:class:`Exposition`), so a fleet's series are as distinct as a
real fleet's; ``node`` and ``instance`` come from the shipped relabeling, as in a cluster.

:class:`FleetServer` serves every node from one thread of one process: one socket bound to 0.0.0.0 on
one port, and node *i* at its own loopback address (:func:`node_address`, 127.100.x.y: all of 127/8
reaches loopback on Linux); the socket's local address says which node a connection is for, and each
response (status line, headers and body, per node and path) is bytes made once. A connection to any
other local address is closed at once.

Prometheus finds the nodes as it would in a cluster: :func:`prometheus_config` replaces each job's
``kubernetes_sd_configs`` by ``file_sd_configs`` whose target groups carry the
``__meta_kubernetes_*`` labels pod discovery gives (tests/kube/deployed.py's ``pod_targets``, the
as-deployed harness's own discovery), so the shipped ``relabel_configs`` run unchanged. A few nodes
can be real exporters (fault injection): :func:`exporter_pod` describes a pod at any address and port,
simulated or not.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import ipaddress
import json
import re
import shutil
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
# Run as `python bench/...`: the harness lives in tests/, the fakes in examples/.
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from examples.pipeline import free_port  # noqa: E402  after sys.path
from exporter.exposition import CONTENT_TYPE  # noqa: E402  after sys.path
from tests.deploy import kube as deploy_kube  # noqa: E402  after sys.path
from tests.kube.controlplane import Process, spawn, wait_for  # noqa: E402  after sys.path
from tests.kube.deployed import EXPORTER, NAMESPACE, pod_targets  # noqa: E402  after sys.path

Obj = dict[str, Any]

SHIPPED_CONFIG = REPO / "deploy" / "prometheus" / "prometheus.yaml"
RULES = REPO / "alerts"
NODE_FIXTURE = REPO / "examples" / "nodes" / "gpu-node-1"
FIRST_ADDRESS = ipaddress.IPv4Address("127.100.0.1")
"""Node 0's address; node i is at FIRST_ADDRESS + i (room for about 10 million nodes)."""

IDENTITY_LABEL = re.compile(r"(?:^|_)(?:uuid|guid|serial|serial_number)$")
"""Label names whose values name one physical device (unique across a fleet): rewritten per node."""

_LABEL_PAIR = re.compile(rb'[{,]([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\.)*)"')
_DURATION = re.compile(r"(\d+)(ms|s|m|h|d|w|y)")
_UNIT_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}


# -- the shipped configuration ------------------------------------------------------------------------


def parse_duration(text: str) -> float:
    """A Prometheus duration ("5s", "1m30s", "500ms") in seconds."""
    parts = _DURATION.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"not a Prometheus duration: {text!r}")
    return sum(int(n) * _UNIT_SECONDS[u] for n, u in parts)


def format_duration(seconds: float) -> str:
    """Seconds as a Prometheus duration (whole milliseconds)."""
    return f"{round(seconds * 1000)}ms" if seconds % 1 else f"{int(seconds)}s"


def _expand(template: str, match: re.Match[str]) -> str:
    """Go's Regexp.ExpandString: $1, ${1}, $name, ${name}; $$ is a dollar; an unknown group is empty."""

    def group(found: re.Match[str]) -> str:
        if found.group(0) == "$$":
            return "$"
        name = found.group(1) or found.group(2)
        try:
            value = match.group(int(name) if name.isdigit() else name)
        except IndexError:  # no such group
            return ""
        return value or ""

    return re.sub(r"\$\$|\$\{(\w+)\}|\$(\w+)", group, template)


@dataclass(frozen=True)
class _Step:
    """One relabel_configs entry, applied to one target's labels."""

    regex: re.Pattern[str]
    value: str
    """The source labels' values, joined by the separator."""
    target: str
    replacement: str
    modulus: int


def _replace(labels: dict[str, str], step: _Step) -> dict[str, str] | None:
    match = step.regex.match(step.value)
    if match:
        name, result = _expand(step.target, match), _expand(step.replacement, match)
        if result:
            labels[name] = result
        else:
            labels.pop(name, None)
    return labels


def _labelmap(labels: dict[str, str], step: _Step) -> dict[str, str] | None:
    for name, value in list(labels.items()):
        if match := step.regex.match(name):
            labels[_expand(step.replacement, match)] = value
    return labels


def _hashmod(labels: dict[str, str], step: _Step) -> dict[str, str] | None:
    digest = hashlib.md5(step.value.encode(), usedforsecurity=False).digest()
    labels[step.target] = str(int.from_bytes(digest[8:], "big") % step.modulus)
    return labels


def _case(upper: bool) -> Callable[[dict[str, str], _Step], dict[str, str] | None]:
    def apply(labels: dict[str, str], step: _Step) -> dict[str, str] | None:
        labels[step.target] = step.value.upper() if upper else step.value.lower()
        return labels

    return apply


_ACTIONS: dict[str, Callable[[dict[str, str], _Step], dict[str, str] | None]] = {
    "replace": _replace,
    "keep": lambda labels, step: labels if step.regex.match(step.value) else None,
    "drop": lambda labels, step: None if step.regex.match(step.value) else labels,
    "keepequal": lambda labels, step: labels if step.value == labels.get(step.target, "") else None,
    "dropequal": lambda labels, step: None if step.value == labels.get(step.target, "") else labels,
    "hashmod": _hashmod,
    "lowercase": _case(upper=False),
    "uppercase": _case(upper=True),
    "labelmap": _labelmap,
    "labeldrop": lambda labels, step: {k: v for k, v in labels.items() if not step.regex.match(k)},
    "labelkeep": lambda labels, step: {k: v for k, v in labels.items() if step.regex.match(k)},
}


def relabel(labels: Mapping[str, str], configs: Sequence[Mapping[str, Any]]) -> dict[str, str] | None:
    """Prometheus's relabeling of one target (or None where it is dropped), every action Prometheus
    2.42 has; regexes anchored at both ends as Prometheus anchors them."""
    out: dict[str, str] | None = dict(labels)
    for config in configs:
        assert out is not None
        action = config.get("action", "replace")
        if action not in _ACTIONS:
            raise ValueError(f"unknown relabel action {action!r}")
        step = _Step(
            regex=re.compile(f"^(?:{config.get('regex', '(.*)')})$"),
            value=config.get("separator", ";").join(
                out.get(n, "") for n in config.get("source_labels") or []
            ),
            target=config.get("target_label", ""),
            replacement=str(config.get("replacement", "$1")),
            modulus=int(config.get("modulus", 0)),
        )
        out = _ACTIONS[action](out, step)
        if out is None:
            return None
    return out


@dataclass(frozen=True)
class ScrapeJob:
    """One job of the configuration that scrapes the exporter pods, as it scrapes them."""

    name: str
    index: int
    """Its position in scrape_configs."""
    metrics_path: str
    interval: float
    """Seconds between two scrapes of a target."""
    timeout: float
    """Seconds a scrape may take."""
    port_names: frozenset[str]
    """The exporter container's ports the job keeps (by name)."""


def load_config(path: Path = SHIPPED_CONFIG) -> Obj:
    config: Obj = yaml.safe_load(path.read_text())
    return config


def exporter_template(overlay: str = "enforce") -> Obj:
    """The exporter DaemonSet's pod template, as `kubectl kustomize deploy/overlays/<overlay>` renders it."""
    for obj in deploy_kube.render(REPO / "deploy" / "overlays" / overlay):
        if obj["kind"] == "DaemonSet" and obj["metadata"]["name"] == EXPORTER:
            template: Obj = obj["spec"]["template"]
            return template
    raise LookupError(f"no DaemonSet {EXPORTER} in deploy/overlays/{overlay}")


def exporter_pod(
    template: Obj, *, node: str, ip: str, port: int | None = None, ports: Iterable[str] = ()
) -> Obj:
    """A pod of the exporter DaemonSet on `node` at `ip`, Running and Ready, as pod discovery sees it;
    with `port`, the container ports named in `ports` are at that port (a simulated node's server, a
    real exporter's --listen)."""
    names = set(ports)
    pod: Obj = json.loads(json.dumps({"metadata": template.get("metadata") or {}, "spec": template["spec"]}))
    suffix = hashlib.sha256(node.encode()).hexdigest()[:5]
    pod["metadata"] |= {"namespace": NAMESPACE, "name": f"{EXPORTER}-{suffix}", "uid": f"uid-{node}"}
    pod["spec"]["nodeName"] = node
    for container in pod["spec"]["containers"]:
        for container_port in container.get("ports") or []:
            if port is not None and container_port.get("name") in names:
                container_port["containerPort"] = port
    pod["status"] = {
        "podIP": ip,
        "hostIP": ip,
        "phase": "Running",
        "conditions": [{"type": "Ready", "status": "True"}],
    }
    return pod


def _job_defaults(config: Obj, job: Obj) -> tuple[float, float]:
    defaults = config.get("global") or {}
    interval = parse_duration(job.get("scrape_interval") or defaults.get("scrape_interval") or "1m")
    timeout = parse_duration(job.get("scrape_timeout") or defaults.get("scrape_timeout") or "10s")
    return interval, min(timeout, interval)


def target_labels(config: Obj, job: Obj, group: Obj) -> dict[str, str] | None:
    """What Prometheus makes of one discovered target for `job`: the labels after relabeling (the
    `__`-prefixed ones included, so the address, path and intervals can be read), or None if dropped."""
    interval, timeout = _job_defaults(config, job)
    labels = {
        "job": job["job_name"],
        "__address__": group["targets"][0],
        "__scheme__": job.get("scheme", "http"),
        "__metrics_path__": job.get("metrics_path", "/metrics"),
        "__scrape_interval__": format_duration(interval),
        "__scrape_timeout__": format_duration(timeout),
        **{f"__param_{k}": v[0] for k, v in (job.get("params") or {}).items()},
    } | group.get("labels", {})
    out = relabel(labels, job.get("relabel_configs") or [])
    if out is not None:
        out.setdefault("instance", out["__address__"])
    return out


def _discovers(job: Obj, namespace: str) -> bool:
    for sd in job.get("kubernetes_sd_configs") or []:
        names = (sd.get("namespaces") or {}).get("names")
        if sd.get("role") == "pod" and (not names or namespace in names):
            return True
    return False


def exporter_jobs(config: Obj, template: Obj) -> list[ScrapeJob]:
    """Every job of `config` whose pod discovery and relabeling keep a pod of the exporter DaemonSet."""
    probe = exporter_pod(template, node="probe-node", ip="10.0.0.1")
    jobs = []
    for index, job in enumerate(config.get("scrape_configs") or []):
        if not _discovers(job, NAMESPACE):
            continue
        kept = [
            (group, labels)
            for group in pod_targets(probe)
            if (labels := target_labels(config, job, group)) is not None
        ]
        if not kept:
            continue
        paths = {labels["__metrics_path__"] for _, labels in kept}
        if len(paths) != 1 or any(labels["__address__"] != g["targets"][0] for g, labels in kept):
            raise ValueError(f"job {job['job_name']}: relabeling moves the address or the path per port")
        labels = kept[0][1]
        jobs.append(
            ScrapeJob(
                name=labels["job"],
                index=index,
                metrics_path=paths.pop(),
                interval=parse_duration(labels["__scrape_interval__"]),
                timeout=parse_duration(labels["__scrape_timeout__"]),
                port_names=frozenset(
                    g["labels"]["__meta_kubernetes_pod_container_port_name"] for g, _ in kept
                ),
            )
        )
    if not jobs:
        raise LookupError("no scrape job of the configuration keeps the exporter pods")
    return jobs


# -- what a node serves -------------------------------------------------------------------------------


def _identity(node: str, value: str) -> str:
    """`value` rewritten for `node`: the same shape (every hexadecimal digit replaced, a digit by a
    digit where the value is all digits), deterministic, different per node."""
    stream = hashlib.sha256(f"{node}\0{value}".encode()).hexdigest() * 4
    digits_only = value.isdigit()
    out, used = [], 0
    for char in value:
        if char in "0123456789abcdefABCDEF":
            new = stream[used]
            used += 1
            if digits_only:
                new = str(int(new, 16) % 10)
            elif char.isupper():
                new = new.upper()
            out.append(new)
        else:
            out.append(char)
    return "".join(out)


@dataclass(frozen=True)
class Exposition:
    """One scrape path's body with its per-device identities cut out: `pieces` alternate between
    text kept as is and an identity label value, text first and last."""

    pieces: tuple[bytes, ...]

    @classmethod
    def parse(cls, body: bytes) -> Exposition:
        pieces, start = [], 0
        for match in _LABEL_PAIR.finditer(body):
            if IDENTITY_LABEL.search(match.group(1).decode()):
                pieces += [body[start : match.start(2)], match.group(2)]
                start = match.end(2)
        pieces.append(body[start:])
        return cls(tuple(pieces))

    @property
    def identities(self) -> frozenset[bytes]:
        return frozenset(self.pieces[1::2])

    def for_node(self, node: str) -> bytes:
        values = {v: _identity(node, v.decode()).encode() for v in self.identities}
        return b"".join(p if i % 2 == 0 else values[p] for i, p in enumerate(self.pieces))


def sample_count(body: bytes) -> int:
    """Samples (series) in a text exposition."""
    return sum(1 for line in body.splitlines() if line and not line.startswith(b"#"))


@dataclass
class RealExporter:
    """The real exporter on examples/nodes/gpu-node-1 with simulated NVML (examples/fake_gpus.py), on
    127.0.0.1 and a port of its own, with a scratch copy of the kernel log to write faults into."""

    workdir: Path
    port: int = 0
    process: Process | None = None
    sysfs_root: Path = NODE_FIXTURE / "sys"

    @property
    def kmsg(self) -> Path:
        return self.workdir / "kmsg"

    def start(self, *, timeout: float = 30.0) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(NODE_FIXTURE / "kmsg", self.kmsg)
        self.port = free_port()
        argv = [
            sys.executable,
            "-m",
            "examples.fake_gpus",
            f"--listen=127.0.0.1:{self.port}",
            f"--kmsg={self.kmsg}",
            f"--sysfs-root={self.sysfs_root}",
            "--nvml=auto",
            f"--state-dir={self.workdir / 'state'}",
        ]
        self.process = spawn("exporter", argv, log_dir=self.workdir, cwd=REPO, env={"PYTHONPATH": str(REPO)})
        seen: list[bytes] = []

        def settled() -> bool:
            assert self.process is not None
            if self.process.popen.poll() is not None:
                raise RuntimeError(f"the exporter exited\n{self.process.tail()}")
            try:
                body = self.get("/metrics")
            except OSError:
                return False
            series = b"\n".join(sorted(line.rpartition(b" ")[0] for line in body.splitlines()))
            seen.append(series)
            return len(seen) > 1 and seen[-1] == seen[-2] and b"accel_kmsg_records_total" in series

        wait_for("the exporter to serve the same series twice", settled, timeout=timeout, interval=0.3)

    def get(self, path: str) -> bytes:
        url = f"http://127.0.0.1:{self.port}{path}"
        with urllib.request.urlopen(url, timeout=5) as response:
            body: bytes = response.read()
            return body

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()

    def __enter__(self) -> RealExporter:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


FAULT_COUNTERS = ("link_downed", "local_link_integrity_errors", "excessive_buffer_overrun_errors")
"""The InfiniBand counters a faulted capture raises on every port."""


def capture(paths: Iterable[str], *, workdir: Path | None = None, faulted: bool = False) -> dict[str, bytes]:
    """What the real exporter serves on each path (a short-lived exporter, see :class:`RealExporter`).
    ``faulted``: on a copy of the node's sysfs tree in which, once the exporter has read it, every
    InfiniBand port's :data:`FAULT_COUNTERS` rise by one (the node after a storm of link events: the
    most fast-path series one node's InfiniBand faults make, 3 per port)."""
    with contextlib.ExitStack() as stack:
        folder = workdir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="fleet-capture-")))
        if not faulted:
            exporter = stack.enter_context(RealExporter(folder))
            return {path: exporter.get(path) for path in sorted(set(paths))}
        root = folder / "sys"
        shutil.copytree(NODE_FIXTURE / "sys", root, symlinks=True)
        exporter = stack.enter_context(RealExporter(folder, sysfs_root=root))
        counters = [
            port / "counters" / name
            for port in sorted(root.glob("class/infiniband/*/ports/*"))
            for name in FAULT_COUNTERS
        ]
        for counter in counters:
            counter.write_text(f"{int(counter.read_text()) + 1}\n")
        wait_for(
            "the exporter to serve every port's rises",
            lambda: (
                exporter.get("/metrics/fast").count(b"accel_infiniband_port_events_seen_total{")
                == len(counters)
            ),
            timeout=30,
            interval=0.3,
        )
        return {path: exporter.get(path) for path in sorted(set(paths))}


# -- the fleet ----------------------------------------------------------------------------------------


def node_address(index: int) -> str:
    return str(FIRST_ADDRESS + index)


def node_name(index: int) -> str:
    return f"fleet-node-{index + 1:05d}"


@dataclass(frozen=True)
class SimNode:
    name: str
    address: str


def _response(body: bytes) -> bytes:
    head = f"HTTP/1.1 200 OK\r\nContent-Type: {CONTENT_TYPE}\r\nContent-Length: {len(body)}\r\n\r\n"
    return head.encode() + body


_NOT_FOUND = b"HTTP/1.1 404 Not Found\r\nContent-Type: text/plain\r\nContent-Length: 10\r\n\r\nnot found\n"
_MAX_HEAD = 16384


class _Connection(asyncio.Protocol):
    """HTTP/1.1 with keep-alive, GET only, as Prometheus scrapes: the request line's path picks a
    precomputed response; headers are read past, bodies never expected."""

    def __init__(self, server: FleetServer) -> None:
        self.server = server
        self.buffer = b""
        self.transport: asyncio.Transport | None = None
        self.responses: Mapping[bytes, bytes] = {}

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        responses = self.server.responses.get(transport.get_extra_info("sockname")[0])
        if responses is None:  # not a simulated node's address (0.0.0.0 reaches every interface)
            transport.close()
            return
        self.responses = responses

    def data_received(self, data: bytes) -> None:
        assert self.transport is not None
        self.buffer += data
        while (end := self.buffer.find(b"\r\n\r\n")) >= 0:
            head, self.buffer = self.buffer[:end], self.buffer[end + 4 :]
            request_line, _, headers = head.partition(b"\r\n")
            parts = request_line.split(b" ")
            path = parts[1].split(b"?", 1)[0] if len(parts) == 3 else b""
            response = self.responses.get(path, _NOT_FOUND)
            self.server.served[path] = self.server.served.get(path, 0) + 1
            self.transport.write(response)
            if b"connection: close" in headers.lower():
                self.transport.close()
                return
        if len(self.buffer) > _MAX_HEAD:
            self.transport.close()


@dataclass
class FleetServer:
    """Every simulated node's responses from one socket (0.0.0.0:port) in a thread of its own."""

    bodies: Mapping[str, Exposition]
    """Scrape path -> what the real exporter serves there."""
    nodes: int
    faulted: Mapping[str, Exposition] = field(default_factory=dict)
    """Scrape path -> what the real exporter serves there after faults (:func:`capture`)."""
    faulty: float = 0.0
    """The share of the nodes, spread evenly, that serve :attr:`faulted`."""
    responses: dict[str, dict[bytes, bytes]] = field(default_factory=dict)
    """Node address -> path -> the response, made once."""
    served: dict[bytes, int] = field(default_factory=dict)
    """Requests answered per path (an unknown path counts too)."""
    port: int = 0
    _loop: asyncio.AbstractEventLoop | None = None
    _server: asyncio.base_events.Server | None = None
    _thread: threading.Thread | None = None

    @property
    def fleet(self) -> list[SimNode]:
        return [SimNode(node_name(i), node_address(i)) for i in range(self.nodes)]

    def start(self) -> None:
        for index, node in enumerate(self.fleet):
            bodies = self.faulted if self.is_faulty(index) else self.bodies
            self.responses[node.address] = {
                path.encode(): _response(body.for_node(node.name)) for path, body in bodies.items()
            }
        loop = asyncio.new_event_loop()
        self._loop = loop
        self._thread = threading.Thread(target=loop.run_forever, name="fleet-server", daemon=True)
        self._thread.start()

        async def listen() -> asyncio.base_events.Server:
            return await loop.create_server(
                lambda: _Connection(self), host="0.0.0.0", port=self.port, backlog=4096, reuse_address=True
            )

        self._server = asyncio.run_coroutine_threadsafe(listen(), loop).result(timeout=10)
        self.port = self._server.sockets[0].getsockname()[1]

    def is_faulty(self, index: int) -> bool:
        """Whether node ``index`` serves the faulted bodies: every 1/faulty-th node, so any first N
        nodes hold their share."""
        return bool(self.faulted) and int((index + 1) * self.faulty) > int(index * self.faulty)

    def cpu_seconds(self) -> float:
        """CPU time the serving thread has used."""
        assert self._loop is not None

        async def now() -> float:
            return time.thread_time()

        return asyncio.run_coroutine_threadsafe(now(), self._loop).result(timeout=10)

    def stop(self) -> None:
        if self._loop is None:
            return
        loop = self._loop

        async def close() -> None:
            if self._server is not None:
                self._server.close()
                await self._server.wait_closed()

        with contextlib.suppress(TimeoutError):
            asyncio.run_coroutine_threadsafe(close(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(timeout=10)
        loop.close()
        self._loop = None

    def __enter__(self) -> FleetServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def pods(self, template: Obj, jobs: Sequence[ScrapeJob]) -> list[Obj]:
        """The fleet's exporter pods, as pod discovery would list them, at this server's port."""
        ports = frozenset().union(*(job.port_names for job in jobs))
        return [
            exporter_pod(template, node=node.name, ip=node.address, port=self.port, ports=ports)
            for node in self.fleet
        ]


# -- Prometheus ---------------------------------------------------------------------------------------


def write_file_sd(folder: Path, config: Obj, pods: Iterable[Obj]) -> dict[int, Path]:
    """One file_sd file per job with pod discovery: the target groups of the pods in its namespaces
    (every container port of every pod, as pod discovery gives them). Returns job index -> file."""
    folder.mkdir(parents=True, exist_ok=True)
    listed = list(pods)
    files = {}
    for index, job in enumerate(config.get("scrape_configs") or []):
        sds = job.get("kubernetes_sd_configs") or []
        if not sds:
            continue
        groups = [
            group
            for pod in listed
            if any(
                not (sd.get("namespaces") or {}).get("names")
                or pod["metadata"]["namespace"] in sd["namespaces"]["names"]
                for sd in sds
                if sd.get("role") == "pod"
            )
            for group in pod_targets(pod)
        ]
        path = folder / f"{index}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(groups))
        tmp.replace(path)
        files[index] = path
    return files


def prometheus_config(
    config: Obj,
    *,
    sd_files: Mapping[int, Path],
    rule_files: Sequence[str] = (str(RULES / "*.yaml"),),
    max_interval: float | None = None,
    extra_jobs: Sequence[Obj] = (),
) -> Obj:
    """`config` with each job's kubernetes_sd_configs replaced by its file_sd file and the rules of
    alerts/; `max_interval` shortens longer scrape intervals (a test that cannot wait a minute for a
    slow job's first scrape; benchmarks leave it None)."""
    out: Obj = json.loads(json.dumps(config))
    out["rule_files"] = list(rule_files)
    for index, job in enumerate(out.get("scrape_configs") or []):
        if job.pop("kubernetes_sd_configs", None) is not None:
            job["file_sd_configs"] = [{"files": [str(sd_files[index])], "refresh_interval": "5s"}]
        if max_interval is not None:
            interval, timeout = _job_defaults(out, job)
            if interval > max_interval:
                job["scrape_interval"] = format_duration(max_interval)
                job["scrape_timeout"] = format_duration(min(timeout, max_interval))
    out["scrape_configs"] = [*out.get("scrape_configs", []), *extra_jobs]
    return out


@dataclass
class Prometheus:
    """Real Prometheus on loopback with a scratch data folder."""

    workdir: Path
    config: Obj
    port: int = 0
    process: Process | None = None
    args: Sequence[str] = ()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, *, timeout: float = 60.0) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = self.port or free_port()
        path = self.workdir / "prometheus.yml"
        path.write_text(yaml.safe_dump(self.config, sort_keys=False))
        self.process = spawn(
            "prometheus",
            [
                "prometheus",
                f"--config.file={path}",
                f"--storage.tsdb.path={self.workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                *self.args,
            ],
            log_dir=self.workdir,
        )

        def ready() -> bool:
            assert self.process is not None
            if self.process.popen.poll() is not None:
                raise RuntimeError(f"Prometheus exited\n{self.process.tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as response:  # noqa: S310
                    return bool(response.status == 200)
            except OSError:
                return False

        wait_for("Prometheus to be ready", ready, timeout=timeout, interval=0.2)

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()

    def __enter__(self) -> Prometheus:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def query(self, promql: str, *, at: float | None = None, timeout: float = 30) -> list[Obj]:
        """An instant query's result vector."""
        params = {"query": promql} | ({"time": f"{at:.3f}"} if at is not None else {})
        data = self._api("query", params, timeout)
        result: list[Obj] = data["result"]
        return result

    def query_stats(self, promql: str, *, at: float) -> tuple[float, float]:
        """An instant query's evaluation seconds and the samples it read, as the engine counts them
        (`stats=all`: evalTotalTime, totalQueryableSamples)."""
        stats = self._api("query", {"query": promql, "time": f"{at:.3f}", "stats": "all"}, 60)["stats"]
        return float(stats["timings"]["evalTotalTime"]), float(stats["samples"]["totalQueryableSamples"])

    def query_range(self, promql: str, *, start: float, end: float, step: float) -> list[Obj]:
        params = {"query": promql, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step:g}"}
        result: list[Obj] = self._api("query_range", params, 60)["result"]
        return result

    def _api(self, endpoint: str, params: Mapping[str, str], timeout: float) -> Obj:
        body = urllib.parse.urlencode(params).encode()
        request = urllib.request.Request(f"{self.url}/api/v1/{endpoint}", data=body)  # noqa: S310
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310  loopback
                reply = json.loads(response.read())
        except urllib.error.HTTPError as exc:
            raise RuntimeError(f"{endpoint} {dict(params)}: {exc.code} {exc.read()!r}") from None
        if reply.get("status") != "success":
            raise RuntimeError(f"{endpoint} {params}: {reply}")
        data: Obj = reply["data"]
        return data

    def active_targets(self) -> list[Obj]:
        """/api/v1/targets' active targets (labels, discoveredLabels, health, scrapePool, ...)."""
        url = f"{self.url}/api/v1/targets?state=active"
        with urllib.request.urlopen(url, timeout=30) as response:  # noqa: S310  loopback http
            targets: list[Obj] = json.loads(response.read())["data"]["activeTargets"]
            return targets

    def value(self, promql: str, *, at: float | None = None) -> float | None:
        """The single value of an instant query (None when it returns nothing)."""
        result = self.query(promql, at=at)
        return float(result[0]["value"][1]) if result else None

    def by(self, label: str, promql: str, *, at: float | None = None) -> dict[str, float]:
        return {r["metric"].get(label, ""): float(r["value"][1]) for r in self.query(promql, at=at)}


def load_bodies(
    jobs: Sequence[ScrapeJob], *, workdir: Path | None = None, faulted: bool = False
) -> dict[str, Exposition]:
    """Each scraped path's body from the real exporter, identities cut out (``faulted``: see
    :func:`capture`)."""
    return {
        path: Exposition.parse(body)
        for path, body in capture({j.metrics_path for j in jobs}, workdir=workdir, faulted=faulted).items()
    }


def exporter_job_regex(jobs: Sequence[ScrapeJob]) -> str:
    """A regex matching the exporter jobs' names, escaped for a PromQL string literal."""
    return "|".join(re.escape(j.name) for j in jobs).replace("\\", "\\\\")
