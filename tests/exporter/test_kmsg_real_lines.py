"""Kernel-log lines as real nodes printed them (tests/fixtures/kmsg, each file naming its source).

What each file must count: quoted Xid/SXid lines forwarded by journald count nothing while the
driver's own record and a /dev/kmsg injection in the driver's shape count once each; an NVSwitch error
of several records counts once; a fall-off the driver reports in several lines, or twice, counts once.
Every file is fed line by line (as /dev/kmsg hands records over) and as chunks of text (as a followed
file is read), and both must agree.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from exporter.readers.kmsg import KmsgSnapshot, KmsgTally, XidKey

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "kmsg"


def lines_of(name: str) -> list[str]:
    text = (FIXTURES / name).read_text()
    return [line for line in text.split("\n") if line and not line.startswith("#")]


def tallied(name: str) -> KmsgSnapshot:
    lines = lines_of(name)
    by_line, by_chunk = KmsgTally(), KmsgTally()
    by_line.add_lines(lines)
    half = len(lines) // 2
    by_chunk.add_text("\n".join(lines[:half]))
    by_chunk.add_text("\n".join(lines[half:]))
    assert by_chunk.snapshot() == by_line.snapshot()
    return by_line.snapshot()


def test_every_fixture_names_its_source() -> None:
    for path in FIXTURES.iterdir():
        if path.suffix in (".log", ".kmsg"):
            assert "Source" in path.read_text() or "Quoted" in path.read_text(), path.name


@pytest.mark.parametrize(
    "name", ["fallen-off-bus-proc-kmsg.log", "fallen-off-bus-dmesg.log", "fallen-off-bus-syslog.log"]
)
def test_an_older_drivers_fall_off_line_counts_once_for_its_gpu(name: str) -> None:
    snapshot = tallied(name)
    assert dict(snapshot.fallen_off_bus) == {"0000:01:00": 1}


def test_the_xid_79_beside_an_older_drivers_fall_off_line_is_counted_as_an_xid_too() -> None:
    snapshot = tallied("fallen-off-bus-syslog.log")
    assert dict(snapshot.xid) == {("0000:01:00", 79, "", ""): 1}
    assert dict(snapshot.gpu_uuids) == {"0000:01:00": "GPU-435cb66f-d89f-a234-9414-70b032521666"}


def test_the_probe_time_message_counts_once_however_often_the_driver_loads() -> None:
    snapshot = tallied("fallen-off-bus-probe.kmsg")
    assert dict(snapshot.fallen_off_bus) == {"0000:b3:00": 1}
    assert snapshot.records == 4


def test_an_nvswitch_error_of_three_records_counts_once() -> None:
    snapshot = tallied("sxid-one-error.log")
    assert dict(snapshot.sxid) == {("0000:08:00", 22013): 1}


def test_interleaved_nvswitch_errors_count_one_per_header_and_the_xid_79_fall_off_once() -> None:
    snapshot = tallied("xid79-and-sxid-storm.log")
    assert dict(snapshot.sxid) == {
        ("0000:05:00", 20034): 2,
        ("0000:06:00", 20034): 1,
        ("0000:07:00", 20034): 1,
    }
    assert dict(snapshot.xid) == {("0000:91:00", 79, "", ""): 1}
    assert dict(snapshot.fallen_off_bus) == {"0000:91:00": 1}


def test_quoted_lines_count_nothing_while_the_drivers_record_and_injections_count_once_each(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="exporter.readers.kmsg"):
        snapshot = tallied("quoted-and-injected.kmsg")
    expected: dict[XidKey, int] = {("0000:cb:00", 109, "", ""): 2}
    assert dict(snapshot.xid) == expected
    assert dict(snapshot.sxid) == {("0000:cd:00", 20034): 1}
    assert snapshot.records == 7
    injected = [r.message for r in caplog.records if "written to the kernel log by a process" in r.message]
    assert any("SXid 20034 for 0000:cd:00" in message and "facility 1" in message for message in injected)


def test_a_quote_is_not_counted_even_when_it_is_the_only_line() -> None:
    tally = KmsgTally()
    tally.add_lines(lines_of("quoted-and-injected.kmsg")[:4])
    snapshot = tally.snapshot()
    assert dict(snapshot.xid) == {}
    assert dict(snapshot.sxid) == {}
    assert snapshot.records == 4
