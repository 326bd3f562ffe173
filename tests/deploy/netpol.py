"""Whether rendered NetworkPolicies allow a connection, by the rules of networking.k8s.io/v1.

A connection from a pod to a pod (or an address outside the cluster) on a port is allowed when the
source's egress and the destination's ingress both allow it: a pod no policy selects for a direction
is open in that direction; a pod some policies select is open only to what one of their rules
admits. A rule's peer is a podSelector (pods of the policy's namespace), a namespaceSelector (every
pod of those namespaces), both (those pods of those namespaces) or an ipBlock; no peers mean anyone;
no ports mean every port. Services are transparent: policies see the pod behind a ClusterIP.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Any

Obj = dict[str, Any]


@dataclass(frozen=True)
class Pod:
    namespace: str
    labels: dict[str, str]
    ports: dict[str, int] = field(default_factory=dict)
    """Named container ports, for rules that name a port."""

    @property
    def namespace_labels(self) -> dict[str, str]:
        return {"kubernetes.io/metadata.name": self.namespace}


@dataclass(frozen=True)
class Outside:
    """An address no pod has: the API server, a cloud API."""

    ip: str


Endpoint = Pod | Outside


def selects(selector: Obj | None, labels: dict[str, str]) -> bool:
    """A LabelSelector (matchLabels, matchExpressions); an empty one selects everything."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


def _peer_matches(peer: Obj, policy_ns: str, other: Endpoint) -> bool:
    if "ipBlock" in peer:
        if not isinstance(other, Outside):
            return False  # pod traffic is matched by selectors; ipBlock is meant for the outside
        block = peer["ipBlock"]
        ip = ipaddress.ip_address(other.ip)
        inside = ip in ipaddress.ip_network(block["cidr"])
        return inside and not any(ip in ipaddress.ip_network(c) for c in block.get("except") or [])
    if not isinstance(other, Pod):
        return False
    if "namespaceSelector" in peer:
        if not selects(peer["namespaceSelector"], other.namespace_labels):
            return False
    elif other.namespace != policy_ns:
        return False
    return selects(peer.get("podSelector"), other.labels)


def _port_matches(rule_port: Obj, port: int, protocol: str, target: Endpoint) -> bool:
    if rule_port.get("protocol", "TCP") != protocol:
        return False
    wanted: int | str | None = rule_port.get("port")
    if wanted is None:
        return True
    if isinstance(wanted, str):
        named = target.ports.get(wanted) if isinstance(target, Pod) else None
        return named == port
    return wanted <= port <= int(rule_port.get("endPort", wanted))


def _direction_allows(
    policies: list[Obj], pod: Pod, other: Endpoint, port: int, protocol: str, *, direction: str
) -> bool:
    """Egress of `pod` towards `other`, or ingress of `pod` from `other`."""
    kind = direction.capitalize()
    key, peers_key = ("egress", "to") if direction == "egress" else ("ingress", "from")
    applying = []
    for policy in policies:
        meta, spec = policy["metadata"], policy["spec"]
        types = spec.get("policyTypes") or (["Ingress", "Egress"] if "egress" in spec else ["Ingress"])
        if meta["namespace"] == pod.namespace and kind in types and selects(spec["podSelector"], pod.labels):
            applying.append(policy)
    if not applying:
        return True
    # The port is the destination's: for egress, `other`'s; for ingress, this pod's.
    target = other if direction == "egress" else pod
    for policy in applying:
        for rule in policy["spec"].get(key) or []:
            peers = rule.get(peers_key) or []
            if peers and not any(_peer_matches(p, policy["metadata"]["namespace"], other) for p in peers):
                continue
            ports = rule.get("ports") or []
            if ports and not any(_port_matches(p, port, protocol, target) for p in ports):
                continue
            return True
    return False


def allowed(
    objects: list[Obj], source: Endpoint, destination: Endpoint, port: int, protocol: str = "TCP"
) -> bool:
    """Whether the NetworkPolicies among `objects` let `source` open `port` on `destination` (an
    `Outside` source has no egress to check, only the destination's ingress)."""
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    if isinstance(source, Pod) and not _direction_allows(
        policies, source, destination, port, protocol, direction="egress"
    ):
        return False
    if isinstance(destination, Outside):
        return True
    return _direction_allows(policies, destination, source, port, protocol, direction="ingress")
