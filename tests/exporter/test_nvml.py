"""NVML: the real reader's mapping, bounding and caching over a fake pynvml; the collector and its golden
exposition; Xid events from NVML only where the kernel log cannot be read; the real library where a
GPU exists (marked ``gpu``)."""

from __future__ import annotations

import copy
import functools
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import pynvml  # the real library, only to ask a real GPU directly in the gpu-marked tests
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from exporter.collectors.framework import SourceUnavailableError
from exporter.collectors.nvml import GPU_LABELS, nvml_metrics
from exporter.exposition import Family, encode, generate_text
from exporter.metric import CollectorRegistry, Metric
from exporter.readers.kmsg import KmsgFollower
from exporter.readers.nvml import (
    NvLink,
    NvLinkTotals,
    NvmlSnapshot,
    PynvmlReader,
    _Batch,
    _Job,
    _LinkTally,
    _Workers,
)
from exporter.sources import ExporterSettings, XidOwnership, build_registry, build_sources
from tests.exporter.fake_nvml import FIXTURES, FakeNvml
from tests.exporter.helpers import GPU_NODE, GPU_NODE_BUS_IDS, client_text, wait_until

GOLDEN = FIXTURES / "h100x8.prom"
XID_79 = "NVRM: Xid (PCI:0000:9d:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
H100_GPU3 = {
    "gpu": "3",
    "uuid": "GPU-35be2791-0f30-550d-89c1-c29455a5ca63",
    "pci_bus_id": "0000:61:00",
    "model": "NVIDIA H100 80GB HBM3",
}

Open = Callable[..., tuple[FakeNvml, PynvmlReader]]


@pytest.fixture
def open_nvml() -> Iterator[Open]:
    """Makes (fake, reader) pairs from fixture names; releases hung calls and closes the readers after."""
    made: list[tuple[FakeNvml, PynvmlReader]] = []

    def make(fixture: str, *, timeout: float = 5.0, **settings: float) -> tuple[FakeNvml, PynvmlReader]:
        fake = FakeNvml.from_fixture(fixture)
        reader = PynvmlReader(timeout=timeout, library=fake, event_wait_ms=20, **settings)
        made.append((fake, reader))
        return fake, reader

    yield make
    for fake, reader in made:
        fake.release.set()
        reader.close()


class _Fixed:
    def __init__(self, families: Iterable[Metric]) -> None:
        self.families = list(families)

    def collect(self) -> Iterable[Metric]:
        return self.families


def families_registry(families: Iterable[Metric]) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(_Fixed(families))
    return registry


def nvml_registry(snapshot: NvmlSnapshot) -> CollectorRegistry:
    return families_registry(nvml_metrics(snapshot))


def node_registry(reader: PynvmlReader, *, kmsg: KmsgFollower | None = None) -> CollectorRegistry:
    settings = ExporterSettings(
        kmsg_path=kmsg.path if kmsg else Path("/nonexistent"), sysfs_root=GPU_NODE / "sys"
    )
    return build_registry(build_sources(settings, kmsg=kmsg, nvml=reader))


# -- the reader over the fake ---------------------------------------------------------------------------


def test_an_h100_node_reads_eight_gpus_with_their_identity_and_health(open_nvml: Open) -> None:
    _fake, reader = open_nvml("h100x8")
    snapshot = reader.read()
    assert snapshot.available
    assert snapshot.gpu_count == 8
    assert [gpu.status for gpu in snapshot.gpus] == ["ok"] * 8
    assert tuple(gpu.pci_bus_id for gpu in snapshot.gpus) == GPU_NODE_BUS_IDS
    gpu = snapshot.gpus[3]
    assert (gpu.uuid, gpu.model) == (H100_GPU3["uuid"], H100_GPU3["model"])
    assert len(gpu.nvlinks) == 18
    assert gpu.nvlinks[7].crc_flit == 12
    assert gpu.nvlinks[7].recovery == 1
    assert gpu.retired_pages is None
    assert gpu.pcie is not None
    assert gpu.pcie.rx_bytes_per_second == 24576 * 1024
    assert gpu.power_watts == pytest.approx(641.95)
    assert snapshot.gpus[0].clock_throttle is not None
    assert snapshot.gpus[0].clock_throttle.sw_power_cap is True
    assert snapshot.gpus[0].clock_throttle.hw_slowdown is False
    assert dict(snapshot.field_errors) == {}


def test_identity_and_nvlink_indices_are_asked_once_not_on_every_read(open_nvml: Open) -> None:
    fake, reader = open_nvml("a100x8")
    reader.read()
    first = dict(fake.calls)
    reader.read()
    assert fake.calls["nvmlDeviceGetUUID"] == first["nvmlDeviceGetUUID"] == 8
    assert fake.calls["nvmlDeviceGetHandleByIndex"] == 8
    # First read probes every index pynvml knows; later reads only the A100's 12 links.
    probed = first["nvmlDeviceGetNvLinkState"]
    assert fake.calls["nvmlDeviceGetNvLinkState"] - probed == 8 * 12


def test_hopper_link_states_come_from_one_field_values_call_per_gpu(open_nvml: Open) -> None:
    fake, reader = open_nvml("h100x8")
    for _ in range(3):
        snapshot = reader.read()
    assert fake.calls["nvmlDeviceGetFieldValues"] == 3 * 8
    assert fake.calls["nvmlDeviceGetNvLinkState"] == 0
    assert fake.calls["nvmlDeviceGetNvLinkErrorCounter"] == 3 * 8 * 18 * 4
    assert [len(gpu.nvlinks) for gpu in snapshot.gpus] == [18] * 8
    assert all(link.up for gpu in snapshot.gpus for link in gpu.nvlinks)


