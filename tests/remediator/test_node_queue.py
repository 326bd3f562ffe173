"""The work queue keyed by node (remediator/lifecycle/queue.py) and the engine on it: one reconcile per
node at a time, nodes in parallel, no lock across nodes. A node whose write hangs holds only itself;
two nodes acting at once still share one disruption budget (a check that passes reserves the slot
until the write commits or fails); background triggers for one node collapse into one reconcile.
Order is proven by events (a write held open until the test lets it go), never by the clock."""

from __future__ import annotations

import asyncio
from typing import Any

from remediator.cluster import Node
from remediator.executors.snapshot import RecordingAws, SnapshotCluster
from remediator.intake.payload import WebhookPayload, parse_payload
from remediator.lifecycle.engine import Engine
from remediator.lifecycle.model import EngineSettings
from remediator.lifecycle.queue import NodeQueue
from remediator.lifecycle.record import RecordChange
from remediator.policy import parse_policy
from tests.remediator.conftest import FakeClock

CORDON_POLICY = """
safety: {max_disrupted_nodes: 1}
rules:
  - name: cordon
    actions: [cordon]
"""


def delivery(*pairs: tuple[str, str]) -> WebhookPayload:
    """One delivery with a firing alert per (node, fingerprint)."""
    return parse_payload(
        {
            "version": "4",
            "status": "firing",
            "alerts": [
                {
                    "status": "firing",
                    "labels": {"alertname": "AccelGPUFatalXid", "node": node},
                    "startsAt": "2026-11-28T10:00:00Z",
                    "fingerprint": fp,
                }
                for node, fp in pairs
            ],
        }
    )


class HeldCordons(SnapshotCluster):
    """A snapshot whose cordon of a chosen node waits until the test opens its gate."""

    def __init__(self, nodes: list[Node]) -> None:
        super().__init__(nodes=nodes, pods=[], pdbs=[])
        self.doors: dict[str, asyncio.Event] = {}
        self.entered: dict[str, asyncio.Event] = {}

    def hold(self, node: str) -> None:
        self.doors[node] = asyncio.Event()
        self.entered[node] = asyncio.Event()

    async def cordon(self, node: str, *, record: RecordChange | None = None) -> bool:
        if node in self.doors:
            self.entered[node].set()
            await self.doors[node].wait()
        return await super().cordon(node, record=record)


def gpu(name: str) -> Node:
    return Node(name=name, accelerators=("nvidia.com/gpu",))


def engine_on(cluster: SnapshotCluster, policy: str = CORDON_POLICY) -> Engine:
    return Engine(
        policy=parse_policy(policy),
        cluster=cluster,
        aws=RecordingAws(),
        settings=EngineSettings(),
        clock=FakeClock(),
    )


def outcomes(engine: Engine, node: str) -> list[tuple[str, str]]:
    return [(r.action, r.outcome) for r in engine.log.records() if r.node == node]


async def test_a_node_whose_write_hangs_holds_only_itself() -> None:
    cluster = HeldCordons([gpu(f"n{i}") for i in range(4)])
    engine = engine_on(cluster, CORDON_POLICY.replace("max_disrupted_nodes: 1", "max_disrupted_nodes: 4"))
    cluster.hold("n0")
    slow = asyncio.create_task(engine.handle(delivery(("n0", "fp-0"))))
    await cluster.entered["n0"].wait()  # n0's cordon is in flight and stays so
    await engine.handle(delivery(("n1", "fp-1")))  # answered while n0 still waits
    assert outcomes(engine, "n1") == [("cordon", "done")]
    assert cluster.nodes["n1"].unschedulable
    assert not slow.done()
    cluster.doors["n0"].set()
    await slow
    assert outcomes(engine, "n0") == [("cordon", "done")]


