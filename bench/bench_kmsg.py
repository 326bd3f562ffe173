"""How fast the kernel-log tally eats a flood of unrelated messages with 1% Xid lines.

Prints the tally's records/s, a bare loop's records/s (one that only splits the same records into
prefix and message) and their ratio. Target: ratio >= 0.5, so a log flood costs the exporter little
more than reading it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from exporter.readers.kmsg import KmsgTally

NOISE = (
    "EXT4-fs (nvme0n1p2): re-mounted. Opts: errors=remount-ro. Quota mode: none.",
    "IPv4: martian source 10.0.3.17 from 10.0.3.1, on dev eth0",
    'audit: type=1400 audit(1700000000.123:456): apparmor="DENIED" operation="open" profile="snap"',
    "mlx5_core 0000:18:00.0: mlx5_fw_tracer_handle_traces:741:(pid 0): FW trace event",
    "TCP: request_sock_TCP: Possible SYN flooding on port 8080. Sending cookies.",
    "usb 1-1: USB disconnect, device number 2",
)
XID = "NVRM: Xid (PCI:0000:9d:00): 13, pid=48213, name=python3, Graphics Exception: ESR 0x404600=0x80000002"


def flood(count: int) -> list[str]:
    lines = []
    for seq in range(count):
        message = XID if seq % 100 == 0 else NOISE[seq % len(NOISE)]
        lines.append(f"6,{seq},{seq * 1000},-;{message}")
    return lines


def bare_split(lines: list[str]) -> Callable[[], None]:
    def run() -> None:
        for line in lines:
            head, _, _message = line.partition(";")
            head.split(",", 2)

    return run


def tally(text: str) -> Callable[[], None]:
    """What the follower does with a chunk of a followed file (already decoded)."""

    def run() -> None:
        KmsgTally().add_text(text)

    return run


def best_seconds(runs: dict[str, Callable[[], None]], *, repeats: int = 9) -> dict[str, float]:
    """Best wall time of each run; the runs alternate, so a noisy neighbour hits both alike."""
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(repeats):
        for name, run in runs.items():
            started = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - started)
    return best


def main() -> None:
    lines = flood(200_000)
    seconds = best_seconds({"parser": tally("\n".join(lines)), "bare": bare_split(lines)})
    parser, bare = len(lines) / seconds["parser"], len(lines) / seconds["bare"]
    print(
        f"kmsg parser: {parser:.0f} records/s; bare split loop: {bare:.0f} records/s; "
        f"ratio {parser / bare:.2f}"
    )


if __name__ == "__main__":
    main()
