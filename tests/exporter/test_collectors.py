"""Collectors and the framework, asserted through a real CollectorRegistry (absent series -> None)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest

from exporter.collectors.framework import Source, SourcesCollector, SourceUnavailableError
from exporter.collectors.infiniband import counter_metric_name
from exporter.metric import CollectorRegistry, GaugeMetricFamily, Metric
from exporter.readers.kmsg import KmsgFollower, KmsgTally
from exporter.readers.nvml import PynvmlReader
from exporter.sources import ExporterSettings, build_registry, build_sources
from tests.exporter.fake_nvml import FakeNvml
from tests.exporter.helpers import GPU_NODE, TRN_NODE, wait_until


def registry_for(root: Path, *, kmsg: KmsgFollower | None, nvml: PynvmlReader | None) -> CollectorRegistry:
    settings = ExporterSettings(kmsg_path=kmsg.path if kmsg else Path("/nonexistent"), sysfs_root=root)
    return build_registry(build_sources(settings, kmsg=kmsg, nvml=nvml))


@pytest.fixture
def gpu_node_kmsg(tmp_path: Path) -> Iterator[KmsgFollower]:
    path = tmp_path / "kmsg"
    lines = (GPU_NODE / "kmsg").read_text()
    lines += "3,55,9000000,-;NVRM: Xid (PCI:0000:9d:00): 79, pid='<unknown>', name=<unknown>, GPU has "
    lines += "fallen off the bus.\n"
    lines += "3,56,9000001,-;NVRM: The NVIDIA GPU 0000:C3:00.0\n"
    lines += "3,57,9000002,-;NVRM: (PCI ID: 10de:2330) installed in this system has\n"
    lines += "3,58,9000003,-;NVRM: fallen off the bus and is not responding to commands.\n"
    lines += (
        "4,59,9000004,-;nvidia-nvswitch2: SXid (PCI:0000:07:00.0): 20034, Fatal, Link 04 LTSSM Fault Up\n"
    )
    path.write_text(lines)
    follower = KmsgFollower(path, poll_interval=0.01)
    follower.start()
    assert wait_until(lambda: follower.snapshot().records == 60)
    yield follower
    follower.stop()


def test_xid_series_carry_the_gpu_index_from_sysfs(gpu_node_kmsg: KmsgFollower) -> None:
    registry = registry_for(GPU_NODE / "sys", kmsg=gpu_node_kmsg, nvml=None)
    value = registry.get_sample_value(
        "accel_gpu_xid_errors_total", {"pci_bus_id": "0000:9d:00", "gpu": "4", "xid": "79"}
    )
    assert value == 1
    assert (
        registry.get_sample_value(
            "accel_gpu_xid_errors_total", {"pci_bus_id": "0000:43:00", "gpu": "1", "xid": "79"}
        )
        is None
    )
    assert (
        registry.get_sample_value("accel_gpu_fallen_off_bus_total", {"pci_bus_id": "0000:c3:00", "gpu": "5"})
        == 1
    )
    assert (
        registry.get_sample_value(
            "accel_nvswitch_sxid_errors_total", {"pci_bus_id": "0000:07:00", "sxid": "20034"}
        )
        == 1
    )
    assert registry.get_sample_value("accel_kmsg_records_total") == 60
    assert registry.get_sample_value("accel_kmsg_missed_records_total") == 0
    assert registry.get_sample_value("accel_exporter_collector_up", {"collector": "kmsg"}) == 1


def test_an_xid_on_a_gpu_unknown_to_sysfs_has_an_empty_index(gpu_node_kmsg: KmsgFollower) -> None:
    registry = registry_for(TRN_NODE / "sys", kmsg=gpu_node_kmsg, nvml=None)
    value = registry.get_sample_value(
        "accel_gpu_xid_errors_total", {"pci_bus_id": "0000:9d:00", "gpu": "", "xid": "79"}
    )
    assert value == 1


def test_gpu_info_joins_sysfs_indices_with_kmsg_uuids(gpu_node_kmsg: KmsgFollower) -> None:
    registry = registry_for(GPU_NODE / "sys", kmsg=gpu_node_kmsg, nvml=None)
    uuid = gpu_node_kmsg.snapshot().gpu_uuids["0000:9d:00"]
    assert uuid.startswith("GPU-")
    assert (
        registry.get_sample_value("accel_gpu_info", {"pci_bus_id": "0000:9d:00", "gpu": "4", "uuid": uuid})
        == 1
    )
    assert registry.get_sample_value("accel_pci_devices", {"vendor": "nvidia"}) == 8
    assert registry.get_sample_value("accel_pci_devices", {"vendor": "neuron"}) is None


def test_pcie_series_report_gen5_x16_and_its_bandwidth() -> None:
    registry = registry_for(GPU_NODE / "sys", kmsg=None, nvml=None)
    labels = {"pci_bus_id": "0000:52:00", "gpu": "2", "vendor": "nvidia"}
    assert registry.get_sample_value("accel_pcie_current_link_speed_transfers_per_second", labels) == 32e9
    assert registry.get_sample_value("accel_pcie_max_link_width", labels) == 16
    bandwidth = registry.get_sample_value("accel_pcie_current_link_bandwidth_bytes_per_second", labels)
    assert bandwidth == pytest.approx(63.0e9, rel=1e-3)
    aer = {**labels, "severity": "correctable", "error": "RxErr"}
    assert registry.get_sample_value("accel_pcie_aer_errors_total", aer) == 3
    reports = {**labels, "severity": "correctable"}
    assert registry.get_sample_value("accel_pcie_aer_error_reports_total", reports) == 4


def test_infiniband_series_use_the_fixed_names() -> None:
    registry = registry_for(GPU_NODE / "sys", kmsg=None, nvml=None)
    port = {"device": "mlx5_1", "port": "1"}
    assert registry.get_sample_value("accel_infiniband_port_state", port) == 4
    assert registry.get_sample_value("accel_infiniband_port_physical_state", port) == 5
    assert registry.get_sample_value("accel_infiniband_port_rate_bytes_per_second", port) == 50e9
    assert registry.get_sample_value("accel_infiniband_port_link_downed_total", port) == 0
    assert registry.get_sample_value("accel_infiniband_port_symbol_error_total", port) == 0
    assert (
        registry.get_sample_value("accel_infiniband_port_rcv_data_bytes_total", port)
        == (18734456213 + 1000) * 4
    )
    assert registry.get_sample_value("accel_infiniband_port_vl15_dropped_total", port) == 0
    no_pma = {"device": "mlx5_0", "port": "1"}
    assert registry.get_sample_value("accel_infiniband_port_vl15_dropped_total", no_pma) is None


@pytest.mark.parametrize(
    ("counter", "name"),
    [
        ("link_downed", "accel_infiniband_port_link_downed"),
        ("port_rcv_errors", "accel_infiniband_port_rcv_errors"),
        ("port_xmit_data", "accel_infiniband_port_xmit_data_bytes"),
        ("VL15_dropped", "accel_infiniband_port_vl15_dropped"),
    ],
)
def test_infiniband_counter_names_drop_a_leading_port_and_mark_bytes(counter: str, name: str) -> None:
    assert counter_metric_name(counter) == name


def test_neuron_sysfs_counters_and_kmsg_errors_are_separate_series(tmp_path: Path) -> None:
    path = tmp_path / "kmsg"
    path.write_text(
        (TRN_NODE / "kmsg").read_text() + "4,37,9000000,-;NEURON_HW_ERR=DMA_ERROR nd-id=0 nc-id=0\n"
    )
    follower = KmsgFollower(path, poll_interval=0.01)
    follower.start()
    try:
        assert wait_until(lambda: follower.snapshot().records == 38)
        registry = registry_for(TRN_NODE / "sys", kmsg=follower, nvml=None)
    finally:
        follower.stop()
    assert (
        registry.get_sample_value(
            "accel_neuron_hw_errors_total", {"neuron_device": "0", "error": "DMA_ERROR"}
        )
        == 1
    )
    sysfs = {"neuron_device": "15", "kind": "sram_ecc_uncorrected"}
    assert registry.get_sample_value("accel_neuron_sysfs_hardware_errors_total", sysfs) is None  # 0: none
    assert registry.get_sample_value("accel_pci_devices", {"vendor": "neuron"}) == 16
    assert registry.get_sample_value("accel_infiniband_port_state", {"device": "mlx5_0", "port": "1"}) is None


def test_absent_hardware_is_collector_down_without_hardware_and_without_errors(tmp_path: Path) -> None:
    registry = registry_for(tmp_path, kmsg=None, nvml=None)
    for collector in ("pci", "infiniband", "neuron"):
        labels = {"collector": collector}
        assert registry.get_sample_value("accel_exporter_collector_up", labels) == 0
        assert registry.get_sample_value("accel_exporter_collector_hardware_present", labels) == 0
        assert registry.get_sample_value("accel_exporter_collector_errors", labels) == 0
    assert registry.get_sample_value("accel_pci_devices", {"vendor": "nvidia"}) is None
    assert registry.get_sample_value("accel_exporter_collector_up", {"collector": "kmsg"}) is None
    assert registry.get_sample_value("accel_exporter_collector_up", {"collector": "nvml"}) is None


def test_an_unreadable_kmsg_path_reports_kmsg_down_and_everything_else_up(tmp_path: Path) -> None:
    follower = KmsgFollower(tmp_path / "missing", retry_interval=10)
    follower.start()
    try:
        assert wait_until(lambda: "cannot read" in (follower.snapshot().error or ""))
        registry = registry_for(GPU_NODE / "sys", kmsg=follower, nvml=None)
        assert registry.get_sample_value("accel_exporter_collector_up", {"collector": "kmsg"}) == 0
        assert registry.get_sample_value("accel_kmsg_records_total") is None
        assert registry.get_sample_value("accel_exporter_collector_up", {"collector": "pci"}) == 1
    finally:
        follower.stop()


def test_nvml_is_down_while_unavailable_and_up_when_available() -> None:
    fake = FakeNvml.from_fixture("h100x8")
    fake.init_error = "LIBRARY_NOT_FOUND"
    reader = PynvmlReader(library=fake)
    try:
        registry = registry_for(GPU_NODE / "sys", kmsg=None, nvml=reader)
        assert registry.get_sample_value("accel_exporter_collector_up", {"collector": "nvml"}) == 0
        fake.init_error = None
        assert registry.get_sample_value("accel_exporter_collector_up", {"collector": "nvml"}) == 1
    finally:
        reader.close()


def test_the_framework_reports_a_failing_source_down_and_keeps_the_others() -> None:
    def broken() -> list[Metric]:
        raise OSError("sysfs went away")

    def unavailable() -> list[Metric]:
        raise SourceUnavailableError("no driver")

    def fine() -> list[Metric]:
        gauge = GaugeMetricFamily("accel_test_value", "A test value.")
        gauge.add_metric([], 7)
        return [gauge]

    ticks = itertools.count(start=0.0, step=0.25)
    registry = CollectorRegistry()
    registry.register(
        SourcesCollector(
            [Source("broken", broken), Source("unavailable", unavailable), Source("fine", fine)],
            clock=lambda: next(ticks),
        )
    )
    assert registry.get_sample_value("accel_exporter_collector_up", {"collector": "broken"}) == 0
    assert registry.get_sample_value("accel_exporter_collector_up", {"collector": "unavailable"}) == 0
    assert registry.get_sample_value("accel_exporter_collector_up", {"collector": "fine"}) == 1
    assert registry.get_sample_value("accel_test_value") == 7
    assert (
        registry.get_sample_value("accel_exporter_collector_duration_seconds", {"collector": "fine"}) == 0.25
    )


def test_the_tally_snapshot_is_immutable() -> None:
    snapshot = KmsgTally().snapshot()
    with pytest.raises(TypeError):
        snapshot.xid["0000:9d:00", 79, "", ""] = 1  # type: ignore[index]
