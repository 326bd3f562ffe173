"""The evidence of this boot (exporter.evidence): which records are kept and how many, across restarts
within a boot and not across a reboot; the devices' identity from fake NVML and the fixture sysfs
trees; and ``GET /evidence`` over a real socket, authenticated like ``GET /checks``.

The kernel-log lines come from the corpora in tests/fixtures/kmsg (as real nodes printed them) and
from the gpu-node-1 example node; NVML is the pynvml stand-in driven by tests/fixtures/nvml/h100x8.json.
"""

from __future__ import annotations

import json
import signal
import threading
import tomllib
import urllib.error
import urllib.request
from collections.abc import Iterator
from http import HTTPStatus
from pathlib import Path
from typing import Any

import pytest

from exporter.auth import BearerToken
from exporter.cli import make_handler
from exporter.evidence import (
    EXPORTER_VERSION,
    SCHEMA,
    STATE_FILE_NAME,
    EvidenceEndpoint,
    EvidenceLimits,
    EvidenceSources,
    EvidenceStore,
    check_summary,
    encode_document,
    evidence_document,
)
from exporter.metric import CollectorRegistry
from exporter.paths import is_fast
from exporter.readers.kmsg import KmsgFollower, KmsgSnapshot, KmsgStateStore, KmsgTally
from exporter.readers.nvml import PynvmlReader
from exporter.readers.sysfs import InfinibandPort
from exporter.server import Server
from exporter.sources import ExporterSettings, build_registry, build_sources
from tests.exporter.fake_nvml import FakeNvml
from tests.exporter.helpers import GPU_NODE, GPU_NODE_BUS_IDS, TRN_NODE, spawn_exporter, wait_until

KMSG_FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "kmsg"
BOOT_A = "6f1c2d4e-0000-4000-8000-00000000000a"
BOOT_B = "6f1c2d4e-0000-4000-8000-00000000000b"
XID_79 = "NVRM: Xid (PCI:0000:9d:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
TOKEN = "evidence-token"
Document = dict[str, Any]


def corpus(name: str) -> list[str]:
    text = (KMSG_FIXTURES / name).read_text()
    return [line for line in text.split("\n") if line and not line.startswith("#")]


def document_of(store: EvidenceStore, sources: EvidenceSources, *, refresh: bool = False) -> Document:
    """The evidence document as a client reads it: encoded, then parsed."""
    parsed: Document = json.loads(encode_document(evidence_document(store, sources, refresh=refresh)))
    return parsed


def kept(store: EvidenceStore) -> list[Document]:
    """The store's ``records`` as a client reads them."""
    parsed: list[Document] = json.loads(json.dumps(store.records()[0]))
    return parsed


def groups(store: EvidenceStore) -> dict[tuple[str, str, str | None], Document]:
    return {(r["kind"], r["device"], r["code"]): r for r in kept(store)}


def fed(lines: list[str], *, limits: EvidenceLimits | None = None) -> EvidenceStore:
    """An in-memory store that saw ``lines`` through a tally, line by line."""
    store = EvidenceStore(directory=None, limits=limits or EvidenceLimits())
    tally = KmsgTally()
    tally.sink = store
    tally.add_lines(lines)
    return store


@pytest.fixture
def boot_id(tmp_path: Path) -> Path:
    path = tmp_path / "boot_id"
    path.write_text(BOOT_A + "\n")
    return path


@pytest.fixture
def nvml() -> Iterator[tuple[FakeNvml, PynvmlReader]]:
    fake = FakeNvml.from_fixture("h100x8")
    reader = PynvmlReader(timeout=5.0, library=fake, event_wait_ms=20)
    yield fake, reader
    fake.release.set()
    reader.close()


# -- which records are kept -------------------------------------------------------------------------


