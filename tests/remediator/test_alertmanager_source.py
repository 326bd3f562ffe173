"""Reading Alertmanager's API v2: its alerts parsed (silenced and inhibited ones marked), the answers
of an HA pair merged, startsAt read the same from the API and from webhooks, the poller's counters,
its pace (a poke reads at once unless reads are slow; never a spin while not ready) and the
`--alertmanager-*` flags refused when unusable. Real Alertmanager for what it answers."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from pathlib import Path

import pytest

from remediator.cli import alertmanager_urls, main
from remediator.desired.alertmanager import (
    AlertmanagerClient,
    AlertmanagerPoller,
    AlertmanagerSettings,
    AlertmanagerView,
    ShownAlert,
    merge_views,
    parse_api_alerts,
)
from remediator.intake.payload import PayloadError, canonical_time
from tests import alertmanager_process
from tests.alertmanager_process import Alertmanager, fired
from tests.remediator.conftest import SNAPSHOT

needs_alertmanager = pytest.mark.skipif(not alertmanager_process.available(), reason="no alertmanager")


def test_a_webhooks_nanoseconds_and_the_apis_milliseconds_read_as_the_same_start() -> None:
    assert canonical_time("2025-11-22T21:00:00.123456789+01:00") == "2025-11-22T20:00:00.123Z"
    assert canonical_time("2025-11-22T20:00:00.123Z") == "2025-11-22T20:00:00.123Z"
    assert canonical_time("2025-11-22T20:00:00Z") == "2025-11-22T20:00:00.000Z"
    assert canonical_time("yesterday") == "yesterday"


def test_an_api_answer_that_is_not_a_list_of_alerts_is_refused_naming_the_field() -> None:
    with pytest.raises(PayloadError, match="JSON array"):
        parse_api_alerts({"alerts": []})
    with pytest.raises(PayloadError, match=r"\[0\]: alerts\[0\]\.startsAt"):
        parse_api_alerts([{"labels": {"node": "n"}, "status": {"state": "active"}}])
    with pytest.raises(PayloadError, match=r"\[0\]\.status"):
        parse_api_alerts([{"labels": {"node": "n"}, "startsAt": "2025-01-01T00:00:00Z", "status": "x"}])


def _shown(fp: str, suppressed: str = "") -> ShownAlert:
    raw = {"labels": {"node": "n"}, "startsAt": "2025-01-01T00:00:00Z", "fingerprint": fp}
    status = {
        "state": "suppressed" if suppressed else "active",
        "silencedBy": [suppressed] if suppressed else [],
    }
    return parse_api_alerts([{**raw, "status": status}])[0]


def test_a_silence_on_either_member_of_a_pair_wins_over_the_others_active() -> None:
    view = merge_views(
        {"a": [_shown("1"), _shown("2")], "b": [_shown("1", "s-1"), _shown("2")]}, {"c": "refused"}
    )
    assert view.alerts["1"].suppressed == "silenced in Alertmanager by s-1"
    assert view.alerts["2"].suppressed == ""
    assert view.reached == ("a", "b")
    assert dict(view.unreachable) == {"c": "refused"}


@needs_alertmanager
async def test_the_client_reads_active_and_silenced_alerts_and_marks_the_silenced(tmp_path: Path) -> None:
    am = Alertmanager(workdir=tmp_path / "am")
    client = AlertmanagerClient(AlertmanagerSettings(urls=(am.url, "http://127.0.0.1:9")))
    seen: list[AlertmanagerView] = []
    poller = AlertmanagerPoller(client=client, reconcile=seen.append, ready=lambda: True)
    try:
        am.post_alerts(fired("a", starts_at=time.time() - 5), fired("b", starts_at=time.time() - 5))
        silence = am.silence(matchers={"node": "b"})
        view = await poller.poll_once()
    finally:
        await client.close()
        am.stop()
    assert view is not None
    assert seen == [view]
    by_node = {s.alert.labels["node"]: s for s in view.alerts.values()}
    assert by_node["a"].suppressed == ""
    assert by_node["b"].suppressed == f"silenced in Alertmanager by {silence}"
    assert by_node["a"].alert.ends_at  # the real endsAt, not zero
    assert view.reached == (am.url,)
    assert list(view.unreachable) == ["http://127.0.0.1:9"]
    assert (poller.counters.ok, poller.counters.unreachable) == (1, 0)


async def test_a_poke_while_not_leading_waits_for_the_lead_instead_of_spinning() -> None:
    """A webhook (or a lost lead) pokes the poller of a replica that does not lead: it reads nothing,
    and it does not loop at once again and again either; once it leads, the poke's read happens."""
    client = AlertmanagerClient(AlertmanagerSettings(urls=("http://127.0.0.1:9",), interval_seconds=3600))
    leading = False
    looks = 0

    def ready() -> bool:
        nonlocal looks
        looks += 1
        return leading

    reads: list[AlertmanagerView] = []
    poller = AlertmanagerPoller(client=client, reconcile=reads.append, ready=ready, tick_seconds=3600)
    fetched = asyncio.Event()

    async def fetch() -> AlertmanagerView | None:
        fetched.set()
        return None

    client.fetch = fetch  # type: ignore[method-assign]  # the read itself is not what is tested here
    task = asyncio.create_task(poller.run())
    try:
        for _ in range(5):
            await asyncio.sleep(0)
        poller.poke()
        for _ in range(200):  # the event loop's turns: a busy loop would look at the lead at each
            await asyncio.sleep(0)
        assert looks <= 3
        assert not fetched.is_set()
        leading = True
        poller.poke()
        await asyncio.wait_for(fetched.wait(), timeout=30)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await client.close()


