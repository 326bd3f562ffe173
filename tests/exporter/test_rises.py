"""The rises of the InfiniBand counters whose first increase cordons (exporter/rises.py): history,
resets, a restart within the boot, another boot, a state directory that cannot be written; and the
real exporter serving them on its fast path and keeping them across a restart."""

from __future__ import annotations

import json
import logging
import shutil
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from exporter.paths import FAST_INFINIBAND_COUNTERS
from exporter.readers.sysfs import InfinibandPort
from exporter.rises import STATE_FILE_NAME, CounterRises
from tests.exporter.helpers import GPU_NODE, Running, spawn_exporter, wait_until

EVENTS = "accel_infiniband_port_events_seen_total"
AGE = "accel_infiniband_port_events_last_rise_age_seconds"


def port(device: str = "mlx5_0", number: str = "1", **counters: int) -> InfinibandPort:
    return InfinibandPort(
        device=device,
        port=number,
        state=4,
        physical_state=5,
        rate_bytes_per_second=None,
        link_layer="InfiniBand",
        counters=counters,
        hw_counters={},
    )


@pytest.fixture
def boot_id(tmp_path: Path) -> Path:
    path = tmp_path / "boot_id"
    path.write_text("6a1c0a43-0000-4000-8000-000000000001\n")
    return path


def rises(directory: Path | None, boot_id: Path) -> CounterRises:
    return CounterRises(FAST_INFINIBAND_COUNTERS, directory=directory, boot_id_path=boot_id)


def test_the_first_reading_is_history_and_each_rise_counts(boot_id: Path) -> None:
    watched = rises(None, boot_id)
    assert watched.observe([port(link_downed=4, symbol_error=900)]) == {}
    assert watched.observe([port(link_downed=4, symbol_error=950)]) == {}
    assert watched.observe([port(link_downed=5)]) == {("mlx5_0", "1", "link_downed"): 1}
    assert watched.observe([port(link_downed=7), port("mlx5_1", local_link_integrity_errors=2)]) == {
        ("mlx5_0", "1", "link_downed"): 3
    }
    # Counters that cordon nobody are not watched (symbol_error has rates and thresholds of its own).
    assert all(key[2] in FAST_INFINIBAND_COUNTERS for key in watched.observe([port(symbol_error=10**6)]))


def test_a_reset_is_a_new_starting_point_and_the_rises_never_go_down(boot_id: Path) -> None:
    watched = rises(None, boot_id)
    watched.observe([port(excessive_buffer_overrun_errors=9)])
    watched.observe([port(excessive_buffer_overrun_errors=10)])
    key = ("mlx5_0", "1", "excessive_buffer_overrun_errors")
    assert watched.observe([port(excessive_buffer_overrun_errors=0)]) == {key: 1}  # perfquery -R
    assert watched.observe([port(excessive_buffer_overrun_errors=2)]) == {key: 3}


def test_a_reading_older_than_one_taken_is_left_out_and_counts_nothing_twice(boot_id: Path) -> None:
    watched = rises(None, boot_id)
    watched.observe([port(link_downed=5)], read_at=10.0)
    # The slow path begins reading at 11 (5); the fast one at 12 reads the link-down (6), and is
    # taken first; the slow path's older 5 then arrives: not a reset, and 6 is not counted again.
    assert watched.observe([port(link_downed=6)], read_at=12.0) == {("mlx5_0", "1", "link_downed"): 1}
    assert watched.observe([port(link_downed=5)], read_at=11.0) == {("mlx5_0", "1", "link_downed"): 1}
    assert watched.observe([port(link_downed=6)], read_at=13.0) == {("mlx5_0", "1", "link_downed"): 1}
    assert watched.observe([port(link_downed=0)], read_at=14.0) == {("mlx5_0", "1", "link_downed"): 1}