def test_the_xid_the_fall_off_and_each_nvswitch_error_keep_their_own_line_and_kernel_time() -> None:
    store = fed(corpus("xid79-and-sxid-storm.log"))
    found = groups(store)
    assert set(found) == {
        ("xid", "0000:91:00", "79"),
        ("sxid", "0000:05:00", "20034"),
        ("sxid", "0000:06:00", "20034"),
        ("sxid", "0000:07:00", "20034"),
        ("fall_off", "0000:91:00", None),
    }
    (xid,) = found["xid", "0000:91:00", "79"]["first"]
    assert xid["line"].endswith(
        "NVRM: Xid (PCI:0000:91:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
    )
    assert xid["monotonic_us"] == 6781741548779  # the dmesg stamp of a plain-text line
    assert xid["seq"] is None
    assert xid["source"] == "kmsg"
    # An NVSwitch error is one record however many lines follow its header: only headers are kept.
    switch0 = found["sxid", "0000:05:00", "20034"]
    assert switch0["seen"] == 2
    assert all("Fatal, Link" in r["line"] for r in switch0["first"])


def test_quoted_lines_are_no_evidence_and_the_drivers_record_and_an_injection_are() -> None:
    store = fed(corpus("quoted-and-injected.kmsg"))
    found = groups(store)
    assert set(found) == {("xid", "0000:cb:00", "109"), ("sxid", "0000:cd:00", "20034")}
    xid = found["xid", "0000:cb:00", "109"]
    assert [r["seq"] for r in xid["first"]] == [4104, 4105]
    assert [r["monotonic_us"] for r in xid["first"]] == [1000400, 1000500]
    assert xid["first"][0]["line"].startswith("NVRM: Xid (PCI:0000:cb:00): 109")


def test_a_fall_off_reported_twice_at_driver_load_is_kept_once_like_it_is_counted() -> None:
    store = fed(corpus("fallen-off-bus-probe.kmsg"))
    found = groups(store)
    assert list(found) == [("fall_off", "0000:b3:00", None)]
    assert found["fall_off", "0000:b3:00", None]["seen"] == 1


def test_fatal_aer_lines_are_kept_and_corrected_ones_are_not() -> None:
    # The format strings of drivers/pci/pcie/aer.c (older and newer kernels), and the corrected-error
    # line of tests/fixtures/kmsg/fallen-off-bus-proc-kmsg.log.
    lines = [
        "4,10,5000000,-;pcieport 0000:00:03.0: AER: Multiple Corrected error received: id=0018",
        "3,11,5000100,-;pcieport 0000:97:01.0: AER: Uncorrected (Fatal) error received: 0000:9d:00.0",
        "3,12,5000200,-;nvidia 0000:9d:00.0: AER: PCIe Bus Error: severity=Uncorrected (Fatal), "
        "type=Transaction Layer, (Receiver ID)",
        "3,13,5000300,-;pcieport 0000:97:01.0: AER: Uncorrectable (Fatal) error message received from "
        "0000:9d:00.0",
    ]
    for store in (fed(lines), _fed_as_text(lines)):
        found = groups(store)
        assert list(found) == [("aer_fatal", "0000:9d:00", None)]
        assert [r["seq"] for r in found["aer_fatal", "0000:9d:00", None]["first"]] == [11, 12, 13]


def _fed_as_text(lines: list[str]) -> EvidenceStore:
    store = EvidenceStore(directory=None)
    tally = KmsgTally()
    tally.sink = store
    tally.add_text("\n".join(lines))
    return store


def test_without_a_sink_the_counts_are_exactly_what_they_were() -> None:
    lines = corpus("xid79-and-sxid-storm.log") + corpus("quoted-and-injected.kmsg")
    plain, witnessed = KmsgTally(), KmsgTally()
    witnessed.sink = EvidenceStore(directory=None)
    plain.add_lines(lines)
    witnessed.add_lines(lines)
    assert plain.snapshot() == witnessed.snapshot()


# -- bounds -----------------------------------------------------------------------------------------


def test_a_storm_keeps_the_first_and_last_five_and_counts_the_rest_dropped() -> None:
    lines = [
        f"3,{seq},{seq * 10},-;NVRM: Xid (PCI:0000:1b:00): 13, pid={seq}, name=python, Graphics SM"
        for seq in range(1000)
    ]
    xid = groups(fed(lines))["xid", "0000:1b:00", "13"]
    assert (xid["seen"], xid["dropped"]) == (1000, 990)
    assert [r["seq"] for r in xid["first"]] == [0, 1, 2, 3, 4]
    assert [r["seq"] for r in xid["last"]] == [995, 996, 997, 998, 999]


