"""InfiniBand ports -> state, physical state, rate and one counter family per port counter.

Counter names: ``accel_infiniband_port_<counter>_total``, with a leading ``port_`` of the sysfs name
dropped (``port_rcv_errors`` -> ``accel_infiniband_port_rcv_errors_total``) and ``_bytes`` added to the
data counters, which are exported in bytes (``accel_infiniband_port_rcv_data_bytes_total``).
``accel_infiniband_port_events_seen_total{device, port, counter}``: the rises of the counters whose
first increase cordons, as :class:`exporter.rises.CounterRises` saw them (a series once there was one),
and ``accel_infiniband_port_events_last_rise_age_seconds{device, port, counter}``, how long ago each
last rose (this boot, on the monotonic clock).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from exporter.exposition import Family, FamilySpec
from exporter.metric import Metric
from exporter.readers.sysfs import InfinibandDevice, InfinibandPort
from exporter.rises import Key

_BYTE_COUNTERS = frozenset({"port_rcv_data", "port_xmit_data"})
_UNSAFE = re.compile(r"[^a-z0-9_]")
_PORT = ("device", "port")

DEVICE_INFO = FamilySpec(
    "accel_infiniband_device_info",
    "1 per InfiniBand adapter, with its firmware version, board id and adapter type.",
    "gauge",
    ("device", "fw_ver", "board_id", "hca_type"),
)
DRIVER_EVENTS = FamilySpec(
    "accel_infiniband_port_driver_events",
    "The adapter driver's own port counters (sysfs hw_counters/<counter>), by counter name.",
    "counter",
    (*_PORT, "counter"),
)
STATE = FamilySpec(
    "accel_infiniband_port_state",
    "Logical port state: 1 down, 2 init, 3 armed, 4 active, 5 active-defer.",
    "gauge",
    _PORT,
)
PHYSICAL_STATE = FamilySpec(
    "accel_infiniband_port_physical_state",
    "Physical port state, e.g. 2 polling, 3 disabled, 5 link up.",
    "gauge",
    _PORT,
)
RATE = FamilySpec("accel_infiniband_port_rate_bytes_per_second", "Port data rate.", "gauge", _PORT)
PORT_INFO = FamilySpec(
    "accel_infiniband_port_info", "1 per port, with its link layer.", "gauge", (*_PORT, "link_layer")
)
EVENTS_SEEN = FamilySpec(
    "accel_infiniband_port_events_seen",
    "How much the port's counter (sysfs counters/<counter>) rose while the exporter watched it, this "
    "boot: its first reading and a reset's new value are history. A series once the counter rose.",
    "counter",
    (*_PORT, "counter"),
)
LAST_RISE_AGE = FamilySpec(
    "accel_infiniband_port_events_last_rise_age_seconds",
    "Seconds since the exporter last saw the port's counter rise, this boot (the system's monotonic "
    "clock, so neither another boot nor the node's wall clock enters it). A series once it rose.",
    "gauge",
    (*_PORT, "counter"),
)
_COUNTERS: dict[str, FamilySpec] = {}
"""sysfs counter file name -> its family's spec, made on first sight (a few dozen names at most)."""


def counter_metric_name(counter: str) -> str:
    """The metric name (without ``_total``) for a sysfs counter file name."""
    name = _UNSAFE.sub("_", counter.lower()).removeprefix("port_")
    if counter in _BYTE_COUNTERS:
        name += "_bytes"
    return f"accel_infiniband_port_{name}"


def _counter_spec(counter: str) -> FamilySpec:
    spec = _COUNTERS.get(counter)
    if spec is None:
        if len(_COUNTERS) >= 1024:  # a driver inventing names forever: start again rather than grow
            _COUNTERS.clear()
        spec = _COUNTERS[counter] = FamilySpec(
            counter_metric_name(counter),
            f"InfiniBand port counter {counter} (sysfs counters/{counter}).",
            "counter",
            _PORT,
        )
    return spec


def infiniband_metrics(
    devices: Sequence[InfinibandDevice],
    ports: Sequence[InfinibandPort],
    seen: Mapping[Key, int],
    *,
    ages: Mapping[Key, float] | None = None,
    brief: bool = False,
) -> list[Metric]:
    """Metric families for the adapters and ports found, the counters' rises ``seen`` and the seconds
    since each last rose (``ages``); ``brief``: the rises and their ages only (the fast path's).

    Families come from specs made once (per counter name), so a port's label sets are rendered once
    per process, not once per scrape (see :class:`exporter.exposition.FamilySpec`).
    """
    events = EVENTS_SEEN.family()
    for key, value in sorted(seen.items()):
        events.add(key, value)
    age = LAST_RISE_AGE.family()
    for key, seconds in sorted((ages or {}).items()):
        age.add(key, round(seconds, 3))
    if brief:
        return [events, age]
    device_info = DEVICE_INFO.family()
    for device in devices:
        device_info.add((device.device, device.fw_ver, device.board_id, device.hca_type), 1)
    hw_counters = DRIVER_EVENTS.family()
    state, physical, rate, info = STATE.family(), PHYSICAL_STATE.family(), RATE.family(), PORT_INFO.family()
    counters: dict[str, Family] = {}
    for port in ports:
        values = (port.device, port.port)
        if port.state is not None:
            state.add(values, port.state)
        if port.physical_state is not None:
            physical.add(values, port.physical_state)
        if port.rate_bytes_per_second is not None:
            rate.add(values, port.rate_bytes_per_second)
        info.add((*values, port.link_layer or ""), 1)
        for counter, value in port.counters.items():
            spec = _counter_spec(counter)
            family = counters.get(spec.name)
            if family is None:
                family = counters[spec.name] = spec.family()
            family.add(values, value)
        for counter, value in port.hw_counters.items():
            hw_counters.add((*values, counter), value)
    return [
        device_info,
        state,
        physical,
        rate,
        info,
        *(counters[name] for name in sorted(counters)),
        hw_counters,
        events,
        age,
    ]
