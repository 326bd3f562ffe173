"""Scrape cost and memory of the exporter on a node with 8 GPUs, 8 InfiniBand ports and 16 Neuron devices.

Builds that node by merging the two fixture nodes (the DGX-H100-like tree and the trn1-like tree's
Neuron devices) in a scratch directory, then:

- times in-process scrapes (``generate_latest`` over the exporter's registry, sysfs read included)
  and prints the median and p95; target: median <= 10 ms;
- starts the real exporter binary on that tree, scrapes it over HTTP 200 times, and prints its
  resident memory (VmRSS) afterwards; target: <= 50 MB.
"""

from __future__ import annotations

import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from exporter.exposition import generate_text
from exporter.readers.kmsg import KmsgFollower
from exporter.sources import ExporterSettings, build_registry, build_sources

NODES = Path(__file__).resolve().parent.parent / "examples" / "nodes"
SCRAPES = 300


def build_node(scratch: Path) -> tuple[Path, Path]:
    """A sysfs tree with both fixture nodes' accelerators, and a kernel log with some faults."""
    root = scratch / "sys"
    shutil.copytree(NODES / "gpu-node-1" / "sys", root, symlinks=True)
    neuron = NODES / "trn-node-1" / "sys" / "devices" / "virtual" / "neuron_device"
    shutil.copytree(neuron, root / "devices" / "virtual" / "neuron_device", symlinks=True)
    kmsg = scratch / "kmsg"
    text = (NODES / "gpu-node-1" / "kmsg").read_text()
    seq = max(int(m) for m in re.findall(r"^\d+,(\d+),", text, re.MULTILINE))
    for fault in (
        "NVRM: Xid (PCI:0000:9d:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
        "NVRM: Xid (PCI:0000:43:00): 13, pid=48213, name=python3, Graphics Exception",
        "NEURON_HW_ERR=DMA_ERROR instance-id=i-0 hostname=n nd-id=3 nc-id=0 action=TERMINATE_INSTANCE",
    ):
        seq += 1
        text += f"3,{seq},{seq * 1000},-;{fault}\n"
    kmsg.write_text(text)
    return root, kmsg


def in_process_scrape_ms(root: Path, kmsg: Path) -> list[float]:
    follower = KmsgFollower(kmsg)  # the production poll interval
    follower.start()
    try:
        time.sleep(0.3)
        registry = build_registry(build_sources(ExporterSettings(sysfs_root=root), kmsg=follower, nvml=None))
        body = generate_text(registry)
        for wanted in (b'xid="79"', b'neuron_device="15"', b'device="mlx5_7"'):
            assert wanted in body, wanted
        times = []
        for _ in range(SCRAPES):
            started = time.perf_counter()
            generate_text(registry)
            times.append((time.perf_counter() - started) * 1000)
        return times
    finally:
        follower.stop()


def exporter_rss_mb(root: Path, kmsg: Path, scratch: Path) -> tuple[float, int]:
    log = scratch / "exporter.log"
    argv = [
        str(Path(sys.executable).parent / "accel-health-exporter"),
        "--listen=127.0.0.1:0",
        f"--kmsg={kmsg}",
        f"--sysfs-root={root}",
        "--nvml=auto",
        f"--state-dir={scratch / 'state'}",
    ]
    with log.open("wb") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while not (found := re.findall(r"listening on (127\.0\.0\.1:\d+)", log.read_text())):
            if time.monotonic() > deadline or process.poll() is not None:
                raise RuntimeError(log.read_text())
            time.sleep(0.05)
        size = 0
        for _ in range(200):
            with urllib.request.urlopen(f"http://{found[0]}/metrics", timeout=5) as response:
                size = len(response.read())
        status = Path(f"/proc/{process.pid}/status").read_text()
        rss_kb = int(re.search(r"^VmRSS:\s+(\d+) kB", status, re.MULTILINE).group(1))  # type: ignore[union-attr]  # Linux always has VmRSS
        return rss_kb / 1024, size
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=10)


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="accel-health-bench-") as name:
        scratch = Path(name)
        root, kmsg = build_node(scratch)
        times = in_process_scrape_ms(root, kmsg)
        median = statistics.median(times)
        p95 = statistics.quantiles(times, n=20)[-1]
        rss, size = exporter_rss_mb(root, kmsg, scratch)
    print(
        f"scrape (8 GPUs, 8 IB ports, 16 Neuron devices): median {median:.2f} ms, p95 {p95:.2f} ms "
        f"over {SCRAPES} scrapes (target median <= 10 ms)"
    )
    print(f"exporter resident memory after 200 HTTP scrapes of {size} bytes: {rss:.1f} MB (target <= 50 MB)")
    return 0 if median <= 10 and rss <= 50 else 1


if __name__ == "__main__":
    sys.exit(main())
