"""Kernel-log parsing: records, every Xid variant, SXid, NEURON_HW_ERR, UUID lines, fallen off the bus.

Pure functions and the tally only; no files or threads here.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from exporter.readers.kmsg import (
    FallenOffBusEvent,
    GpuUuidEvent,
    KmsgDecoder,
    KmsgRecord,
    KmsgTally,
    NeuronHwErrorEvent,
    SxidEvent,
    XidEvent,
    normalise_pci_bus_id,
    parse_message,
    parse_record,
)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("0000:91:00", "0000:91:00"),
        ("00000000:91:00.0", "0000:91:00"),
        ("0000:B3:00.0", "0000:b3:00"),
        ("91:00.0", "0000:91:00"),
    ],
)
def test_pci_bus_ids_are_normalised_to_domain_bus_device(raw: str, expected: str) -> None:
    assert normalise_pci_bus_id(raw) == expected


@pytest.mark.parametrize("raw", ["", "zz:00", "0000:91", "0000:100:00"])
def test_text_that_is_no_pci_address_is_rejected(raw: str) -> None:
    with pytest.raises(ValueError, match="PCI address"):
        normalise_pci_bus_id(raw)


def test_a_kmsg_record_splits_into_priority_sequence_timestamp_and_message() -> None:
    record = parse_record("3,1042,8123456789,-;NVRM: GPU at PCI:0000:91:00: GPU-1\n SUBSYSTEM=pci\n")
    assert record == KmsgRecord(
        message="NVRM: GPU at PCI:0000:91:00: GPU-1", priority=3, seq=1042, timestamp_us=8123456789
    )


def test_a_plain_text_line_is_taken_whole_as_the_message() -> None:
    assert parse_record("[ 12.3] usb 1-1: new device; fine") == KmsgRecord(
        message="[ 12.3] usb 1-1: new device; fine"
    )


XID_LINES = [
    pytest.param(
        "NVRM: Xid (PCI:0000:05:00): 79, pid=1173, GPU has fallen off the bus.",
        XidEvent(pci_bus_id="0000:05:00", xid=79, pid="1173", detail="GPU has fallen off the bus."),
        id="old driver, no name",
    ),
    pytest.param(
        "NVRM: Xid (PCI:0000:91:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
        XidEvent(
            pci_bus_id="0000:91:00",
            xid=79,
            pid="<unknown>",
            process_name="<unknown>",
            detail="GPU has fallen off the bus.",
        ),
        id="unknown pid",
    ),
    pytest.param(
        "NVRM: Xid (PCI:0000:44:00): 79, GPU has fallen off the bus",
        XidEvent(pci_bus_id="0000:44:00", xid=79, detail="GPU has fallen off the bus"),
        id="no pid",
    ),
    pytest.param(
        "NVRM: Xid (PCI:0000:01:00): 154, GPU recovery action changed from 0x0 (None) to 0x2 "
        "(Node Reboot Required)",
        XidEvent(
            pci_bus_id="0000:01:00",
            xid=154,
            detail="GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)",
        ),
        id="free text",
    ),
    pytest.param(
        "NVRM: Xid (PCI:0000:3b:00): 45, pid=2231, name=python3, Ch 00000001 caused by previous Xid 149",
        XidEvent(
            pci_bus_id="0000:3b:00",
            xid=45,
            pid="2231",
            process_name="python3",
            detail="Ch 00000001 caused by previous Xid 149",
            caused_by_xid=149,
        ),
        id="chained",
    ),
    pytest.param(
        "NVRM: Xid (PCI:0000:B3:00 GPU-I:01): 31, pid=8812, name=python, Ch 00000008, intr 00000000",
        XidEvent(
            pci_bus_id="0000:b3:00",
            xid=31,
            gpu_instance=1,
            pid="8812",
            process_name="python",
            detail="Ch 00000008, intr 00000000",
        ),
        id="MIG GPU instance",
    ),
    pytest.param(
        "NVRM: Xid (PCI:0000:b3:00 GPU-I:02 GPU-CI:03): 43, pid=9, name=train, Ch 00000010",
        XidEvent(
            pci_bus_id="0000:b3:00",
            xid=43,
            gpu_instance=2,
            compute_instance=3,
            pid="9",
            process_name="train",
            detail="Ch 00000010",
        ),
        id="MIG compute instance",
    ),
    pytest.param(
        "[ 8123.456789] NVRM: Xid (0000:02:00): 13, Graphics Exception",
        XidEvent(pci_bus_id="0000:02:00", xid=13, detail="Graphics Exception"),
        id="dmesg text, ancient format without PCI:",
    ),
]


@pytest.mark.parametrize(("message", "expected"), XID_LINES)
def test_every_xid_variant_parses_to_its_gpu_and_number(message: str, expected: XidEvent) -> None:
    assert parse_message(message) == expected


def test_an_nvswitch_sxid_line_parses_to_its_switch_and_number() -> None:
    message = (
        "nvidia-nvswitch3: SXid (PCI:0000:05:00.0): 12028, Non-fatal, Link 32 egress non-posted PRIV error"
    )
    assert parse_message(message) == SxidEvent(
        pci_bus_id="0000:05:00", sxid=12028, detail="Non-fatal, Link 32 egress non-posted PRIV error"
    )


def test_a_neuron_hardware_error_names_its_kind_and_device() -> None:
    message = (
        "NEURON_HW_ERR=HBM_UNCORRECTABLE_ERROR instance-id=i-0abc hostname=trn-1 nd-id=7 nc-id=1 "
        "serial-num=0x4f2a action=TERMINATE_INSTANCE"
    )
    assert parse_message(message) == NeuronHwErrorEvent(error="HBM_UNCORRECTABLE_ERROR", neuron_device="7")


def test_the_aws_neuron_test_line_counts_with_an_empty_device() -> None:
    assert parse_message("test NEURON_HW_ERR=DMA_ERROR test") == NeuronHwErrorEvent(
        error="DMA_ERROR", neuron_device=""
    )


def test_the_driver_load_line_maps_a_pci_bus_id_to_a_gpu_uuid() -> None:
    message = "NVRM: GPU at PCI:0000:91:00: GPU-6d2f4c1a-0b3e-4f5a-9c8d-7e6f5a4b3c2d"
    assert parse_message(message) == GpuUuidEvent(
        pci_bus_id="0000:91:00", uuid="GPU-6d2f4c1a-0b3e-4f5a-9c8d-7e6f5a4b3c2d"
    )


@pytest.mark.parametrize(
    "message",
    [
        "NVRM: loading NVIDIA UNIX Open Kernel Module for x86_64  535.129.03",
        "usb 1-1: new high-speed USB device number 2 using xhci_hcd",
        "NVRM: Xid (PCI:nonsense): 79, broken",
        "",
    ],
)
def test_unrelated_or_broken_messages_report_nothing(message: str) -> None:
    assert parse_message(message) is None


def test_the_three_line_fallen_off_the_bus_message_becomes_one_event() -> None:
    decoder = KmsgDecoder()
    events = [
        decoder.feed("NVRM: The NVIDIA GPU 0000:b3:00.0"),
        decoder.feed("NVRM: (PCI ID: 10de:26b5) installed in this system has"),
        decoder.feed("NVRM: fallen off the bus and is not responding to commands."),
    ]
    assert events == [None, None, FallenOffBusEvent(pci_bus_id="0000:b3:00")]


def test_a_fallen_off_the_bus_message_without_its_first_line_still_counts() -> None:
    event = KmsgDecoder().feed("NVRM: fallen off the bus and is not responding to commands.")
    assert event == FallenOffBusEvent(pci_bus_id="")


def test_the_tally_counts_records_events_and_sequence_gaps() -> None:
    tally = KmsgTally()
    tally.add_lines(
        [
            "6,0,0,-;Linux version 6.1",
            "6,1,10,-;pci 0000:91:00.0: [10de:2330] type 00 class 0x030200",
            " SUBSYSTEM=pci",
            "3,2,20,-;NVRM: Xid (PCI:0000:91:00): 79, pid='<unknown>', name=<unknown>, GPU has fell off.",
            "3,5,30,-;NVRM: Xid (PCI:0000:91:00): 79, GPU has fallen off the bus",
            "4,6,40,-;test NEURON_HW_ERR=DMA_ERROR test",
        ]
    )
    snapshot = tally.snapshot()
    assert snapshot.records == 5
    assert snapshot.missed == 2
    assert dict(snapshot.xid) == {("0000:91:00", 79, "", ""): 2}
    assert dict(snapshot.neuron_hw_errors) == {("", "DMA_ERROR"): 1}


def test_records_gone_before_the_first_one_read_count_as_missed() -> None:
    tally = KmsgTally()
    tally.add_lines(["6,100,5,-;first surviving record"])
    assert tally.snapshot().missed == 100


@given(st.text())
def test_the_parser_never_raises_on_arbitrary_text(text: str) -> None:
    parse_message(text)
    parse_record(text)
    KmsgDecoder().feed(text)
    KmsgTally().add_lines(text.split("\n"))
    KmsgTally().add_text(text)


@given(
    st.sampled_from(["NVRM: Xid (PCI:", "SXid (PCI:", "NVRM: GPU at PCI:", "NVRM: The NVIDIA GPU "]),
    st.text(alphabet="0123456789abcdefABCDEF:.() ,-GPUIC", max_size=40),
)
def test_the_parser_never_raises_on_lines_that_almost_match(prefix: str, rest: str) -> None:
    parse_message(prefix + rest)
    KmsgDecoder().feed(prefix + rest)


def test_an_xid_line_with_an_impossible_pci_address_reports_nothing() -> None:
    assert parse_message("NVRM: Xid (PCI:0000:91:ff): 79, GPU has fallen off the bus") is None


_MESSAGES = st.sampled_from(
    [
        "usb 1-1: new high-speed USB device",
        "NVRM: Xid (PCI:0000:9d:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
        "NVRM: Xid (PCI:0000:43:00): 13, pid=1, name=python3, Graphics Exception",
        "nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 12028, Non-fatal",
        "NEURON_HW_ERR=DMA_ERROR nd-id=3",
        "NVRM: The NVIDIA GPU 0000:b3:00.0",
        "NVRM: fallen off the bus and is not responding to commands.",
        "NVRM: GPU at PCI:0000:1b:00: GPU-0a1b",
    ]
)


@given(
    st.lists(
        st.tuples(st.integers(min_value=1, max_value=3), _MESSAGES, st.booleans()), min_size=1, max_size=40
    ),
    st.integers(min_value=0, max_value=5),
)
def test_the_fast_chunk_path_counts_exactly_like_the_line_by_line_path(
    records: list[tuple[int, str, bool]], start: int
) -> None:
    lines: list[str] = []
    seq = start
    for step, message, continued in records:
        lines.append(f"6,{seq},{seq * 10},-;{message}")
        if continued:
            lines.append(" SUBSYSTEM=pci")
        seq += step
    by_line, by_chunk = KmsgTally(), KmsgTally()
    by_line.add_lines(lines)
    half = len(lines) // 2
    by_chunk.add_text("\n".join(lines[:half]))
    by_chunk.add_text("\n".join(lines[half:]))
    assert by_chunk.snapshot() == by_line.snapshot()


@pytest.mark.parametrize(
    "message",
    [
        "somecheck[1234]: GPU 0 unhealthy: NVRM: Xid (PCI:0000:9d:00): 119, pid=1, name=x, Timeout",
        "kernel[4242]: NVRM: Xid (PCI:0000:9d:00): 79, GPU has fallen off the bus.",
        "host gpud[2211]: known sxid: nvidia-nvswitch1: SXid (PCI:0000:84:00.0): 12028, Non-fatal",
        "watchdog: saw 'NVRM: GPU at 0000:01:00.0 has fallen off the bus.'",
    ],
)
def test_a_line_that_quotes_the_driver_reports_nothing(message: str) -> None:
    assert parse_message(message) is None
    assert KmsgDecoder().feed(message) is None


@pytest.mark.parametrize(
    "message",
    [
        "NVRM: Xid (PCI:0000:9d:00): 79, GPU has fallen off the bus.",
        "[ 4564.303884] NVRM: Xid (PCI:0000:9d:00): 79, GPU has fallen off the bus.",
        "<4>[ 4564.303884] NVRM: Xid (PCI:0000:9d:00): 79, GPU has fallen off the bus.",
        "Nov  5 22:36:51 gpu-node-1 kernel: [ 4564.303884] NVRM: Xid (PCI:0000:9d:00): 79, GPU has fallen",
        "2026-09-14T20:30:27-0400 gpu-node-1 kernel: NVRM: Xid (PCI:0000:9d:00): 79, GPU has fallen off",
    ],
)
def test_the_drivers_line_counts_bare_or_as_dmesg_and_syslog_print_it(message: str) -> None:
    event = parse_message(message)
    assert isinstance(event, XidEvent)
    assert (event.pci_bus_id, event.xid) == ("0000:9d:00", 79)


def test_a_record_says_whether_the_kernel_or_a_process_wrote_it() -> None:
    assert parse_record("3,1,2,-;NVRM: Xid (PCI:0000:9d:00): 79, x").facility == 0
    assert parse_record("12,1,2,-;NVRM: Xid (PCI:0000:9d:00): 79, x").facility == 1
    assert parse_record("NVRM: Xid (PCI:0000:9d:00): 79, x").facility is None


@pytest.mark.parametrize(
    ("message", "pci"),
    [
        ("NVRM: GPU at 0000:01:00.0 has fallen off the bus.", "0000:01:00"),
        ("NVRM: GPU 0000:91:00.0: GPU has fallen off the bus.", "0000:91:00"),
    ],
)
def test_the_single_fall_off_lines_of_older_and_current_drivers_name_their_gpu(
    message: str, pci: str
) -> None:
    assert parse_message(message) == FallenOffBusEvent(pci_bus_id=pci)


def test_the_sxid_records_after_an_errors_header_report_nothing() -> None:
    prefix = "nvidia-nvswitch3: SXid (PCI:0000:08:00.0): 22013, "
    assert parse_message(prefix + "Severity 0 Engine instance 60 Sub-engine instance 00") is None
    assert parse_message(prefix + "Data {0x0000003c, 0x0000003c, 0x00000000}") is None
    assert parse_message(prefix + "Non-fatal, Link 60 Minion Link DLREQ interrupt") == SxidEvent(
        pci_bus_id="0000:08:00", sxid=22013, detail="Non-fatal, Link 60 Minion Link DLREQ interrupt"
    )


FELL_OFF = "4,{seq},{seq}000,-;NVRM: GPU at 0000:01:00.0 has fallen off the bus."
NAMED = "6,{seq},{seq}000,-;NVRM: GPU at PCI:0000:01:00: GPU-435cb66f-d89f-a234-9414-70b032521666"


def test_a_gpu_falls_off_again_only_after_the_driver_named_it_again() -> None:
    tally = KmsgTally()
    tally.add_lines([FELL_OFF.format(seq=0), FELL_OFF.format(seq=1), FELL_OFF.format(seq=2)])
    assert dict(tally.snapshot().fallen_off_bus) == {"0000:01:00": 1}
    tally.add_lines([NAMED.format(seq=3), FELL_OFF.format(seq=4), FELL_OFF.format(seq=5)])
    assert dict(tally.snapshot().fallen_off_bus) == {"0000:01:00": 2}


def test_a_restart_that_resumes_the_saved_state_does_not_count_the_same_fall_off_again() -> None:
    tally = KmsgTally()
    tally.add_lines([FELL_OFF.format(seq=0)])
    resumed = KmsgTally.from_state(tally.to_state())
    resumed.add_lines([FELL_OFF.format(seq=0), FELL_OFF.format(seq=1)])
    assert dict(resumed.snapshot().fallen_off_bus) == {"0000:01:00": 1}
