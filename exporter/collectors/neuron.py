"""Neuron sysfs hardware counters -> ``accel_neuron_sysfs_hardware_errors_total{neuron_device,kind}``.

Distinct from ``accel_neuron_hw_errors_total``, which counts NEURON_HW_ERR kernel-log records. A kind
is exported once its count is above 0 (as the kernel-log counts and AER error names are): the
uncorrectable kinds are on the fast path, read every 2 s on every node, and the rules fire on any.
"""

from __future__ import annotations

from collections.abc import Sequence

from exporter.metric import CounterMetricFamily, Metric
from exporter.readers.sysfs import NeuronDevice


def neuron_metrics(devices: Sequence[NeuronDevice]) -> list[Metric]:
    """Metric families for the Neuron devices found."""
    errors = CounterMetricFamily(
        "accel_neuron_sysfs_hardware_errors",
        "Neuron device hardware error counters from sysfs (stats/hardware/<kind>/total); a kind is "
        "exported once above 0.",
        labels=["neuron_device", "kind"],
    )
    for device in devices:
        for kind, value in sorted(device.hardware_errors.items()):
            if value:
                errors.add_metric([device.neuron_device, kind], value)
    return [errors]