def test_past_four_codes_a_device_shares_one_group_and_past_the_group_limit_records_are_only_counted() -> (
    None
):
    lines = [
        f"3,{seq},{seq},-;NVRM: Xid (PCI:0000:1b:00): {code}, pid=1, name=x, text"
        for seq, code in enumerate([13, 31, 43, 45, 48, 63, 13])
    ]
    found = groups(fed(lines))
    assert {code for _kind, _device, code in found} == {"13", "31", "43", "45", None}
    assert found["xid", "0000:1b:00", "13"]["seen"] == 2
    shared = found["xid", "0000:1b:00", None]
    assert [r["line"].split(": ")[2].split(",")[0] for r in shared["first"]] == ["48", "63"]

    small = fed(lines, limits=EvidenceLimits(groups=2))
    records, overflow = small.records()
    assert [r["code"] for r in records] == ["13", "31"]
    assert overflow == 4


def test_long_lines_and_many_devices_still_stay_under_256_kib() -> None:
    lines = []
    seq = 0
    for device in range(64):  # more devices and codes than any node has
        for code in range(8):
            for _ in range(20):
                pci = f"0000:{device:02x}:00"
                lines.append(f"3,{seq},{seq},-;NVRM: Xid (PCI:{pci}): {code}, pid=1, name=x, {'y' * 2000}")
                seq += 1
    store = fed(lines)
    size = len(encode_document({"records": store.records()[0]}))
    assert size < 256 * 1024
    assert store.records()[1] > 0  # what did not fit is counted


def test_an_infiniband_port_whose_link_went_down_is_recorded_once_per_increase() -> None:
    store = EvidenceStore(directory=None)

    def port(value: int) -> InfinibandPort:
        return InfinibandPort("mlx5_3", "1", 1, None, None, None, {"link_downed": value})

    store.observe_infiniband([port(0)])
    store.observe_infiniband([port(0)])
    assert store.records()[0] == []
    store.observe_infiniband([port(1)])
    store.observe_infiniband([port(1)])
    store.observe_infiniband([port(3)])
    (group,) = kept(store)
    assert (group["kind"], group["device"], group["code"], group["seen"]) == (
        "ib_link_down",
        "mlx5_3",
        "1",
        2,
    )
    assert [r["line"] for r in group["first"]] == [
        "mlx5_3 port 1: counters/link_downed 0 -> 1, state 1",
        "mlx5_3 port 1: counters/link_downed 1 -> 3, state 1",
    ]
    assert all(r["source"] == "sysfs" and r["seq"] is None for r in group["first"])


# -- across restarts --------------------------------------------------------------------------------


def _follow(
    kmsg: Path, state: Path, boot_id: Path, *, records: int, seen: list[KmsgSnapshot] | None = None
) -> EvidenceStore:
    """A follower and store as the exporter builds them (exporter/cli.py), run until ``records`` were
    read, stopped; the follower's last snapshot appended to ``seen``."""
    store = EvidenceStore(directory=state, boot_id_path=boot_id)
    resumed = store.load()
    follower = KmsgFollower(
        kmsg,
        state_store=KmsgStateStore(state, boot_id_path=boot_id),
        sink=store,
        replay=not resumed,
        poll_interval=0.01,
        save_interval=0.0,
    )
    follower.start()
    try:
        assert wait_until(lambda: follower.snapshot().records == records), follower.snapshot()
    finally:
        follower.stop()
    if seen is not None:
        seen.append(follower.snapshot())
    return store