def test_a_restart_within_the_boot_counts_a_rise_it_missed_and_nothing_twice(
    tmp_path: Path, boot_id: Path
) -> None:
    state = tmp_path / "state"
    first = rises(state, boot_id)
    assert not first.load()
    first.observe([port(link_downed=1)])
    first.observe([port(link_downed=2)])
    # The exporter stops; the link goes down once more before the next one reads it.
    second = rises(state, boot_id)
    assert second.load()
    assert second.observe([port(link_downed=3)]) == {("mlx5_0", "1", "link_downed"): 2}
    third = rises(state, boot_id)
    assert third.load()
    assert third.observe([port(link_downed=3)]) == {("mlx5_0", "1", "link_downed"): 2}


class Clock:
    """The system's monotonic clock, as every exporter process of one boot reads it."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_the_age_of_the_newest_rise_survives_a_restart_within_the_boot_and_not_a_reboot(
    tmp_path: Path, boot_id: Path
) -> None:
    clock = Clock(1000.0)
    state = tmp_path / "state"
    key = ("mlx5_0", "1", "link_downed")
    first = CounterRises(FAST_INFINIBAND_COUNTERS, directory=state, boot_id_path=boot_id, monotonic=clock)
    first.observe([port(link_downed=4)])
    assert first.ages() == {}  # history has no time
    clock.now = 1010.0
    first.observe([port(link_downed=5)])
    clock.now = 1100.0
    assert first.ages() == {key: 90.0}
    clock.now = 1200.0
    first.observe([port(link_downed=7)])  # a second rise: the age starts again
    assert first.ages(now=1230.0) == {key: 30.0}

    # The exporter restarts in the same boot: the rise keeps its time (the same monotonic clock).
    clock.now = 1500.0
    second = CounterRises(FAST_INFINIBAND_COUNTERS, directory=state, boot_id_path=boot_id, monotonic=clock)
    assert second.load()
    assert second.ages() == {key: 300.0}
    second.observe([port(link_downed=7)])  # no rise: unchanged
    assert second.ages() == {key: 300.0}

    # A reboot: the previous boot's rises have no age in the new one (and the clock starts again).
    boot_id.write_text("6a1c0a43-0000-4000-8000-000000000002\n")
    clock.now = 40.0
    third = CounterRises(FAST_INFINIBAND_COUNTERS, directory=state, boot_id_path=boot_id, monotonic=clock)
    assert not third.load()
    third.observe([port(link_downed=0)])
    assert third.ages() == {}


def test_a_state_written_before_ages_were_kept_resumes_its_rises_without_an_age(
    tmp_path: Path, boot_id: Path
) -> None:
    state = tmp_path / "state"
    state.mkdir()
    (state / STATE_FILE_NAME).write_text(
        json.dumps(
            {
                "boot_id": boot_id.read_text().strip(),
                "version": 1,
                "last": {"mlx5_0/1/link_downed": 3},
                "rises": {"mlx5_0/1/link_downed": 2},
            }
        )
    )
    resumed = rises(state, boot_id)
    assert resumed.load()
    assert resumed.observe([port(link_downed=3)]) == {("mlx5_0", "1", "link_downed"): 2}
    assert resumed.ages() == {}  # a rise of unknown time is not "within the last 10 minutes"


def test_state_from_another_boot_or_unreadable_is_ignored(
    tmp_path: Path, boot_id: Path, caplog: pytest.LogCaptureFixture
) -> None:
    state = tmp_path / "state"
    before = rises(state, boot_id)
    before.observe([port(link_downed=1)])
    before.observe([port(link_downed=5)])
    boot_id.write_text("6a1c0a43-0000-4000-8000-000000000002\n")  # the node rebooted
    after = rises(state, boot_id)
    assert not after.load()
    assert after.observe([port(link_downed=0)]) == {}
    assert after.observe([port(link_downed=1)]) == {("mlx5_0", "1", "link_downed"): 1}
    for damaged in ("{not json", '{"boot_id": "x"}', "[]"):
        (state / STATE_FILE_NAME).write_text(damaged)
        with caplog.at_level(logging.INFO, logger="exporter.rises"):
            assert not rises(state, boot_id).load()
    assert "ignoring" in caplog.text or "another boot" in caplog.text


def test_an_unwritable_state_directory_is_logged_once_and_the_counts_go_on(
    tmp_path: Path, boot_id: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    watched = rises(blocked / "state", boot_id)
    with caplog.at_level(logging.WARNING, logger="exporter.rises"):
        watched.observe([port(link_downed=1)])
        watched.observe([port(link_downed=2)])
        assert watched.observe([port(link_downed=3)]) == {("mlx5_0", "1", "link_downed"): 2}
    assert caplog.text.count("cannot write") == 1


# -- the real exporter -----------------------------------------------------------------------------


@pytest.fixture
def node(tmp_path: Path) -> Path:
    root = tmp_path / "sys"
    shutil.copytree(GPU_NODE / "sys", root, symlinks=True)
    return root


def _fast(running: Running, name: str = EVENTS) -> dict[tuple[str, str, str], float]:
    with urllib.request.urlopen(running.url + "/metrics/fast", timeout=5) as response:  # noqa: S310 -- loopback URL
        body = response.read().decode()
    return {
        (s.labels["device"], s.labels["port"], s.labels["counter"]): s.value
        for family in text_string_to_metric_families(body)
        for s in family.samples
        if s.name == name
    }


def _boot(running: Running) -> dict[str, float]:
    with urllib.request.urlopen(running.url + "/metrics/slow", timeout=5) as response:  # noqa: S310 -- loopback URL
        body = response.read().decode()
    return {
        s.labels["boot_id"]: s.value
        for family in text_string_to_metric_families(body)
        for s in family.samples
        if s.name == "accel_node_boot_time_seconds"
    }


@pytest.fixture
def exporter(tmp_path: Path, node: Path) -> Iterator[tuple[Path, list[Running]]]:
    started: list[Running] = []
    yield tmp_path, started
    for running in started:
        if running.process.poll() is None:
            running.process.terminate()
            running.process.wait(timeout=10)


def test_the_exporter_serves_a_link_down_on_its_fast_path_and_keeps_it_across_a_restart(
    node: Path, exporter: tuple[Path, list[Running]]
) -> None:
    tmp_path, started = exporter
    kmsg = tmp_path / "kmsg"
    kmsg.write_text((GPU_NODE / "kmsg").read_text())
    flags = ("--nvml=off", f"--state-dir={tmp_path / 'state'}")
    log = tmp_path / "exporter.log"
    link_downed = node / "class/infiniband/mlx5_2/ports/1/counters/link_downed"
    baseline = int(link_downed.read_text())

    started.append(spawn_exporter(kmsg=kmsg, sysfs_root=node, log=log, flags=flags))
    assert _fast(started[-1]) == {}  # a healthy node: no series at all
    boot = _boot(started[-1])
    assert list(boot) == [Path("/proc/sys/kernel/random/boot_id").read_text().strip()]
    link_downed.write_text(f"{baseline + 1}\n")
    first_rise = time.monotonic()
    assert wait_until(lambda: _fast(started[-1]) == {("mlx5_2", "1", "link_downed"): 1}, timeout=5)
    assert set(_fast(started[-1], AGE)) == {("mlx5_2", "1", "link_downed")}

    started[-1].process.terminate()
    started[-1].process.wait(timeout=10)
    link_downed.write_text(f"{baseline + 3}\n")  # two more while no exporter ran
    started.append(spawn_exporter(kmsg=kmsg, sysfs_root=node, log=log, flags=flags))
    assert _fast(started[-1]) == {("mlx5_2", "1", "link_downed"): 3}
    # The rises while it was away were seen at its first reading, after the first rise: newer.
    (age,) = _fast(started[-1], AGE).values()
    assert 0 <= age < time.monotonic() - first_rise
    # The raw counter itself is on the slow path, with the adapter's own value.
    url = started[-1].url + "/metrics/slow"
    with urllib.request.urlopen(url, timeout=5) as response:  # noqa: S310 -- loopback URL
        slow = response.read().decode()
    assert f'accel_infiniband_port_link_downed_total{{device="mlx5_2",port="1"}} {baseline + 3}' in slow
    assert EVENTS not in slow
    assert AGE not in slow
    # The boot the rules scope the slow counters by: the same id and time after the restart.
    assert _boot(started[-1]) == boot