def test_batched_and_link_by_link_states_read_the_same(open_nvml: Open) -> None:
    batched_fake, batched = open_nvml("h100x8")
    per_link_fake, per_link = open_nvml("h100x8")
    for fake in (batched_fake, per_link_fake):
        fake.gpus[3]["nvlink"]["state"][5] = 0  # one link down
    for gpu in per_link_fake.gpus:
        gpu["nvlink_state_field"] = False
    for _ in range(2):
        expected, got = per_link.read(), batched.read()
        assert got.gpus == expected.gpus
    assert got.gpus[3].nvlinks[5].up is False
    assert per_link_fake.calls["nvmlDeviceGetFieldValues"] == 8  # tried once per GPU, then not again
    assert batched_fake.calls["nvmlDeviceGetNvLinkState"] == 0


def test_a_driver_that_does_not_know_the_state_field_is_asked_link_by_link(open_nvml: Open) -> None:
    fake, reader = open_nvml("h100x8")
    for gpu in fake.gpus:
        gpu["errors"] = {"nvmlDeviceGetFieldValues": "INVALID_ARGUMENT"}
    reader.read()
    snapshot = reader.read()
    assert all(len(gpu.nvlinks) == 18 and gpu.nvlinks[0].up for gpu in snapshot.gpus)
    assert dict(snapshot.field_errors) == {}
    assert fake.calls["nvmlDeviceGetFieldValues"] == 8  # tried on the first read only


def test_a_link_state_field_that_fails_is_counted_and_its_counters_still_read(open_nvml: Open) -> None:
    fake, reader = open_nvml("h100x8")
    reader.read()
    fake.gpus[3]["nvlink"]["state"][7] = "UNKNOWN"
    snapshot = reader.read()
    link = snapshot.gpus[3].nvlinks[7]
    assert link.up is None
    assert (link.crc_flit, link.replay) == (12, 4)
    assert dict(snapshot.field_errors) == {("nvmlDeviceGetFieldValues", "unknown"): 1}
    fake.gpus[3]["nvlink"]["state"] = ["UNKNOWN"] * 18  # the batch answers nothing: asked link by link
    snapshot = reader.read()
    assert [link.up for link in snapshot.gpus[3].nvlinks] == [None] * 18
    assert dict(snapshot.field_errors) == {
        ("nvmlDeviceGetFieldValues", "unknown"): 1,
        ("nvmlDeviceGetNvLinkState", "unknown"): 18,
    }
    fake.gpus[3]["nvlink"]["state"] = [1] * 17 + ["GPU_IS_LOST"]
    assert reader.read().gpus[3].status == "lost"


def test_older_gpus_report_retired_pages_and_no_remapped_rows(open_nvml: Open) -> None:
    _fake, reader = open_nvml("v100x2")
    gpu = reader.read().gpus[1]
    assert gpu.remapped_rows is None
    assert gpu.retired_pages is not None
    assert (gpu.retired_pages.single_bit_ecc, gpu.retired_pages.double_bit_ecc) == (2, 1)
    assert gpu.retired_pages.pending is True
    assert [link.up for link in gpu.nvlinks] == [True, True, False, True, True, True]
    assert gpu.clock_throttle is not None
    assert gpu.clock_throttle.hw_power_brake is None  # Volta has no power-brake reason
    assert gpu.clock_throttle.hw_thermal_slowdown is True


def test_a_failing_call_drops_that_field_counts_the_error_and_keeps_the_gpu_up(open_nvml: Open) -> None:
    fake, reader = open_nvml("h100x8")
    fake.gpus[2]["errors"] = {
        "nvmlDeviceGetPowerUsage": "UNKNOWN",
        "nvmlDeviceGetPcieReplayCounter": "NO_PERMISSION",
    }
    reader.read()
    snapshot = reader.read()
    gpu = snapshot.gpus[2]
    assert gpu.status == "ok"
    assert gpu.power_watts is None
    assert gpu.temperature_celsius == 55
    assert dict(snapshot.field_errors) == {
        ("nvmlDeviceGetPowerUsage", "unknown"): 2,
        ("nvmlDeviceGetPcieReplayCounter", "no_permission"): 2,
    }
    registry = nvml_registry(snapshot)
    labels = {"call": "nvmlDeviceGetPowerUsage", "error": "unknown"}
    assert registry.get_sample_value("accel_nvml_field_errors_total", labels) == 2
    gpu2 = {
        "gpu": "2",
        "uuid": "GPU-8b28e6ef-9616-56e8-878d-9283ebc9372f",
        "pci_bus_id": "0000:52:00",
        "model": "NVIDIA H100 80GB HBM3",
    }
    assert registry.get_sample_value("accel_gpu_power_watts", gpu2) is None
    assert registry.get_sample_value("accel_gpu_nvml_up", gpu2) == 1


def _nvml_threads() -> int:
    """Threads of NVML readers (all are named nvml...), so that a thread of something else in the
    process (a test worker's own, another module's server shutting down) is not counted as theirs."""
    return sum(thread.name.startswith("nvml") for thread in threading.enumerate())


