"""The fast and slow scrape paths: a partition of /metrics, and the fast one's brief reads."""

from __future__ import annotations

import collections
import shutil
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from exporter.collectors.framework import Source
from exporter.exposition import generate_text
from exporter.paths import FAST, FAST_INFINIBAND_COUNTERS, cut
from exporter.readers.kmsg import KmsgFollower
from exporter.readers.nvml import PynvmlReader
from exporter.readers.sysfs import read_infiniband_ports
from exporter.sources import ExporterSettings, build_registry, build_sources
from tests.exporter.fake_nvml import FakeNvml
from tests.exporter.helpers import GPU_NODE, TRN_NODE, Running, spawn_exporter, wait_until

Series = dict[tuple[str, tuple[tuple[str, str], ...]], float]
FAULTS = (
    "NVRM: Xid (PCI:0000:9d:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
    "NVRM: Xid (PCI:0000:43:00): 13, pid=48213, name=python3, Graphics Exception",
    "nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 12028, Non-fatal, Link 11 egress non-posted PRIV error",
)
MOVING = ("accel_exporter_collector_duration_seconds",)
"""Series whose value differs from one scrape to the next."""


def _series(body: bytes) -> Series:
    found: Series = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            if sample.name.startswith(MOVING):
                continue
            found[sample.name, tuple(sorted(sample.labels.items()))] = sample.value
    return found


def _kmsg_with_faults(tmp_path: Path, node: Path) -> Path:
    kmsg = tmp_path / "kmsg"
    text = (node / "kmsg").read_text()
    seq = sum(1 for line in text.splitlines() if line and not line.startswith(" "))
    for fault in FAULTS:
        text += f"3,{seq},{seq * 1000},-;{fault}\n"
        seq += 1
    kmsg.write_text(text)
    return kmsg


@pytest.fixture
def follower(tmp_path: Path) -> Iterator[KmsgFollower]:
    kmsg = KmsgFollower(_kmsg_with_faults(tmp_path, GPU_NODE))
    kmsg.start()
    wait_until(lambda: kmsg.snapshot().records > 0 and bool(kmsg.snapshot().xid), timeout=5)
    yield kmsg
    kmsg.stop(timeout=0.5)


@pytest.fixture
def nvml() -> Iterator[tuple[FakeNvml, PynvmlReader]]:
    fake = FakeNvml.from_fixture("h100x8")
    reader = PynvmlReader(timeout=5.0, library=fake, event_wait_ms=20)
    yield fake, reader
    fake.release.set()
    reader.close()


def test_fast_and_slow_split_everything_once_and_fast_holds_only_what_acts(
    follower: KmsgFollower, nvml: tuple[FakeNvml, PynvmlReader]
) -> None:
    _fake, reader = nvml
    settings = ExporterSettings(kmsg_path=follower.path, sysfs_root=GPU_NODE / "sys")
    sources = build_sources(settings, kmsg=follower, nvml=reader)
    brief = build_sources(settings, kmsg=follower, nvml=reader, brief=True)
    everything = _series(generate_text(build_registry(sources)))
    fast = _series(generate_text(build_registry(brief, "fast")))
    slow = _series(generate_text(build_registry(sources, "slow")))

    assert not fast.keys() & slow.keys()
    assert fast.keys() | slow.keys() == everything.keys()
    assert {key: everything[key] for key in fast} == fast  # the brief reads give the same values
    assert {name for name, _ in fast} <= set(FAST)
    # What a node with 8 GPUs and 8 InfiniBand ports serves fast, every 2 s as shipped: the series of
    # the faults it has (2 Xids, 1 SXid) and nothing else: no device count, port state, InfiniBand
    # counter, lost-GPU, row-remap or AER series while nothing is wrong with them.
    names = collections.Counter(name for name, _ in fast)
    assert names == {"accel_gpu_xid_errors_total": 2, "accel_nvswitch_sxid_errors_total": 1}
    for counter in FAST_INFINIBAND_COUNTERS:
        assert (f"accel_infiniband_port_{counter}_total", (("device", "mlx5_0"), ("port", "1"))) in slow
    assert ("accel_pci_devices", (("vendor", "nvidia"),)) in slow
    assert any(name == "accel_infiniband_port_state" for name, _ in slow)
    assert any(
        name == "accel_pcie_aer_error_reports_total" and dict(labels)["severity"] == "nonfatal"
        for name, labels in slow
    )
    # Health series stay on the slow path, for every collector.
    assert not any(name.startswith("accel_exporter_") for name, _ in fast)
    assert {dict(labels)["collector"] for name, labels in slow if name == "accel_exporter_collector_up"} == {
        "pci",
        "kmsg",
        "infiniband",
        "neuron",
        "nvml",
    }


def test_a_fatal_aer_report_and_a_failed_row_remap_appear_on_the_fast_path(
    tmp_path: Path, nvml: tuple[FakeNvml, PynvmlReader]
) -> None:
    fake, reader = nvml
    root = tmp_path / "sys"
    shutil.copytree(GPU_NODE / "sys", root, symlinks=True)
    aer = root / "bus/pci/devices/0000:bd:01.0/0000:c3:00.0/aer_dev_fatal"
    aer.write_text(aer.read_text().replace("TOTAL_ERR_FATAL 0", "TOTAL_ERR_FATAL 1"))
    fake.gpus[2]["remapped_rows"] = [0, 1, 0, 1]
    brief = build_sources(ExporterSettings(sysfs_root=root), kmsg=None, nvml=reader, brief=True)
    fast = _series(generate_text(build_registry(brief, "fast")))
    found = {(name, dict(labels).get("gpu")): value for (name, labels), value in fast.items()}
    assert found[("accel_pcie_aer_error_reports_total", "5")] == 1
    assert found[("accel_gpu_remapped_rows_failure", "2")] == 1
    assert {key for key in found if not key[0].startswith("accel_infiniband_")} == {
        ("accel_pcie_aer_error_reports_total", "5"),
        ("accel_gpu_remapped_rows_failure", "2"),
    }