def test_a_restart_within_the_boot_keeps_the_evidence_and_takes_no_record_twice(
    tmp_path: Path, boot_id: Path
) -> None:
    kmsg, state = tmp_path / "kmsg", tmp_path / "state"
    kmsg.write_text(
        "".join(f"6,{seq},{seq * 1000},-;usb 1-1: noise {seq}\n" for seq in range(20))
        + f"3,20,20000,-;{XID_79}\n"
    )
    first = _follow(kmsg, state, boot_id, records=21)
    assert groups(first)["xid", "0000:9d:00", "79"]["seen"] == 1
    assert (state / STATE_FILE_NAME).exists()

    # The ring buffer overwrote the Xid while the exporter was down; then a second one came.
    kmsg.write_text(f"6,21,21000,-;usb 1-1: noise\n3,22,22000,-;{XID_79}\n")
    second = _follow(kmsg, state, boot_id, records=23)
    xid = groups(second)["xid", "0000:9d:00", "79"]
    assert xid["seen"] == 2
    assert [r["seq"] for r in xid["first"]] == [20, 22]

    third = _follow(kmsg, state, boot_id, records=23)  # the same ring read again: nothing new
    assert groups(third)["xid", "0000:9d:00", "79"]["seen"] == 2


def test_evidence_lost_while_the_counts_were_kept_is_taken_again_from_the_ring_buffer(
    tmp_path: Path, boot_id: Path
) -> None:
    kmsg, state = tmp_path / "kmsg", tmp_path / "state"
    kmsg.write_text(
        "".join(f"6,{seq},{seq * 1000},-;usb 1-1: noise {seq}\n" for seq in range(10))
        + f"3,10,10000,-;{XID_79}\n3,11,11000,-;{XID_79}\n"
        + "3,12,12000,-;pcieport 0000:00:01.0: AER: Uncorrectable (Fatal) error message received "
        "from 0000:9d:00.0\n"
    )
    seen: list[KmsgSnapshot] = []
    first = _follow(kmsg, state, boot_id, records=13, seen=seen)
    assert groups(first)["xid", "0000:9d:00", "79"]["seen"] == 2
    before = groups(first)

    # The evidence file is damaged (or deleted) while the exporter is down; the counts' file is not.
    (state / STATE_FILE_NAME).write_text('{"boot_id": "' + BOOT_A + '", "groups": [')
    with kmsg.open("a") as out:
        out.write(f"3,13,13000,-;{XID_79}\n")
    second = _follow(kmsg, state, boot_id, records=14, seen=seen)
    # What the ring buffer still held is evidence again, the new record too, each once ...
    xid = groups(second)["xid", "0000:9d:00", "79"]
    assert xid["seen"] == 3
    assert [r["seq"] for r in xid["first"]] == [10, 11, 13]
    assert groups(second).keys() == before.keys()
    # ... and counted once: the counts resumed from their own file, the re-read counted nothing.
    assert sum(seen[-1].xid.values()) == 3

    (state / STATE_FILE_NAME).unlink()  # gone altogether: the same
    with kmsg.open("a") as out:  # read after the re-read records: the follower is done with them
        out.write(f"3,14,14000,-;{XID_79}\n")
    third = _follow(kmsg, state, boot_id, records=15, seen=seen)
    assert [r["seq"] for r in groups(third)["xid", "0000:9d:00", "79"]["first"]] == [10, 11, 13, 14]
    assert sum(seen[-1].xid.values()) == 4


def test_a_new_boot_starts_with_no_evidence(tmp_path: Path, boot_id: Path) -> None:
    kmsg, state = tmp_path / "kmsg", tmp_path / "state"
    kmsg.write_text(f"3,0,1000,-;{XID_79}\n")
    _follow(kmsg, state, boot_id, records=1)
    boot_id.write_text(BOOT_B + "\n")
    kmsg.write_text("6,0,1000,-;usb 1-1: a new boot\n")
    store = EvidenceStore(directory=state, boot_id_path=boot_id)
    assert not store.load()
    assert store.records() == ([], 0)


