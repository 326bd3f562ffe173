"""An optional API the API server does not serve (policy/v1 PodDisruptionBudgets answering 404, as
before Kubernetes 1.21) is a logged, counted condition: the webhook still answers 200, the drain plans
without the budget list and finishes through the Eviction API (which enforces the budgets itself), the
log says so once, and accel_remediator_api_unavailable_total counts it.
"""

from __future__ import annotations

import pytest

from remediator.executors.kubernetes import PDB_API
from remediator.lifecycle.record import DRAIN_STATUS
from tests.remediator.conftest import AUTH, AiohttpClient
from tests.remediator.fake_apiserver import node, pdb, pod, serve, status_error
from tests.remediator.test_background_drain import (
    INSTANCE,
    NODE,
    alert_body,
    drain_records,
    replace_policy,
    start_live,
    stop,
    wait_until,
)


async def test_a_server_without_the_pdb_api_still_drains_and_counts_the_missing_api(
    aiohttp_client: AiohttpClient, caplog: pytest.LogCaptureFixture
) -> None:
    async with serve() as (api, url):
        api.add(node(NODE, provider_id=f"aws:///us-east-1a/{INSTANCE}"))
        api.add(pod("db-0", node_name=NODE, labels={"app": "db"}, owner=("StatefulSet", "db")))
        api.add(pdb("db", match={"app": "db"}, allowed=1))  # still enforced by the eviction
        api["get", api.resource("policy/v1/poddisruptionbudgets")] << (
            lambda: status_error(404, "NotFound", "the server could not find the requested resource")
        )
        live = await start_live(api, url, aiohttp_client, replace_policy())
        try:
            assert await live.post(alert_body()) == 200
            await wait_until(lambda: [o for o, _ in drain_records(live.engine)] == ["started", "done"])
            assert await live.post(alert_body(fingerprint="fp-2")) == 200  # another delivery: logged once
            await live.engine.drained()
            metrics = await (await live.client.get("/metrics")).text()
            state = await (await live.client.get("/state", headers=AUTH)).json()
        finally:
            await stop(live)
    assert api.stored("nodes", NODE)["metadata"]["annotations"][DRAIN_STATUS] == "done"  # type: ignore[index]  # exists
    assert [(name, status) for _, name, status in api.evictions] == [("db-0", 201)]
    assert live.aws.calls  # the alert's later action ran
    count = live.cluster.api_unavailable[PDB_API]
    assert count >= 2  # the engine's plan and the executor's drain both asked
    assert f'accel_remediator_api_unavailable_total{{api="{PDB_API}"}} {float(count)}' in metrics
    assert state["api_unavailable"] == {PDB_API: count}
    assert caplog.text.count(f"the API server does not serve {PDB_API}") == 1


async def test_other_errors_from_the_pdb_api_are_still_backend_unavailable(
    aiohttp_client: AiohttpClient,
) -> None:
    async with serve() as (api, url):
        api.add(node(NODE))
        api.add(pod("w-0", node_name=NODE))
        api["get", api.resource("policy/v1/poddisruptionbudgets")] << (
            lambda: status_error(403, "Forbidden", "poddisruptionbudgets is forbidden")
        )
        live = await start_live(api, url, aiohttp_client, replace_policy())
        try:
            assert await live.post(alert_body()) == 503  # a forbidden list is not a missing API
        finally:
            await stop(live)
    assert live.cluster.api_unavailable == {}
