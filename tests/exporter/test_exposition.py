"""The exporter's text encoder writes exactly what prometheus_client's generate_latest writes."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from exporter.collectors.kmsg import kmsg_metrics
from exporter.exposition import encode, generate_text, go_float
from exporter.readers.kmsg import KmsgTally
from exporter.sources import ExporterSettings, build_registry, build_sources
from tests.exporter.helpers import GPU_NODE, TRN_NODE


class Fixed(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


def registry_of(families: list[Metric]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(Fixed(families))
    return registry


def test_both_fixture_nodes_encode_byte_for_byte_like_prometheus_client() -> None:
    for node in (GPU_NODE, TRN_NODE):
        registry = build_registry(
            build_sources(ExporterSettings(sysfs_root=node / "sys"), kmsg=None, nvml=None)
        )
        families = list(registry.collect())
        assert encode(families) == generate_latest(registry_of(families))


def test_mig_samples_with_their_own_label_sets_encode_like_prometheus_client() -> None:
    tally = KmsgTally()
    tally.add_lines(["3,0,1,-;NVRM: Xid (PCI:0000:3b:00 GPU-I:01 GPU-CI:02): 43, pid=7, name=p, Ch 8"])
    families = kmsg_metrics(tally.snapshot(), gpu_indices={})
    assert encode(families) == generate_latest(registry_of(families))


label_values = st.text(alphabet=st.characters(codec="utf-8"), max_size=12)
values = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True), st.integers(min_value=-(2**60), max_value=2**60)
)


@settings(max_examples=300, deadline=None)
@given(
    samples=st.lists(st.tuples(label_values, label_values, values), min_size=0, max_size=6),
    help_text=st.text(max_size=30),
    counter=st.booleans(),
)
def test_any_label_values_and_numbers_encode_like_prometheus_client(
    samples: list[tuple[str, str, float]], help_text: str, counter: bool
) -> None:
    family: Metric
    if counter:
        family = CounterMetricFamily("accel_test_things", help_text, labels=["a", "b"])
        for a, b, value in samples:
            family.add_metric([a, b], abs(value) if not math.isnan(value) else value)
    else:
        family = GaugeMetricFamily("accel_test_level", help_text, labels=["a", "b"])
        for a, b, value in samples:
            family.add_metric([a, b], value)
    assert encode([family]) == generate_latest(registry_of([family]))


@settings(max_examples=500, deadline=None)
@given(st.floats(allow_nan=True, allow_infinity=True))
def test_values_are_written_as_go_writes_them(value: float) -> None:
    assert go_float(value) == floatToGoString(value)  # type: ignore[no-untyped-call]  # untyped upstream


def test_families_the_fast_path_does_not_cover_go_to_prometheus_client() -> None:
    with_timestamp = GaugeMetricFamily("accel_test_stamped", "x", labels=["a"])
    with_timestamp.add_metric(["1"], 2.0, timestamp=1700000000.5)
    odd_label = GaugeMetricFamily("accel_test_odd", "x", labels=["not-legacy"])
    odd_label.add_metric(["1"], 2.0)
    for family in (with_timestamp, odd_label):
        assert encode([family]) is None
        registry = registry_of([family])
        assert generate_text(registry) == generate_latest(registry)


def test_the_exporter_answers_with_the_text_format() -> None:
    settings = ExporterSettings(sysfs_root=GPU_NODE / "sys")
    registry = build_registry(build_sources(settings, kmsg=None, nvml=None))
    text = generate_text(registry).decode()
    assert '# TYPE accel_pci_devices gauge\naccel_pci_devices{vendor="nvidia"} 8.0\n' in text
