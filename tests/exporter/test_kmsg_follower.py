"""The kernel-log follower: a regular file followed like ``tail -f``, a missing path, /dev/kmsg itself."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from exporter.readers.kmsg import KmsgFollower
from tests.exporter.helpers import GPU_NODE, wait_until

XID_79 = "NVRM: Xid (PCI:0000:9d:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
FIXTURE_RECORDS = 55


@pytest.fixture
def kmsg_file(tmp_path: Path) -> Path:
    path = tmp_path / "kmsg"
    shutil.copyfile(GPU_NODE / "kmsg", path)
    return path


@pytest.fixture
def follower(kmsg_file: Path) -> Iterator[KmsgFollower]:
    follower = KmsgFollower(kmsg_file, poll_interval=0.01)
    follower.start()
    yield follower
    follower.stop()


def append(path: Path, text: str) -> None:
    with path.open("a") as out:
        out.write(text)


def test_a_file_is_read_from_its_first_record(follower: KmsgFollower) -> None:
    assert wait_until(lambda: follower.snapshot().records == FIXTURE_RECORDS)
    snapshot = follower.snapshot()
    assert snapshot.error is None
    assert snapshot.missed == 0
    assert dict(snapshot.xid) == {}
    assert len(snapshot.gpu_uuids) == 8


def test_a_record_appended_after_start_is_counted(follower: KmsgFollower, kmsg_file: Path) -> None:
    assert wait_until(lambda: follower.snapshot().records == FIXTURE_RECORDS)
    append(kmsg_file, f"3,{FIXTURE_RECORDS},9000000,-;{XID_79}\n")
    assert wait_until(lambda: dict(follower.snapshot().xid) == {("0000:9d:00", 79, "", ""): 1}, timeout=0.3)


def test_a_partial_line_is_not_counted_until_its_newline_arrives(
    follower: KmsgFollower, kmsg_file: Path
) -> None:
    assert wait_until(lambda: follower.snapshot().records == FIXTURE_RECORDS)
    append(kmsg_file, f"3,{FIXTURE_RECORDS},9000000,-;NVRM: Xid (PCI:0000:9d:00): 7")
    assert not wait_until(lambda: follower.snapshot().records > FIXTURE_RECORDS, timeout=0.2)
    append(kmsg_file, "9, GPU has fallen off the bus.\n")
    assert wait_until(lambda: dict(follower.snapshot().xid) == {("0000:9d:00", 79, "", ""): 1})


def test_a_gap_in_sequence_numbers_counts_as_missed_records(follower: KmsgFollower, kmsg_file: Path) -> None:
    append(kmsg_file, f"6,{FIXTURE_RECORDS + 10},9000000,-;usb 1-1: USB disconnect\n")
    assert wait_until(lambda: follower.snapshot().missed == 10)


def test_a_missing_path_is_an_error_until_it_appears(tmp_path: Path) -> None:
    path = tmp_path / "not-yet"
    follower = KmsgFollower(path, poll_interval=0.01, retry_interval=0.02)
    follower.start()
    try:
        assert wait_until(lambda: "cannot read" in (follower.snapshot().error or ""))
        path.write_text(f"3,0,1,-;{XID_79}\n")
        assert wait_until(lambda: follower.snapshot().error is None)
        assert wait_until(lambda: follower.snapshot().records == 1)
    finally:
        follower.stop()


@pytest.mark.skipif(not os.access("/dev/kmsg", os.R_OK), reason="/dev/kmsg is not readable here")
def test_the_real_kmsg_device_is_read_one_record_at_a_time() -> None:
    follower = KmsgFollower(Path("/dev/kmsg"))
    follower.start()
    try:
        assert wait_until(lambda: follower.snapshot().records > 0)
        assert follower.snapshot().error is None
    finally:
        follower.stop()


def test_a_truncated_file_is_read_again_without_counting_twice(
    follower: KmsgFollower, kmsg_file: Path
) -> None:
    assert wait_until(lambda: follower.snapshot().records == FIXTURE_RECORDS)
    append(kmsg_file, f"3,{FIXTURE_RECORDS},9000000,-;{XID_79}\n")
    assert wait_until(lambda: dict(follower.snapshot().xid) == {("0000:9d:00", 79, "", ""): 1})
    # Rotated in place: the old records (already counted) and one new Xid.
    kmsg_file.write_text(
        f"3,{FIXTURE_RECORDS},9000000,-;{XID_79}\n3,{FIXTURE_RECORDS + 1},9000001,-;{XID_79}\n"
    )
    assert wait_until(lambda: dict(follower.snapshot().xid) == {("0000:9d:00", 79, "", ""): 2})
    assert not wait_until(
        lambda: dict(follower.snapshot().xid) != {("0000:9d:00", 79, "", ""): 2}, timeout=0.3
    )
    assert follower.snapshot().records == FIXTURE_RECORDS + 2


def test_a_replaced_file_is_reopened(follower: KmsgFollower, kmsg_file: Path) -> None:
    assert wait_until(lambda: follower.snapshot().records == FIXTURE_RECORDS)
    replacement = kmsg_file.with_name("kmsg.new")
    replacement.write_text(kmsg_file.read_text() + f"3,{FIXTURE_RECORDS},9000000,-;{XID_79}\n")
    os.replace(replacement, kmsg_file)
    assert wait_until(lambda: dict(follower.snapshot().xid) == {("0000:9d:00", 79, "", ""): 1})
    assert follower.snapshot().records == FIXTURE_RECORDS + 1
    assert follower.snapshot().error is None