def test_the_fast_nvml_read_asks_only_for_lost_gpus_and_row_remaps(
    nvml: tuple[FakeNvml, PynvmlReader],
) -> None:
    fake, reader = nvml
    reader.read()  # identity is learnt once, by whichever read comes first
    before = fake.calls
    snapshot = reader.read(brief=True)
    asked = fake.calls - before
    assert snapshot.available
    assert [gpu.status for gpu in snapshot.gpus] == ["ok"] * 8
    assert all(gpu.remapped_rows is not None and not gpu.nvlinks for gpu in snapshot.gpus)
    assert set(asked) == {"nvmlDeviceGetCount", "nvmlDeviceGetRemappedRows"}
    assert asked["nvmlDeviceGetRemappedRows"] == 8


def test_a_lost_gpu_is_seen_by_the_fast_read(nvml: tuple[FakeNvml, PynvmlReader]) -> None:
    fake, reader = nvml
    reader.read()
    fake.gpus[4]["lost"] = True
    snapshot = reader.read(brief=True)
    assert [gpu.index for gpu in snapshot.gpus if gpu.status == "lost"] == [4]
    fast = _series(generate_text(build_registry(_nvml_only(reader, brief=True), "fast")))
    lost = {dict(labels)["gpu"]: value for (name, labels), value in fast.items() if name == "accel_gpu_lost"}
    assert lost == {"4": 1.0}


def _nvml_only(reader: PynvmlReader, *, brief: bool) -> list[Source]:
    settings = ExporterSettings(sysfs_root=Path("/nonexistent"))
    return build_sources(settings, kmsg=None, nvml=reader, brief=brief)


def test_the_brief_infiniband_read_opens_only_state_and_the_fast_counters(tmp_path: Path) -> None:
    root = tmp_path / "sys"
    shutil.copytree(GPU_NODE / "sys", root, symlinks=True)
    full = {(p.device, p.port): p for p in read_infiniband_ports(root)}
    brief = read_infiniband_ports(root, counters=FAST_INFINIBAND_COUNTERS)
    assert len(brief) == len(full) == 8
    for port in brief:
        whole = full[port.device, port.port]
        assert port.state == whole.state
        assert dict(port.counters) == {
            k: v for k, v in whole.counters.items() if k in FAST_INFINIBAND_COUNTERS
        }
        assert port.physical_state is None
        assert not port.hw_counters
    # A file the brief read does not need may be garbage: it is not even opened.
    (root / "class/infiniband/mlx5_0/ports/1/counters/symbol_error").write_text("garbage\n")
    assert read_infiniband_ports(root, counters=FAST_INFINIBAND_COUNTERS)[0].counters


def test_a_neuron_node_serves_its_ecc_kinds_fast_and_the_rest_slow(tmp_path: Path) -> None:
    root = tmp_path / "sys"
    shutil.copytree(TRN_NODE / "sys", root, symlinks=True)
    hardware = root / "devices/virtual/neuron_device/neuron0/stats/hardware"
    other = hardware / "sram_ecc_corrected"
    other.mkdir()
    (other / "total").write_text("3\n")
    (other / "present").write_text("3\n")
    for kind in ("mem_ecc_uncorrected", "sram_ecc_uncorrected", "mem_ecc_repairable_uncorrected"):
        (hardware / kind / "total").write_text("1\n")  # a kind is a series once above 0
    sources = build_sources(ExporterSettings(sysfs_root=root), kmsg=None, nvml=None)
    families = list(build_registry(sources).collect())
    neuron = "accel_neuron_sysfs_hardware_errors_total"
    fast = {s.labels["kind"] for f in cut(families, "fast") for s in f.samples if s.name == neuron}
    slow = {s.labels["kind"] for f in cut(families, "slow") for s in f.samples if s.name == neuron}
    assert fast == {"mem_ecc_uncorrected", "sram_ecc_uncorrected", "mem_ecc_repairable_uncorrected"}
    assert slow == {"sram_ecc_corrected"}
    # The other devices, with no error of any kind, serve nothing fast.
    assert {
        s.labels["neuron_device"] for f in cut(families, "fast") for s in f.samples if s.name == neuron
    } == {"0"}


@pytest.fixture
def gpu_exporter(tmp_path: Path) -> Iterator[Running]:
    kmsg = _kmsg_with_faults(tmp_path, GPU_NODE)
    running = spawn_exporter(
        kmsg=kmsg, sysfs_root=GPU_NODE / "sys", log=tmp_path / "exporter.log", flags=("--nvml=off",)
    )
    yield running
    if running.process.poll() is None:
        running.process.kill()
        running.process.wait()


def test_the_exporter_serves_both_paths_over_http(gpu_exporter: Running) -> None:
    def get(path: str) -> Series:
        with urllib.request.urlopen(f"{gpu_exporter.url}{path}", timeout=5) as reply:  # noqa: S310 -- loopback
            assert reply.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            return _series(reply.read())

    wait_until(
        lambda: any(name == "accel_gpu_xid_errors_total" for name, _ in get("/metrics/fast")), timeout=5
    )
    everything, fast, slow = get("/metrics"), get("/metrics/fast"), get("/metrics/slow")
    assert fast.keys() | slow.keys() == everything.keys()
    assert not fast.keys() & slow.keys()
    assert get("/metrics/fast/") == fast
