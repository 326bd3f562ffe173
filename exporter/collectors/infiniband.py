"""InfiniBand ports -> state, physical state, rate and one counter family per port counter.

Counter names: ``accel_infiniband_port_<counter>_total``, with a leading ``port_`` of the sysfs name
dropped (``port_rcv_errors`` -> ``accel_infiniband_port_rcv_errors_total``) and ``_bytes`` added to the
data counters, which are exported in bytes (``accel_infiniband_port_rcv_data_bytes_total``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from exporter.metric import CounterMetricFamily, GaugeMetricFamily, Metric
from exporter.readers.sysfs import InfinibandDevice, InfinibandPort

_BYTE_COUNTERS = frozenset({"port_rcv_data", "port_xmit_data"})
_UNSAFE = re.compile(r"[^a-z0-9_]")


def counter_metric_name(counter: str) -> str:
    """The metric name (without ``_total``) for a sysfs counter file name."""
    name = _UNSAFE.sub("_", counter.lower()).removeprefix("port_")
    if counter in _BYTE_COUNTERS:
        name += "_bytes"
    return f"accel_infiniband_port_{name}"


def infiniband_metrics(devices: Sequence[InfinibandDevice], ports: Sequence[InfinibandPort]) -> list[Metric]:
    """Metric families for the adapters and ports found."""
    labels = ["device", "port"]
    device_info = GaugeMetricFamily(
        "accel_infiniband_device_info",
        "1 per InfiniBand adapter, with its firmware version, board id and adapter type.",
        labels=["device", "fw_ver", "board_id", "hca_type"],
    )
    for device in devices:
        device_info.add_metric([device.device, device.fw_ver, device.board_id, device.hca_type], 1)
    hw_counters = CounterMetricFamily(
        "accel_infiniband_port_driver_events",
        "The adapter driver's own port counters (sysfs hw_counters/<counter>), by counter name.",
        labels=[*labels, "counter"],
    )
    state = GaugeMetricFamily(
        "accel_infiniband_port_state",
        "Logical port state: 1 down, 2 init, 3 armed, 4 active, 5 active-defer.",
        labels=labels,
    )
    physical = GaugeMetricFamily(
        "accel_infiniband_port_physical_state",
        "Physical port state, e.g. 2 polling, 3 disabled, 5 link up.",
        labels=labels,
    )
    rate = GaugeMetricFamily("accel_infiniband_port_rate_bytes_per_second", "Port data rate.", labels=labels)
    info = GaugeMetricFamily(
        "accel_infiniband_port_info", "1 per port, with its link layer.", labels=[*labels, "link_layer"]
    )
    counters: dict[str, CounterMetricFamily] = {}
    for port in ports:
        values = [port.device, port.port]
        if port.state is not None:
            state.add_metric(values, port.state)
        if port.physical_state is not None:
            physical.add_metric(values, port.physical_state)
        if port.rate_bytes_per_second is not None:
            rate.add_metric(values, port.rate_bytes_per_second)
        info.add_metric([*values, port.link_layer or ""], 1)
        for counter, value in port.counters.items():
            name = counter_metric_name(counter)
            if name not in counters:
                counters[name] = CounterMetricFamily(
                    name, f"InfiniBand port counter {counter} (sysfs counters/{counter}).", labels=labels
                )
            counters[name].add_metric(values, value)
        for counter, value in port.hw_counters.items():
            hw_counters.add_metric([*values, counter], value)
    return [
        device_info,
        state,
        physical,
        rate,
        info,
        *(counters[name] for name in sorted(counters)),
        hw_counters,
    ]
