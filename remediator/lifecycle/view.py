"""The nodes as the engine knows them: observed through the cluster seam (the Kubernetes executor
answers from a watch cache), each with the record this service keeps on it (remediator/lifecycle/record.py),
plus what dry-run decisions pretended to do (kept in memory, never written anywhere).

Everything a leader must remember about a node is derived here from the node itself: whether this
service cordoned or tainted it (the ownership annotations), whether it holds the node against the
disruption budget and since when, which steps of which alert episodes were decided, which drain
runs, and when each kind of action last ran (the rate limits of a new leader).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from remediator.cluster import Node, NodeReads, Taint
from remediator.gates.safety import Hold
from remediator.lifecycle.record import (
    CORDONED_AT,
    DRAIN_STATUS,
    EPISODES,
    MANAGER,
    TAINTS_ADDED,
    Episode,
    NodeRecord,
    cordoned_by_us,
    owned_taints,
    parse_rfc3339,
    read,
)
from remediator.policy import DISRUPTIVE, AddTaint, AwsReboot, AwsSetUnhealthy, Rule

OURS = (EPISODES, TAINTS_ADDED, DRAIN_STATUS)
"""Annotations that make a node worth a closer look (with `cordoned-by`)."""


@dataclass(frozen=True)
class Steps:
    """What the node's record says of one episode."""

    decided: int = 0
    """Bit i: action i decided (AWS `aws_set_unhealthy` bits excluded: see `intent`)."""
    intent: int = 0
    """Bit i: action i (aws_set_unhealthy, aws_reboot) was asked for: the call may or may not have
    been made, so the instance's state is read before it is made again."""


@dataclass
class DryRun:
    """What dry-run decisions pretended to do, per node (nothing of it is ever written)."""

    cordoned: set[str] = field(default_factory=set)
    """Nodes a dry-run decision cordoned."""
    tainted: dict[str, dict[tuple[str, str], str]] = field(default_factory=dict)
    """node -> (key, effect) -> value of taints a dry-run decision added."""

    def forget(self, node: str) -> None:
        self.cordoned.discard(node)
        self.tainted.pop(node, None)

    def holds(self, node: str) -> bool:
        return node in self.cordoned or bool(self.tainted.get(node))


