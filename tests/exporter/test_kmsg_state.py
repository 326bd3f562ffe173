"""Kernel-log counts across exporter restarts: the state directory, the boot id, the ring buffer.

The promise: within one boot a restarted exporter neither loses an event the ring buffer has since
overwritten nor counts one twice; after a reboot it starts from zero.
"""

from __future__ import annotations

import json
import logging
import signal
from pathlib import Path

import pytest

from exporter.readers.kmsg import STATE_FILE_NAME, KmsgFollower, KmsgSnapshot, KmsgStateStore, KmsgTally
from tests.exporter.helpers import GPU_NODE, Running, sample_value, spawn_exporter, wait_until

XID_79 = "NVRM: Xid (PCI:0000:9d:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
BOOT_A = "6f1c2d4e-0000-4000-8000-00000000000a"
BOOT_B = "6f1c2d4e-0000-4000-8000-00000000000b"


def ring(first_seq: int, last_seq: int, *, xid_at: int | None = None) -> str:
    """Records ``first_seq..last_seq`` in /dev/kmsg format: noise, and an Xid 79 at ``xid_at``."""
    lines = []
    for seq in range(first_seq, last_seq + 1):
        message = XID_79 if seq == xid_at else f"usb 1-1: noise record {seq}"
        lines.append(f"6,{seq},{seq * 1000},-;{message}\n")
    return "".join(lines)


def run_follower(kmsg: Path, store: KmsgStateStore, *, records: int) -> KmsgSnapshot:
    """Runs a follower over ``kmsg`` until it has counted ``records``, stops it, returns its counts."""
    follower = KmsgFollower(kmsg, state_store=store, poll_interval=0.01, save_interval=0.0)
    follower.start()
    try:
        assert wait_until(lambda: follower.snapshot().records == records), follower.snapshot()
    finally:
        follower.stop()
    return follower.snapshot()


@pytest.fixture
def boot_id(tmp_path: Path) -> Path:
    path = tmp_path / "boot_id"
    path.write_text(BOOT_A + "\n")
    return path


def test_an_event_overwritten_in_the_ring_still_counts_after_a_restart(tmp_path: Path, boot_id: Path) -> None:
    kmsg = tmp_path / "kmsg"
    store = KmsgStateStore(tmp_path / "state", boot_id_path=boot_id)
    kmsg.write_text(ring(0, 99, xid_at=10))
    first = run_follower(kmsg, store, records=100)
    assert dict(first.xid) == {("0000:9d:00", 79, "", ""): 1}

    # While the exporter was down the ring moved on: records 0-49 (the Xid among them) are gone.
    kmsg.write_text(ring(50, 119))
    second = run_follower(kmsg, store, records=120)
    assert dict(second.xid) == {("0000:9d:00", 79, "", ""): 1}
    assert second.missed == 0


def test_a_restart_rereading_the_same_ring_counts_nothing_twice(tmp_path: Path, boot_id: Path) -> None:
    kmsg = tmp_path / "kmsg"
    store = KmsgStateStore(tmp_path / "state", boot_id_path=boot_id)
    kmsg.write_text(ring(0, 39, xid_at=5) + "3,40,41000,-;" + XID_79 + "\n")
    assert run_follower(kmsg, store, records=41).xid == {("0000:9d:00", 79, "", ""): 2}
    again = run_follower(kmsg, store, records=41)
    assert dict(again.xid) == {("0000:9d:00", 79, "", ""): 2}
    assert again.records == 41


def test_records_the_exporter_never_saw_are_counted_as_missed(tmp_path: Path, boot_id: Path) -> None:
    kmsg = tmp_path / "kmsg"
    store = KmsgStateStore(tmp_path / "state", boot_id_path=boot_id)
    kmsg.write_text(ring(0, 9))
    run_follower(kmsg, store, records=10)
    kmsg.write_text(ring(30, 39))  # 10-29 came and went while the exporter was down
    assert run_follower(kmsg, store, records=20).missed == 20


def test_a_new_boot_starts_from_zero(tmp_path: Path, boot_id: Path) -> None:
    kmsg = tmp_path / "kmsg"
    store = KmsgStateStore(tmp_path / "state", boot_id_path=boot_id)
    kmsg.write_text(ring(0, 19, xid_at=3))
    run_follower(kmsg, store, records=20)
    boot_id.write_text(BOOT_B + "\n")
    kmsg.write_text(ring(0, 4))  # the new boot's ring: no Xid
    after_reboot = run_follower(kmsg, store, records=5)
    assert dict(after_reboot.xid) == {}
    assert json.loads((tmp_path / "state" / STATE_FILE_NAME).read_text())["boot_id"] == BOOT_B


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        '["a list"]',
        json.dumps({"boot_id": BOOT_A, "records": -4}),
        json.dumps({"boot_id": BOOT_A, "xid": [[1]]}),
    ],
)
def test_a_damaged_state_file_is_ignored_with_a_log_line(
    tmp_path: Path, boot_id: Path, content: str, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / STATE_FILE_NAME).write_text(content)
    kmsg = tmp_path / "kmsg"
    kmsg.write_text(ring(0, 9, xid_at=2))
    with caplog.at_level(logging.INFO, logger="exporter.readers.kmsg"):
        tally = run_follower(kmsg, KmsgStateStore(tmp_path / "state", boot_id_path=boot_id), records=10)
    assert dict(tally.xid) == {("0000:9d:00", 79, "", ""): 1}
    assert any("state" in r.getMessage() for r in caplog.records)


