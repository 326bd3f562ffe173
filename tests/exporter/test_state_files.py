"""The state directory's files (exporter/statefile.py) have one writer at a time and never go back in
time: concurrent saves of one store leave the newest state on disk, every write goes through a
temporary file of its own and an atomic rename, a damaged file is an error line and
``accel_exporter_state_file_damaged_total{file}`` (the store goes on without it), and an exporter
killed (SIGKILL) at any moment while fault records wait, several at once, with /evidence read as it
starts, leaves every state file readable and holding at least what the last /evidence answer showed.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import threading
import time
from http import HTTPStatus
from pathlib import Path

import pytest

from exporter.evidence import STATE_FILE_NAME as EVIDENCE_FILE
from exporter.evidence import EvidenceStore
from exporter.readers.kmsg import STATE_FILE_NAME as KMSG_FILE
from exporter.sources import state_file_metrics
from exporter.statefile import BootStateFile, damaged_counts
from tests.exporter.helpers import GPU_NODE, spawn_exporter
from tests.exporter.test_evidence import BOOT_A, TOKEN, XID_79, get

logger = logging.getLogger("tests.state")


@pytest.fixture
def boot_id(tmp_path: Path) -> Path:
    path = tmp_path / "boot_id"
    path.write_text(BOOT_A + "\n")
    return path


def test_concurrent_saves_leave_the_newest_state_and_no_temporary_file(tmp_path: Path, boot_id: Path) -> None:
    store = EvidenceStore(directory=tmp_path / "state", boot_id_path=boot_id, save_interval=0.0)
    start = threading.Barrier(8)
    errors: list[BaseException] = []

    def writer(offset: int) -> None:
        start.wait()
        try:
            for n in range(offset, 400, 8):
                store.fault("xid", "0000:9d:00", "79", seq=n, timestamp_us=n, line=f"{XID_79} #{n}")
                store.save(force=True)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    store.save(force=True)
    assert errors == []
    saved = json.loads((tmp_path / "state" / EVIDENCE_FILE).read_text())
    expected, _overflow = store.records()
    assert saved["last_seq"] == 399  # the newest record, whichever thread saved last
    again = EvidenceStore(directory=tmp_path / "state", boot_id_path=boot_id)
    assert again.load()
    assert again.records() == (expected, _overflow)
    assert [p.name for p in (tmp_path / "state").iterdir() if p.name.endswith(".tmp")] == []


def test_an_older_generation_is_never_written_over_a_newer_one(tmp_path: Path) -> None:
    file = BootStateFile(tmp_path / "x.json", logger=logger, prefix="x", other_boot="")
    assert file.write('{"n": 2}', generation=2)
    assert file.write('{"n": 1}', generation=1)  # late: a newer state is on disk already
    assert json.loads((tmp_path / "x.json").read_text()) == {"n": 2}
    assert file.write('{"n": 3}', generation=3)
    assert json.loads((tmp_path / "x.json").read_text()) == {"n": 3}


def test_temporary_files_a_killed_writer_left_are_swept_by_the_next(tmp_path: Path) -> None:
    (tmp_path / ".x.json.abc123.tmp").write_text('{"half": ')
    file = BootStateFile(tmp_path / "x.json", logger=logger, prefix="x", other_boot="")
    assert file.write("{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".x.json.lock", "x.json"]


def test_a_damaged_file_is_an_error_line_and_a_counted_series(
    tmp_path: Path, boot_id: Path, caplog: pytest.LogCaptureFixture
) -> None:
    state = tmp_path / "state"
    state.mkdir()
    (state / EVIDENCE_FILE).write_text('{"boot_id": "' + BOOT_A + '", "groups": [')  # cut short
    before = damaged_counts().get(EVIDENCE_FILE, 0)
    with caplog.at_level(logging.ERROR, logger="exporter.evidence"):
        assert not EvidenceStore(directory=state, boot_id_path=boot_id).load()
    assert any(r.levelno == logging.ERROR and "going on without it" in r.getMessage() for r in caplog.records)
    assert damaged_counts()[EVIDENCE_FILE] == before + 1
    [family] = state_file_metrics()
    samples = {s.labels["file"]: s.value for s in family.samples}
    assert samples[EVIDENCE_FILE] == before + 1


@pytest.mark.skipif(not Path("/proc/sys/kernel/random/boot_id").exists(), reason="needs a Linux boot id")
def test_exporters_killed_at_any_moment_leave_readable_state_holding_what_evidence_showed(
    tmp_path: Path,
) -> None:
    """A bounded version of 100 start-then-SIGKILL cycles: 3 exporters at once, 6 cycles each, a
    kernel log of 1,500 Xid records waiting (more appended while they run), /evidence read from the
    start, SIGKILL at a random moment of the first second."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    ring = "".join(
        f"6,{s},{s * 1000},-;usb 1-1: noise {s}\n" if s % 2 == 0 else f"3,{s},{s * 1000},-;{XID_79}\n"
        for s in range(3000)
    )
    rng = random.Random(34)  # noqa: S311  a reproducible schedule of kills, no secret
    delays = [[rng.uniform(0.05, 1.0) for _ in range(6)] for _ in range(3)]

    def cycles(worker: int, failures: list[str]) -> None:
        kmsg, state = tmp_path / f"kmsg-{worker}", tmp_path / f"state-{worker}"
        kmsg.write_text(ring)
        for cycle, delay in enumerate(delays[worker]):
            log = tmp_path / f"exporter-{worker}-{cycle}.log"
            flags = ("--nvml=off", f"--state-dir={state}", f"--checks-token-file={token_file}")
            running = spawn_exporter(kmsg=kmsg, sysfs_root=GPU_NODE / "sys", log=log, flags=flags)
            with kmsg.open("a") as out:  # records still arriving
                seq = 3000 + cycle
                out.write(f"3,{seq},{seq * 1000},-;{XID_79}\n")
            shown = -1
            deadline = time.monotonic() + delay
            while time.monotonic() < deadline or shown < 0:
                status, _headers, document = get(running.url + "/evidence", TOKEN)
                if status == HTTPStatus.OK:
                    shown = sum(g["seen"] for g in document["records"])
            os.kill(running.process.pid, signal.SIGKILL)
            running.process.wait(timeout=10)
            where = f"exporter {worker}, cycle {cycle} (killed {delay:.2f} s after its start)"
            for name in (EVIDENCE_FILE, KMSG_FILE):
                try:
                    json.loads((state / name).read_text())
                except (OSError, ValueError) as exc:
                    failures.append(f"{where}: {name} unreadable: {exc}")
            kept = EvidenceStore(directory=state)
            if not kept.load():
                failures.append(f"{where}: {EVIDENCE_FILE} not this boot's evidence")
                continue
            held = sum(int(str(g["seen"])) for g in kept.records()[0])
            if held < shown:
                failures.append(f"{where}: {EVIDENCE_FILE} holds {held} records, /evidence showed {shown}")
            left = [p.name for p in state.iterdir() if p.name.endswith(".tmp")]
            if len(left) > 2:  # a kill mid-write may leave one per file; the next writer sweeps them
                failures.append(f"{where}: temporary files pile up: {left}")

    failures: list[str] = []
    workers = [threading.Thread(target=cycles, args=(w, failures)) for w in range(3)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert failures == []