def test_a_wedged_gpu_times_out_is_skipped_while_stuck_and_returns_when_freed(open_nvml: Open) -> None:
    fake, reader = open_nvml("hang", timeout=0.2)
    started = time.monotonic()
    first = reader.read()
    assert time.monotonic() - started < 1.0
    assert [gpu.status for gpu in first.gpus] == ["ok", "timeout"]
    assert first.gpus[1].stuck_call == "nvmlDeviceGetRemappedRows"
    assert dict(first.call_timeouts) == {"nvmlDeviceGetRemappedRows": 1}

    again = reader.read()
    assert [gpu.status for gpu in again.gpus] == ["ok", "stuck"]
    threads = _nvml_threads()  # GPU 0 may have needed a worker of its own
    for _ in range(2):
        again = reader.read()
        assert [gpu.status for gpu in again.gpus] == ["ok", "stuck"]
    assert _nvml_threads() <= threads  # no thread per scrape (earlier tests' may still exit)
    assert fake.calls["nvmlDeviceGetRemappedRows"] == 1 + 4  # GPU 0 on each read, GPU 1 once
    assert dict(again.call_timeouts) == {"nvmlDeviceGetRemappedRows": 1}
    stuck = again.gpus[1]
    assert stuck.uuid == "GPU-857e7def-2864-5269-a831-5d7fae136652"  # learnt before the hang
    assert stuck.stuck_seconds is not None
    assert first.gpus[1].stuck_seconds is not None
    assert 0.1 < first.gpus[1].stuck_seconds < stuck.stuck_seconds

    registry = nvml_registry(again)
    labels = {"gpu": "1", "uuid": stuck.uuid, "pci_bus_id": "0000:43:00", "model": "NVIDIA H100 80GB HBM3"}
    assert registry.get_sample_value("accel_gpu_nvml_up", labels) == 0
    assert registry.get_sample_value("accel_gpu_temperature_celsius", labels) is None
    stuck_labels = {**labels, "call": "nvmlDeviceGetRemappedRows"}
    assert registry.get_sample_value("accel_gpu_nvml_call_stuck_seconds", stuck_labels) == stuck.stuck_seconds
    assert (
        registry.get_sample_value("accel_nvml_call_timeouts_total", {"call": "nvmlDeviceGetRemappedRows"})
        == 1
    )

    fake.release.set()
    assert wait_until(lambda: reader.read().gpus[1].status == "ok")


@pytest.mark.parametrize("call", ["nvmlDeviceGetRemappedRows", "nvmlDeviceGetPcieThroughput"])
def test_the_first_gpu_wedged_holds_up_only_itself(open_nvml: Open, call: str) -> None:
    """The GPUs of a read are taken in turn; one wedged ahead of the others, before or in the sampling
    call, still leaves the others read in the same scrape, and costs one thread, not one per scrape."""
    fake, reader = open_nvml("h100x8", timeout=0.5)
    assert all(gpu.status == "ok" for gpu in reader.read().gpus)
    fake.gpus[0]["hang"] = [call]
    started = time.monotonic()
    first = reader.read()
    assert time.monotonic() - started < 2.0
    assert [gpu.status for gpu in first.gpus] == ["timeout"] + ["ok"] * 7
    assert first.gpus[0].stuck_call == call
    assert all(gpu.pcie is not None and gpu.pcie.tx_bytes_per_second for gpu in first.gpus[1:])
    again = reader.read()
    assert [gpu.status for gpu in again.gpus] == ["stuck"] + ["ok"] * 7
    threads = _nvml_threads()
    for _ in range(3):
        again = reader.read()
        assert [gpu.status for gpu in again.gpus] == ["stuck"] + ["ok"] * 7
    assert _nvml_threads() <= threads
    assert dict(again.call_timeouts) == {call: 1}
    fake.release.set()
    assert wait_until(lambda: all(gpu.status == "ok" for gpu in reader.read().gpus))


def blocking_job(_job: _Job[None], *, ran: list[int], n: int) -> None:
    """Lets go of the GIL, as a call into NVML does, then notes that job ``n`` ran."""
    time.sleep(0.0002)
    ran.append(n)


def test_a_batch_runs_each_job_once_or_hands_it_back_however_its_workers_race() -> None:
    """The GPUs of a read are taken by whichever worker is free: started, handed on and spread while
    being withdrawn at the deadline, every job is either run exactly once or handed back unrun."""
    workers = _Workers("test-batch")
    try:
        for attempt in range(300):
            ran: list[int] = []  # list.append is atomic: the workers need no lock
            jobs = [_Job(functools.partial(blocking_job, ran=ran, n=n)) for n in range(8)]
            batch = _Batch(jobs, workers)
            batch.start()
            for _ in range(attempt % 3):
                batch.hand_on()
            if attempt % 2:
                batch.spread()
            if attempt % 5 == 0:
                time.sleep(0.001)  # some rounds let the workers take everything
            withdrawn = batch.withdraw()
            taken = [n for n, job in enumerate(jobs) if job not in withdrawn]
            assert all(jobs[n].done.wait(5) for n in taken)
            assert sorted(ran) == taken
            assert not any(job.done.is_set() for job in withdrawn)
    finally:
        workers.stop()


def test_throughput_sampling_overlaps_across_gpus(open_nvml: Open) -> None:
    """NVML samples PCIe throughput for 20 ms per direction: before sampling, a GPU hands the GPUs left
    to another worker, so a read lasts about one GPU's sampling, not eight. The patience is long here,
    so only that hand-over can make the read short."""
    fake, reader = open_nvml("h100x8", patience=1.0)
    reader.read()
    for gpu in fake.gpus:
        gpu["delay"] = {"nvmlDeviceGetPcieThroughput": 0.05}  # 0.1 s a GPU, 0.8 s one after another
    started = time.monotonic()
    snapshot = reader.read()
    elapsed = time.monotonic() - started
    assert all(gpu.status == "ok" for gpu in snapshot.gpus)
    assert elapsed < 0.45, elapsed


