"""Shared helpers for the remediator tests: the example snapshot and payloads, and an app builder."""

from __future__ import annotations

import copy
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from remediator.app import create_app
from remediator.engine import Engine, EngineSettings
from remediator.executors.snapshot import RecordingAws, SnapshotCluster
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


class Service:
    """An engine over the example snapshot, plus the app serving it."""

    def __init__(
        self, *, dry_run: bool, policy: Policy | None = None, clock: Callable[[], float] = lambda: 1000.0
    ):
        self.cluster = SnapshotCluster.from_file(SNAPSHOT)
        self.aws = RecordingAws()
        self.engine = Engine(
            policy=policy or load_policy(),
            cluster=self.cluster,
            aws=self.aws,
            settings=EngineSettings(dry_run=dry_run),
            clock=clock,
        )
        self.app = create_app(engine=self.engine, token=TOKEN)


@pytest.fixture
def dry_service() -> Service:
    return Service(dry_run=True)


@pytest.fixture
def live_service() -> Service:
    return Service(dry_run=False)
