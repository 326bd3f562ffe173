"""The request layer every part of the Kubernetes executor shares: the client, the settings, the
leadership fence (`should_act`, asked before every write), one request with its retries, and a paged
LIST; and how the client finds its configuration (as client-go and controller-runtime do)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import socket
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from kubernetes.aio import client as k8s
from kubernetes.aio import config as k8s_config
from kubernetes.aio.config import incluster_config as k8s_incluster

from remediator.cluster import BackendUnavailable, NotLeader, WriteRefused
from remediator.lifecycle.record import MANAGER

logger = logging.getLogger("remediator.kubernetes")

MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
"""Where Kubernetes mounts a pod's service-account token, CA certificate and namespace."""
TLS_CLOSE_GRACE_SECONDS = 0.25
"""How long the event loop must still run after TLS connections are closed for their sockets to close
(aiohttp's advice): `close` waits it after watches, a command's own loop before it ends."""


class ApiError(Exception):
    """A non-retryable answer from the API server (4xx other than 429, or 500 from an eviction)."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message


@dataclass(frozen=True)
class ClientConfig:
    """A Kubernetes client configuration and where it came from (logged at start-up)."""

    configuration: k8s.Configuration
    """The client configuration."""
    source: str
    """Which source it was read from, in words."""


@dataclass(frozen=True)
class KubernetesSettings:
    """How the executor talks to the API server."""

    manager: str = MANAGER
    """Written into annotations and as the Events' source component; identifies this service."""
    instance: str = field(default_factory=socket.gethostname)
    """Events' reportingInstance (the pod name in a cluster)."""
    event_namespace: str = "default"
    """Namespace for node Events (the kubelet uses `default`; `kubectl describe node` finds them)."""
    request_timeout_seconds: float = 10.0
    """Total time allowed for one API request."""
    attempts: int = 3
    """Tries per request on transport errors, timeouts, 5xx and 429 (not for evictions)."""
    retry_base_seconds: float = 0.2
    """First retry delay; doubled per attempt, with jitter."""
    conflict_attempts: int = 8
    """Tries of a read-modify-write on 409 Conflict before giving up."""
    state_namespace: str = "accel-health"
    """Namespace of the gates ConfigMap (the remediator's own)."""
    gates_configmap: str = "accel-health-remediator-gates"
    """Name of the ConfigMap holding the pause switch and the storm breaker's latch (under 1 KiB,
    written only when one of them changes). Everything else this service remembers is on the nodes."""
    legacy_configmap: str = "accel-health-remediator-state"
    """Name of the ConfigMap an older release kept all its gate state in: read once by a new leader,
    what still matters moved onto the nodes, then deleted."""
    watch_seconds: int = 300
    """Server-side timeout of one WATCH request (the caches' watches are started again from their
    last resourceVersion when it ends)."""


def _pick_kubeconfig(kubeconfig: Path | None, env: Mapping[str, str], sa_dir: Path) -> tuple[str | None, str]:
    """(kubeconfig path, source in words), or (None, ...) for the service account; client-go's order.

    Raises ValueError naming everything tried when nothing is there.
    """
    if kubeconfig is not None:
        return str(kubeconfig), f"--kubeconfig {kubeconfig}"
    tried = ["--kubeconfig (not given)"]
    paths = [p for p in env.get("KUBECONFIG", "").split(os.pathsep) if p]
    existing = [p for p in paths if Path(p).expanduser().exists()]
    if existing:
        joined = os.pathsep.join(existing)
        return joined, f"$KUBECONFIG ({joined})"
    tried.append(f"$KUBECONFIG ({'no file at ' + os.pathsep.join(paths) if paths else 'not set'})")
    host, port = env.get("KUBERNETES_SERVICE_HOST", ""), env.get("KUBERNETES_SERVICE_PORT", "")
    if host and port and (sa_dir / "token").is_file():
        return None, "in-cluster service account"
    if host and port:
        tried.append(f"in-cluster service account (no token at {sa_dir / 'token'})")
    else:
        tried.append("in-cluster service account (KUBERNETES_SERVICE_HOST/KUBERNETES_SERVICE_PORT not set)")
    home = Path(env.get("HOME") or Path.home()) / ".kube" / "config"
    if home.exists():
        return str(home), str(home)
    tried.append(f"{home} (no such file)")
    raise ValueError("cannot load Kubernetes client configuration; tried " + "; ".join(tried))


