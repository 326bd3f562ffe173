"""Running checks: idle GPUs only, one check per GPU, deadlines, the schedule, and the series.

A busy GPU must cost nothing: the fake CUDA counts every call per GPU, so "not touched" is asserted,
not assumed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from exporter.checks.metrics import check_metrics
from exporter.checks.schedule import DAY, HOUR, ScheduleError, Scheduler, load_schedule
from exporter.checks.usage import NvmlProcesses, PodAccelerators
from exporter.cli import checks_source
from exporter.exposition import generate_text
from exporter.sources import build_registry
from tests.checks.fake_cuda import h100x8
from tests.checks.helpers import fake_dcgmi, make_runner
from tests.exporter.fake_nvml import FakeNvml
from tests.exporter.helpers import sample_value


def test_an_invasive_check_leaves_a_gpu_with_a_process_untouched() -> None:
    nvml = FakeNvml.from_fixture("h100x8")
    nvml.gpus[3]["processes"] = [48213]
    runner, cuda, _ = make_runner(nvml=nvml)
    result = runner.run("pciebw")
    assert result.verdict == "pass"
    busy = next(d for d in result.devices if d.device == "3")
    assert (busy.verdict, busy.detail) == ("skipped", "1 process(es) on the GPU (pid 48213)")
    assert 3 not in cuda.touched
    assert cuda.touched == {0, 1, 2, 4, 5, 6, 7}
    assert runner.skipped_gpus()["pciebw"] == 1


def test_a_pod_requesting_gpus_keeps_every_invasive_check_off_the_node() -> None:
    pod = {
        "metadata": {"namespace": "training", "name": "llama-0"},
        "spec": {"containers": [{"resources": {"limits": {"nvidia.com/gpu": "8"}}}]},
        "status": {"phase": "Running"},
    }
    done = {**pod, "status": {"phase": "Succeeded"}}
    runner, cuda, _ = make_runner(usage=[PodAccelerators(lambda: [done, pod])])
    result = runner.run("gpumem")
    assert result.verdict == "skipped"
    assert "pod training/llama-0 requests nvidia.com/gpu=8" in result.message
    assert sum(cuda.calls.values()) == 0
    assert runner.run("power").verdict == "pass"  # reading NVML loads nothing: runs on busy GPUs


def test_probes_that_cannot_tell_count_every_gpu_as_in_use() -> None:
    def broken() -> list[Mapping[str, Any]]:
        raise ConnectionError("API unreachable")

    runner, cuda, _ = make_runner(usage=[PodAccelerators(broken)])
    assert runner.run("pciebw").verdict == "skipped"
    nvml = FakeNvml.from_fixture("h100x8")
    nvml.init_error = "DRIVER_NOT_LOADED"
    assert all("cannot list GPU processes" in why for why in NvmlProcesses(library=nvml).in_use([]).values())
    assert sum(cuda.calls.values()) == 0


def test_a_wedged_run_past_its_deadline_keeps_its_gpus_until_it_really_ends() -> None:
    runner, cuda, _ = make_runner(
        gpus=h100x8(**{"0": {"hang": {"cuEventSynchronize"}}}), deadlines={"pciebw": 0.3}
    )
    first = runner.run("pciebw")
    assert first.verdict == "error"
    assert first.message == "deadline exceeded: still running after 0.3 s"
    copies = cuda.calls["cuMemcpyDtoDAsync"]
    second = runner.run("gpumem")  # every GPU is still reserved by the wedged pciebw run
    assert second.verdict == "skipped"
    assert {d.detail for d in second.devices} == {"check pciebw is running on it"}
    assert cuda.calls["cuMemcpyDtoDAsync"] == copies
    cuda.release.set()
    deadline = time.monotonic() + 5
    while runner.run("gpumem").verdict == "skipped" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert runner.latest()["gpumem"].verdict == "pass"
    assert cuda.live_allocations() == 0


def test_the_same_check_asked_twice_at_once_runs_once() -> None:
    runner, cuda, _ = make_runner(gpus=h100x8(**{"0": {"hang": {"cuEventSynchronize"}}}))
    answers = []
    thread = threading.Thread(target=lambda: answers.append(runner.run("pciebw")))
    thread.start()
    time.sleep(0.2)
    assert runner.run("pciebw").message == "pciebw is already running"
    cuda.release.set()
    thread.join(5)
    assert answers[0].verdict == "pass"


def test_the_schedule_runs_cheap_checks_hourly_and_invasive_ones_daily() -> None:
    runner, _, _ = make_runner()
    schedule = load_schedule(None, runner)
    assert {n: s.interval for n, s in schedule.items()} == {
        "pciebw": DAY,
        "gpumem": DAY,
        "remapped": HOUR,
        "power": HOUR,
    }
    scheduler = Scheduler(runner, schedule, node="gpu-node-1", start=0.0, clock=lambda: 0.0)
    assert all(0 <= due < 0.1 * schedule[n].interval for n, due in scheduler.next_due.items())
    ran = scheduler.tick(0.1 * DAY)
    assert sorted(ran) == ["gpumem", "pciebw", "power", "remapped"]
    assert scheduler.tick(0.1 * DAY + HOUR) == ["remapped", "power"]
    assert scheduler.tick(0.1 * DAY + 2 * HOUR) == ["remapped", "power"]
    assert sorted(scheduler.tick(1.1 * DAY)) == ["gpumem", "pciebw", "power", "remapped"]


def test_a_schedule_file_sets_interval_deadline_and_parameters(tmp_path: Path) -> None:
    runner, _, _ = make_runner()
    path = tmp_path / "schedule.yaml"
    path.write_text(
        "checks:\n"
        "  pciebw: {interval: 6h, deadline: 90s, params: {floor_gbps: 20}}\n"
        "  gpumem: {enabled: false}\n"
    )
    schedule = load_schedule(path, runner)
    assert (schedule["pciebw"].interval, schedule["pciebw"].deadline) == (6 * HOUR, 90.0)
    assert dict(schedule["pciebw"].params) == {"floor_gbps": "20"}
    scheduler = Scheduler(runner, schedule, start=0.0)
    assert "gpumem" not in scheduler.schedule
    scheduler.tick(HOUR)
    assert runner.latest()["pciebw"].verdict == "pass"
    assert runner.deadline("pciebw") == 90.0


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("checks:\n  nosuch: {}\n", "unknown check 'nosuch'"),
        ("checks:\n  pciebw: {interval: soon}\n", "not a duration"),
        ("checks:\n  pciebw: {every: 1h}\n", "unknown keys"),
        ("checks:\n  pciebw: {params: {floor_gbps: x}}\n", "is not a number"),
        ("checks: [1]\n", "expected a mapping"),
    ],
)
def test_a_bad_schedule_file_is_refused_with_the_reason(tmp_path: Path, text: str, error: str) -> None:
    path = tmp_path / "schedule.yaml"
    path.write_text(text)
    with pytest.raises(ScheduleError, match=error):
        load_schedule(path, make_runner()[0])


def test_results_become_raw_series_on_the_exporters_metrics() -> None:
    runner, _, _ = make_runner(gpus=h100x8(**{"4": {"host_to_device": 5.3e9}}))
    scheduler = Scheduler(runner, load_schedule(None, runner), start=0.0)
    registry = build_registry([checks_source(runner, scheduler)])
    before = generate_text(registry).decode()
    assert sample_value(before, "accel_check_interval_seconds", {"check": "pciebw"}) == DAY
    assert sample_value(before, "accel_check_success", {"check": "pciebw"}) is None
    runner.run("pciebw")
    runner.run("power")
    text = generate_text(registry).decode()
    labels = {"gpu": "4", "pci_bus_id": "0000:9d:00", "direction": "host_to_device"}
    assert sample_value(text, "accel_check_pcie_bandwidth_bytes_per_second", labels) == pytest.approx(5.3e9)
    assert sample_value(text, "accel_check_success", {"check": "pciebw"}) == 0.0
    assert sample_value(text, "accel_check_success", {"check": "power"}) == 1.0
    assert sample_value(text, "accel_check_runs_total", {"check": "pciebw", "verdict": "fail"}) == 1.0
    assert (
        sample_value(
            text, "accel_check_gpu_passed", {"check": "pciebw", "gpu": "4", "pci_bus_id": "0000:9d:00"}
        )
        == 0.0
    )
    assert sample_value(text, "accel_exporter_collector_up", {"collector": "checks"}) == 1.0
    assert (sample_value(text, "accel_check_last_run_timestamp_seconds", {"check": "pciebw"}) or 0) > 1.7e9


def test_dcgm_results_become_one_status_series_per_test_and_gpu(tmp_path: Path) -> None:
    runner, _, _ = make_runner(
        names=("dcgm",), dcgmi=str(fake_dcgmi(tmp_path, "dcgm4-r2-fail.json", status=226))
    )
    runner.run("dcgm")
    families = check_metrics(runner.latest(), runner.runs(), runner.skipped_gpus(), {})
    dcgm = next(f for f in families if f.name == "accel_check_dcgm_test_status")
    failed = [s.labels for s in dcgm.samples if s.labels["status"] == "fail"]
    assert failed == [{"gpu": "4", "test": "memory", "status": "fail"}]
