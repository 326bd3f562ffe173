"""Shared helpers for the remediator tests: the example snapshot and payloads, a cluster that counts
the calls made through the Cluster seam, an injected clock, and an app builder."""

from __future__ import annotations

import copy
import json
from collections import Counter
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from remediator.cluster import (
    DrainOutcome,
    DrainSettings,
    EvictionResult,
    Node,
    NodeCondition,
    NodeListener,
    Pod,
    PodDisruptionBudget,
    Returned,
    Taint,
)
from remediator.executors.snapshot import RecordingAws, SnapshotCluster
from remediator.intake.app import create_app
from remediator.lifecycle.engine import Engine
from remediator.lifecycle.model import EngineSettings
from remediator.lifecycle.record import RecordChange
from remediator.policy import Policy, load_policy

REPO = Path(__file__).resolve().parents[2]
SNAPSHOT = REPO / "examples" / "cluster-snapshot.yaml"
PAYLOADS = REPO / "examples" / "payloads"
TOKEN = "test-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}

AiohttpClient = Callable[[web.Application], Awaitable[TestClient[web.Request, web.Application]]]


def payload(name: str) -> dict[str, Any]:
    """A fresh copy of examples/payloads/<name>.json."""
    loaded: dict[str, Any] = json.loads((PAYLOADS / f"{name}.json").read_text())
    return copy.deepcopy(loaded)


MUTATING = frozenset(
    {
        "cordon",
        "uncordon",
        "add_taint",
        "remove_taint",
        "set_condition",
        "record_event",
        "evict_pod",
        "annotate_node",
        "label_node",
        "drain",
        "start_drain",
        "save_gates",
        "delete_legacy_state",
        "set_startup_taint",
        "save_quarantine",
        "delete_quarantine",
        "return_node",
    }
)