async def client_configuration(
    *,
    kubeconfig: Path | None = None,
    context: str | None = None,
    in_cluster: bool = False,
    environ: Mapping[str, str] | None = None,
    service_account_dir: Path | None = None,
) -> ClientConfig:
    """Client configuration, found the way client-go and controller-runtime find it.

    `in_cluster` uses the pod's service account and nothing else. Otherwise the first of: the
    `kubeconfig` file; the files in $KUBECONFIG (separated by ':'); the pod's service account
    (when KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT are set and its token exists);
    ~/.kube/config. Raises ValueError naming everything tried. The asyncio client allows 100
    connections in flight, well above a drain's concurrency.
    """
    env = os.environ if environ is None else environ
    sa_dir = SERVICE_ACCOUNT_DIR if service_account_dir is None else service_account_dir

    async def from_kubeconfig(path: str, source: str) -> ClientConfig:
        cfg = k8s.Configuration()
        try:
            await k8s_config.load_kube_config(  # type: ignore[no-untyped-call]  # untyped upstream
                config_file=path, context=context, client_configuration=cfg, persist_config=False
            )
        except (k8s_config.ConfigException, OSError, ValueError, TypeError, AttributeError) as exc:
            # A malformed file makes the loader raise anything from ConfigException to TypeError.
            raise ValueError(f"cannot load Kubernetes client configuration from {source}: {exc}") from exc
        return ClientConfig(cfg, source)

    def from_service_account() -> ClientConfig:
        cfg = k8s.Configuration()
        loader = k8s_incluster.InClusterConfigLoader(  # type: ignore[no-untyped-call]  # untyped upstream
            token_filename=str(sa_dir / "token"), cert_filename=str(sa_dir / "ca.crt"), environ=env
        )
        try:
            loader.load_and_set(cfg)  # type: ignore[no-untyped-call]  # untyped upstream
        except (k8s_config.ConfigException, OSError) as exc:
            raise ValueError(
                f"cannot load Kubernetes client configuration from the service account in {sa_dir}: {exc}"
            ) from exc
        return ClientConfig(cfg, f"in-cluster service account ({sa_dir}, API {cfg.host})")

    if in_cluster:
        return from_service_account()
    path, source = _pick_kubeconfig(kubeconfig, env, sa_dir)
    if path is None:
        return from_service_account()
    return await from_kubeconfig(path, source)


def refused_or_unavailable(what: str, exc: ApiError) -> Exception:
    """A write's error answer: refused for good (400, 403, 422: the same write gets the same answer;
    the step is recorded as failed, not retried by every redelivery), else worth a retry (503)."""
    if exc.status in (400, 403, 422):
        return WriteRefused(f"Kubernetes API refused to {what}: {exc}")
    return BackendUnavailable(f"Kubernetes API: {what}: {exc}")


class Api:
    """The client, its settings and clock, and the fence: every part of the executor is handed this."""

    def __init__(
        self,
        *,
        api: k8s.ApiClient,
        settings: KubernetesSettings,
        should_act: Callable[[], bool],
        clock: Callable[[], float],
    ) -> None:
        self.client = api
        self.settings = settings
        self.core = k8s.CoreV1Api(api)
        self.policy = k8s.PolicyV1Api(api)
        self.apps = k8s.AppsV1Api(api)
        self.should_act = should_act
        self.clock = clock
        self.api_unavailable: dict[str, int] = {}
        """Optional API -> how often it answered 404 (not served by this API server); a metric."""

    def ensure_leader(self, what: str) -> None:
        if not self.should_act():
            raise NotLeader(f"not the leader; refusing to {what}")

    async def call(
        self,
        what: str,
        method: Callable[..., Awaitable[Any]],
        *args: Any,
        retry: bool = True,
        **kwargs: Any,
    ) -> Any:
        """One API request: the parsed JSON body of a 2xx answer.

        Transport errors, timeouts, 5xx and 429 are retried (when `retry`) and then raise
        BackendUnavailable; other 4xx raise ApiError at once.
        """
        attempts = self.settings.attempts if retry else 1
        delay = self.settings.retry_base_seconds
        last = ""
        for attempt in range(1, attempts + 1):
            try:
                resp = await method(*args, _request_timeout=self.settings.request_timeout_seconds, **kwargs)
                try:
                    body = await resp.read()
                finally:
                    resp.release()
            except (aiohttp.ClientError, TimeoutError) as exc:
                last = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            else:
                if 200 <= resp.status < 300:
                    return json.loads(body) if body else {}
                reason, message = resp.reason or "", body.decode("utf-8", "replace")
                try:
                    status_obj = json.loads(body)
                    reason = str(status_obj.get("reason") or reason)
                    message = str(status_obj.get("message") or message)
                except (ValueError, AttributeError):
                    pass
                if resp.status < 500 and resp.status != 429:
                    raise ApiError(resp.status, reason, message)
                if not retry:
                    raise ApiError(resp.status, reason, message)
                last = f"{resp.status} {reason}: {message}"[:300]
            if attempt < attempts:
                await asyncio.sleep(delay * (0.5 + random.random()))  # noqa: S311  jitter, not crypto
                delay *= 2
        raise BackendUnavailable(f"Kubernetes API: {what} failed after {attempts} attempts: {last}")

    def missing(self, api: str, exc: ApiError) -> None:
        """An optional API this server does not serve: logged the first time, counted every time."""
        if api not in self.api_unavailable:
            logger.warning(
                "the API server does not serve %s (%s); going on without it "
                "(counted in accel_remediator_api_unavailable_total)",
                api,
                exc,
            )
        self.api_unavailable[api] = self.api_unavailable.get(api, 0) + 1

    async def list_with_version(
        self, what: str, method: Callable[..., Awaitable[Any]], **kwargs: Any
    ) -> tuple[list[dict[str, Any]], str]:
        """Every page of a list and the list's resourceVersion (where a watch starts); ApiError as
        `_call` raises it."""
        items: list[dict[str, Any]] = []
        token: str | None = None
        while True:
            extra: dict[str, Any] = {"_continue": token} if token else {}
            page = await self.call(what, method, limit=500, **kwargs, **extra)
            items.extend(page.get("items") or [])
            meta = page.get("metadata") or {}
            token = meta.get("continue")
            if not token:
                return items, str(meta.get("resourceVersion", ""))
