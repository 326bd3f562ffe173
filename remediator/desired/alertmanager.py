"""Desired state from Alertmanager's API v2: the alerts firing now, silenced or not.

Webhook deliveries say "look again"; Alertmanager's API says what fires now. The leader reads
`GET /api/v2/alerts?active=true&silenced=true&inhibited=true&unprocessed=false` from every configured
Alertmanager (an HA pair is two URLs), periodically and at once on becoming leader, and merges the
answers by fingerprint:

- an alert shown active (neither silenced nor inhibited) by any Alertmanager, and suppressed by none,
  fires: it is decided as a delivery would be (idempotency keys make a repeat a no-op);
- an alert silenced or inhibited by any Alertmanager is *suppressed*: no new action is taken for it,
  and what it already holds on its node stays held (a silence says "leave this node alone": neither
  act nor undo) until the silence ends or the alert resolves;
- an alert the service knew firing that no Alertmanager shows any more resolved: its `on_resolved`
  actions run and its holds are released per the policy.

Suppressed alerts are asked for (silenced=true, inhibited=true) so that a silence is never mistaken
for a resolve. When no Alertmanager answers, nothing is concluded: the webhook deliveries and their
expiry (remediator/desired/firing.py) stay the desired state, and each such poll is logged and counted.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import ssl
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from remediator.intake.payload import Alert, PayloadError, parse_payload

logger = logging.getLogger("remediator.desired.alertmanager")

DEFAULT_INTERVAL_SECONDS = 30.0
DEFAULT_TIMEOUT_SECONDS = 10.0
POKE_GAP_FACTOR = 4.0
"""A poke (a webhook delivery) reads at once unless the last read started less than this many times
its own duration ago; then when that much has passed. Reads of a storm's thousands of alerts (about
a second each at 5,000) take at most a quarter of the time however fast deliveries arrive, instead of
following each other back to back; a read of a few alerts (milliseconds) is not held back."""


@dataclass(frozen=True)
class AlertmanagerSettings:
    """Where and how the leader reads the alerts firing now."""

    urls: tuple[str, ...]
    """Base URLs, e.g. http://alertmanager-0:9093 (each member of an HA pair)."""
    receiver: str = ""
    """Only alerts routed to receivers matching this regular expression (Alertmanager's `receiver`
    query parameter); empty: every alert (the policy's rules still decide what is acted on)."""
    bearer_token: str | None = None
    """`Authorization: Bearer` for every request (e.g. an OAuth proxy in front of Alertmanager)."""
    basic_auth: tuple[str, str] | None = None
    """HTTP basic auth (USER, PASSWORD) for every request."""
    ca_file: Path | None = None
    """CA bundle for https URLs; default: the system's."""
    interval_seconds: float = DEFAULT_INTERVAL_SECONDS
    """Seconds between two reads while leading."""
    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS
    """Per-request deadline; an Alertmanager slower than this counts as unreachable for that read."""


@dataclass(frozen=True)
class ShownAlert:
    """One alert as Alertmanager's API shows it."""

    alert: Alert
    """The alert, status "firing", with its real endsAt."""
    suppressed: str
    """Empty when active; else why not acted on, e.g. "silenced by 5f3e..."."""


@dataclass(frozen=True)
class AlertmanagerView:
    """What the reachable Alertmanagers show now, merged."""

    alerts: Mapping[str, ShownAlert]
    """By fingerprint."""
    reached: tuple[str, ...]
    """URLs that answered."""
    unreachable: Mapping[str, str] = field(default_factory=dict)
    """URL -> error, for those that did not."""
    read_at: float | None = None
    """When the read began (``time.monotonic()``): an alert a delivery said fires after that moment
    may be missing from the answers without having resolved. None: not known (every absence counts)."""


