"""Scrape cost the NVML source adds on an 8-GPU node, with a fake NVML (tests/fixtures/nvml/h100x8.json).

Builds the exporter's registry for the DGX-H100-like example node twice, without and with the NVML
source (8 fake H100s: 905 series, 720 of them NVLink), and scrapes each alternately. Prints the
median added cost per scrape and its parts: the NVML read (including the fake's own bookkeeping),
turning the snapshot into families, and the text exposition of those families.

Two cases: a healthy node, whose NVLink error counters stay the same from scrape to scrape (the
exporter then hands over the previous scrape's NVLink rows and text), and the worst case, where a
counter of every GPU changes before every scrape. Target: added cost <= 5 ms.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from exporter.collectors.nvml import nvml_metrics
from exporter.exposition import generate_text
from exporter.metric import CollectorRegistry, Metric
from exporter.readers.nvml import PynvmlReader
from exporter.sources import ExporterSettings, build_registry, build_sources

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python bench/bench_nvml.py`: the fake lives in the tests package
    sys.path.insert(0, str(ROOT))
from tests.exporter.fake_nvml import FakeNvml  # noqa: E402 -- needs the path set up just above

NODE_SYSFS = ROOT / "examples" / "nodes" / "gpu-node-1" / "sys"
TARGET_MS = 5.0


class _Fixed:
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterable[Metric]:
        return self.families


def medians_ms(runs: dict[str, Callable[[], object]], *, repeats: int) -> dict[str, float]:
    """Median wall time of each run in ms; the runs alternate, so a noisy neighbour hits all alike."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            started = time.perf_counter()
            run()
            times[name].append((time.perf_counter() - started) * 1000)
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    fake = FakeNvml.from_fixture("h100x8")
    reader = PynvmlReader(library=fake)
    settings = ExporterSettings(sysfs_root=NODE_SYSFS, nvml_timeout=5.0)
    without = build_registry(build_sources(settings, kmsg=None, nvml=None))
    with_nvml = build_registry(build_sources(settings, kmsg=None, nvml=reader))
    try:
        snapshot = reader.read()
        assert snapshot.available, snapshot.reason
        assert all(gpu.status == "ok" for gpu in snapshot.gpus), snapshot
        exposed = CollectorRegistry()
        exposed.register(_Fixed(nvml_metrics(snapshot)))
        series = sum(len(family.samples) for family in nvml_metrics(snapshot))
        replays = [gpu["nvlink"]["errors"]["replay"] for gpu in fake.gpus]

        def changing() -> bytes:
            for counts in replays:  # some GPUs share one list: each still changes
                counts[0] += 1
            return generate_text(with_nvml)

        ms = medians_ms(  # a healthy node: the values stay as they are
            {
                "without": lambda: generate_text(without),
                "with": lambda: generate_text(with_nvml),
                "read": reader.read,
                "families": lambda: nvml_metrics(snapshot),
                "exposition": lambda: generate_text(exposed),
            },
            repeats=60,
        )
        worst = medians_ms({"without": lambda: generate_text(without), "changing": changing}, repeats=60)
    finally:
        reader.close()
    added = ms["with"] - ms["without"]
    changed = worst["changing"] - worst["without"]
    print(
        f"nvml, 8 fake H100s ({series} series): scrape cost added {added:.1f} ms (median; target <= "
        f"{TARGET_MS:g} ms: {'met' if added <= TARGET_MS else 'NOT met'}); parts: read {ms['read']:.1f} ms, "
        f"families {ms['families']:.1f} ms, text exposition {ms['exposition']:.1f} ms; with a counter of "
        f"every GPU changing before every scrape: {changed:.1f} ms "
        f"({'met' if changed <= TARGET_MS else 'NOT met'})"
    )


if __name__ == "__main__":
    main()
