"""The exporter's text encoder writes exactly what prometheus_client's generate_latest writes, and the
exporter's own families (exporter.metric) hold what prometheus_client's would."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from exporter import metric
from exporter.collectors.kmsg import kmsg_metrics
from exporter.exposition import FamilySpec, encode, generate_text, go_float
from exporter.readers.kmsg import KmsgTally
from exporter.sources import ExporterSettings, build_registry, build_sources
from tests.exporter.helpers import GPU_NODE, TRN_NODE, client_metric, client_text


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
        assert encode(families) == client_text(families).encode()


def test_mig_samples_with_their_own_label_sets_encode_like_prometheus_client() -> None:
    tally = KmsgTally()
    tally.add_lines(["3,0,1,-;NVRM: Xid (PCI:0000:3b:00 GPU-I:01 GPU-CI:02): 43, pid=7, name=p, Ch 8"])
    families = kmsg_metrics(tally.snapshot(), gpu_indices={})
    assert encode(families) == client_text(families).encode()


label_values = st.text(alphabet=st.characters(codec="utf-8"), max_size=12)
values = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True), st.integers(min_value=-(2**60), max_value=2**60)
)


rows = st.lists(st.tuples(label_values, label_values, values), min_size=0, max_size=6)


def client_family(
    name: str, help_text: str, *, counter: bool, labels: list[str], samples: list[tuple[str, str, float]]
) -> Metric:
    """prometheus_client's own counter or gauge family with one sample per (label, label, value)."""
    family: Metric
    if counter:
        family = CounterMetricFamily(name, help_text, labels=labels)
    else:
        family = GaugeMetricFamily(name, help_text, labels=labels)
    for first, second, value in samples:
        family.add_metric([first, second], value)
    return family


@settings(max_examples=300, deadline=None)
@given(samples=rows, help_text=st.text(max_size=30), counter=st.booleans())
def test_any_label_values_and_numbers_encode_like_prometheus_client(
    samples: list[tuple[str, str, float]], help_text: str, counter: bool
) -> None:
    if counter:
        samples = [(a, b, abs(value) if not math.isnan(value) else value) for a, b, value in samples]
    name = "accel_test_things" if counter else "accel_test_level"
    family = client_family(name, help_text, counter=counter, labels=["a", "b"], samples=samples)
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


@settings(max_examples=300, deadline=None)
@given(samples=rows, help_text=st.text(max_size=30), counter=st.booleans())
def test_a_family_built_from_a_spec_encodes_like_prometheus_client(
    samples: list[tuple[str, str, float]], help_text: str, counter: bool
) -> None:
    spec = FamilySpec("accel_test_rows", help_text, "counter" if counter else "gauge", ["b", "a"])
    reference = client_family(
        "accel_test_rows", help_text, counter=counter, labels=["b", "a"], samples=samples
    )
    expected = generate_latest(registry_of([reference]))
    for _scrape in range(2):  # the second scrape renders from the spec's cache
        family = spec.family()
        for b, a, value in samples:
            family.add((b, a), value)
        assert encode([family]) == expected
        assert [tuple(s) for s in family.samples] == [tuple(s) for s in reference.samples]
    handed_over = tuple(family.rows)
    for _scrape in range(2):  # the second scrape gives back the text written for the same rows
        family = spec.family(handed_over)
        assert encode([family]) == expected
        assert [tuple(s) for s in family.samples] == [tuple(s) for s in reference.samples]


def test_a_family_without_labels_and_one_among_plain_families_encode_like_prometheus_client() -> None:
    spec = FamilySpec("accel_test_count", "How many.", "gauge", ())
    family = spec.family()
    family.add((), 8)
    plain = GaugeMetricFamily("accel_test_level", "x", labels=["a"])
    plain.add_metric(["1"], 2.5)
    reference = GaugeMetricFamily("accel_test_count", "How many.")
    reference.add_metric([], 8)
    assert encode([plain, family]) == generate_latest(registry_of([plain, reference]))
    assert b"accel_test_count 8.0\n" in (encode([family]) or b"")


def test_rows_handed_over_again_reuse_their_text_and_only_those_very_rows_do() -> None:
    spec = FamilySpec("accel_test_links", "x", "counter", ("link",))
    rows = ((("0",), 3), (("1",), 0))
    first = spec.family(rows).text()
    assert first.endswith('accel_test_links_total{link="0"} 3.0\naccel_test_links_total{link="1"} 0.0\n')
    assert spec.family(rows).text() is first  # not written again
    equal = ((("0",), 3), (("1",), 0.0))  # equal rows, another tuple: written again, never assumed
    assert spec.family(equal).text() is not first
    assert spec.family(equal).text() == first
    assert spec.family(((("0",), 3), (("1",), -0.0))).text().endswith('{link="1"} -0.0\n')
    grown = spec.family(rows)
    grown.add(("2",), 5)  # a family given rows and then more gets its own list; the rows stay as they were
    assert grown.text().endswith('{link="2"} 5.0\n')
    assert rows == ((("0",), 3), (("1",), 0))
    assert spec.family(rows).text() == first


