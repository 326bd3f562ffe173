"""The aiohttp service: POST /alerts, GET /actions, /healthz, /readyz, /metrics."""

from __future__ import annotations

import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from remediator.cluster import BackendUnavailable
from remediator.engine import Engine
from remediator.metrics import RemediatorMetrics
from remediator.payload import PayloadError, parse_body

MAX_BODY_BYTES = 1024 * 1024
logger = logging.getLogger("remediator.app")


@dataclass
class ServiceState:
    """Mutable per-application state."""

    ready: bool = False
    """True between start-up and shutdown."""


ENGINE = web.AppKey("engine", Engine)
METRICS = web.AppKey("metrics", RemediatorMetrics)
TOKEN = web.AppKey("token", str)
STATE = web.AppKey("state", ServiceState)
MAX_BODY = web.AppKey("max_body_bytes", int)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _error(status: int, message: str, **headers: str) -> web.Response:
    return web.json_response({"error": message}, status=status, headers=headers or None)


def _authorized(request: web.Request) -> bool:
    expected = request.app[TOKEN]
    if not expected:
        return True
    header = request.headers.get("Authorization", "")
    scheme, _, given = header.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), expected.encode())


def _unauthorized() -> web.Response:
    return _error(401, "missing or wrong bearer token", **{"WWW-Authenticate": 'Bearer realm="accel-health"'})


async def receive_alerts(request: web.Request) -> web.Response:
    """Alertmanager webhook v4."""
    if not _authorized(request):
        return _unauthorized()
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
    try:
        plans = await request.app[ENGINE].handle(payload)
    except BackendUnavailable as exc:
        logger.warning("backend unavailable, asking Alertmanager to retry: %s", exc)
        return _error(503, f"backend unavailable, retry later: {exc}")
    return web.json_response(
        {"status": "ok", "alerts": len(payload.alerts), "new_decisions": sum(len(p.records) for p in plans)}
    )


async def list_actions(request: web.Request) -> web.Response:
    """Decision records, newest last."""
    if not _authorized(request):
        return _unauthorized()
    records = [r.as_json() for r in request.app[ENGINE].log.records()]
    return web.json_response(records)


async def healthz(request: web.Request) -> web.Response:
    del request
    return web.Response(text="ok\n")


async def readyz(request: web.Request) -> web.Response:
    if request.app[STATE].ready:
        return web.Response(text="ready\n")
    return web.Response(text="not ready\n", status=503)


async def metrics(request: web.Request) -> web.Response:
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
    """Ready while running; later issues start leader election and state sync here."""
    engine = app[ENGINE]
    logger.info(
        "policy %s: %d rules; dry-run %s; budget %d nodes",
        engine.policy.source,
        len(engine.policy.rules),
        "on" if engine.settings.dry_run else "off",
        engine.budget.capacity,
    )
    app[STATE].ready = True
    yield
    app[STATE].ready = False
    logger.info("stopping")


def create_app(*, engine: Engine, token: str | None, max_body_bytes: int = MAX_BODY_BYTES) -> web.Application:
    """The remediator service. `token=None` disables auth (only with --insecure-no-auth)."""
    app = web.Application(client_max_size=max_body_bytes, middlewares=[count_webhooks])
    app[ENGINE] = engine
    app[TOKEN] = token or ""
    app[MAX_BODY] = max_body_bytes
    app[STATE] = ServiceState()
    app[METRICS] = RemediatorMetrics(nodes_disrupted=lambda: engine.budget.in_use)
    engine.subscribe(app[METRICS].observe)
    app.cleanup_ctx.append(_lifecycle)
    app.router.add_post("/alerts", receive_alerts)
    app.router.add_get("/actions", list_actions)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    return app