class FakeClock:
    """A clock the test moves by hand."""

    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class CountingCluster:
    """The Cluster seam, counting every call by method name before handing it to a snapshot."""

    def __init__(self, inner: SnapshotCluster) -> None:
        self.inner = inner
        self.calls: Counter[str] = Counter()

    @property
    def mutating_calls(self) -> int:
        return sum(n for name, n in self.calls.items() if name in MUTATING)

    async def get_node(self, name: str) -> Node | None:
        self.calls["get_node"] += 1
        return await self.inner.get_node(name)

    async def list_nodes(self) -> list[Node]:
        self.calls["list_nodes"] += 1
        return await self.inner.list_nodes()

    async def list_pods(self, node: str) -> list[Pod]:
        self.calls["list_pods"] += 1
        return await self.inner.list_pods(node)

    async def list_pdbs(self) -> list[PodDisruptionBudget]:
        self.calls["list_pdbs"] += 1
        return await self.inner.list_pdbs()

    async def daemonsets_exist(self, refs: Collection[tuple[str, str]]) -> set[tuple[str, str]] | None:
        self.calls["daemonsets_exist"] += 1
        return await self.inner.daemonsets_exist(refs)

    async def cordon(self, node: str, *, record: RecordChange | None = None) -> bool:
        self.calls["cordon"] += 1
        return await self.inner.cordon(node, record=record)

    async def uncordon(self, node: str, *, record: RecordChange | None = None) -> bool:
        self.calls["uncordon"] += 1
        return await self.inner.uncordon(node, record=record)

    async def add_taint(self, node: str, taint: Taint, *, record: RecordChange | None = None) -> None:
        self.calls["add_taint"] += 1
        await self.inner.add_taint(node, taint, record=record)

    async def remove_taint(self, node: str, taint: Taint, *, record: RecordChange | None = None) -> None:
        self.calls["remove_taint"] += 1
        await self.inner.remove_taint(node, taint, record=record)

    async def set_condition(
        self,
        node: str,
        condition: NodeCondition,
        *,
        record: RecordChange | None = None,
        annotations: Mapping[str, str | None] | None = None,
    ) -> None:
        self.calls["set_condition"] += 1
        await self.inner.set_condition(node, condition, record=record, annotations=annotations)

    async def return_node(
        self,
        node: str,
        *,
        uid: str,
        taints: Sequence[Taint],
        annotations: Mapping[str, str | None],
        record: RecordChange | None = None,
    ) -> Returned | None:
        self.calls["return_node"] += 1
        return await self.inner.return_node(
            node, uid=uid, taints=taints, annotations=annotations, record=record
        )

    async def record_event(self, *, node: str, reason: str, message: str, type_: str) -> None:
        self.calls["record_event"] += 1
        await self.inner.record_event(node=node, reason=reason, message=message, type_=type_)

    async def annotate_node(
        self, node: str, annotations: Mapping[str, str | None], *, record: RecordChange | None = None
    ) -> None:
        self.calls["annotate_node"] += 1
        await self.inner.annotate_node(node, annotations, record=record)

    async def label_node(self, node: str, labels: Mapping[str, str | None]) -> None:
        self.calls["label_node"] += 1
        await self.inner.label_node(node, labels)

    async def evict_pod(
        self, *, namespace: str, name: str, grace_period_seconds: int | None
    ) -> EvictionResult:
        self.calls["evict_pod"] += 1
        return await self.inner.evict_pod(
            namespace=namespace, name=name, grace_period_seconds=grace_period_seconds
        )

    async def start_drain(
        self, node: str, settings: DrainSettings, *, record: RecordChange | None = None
    ) -> None:
        self.calls["start_drain"] += 1
        await self.inner.start_drain(node, settings, record=record)

    async def drain(
        self,
        node: str,
        settings: DrainSettings,
        *,
        ended: Callable[[DrainOutcome], RecordChange | None] | None = None,
    ) -> DrainOutcome:
        self.calls["drain"] += 1
        return await self.inner.drain(node, settings, ended=ended)

    async def load_gates(self) -> Mapping[str, Any] | None:
        self.calls["load_gates"] += 1
        return await self.inner.load_gates()

    async def save_gates(self, document: Mapping[str, Any]) -> None:
        self.calls["save_gates"] += 1
        await self.inner.save_gates(document)

    async def load_legacy_state(self) -> Mapping[str, Any] | None:
        self.calls["load_legacy_state"] += 1
        return await self.inner.load_legacy_state()

    async def delete_legacy_state(self) -> None:
        self.calls["delete_legacy_state"] += 1
        await self.inner.delete_legacy_state()

    def watch_nodes(self, listener: NodeListener) -> None:
        self.inner.watch_nodes(listener)

    def observed_nodes(self) -> list[Node] | None:
        self.calls["observed_nodes"] += 1
        return self.inner.observed_nodes()

    async def set_startup_taint(
        self,
        node: str,
        *,
        uid: str,
        taint: Taint,
        present: bool,
        annotations: Mapping[str, str | None],
        labels: Mapping[str, str | None],
    ) -> bool:
        self.calls["set_startup_taint"] += 1
        return await self.inner.set_startup_taint(
            node, uid=uid, taint=taint, present=present, annotations=annotations, labels=labels
        )

    async def load_quarantines(self) -> Mapping[str, Mapping[str, Any]]:
        self.calls["load_quarantines"] += 1
        return await self.inner.load_quarantines()

    async def save_quarantine(self, node: str, document: Mapping[str, Any]) -> None:
        self.calls["save_quarantine"] += 1
        await self.inner.save_quarantine(node, document)

    async def delete_quarantine(self, node: str) -> None:
        self.calls["delete_quarantine"] += 1
        await self.inner.delete_quarantine(node)


class Service:
    """An engine over the example snapshot, plus the app serving it."""

    def __init__(
        self,
        *,
        dry_run: bool,
        policy: Policy | None = None,
        clock: Callable[[], float] | None = None,
        cluster: SnapshotCluster | None = None,
        basic_auth: tuple[str, str] | None = None,
    ):
        self.cluster = cluster if cluster is not None else SnapshotCluster.from_file(SNAPSHOT)
        self.counting = CountingCluster(self.cluster)
        self.aws = RecordingAws()
        self.clock = clock if clock is not None else FakeClock()
        self.engine = Engine(
            policy=policy or load_policy(),
            cluster=self.counting,
            aws=self.aws,
            settings=EngineSettings(dry_run=dry_run),
            clock=self.clock,
        )
        self.app = create_app(engine=self.engine, token=TOKEN, basic_auth=basic_auth)


@pytest.fixture
def dry_service() -> Service:
    return Service(dry_run=True)


@pytest.fixture
def live_service() -> Service:
    return Service(dry_run=False)
