"""An Xid storm: 1,000,000 kernel-log records, as a node with a failing GPU prints them.

Shaped after NVSentinel #1120 (a node logged ~800K Xid 95 lines, 29 distinct): 800,000 Xid 95
records cycling through 29 distinct driver lines on 8 GPUs (the line format is the driver's, as
NVIDIA's open kernel modules document it in their error-containment comments), interleaved with
200,000 unrelated records. Fed twice, each in a fresh process so peak memory is its own:

- ``file``: chunks of 64 KiB text through ``KmsgTally.add_text``, as the follower reads a followed file;
- ``device``: one record per ``KmsgTally.add_lines`` call, as it reads /dev/kmsg (one record per read).

Prints, per path: records/s and CPU microseconds per record of the tally alone (generating the records
is not timed), resident memory after 100,000 records and after all of them, and the peak (ru_maxrss).
Exits non-zero when a count is not exact.
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from exporter.readers.kmsg import KmsgTally

RECORDS = 1_000_000
XID_EVERY = 5
"""Four records in five are Xid 95 records: 800,000 of 1,000,000."""
CHUNK_BYTES = 65536
GPUS = tuple(f"0000:{bus}:00" for bus in ("18", "2a", "3a", "5d", "9a", "ab", "ba", "db"))
DETAILS = (
    "Uncontained: FBHUB. RST: Yes, D-RST: No",
    "Uncontained: LTC TAG (0x2,0x1). RST: Yes, D-RST: No",
    "Uncontained: LTC TAG (0x2,0x0). RST: Yes, D-RST: No",
    "Uncontained: FBHUB. RST: Yes, D-RST: No",
)
NOISE = (
    "mlx5_core 0000:18:00.0: mlx5_fw_tracer_handle_traces:741:(pid 0): FW trace event",
    "IPv4: martian source 10.0.3.17 from 10.0.3.1, on dev eth0",
    'audit: type=1400 audit(1700000000.123:456): apparmor="DENIED" operation="open" profile="snap"',
)


def distinct_lines() -> list[tuple[str, str]]:
    """29 distinct (pci, message) Xid 95 lines over 8 GPUs."""
    lines = []
    for index in range(29):
        pci = GPUS[index % len(GPUS)]
        detail = DETAILS[index % len(DETAILS)]
        lines.append((pci, f"NVRM: Xid (PCI:{pci}): 95, pid={7000 + index}, name=python3, {detail}"))
    return lines


XIDS = distinct_lines()


def record(seq: int) -> tuple[str, str | None]:
    """The record with this sequence number and the GPU of its Xid (None for noise)."""
    if seq % XID_EVERY:
        pci, message = XIDS[seq % len(XIDS)]
        return f"3,{seq},{seq * 50},-;{message}", pci
    return f"6,{seq},{seq * 50},-;{NOISE[seq % len(NOISE)]}", None


def expected_counts() -> dict[str, int]:
    counts: dict[str, int] = {}
    for seq in range(RECORDS):
        _, pci = record(seq)
        if pci is not None:
            counts[pci] = counts.get(pci, 0) + 1
    return counts


def chunks() -> Iterator[str]:
    """The records as text chunks of about CHUNK_BYTES, whole lines only."""
    lines: list[str] = []
    size = 0
    for seq in range(RECORDS):
        line = record(seq)[0]
        lines.append(line)
        size += len(line) + 1
        if size >= CHUNK_BYTES:
            yield "\n".join(lines)
            lines, size = [], 0
    if lines:
        yield "\n".join(lines)


def rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def run(mode: str) -> int:
    tally = KmsgTally()
    wall = cpu = 0.0
    rss_early = 0
    if mode == "file":
        for text in chunks():
            started, started_cpu = time.perf_counter(), time.process_time()
            tally.add_text(text)
            wall += time.perf_counter() - started
            cpu += time.process_time() - started_cpu
            if not rss_early and tally.records >= 100_000:
                rss_early = rss_kib()
    else:
        for seq in range(RECORDS):
            line = (record(seq)[0],)
            started, started_cpu = time.perf_counter(), time.process_time()
            tally.add_lines(line)
            wall += time.perf_counter() - started
            cpu += time.process_time() - started_cpu
            if seq == 99_999:
                rss_early = rss_kib()
    rss_end = rss_kib()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    snapshot = tally.snapshot()
    got = {pci: count for (pci, xid, _, _), count in snapshot.xid.items() if xid == 95}
    exact = snapshot.records == RECORDS and snapshot.missed == 0 and got == expected_counts()
    print(
        f"{mode:6}: {RECORDS / wall:>9,.0f} records/s, {cpu / RECORDS * 1e6:.2f} us CPU/record; "
        f"RSS {rss_early / 1024:.1f} MiB after 100k, {rss_end / 1024:.1f} MiB after 1M, "
        f"peak {peak / 1024:.1f} MiB; counts {'exact' if exact else 'WRONG'} "
        f"({sum(got.values()):,} Xid 95 records on {len(got)} GPUs)"
    )
    return 0 if exact else 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--mode", choices=("file", "device"))
    mode = parser.parse_args().mode
    if mode is not None:
        sys.exit(run(mode))
    xids = RECORDS - RECORDS // XID_EVERY
    print(f"kmsg storm: {RECORDS:,} records, {xids:,} of them Xid 95 ({len(XIDS)} distinct)")
    failed = 0
    for each in ("file", "device"):
        failed |= subprocess.run([sys.executable, __file__, f"--mode={each}"], check=False).returncode
    sys.exit(failed)


if __name__ == "__main__":
    main()