def test_an_unwritable_state_dir_is_logged_once_and_counting_goes_on(
    tmp_path: Path, boot_id: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "state"
    blocker.write_text("a file where the directory should be")
    kmsg = tmp_path / "kmsg"
    kmsg.write_text(ring(0, 9, xid_at=2))
    follower = KmsgFollower(
        kmsg, state_store=KmsgStateStore(blocker, boot_id_path=boot_id), poll_interval=0.01, save_interval=0.0
    )
    with caplog.at_level(logging.WARNING, logger="exporter.readers.kmsg"):
        follower.start()
        assert wait_until(lambda: follower.snapshot().records == 10)
        with kmsg.open("a") as out:
            out.write(ring(10, 12, xid_at=11))
        assert wait_until(lambda: follower.snapshot().records == 13)
        follower.stop()
    assert dict(follower.snapshot().xid) == {("0000:9d:00", 79, "", ""): 2}
    assert len([r for r in caplog.records if "cannot write" in r.getMessage()]) == 1


def test_an_unreadable_boot_id_keeps_counts_in_memory_only(tmp_path: Path) -> None:
    kmsg = tmp_path / "kmsg"
    kmsg.write_text(ring(0, 4, xid_at=1))
    store = KmsgStateStore(tmp_path / "state", boot_id_path=tmp_path / "no-such-boot-id")
    assert run_follower(kmsg, store, records=5).xid == {("0000:9d:00", 79, "", ""): 1}
    assert not (tmp_path / "state" / STATE_FILE_NAME).exists()


def test_the_state_round_trips_every_count() -> None:
    tally = KmsgTally()
    tally.add_lines(
        [
            "3,0,1,-;" + XID_79,
            "3,1,2,-;NVRM: Xid (PCI:0000:3b:00 GPU-I:01 GPU-CI:02): 43, pid=7, name=python3, Ch 00000008",
            "4,2,3,-;nvidia-nvswitch2: SXid (PCI:0000:07:00.0): 20034, Fatal, Link 04 LTSSM Fault Up",
            "3,3,4,-;NEURON_HW_ERR=HBM_UNCORRECTABLE_ERROR instance-id=i-0 nd-id=3 nc-id=1",
            "3,4,5,-;NVRM: The NVIDIA GPU 0000:c3:00.0",
            "3,5,6,-;NVRM: fallen off the bus and is not responding to commands.",
            "6,9,7,-;NVRM: GPU at PCI:0000:9d:00: GPU-4b8e2c2a-1111-2222-3333-444455556666",
        ]
    )
    restored = KmsgTally.from_state(json.loads(json.dumps(tally.to_state())))
    assert restored.snapshot() == tally.snapshot()
    assert restored.snapshot().missed == 3


def _exporter(kmsg: Path, state: Path, log: Path) -> Running:
    flags = ("--nvml=off", f"--state-dir={state}")
    return spawn_exporter(kmsg=kmsg, sysfs_root=GPU_NODE / "sys", log=log, flags=flags)


@pytest.mark.skipif(not Path("/proc/sys/kernel/random/boot_id").exists(), reason="needs a Linux boot id")
def test_the_exporter_process_keeps_an_overwritten_xid_across_a_restart(tmp_path: Path) -> None:
    kmsg, state, log = tmp_path / "kmsg", tmp_path / "state", tmp_path / "exporter.log"
    kmsg.write_text(ring(0, 59, xid_at=20))
    labels = {"pci_bus_id": "0000:9d:00", "gpu": "4", "xid": "79"}

    first = _exporter(kmsg, state, log)
    try:
        body = first.scrape()
        assert wait_until((state / STATE_FILE_NAME).exists, timeout=5)
        assert sample_value(body, "accel_gpu_xid_errors_total", labels) == 1
    finally:
        first.process.send_signal(signal.SIGTERM)
        assert first.process.wait(timeout=10) == 0

    kmsg.write_text(ring(40, 79))  # the Xid's record was overwritten while the exporter was down
    second = _exporter(kmsg, state, log)
    try:
        body = second.scrape()
        assert sample_value(body, "accel_gpu_xid_errors_total", labels) == 1
        assert sample_value(body, "accel_kmsg_missed_records_total") == 0
    finally:
        second.process.send_signal(signal.SIGTERM)
        assert second.process.wait(timeout=10) == 0