def _suppression(raw: Mapping[str, Any]) -> str:
    status = raw.get("status")
    if not isinstance(status, Mapping):
        raise PayloadError("status: expected an object")
    state = status.get("state", "active")
    silenced = [str(s) for s in status.get("silencedBy") or []]
    inhibited = [str(s) for s in status.get("inhibitedBy") or []]
    if silenced:
        return "silenced in Alertmanager by " + ", ".join(silenced)
    if inhibited:
        return "inhibited in Alertmanager by " + ", ".join(inhibited)
    if state == "suppressed":
        return "suppressed in Alertmanager"
    return ""


def parse_api_alerts(doc: Any) -> list[ShownAlert]:
    """The body of `GET /api/v2/alerts` -> alerts, or PayloadError naming the field."""
    if not isinstance(doc, list):
        raise PayloadError("expected a JSON array of alerts (Alertmanager API v2)")
    shown = []
    for index, raw in enumerate(doc):
        if not isinstance(raw, dict):
            raise PayloadError(f"[{index}]: expected an object")
        try:
            suppressed = _suppression(raw)
        except PayloadError as exc:
            raise PayloadError(f"[{index}].{exc}") from None
        fields = {
            k: raw[k] for k in ("labels", "annotations", "startsAt", "endsAt", "fingerprint") if k in raw
        }
        fields["generatorURL"] = raw.get("generatorURL", "")
        try:
            alert = parse_payload({"version": "4", "alerts": [{**fields, "status": "firing"}]}).alerts[0]
        except PayloadError as exc:
            raise PayloadError(f"[{index}]: {exc}") from None
        shown.append(ShownAlert(alert=alert, suppressed=suppressed))
    return shown


def merge_views(
    answers: Mapping[str, Sequence[ShownAlert]], unreachable: Mapping[str, str]
) -> AlertmanagerView:
    """Merge what several Alertmanagers show: suppressed by any wins over active."""
    merged: dict[str, ShownAlert] = {}
    for shown in answers.values():
        for item in shown:
            fp = item.alert.fingerprint
            known = merged.get(fp)
            if known is None or (item.suppressed and not known.suppressed):
                merged[fp] = item
    return AlertmanagerView(alerts=merged, reached=tuple(answers), unreachable=dict(unreachable))


