"""Property-based fuzz of the webhook: arbitrary bytes, arbitrary JSON, webhook-shaped documents with
wrong types in every field, and arbitrary headers. No input may get a 5xx or stop the service.

Each test drives one live service (the example cluster in memory, so actions really run) through
thousands of requests; the service keeps its state between examples, as it would in production.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.remediator.conftest import AUTH, AiohttpClient, Service

FUZZ = settings(
    max_examples=800,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    derandomize=True,
)

SCALARS = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=30)
JSON = st.recursive(
    SCALARS,
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=5)
    ),
    max_leaves=15,
)
NODES = st.sampled_from(["gpu-node-1", "gpu-node-2", "trn-node-1", "cp-1", "nope", ""]) | st.text(max_size=20)
LABELS = st.fixed_dictionaries(
    {"node": NODES},
    optional={
        "alertname": st.text(max_size=20),
        "remediation": st.sampled_from(["drain", "cordon", "taint", "replace", "none"]) | st.text(max_size=8),
        "severity": st.text(max_size=8),
    },
)
ALERT = st.fixed_dictionaries(
    {"labels": LABELS | JSON},
    optional={
        "status": st.sampled_from(["firing", "resolved"]) | JSON,
        "annotations": st.dictionaries(st.text(max_size=10), st.text(max_size=30), max_size=3) | JSON,
        "startsAt": st.sampled_from(["2025-11-22T20:00:00Z", ""]) | JSON,
        "endsAt": JSON,
        "generatorURL": JSON,
        "fingerprint": st.text(max_size=16) | JSON,
        "extraField": JSON,
    },
)
WEBHOOK = st.fixed_dictionaries(
    {"alerts": st.lists(ALERT, max_size=6) | JSON},
    optional={
        "version": st.just("4") | JSON,
        "status": JSON,
        "receiver": JSON,
        "groupLabels": JSON,
        "commonLabels": JSON,
        "commonAnnotations": JSON,
        "externalURL": JSON,
        "truncatedAlerts": st.integers() | JSON,
        "groupKey": JSON,
        "futureField": JSON,
    },
)
HEADER_TEXT = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=60)
HEADER_NAME = st.text(st.sampled_from("abcdefghijklmnopqrstuvwxyz-ABCXYZ0123456789"), min_size=1, max_size=20)


async def _still_answers(client: Any) -> None:
    assert (await client.get("/healthz")).status == 200


_CLIENTS: dict[int, Any] = {}


async def _client(aiohttp_client: AiohttpClient, service: Service) -> Any:
    """One test server per service, reused by every example of the test (hypothesis calls the test
    function many times with the same fixtures)."""
    if id(service) not in _CLIENTS or _CLIENTS[id(service)][0] is not service:
        _CLIENTS.clear()
        _CLIENTS[id(service)] = (service, await aiohttp_client(service.app))
    return _CLIENTS[id(service)][1]


@FUZZ
@given(body=st.binary(max_size=3000))
async def test_arbitrary_bytes_never_get_a_server_error(
    aiohttp_client: AiohttpClient, live_service: Service, body: bytes
) -> None:
    client = await _client(aiohttp_client, live_service)
    resp = await client.post("/alerts", data=body, headers=AUTH)
    assert resp.status in (200, 400)
    await _still_answers(client)


@settings(FUZZ, max_examples=600)
@given(doc=JSON)
async def test_arbitrary_json_never_gets_a_server_error(
    aiohttp_client: AiohttpClient, live_service: Service, doc: object
) -> None:
    client = await _client(aiohttp_client, live_service)
    resp = await client.post("/alerts", data=json.dumps(doc), headers=AUTH)
    assert resp.status in (200, 400)


@settings(FUZZ, max_examples=500)
@given(doc=WEBHOOK)
async def test_webhook_shaped_documents_with_any_field_types_never_get_a_server_error(
    aiohttp_client: AiohttpClient, live_service: Service, doc: dict[str, Any]
) -> None:
    client = await _client(aiohttp_client, live_service)
    resp = await client.post("/alerts", data=json.dumps(doc), headers=AUTH)
    assert resp.status in (200, 400), await resp.text()
    await _still_answers(client)


@FUZZ
@given(
    authorization=st.one_of(
        HEADER_TEXT,
        st.builds(lambda t: "Bearer " + t, HEADER_TEXT),
        st.builds(lambda t: "Basic " + t, HEADER_TEXT),
    ),
    content_type=HEADER_TEXT,
    extra=st.dictionaries(HEADER_NAME, HEADER_TEXT, max_size=4),
)
async def test_arbitrary_headers_never_get_a_server_error(
    aiohttp_client: AiohttpClient,
    live_service: Service,
    authorization: str,
    content_type: str,
    extra: dict[str, str],
) -> None:
    client = await _client(aiohttp_client, live_service)
    headers = {**extra, "Authorization": authorization, "Content-Type": content_type}
    body = b'{"alerts": []}'
    for path in ("/alerts", "/pause", "/resume"):
        resp = await client.post(path, data=body, headers=headers)
        assert resp.status < 500
        assert resp.status == 401  # never authorised by chance
    for path in ("/actions", "/state", "/nope"):
        assert (await client.get(path, headers=headers)).status < 500
    await _still_answers(client)