class _Shown(AlertmanagerClient):
    """A client whose every read shows nothing, at once (no HTTP)."""

    async def fetch(self) -> AlertmanagerView | None:
        return AlertmanagerView(alerts={}, reached=("http://alertmanager:9093",))


async def test_pokes_while_reads_are_slow_read_at_most_a_quarter_of_the_time() -> None:
    reads: list[float] = []

    def reconcile(_view: AlertmanagerView) -> None:
        reads.append(time.monotonic())
        time.sleep(0.1)  # a storm's thousands of alerts, decided on the event loop

    poller = AlertmanagerPoller(
        client=_Shown(AlertmanagerSettings(urls=("http://alertmanager:9093",))),
        reconcile=reconcile,
        ready=lambda: True,
    )
    task = asyncio.create_task(poller.run())
    try:
        end = time.monotonic() + 2.0
        while time.monotonic() < end:  # a delivery every 10 ms, each a poke
            await asyncio.sleep(0.01)
            poller.poke()
    finally:
        task.cancel()
    assert 2 <= len(reads) <= 7  # back to back would be 20 (a loaded machine reads fewer)
    assert min(b - a for a, b in itertools.pairwise(reads)) >= 0.35


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--alertmanager-url=alertmanager:9093"], "expects http:// or https:// URLs"),
        (["--alertmanager-url=http://a:9093,alertmanager-b:9093"], "got 'alertmanager-b:9093'"),
        (["--alertmanager-url=http://a:9093,"], "got ''"),
        (["--alertmanager-url=http://a:9093", "--alertmanager-interval=0.5"], "at least 1 second"),
        (["--alertmanager-url=http://a:9093", "--alertmanager-ca-file=/nonexistent"], "no such file"),
    ],
)
def test_unusable_alertmanager_flags_are_refused_at_start(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["serve", "--insecure-no-auth", f"--cluster-snapshot={SNAPSHOT}", "--listen=127.0.0.1:0", *flags]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_the_members_of_an_ha_cluster_may_be_listed_in_one_value_or_repeated() -> None:
    """One value, comma-separated, is what a Deployment fills from one ConfigMap key (deploy/)."""
    assert alertmanager_urls(["http://am-0:9093, http://am-1:9093", "http://am-2:9093"]) == (
        "http://am-0:9093",
        "http://am-1:9093",
        "http://am-2:9093",
    )
    assert alertmanager_urls(["http://am-0:9093", "http://am-0:9093,http://am-1:9093"]) == (
        "http://am-0:9093",
        "http://am-1:9093",
    )
