"""Races around a drain running in the background, each driven to the moment it bites on the
in-memory cluster: the drain's end and the Event of its start, a fail-over's Events, a drain whose
alerts all resolved, an alert that arrives while the end of the node's drain is being written."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from remediator.cluster import DrainOutcome, DrainSettings
from remediator.executors.snapshot import RecordingAws, SnapshotCluster
from remediator.lifecycle.record import DRAIN_STATUS, NodeRecord, RecordChange, read
from tests.remediator.test_lifecycle import HeldDrains, alert, decisions, engine_on, gpu, settled, work_pod

DRAIN = 2
"""The drain's index in test_lifecycle's `drain` rule (condition, cordon, drain, aws_set_unhealthy)."""


def nodes() -> list[Any]:
    return [gpu("gpu-1")] + [gpu(f"n{i}") for i in range(8)]


def drained(record: NodeRecord, fingerprint: str) -> bool:
    """Does the record say the episode's drain was decided (its end recorded)?"""
    episode = record.episodes.get(fingerprint)
    return episode is not None and bool(episode.steps >> DRAIN & 1)


class EndDuringStartEvent(SnapshotCluster):
    """The drain waits for the `nth` AccelDrainStarted Event, then ends while that Event is still
    being written; `at_end` keeps the node's record as each drain's end wrote it."""

    def __init__(self, *args: Any, nth: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.nth = nth
        self.started_events = 0
        self.go = asyncio.Event()
        self.returned = asyncio.Event()
        self.at_end: list[NodeRecord] = []

    async def drain(
        self,
        node: str,
        settings: DrainSettings,
        *,
        ended: Callable[[DrainOutcome], RecordChange | None] | None = None,
    ) -> DrainOutcome:
        await self.go.wait()
        outcome = await super().drain(node, settings, ended=ended)
        self.at_end.append(read(self.nodes[node].annotations))
        self.returned.set()
        return outcome

    async def record_event(self, *, node: str, reason: str, message: str, type_: str) -> None:
        if reason == "AccelDrainStarted":
            self.started_events += 1
            if self.started_events == self.nth:
                self.go.set()
                await self.returned.wait()  # the drain ends while this Event is written
        await super().record_event(node=node, reason=reason, message=message, type_=type_)


@pytest.mark.parametrize("joined", [False, True], ids=["started", "joined"])
async def test_a_drain_ending_while_its_start_event_is_written_records_its_end_for_every_alert(
    joined: bool,
) -> None:
    cluster = EndDuringStartEvent(nodes=nodes(), pods=[work_pod("gpu-1")], pdbs=[], nth=2 if joined else 1)
    aws = RecordingAws()
    engine = engine_on(cluster, aws=aws)
    fingerprints = ["fp-1", "fp-2"] if joined else ["fp-1"]
    for fingerprint in fingerprints:
        await engine.handle(alert("gpu-1", fingerprint=fingerprint))
    await settled(engine)
    [at_end] = cluster.at_end
    for fingerprint in fingerprints:  # the end's own write records it for each, whoever joined when
        assert drained(at_end, fingerprint), fingerprint
    assert at_end.phase == "repair"
    by_alert = [(r.fingerprint, r.action, r.outcome) for r in engine.log.records()]
    for fingerprint in fingerprints:
        assert (fingerprint, "drain", "done") in by_alert
    assert ("fp-1", "aws_set_unhealthy", "done") in by_alert
    assert len(aws.calls) == 1


async def test_a_new_leader_does_not_tell_again_what_the_previous_one_told_of_the_episode() -> None:
    """The first leader cordons, starts the drain and tells of each, then hands over mid-drain; the
    new one resumes the drain: the fault seen and the drain's start are not told twice."""
    cluster = HeldDrains(nodes=nodes(), pods=[work_pod("gpu-1")], pdbs=[])
    first = engine_on(cluster)
    await first.handle(alert("gpu-1"))
    await cluster.draining.setdefault("gpu-1", asyncio.Event()).wait()
    await first.stop()  # a graceful hand-over: the drain is left in progress
    cluster._listeners.clear()  # and the first leader's watch of the nodes ends with it
    told = [e["reason"] for e in cluster.events]
    assert told == ["AccelFaultDetected", "AccelCordoned", "AccelDrainStarted"]

    aws = RecordingAws()
    second = engine_on(cluster, aws=aws)
    await second.sync()  # resumes the drain left running
    cluster.finish.set()
    await settled(second)
    assert ("drain", "done") in decisions(second)
    assert len(aws.calls) == 1
    reasons = [e["reason"] for e in cluster.events]
    assert reasons == [*told, "AccelDrainFinished", "AccelInstanceMarkedUnhealthy"]  # each once


async def test_a_drain_ending_after_all_its_alerts_resolved_moves_the_node_on_to_repair() -> None:
    cluster = HeldDrains(nodes=nodes(), pods=[work_pod("gpu-1")], pdbs=[])
    aws = RecordingAws()
    engine = engine_on(cluster, aws=aws)
    await engine.handle(alert("gpu-1"))
    await cluster.draining.setdefault("gpu-1", asyncio.Event()).wait()
    await engine.handle(alert("gpu-1", status="resolved"))  # resolves while the drain runs
    cluster.finish.set()
    await settled(engine)
    assert [(r.action, r.outcome, r.status) for r in engine.log.records() if r.action != "none"][-2:] == [
        ("drain", "done", "resolved"),
        ("aws_set_unhealthy", "skipped", "resolved"),
    ]
    assert cluster.nodes["gpu-1"].annotations[DRAIN_STATUS] == "done"
    assert read(cluster.nodes["gpu-1"].annotations).phase == "repair"  # drained: not `draining` any more
    assert aws.calls == []


class EndWrittenSlowly(SnapshotCluster):
    """The first drain's end is taken (`ended`) and then written slowly, as a PATCH to the API server
    takes its time; `ends` keeps what each drain's end wrote to the record."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ends: list[RecordChange | None] = []
        self.writing = asyncio.Event()
        self.written = asyncio.Event()

    async def drain(
        self,
        node: str,
        settings: DrainSettings,
        *,
        ended: Callable[[DrainOutcome], RecordChange | None] | None = None,
    ) -> DrainOutcome:
        outcome = await self._drain(node, settings)
        change = ended(outcome) if ended is not None else None
        self.ends.append(change)
        if len(self.ends) == 1:
            self.writing.set()
            await self.written.wait()
        status = "done" if outcome.completed else ("timed-out" if outcome.timed_out else "refused")
        self._replace_node(node, annotations=self._annotations(node, {DRAIN_STATUS: status}, change))
        return outcome


async def test_an_alert_arriving_while_the_drains_end_is_written_does_not_join_it() -> None:
    cluster = EndWrittenSlowly(nodes=nodes(), pods=[work_pod("gpu-1")], pdbs=[])
    engine = engine_on(cluster)
    await engine.handle(alert("gpu-1", fingerprint="fp-1"))
    await cluster.writing.wait()  # the end of fp-1's drain is taken, and being written
    await engine.handle(alert("gpu-1", fingerprint="fp-2"))
    cluster.written.set()
    await settled(engine)
    started = [r for r in engine.log.records() if r.fingerprint == "fp-2" and r.outcome == "started"]
    assert [r.action for r in started] == ["drain"]
    assert "joins the drain" not in started[0].reason  # it starts afresh
    recorded = [e for change in cluster.ends if change is not None for e in change.episodes]
    assert any(e.fingerprint == "fp-2" and e.steps >> DRAIN & 1 for e in recorded)  # its end recorded
    by_alert = [(r.fingerprint, r.action, r.outcome) for r in engine.log.records()]
    assert ("fp-1", "drain", "done") in by_alert
    assert ("fp-2", "drain", "done") in by_alert
    assert not engine.drains.running
    assert cluster.nodes["gpu-1"].annotations[DRAIN_STATUS] == "done"
    assert drained(read(cluster.nodes["gpu-1"].annotations), "fp-2")
