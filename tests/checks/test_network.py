"""The ``ping`` and ``iperf`` checks with real ping and iperf3 between network namespaces.

Three "nodes" are network namespaces this module creates, each with two secondary interfaces (net1 on
network rdma-0, net2 on rdma-1) on two bridges in a hub namespace, addresses in 10.219.7.0/24 and
10.219.8.0/24 that exist only inside them. node-c's rdma-1 port is down on its bridge, and node-d's
pod lists addresses nobody has. The peers come as exporter pods with Multus network-status
annotations, as the Kubernetes API returns them. Needs root and iproute2 (skipped otherwise).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import pytest

from exporter.checks.base import CheckRequest
from exporter.checks.metrics import check_metrics
from exporter.checks.network import (
    IperfCheck,
    IperfServer,
    PingCheck,
    attachments,
    parse_iperf,
    parse_ping,
    paths,
)
from exporter.checks.runner import CheckRunner

NODES = {"node-a": 1, "node-b": 2, "node-c": 3}
NETWORKS = {"rdma-0": ("net1", "10.219.7"), "rdma-1": ("net2", "10.219.8")}
IPERF_PORT = 15201

needs_netns = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("ping") is None,
    reason="needs root, iproute2 and ping to create network namespaces",
)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


def pod(node: str, networks: Mapping[str, str], *, phase: str = "Running") -> dict[str, Any]:
    """An exporter pod as the API returns it: on ``node``, attached to network -> address."""
    status = [{"name": "k8s-pod-network", "interface": "eth0", "ips": ["10.244.0.9"], "default": True}]
    status += [
        {"name": f"accel-health/{net}", "interface": NETWORKS[net][0], "ips": [ip], "default": False}
        for net, ip in networks.items()
    ]
    return {
        "metadata": {
            "name": f"accel-health-exporter-{node}",
            "annotations": {"k8s.v1.cni.cncf.io/network-status": json.dumps(status)},
        },
        "spec": {"nodeName": node},
        "status": {"phase": phase},
    }


def address(node: str, network: str) -> str:
    return f"{NETWORKS[network][1]}.{NODES.get(node, 4)}"


def all_pods() -> list[Mapping[str, Any]]:
    nodes = [*NODES, "node-d"]
    return [pod(n, {net: address(n, net) for net in NETWORKS}) for n in nodes]


@dataclass
class Fabric:
    namespaces: dict[str, str]
    """node -> its network namespace."""

    def prefix(self, node: str) -> list[str]:
        return ["ip", "netns", "exec", self.namespaces[node]]


@pytest.fixture(scope="module")
def fabric() -> Iterator[Fabric]:
    tag = secrets.token_hex(3)
    hub = f"ah-{tag}-hub"
    namespaces = {node: f"ah-{tag}-{node[-1]}" for node in NODES}
    created: list[str] = []
    try:
        for name in [hub, *namespaces.values()]:
            _ip("netns", "add", name)
            created.append(name)
        for bridge in ("br0", "br1"):
            _ip("-n", hub, "link", "add", bridge, "type", "bridge")
            _ip("-n", hub, "link", "set", bridge, "up")
        for node, ns in namespaces.items():
            _ip("-n", ns, "link", "set", "lo", "up")
            for bridge, (network, (interface, _)) in zip(("br0", "br1"), NETWORKS.items(), strict=True):
                port = f"{bridge[-1]}{node[-1]}"
                _ip("-n", ns, "link", "add", interface, "type", "veth", "peer", "name", port, "netns", hub)
                _ip("-n", ns, "addr", "add", f"{address(node, network)}/24", "dev", interface)
                _ip("-n", ns, "link", "set", interface, "up")
                _ip("-n", hub, "link", "set", port, "master", bridge)
                if not (node == "node-c" and network == "rdma-1"):
                    _ip("-n", hub, "link", "set", port, "up")
        yield Fabric(namespaces)
    finally:
        for name in reversed(created):
            subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True)


def test_attachments_leave_out_the_cluster_network_and_garbage() -> None:
    found = attachments(pod("node-a", {"rdma-0": "10.219.7.1"}))
    assert [(a.network, a.interface, a.ips) for a in found] == [
        ("accel-health/rdma-0", "net1", ("10.219.7.1",))
    ]
    broken = {"metadata": {"annotations": {"k8s.v1.cni.cncf.io/network-status": "{not json"}}}
    assert attachments(broken) == []
    odd = pod("node-a", {})
    odd["metadata"]["annotations"]["k8s.v1.cni.cncf.io/network-status"] = json.dumps(
        [{"name": "x/y", "interface": "net1; rm -rf /", "ips": ["10.0.0.1"]}]
    )
    assert attachments(odd) == []


def test_paths_pair_each_interface_with_every_peer_on_the_same_network() -> None:
    pods = [
        pod("node-a", {"rdma-0": "10.219.7.1", "rdma-1": "10.219.8.1"}),
        pod("node-b", {"rdma-0": "10.219.7.2"}),
        pod("node-c", {"rdma-1": "10.219.8.3"}, phase="Pending"),
    ]
    found, why = paths(pods, "node-a")
    assert why == ""
    assert [(r.key, r.source, r.address) for r in found] == [("net1/node-b", "10.219.7.1", "10.219.7.2")]
    assert paths(pods, "node-z") == ([], "no running exporter pod on node 'node-z'")
    assert paths([pod("node-a", {})], "node-a")[1].startswith("this node's exporter pod has no secondary")


def test_iputils_summaries_parse_to_counts_and_average_rtt() -> None:
    reachable = (
        "--- 10.219.7.2 ping statistics ---\n"
        "3 packets transmitted, 3 received, 0% packet loss, time 401ms\n"
        "rtt min/avg/max/mdev = 0.041/0.052/0.066/0.010 ms\n"
    )
    sent, received, rtt = parse_ping(reachable)
    assert (sent, received) == (3, 3)
    assert rtt == pytest.approx(52e-6)
    lost = "3 packets transmitted, 0 received, +3 errors, 100% packet loss, time 2040ms\n"
    assert parse_ping(lost) == (3, 0, None)
    with pytest.raises(ValueError, match="no packet summary"):
        parse_ping("ping: net9: No such device\n")


def test_iperf3_json_parses_to_received_bits_and_reports_its_error() -> None:
    assert parse_iperf(json.dumps({"end": {"sum_received": {"bits_per_second": 9.4e9}}})) == 9.4e9
    with pytest.raises(ValueError, match="iperf3: unable to connect to server"):
        parse_iperf(json.dumps({"start": {}, "end": {}, "error": "unable to connect to server"}))
    with pytest.raises(ValueError, match="no JSON"):
        parse_iperf("iperf3: error\n")


def test_ping_without_peers_or_without_the_api_does_not_pretend() -> None:
    lonely = PingCheck(lambda: [pod("node-a", {"rdma-0": "10.219.7.1"})], node="node-a")
    result = lonely.run(CheckRequest())
    assert (result.verdict, result.message) == ("skipped", "no peer exporter pods")

    def forbidden() -> list[Mapping[str, Any]]:
        raise RuntimeError("pods is forbidden")

    result = PingCheck(forbidden, node="node-a").run(CheckRequest())
    assert result.verdict == "error"
    assert "pods is forbidden" in result.message
    nameless = PingCheck(all_pods, node="").run(CheckRequest())
    assert nameless.verdict == "skipped"
    assert "NODE_NAME" in nameless.message


@needs_netns
def test_ping_reaches_peers_per_interface_and_fails_the_ones_that_do_not_answer(fabric: Fabric) -> None:
    check = PingCheck(all_pods, node="node-a", command=fabric.prefix("node-a"))
    runner = CheckRunner([check], nvml=None)
    result = runner.run("ping", {"count": "2", "wait": "0.5"})
    reachable = {d.device: d.values["reachable"] for d in result.devices}
    assert reachable == {
        "net1/node-b": 1.0,
        "net1/node-c": 1.0,
        "net1/node-d": 0.0,
        "net2/node-b": 1.0,
        "net2/node-c": 0.0,
        "net2/node-d": 0.0,
    }
    assert result.verdict == "fail"
    assert "net2/node-c: 10.219.8.3 unreachable" in result.message
    rtt = next(d.values["rtt_seconds"] for d in result.devices if d.device == "net1/node-b")
    assert 0 < rtt < 0.1

    families = {m.name: m for m in check_metrics(runner.latest(), runner.runs(), {}, {"ping": 3600.0})}
    samples = {
        (s.labels["interface"], s.labels["peer"]): s.value
        for s in families["accel_check_peer_reachable"].samples
    }
    assert samples[("net2", "node-c")] == 0.0
    assert samples[("net1", "node-c")] == 1.0
    assert len(families["accel_check_peer_rtt_seconds"].samples) == 3


@needs_netns
@pytest.mark.skipif(shutil.which("iperf3") is None, reason="needs iperf3")
def test_iperf_measures_each_peer_with_a_server_and_fails_one_without(fabric: Fabric) -> None:
    server = IperfServer(command=fabric.prefix("node-b"), port=IPERF_PORT)
    server.start()
    try:
        listening = [*fabric.prefix("node-b"), "ss", "-Hltn", f"sport = :{IPERF_PORT}"]
        for _ in range(50):
            if subprocess.run(listening, capture_output=True, text=True, check=False).stdout.strip():
                break
            time.sleep(0.1)
        pods: list[Mapping[str, Any]] = [
            pod("node-a", {"rdma-0": address("node-a", "rdma-0")}),
            pod("node-b", {"rdma-0": address("node-b", "rdma-0")}),
            pod("node-c", {"rdma-0": address("node-c", "rdma-0")}),
        ]
        check = IperfCheck(lambda: pods, node="node-a", command=fabric.prefix("node-a"), port=IPERF_PORT)
        result = CheckRunner([check], nvml=None).run("iperf", {"seconds": "1"})
    finally:
        server.stop()
    by_peer = {d.device: d for d in result.devices}
    assert by_peer["net1/node-b"].verdict == "pass"
    assert by_peer["net1/node-b"].values["bytes_per_second"] > 1e8  # a veth pair moves gigabits per second
    assert by_peer["net1/node-c"].verdict == "fail"
    assert "iperf3" in by_peer["net1/node-c"].detail
    assert result.verdict == "fail"


def test_iperf_where_iperf3_is_not_installed_is_skipped() -> None:
    check = IperfCheck(all_pods, node="node-a", iperf3="iperf3-not-installed")
    result = check.run(CheckRequest())
    assert (result.verdict, result.message) == ("skipped", "iperf3-not-installed is not installed")
