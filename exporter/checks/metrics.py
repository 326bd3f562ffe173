"""The checks' latest results as raw series; the thresholds that judge them live in alerts/.

Per check: ``accel_check_last_run_timestamp_seconds``, ``accel_check_success`` (1 when the latest run
passed), ``accel_check_duration_seconds``, ``accel_check_interval_seconds`` (the schedule's),
``accel_check_gpus_skipped`` (GPUs the latest run left out because they were in use) and the counter
``accel_check_runs_total{check, verdict}``. Per device, from the latest run that measured it:

- ``accel_check_pcie_bandwidth_bytes_per_second{gpu, pci_bus_id, direction}`` (``pciebw``)
- ``accel_check_memory_bandwidth_bytes_per_second{gpu, pci_bus_id}`` (``gpumem``)
- ``accel_check_dcgm_test_status{gpu, test, status}``: 1 for the status DCGM gave (``dcgm``)
- ``accel_check_peer_reachable{interface, peer}``, ``accel_check_peer_rtt_seconds{interface, peer}``
  (``ping``), ``accel_check_network_bandwidth_bytes_per_second{interface, peer}`` (``iperf``)
- ``accel_check_gpu_passed{check, gpu, pci_bus_id}``: 1 when the GPU passed the check, 0 when it failed

A check that has not run yet publishes nothing but its interval.
"""

from __future__ import annotations

from collections.abc import Mapping

from exporter.checks.base import CheckResult
from exporter.metric import CounterMetricFamily, GaugeMetricFamily, Metric


def check_metrics(  # noqa: PLR0912  one branch per family; splitting hides the shape
    latest: Mapping[str, CheckResult],
    runs: Mapping[str, Mapping[str, int]],
    skipped_gpus: Mapping[str, int],
    intervals: Mapping[str, float],
) -> list[Metric]:
    last = GaugeMetricFamily(
        "accel_check_last_run_timestamp_seconds",
        "Unix time the latest run of the check began.",
        labels=["check"],
    )
    success = GaugeMetricFamily(
        "accel_check_success",
        "1 when the latest run of the check passed; 0 when it failed, erred or was skipped.",
        labels=["check"],
    )
    duration = GaugeMetricFamily(
        "accel_check_duration_seconds", "Seconds the latest run of the check took.", labels=["check"]
    )
    interval = GaugeMetricFamily(
        "accel_check_interval_seconds", "Seconds between scheduled runs of the check.", labels=["check"]
    )
    skipped = GaugeMetricFamily(
        "accel_check_gpus_skipped",
        "GPUs the latest run of the check left out because something used them (or another check held them).",
        labels=["check"],
    )
    total = CounterMetricFamily(
        "accel_check_runs",
        "Runs of the check by verdict (pass, fail, error, skipped).",
        labels=["check", "verdict"],
    )
    pcie = GaugeMetricFamily(
        "accel_check_pcie_bandwidth_bytes_per_second",
        "Measured host<->device copy bandwidth over pinned memory (pciebw).",
        labels=["gpu", "pci_bus_id", "direction"],
    )
    memory = GaugeMetricFamily(
        "accel_check_memory_bandwidth_bytes_per_second",
        "Measured device memory bandwidth: device-to-device copies, bytes read plus written (gpumem).",
        labels=["gpu", "pci_bus_id"],
    )
    dcgm = GaugeMetricFamily(
        "accel_check_dcgm_test_status",
        "1 for the status (pass, fail, warn, skip) DCGM's diagnostic gave the test on the GPU.",
        labels=["gpu", "test", "status"],
    )
    reachable = GaugeMetricFamily(
        "accel_check_peer_reachable",
        "1 when the peer answered over the interface (ping).",
        labels=["interface", "peer"],
    )
    rtt = GaugeMetricFamily(
        "accel_check_peer_rtt_seconds",
        "Average round-trip time to the peer over the interface (ping).",
        labels=["interface", "peer"],
    )
    network = GaugeMetricFamily(
        "accel_check_network_bandwidth_bytes_per_second",
        "Measured TCP bandwidth to the peer, bytes received per second (iperf).",
        labels=["interface", "peer"],
    )
    passed = GaugeMetricFamily(
        "accel_check_gpu_passed",
        "1 when the GPU passed the check's latest run that measured it, 0 when it failed.",
        labels=["check", "gpu", "pci_bus_id"],
    )
    for name in sorted(set(intervals)):
        interval.add_metric([name], intervals[name])
    for name in sorted(runs):
        for verdict, count in sorted(runs[name].items()):
            total.add_metric([name, verdict], count)
    for name in sorted(latest):
        result = latest[name]
        last.add_metric([name], result.started)
        success.add_metric([name], 1.0 if result.verdict == "pass" else 0.0)
        duration.add_metric([name], result.duration)
        skipped.add_metric([name], skipped_gpus.get(name, 0))
        for device in result.devices:
            if device.verdict in ("pass", "fail") and name in (
                "pciebw",
                "gpumem",
                "remapped",
                "power",
                "dcgm",
            ):
                passed.add_metric(
                    [name, device.device, device.pci_bus_id], 1.0 if device.verdict == "pass" else 0.0
                )
            values = device.values
            if name == "pciebw":
                for direction in ("host_to_device", "device_to_host"):
                    if direction in values:
                        pcie.add_metric([device.device, device.pci_bus_id, direction], values[direction])
            elif name == "gpumem" and "device_to_device" in values:
                memory.add_metric([device.device, device.pci_bus_id], values["device_to_device"])
            elif name in ("ping", "iperf") and "/" in device.device:
                interface, peer = device.device.split("/", 1)
                if "reachable" in values:
                    reachable.add_metric([interface, peer], values["reachable"])
                if "rtt_seconds" in values:
                    rtt.add_metric([interface, peer], values["rtt_seconds"])
                if "bytes_per_second" in values:
                    network.add_metric([interface, peer], values["bytes_per_second"])
        if name == "dcgm":
            for test in result.extra.get("tests", []):
                dcgm.add_metric([str(test["gpu"]), str(test["test"]), str(test["status"])], 1.0)
    return [
        last,
        success,
        duration,
        interval,
        skipped,
        total,
        pcie,
        memory,
        dcgm,
        reachable,
        rtt,
        network,
        passed,
    ]
