"""The aiohttp service.

    POST /alerts    Alertmanager webhook v4 (auth)        GET /actions   decision records (auth)
    GET  /state     gates, deferred actions, drains (auth)     POST /pause, /resume  the switch (auth)
    GET  /metrics   GET /healthz   GET /readyz

Answers on /alerts: 200 when decided (acted, deferred or ignored), 400 for a body that is not a
webhook payload, 401 without valid credentials, 413 over the body limit, 503 when the cluster could
not be reached (Alertmanager retries 5xx, never 4xx).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hmac
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from remediator.cluster import BackendUnavailable
from remediator.desired.alertmanager import AlertmanagerPoller
from remediator.intake.payload import PayloadError, parse_body
from remediator.lifecycle.engine import Engine
from remediator.lifecycle.holds import as_json, held_nodes
from remediator.lifecycle.status import as_json as status_json
from remediator.lifecycle.status import node_statuses
from remediator.metrics import RemediatorMetrics

MAX_BODY_BYTES = 1024 * 1024
logger = logging.getLogger("remediator.intake.app")


@dataclass
class ServiceState:
    """Mutable per-application state."""

    ready: bool = False
    """True between start-up and shutdown."""


@dataclass(frozen=True)
class Credentials:
    """What a request must present; both None means no authentication (--insecure-no-auth)."""

    bearer_token: str | None = None
    """`Authorization: Bearer <token>` (Alertmanager: http_config.authorization.credentials_file)."""
    basic_auth: tuple[str, str] | None = None
    """`Authorization: Basic ...` with this user and password (Alertmanager: http_config.basic_auth)."""

    @property
    def required(self) -> bool:
        return self.bearer_token is not None or self.basic_auth is not None


ENGINE = web.AppKey("engine", Engine)
METRICS = web.AppKey("metrics", RemediatorMetrics)
CREDENTIALS = web.AppKey("credentials", Credentials)
STATE = web.AppKey("state", ServiceState)
MAX_BODY = web.AppKey("max_body_bytes", int)
POLLER = web.AppKey("alertmanager_poller", AlertmanagerPoller)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _error(status: int, message: str, **headers: str) -> web.Response:
    return web.json_response({"error": message}, status=status, headers=headers or None)


def _bytes(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")


def _authorized(request: web.Request) -> bool:
    """Constant-time comparison of whatever credentials are configured."""
    creds = request.app[CREDENTIALS]
    if not creds.required:
        return True
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    scheme = scheme.lower()
    given = given.strip()
    if scheme == "bearer" and creds.bearer_token is not None:
        return hmac.compare_digest(_bytes(given), _bytes(creds.bearer_token))
    if scheme == "basic" and creds.basic_auth is not None:
        try:
            decoded = base64.b64decode(_bytes(given), validate=True)
        except (binascii.Error, ValueError):
            return False
        user, sep, password = decoded.partition(b":")
        want_user, want_password = creds.basic_auth
        ok_user = hmac.compare_digest(user, _bytes(want_user))
        ok_password = hmac.compare_digest(password, _bytes(want_password))
        return bool(sep) and ok_user and ok_password
    return False


def _unauthorized(request: web.Request) -> web.Response:
    creds = request.app[CREDENTIALS]
    challenge = (
        'Bearer realm="accel-health"' if creds.bearer_token is not None else 'Basic realm="accel-health"'
    )
    return _error(401, "missing or wrong credentials", **{"WWW-Authenticate": challenge})


async def receive_alerts(request: web.Request) -> web.Response:
    """Alertmanager webhook v4."""
    if not _authorized(request):
        return _unauthorized(request)
    max_size = request.app[MAX_BODY]
    if request.content_length is not None and request.content_length > max_size:
        return _error(413, f"body larger than {max_size} bytes")
    try:
        body = await request.read()
    except web.HTTPRequestEntityTooLarge:
        return _error(413, f"body larger than {max_size} bytes")
    try:
        payload = parse_body(body)
    except PayloadError as exc:
        return _error(400, f"invalid Alertmanager webhook payload: {exc}")
    if payload.truncated_alerts > 0:
        # max_alerts cut the group: the alerts left out are decided when the API or a later
        # delivery shows them. Said in the log and the answer, never silently.
        logger.warning(
            "delivery of group %s left out %d alert(s) (Alertmanager max_alerts); raise max_alerts on "
            "this receiver",
            payload.group_key,
            payload.truncated_alerts,
        )
    try:
        plans = await request.app[ENGINE].handle(payload)
    except BackendUnavailable as exc:
        logger.warning("backend unavailable, asking Alertmanager to retry: %s", exc)
        return _error(503, f"backend unavailable, retry later: {exc}", **{"Retry-After": "10"})
    if POLLER in request.app:
        request.app[POLLER].poke()  # a delivery says "look again": read what fires now
    outcomes: dict[str, int] = {}
    for plan in plans:
        for record in plan.records:
            outcomes[record.outcome] = outcomes.get(record.outcome, 0) + 1
    return web.json_response(
        {
            "status": "ok",
            "alerts": len(payload.alerts),
            "new_decisions": sum(outcomes.values()),
            "outcomes": outcomes,
            "truncated_alerts": payload.truncated_alerts,
        }
    )


async def list_actions(request: web.Request) -> web.Response:
    """Decision records, newest last."""
    if not _authorized(request):
        return _unauthorized(request)
    records = [r.as_json() for r in request.app[ENGINE].log.records()]
    return web.json_response(records)


async def show_state(request: web.Request) -> web.Response:
    """The gates and the deferred actions waiting for a resend."""
    if not _authorized(request):
        return _unauthorized(request)
    engine = request.app[ENGINE]
    await engine.refresh()  # the nodes as they are now: a human's uncordon shows at once
    body = engine.status().as_json()
    nodes = await engine.view.all()
    body["holds"] = as_json(held_nodes(nodes, engine.policy))
    body["nodes"] = status_json(node_statuses(nodes, engine.policy, deferred=engine.deferred_by_node()))
    body["dry_run"] = engine.settings.dry_run
    body["pending"] = [p.as_json() for p in engine.pending.values()]
    return web.json_response(body)


async def _pause_reason(request: web.Request) -> str | web.Response:
    body = await request.read()
    if not body.strip():
        return ""
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):
        return _error(400, 'expected no body or a JSON object like {"reason": "..."}')
    if not isinstance(doc, dict) or not isinstance(doc.get("reason", ""), str):
        return _error(400, 'expected no body or a JSON object like {"reason": "..."}')
    reason: str = doc.get("reason", "")
    return reason


async def pause(request: web.Request) -> web.Response:
    """Stop every action until POST /resume (kept in the gate state: survives restarts)."""
    if not _authorized(request):
        return _unauthorized(request)
    reason = await _pause_reason(request)
    if isinstance(reason, web.Response):
        return reason
    try:
        changed = await request.app[ENGINE].set_paused(True, reason or "paused over HTTP")
    except BackendUnavailable as exc:
        return _error(503, f"could not store the pause in the cluster, retry: {exc}")
    return web.json_response({"paused": True, "changed": changed})


async def resume(request: web.Request) -> web.Response:
    """Lift the pause."""
    if not _authorized(request):
        return _unauthorized(request)
    try:
        changed = await request.app[ENGINE].set_paused(False)
    except BackendUnavailable as exc:
        return _error(503, f"could not store the change in the cluster, retry: {exc}")
    return web.json_response({"paused": False, "changed": changed})


async def healthz(request: web.Request) -> web.Response:
    del request
    return web.Response(text="ok\n")


async def readyz(request: web.Request) -> web.Response:
    if request.app[STATE].ready:
        return web.Response(text="ready\n")
    return web.Response(text="not ready\n", status=503)


async def metrics(request: web.Request) -> web.Response:
    await request.app[ENGINE].refresh()  # the gauges show the nodes as they are now
    return web.Response(body=request.app[METRICS].exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST})


@web.middleware
async def count_webhooks(request: web.Request, handler: Handler) -> web.StreamResponse:
    """accel_remediator_webhooks_total{code} for every answer on /alerts, errors included."""
    if request.path != "/alerts":
        return await handler(request)
    try:
        response = await handler(request)
    except web.HTTPException as exc:
        request.app[METRICS].webhook_answered(exc.status)
        raise
    request.app[METRICS].webhook_answered(response.status)
    return response


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    """Rebuild the view from the cluster, then ready until shutdown."""
    engine = app[ENGINE]
    await engine.start()
    status = engine.status()
    logger.info(
        "policy %s: %d rules; dry-run %s; budget %d of %d nodes in use; breaker %s; %s",
        engine.policy.source,
        len(engine.policy.rules),
        "on" if engine.settings.dry_run else "off",
        status.budget_in_use,
        status.budget_capacity,
        "OPEN" if status.breaker_open else "closed",
        f"PAUSED ({status.pause_reason})" if status.paused else "not paused",
    )
    app[STATE].ready = True
    yield
    app[STATE].ready = False
    await engine.stop()  # normally done already, on shutdown
    logger.info("stopping")


async def _stop_drains(app: web.Application) -> None:
    """Cancel the drains running in the background before any cleanup runs.

    On shutdown rather than in the cleanup above: cleanup contexts registered later (the Kubernetes
    client, the leader Lease) are torn down first, and a drain must stop before its client closes or
    its Lease is handed back. The executor's annotations let the next delivery resume each drain.
    """
    await app[ENGINE].stop()


async def _poll_alertmanager(app: web.Application) -> AsyncIterator[None]:
    """Read what fires now from Alertmanager while leading (remediator/desired/alertmanager.py)."""
    poller = app[POLLER]
    task = asyncio.create_task(poller.run(), name="alertmanager-poller")
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await poller.client.close()


def create_app(
    *,
    engine: Engine,
    token: str | None,
    basic_auth: tuple[str, str] | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    alertmanager: AlertmanagerPoller | None = None,
) -> web.Application:
    """The remediator service. `token=None` and `basic_auth=None` disable auth (--insecure-no-auth).
    With `alertmanager`, the desired state is read from Alertmanager's API while leading."""
    app = web.Application(client_max_size=max_body_bytes, middlewares=[count_webhooks])
    app[ENGINE] = engine
    app[CREDENTIALS] = Credentials(bearer_token=token or None, basic_auth=basic_auth)
    app[MAX_BODY] = max_body_bytes
    app[STATE] = ServiceState()
    app[METRICS] = RemediatorMetrics(status=engine.status)
    engine.subscribe(app[METRICS].observe)
    app.cleanup_ctx.append(_lifecycle)
    app.on_shutdown.append(_stop_drains)
    if alertmanager is not None:
        app[POLLER] = alertmanager
        app[METRICS].track_alertmanager(alertmanager.counters)
        app.cleanup_ctx.append(_poll_alertmanager)
    app.router.add_post("/alerts", receive_alerts)
    app.router.add_get("/actions", list_actions)
    app.router.add_get("/state", show_state)
    app.router.add_post("/pause", pause)
    app.router.add_post("/resume", resume)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    return app