async def test_two_deliveries_for_one_node_never_interleave() -> None:
    cluster = HeldCordons([gpu("n0")])
    engine = engine_on(cluster)
    cluster.hold("n0")
    first = asyncio.create_task(engine.handle(delivery(("n0", "fp-a"))))
    await cluster.entered["n0"].wait()
    second = asyncio.create_task(engine.handle(delivery(("n0", "fp-b"))))
    await asyncio.sleep(0)  # let the second delivery reach the node's lock
    assert engine.queue.busy("n0")
    assert outcomes(engine, "n0") == []  # the second waits for the first, it did not decide alone
    cluster.doors["n0"].set()
    await asyncio.gather(first, second)
    # The second alert found the node cordoned by the first: decided after it, not beside it.
    assert outcomes(engine, "n0") == [("cordon", "done"), ("cordon", "skipped")]


async def test_nodes_acting_at_once_share_one_budget_slot() -> None:
    cluster = HeldCordons([gpu("n0"), gpu("n1")])
    engine = engine_on(cluster)
    cluster.hold("n0")
    first = asyncio.create_task(engine.handle(delivery(("n0", "fp-0"))))
    await cluster.entered["n0"].wait()  # n0 passed the budget check; its write is in flight
    await engine.handle(delivery(("n1", "fp-1")))
    assert outcomes(engine, "n1") == [("cordon", "deferred")]
    assert "budget exhausted" in engine.log.records()[-1].reason
    cluster.doors["n0"].set()
    await first
    assert outcomes(engine, "n0") == [("cordon", "done")]
    assert not cluster.nodes["n1"].unschedulable


async def test_a_reservation_whose_write_fails_gives_the_slot_back() -> None:
    class Failing(SnapshotCluster):
        async def cordon(self, node: str, *, record: RecordChange | None = None) -> bool:
            if node == "n0":
                raise RuntimeError("admission webhook said no")
            return await super().cordon(node, record=record)

    cluster = Failing(nodes=[gpu("n0"), gpu("n1")], pods=[], pdbs=[])
    engine = engine_on(cluster)
    await engine.handle(delivery(("n0", "fp-0")))
    assert outcomes(engine, "n0") == [("cordon", "failed")]
    assert engine.gates.budget.in_use == 0
    await engine.handle(delivery(("n1", "fp-1")))
    assert outcomes(engine, "n1") == [("cordon", "done")]


async def test_one_delivery_naming_many_nodes_acts_on_each_in_parallel() -> None:
    cluster = HeldCordons([gpu(f"n{i}") for i in range(12)])  # 3 of 12 alerting: no storm
    engine = engine_on(cluster, CORDON_POLICY.replace("max_disrupted_nodes: 1", "max_disrupted_nodes: 3"))
    for name in ("n0", "n1", "n2"):
        cluster.hold(name)
    task = asyncio.create_task(engine.handle(delivery(("n0", "a"), ("n1", "b"), ("n2", "c"))))
    for name in ("n0", "n1", "n2"):  # all three writes in flight at once
        await cluster.entered[name].wait()
    for name in ("n2", "n0", "n1"):
        cluster.doors[name].set()
    plans = await task
    assert [p.node for p in plans] == ["n0", "n1", "n2"]  # the answer keeps the delivery's order
    assert all(cluster.nodes[n].unschedulable for n in ("n0", "n1", "n2"))


async def test_triggers_for_one_node_collapse_and_a_trigger_while_it_runs_runs_it_again() -> None:
    queue = NodeQueue(workers=2)
    seen: list[str] = []
    running = asyncio.Event()
    release = asyncio.Event()

    async def reconcile(node: str) -> None:
        seen.append(node)
        if len(seen) == 1:
            running.set()
            await release.wait()

    for _ in range(5):
        queue.add("n0")
    queue.start(reconcile)
    await running.wait()
    queue.add("n0")  # while its reconcile runs: once more after it
    queue.add("n0")
    queue.add("n1")
    release.set()
    await queue.idle()
    await queue.stop()
    assert sorted(seen) == ["n0", "n0", "n1"]


async def test_a_reconcile_that_raises_is_tried_again() -> None:
    queue = NodeQueue(retry_seconds=0.0)
    calls: list[int] = []
    done = asyncio.Event()

    async def reconcile(node: str) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("API hiccup")
        done.set()

    queue.start(reconcile)
    queue.add("n0")
    await done.wait()
    await queue.stop()
    assert len(calls) == 2
    assert queue.failures == 1
