"""The connection recorder of the as-deployed harness (tests/kube/connections.py), without a cluster:
/proc/net/nf_conntrack lines become connections (who opened them, to what port), addresses become the
pods and servers they stand for, and each connection is held against the rendered enforce overlay's
NetworkPolicies; a policy that drops a connection the shipped components make fails the check. Where
pod networks can be made (root), the kernel side too: two pod namespaces record what one opens to the
other."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.kube import DEPLOY, kubectl_problem, render
from tests.deploy.netpol import Outside
from tests.kube import podnet
from tests.kube.connections import (
    AddressBook,
    Connection,
    ConnectionRecorder,
    Peer,
    disallowed,
    parse_conntrack,
    pod_peer,
    roles,
)
from tests.kube.deployed import ALERTMANAGER_POD, API_SERVER, PROMETHEUS_POD

HOST, PROXY_PORT = "10.213.5.1", 34567
ALERTMANAGER_0, PROMETHEUS = "10.213.5.2", "10.213.5.9"
REMEDIATOR, EXPORTER_1, EXPORTER_2 = "10.213.5.10", "10.213.5.11", "10.213.5.12"

TABLE = f"""\
ipv4     2 tcp      6 431999 ESTABLISHED src={REMEDIATOR} dst={HOST} sport=40212 dport={PROXY_PORT} \
src={HOST} dst={REMEDIATOR} sport={PROXY_PORT} dport=40212 [ASSURED] mark=0 zone=0 use=2
ipv4     2 tcp      6 117 TIME_WAIT src={ALERTMANAGER_0} dst={REMEDIATOR} sport=51000 dport=9836 \
src={REMEDIATOR} dst={ALERTMANAGER_0} sport=9836 dport=51000 [ASSURED] mark=0 zone=0 use=2
ipv4     2 tcp      6 431999 ESTABLISHED src={REMEDIATOR} dst={ALERTMANAGER_0} sport=40300 dport=9093 \
src={ALERTMANAGER_0} dst={REMEDIATOR} sport=9093 dport=40300 [ASSURED] mark=0 zone=0 use=2
ipv4     2 tcp      6 431999 ESTABLISHED src={PROMETHEUS} dst={EXPORTER_1} sport=38000 dport=9835 \
src={EXPORTER_1} dst={PROMETHEUS} sport=9835 dport=38000 [ASSURED] mark=0 zone=0 use=2
ipv4     2 tcp      6 100 TIME_WAIT src={HOST} dst={REMEDIATOR} sport=55000 dport=9836 \
src={REMEDIATOR} dst={HOST} sport=9836 dport=55000 [ASSURED] mark=0 zone=0 use=2
ipv4     2 icmp     1 29 src={EXPORTER_1} dst={EXPORTER_2} type=8 code=0 id=7 \
src={EXPORTER_2} dst={EXPORTER_1} type=0 code=0 id=7 mark=0 zone=0 use=2
ipv4     2 tcp      6 431999 ESTABLISHED src=127.0.0.1 dst=127.0.0.1 sport=41000 dport=9835 \
src=127.0.0.1 dst=127.0.0.1 sport=9835 dport=41000 [ASSURED] mark=0 zone=0 use=2
ipv6     10 udp      17 20 src=fe80::1 dst=ff02::2 sport=546 dport=547 [UNREPLIED] \
src=ff02::2 dst=fe80::1 sport=547 dport=546 mark=0 zone=0 use=2
"""


def test_conntrack_lines_become_connections_in_the_direction_they_were_opened() -> None:
    assert parse_conntrack(TABLE) == {
        Connection("TCP", REMEDIATOR, HOST, PROXY_PORT),
        Connection("TCP", ALERTMANAGER_0, REMEDIATOR, 9836),
        Connection("TCP", REMEDIATOR, ALERTMANAGER_0, 9093),
        Connection("TCP", PROMETHEUS, EXPORTER_1, 9835),
        Connection("TCP", HOST, REMEDIATOR, 9836),
        Connection("ICMP", EXPORTER_1, EXPORTER_2, 0),
    }


def test_the_recorder_keeps_what_each_table_showed_and_counts_the_unreadable(tmp_path: Path) -> None:
    table = tmp_path / "nf_conntrack"
    table.write_text(TABLE)
    recorder = ConnectionRecorder(lambda: {"pod": table, "gone": tmp_path / "missing"})
    assert len(recorder.poll()) == 6
    table.write_text("")  # the kernel forgot them: the recorder does not
    assert len(recorder.poll()) == 6
    assert len(recorder.errors) == 2
    assert recorder.errors[0].startswith("gone: ")


@pytest.fixture(scope="module")
def enforce() -> list[dict[str, Any]]:
    problem = kubectl_problem()
    if problem:
        pytest.skip(problem)
    return render(DEPLOY / "overlays" / "enforce")


def _pod(objects: list[dict[str, Any]], kind: str, name: str, pod_name: str) -> dict[str, Any]:
    workload = next(o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name)
    template = workload["spec"]["template"]
    return {
        "metadata": {**template["metadata"], "namespace": "accel-health", "name": pod_name},
        "spec": template["spec"],
    }


def _book(objects: list[dict[str, Any]]) -> AddressBook:
    remediator = _pod(objects, "Deployment", "accel-health-remediator", "accel-health-remediator-0")
    exporters = [
        _pod(objects, "DaemonSet", "accel-health-exporter", f"accel-health-exporter-{i}") for i in (1, 2)
    ]
    return AddressBook(
        pods={
            REMEDIATOR: pod_peer(remediator),
            EXPORTER_1: pod_peer(exporters[0]),
            EXPORTER_2: pod_peer(exporters[1]),
            ALERTMANAGER_0: Peer(
                "monitoring/alertmanager-main-0", "monitoring/alertmanager", ALERTMANAGER_POD
            ),
            PROMETHEUS: Peer("monitoring/prometheus-k8s-0", "monitoring/prometheus", PROMETHEUS_POD),
        },
        services={(HOST, PROXY_PORT): (Peer("API server", "API server", API_SERVER), 443)},
        nodes={HOST},
    )


def test_addresses_become_the_pods_and_servers_they_stand_for(enforce: list[dict[str, Any]]) -> None:
    flows = _book(enforce).flows(parse_conntrack(TABLE))
    assert roles(flows) == {
        ("accel-health/accel-health-remediator", "API server", 443, "TCP"),
        ("monitoring/alertmanager", "accel-health/accel-health-remediator", 9836, "TCP"),
        ("accel-health/accel-health-remediator", "monitoring/alertmanager", 9093, "TCP"),
        ("monitoring/prometheus", "accel-health/accel-health-exporter", 9835, "TCP"),
        ("node", "accel-health/accel-health-remediator", 9836, "TCP"),
        ("accel-health/accel-health-exporter", "accel-health/accel-health-exporter", 0, "ICMP"),
    }
    (to_api,) = [f for f in flows if f.destination.role == "API server"]
    assert str(to_api) == (
        f"accel-health/accel-health-remediator-0 -> API server:443/TCP (seen as {REMEDIATOR} -> "
        f"{HOST}:{PROXY_PORT}/TCP)"
    )
    # A pod calling its node on another port is an address outside the cluster: egress rules apply.
    (to_node,) = _book(enforce).flows([Connection("TCP", EXPORTER_1, HOST, 8080)])
    assert to_node.destination.endpoint == Outside(HOST)


def test_the_shipped_policies_admit_every_connection_of_the_canned_table(
    enforce: list[dict[str, Any]],
) -> None:
    assert disallowed(enforce, _book(enforce).flows(parse_conntrack(TABLE))) == []


def test_a_policy_that_drops_a_shipped_connection_fails_the_check(enforce: list[dict[str, Any]]) -> None:
    """The remediator's policy without its egress to Alertmanager (deploy/components/alertmanager-api)
    and the exporter's without the rule that admits the other exporters: the reads of Alertmanager's
    API and the exporters' ping are refused, with who, to what and as what the recorder saw them."""
    cut = copy.deepcopy(enforce)
    for obj in cut:
        if obj["kind"] != "NetworkPolicy":
            continue
        if obj["metadata"]["name"] == "accel-health-remediator":
            to_9093 = {"port": 9093, "protocol": "TCP"}
            obj["spec"]["egress"] = [
                r for r in obj["spec"]["egress"] if to_9093 not in (r.get("ports") or [])
            ]
        if obj["metadata"]["name"] == "accel-health-exporter":
            obj["spec"]["egress"] = [r for r in obj["spec"]["egress"] if "to" not in r]
    refused = disallowed(cut, _book(cut).flows(parse_conntrack(TABLE)))
    assert refused == [
        f"accel-health/accel-health-exporter-1 -> accel-health/accel-health-exporter-2:0/ICMP (seen as "
        f"{EXPORTER_1} -> {EXPORTER_2}:0/ICMP) not allowed by the NetworkPolicies",
        f"accel-health/accel-health-remediator-0 -> monitoring/alertmanager-main-0:9093/TCP (seen as "
        f"{REMEDIATOR} -> {ALERTMANAGER_0}:9093/TCP) not allowed by the NetworkPolicies",
    ]