def test_where_no_thread_can_be_started_nvml_is_down_or_its_gpus_time_out(
    open_nvml: Open, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A limit on threads (a container's pids limit) is a state of the collector, never a traceback;
    GPUs no worker began report a timeout without a stuck call, and the next read reads them."""
    _fake, reader = open_nvml("h100x8", timeout=0.2)
    start = threading.Thread.start
    allowed = [0]

    def limited(thread: threading.Thread) -> None:
        if allowed[0] <= 0:
            raise RuntimeError("can't start new thread")
        allowed[0] -= 1
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", limited)
    down = reader.read()
    assert not down.available
    assert down.reason == "cannot start a thread for NVML: can't start new thread"

    allowed[0] = 1  # the thread that initialises NVML and counts the GPUs, none for the GPUs
    starved = reader.read()
    assert starved.available
    assert [(gpu.status, gpu.stuck_call, gpu.stuck_seconds) for gpu in starved.gpus] == [
        ("timeout", "", None)
    ] * 8
    assert dict(starved.call_timeouts) == {}
    registry = nvml_registry(starved)
    unknown = {"gpu": "3", "uuid": "", "pci_bus_id": "", "model": ""}  # never read: identity not known
    assert registry.get_sample_value("accel_gpu_nvml_up", unknown) == 0
    assert "accel_gpu_nvml_call_stuck_seconds{" not in generate_text(registry).decode()

    allowed[0] = 100
    assert all(gpu.status == "ok" for gpu in reader.read().gpus)


def test_a_hanging_nvml_init_is_unavailable_within_the_bound(open_nvml: Open) -> None:
    fake, reader = open_nvml("h100x8", timeout=0.1)
    fake.init_hangs = True
    first = reader.read()
    assert not first.available
    assert first.reason == "nvmlInit did not return within 0.1 s"
    assert not reader.read().available
    assert fake.calls["nvmlInit"] == 1  # the stuck call is not started again
    registry = node_registry(reader)
    assert registry.get_sample_value("accel_exporter_collector_up", {"collector": "nvml"}) == 0
    assert registry.get_sample_value("accel_exporter_collector_up", {"collector": "pci"}) == 1
    fake.release.set()
    assert wait_until(lambda: reader.read().available)


def test_a_gpu_lost_since_boot_is_its_own_series_labelled_from_sysfs_and_the_kernel_log(
    open_nvml: Open, tmp_path: Path
) -> None:
    _fake, reader = open_nvml("lost_gpu")
    snapshot = reader.read()
    assert [gpu.status for gpu in snapshot.gpus] == ["ok", "lost"]
    assert (snapshot.gpus[1].uuid, snapshot.gpus[1].pci_bus_id) == ("", "")
    assert dict(snapshot.field_errors) == {}  # GPU_IS_LOST is a status, not a field error

    kmsg = tmp_path / "kmsg"
    shutil.copyfile(GPU_NODE / "kmsg", kmsg)
    follower = KmsgFollower(kmsg, poll_interval=0.01)
    follower.start()
    try:
        assert wait_until(lambda: bool(follower.snapshot().gpu_uuids))
        registry = node_registry(reader, kmsg=follower)
    finally:
        follower.stop()
    lost = {
        "gpu": "1",
        "uuid": "GPU-857e7def-2864-5269-a831-5d7fae136652",
        "pci_bus_id": "0000:43:00",
        "model": "",
    }
    assert registry.get_sample_value("accel_gpu_lost", lost) == 1
    assert registry.get_sample_value("accel_gpu_nvml_up", lost) == 0
    assert registry.get_sample_value("accel_gpu_temperature_celsius", lost) is None
    assert registry.get_sample_value("accel_nvml_gpus") == 2
    healthy = {
        "gpu": "0",
        "uuid": "GPU-8e8df7ef-d2bf-5947-87d0-59eb0c597a9e",
        "pci_bus_id": "0000:1b:00",
        "model": "NVIDIA H100 80GB HBM3",
    }
    assert registry.get_sample_value("accel_gpu_lost", healthy) is None
    assert registry.get_sample_value("accel_gpu_nvml_up", healthy) == 1


def test_a_gpu_lost_after_a_good_read_keeps_the_identity_nvml_told_before(open_nvml: Open) -> None:
    fake, reader = open_nvml("h100x8")
    reader.read()
    fake.gpus[4]["lost"] = True
    registry = nvml_registry(reader.read())
    labels = {
        "gpu": "4",
        "uuid": "GPU-575a9c5f-780e-558f-99bc-3b0f90f7dbd5",
        "pci_bus_id": "0000:9d:00",
        "model": "NVIDIA H100 80GB HBM3",
    }
    assert registry.get_sample_value("accel_gpu_lost", labels) == 1
    assert registry.get_sample_value("accel_gpu_nvml_up", labels) == 0
    assert (
        registry.get_sample_value(
            "accel_gpu_ecc_errors", {**labels, "error_type": "corrected", "counter_type": "volatile"}
        )
        is None
    )


def test_without_a_driver_nvml_is_down_and_every_other_collector_up(open_nvml: Open) -> None:
    fake, reader = open_nvml("h100x8")
    fake.init_error = "LIBRARY_NOT_FOUND"
    snapshot = reader.read()
    assert not snapshot.available
    assert snapshot.reason == "nvmlInit failed: NVML Shared Library Not Found"
    registry = node_registry(reader)
    assert registry.get_sample_value("accel_exporter_collector_up", {"collector": "nvml"}) == 0
    assert registry.get_sample_value("accel_exporter_collector_hardware_present", {"collector": "nvml"}) == 0
    for collector in ("pci", "infiniband"):
        assert registry.get_sample_value("accel_exporter_collector_up", {"collector": collector}) == 1
    assert registry.get_sample_value("accel_nvml_gpus") is None
    fake.init_error = None  # the driver came up: the next read initialises
    assert registry.get_sample_value("accel_exporter_collector_up", {"collector": "nvml"}) == 1
    assert registry.get_sample_value("accel_nvml_gpus") == 8


def test_the_real_reader_without_a_driver_says_unavailable() -> None:
    reader = PynvmlReader(timeout=5.0)
    try:
        snapshot = reader.read()
        if snapshot.available:
            pytest.skip("an NVIDIA driver is present here")
        assert any(why in snapshot.reason for why in ("cannot be loaded", "failed", "not installed"))
        assert reader.xid_events().error is not None
    finally:
        reader.close()


def test_close_shuts_nvml_down_once_and_skips_it_while_a_call_is_stuck(open_nvml: Open) -> None:
    fake, reader = open_nvml("h100x8")
    reader.read()
    assert fake.initialised == 1
    reader.close()
    assert fake.initialised == 0

    hung, stuck_reader = open_nvml("hang", timeout=0.1)
    stuck_reader.read()
    stuck_reader.close()
    assert hung.calls["nvmlShutdown"] == 0


# -- the collector --------------------------------------------------------------------------------------


def test_unsupported_fields_have_no_series_rather_than_zero(open_nvml: Open) -> None:
    _fake, reader = open_nvml("v100x2")
    registry = nvml_registry(reader.read())
    gpu1 = {
        "gpu": "1",
        "uuid": "GPU-c9e2b7d4-0a5f-6183-e4b2-7f9c3d1a8e05",
        "pci_bus_id": "0000:3b:00",
        "model": "Tesla V100-SXM2-32GB",
    }
    assert registry.get_sample_value("accel_gpu_remapped_rows", {**gpu1, "cause": "correctable"}) is None
    assert registry.get_sample_value("accel_gpu_remapped_rows_pending", gpu1) is None
    assert registry.get_sample_value("accel_gpu_retired_pages", {**gpu1, "cause": "double_bit_ecc"}) == 1
    assert registry.get_sample_value("accel_gpu_retired_pages_pending", gpu1) == 1
    assert (
        registry.get_sample_value("accel_gpu_clock_throttle_active", {**gpu1, "reason": "hw_power_brake"})
        is None
    )
    assert (
        registry.get_sample_value("accel_gpu_clock_throttle_active", {**gpu1, "reason": "hw_slowdown"}) == 1
    )
    assert registry.get_sample_value("accel_gpu_nvlink_links", gpu1) == 6  # a V100 has 6, not 18
    assert registry.get_sample_value("accel_gpu_nvlink_links_up", gpu1) == 5
    assert registry.get_sample_value("accel_gpu_nvlink_errors_total", {**gpu1, "error": "replay"}) == 160
    per_link = families_registry(nvml_metrics(reader.read(), per_link=True))
    assert per_link.get_sample_value("accel_gpu_nvlink_link_up", {**gpu1, "link": "2"}) == 0
    assert (
        per_link.get_sample_value(
            "accel_gpu_nvlink_link_errors_total", {**gpu1, "link": "2", "error": "replay"}
        )
        == 160
    )
    assert per_link.get_sample_value("accel_gpu_nvlink_link_up", {**gpu1, "link": "6"}) is None


def test_a_pending_remap_and_a_remap_failure_are_flags(open_nvml: Open) -> None:
    _fake, reader = open_nvml("remap_pending")
    registry = nvml_registry(reader.read())
    model = "NVIDIA A100-SXM4-80GB"
    pending = {
        "gpu": "1",
        "uuid": "GPU-5f0a9e32-1c8d-4b7f-a6e2-93d1c0b84e57",
        "pci_bus_id": "0000:0f:00",
        "model": model,
    }
    failed = {
        "gpu": "2",
        "uuid": "GPU-9c41e7b0-3d25-48fa-b1e9-6a7f2d05c813",
        "pci_bus_id": "0000:47:00",
        "model": model,
    }
    assert registry.get_sample_value("accel_gpu_remapped_rows_pending", pending) == 1
    assert registry.get_sample_value("accel_gpu_remapped_rows_failure", pending) is None  # only once failed
    assert registry.get_sample_value("accel_gpu_remapped_rows", {**pending, "cause": "uncorrectable"}) == 1
    ecc = {**pending, "error_type": "uncorrected", "counter_type": "volatile"}
    assert registry.get_sample_value("accel_gpu_ecc_errors", ecc) == 1
    assert registry.get_sample_value("accel_gpu_remapped_rows_failure", failed) == 1
    assert registry.get_sample_value("accel_gpu_remapped_rows_pending", failed) == 0
    assert registry.get_sample_value("accel_gpu_retired_pages", {**failed, "cause": "single_bit_ecc"}) is None


def test_an_a100_with_a_link_trained_down_shows_current_below_max(open_nvml: Open) -> None:
    _fake, reader = open_nvml("a100x8")
    registry = nvml_registry(reader.read())
    gpu4 = {
        "gpu": "4",
        "uuid": "GPU-71e8c3a9-5b04-4d2e-8f6a-c1b9d7e30a52",
        "pci_bus_id": "0000:87:00",
        "model": "NVIDIA A100-SXM4-80GB",
    }
    assert registry.get_sample_value("accel_gpu_pcie_link_width", {**gpu4, "link": "current"}) == 8
    assert registry.get_sample_value("accel_gpu_pcie_link_width", {**gpu4, "link": "max"}) == 16
    assert registry.get_sample_value("accel_gpu_pcie_link_generation", {**gpu4, "link": "max"}) == 4
    assert registry.get_sample_value("accel_gpu_pcie_replay_errors_total", gpu4) == 3
    assert (
        registry.get_sample_value("accel_gpu_pcie_throughput_bytes_per_second", {**gpu4, "direction": "tx"})
        == 948 * 1024
    )


def test_an_unavailable_snapshot_raises_for_the_framework() -> None:
    with pytest.raises(SourceUnavailableError, match="no driver"):
        nvml_metrics(NvmlSnapshot(available=False, reason="no driver"))


def test_every_per_gpu_series_carries_the_four_gpu_labels(open_nvml: Open) -> None:
    _fake, reader = open_nvml("h100x8")
    for family in nvml_metrics(reader.read()):
        for sample in family.samples:
            if family.name.startswith("accel_gpu_"):
                assert set(GPU_LABELS) <= set(sample.labels), sample
            else:
                assert not set(GPU_LABELS) & set(sample.labels), sample


def _nvlink_families(families: list[Metric]) -> list[Family]:
    return [f for f in families if isinstance(f, Family) and f.name.startswith("accel_gpu_nvlink_link_")]


def _series(name: str, labels: dict[str, str], value: int) -> str:
    rendered = ",".join(f'{label}="{text}"' for label, text in sorted(labels.items()))
    return f"{name}{{{rendered}}} {value}.0\n"


def test_unchanged_nvlinks_are_handed_over_again_and_any_change_is_written(open_nvml: Open) -> None:
    fake, reader = open_nvml("h100x8")
    fake.gpus[3]["nvlink"] = copy.deepcopy(fake.gpus[3]["nvlink"])  # GPU 3's links alone
    first = nvml_metrics(reader.read(), per_link=True)
    first_text = encode(first)
    again = nvml_metrics(reader.read(), per_link=True)  # a new snapshot with the same values
    assert len(_nvlink_families(again)) == 2
    for before, after in zip(_nvlink_families(first), _nvlink_families(again), strict=True):
        assert after.rows is before.rows  # handed over, not built again
    assert encode(again) == first_text

    fake.gpus[3]["nvlink"]["errors"]["replay"][7] += 5
    fake.gpus[3]["nvlink"]["state"][16] = 0
    changed = nvml_metrics(reader.read(), per_link=True)
    text = (encode(changed) or b"").decode()
    assert text == client_text(changed)
    replay = fake.gpus[3]["nvlink"]["errors"]["replay"][7]
    link7 = {**H100_GPU3, "link": "7", "error": "replay"}
    assert _series("accel_gpu_nvlink_link_errors_total", link7, replay) in text
    assert _series("accel_gpu_nvlink_link_errors_total", link7, replay - 5) in (first_text or b"").decode()
    assert _series("accel_gpu_nvlink_link_up", {**H100_GPU3, "link": "16"}, 0) in text
    assert _series("accel_gpu_nvlink_link_up", {**H100_GPU3, "link": "16"}, 1) not in text
    assert _series("accel_gpu_nvlink_links_up", H100_GPU3, 17) in text


def test_the_h100_exposition_matches_the_golden_file(open_nvml: Open) -> None:
    """Regenerate on purpose with ACCEL_UPDATE_GOLDEN=1, then review the diff."""
    _fake, reader = open_nvml("h100x8")
    exposition = client_text(nvml_metrics(reader.read()))
    if os.environ.get("ACCEL_UPDATE_GOLDEN") == "1":
        GOLDEN.write_text(exposition)
    assert exposition == GOLDEN.read_text()
    registry = nvml_registry(reader.read())
    assert (
        registry.get_sample_value("accel_gpu_nvlink_errors_total", {**H100_GPU3, "error": "crc_flit"}) == 12
    )
    assert "accel_gpu_nvlink_link_" not in exposition  # per GPU by default: no per-link series


def test_the_golden_exposition_passes_promtool_check_metrics() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not on PATH")
    checked = subprocess.run(
        [promtool, "check", "metrics"], input=GOLDEN.read_bytes(), capture_output=True, check=False
    )
    assert checked.returncode == 0, checked.stdout.decode() + checked.stderr.decode()


# -- NVLink per GPU ---------------------------------------------------------------------------------------


def gpu3_links(reader: PynvmlReader) -> NvLinkTotals | None:
    return reader.read().gpus[3].nvlink_totals


@pytest.fixture
def h100(open_nvml: Open) -> tuple[FakeNvml, PynvmlReader]:
    """The h100x8 node, with GPU 3's NVLink readings its own to change."""
    fake, reader = open_nvml("h100x8")
    fake.gpus[3]["nvlink"] = copy.deepcopy(fake.gpus[3]["nvlink"])
    return fake, reader


def test_nvlink_totals_are_the_sums_of_the_links_counters_and_count_the_links_up(
    h100: tuple[FakeNvml, PynvmlReader],
) -> None:
    fake, reader = h100
    assert gpu3_links(reader) == NvLinkTotals(
        links=18, links_up=18, crc_flit=12, crc_data=3, replay=4, recovery=1
    )
    nvlink = fake.gpus[3]["nvlink"]
    nvlink["state"][5] = 0
    nvlink["errors"]["replay"][9] += 7
    assert gpu3_links(reader) == NvLinkTotals(18, 17, 12, 3, 11, 1)
    assert reader.read().gpus[2].nvlink_totals == NvLinkTotals(18, 18, 0, 0, 0, 0)


def test_a_link_counter_that_cannot_be_read_keeps_its_last_value_in_the_total(
    h100: tuple[FakeNvml, PynvmlReader],
) -> None:
    fake, reader = h100
    replay = fake.gpus[3]["nvlink"]["errors"]["replay"]
    assert gpu3_links(reader) == NvLinkTotals(18, 18, 12, 3, 4, 1)
    replay[7] = "UNKNOWN"  # link 7 held 4 of the GPU's replays: a plain sum would fall to 0
    snapshot = reader.read()
    assert snapshot.gpus[3].nvlinks[7].replay is None
    assert snapshot.gpus[3].nvlink_totals == NvLinkTotals(18, 18, 12, 3, 4, 1)
    assert snapshot.field_errors[("nvmlDeviceGetNvLinkErrorCounter", "unknown")] == 1
    replay[7] = 6  # readable again, 2 more
    assert gpu3_links(reader) == NvLinkTotals(18, 18, 12, 3, 6, 1)


def test_a_link_counter_that_was_reset_adds_to_the_total_rather_than_lowering_it(
    h100: tuple[FakeNvml, PynvmlReader],
) -> None:
    fake, reader = h100
    flits = fake.gpus[3]["nvlink"]["errors"]["crc_flit"]
    assert gpu3_links(reader) == NvLinkTotals(18, 18, 12, 3, 4, 1)
    flits[7] = 2  # link 7's counters reset (nvidia-smi nvlink -r), then 2 new errors
    assert gpu3_links(reader) == NvLinkTotals(18, 18, 14, 3, 4, 1)
    flits[7] = 5
    flits[8] = 1
    assert gpu3_links(reader) == NvLinkTotals(18, 18, 18, 3, 4, 1)


def test_a_link_whose_state_cannot_be_read_counts_as_it_was_last_read(
    h100: tuple[FakeNvml, PynvmlReader],
) -> None:
    fake, reader = h100
    state = fake.gpus[3]["nvlink"]["state"]
    state[4] = 0
    assert gpu3_links(reader) == NvLinkTotals(18, 17, 12, 3, 4, 1)
    state[4] = "UNKNOWN"  # still down as far as anyone knows
    assert gpu3_links(reader) == NvLinkTotals(18, 17, 12, 3, 4, 1)
    state[4] = 1
    state[11] = "UNKNOWN"  # up when last read
    assert gpu3_links(reader) == NvLinkTotals(18, 18, 12, 3, 4, 1)


def test_brief_reads_carry_no_nvlink_totals_and_leave_them_as_they_were(
    h100: tuple[FakeNvml, PynvmlReader],
) -> None:
    fake, reader = h100
    first = gpu3_links(reader)
    fake.gpus[3]["nvlink"]["errors"]["crc_flit"][7] = "UNKNOWN"
    assert all(gpu.nvlink_totals is None and not gpu.nvlinks for gpu in reader.read(brief=True).gpus)
    assert gpu3_links(reader) == first


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.lists(st.one_of(st.none(), st.integers(min_value=0, max_value=1000)), min_size=3, max_size=3),
        min_size=1,
        max_size=12,
    )
)
def test_nvlink_error_totals_never_go_down_and_equal_the_sums_while_counters_only_grow(
    reads: list[list[int | None]],
) -> None:
    """Any sequence of reads of three links' replay counters (None: unreadable), resets included."""
    tally = _LinkTally()
    previous = 0
    growing = True
    last: dict[int, int] = {}
    for values in reads:
        for link, value in enumerate(values):
            if value is not None:
                growing = growing and value >= last.get(link, 0)
                last[link] = value
        replay = tally.add(
            tuple(NvLink(link, True, 0, 0, value, 0) for link, value in enumerate(values))
        ).replay
        assert (replay is None) == (not last)  # no total until some link reported the counter
        total = replay or 0
        assert total >= previous
        previous = total
        if growing:  # no counter went down so far: the total is the plain sum of the last values read
            assert total == sum(last.values())


