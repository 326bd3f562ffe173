"""The active checks on fake CUDA, fake NVML and a fake ``dcgmi``: measurements, verdicts, bad input.

CUDA is faked at the level of ``cuda.bindings.driver`` (tests/checks/fake_cuda.py), so the real
measurement code (contexts, pinned buffers, streams, events, cleanup) runs as on a GPU machine; only
the elapsed time comes from the simulated bandwidth.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from exporter.checks.bandwidth import MEDIAN_RATIO, PCIE_FLOOR_GBPS, PcieBandwidthCheck
from exporter.checks.base import CheckInputError, CheckRequest
from exporter.checks.cuda import CudaBindingsDriver, CudaError
from exporter.checks.dcgm import DcgmDiagCheck, DcgmOutputError, parse_diag
from tests.checks.fake_cuda import FakeCuda, h100x8
from tests.checks.helpers import FIXTURES, fake_dcgmi, make_runner, values
from tests.exporter.fake_nvml import FakeNvml


def test_pciebw_measures_both_directions_per_gpu_from_the_gpus_own_timer() -> None:
    runner, cuda, _ = make_runner()
    result = runner.run("pciebw")
    assert result.verdict == "pass"
    h2d = values(result, "host_to_device")
    assert sorted(h2d) == [str(i) for i in range(8)]
    assert all(v == pytest.approx(53.5e9) for v in h2d.values())
    assert all(v == pytest.approx(54.8e9) for v in values(result, "device_to_host").values())
    assert result.devices[4].pci_bus_id == "0000:9d:00"
    assert cuda.live_allocations() == 0
    assert cuda.held_contexts() == 0


def test_a_gpu_at_the_seeds_5_3_gb_s_among_12_3_fails_pciebw_below_the_node_median() -> None:
    gpus = h100x8(**{"4": {"host_to_device": 5.3e9}})
    for gpu in gpus:
        gpu.device_to_host = 12.3e9
        if gpu.bus_id != "0000:9D:00.0":
            gpu.host_to_device = 12.3e9
    runner, _, _ = make_runner(gpus=gpus)
    result = runner.run("pciebw")
    assert result.verdict == "fail"
    failed = [d for d in result.devices if d.verdict == "fail"]
    assert [(d.device, d.pci_bus_id) for d in failed] == [("4", "0000:9d:00")]
    assert "host_to_device below 0.5x the node's median" in failed[0].detail
    assert "GPU 4" in result.message


def test_a_whole_node_below_the_floor_fails_although_no_gpu_stands_out() -> None:
    gpus = h100x8()
    for gpu in gpus:
        gpu.host_to_device = gpu.device_to_host = 3.1e9
    result = make_runner(gpus=gpus)[0].run("pciebw")
    assert result.verdict == "fail"
    assert all(f"below {PCIE_FLOOR_GBPS:g} GB/s" in d.detail for d in result.devices)


def test_gpumem_counts_bytes_read_and_written_and_fails_a_slow_hbm() -> None:
    runner, _, _ = make_runner(gpus=h100x8(**{"2": {"device_to_device": 1.2e12}}))
    result = runner.run("gpumem")
    measured = values(result, "device_to_device")
    assert measured["0"] == pytest.approx(2.9e12)
    assert measured["2"] == pytest.approx(1.2e12)
    assert [d.device for d in result.devices if d.verdict == "fail"] == ["2"]


def test_a_cuda_error_on_one_gpu_is_that_gpus_error_and_everything_is_freed() -> None:
    runner, cuda, _ = make_runner(
        gpus=h100x8(**{"3": {"errors": {"cuMemAlloc": "CUDA_ERROR_ECC_UNCORRECTABLE"}}})
    )
    result = runner.run("pciebw")
    assert result.verdict == "error"
    bad = next(d for d in result.devices if d.device == "3")
    assert bad.verdict == "error"
    assert bad.detail == "cuMemAlloc: CUDA_ERROR_ECC_UNCORRECTABLE"
    assert sum(d.verdict == "pass" for d in result.devices) == 7
    assert cuda.live_allocations() == 0
    assert cuda.held_contexts() == 0


def test_no_cuda_driver_is_an_error_with_the_reason_not_a_traceback() -> None:
    driver = CudaBindingsDriver(library=FakeCuda(h100x8(), init_error="CUDA_ERROR_NO_DEVICE"))
    with pytest.raises(CudaError, match="cuInit: CUDA_ERROR_NO_DEVICE"):
        driver.devices()
    result = PcieBandwidthCheck(driver).run(CheckRequest())
    assert (result.verdict, result.message) == ("error", "cuInit: CUDA_ERROR_NO_DEVICE")


@pytest.mark.parametrize(
    ("params", "error"),
    [
        ({"floor_gbps": "fast"}, "floor_gbps='fast' is not a number"),
        ({"median_ratio": "2"}, "median_ratio='2' is outside [0, 1]"),
        ({"size_mib": "0"}, "size_mib='0' is outside [1, 8192]"),
    ],
)
def test_bad_bandwidth_parameters_are_refused_before_anything_runs(
    params: dict[str, str], error: str
) -> None:
    runner, cuda, _ = make_runner()
    with pytest.raises(CheckInputError, match=error.replace("[", r"\[").replace("]", r"\]")):
        runner.run("pciebw", params)
    assert sum(cuda.calls.values()) == 0


def test_the_on_demand_defaults_are_the_alert_thresholds() -> None:
    rules = (Path(__file__).resolve().parents[2] / "alerts" / "active-checks.yaml").read_text()
    assert f"< {PCIE_FLOOR_GBPS:g}e9" in rules
    assert rules.count(f"({MEDIAN_RATIO:g} * quantile by (node") == 2


def test_remapped_fails_a_pending_remap_and_power_fails_a_power_brake() -> None:
    nvml = FakeNvml.from_fixture("h100x8")
    nvml.gpus[5]["remapped_rows"] = [2, 1, 1, 0]
    nvml.gpus[6]["clocks_event_reasons"] = {
        "supported": ["hw_slowdown", "hw_power_brake", "sw_power_cap"],
        "active": ["hw_slowdown", "hw_power_brake"],
    }
    runner, _, _ = make_runner(nvml=nvml)
    remapped = runner.run("remapped")
    assert remapped.verdict == "fail"
    assert [(d.device, d.detail) for d in remapped.devices if d.verdict == "fail"] == [
        ("5", "a remap is pending a reset")
    ]
    assert remapped.devices[5].values["remapped_rows_uncorrectable"] == 1.0
    power = runner.run("power")
    assert [(d.device, d.detail) for d in power.devices if d.verdict == "fail"] == [
        ("6", "power brake asserted; hardware slowdown")
    ]
    assert power.devices[0].values["power_watts"] == pytest.approx(655.102)


def test_a_lost_gpu_is_an_nvml_checks_error_for_that_gpu() -> None:
    nvml = FakeNvml.from_fixture("h100x8")
    nvml.gpus[2]["lost"] = True
    result = make_runner(nvml=nvml)[0].run("remapped")
    assert result.verdict == "error"
    assert result.devices[2].verdict == "error"
    assert "lost" in result.devices[2].detail


def test_a_node_without_an_nvidia_driver_skips_every_check_and_calls_no_cuda() -> None:
    nvml = FakeNvml.from_fixture("h100x8")
    nvml.init_error = "LIBRARY_NOT_FOUND"
    runner, cuda, _ = make_runner(nvml=nvml)
    results = {name: runner.run(name) for name in ("pciebw", "gpumem", "remapped", "power")}
    assert {name: r.verdict for name, r in results.items()} == dict.fromkeys(results, "skipped")
    assert "NVML unavailable" in results["remapped"].message
    assert sum(cuda.calls.values()) == 0


def test_dcgm_reports_only_the_gpus_it_was_given_even_when_dcgmi_answers_for_all(tmp_path: Path) -> None:
    nvml = FakeNvml.from_fixture("h100x8")
    nvml.gpus[6]["processes"] = [4248]
    dcgmi = str(fake_dcgmi(tmp_path, "dcgm4-r2-fail.json", status=226))  # answers for all 8 GPUs
    result = make_runner(nvml=nvml, names=("dcgm",), dcgmi=dcgmi)[0].run("dcgm")
    assert "-i 0,1,2,3,4,5,7" in (tmp_path / "dcgmi.args").read_text()
    assert [(d.device, d.verdict) for d in result.devices if d.device == "6"] == [("6", "skipped")]
    assert "6" not in {str(t["gpu"]) for t in result.extra["tests"]}


def test_dcgm_3_output_parses_per_test_and_gpu_with_the_leading_line() -> None:
    tests = parse_diag((FIXTURES / "dcgm3-r1-pass.txt").read_text())
    assert {t.gpu for t in tests} == {str(i) for i in range(8)}
    assert {t.status for t in tests} == {"pass", "skip"}
    assert sum(t.test == "Denylist" for t in tests) == 8


def test_dcgm_4_output_parses_entities_warnings_and_leaves_out_cpus() -> None:
    tests = parse_diag((FIXTURES / "dcgm4-r2-fail.json").read_text())
    failed = [t for t in tests if t.status == "fail"]
    assert [(t.test, t.gpu) for t in failed] == [("memory", "4")]
    assert "uncorrectable" in failed[0].warnings[0]
    assert len([t for t in tests if t.test == "pcie"]) == 8
    assert next(t for t in tests if t.test == "pcie" and t.gpu == "6").status == "warn"


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("Error: unable to connect to host engine", "no JSON document"),
        (
            '{"DCGM Diagnostic": {"test_categories": [{"tests": [{"name": "x", "results": '
            '[{"status": "Maybe"}]}]}]}}',
            "unknown status",
        ),
        ('{"something": 1}', "no test_categories"),
        ("{not json}", "does not parse"),
    ],
)
def test_unreadable_dcgm_output_is_a_clear_error(text: str, error: str) -> None:
    with pytest.raises(DcgmOutputError, match=error):
        parse_diag(text)


def test_dcgm_runs_dcgmi_on_the_reserved_gpus_and_fails_the_gpu_that_failed(tmp_path: Path) -> None:
    dcgmi = fake_dcgmi(tmp_path, "dcgm4-r2-fail.json", status=226)
    runner, _, _ = make_runner(names=("dcgm",), dcgmi=str(dcgmi))
    result = runner.run("dcgm", {"r": "2"})
    assert result.verdict == "fail"
    assert [d.device for d in result.devices if d.verdict == "fail"] == ["4"]
    assert result.devices[4].pci_bus_id == "0000:9d:00"
    assert (tmp_path / "dcgmi.args").read_text() == "diag -r 2 -j -i 0,1,2,3,4,5,6,7\n"
    assert {"test": "memory", "gpu": "4", "status": "fail"}.items() <= result.extra["tests"][-4].items()


def test_dcgm_is_skipped_where_dcgmi_is_not_installed_and_refuses_a_bad_level() -> None:
    check = DcgmDiagCheck(dcgmi="dcgmi-not-installed-here")
    assert check.run(CheckRequest()).verdict == "skipped"
    with pytest.raises(CheckInputError, match="levels 1, 2, 3 or 4"):
        check.validate({"r": "9"})


def test_dcgm_past_its_deadline_is_an_error(tmp_path: Path) -> None:
    dcgmi = fake_dcgmi(tmp_path, "dcgm3-r1-pass.txt", sleep=5)
    runner, _, _ = make_runner(names=("dcgm",), dcgmi=str(dcgmi), deadlines={"dcgm": 0.5})
    result = runner.run("dcgm")
    assert result.verdict == "error"
    assert "within 0.5 s" in result.message or "deadline exceeded" in result.message
