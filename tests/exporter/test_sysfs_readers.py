"""Sysfs readers against the example node trees (symlinked like real sysfs) and damaged copies."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest

from exporter.readers.sysfs import (
    PcieLink,
    link_encoding_efficiency,
    nvidia_gpu_indices,
    read_infiniband_ports,
    read_neuron_devices,
    read_pci_accelerators,
)
from tests.exporter.helpers import GPU_NODE, GPU_NODE_BUS_IDS, TRN_NODE


def copy_tree(source: Path, tmp_path: Path) -> Path:
    target = tmp_path / "sys"
    shutil.copytree(source, target, symlinks=True)
    return target


def test_the_gpu_node_has_eight_nvidia_gpus_and_no_nvswitch_counts_as_one() -> None:
    devices = read_pci_accelerators(GPU_NODE / "sys")
    assert [d.pci_bus_id for d in devices] == list(GPU_NODE_BUS_IDS)
    assert {d.kind for d in devices} == {"nvidia"}


def test_gpu_indices_follow_pci_address_order_like_nvml() -> None:
    indices = nvidia_gpu_indices(read_pci_accelerators(GPU_NODE / "sys"))
    assert indices == {bus_id: index for index, bus_id in enumerate(GPU_NODE_BUS_IDS)}
    assert indices["0000:9d:00"] == 4


def test_pcie_links_and_aer_counters_are_read() -> None:
    gpu2 = read_pci_accelerators(GPU_NODE / "sys")[2]
    assert gpu2.current_link == PcieLink(speed_gts=32.0, width=16)
    assert gpu2.max_link == PcieLink(speed_gts=32.0, width=16)
    correctable = next(a for a in gpu2.aer if a.severity == "correctable")
    assert correctable.errors["RxErr"] == 3
    assert correctable.total == 4
    assert [a.severity for a in gpu2.aer] == ["correctable", "nonfatal", "fatal"]


@pytest.mark.parametrize(
    ("speed", "efficiency"), [(2.5, 0.8), (5.0, 0.8), (8.0, 128 / 130), (32.0, 128 / 130), (64.0, 242 / 256)]
)
def test_link_bandwidth_accounts_for_line_encoding(speed: float, efficiency: float) -> None:
    assert link_encoding_efficiency(speed) == efficiency
    assert PcieLink(speed_gts=speed, width=4).bandwidth_bytes_per_second == speed * 1e9 * 4 * efficiency / 8


def test_an_unknown_link_speed_has_no_bandwidth() -> None:
    assert PcieLink(speed_gts=None, width=16).bandwidth_bytes_per_second is None


def test_the_trainium_node_has_sixteen_neuron_devices_and_its_efa_and_ena_are_left_out() -> None:
    devices = read_pci_accelerators(TRN_NODE / "sys")
    assert len(devices) == 16
    assert {d.kind for d in devices} == {"neuron"}
    assert devices[0].pci_bus_id == "0000:10:1c"
    assert devices[0].aer == ()
    assert nvidia_gpu_indices(devices) == {}


def test_a_garbage_link_speed_is_skipped_with_a_log_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = copy_tree(GPU_NODE / "sys", tmp_path)
    (root / "bus/pci/devices/0000:1b:00.0/current_link_speed").write_text("fast\n")
    with caplog.at_level(logging.WARNING):
        devices = read_pci_accelerators(root)
    assert devices[0].current_link == PcieLink(speed_gts=None, width=16)
    assert devices[1].current_link.speed_gts == 32.0
    assert "not a link speed" in caplog.text


def test_infiniband_ports_report_state_rate_and_counters_in_bytes() -> None:
    ports = read_infiniband_ports(GPU_NODE / "sys")
    assert [(p.device, p.port) for p in ports] == [(f"mlx5_{i}", "1") for i in range(8)]
    port = ports[1]
    assert (port.state, port.physical_state, port.link_layer) == (4, 5, "InfiniBand")
    assert port.rate_bytes_per_second == 50e9
    assert port.counters["link_downed"] == 0
    assert port.counters["port_rcv_data"] == (18734456213 + 1000) * 4


def test_a_counter_without_pma_is_left_out_not_zero() -> None:
    ports = read_infiniband_ports(GPU_NODE / "sys")
    assert "VL15_dropped" not in ports[0].counters
    assert ports[1].counters["VL15_dropped"] == 0


def test_a_garbage_counter_is_skipped_and_the_rest_of_the_port_still_read(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = copy_tree(GPU_NODE / "sys", tmp_path)
    (root / "class/infiniband/mlx5_3/ports/1/counters/symbol_error").write_text("\x00garbage\n")
    (root / "class/infiniband/mlx5_3/ports/1/state").write_text("ACTIVE\n")
    with caplog.at_level(logging.WARNING):
        port = read_infiniband_ports(root)[3]
    assert "symbol_error" not in port.counters
    assert port.counters["link_downed"] == 0
    assert port.state is None
    assert port.physical_state == 5
    assert "is not a counter" in caplog.text


def test_neuron_devices_report_their_sysfs_hardware_counters() -> None:
    devices = read_neuron_devices(TRN_NODE / "sys")
    assert [d.neuron_device for d in devices] == [str(i) for i in range(16)]
    assert dict(devices[0].hardware_errors) == {
        "mem_ecc_repairable_uncorrected": 0,
        "mem_ecc_uncorrected": 0,
        "sram_ecc_uncorrected": 0,
    }


def test_absent_hardware_reads_as_nothing(tmp_path: Path) -> None:
    assert read_pci_accelerators(tmp_path) == ()
    assert read_infiniband_ports(tmp_path) == ()
    assert read_neuron_devices(tmp_path) == ()
    assert read_infiniband_ports(TRN_NODE / "sys") == ()
    assert read_neuron_devices(GPU_NODE / "sys") == ()
