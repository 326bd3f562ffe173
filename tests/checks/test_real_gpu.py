"""The real checks on a real NVIDIA GPU and driver (``gpu`` marker): CUDA through cuda-bindings, NVML
through pynvml, ``dcgmi`` where DCGM is installed. Skipped where no GPU is present.

Expectations are broad on purpose (any healthy GPU of the last years passes them): an H100 SXM on
PCIe Gen5 x16 moves about 50 GB/s or more each way with pinned memory, and its HBM3 about 3 TB/s
(read plus written); the figures are printed for the record.
"""

from __future__ import annotations

import shutil

import pytest

from exporter.checks.bandwidth import MemoryBandwidthCheck, PcieBandwidthCheck
from exporter.checks.base import CheckRequest
from exporter.checks.cuda import CudaBindingsDriver, CudaError
from exporter.checks.dcgm import DcgmDiagCheck
from exporter.checks.nvml_checks import PowerSlowdownCheck, RemappedRowsCheck
from exporter.readers.nvml import PynvmlReader


def _cuda() -> CudaBindingsDriver:
    driver = CudaBindingsDriver()
    try:
        if not driver.devices():
            pytest.skip("CUDA sees no GPU")
    except CudaError as exc:
        pytest.skip(f"no usable CUDA driver: {exc}")
    return driver


pytestmark = pytest.mark.gpu


def test_pciebw_measures_every_gpu_in_both_directions_on_real_hardware() -> None:
    result = PcieBandwidthCheck(_cuda()).run(CheckRequest())
    print({d.device: {k: round(v / 1e9, 1) for k, v in d.values.items()} for d in result.devices})
    assert result.devices
    for device in result.devices:
        assert device.values["host_to_device"] > 1e9
        assert device.values["device_to_host"] > 1e9


def test_gpumem_measures_device_memory_bandwidth_on_real_hardware() -> None:
    result = MemoryBandwidthCheck(_cuda()).run(CheckRequest())
    print({d.device: round(d.values["device_to_device"] / 1e9) for d in result.devices})
    assert all(d.values["device_to_device"] > 100e9 for d in result.devices)


def test_remapped_and_power_read_real_nvml() -> None:
    reader = PynvmlReader()
    try:
        if not reader.read().available:
            pytest.skip("NVML unavailable")
        for check in (RemappedRowsCheck(reader), PowerSlowdownCheck(reader)):
            result = check.run(CheckRequest())
            print(check.name, result.verdict, result.message)
            assert result.verdict in ("pass", "fail", "skipped")
    finally:
        reader.close()


@pytest.mark.skipif(shutil.which("dcgmi") is None, reason="DCGM is not installed")
def test_dcgm_level_1_parses_on_real_hardware() -> None:
    result = DcgmDiagCheck().run(CheckRequest(params={"r": "1"}, deadline=300))
    print(result.verdict, result.message)
    assert result.verdict in ("pass", "fail")
    assert result.devices