def test_the_collector_publishes_nvlink_per_gpu_and_per_link_only_when_asked(
    h100: tuple[FakeNvml, PynvmlReader],
) -> None:
    _fake, reader = h100
    snapshot = reader.read()
    per_gpu = nvml_metrics(snapshot)
    by_name = {family.name: family for family in per_gpu}
    nvlink = sorted(name for name in by_name if name.startswith("accel_gpu_nvlink"))
    assert nvlink == ["accel_gpu_nvlink_errors", "accel_gpu_nvlink_links", "accel_gpu_nvlink_links_up"]
    assert sum(len(by_name[name].samples) for name in nvlink) == 8 * (1 + 1 + 4)
    assert all("link" not in sample.labels for name in nvlink for sample in by_name[name].samples)
    registry = families_registry(per_gpu)
    assert registry.get_sample_value("accel_gpu_nvlink_errors_total", {**H100_GPU3, "error": "recovery"}) == 1
    assert registry.get_sample_value("accel_gpu_nvlink_links_up", H100_GPU3) == 18

    with_links = {family.name: family for family in nvml_metrics(snapshot, per_link=True)}
    assert len(with_links["accel_gpu_nvlink_link_up"].samples) == 8 * 18
    assert len(with_links["accel_gpu_nvlink_link_errors"].samples) == 8 * 18 * 4
    assert with_links["accel_gpu_nvlink_errors"].samples == by_name["accel_gpu_nvlink_errors"].samples
    exposition = client_text(list(with_links.values()))
    assert exposition.count("# TYPE accel_gpu_nvlink_errors_total counter") == 1  # no name shared


