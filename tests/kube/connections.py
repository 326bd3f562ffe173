"""The connections the as-deployed pods really make, held against the rendered NetworkPolicies.

No network plugin enforces NetworkPolicies in the harness, so a policy that would cut off a shipped
feature (the exporters' ping, the remediator's reads of Alertmanager) would pass every scenario
unnoticed. Instead, each pod's network namespace tracks its connections (tests/kube/podnet.py switches
the kernel's connection tracking on there), `ConnectionRecorder` reads every namespace's
/proc/net/nf_conntrack about once a second while a Deployment runs and keeps each connection a pod
opened or accepted (protocol, source, destination, destination port; ICMP with port 0), and
`disallowed` evaluates each one with tests/deploy/netpol.py against the objects the harness applied:
every connection must be one the policies admit.

Addresses become the endpoints a cluster's policy sees (`AddressBook`): a pod's IP is that pod (its
namespace, labels and named ports as rendered); the harness's own servers on the bridge are what they
stand in for (the API server proxy is the API server, `Outside` on 443; Alertmanager's members and
Prometheus are kube-prometheus' pods in `monitoring`); the host's own address is the pod's node,
whose traffic to a pod (the kubelet's probes, a port-forward, the tests' own requests) a
NetworkPolicy cannot block.
"""

from __future__ import annotations

import ipaddress
import logging
import re
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.deploy.netpol import Endpoint, Outside, Pod, allowed
from tests.kube.controlplane import Repeating

logger = logging.getLogger("tests.kube.connections")
_FIELD = re.compile(r"(\w+)=(\S+)")
PROTOCOLS = {"tcp": "TCP", "udp": "UDP", "sctp": "SCTP", "icmp": "ICMP"}


@dataclass(frozen=True, order=True)
class Connection:
    """One connection as the kernel tracked it: the original direction's first packet."""

    protocol: str
    """TCP, UDP, SCTP or ICMP (conntrack's name, upper case)."""
    source: str
    destination: str
    port: int
    """The destination port; 0 for ICMP."""

    def __str__(self) -> str:
        return f"{self.source} -> {self.destination}:{self.port}/{self.protocol}"


def parse_conntrack(text: str) -> set[Connection]:
    """The IPv4 connections of a /proc/net/nf_conntrack text, loopback left out (no NetworkPolicy
    applies to it). A line: `ipv4 2 tcp 6 431999 ESTABLISHED src=A dst=B sport=P dport=Q src=B ...`;
    the first src/dst/dport are the original direction's, so `source` is who opened it."""
    found = set()
    for line in text.splitlines():
        words = line.split()
        if len(words) < 3 or words[0] != "ipv4" or words[2] not in PROTOCOLS:
            continue
        fields: dict[str, str] = {}
        for key, value in _FIELD.findall(line):
            fields.setdefault(key, value)  # the original tuple's come first
        if "src" not in fields or "dst" not in fields:
            continue
        if ipaddress.ip_address(fields["src"]).is_loopback or ipaddress.ip_address(fields["dst"]).is_loopback:
            continue
        protocol = PROTOCOLS[words[2]]
        port = 0 if protocol == "ICMP" else int(fields.get("dport", "0"))
        found.add(Connection(protocol, fields["src"], fields["dst"], port))
    return found


@dataclass
class ConnectionRecorder:
    """Reads every tracked pod namespace's table every `interval` seconds, in a thread, and keeps the
    union: a connection stays recorded after the kernel forgets it (a closed TCP connection lingers
    about two minutes in the table, an ICMP echo 30 s)."""

    tables: Callable[[], dict[str, Path]]
    """Namespace -> its nf_conntrack file, asked afresh each time (pods come and go)."""
    interval: float = 1.0
    connections: set[Connection] = field(default_factory=set)
    errors: list[str] = field(default_factory=list)
    """Tables that could not be read (a pod namespace going away mid-read), for the test's eyes."""
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _poller: Repeating | None = None

    def start(self) -> None:
        self._poller = Repeating(self.poll, self.interval, "connection-recorder")
        self._poller.start()

    def stop(self) -> None:
        if self._poller is not None:
            self._poller.stop()

    def poll(self) -> set[Connection]:
        """Read every table now; returns everything recorded so far."""
        for ns, path in self.tables().items():
            try:
                text = path.read_text()
            except OSError as exc:
                self.errors.append(f"{ns}: {exc}")
                logger.warning("connection table of %s: %s", ns, exc)
                continue
            found = parse_conntrack(text)
            with self._lock:
                self.connections |= found
        with self._lock:
            return set(self.connections)


