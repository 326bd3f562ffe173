"""The repair loop (remediator/lifecycle/repair.py) inside the aiohttp service: a background task, its
metrics, and a look again after every delivery that acted. Kept apart so that the engine and the app
factory need no more than a call to `install`."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

from aiohttp import web

from remediator.audit import DecisionRecord
from remediator.cluster import Cluster
from remediator.intake.app import ENGINE, METRICS
from remediator.lifecycle.repair import OWN_ACTIONS, RepairCollector, RepairLoop, Verifier

REPAIR = web.AppKey("repair", RepairLoop)
TAKES_OUT = frozenset({"condition", "cordon", "taint", "drain"})


def wants_a_look(record: DecisionRecord) -> bool:
    """A decision after which the loop looks again at once: a node was taken out (its quarantine is
    recorded with the boot id it has now), or an alert resolved (a repaired node may be returnable)."""
    if record.action in OWN_ACTIONS:
        return False  # the loop's own decisions
    return record.status == "resolved" or (record.outcome == "done" and record.action in TAKES_OUT)


def install(
    app: web.Application,
    *,
    cluster: Cluster,
    verifier: Verifier,
    should_run: Callable[[], bool] = lambda: True,
) -> RepairLoop:
    """Run the repair loop for the application's lifetime, on the leader (`should_run`)."""
    engine = app[ENGINE]
    loop = RepairLoop(
        policy=engine.policy,
        cluster=cluster,
        verifier=verifier,
        firing=engine.causes,
        publish=engine.publish,
        dry_run=engine.settings.dry_run,
        node_lock=engine.queue.lock,
    )
    app[REPAIR] = loop
    app[METRICS].registry.register(RepairCollector(loop))

    engine.subscribe(lambda record: loop.poke() if wants_a_look(record) else None)

    async def run(_app: web.Application) -> AsyncIterator[None]:
        task = asyncio.create_task(loop.run(should_run=should_run), name="repair-loop")
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    app.cleanup_ctx.append(run)
    return loop