# -- Xid events -------------------------------------------------------------------------------------------


def _xid_families(registry: CollectorRegistry) -> int:
    return generate_text(registry).decode().count("# TYPE accel_gpu_xid_errors_total counter")


def test_nvml_xid_events_fill_in_while_the_kernel_log_cannot_be_read(open_nvml: Open, tmp_path: Path) -> None:
    fake, reader = open_nvml("h100x8")
    follower = KmsgFollower(tmp_path / "missing", retry_interval=10)
    follower.start()
    try:
        assert wait_until(lambda: follower.snapshot().error is not None)
        registry = node_registry(reader, kmsg=follower)
        assert registry.get_sample_value("accel_exporter_collector_up", {"collector": "kmsg"}) == 0
        assert wait_until(lambda: fake.registered == set(range(8)))
        fake.emit_xid(4, 79)
        fake.emit_xid(4, 79)
        labels = {"pci_bus_id": "0000:9d:00", "gpu": "4", "xid": "79"}
        assert wait_until(lambda: registry.get_sample_value("accel_gpu_xid_errors_total", labels) == 2)
        assert _xid_families(registry) == 1
    finally:
        follower.stop()


def test_nvml_xid_events_are_not_watched_while_the_kernel_log_is_read(
    open_nvml: Open, tmp_path: Path
) -> None:
    fake, reader = open_nvml("h100x8")
    kmsg = tmp_path / "kmsg"
    kmsg.write_text(f"3,0,1000,-;{XID_79}\n")
    follower = KmsgFollower(kmsg, poll_interval=0.01)
    follower.start()
    try:
        assert wait_until(lambda: follower.snapshot().records == 1)
        registry = node_registry(reader, kmsg=follower)
        labels = {"pci_bus_id": "0000:9d:00", "gpu": "4", "xid": "79"}
        assert registry.get_sample_value("accel_gpu_xid_errors_total", labels) == 1
        assert _xid_families(registry) == 1
        assert fake.calls["nvmlEventSetCreate"] == 0
    finally:
        follower.stop()