@dataclass(frozen=True)
class Peer:
    """One end of a connection, as a cluster's NetworkPolicy sees it."""

    name: str
    """What it is, for messages: a pod's namespace/name, "API server", "node 10.213.5.1"."""
    role: str
    """What kind of peer: namespace/app.kubernetes.io/name for pods, else the name."""
    endpoint: Endpoint | None
    """None: the pod's own node, from which no NetworkPolicy can cut a pod off."""


@dataclass(frozen=True)
class Flow:
    """A recorded connection between the peers the addresses stand for."""

    source: Peer
    destination: Peer
    port: int
    protocol: str
    seen: Connection

    def __str__(self) -> str:
        to = f"{self.destination.name}:{self.port}/{self.protocol}"
        return f"{self.source.name} -> {to} (seen as {self.seen})"


def pod_peer(pod: dict[str, Any]) -> Peer:
    """A pod object (as applied) as a peer: its namespace, labels and named container ports."""
    meta = pod["metadata"]
    labels = dict(meta.get("labels") or {})
    ports = {
        p["name"]: int(p["containerPort"])
        for c in pod["spec"]["containers"]
        for p in c.get("ports") or []
        if p.get("name")
    }
    role = f"{meta['namespace']}/{labels.get('app.kubernetes.io/name', meta['name'])}"
    return Peer(f"{meta['namespace']}/{meta['name']}", role, Pod(meta["namespace"], labels, ports))


@dataclass
class AddressBook:
    """Who each address of the pod network is."""

    pods: dict[str, Peer] = field(default_factory=dict)
    """A pod's (or a harness server's) address -> the pod it is or plays."""
    services: dict[tuple[str, int], tuple[Peer, int]] = field(default_factory=dict)
    """(address, port) the harness serves something on -> what a cluster has there, and its port
    (the API server proxy -> the API server on 443)."""
    nodes: set[str] = field(default_factory=set)
    """The host's own addresses: the pods' node."""

    def _peer(self, ip: str) -> Peer:
        if ip in self.pods:
            return self.pods[ip]
        if ip in self.nodes:
            # As a destination, the node is an address outside the cluster: egress rules apply.
            return Peer(f"node {ip}", "node", None)
        return Peer(ip, ip, Outside(ip))

    def flow(self, connection: Connection) -> Flow:
        source = self._peer(connection.source)
        served = self.services.get((connection.destination, connection.port))
        destination, port = served if served else (self._peer(connection.destination), connection.port)
        if destination.endpoint is None:
            destination = Peer(destination.name, destination.role, Outside(connection.destination))
        return Flow(source, destination, port, connection.protocol, connection)

    def flows(self, connections: Iterable[Connection]) -> list[Flow]:
        return [self.flow(c) for c in sorted(connections)]


def disallowed(objects: list[dict[str, Any]], flows: Iterable[Flow]) -> list[str]:
    """Each flow the NetworkPolicies among `objects` would drop, as "src -> dst:port/proto"; the
    node's own connections to its pods are never dropped (NetworkPolicy cannot block them)."""
    refused = []
    for flow in flows:
        source, destination = flow.source.endpoint, flow.destination.endpoint
        if source is None or destination is None:
            continue
        if not allowed(objects, source, destination, flow.port, flow.protocol):
            refused.append(f"{flow} not allowed by the NetworkPolicies")
    return refused


def roles(flows: Iterable[Flow]) -> set[tuple[str, str, int, str]]:
    """(source role, destination role, port, protocol) of each flow: what the scenarios assert."""
    return {(f.source.role, f.destination.role, f.port, f.protocol) for f in flows}
