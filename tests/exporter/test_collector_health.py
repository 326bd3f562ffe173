"""Collector health on damaged input: garbage, truncated and unreadable files are a 0 and a log line.

Each test copies a fixture tree with its symlinks, damages single files in the copy and scrapes a real
CollectorRegistry: what could be read is still exported, nothing wrong is, and the collector says 0.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest

from exporter.collectors.kmsg import kmsg_metrics
from exporter.metric import CollectorRegistry
from exporter.readers.kmsg import KmsgTally
from exporter.sources import ExporterSettings, build_registry, build_sources
from tests.exporter.helpers import GPU_BUS_PATHS, GPU_NODE, TRN_NODE


def copy_tree(node: Path, tmp_path: Path) -> Path:
    root = tmp_path / "sys"
    shutil.copytree(node / "sys", root, symlinks=True)
    return root


def registry(root: Path) -> CollectorRegistry:
    return build_registry(build_sources(ExporterSettings(sysfs_root=root), kmsg=None, nvml=None))


def health(reg: CollectorRegistry, collector: str) -> tuple[float | None, float | None, float | None]:
    labels = {"collector": collector}
    return (
        reg.get_sample_value("accel_exporter_collector_up", labels),
        reg.get_sample_value("accel_exporter_collector_hardware_present", labels),
        reg.get_sample_value("accel_exporter_collector_errors", labels),
    )


def gpu_labels(bus: str, index: int) -> dict[str, str]:
    return {"pci_bus_id": bus, "gpu": str(index), "vendor": "nvidia"}


def test_undamaged_fixture_trees_are_fully_up() -> None:
    gpu, trn = registry(GPU_NODE / "sys"), registry(TRN_NODE / "sys")
    assert health(gpu, "pci") == (1, 1, 0)
    assert health(gpu, "infiniband") == (1, 1, 0)
    assert health(gpu, "neuron") == (0, 0, 0)
    assert health(trn, "neuron") == (1, 1, 0)
    assert health(trn, "infiniband") == (0, 0, 0)


@pytest.mark.parametrize(
    ("damage", "what"),
    [
        ("x16\n", "garbage"),
        ("", "truncated to nothing"),
        ("1", None),  # a valid value: the control case, nothing is skipped
    ],
)
def test_a_damaged_link_width_drops_only_that_series_and_marks_pci_down(
    tmp_path: Path, damage: str, what: str | None, caplog: pytest.LogCaptureFixture
) -> None:
    root = copy_tree(GPU_NODE, tmp_path)
    (root / GPU_BUS_PATHS[2] / "current_link_width").write_text(damage)
    with caplog.at_level(logging.WARNING):
        reg = registry(root)
        width = reg.get_sample_value("accel_pcie_current_link_width", gpu_labels("0000:52:00", 2))
    assert reg.get_sample_value("accel_pci_devices", {"vendor": "nvidia"}) == 8
    assert reg.get_sample_value("accel_pcie_current_link_width", gpu_labels("0000:61:00", 3)) == 16
    if what is None:
        assert width == 1
        assert health(reg, "pci") == (1, 1, 0)
    else:
        assert width is None, what
        assert health(reg, "pci") == (0, 1, 1)
        assert any("current_link_width" in r.getMessage() for r in caplog.records)


def test_an_unreadable_counter_keeps_the_rest_of_the_port(tmp_path: Path) -> None:
    root = copy_tree(GPU_NODE, tmp_path)
    counters = root / "class" / "infiniband" / "mlx5_3" / "ports" / "1" / "counters"
    (counters / "symbol_error").unlink()
    (counters / "symbol_error").mkdir()  # read() fails with EISDIR, as a permission error would
    reg = registry(root)
    port = {"device": "mlx5_3", "port": "1"}
    assert reg.get_sample_value("accel_infiniband_port_symbol_error_total", port) is None
    assert reg.get_sample_value("accel_infiniband_port_link_downed_total", port) == 0
    assert reg.get_sample_value("accel_infiniband_port_state", port) == 4
    assert health(reg, "infiniband") == (0, 1, 1)
    assert health(reg, "pci") == (1, 1, 0)


def test_garbage_neuron_counter_is_skipped_not_zero(tmp_path: Path) -> None:
    root = copy_tree(TRN_NODE, tmp_path)
    hardware = root / "devices" / "virtual" / "neuron_device" / "neuron7" / "stats" / "hardware"
    (hardware / "mem_ecc_uncorrected" / "total").write_text("\x00\x00garbage")
    (hardware / "sram_ecc_uncorrected" / "total").write_text("2\n")  # a kind appears once above 0
    reg = registry(root)
    assert (
        reg.get_sample_value(
            "accel_neuron_sysfs_hardware_errors_total", {"neuron_device": "7", "kind": "mem_ecc_uncorrected"}
        )
        is None
    )
    assert (
        reg.get_sample_value(
            "accel_neuron_sysfs_hardware_errors_total", {"neuron_device": "7", "kind": "sram_ecc_uncorrected"}
        )
        == 2
    )
    assert health(reg, "neuron") == (0, 1, 1)


def test_a_collector_recovers_once_its_file_is_readable_again(tmp_path: Path) -> None:
    root = copy_tree(GPU_NODE, tmp_path)
    width = root / GPU_BUS_PATHS[0] / "max_link_width"
    width.write_text("sixteen")
    reg = registry(root)
    assert health(reg, "pci") == (0, 1, 1)
    width.write_text("16\n")
    assert health(reg, "pci") == (1, 1, 0)


def test_infiniband_adapters_report_firmware_board_and_driver_counters() -> None:
    reg = registry(GPU_NODE / "sys")
    info = {"device": "mlx5_0", "fw_ver": "28.39.1002", "board_id": "MT_0000000838", "hca_type": "MT4129"}
    assert reg.get_sample_value("accel_infiniband_device_info", info) == 1
    driver = {"device": "mlx5_0", "port": "1", "counter": "out_of_buffer"}
    assert reg.get_sample_value("accel_infiniband_port_driver_events_total", driver) == 17


def test_mig_xids_carry_instance_labels_and_others_keep_the_contract_labels() -> None:
    tally = KmsgTally()
    tally.add_lines(
        [
            "3,0,1,-;NVRM: Xid (PCI:0000:3b:00 GPU-I:01 GPU-CI:02): 43, pid=7, name=python3, Ch 00000008",
            "3,1,2,-;NVRM: Xid (PCI:0000:3b:00 GPU-I:03): 43, pid=8, name=python3, Ch 00000009",
            "3,2,3,-;NVRM: Xid (PCI:0000:3b:00): 43, pid=9, name=python3, Ch 0000000a",
        ]
    )
    [xid] = [
        f
        for f in kmsg_metrics(tally.snapshot(), gpu_indices={"0000:3b:00": 0})
        if f.name == "accel_gpu_xid_errors"
    ]
    labels = sorted(sorted(s.labels.items()) for s in xid.samples)
    base = [("gpu", "0"), ("pci_bus_id", "0000:3b:00"), ("xid", "43")]
    assert labels == sorted(
        [
            sorted([*base, ("gpu_instance", "1"), ("compute_instance", "2")]),
            sorted([*base, ("gpu_instance", "3")]),
            base,
        ]
    )