class AlertmanagerClient:
    """Reads the alerts firing now from each configured Alertmanager."""

    def __init__(self, settings: AlertmanagerSettings) -> None:
        if not settings.urls:
            raise ValueError("at least one Alertmanager URL is needed")
        self.settings = settings
        self._session: aiohttp.ClientSession | None = None

    def _headers(self) -> dict[str, str]:
        if self.settings.bearer_token is not None:
            return {"Authorization": f"Bearer {self.settings.bearer_token}"}
        return {}

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None:
            s = self.settings
            ssl_context: ssl.SSLContext | bool = True
            if s.ca_file is not None:
                ssl_context = ssl.create_default_context(cafile=str(s.ca_file))
            auth = aiohttp.BasicAuth(*s.basic_auth) if s.basic_auth is not None else None
            self._session = aiohttp.ClientSession(
                auth=auth,
                headers=self._headers(),
                timeout=aiohttp.ClientTimeout(total=s.timeout_seconds),
                connector=aiohttp.TCPConnector(ssl=ssl_context),
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _read(self, url: str) -> list[ShownAlert]:
        params = {"active": "true", "silenced": "true", "inhibited": "true", "unprocessed": "false"}
        if self.settings.receiver:
            params["receiver"] = self.settings.receiver
        async with self._open().get(url.rstrip("/") + "/api/v2/alerts", params=params) as response:
            if response.status != 200:
                text = (await response.text())[:200]
                raise PayloadError(f"HTTP {response.status}: {text.strip()}")
            return parse_api_alerts(await response.json(content_type=None))

    async def fetch(self) -> AlertmanagerView | None:
        """What the reachable Alertmanagers show now; None when none answered usefully."""
        urls = self.settings.urls
        began = time.monotonic()
        results = await asyncio.gather(*(self._read(u) for u in urls), return_exceptions=True)
        answers: dict[str, list[ShownAlert]] = {}
        unreachable: dict[str, str] = {}
        for url, result in zip(urls, results, strict=True):
            if isinstance(result, list):
                answers[url] = result
            elif isinstance(result, aiohttp.ClientError | TimeoutError | OSError | PayloadError | ValueError):
                unreachable[url] = f"{type(result).__name__}: {result}"
            else:
                raise result
        if unreachable:
            logger.warning(
                "Alertmanager not read: %s", "; ".join(f"{u}: {e}" for u, e in unreachable.items())
            )
        if not answers:
            return None
        return dataclasses.replace(merge_views(answers, unreachable), read_at=began)


@dataclass
class PollCounters:
    """How the reads went (exported as accel_remediator_alertmanager_polls_total{result})."""

    ok: int = 0
    """Reads where at least one Alertmanager answered."""
    unreachable: int = 0
    """Reads where none did: the webhook deliveries and their expiry stay the desired state."""


class AlertmanagerPoller:
    """While this replica leads and its gate state is read, reconciles what Alertmanager shows:
    every `interval_seconds`, and at once when it (again) becomes the leader."""

    def __init__(
        self,
        *,
        client: AlertmanagerClient,
        reconcile: Callable[[AlertmanagerView], Any],
        ready: Callable[[], bool],
        tick_seconds: float = 1.0,
    ) -> None:
        self.client = client
        self._reconcile = reconcile
        self._ready = ready
        self._tick = min(tick_seconds, client.settings.interval_seconds)
        self.counters = PollCounters()
        self._wake = asyncio.Event()
        self._fallback_logged = False

    def poke(self) -> None:
        """Read now (a webhook arrived, or this replica just became leader)."""
        self._wake.set()

    async def poll_once(self) -> AlertmanagerView | None:
        """One read and reconcile; None when no Alertmanager answered (counted, logged once per outage)."""
        view = await self.client.fetch()
        if view is None:
            self.counters.unreachable += 1
            if not self._fallback_logged:
                logger.error(
                    "no Alertmanager reachable (%s); the desired state is the webhook deliveries, each "
                    "kept until it resolves or expires",
                    ", ".join(self.client.settings.urls),
                )
                self._fallback_logged = True
            return None
        if self._fallback_logged:
            logger.warning("Alertmanager reachable again (%s)", ", ".join(view.reached))
            self._fallback_logged = False
        self.counters.ok += 1
        result = self._reconcile(view)
        if asyncio.iscoroutine(result):
            await result
        return view

    async def run(self) -> None:
        """Until cancelled."""
        was_ready = False
        poked = False
        interval = self.client.settings.interval_seconds
        last = time.monotonic()
        """When the last read started (or this loop did)."""
        gap = 0.0
        """A poke reads once this long has passed since the last read started."""
        while True:
            ready = self._ready()
            if self._wake.is_set():
                # Taken at once, ready or not: waiting on an Event already set returns without
                # yielding, and a poke left set would make this loop spin and hold the event loop,
                # every request and the Lease's renewal. Kept as `poked` until a read.
                self._wake.clear()
                poked = True
            since = time.monotonic() - last
            due = (poked and since >= gap) or since >= interval or (ready and not was_ready)
            was_ready = ready
            if ready and due:
                poked = False
                last = time.monotonic()
                try:
                    await self.poll_once()
                except asyncio.CancelledError:
                    raise
                except Exception:  # a backend outage mid-reconcile: the next read tries again
                    logger.exception("reconciling what Alertmanager shows failed; trying again next read")
                gap = (time.monotonic() - last) * POKE_GAP_FACTOR
                continue
            if ready and poked:
                # Poked within the last read's gap: one read once it has passed, however many
                # pokes come meanwhile (a burst of deliveries is one read).
                await asyncio.sleep(max(0.0, min(self._tick, last + gap - time.monotonic())))
                continue
            try:
                async with asyncio.timeout(self._tick):
                    await self._wake.wait()
            except TimeoutError:
                pass