def test_a_damaged_evidence_file_is_ignored_and_rewritten(tmp_path: Path, boot_id: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    (state / STATE_FILE_NAME).write_text(json.dumps({"boot_id": BOOT_A, "groups": [["xid", 7]]}))
    store = EvidenceStore(directory=state, boot_id_path=boot_id)
    assert not store.load()
    store.fault("xid", "0000:9d:00", "79", seq=3, timestamp_us=10, line=XID_79)
    assert store.save(force=True)
    again = EvidenceStore(directory=state, boot_id_path=boot_id)
    assert again.load()
    assert groups(again)["xid", "0000:9d:00", "79"]["seen"] == 1


def test_a_storm_is_written_at_most_once_a_second(tmp_path: Path, boot_id: Path) -> None:
    ticks = [100.0]
    store = EvidenceStore(directory=tmp_path, boot_id_path=boot_id, monotonic=lambda: ticks[0])
    store.fault("xid", "0000:9d:00", "79", seq=1, timestamp_us=1, line=XID_79)
    assert store.save()
    store.fault("xid", "0000:9d:00", "79", seq=2, timestamp_us=2, line=XID_79)
    assert not store.save()  # within the second: not written
    ticks[0] += 1.0
    assert store.save()
    assert json.loads((tmp_path / STATE_FILE_NAME).read_text())["last_seq"] == 2


# -- identity ---------------------------------------------------------------------------------------


def test_identity_names_each_gpu_by_serial_uuid_and_firmware(nvml: tuple[FakeNvml, PynvmlReader]) -> None:
    _fake, reader = nvml
    store = EvidenceStore(directory=None)
    document = document_of(
        store, EvidenceSources(sysfs_root=GPU_NODE / "sys", nvml=reader, node="gpu-node-1")
    )
    assert document["schema"] == SCHEMA
    assert document["node"] == "gpu-node-1"
    assert document["host"]["driver_version"] == "535.129.03"
    assert document["host"]["cuda_driver_version"] == "12.2"
    gpus = document["gpus"]
    assert [gpu["pci_bus_id"] for gpu in gpus] == list(GPU_NODE_BUS_IDS)
    assert gpus[4] == {
        "index": 4,
        "uuid": "GPU-575a9c5f-780e-558f-99bc-3b0f90f7dbd5",
        "serial": "1654923000004",
        "board_part_number": "692-2G520-0200-000",
        "vbios_version": "96.00.74.00.01",
        "inforom_image_version": "G520.0200.00.05",
        "name": "NVIDIA H100 80GB HBM3",
        "pci_bus_id": "0000:9d:00",
        "pci_device_id": "0x233010DE",
        "pci_subsystem_id": "0x16C110DE",
    }
    assert len(document["hcas"]) == 8
    assert document["hcas"][0] == {
        "device": "mlx5_0",
        "board_id": "MT_0000000838",
        "fw_ver": "28.39.1002",
        "node_guid": None,
    }
    assert document["checks"] == []


def test_a_gpu_whose_identity_calls_fail_gives_nulls_not_a_traceback(
    nvml: tuple[FakeNvml, PynvmlReader],
) -> None:
    fake, reader = nvml
    fake.gpus[2]["errors"] = {"nvmlDeviceGetSerial": "UNKNOWN", "nvmlDeviceGetVbiosVersion": "NO_PERMISSION"}
    del fake.gpus[3]["board_part_number"]  # NOT_SUPPORTED: no error, no value
    fake.gpus[5]["lost"] = True
    fake.driver_version = "UNKNOWN"
    document = document_of(
        EvidenceStore(directory=None), EvidenceSources(sysfs_root=GPU_NODE / "sys", nvml=reader)
    )
    gpus = {gpu["index"]: gpu for gpu in document["gpus"]}
    assert (gpus[2]["serial"], gpus[2]["vbios_version"], gpus[2]["uuid"]) == (
        None,
        None,
        "GPU-8b28e6ef-9616-56e8-878d-9283ebc9372f",
    )
    assert gpus[3]["board_part_number"] is None
    # NVML tells nothing of a lost GPU; the PCI bus still names it and its ids.
    assert gpus[5]["serial"] is None
    assert gpus[5]["pci_bus_id"] == "0000:c3:00"
    assert gpus[5]["pci_device_id"] == "0x233010DE"
    assert document["host"]["driver_version"] is None
    errors = reader.read().field_errors
    assert errors[("nvmlDeviceGetSerial", "unknown")] == 1
    assert errors[("nvmlSystemGetDriverVersion", "unknown")] == 1


def test_a_gpu_lost_after_start_keeps_the_serial_read_at_start(nvml: tuple[FakeNvml, PynvmlReader]) -> None:
    fake, reader = nvml
    store = EvidenceStore(directory=None)
    sources = EvidenceSources(sysfs_root=GPU_NODE / "sys", nvml=reader)
    document_of(store, sources)
    fake.gpus[4]["lost"] = True
    document = document_of(store, sources, refresh=True)
    assert document["gpus"][4]["serial"] == "1654923000004"


def test_without_nvml_the_gpus_come_from_the_pci_bus_with_their_ids() -> None:
    document = document_of(
        EvidenceStore(directory=None), EvidenceSources(sysfs_root=GPU_NODE / "sys", nvml=None)
    )
    assert [gpu["index"] for gpu in document["gpus"]] == list(range(8))
    assert document["gpus"][0]["serial"] is None
    assert document["gpus"][0]["pci_device_id"] == "0x233010DE"
    assert document["host"]["driver_version"] is None


def test_a_neuron_node_lists_its_devices() -> None:
    document = document_of(
        EvidenceStore(directory=None), EvidenceSources(sysfs_root=TRN_NODE / "sys", nvml=None)
    )
    assert len(document["neuron_devices"]) == 16
    assert document["neuron_devices"][0]["neuron_device"] == "0"
    assert len(document["neuron_pci_devices"]) == 16
    assert document["gpus"] == []
    assert document["hcas"] == []


def test_identity_is_an_info_series_on_the_slow_path_read_from_nvml_once(
    nvml: tuple[FakeNvml, PynvmlReader],
) -> None:
    fake, reader = nvml
    settings = ExporterSettings(sysfs_root=GPU_NODE / "sys")
    registry = build_registry(build_sources(settings, kmsg=None, nvml=reader), "slow")
    labels = {
        "gpu": "4",
        "pci_bus_id": "0000:9d:00",
        "uuid": "GPU-575a9c5f-780e-558f-99bc-3b0f90f7dbd5",
        "serial": "1654923000004",
        "board_part_number": "692-2G520-0200-000",
        "vbios_version": "96.00.74.00.01",
        "inforom_image_version": "G520.0200.00.05",
        "driver_version": "535.129.03",
    }
    assert registry.get_sample_value("accel_gpu_identity_info", labels) == 1
    assert not is_fast("accel_gpu_identity_info", labels)
    registry.get_sample_value("accel_gpu_identity_info", labels)
    assert fake.calls["nvmlDeviceGetSerial"] == 8  # once per GPU, not once per scrape


def test_the_checks_latest_results_are_listed() -> None:
    summary = check_summary(
        check="pciebw",
        verdict="fail",
        message="GPU 2 moves 5.3 GB/s",
        started=1_700_000_000.0,
        duration=2.5,
        devices=[
            {"device": "2", "pci_bus_id": "0000:52:00", "verdict": "fail", "detail": "slow"},
            {"device": "3", "pci_bus_id": "0000:61:00", "verdict": "pass", "detail": ""},
        ],
    )
    sources = EvidenceSources(sysfs_root=GPU_NODE / "sys", nvml=None, checks=lambda: [summary])
    (listed,) = document_of(EvidenceStore(directory=None), sources)["checks"]
    assert listed["finished_at"] == "2023-11-14T22:13:22.500000Z"
    assert [device["device"] for device in listed["devices"]] == ["2"]


# -- GET /evidence ----------------------------------------------------------------------------------


def _serve(endpoint: EvidenceEndpoint) -> Iterator[str]:
    server = Server(("127.0.0.1", 0), make_handler(CollectorRegistry(), evidence=endpoint))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    host, port = server.server_address[:2]
    try:
        yield f"http://{host!s}:{port}/evidence"
    finally:
        server.shutdown()
        server.server_close()


def get(url: str, token: str | None = None) -> tuple[int, dict[str, str], Document]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    request = urllib.request.Request(url, headers=headers)  # noqa: S310 -- loopback URL
    try:
        with urllib.request.urlopen(request, timeout=5) as response:  # noqa: S310 -- loopback URL
            return response.status, dict(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), json.loads(exc.read())


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    return path


@pytest.fixture
def evidence_url(token_file: Path) -> Iterator[str]:
    store = fed([f"3,5,9000000,-;{XID_79}"])
    endpoint = EvidenceEndpoint(
        store, EvidenceSources(sysfs_root=GPU_NODE / "sys", nvml=None), BearerToken(token_file=token_file)
    )
    yield from _serve(endpoint)


def test_evidence_is_served_with_the_checks_token(evidence_url: str) -> None:
    status, headers, document = get(evidence_url, TOKEN)
    assert status == HTTPStatus.OK
    assert headers["Content-Type"] == "application/json"
    (xid,) = document["records"]
    assert (xid["kind"], xid["device"], xid["code"], xid["seen"], xid["dropped"]) == (
        "xid",
        "0000:9d:00",
        "79",
        1,
        0,
    )
    assert xid["first"][0]["line"] == XID_79
    assert xid["first"][0]["monotonic_us"] == 9000000
    assert xid["first"][0]["time"].endswith("Z")


def test_evidence_without_or_with_a_wrong_token_is_refused(evidence_url: str) -> None:
    for token in (None, "wrong"):
        status, headers, document = get(evidence_url, token)
        assert status == HTTPStatus.UNAUTHORIZED
        assert headers["WWW-Authenticate"] == 'Bearer realm="accel-health"'
        assert document == {"error": "missing or wrong bearer token"}


def test_evidence_is_unavailable_while_the_token_file_is_empty(evidence_url: str, token_file: Path) -> None:
    token_file.write_text("")
    status, _headers, document = get(evidence_url, TOKEN)
    assert status == HTTPStatus.SERVICE_UNAVAILABLE
    assert "holds a token" in document["error"]


def test_evidence_is_not_served_where_no_token_is_configured() -> None:
    endpoint = EvidenceEndpoint(
        EvidenceStore(directory=None), EvidenceSources(sysfs_root=GPU_NODE / "sys", nvml=None), None
    )
    for url in _serve(endpoint):
        status, _headers, document = get(url, TOKEN)
        assert status == HTTPStatus.NOT_FOUND
        assert "--checks-token-file" in document["error"]


@pytest.mark.skipif(not Path("/proc/sys/kernel/random/boot_id").exists(), reason="needs a Linux boot id")
def test_the_exporter_process_serves_an_xid_line_and_keeps_it_across_a_restart(
    tmp_path: Path, token_file: Path
) -> None:
    kmsg, state, log = tmp_path / "kmsg", tmp_path / "state", tmp_path / "exporter.log"
    kmsg.write_text((GPU_NODE / "kmsg").read_text())
    flags = (
        "--nvml=off",
        f"--state-dir={state}",
        f"--checks-token-file={token_file}",
        "--node-name=gpu-node-1",
    )

    def xid_lines(url: str) -> list[str]:
        _status, _headers, document = get(url + "/evidence", TOKEN)
        return [r["line"] for group in document["records"] for r in group["first"] if group["kind"] == "xid"]

    first = spawn_exporter(kmsg=kmsg, sysfs_root=GPU_NODE / "sys", log=log, flags=flags)
    try:
        with kmsg.open("a") as out:
            out.write(f"3,55,9000000,-;{XID_79}\n")
        assert wait_until(lambda: xid_lines(first.url) == [XID_79], timeout=5)
        _status, _headers, document = get(first.url + "/evidence", TOKEN)
        assert document["node"] == "gpu-node-1"
        assert document["boot_id"]
        assert [gpu["pci_bus_id"] for gpu in document["gpus"]][4] == "0000:9d:00"
    finally:
        first.process.send_signal(signal.SIGTERM)
        assert first.process.wait(timeout=10) == 0

    kmsg.write_text("6,60,9500000,-;usb 1-1: the ring buffer moved on\n")
    second = spawn_exporter(kmsg=kmsg, sysfs_root=GPU_NODE / "sys", log=log, flags=flags)
    try:
        assert xid_lines(second.url) == [XID_79]
        assert get(second.url + "/evidence")[0] == HTTPStatus.UNAUTHORIZED
    finally:
        second.process.send_signal(signal.SIGTERM)
        assert second.process.wait(timeout=10) == 0


def test_the_version_the_document_names_is_the_packages() -> None:
    """EXPORTER_VERSION is written out (reading the package metadata would load `email`): it must
    follow pyproject.toml's version."""
    project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    assert project["project"]["version"] == EXPORTER_VERSION