def test_family_specs_refuse_what_the_text_format_would_need_to_escape() -> None:
    with pytest.raises(ValueError, match="invalid family name"):
        FamilySpec("accel-bad", "x", "gauge", ())
    with pytest.raises(ValueError, match="invalid family name"):
        FamilySpec("accel_things_total", "x", "counter", ())
    with pytest.raises(ValueError, match="invalid label name"):
        FamilySpec("accel_ok", "x", "gauge", ("__reserved",))
    with pytest.raises(ValueError, match="repeated label names"):
        FamilySpec("accel_ok", "x", "gauge", ("a", "a"))
    with pytest.raises(ValueError, match="only gauges and counters"):
        FamilySpec("accel_ok", "x", "histogram", ())  # type: ignore[arg-type]  # the mistake under test
    family = FamilySpec("accel_ok", "x", "gauge", ("a", "b")).family()
    with pytest.raises(ValueError, match="1 label values, expected"):
        family.add(("only one",), 1)
    assert family.rows == []
    with pytest.raises(TypeError, match="add\\(\\)"):
        family.samples = list(metric.GaugeMetricFamily("accel_ok", "x", value=1).samples)


def test_the_rendered_label_sets_a_spec_keeps_are_bounded() -> None:
    spec = FamilySpec("accel_test_churn", "x", "gauge", ("id",), max_cached=4)
    for scrape in range(3):
        family = spec.family()
        for series in range(10):
            family.add((f"{scrape}-{series}",), series)
        text = (encode([family]) or b"").decode()
        assert f'accel_test_churn{{id="{scrape}-9"}} 9.0\n' in text
        assert len(spec._prefixes) <= 4  # the bound is the behaviour under test


@settings(max_examples=300, deadline=None)
@given(st.integers(min_value=-(2**70), max_value=2**70))
def test_integer_values_are_written_as_go_writes_them(value: int) -> None:
    assert go_float(value) == floatToGoString(value)  # type: ignore[no-untyped-call]  # untyped upstream


# -- exporter.metric: prometheus_client's data model without prometheus_client ---------------------------


def own_family(
    name: str, help_text: str, *, counter: bool, labels: list[str], samples: list[tuple[str, str, float]]
) -> metric.Metric:
    """The exporter's own counter or gauge family, built as :func:`client_family` builds its own."""
    family: metric.GaugeMetricFamily | metric.CounterMetricFamily
    if counter:
        family = metric.CounterMetricFamily(name, help_text, labels=labels)
    else:
        family = metric.GaugeMetricFamily(name, help_text, labels=labels)
    for first, second, value in samples:
        family.add_metric([first, second], value)
    return family


@settings(max_examples=300, deadline=None)
@given(samples=rows, help_text=st.text(max_size=30), counter=st.booleans())
def test_the_exporters_own_families_hold_and_encode_what_prometheus_clients_do(
    samples: list[tuple[str, str, float]], help_text: str, counter: bool
) -> None:
    name = "accel_test_things_total" if counter else "accel_test_level"
    ours = own_family(name, help_text, counter=counter, labels=["a", "b"], samples=samples)
    theirs = client_family(name, help_text, counter=counter, labels=["a", "b"], samples=samples)
    assert (ours.name, ours.documentation, ours.type, ours.unit) == (
        theirs.name,
        theirs.documentation,
        theirs.type,
        theirs.unit,
    )
    assert [tuple(s) for s in ours.samples] == [tuple(s) for s in theirs.samples]
    expected = generate_latest(registry_of([theirs]))
    assert client_text([ours]).encode() == expected
    assert encode([ours]) == expected


class OwnFixed:
    def __init__(self, families: list[metric.Metric]) -> None:
        self.families = families

    def collect(self) -> list[metric.Metric]:
        return self.families


def test_a_registry_answers_sample_values_as_prometheus_clients_does() -> None:
    gauge = metric.GaugeMetricFamily("accel_test_level", "x", labels=["a"])
    gauge.add_metric(["1"], 2.5)
    counter = metric.CounterMetricFamily("accel_test_things", "x", value=3)
    ours = metric.CollectorRegistry()
    collector = OwnFixed([gauge, counter])
    ours.register(collector)
    theirs = registry_of([client_metric(gauge), client_metric(counter)])
    queries: list[tuple[str, dict[str, str] | None, float | None]] = [
        ("accel_test_level", {"a": "1"}, 2.5),
        ("accel_test_things_total", None, 3),
        ("accel_test_things", None, None),  # a counter's series end in _total
        ("accel_test_level", {"a": "2"}, None),
        ("accel_test_level", None, None),  # labels must match exactly
    ]
    for name, labels, expected in queries:
        assert ours.get_sample_value(name, labels) == expected
        assert theirs.get_sample_value(name, labels) == expected
    with pytest.raises(ValueError, match="already registered"):
        ours.register(collector)
    with pytest.raises(ValueError, match="only gauges and counters"):
        metric.Metric("accel_test_h", "x", "histogram")
    with pytest.raises(ValueError, match="invalid metric name"):
        metric.GaugeMetricFamily("accel-test", "x")