def test_without_a_kernel_log_source_nvml_publishes_the_xid_family(open_nvml: Open) -> None:
    fake, reader = open_nvml("a100x8")
    registry = node_registry(reader, kmsg=None)
    assert _xid_families(registry) == 1
    assert wait_until(lambda: len(fake.registered) == 8)
    fake.emit_xid(0, 48)
    labels = {"pci_bus_id": "0000:07:00", "gpu": "0", "xid": "48"}
    assert wait_until(lambda: registry.get_sample_value("accel_gpu_xid_errors_total", labels) == 1)


def test_a_gpu_that_refuses_event_registration_is_skipped_not_fatal(open_nvml: Open) -> None:
    fake, reader = open_nvml("h100x8")
    fake.gpus[0]["errors"] = {"nvmlDeviceRegisterEvents": "NOT_SUPPORTED"}
    reader.read()
    assert wait_until(lambda: reader.xid_events().error is None and fake.registered == set(range(1, 8)))
    fake.emit_xid(7, 94)
    assert wait_until(lambda: dict(reader.xid_events().counts) == {("0000:df:00", 94): 1})


def test_the_xid_ownership_record_is_per_thread() -> None:
    ownership = XidOwnership()
    ownership.record(published=True)
    seen: list[bool] = []
    other = threading.Thread(target=lambda: seen.append(ownership.kmsg_published()))
    other.start()
    other.join()
    assert seen == [False]
    assert ownership.kmsg_published()


