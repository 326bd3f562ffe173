"""The node's boot, for rules that must not compare across one.

``accel_node_boot_time_seconds{boot_id}``: the Unix time this boot began, labelled with the kernel's
boot id (``/proc/sys/kernel/random/boot_id``). A counter that starts again at each boot (an InfiniBand
port's, which lives in the adapter) is scoped to one boot by the rules' recording of it with this
series' ``boot_id`` (alerts/infiniband.yaml): a window reaching back into another boot then holds
another series, and the first reading of a boot is its own baseline. One series per node, on the
slow path; where the boot id cannot be read the label is ``boot-time-<seconds>``, which differs from
boot to boot all the same.
"""

from __future__ import annotations

from collections.abc import Iterator

from exporter.metric import Collector, GaugeMetricFamily, Metric


class BootCollector(Collector):
    """Serves ``accel_node_boot_time_seconds{boot_id}`` for one boot."""

    def __init__(self, *, boot_id: str | None, boot_time: float) -> None:
        self.boot_id = boot_id or f"boot-time-{round(boot_time)}"
        self.boot_time = float(round(boot_time))

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "accel_node_boot_time_seconds",
            "Unix time this boot of the node began (whole seconds), labelled with the kernel's boot id.",
            labels=["boot_id"],
        )
        family.add_metric([self.boot_id], self.boot_time)
        yield family