class NodeView:
    """Reads nodes through the cluster seam and derives this service's view of each."""

    def __init__(
        self,
        *,
        cluster: NodeReads,
        taints: Mapping[tuple[str, str], frozenset[str]] | None = None,
        manager: str = MANAGER,
    ) -> None:
        self._cluster = cluster
        self._taints = taints
        """(key, effect) -> the values the policy's taints set (see `taint_values`); None: any value."""
        self.manager = manager
        self.dry = DryRun()
        """What dry-run decisions pretended to do."""
        self._holds: dict[str, tuple[Node, Hold | None]] = {}
        # name -> (the node object last derived from, its hold): a node object is derived once (the
        # Kubernetes executor converts each version of a node once; the snapshot replaces a node on
        # every change), so deriving every node's hold costs a pass over the list, not a decode each.

    async def get(self, name: str) -> Node | None:
        """The node (None when it does not exist)."""
        return await self._cluster.get_node(name)

    async def all(self) -> list[Node]:
        """Every node (the Kubernetes executor answers from its watch cache)."""
        return await self._cluster.list_nodes()

    # -- ownership -----------------------------------------------------------------------------

    def cordoned(self, node: Node) -> bool:
        """This service cordoned the node (per its annotation) and it is still cordoned."""
        return node.unschedulable and cordoned_by_us(node.annotations, manager=self.manager)

    def claimed_cordon(self, node: Node) -> bool:
        """The node carries this service's cordon annotation (cordoned or not: a human may have
        un-cordoned it since)."""
        return cordoned_by_us(node.annotations, manager=self.manager)

    def owned_taints(self, node: Node) -> list[tuple[str, str]]:
        """(key, effect) of the taints this service added to the node (per its annotation)."""
        out = []
        for tid in owned_taints(node.annotations):
            key, _, effect = tid.rpartition(":")
            out.append((key, effect))
        return out

    def present_taints(self, node: Node) -> list[Taint]:
        """The taints this service added that are still on the node as it set them."""
        owned = set(self.owned_taints(node))
        return [
            t
            for t in node.taints
            if (t.key, t.effect) in owned
            and (self._taints is None or t.value in self._taints.get((t.key, t.effect), ()))
        ]

    # -- the record ------------------------------------------------------------------------------

    @staticmethod
    def record(node: Node | None) -> NodeRecord:
        return read(node.annotations) if node is not None else NodeRecord()

    def steps(self, node: Node | None, rule: Rule, fingerprint: str, start: int) -> Steps:
        """What the node's record says of this episode's steps under `rule`."""
        episode = self.record(node).episode(fingerprint, start)
        if episode is None or episode.rule != rule.name:
            return Steps()
        if episode.released:  # a human ended it: every step counts as decided, none runs again
            return Steps(decided=(1 << len(rule.actions)) - 1)
        intent = 0
        for index, action in enumerate(rule.actions):
            if isinstance(action, AwsSetUnhealthy | AwsReboot) and episode.done(index):
                intent |= 1 << index
        return Steps(decided=episode.steps & ~intent, intent=intent)

    def episodes(self, nodes: Iterable[Node]) -> dict[str, list[Episode]]:
        """node -> the episodes recorded on it."""
        out: dict[str, list[Episode]] = {}
        for node in nodes:
            if EPISODES in node.annotations:
                recorded = list(read(node.annotations).episodes.values())
                if recorded:
                    out[node.name] = recorded
        return out

    # -- what this service holds -------------------------------------------------------------------

    def hold(self, node: Node) -> Hold | None:
        """The node's hold on the disruption budget, as the node shows it: cordoned or tainted by this
        service and still so, a drain of it running, or its instance marked for replacement (until
        the node is gone, or a human put it back into service by un-cordoning it)."""
        annotations = node.annotations
        kinds: set[str] = set()
        if self.cordoned(node):
            kinds.add("cordon")
        if self.present_taints(node):
            kinds.add("taint")
        if annotations.get(DRAIN_STATUS) == "in-progress" and node.unschedulable:
            # A drain holds the node while the node is out of service: a human's uncordon gives it
            # back, whatever a drain that never ended left in the annotation.
            kinds.add("drain")
        record = read(annotations) if EPISODES in annotations else NodeRecord()
        # This service cordoned it (before a replacement) and it is schedulable again: a human put
        # it back into service, and nothing replaces it any more.
        returned = not node.unschedulable and (
            self.claimed_cordon(node) or "cordon" in record.times or "drain" in record.times
        )
        if "aws_set_unhealthy" in record.times and not returned:
            kinds.add("aws_set_unhealthy")
        if not kinds:
            return None
        times = [t for kind, t in record.times.items() if kind in DISRUPTIVE]
        since = float(min(times)) if times else parse_rfc3339(annotations.get(CORDONED_AT, "")) or 0.0
        return Hold(since=since, dry_run=False, kinds=kinds)

    def holds(self, nodes: Sequence[Node]) -> dict[str, Hold]:
        """node -> its hold, for every node this service holds now (live decisions only)."""
        out = {}
        memo = self._holds
        for node in nodes:
            cached = memo.get(node.name)
            if cached is not None and cached[0] is node:
                hold = cached[1]
            else:
                annotations = node.annotations
                ours = self.claimed_cordon(node) or any(k in annotations for k in OURS)
                hold = self.hold(node) if ours else None
                memo[node.name] = (node, hold)
            if hold is not None:
                out[node.name] = hold
        if len(memo) > 2 * len(nodes) + 100:  # nodes gone: forget them now and then
            names = {n.name for n in nodes}
            self._holds = {k: v for k, v in memo.items() if k in names}
        return out


def taint_values(rules: Iterable[Rule]) -> Mapping[tuple[str, str], frozenset[str]]:
    """(key, effect) -> the values the policy's taint actions set: what a taint of this service looks
    like, so that one someone changed since is told apart and left alone."""
    out: dict[tuple[str, str], set[str]] = {}
    for rule in rules:
        for action in rule.actions:
            if isinstance(action, AddTaint):
                out.setdefault((action.key, action.effect), set()).add(action.value)
    return {k: frozenset(v) for k, v in out.items()}