# -- the real library (a GPU machine) ---------------------------------------------------------------------


def _shape(snapshot: NvmlSnapshot) -> dict[str, tuple[str, ...]]:
    """Family name -> label names, for families with samples."""
    return {
        family.name: tuple(sorted(family.samples[0].labels))
        for family in nvml_metrics(snapshot)
        if family.samples
    }


@pytest.mark.gpu
def test_the_real_reader_has_the_shape_of_the_fake() -> None:
    reader = PynvmlReader()
    try:
        snapshot = reader.read()
        if not snapshot.available:
            pytest.skip(f"no NVML here: {snapshot.reason}")
        assert snapshot.gpus
        for gpu in snapshot.gpus:
            assert gpu.status == "ok", gpu
            assert gpu.uuid.startswith("GPU-")
            assert len(gpu.pci_bus_id) == len("0000:91:00")
            assert gpu.model
            assert gpu.temperature_celsius is not None
        fake = FakeNvml.from_fixture("h100x8")
        fake_reader = PynvmlReader(library=fake)
        try:
            expected = _shape(fake_reader.read())
        finally:
            fake_reader.close()
        real = _shape(snapshot)
        for name, labels in real.items():
            assert expected.get(name, labels) == labels, name
        assert {"accel_gpu_nvml_up", "accel_gpu_temperature_celsius", "accel_gpu_pcie_link_width"} <= set(
            real
        )
        assert reader.xid_events().counts is not None
    finally:
        reader.close()


@pytest.mark.gpu
def test_on_a_real_gpu_batched_link_states_agree_with_asking_link_by_link() -> None:
    reader = PynvmlReader()
    try:
        started = time.perf_counter()
        snapshot = reader.read()
        took = time.perf_counter() - started
        if not snapshot.available:
            pytest.skip(f"no NVML here: {snapshot.reason}")
        links = 0
        for gpu in snapshot.gpus:
            handle = pynvml.nvmlDeviceGetHandleByIndex(gpu.index)
            for link in gpu.nvlinks:
                assert link.up == bool(pynvml.nvmlDeviceGetNvLinkState(handle, link.link)), (gpu, link)
                links += 1
            if gpu.nvlinks:  # the first read's totals: the links' own counts and states
                totals = gpu.nvlink_totals
                assert totals is not None
                assert (totals.links, totals.links_up) == (
                    len(gpu.nvlinks),
                    sum(1 for k in gpu.nvlinks if k.up),
                )
                assert totals.replay == sum(k.replay or 0 for k in gpu.nvlinks)
        print(
            f"real NVML: {len(snapshot.gpus)} GPUs, {links} NVLink links, one read took {took * 1000:.1f} ms"
        )
    finally:
        reader.close()


def test_with_nvml_on_a_missing_driver_is_an_error_not_absent_hardware(open_nvml: Open) -> None:
    fake, reader = open_nvml("h100x8")
    fake.init_error = "LIBRARY_NOT_FOUND"
    settings = ExporterSettings(kmsg_path=Path("/nonexistent"), sysfs_root=GPU_NODE / "sys", nvml="on")
    registry = build_registry(build_sources(settings, kmsg=None, nvml=reader))
    nvml = {"collector": "nvml"}
    assert registry.get_sample_value("accel_exporter_collector_up", nvml) == 0
    assert registry.get_sample_value("accel_exporter_collector_hardware_present", nvml) == 1
    assert registry.get_sample_value("accel_exporter_collector_errors", nvml) == 1