def _in(ns: str, code: str) -> list[str]:
    return ["ip", "netns", "exec", ns, sys.executable, "-c", code]


def test_pod_namespaces_track_what_their_pods_open_and_the_hosts_rules_stay_as_they_were() -> None:
    """The kernel side, on a pod network of two namespaces: a TCP connection and a ping from one pod to
    the other are recorded, in the direction they were opened; the host's own iptables rules are
    untouched (only the pods' namespaces get rules)."""
    problem = podnet.available()
    if problem:
        pytest.skip(problem)
    host_rules = subprocess.run(["iptables", "-S"], capture_output=True, text=True, check=False).stdout
    network = podnet.PodNetwork()
    network.create()
    try:
        if network.track_problem:
            pytest.skip(network.track_problem)
        (server_ns, server), (client_ns, client) = network.add_pod(), network.add_pod()
        recorder = ConnectionRecorder(network.conntrack_tables)
        listener = subprocess.Popen(
            _in(
                server_ns, "import socket; s = socket.create_server(('0.0.0.0', 7000)); s.accept()[0].close()"
            )
        )
        try:
            connect = f"import socket, time; time.sleep(0.5); socket.create_connection(('{server}', 7000))"
            subprocess.run(_in(client_ns, connect), check=True, timeout=30)
            subprocess.run(
                ["ip", "netns", "exec", client_ns, "ping", "-c1", "-W2", server], check=True, timeout=30
            )
        finally:
            listener.wait(timeout=30)
        assert {
            Connection("TCP", client, server, 7000),
            Connection("ICMP", client, server, 0),
        } <= recorder.poll()
        assert recorder.errors == []
    finally:
        network.destroy()
    assert (
        subprocess.run(["iptables", "-S"], capture_output=True, text=True, check=False).stdout == host_rules
    )
