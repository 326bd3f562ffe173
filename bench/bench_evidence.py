"""The evidence of a 1,000,000-record kernel-log storm on an 8-GPU node: its size and its cost.

800,000 Xid records on the 8 GPUs of examples/nodes/gpu-node-1, cycling through 12 Xid codes (more
than the 4 a device keeps groups of their own for, so the shared groups fill too) with a distinct pid
each, 50,000 NVSwitch SXid headers on 4 switches, and 150,000 unrelated records; /dev/kmsg record
format. They go through the real kernel-log path (``KmsgTally.add_text`` in 64 KiB chunks, as the
follower reads a followed file) into an ``EvidenceStore`` with a state directory, which is saved as
the follower saves it (at most once a second, and just before each write of the counts). The document
``GET /evidence`` serves is then built with the GPUs' identity from the fake NVML (h100x8).

Prints: the tally's CPU time per record without and with the evidence store, the document's size in
KiB (goal < 256 KiB), the state file's size, and the state writes made. Exits non-zero when the
document is 256 KiB or more, or when a group's ``seen`` does not add up to the records fed.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from exporter.evidence import (
    STATE_FILE_NAME,
    EvidenceSources,
    EvidenceStore,
    encode_document,
    evidence_document,
)
from exporter.readers.kmsg import KmsgTally
from exporter.readers.nvml import PynvmlReader

REPOSITORY = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPOSITORY))  # the fake NVML lives in the tests package

from tests.exporter.fake_nvml import FakeNvml  # noqa: E402  after the path above

GPU_NODE = REPOSITORY / "examples" / "nodes" / "gpu-node-1"
RECORDS = 1_000_000
CHUNK_BYTES = 65536
LIMIT_BYTES = 256 * 1024
GPUS = ("1b", "43", "52", "61", "9d", "c3", "d1", "df")
SWITCHES = ("05", "06", "07", "08")
XID_CODES = (95, 13, 31, 43, 45, 48, 63, 64, 74, 79, 94, 119)
NOISE = (
    "mlx5_core 0000:18:00.0: mlx5_fw_tracer_handle_traces:741:(pid 0): FW trace event",
    "IPv4: martian source 10.0.3.17 from 10.0.3.1, on dev eth0",
    'audit: type=1400 audit(1700000000.123:456): apparmor="DENIED" operation="open" profile="snap"',
)


def message(seq: int) -> tuple[str, str | None]:
    """The message of record ``seq`` and its fault kind (None for noise)."""
    slot = seq % 20
    if slot < 16:  # 16 in 20: an Xid
        gpu = GPUS[seq % len(GPUS)]
        code = XID_CODES[(seq // len(GPUS)) % len(XID_CODES)]
        text = f"NVRM: Xid (PCI:0000:{gpu}:00): {code}, pid={seq % 65536}, name=python3, Uncontained: FBHUB."
        return text, "xid"
    if slot == 16:  # 1 in 20: an SXid header
        switch = SWITCHES[seq // 20 % len(SWITCHES)]
        link = seq % 64
        return (
            f"nvidia-nvswitch0: SXid (PCI:0000:{switch}:00.0): 20034, Fatal, Link {link} LTSSM Fault Up",
            "sxid",
        )
    return NOISE[seq % len(NOISE)], None


def chunks(records: int) -> Iterator[str]:
    """The storm as 64 KiB chunks of complete lines."""
    lines: list[str] = []
    size = 0
    for seq in range(records):
        text, _kind = message(seq)
        line = f"3,{seq},{seq * 10},-;{text}"
        lines.append(line)
        size += len(line) + 1
        if size >= CHUNK_BYTES:
            yield "\n".join(lines)
            lines, size = [], 0
    if lines:
        yield "\n".join(lines)


def run(records: int, *, state_dir: Path | None) -> tuple[float, EvidenceStore | None, int]:
    """CPU seconds the tally took over the storm (with an evidence store when ``state_dir``), the store,
    and the state writes made."""
    texts = list(chunks(records))  # generated beforehand: not timed
    tally = KmsgTally()
    store = None
    writes = 0
    if state_dir is not None:
        boot_id = state_dir / "boot_id"
        boot_id.write_text("6f1c2d4e-0000-4000-8000-00000000bench\n")
        store = EvidenceStore(directory=state_dir, boot_id_path=boot_id)
        tally.sink = store
    last_flush = time.monotonic()
    started = time.process_time()
    for text in texts:
        tally.add_text(text)
        if store is not None:
            now = time.monotonic()
            if now - last_flush >= 1.0:  # as the follower: a flush before each write of the counts
                store.flush()
                writes += 1
                last_flush = now
    if store is not None:
        store.flush()
        writes += 1
    elapsed = time.process_time() - started
    assert tally.records == records, tally.records
    return elapsed, store, writes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--records", type=int, default=RECORDS)
    args = parser.parse_args()
    records: int = args.records

    plain, _none, _writes = run(records, state_dir=None)
    with tempfile.TemporaryDirectory() as scratch:
        state_dir = Path(scratch)
        with_evidence, store, writes = run(records, state_dir=state_dir)
        assert store is not None
        state_kib = (state_dir / STATE_FILE_NAME).stat().st_size / 1024
        fake = FakeNvml.from_fixture("h100x8")
        reader = PynvmlReader(timeout=5.0, library=fake)
        try:
            document = evidence_document(
                store, EvidenceSources(sysfs_root=GPU_NODE / "sys", nvml=reader, node="gpu-node-1")
            )
        finally:
            reader.close()
    body = encode_document(document)
    parsed = json.loads(body)
    fed = {"xid": 0, "sxid": 0}
    for seq in range(records):
        kind = message(seq)[1]
        if kind is not None:
            fed[kind] += 1
    seen = {kind: sum(g["seen"] for g in parsed["records"] if g["kind"] == kind) for kind in fed}
    seen["xid"] += parsed["records_overflow"]  # only Xid groups can run past the limit here
    kept = sum(len(g["first"]) + len(g["last"]) for g in parsed["records"])

    mix = f"{fed['xid']:,} Xid, {fed['sxid']:,} SXid, the rest noise"
    print(f"records fed:                  {records:,} ({mix})")
    print(f"tally alone:                  {plain / records * 1e6:.2f} us CPU per record")
    print(f"tally + evidence store:       {with_evidence / records * 1e6:.2f} us CPU per record")
    fault_records = fed["xid"] + fed["sxid"]
    print(f"evidence cost per fault:      {(with_evidence - plain) / fault_records * 1e6:.2f} us CPU")
    overflow = parsed["records_overflow"]
    print(f"groups / records kept:        {len(parsed['records'])} / {kept} (overflow {overflow:,})")
    print(f"evidence document:            {len(body) / 1024:.1f} KiB (goal < {LIMIT_BYTES // 1024} KiB)")
    print(f"state file:                   {state_kib:.1f} KiB, {writes} writes")
    ok = len(body) < LIMIT_BYTES and seen == fed
    if seen != fed:
        print(f"FAIL: records fed {fed}, groups saw {seen}")
    if len(body) >= LIMIT_BYTES:
        print("FAIL: the document is over the limit")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
