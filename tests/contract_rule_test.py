"""Renders alerts/tests/contract_test.yaml: a promtool test fed with the exporter's real series.

The input series are what the exporter's own readers and collectors make of the demo's node fixtures
(examples/nodes/): every label it emits, plus `node`, `instance` and `job` as the scrape attaches them.
The NVML series, which no fixture can produce without a GPU, are written in the shapes the NVML
collector publishes. Twenty minutes of a healthy cluster (nothing may fire), then the demo's three
kernel-log faults are appended: Xid 79 and Xid 13 on gpu-node-1, NEURON_HW_ERR=DMA_ERROR on
trn-node-1. Exactly the fatal Xid, the lost GPU and the Neuron error fire; everything else, the single
application Xid included, stays silent.

Regenerate after changing rules or fixtures, and review the diff:

    .venv/bin/python -m tests.contract_rule_test > alerts/tests/contract_test.yaml
"""

from __future__ import annotations

import sys
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from exporter.metric import Metric
from exporter.paths import is_fast
from exporter.readers.kmsg import KmsgFollower
from exporter.sources import ExporterSettings, build_registry, build_sources

REPO = Path(__file__).resolve().parent.parent
NODES = REPO / "examples" / "nodes"
RULES = REPO / "alerts"
OUTPUT = RULES / "tests" / "contract_test.yaml"

SCRAPE = 10
"""Seconds between samples: the shipped scrape and evaluation interval."""
HEALTHY_SAMPLES = 120
"""Twenty minutes of a healthy cluster before the faults."""
FAULT_SAMPLES = 60
"""Ten minutes after the faults."""
JOB = "accel-health-exporter"
FAST_JOB = "accel-health-exporter-fast"
"""The two scrape jobs: a series is in the fast one when the exporter serves it on /metrics/fast."""
MODEL = "NVIDIA H100 80GB HBM3"
RUNBOOK = "https://github.com/accel-health/accel-health/blob/main/alerts/runbook.md"

Labels = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Node:
    """One simulated node: its fixtures, its scrape address and the kernel-log lines of the fault."""

    name: str
    instance: str
    nvml: bool
    """Whether NVML works there (the nvml collector reports up 1 and publishes per-GPU series)."""
    fault_lines: tuple[str, ...]


NODE_LIST = (
    Node(
        name="gpu-node-1",
        instance="10.0.0.1:9835",
        nvml=True,
        fault_lines=(
            "NVRM: Xid (PCI:0000:9d:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
            "NVRM: Xid (PCI:0000:43:00): 13, pid=48213, name=python3, Graphics Exception: "
            "ESR 0x404600=0x80000002",
        ),
    ),
    Node(
        name="trn-node-1",
        instance="10.0.1.1:9835",
        nvml=False,
        fault_lines=(
            "NEURON_HW_ERR=DMA_ERROR instance-id=i-0a1b2c3d4e5f60002 hostname=trn-node-1 nd-id=0 "
            "nc-id=0 serial-num=0x4f2a action=TERMINATE_INSTANCE",
        ),
    ),
)

LOST_GPU = "0000:9d:00"
"""The GPU that falls off the bus: NVML reports it lost once the Xid is logged."""


def _append_records(text: str, lines: Sequence[str]) -> str:
    """The kernel log with ``lines`` appended as further /dev/kmsg records."""
    last = [line for line in text.splitlines() if line and line[0] != " "][-1]
    seq, timestamp = (int(field) for field in last.split(";", 1)[0].split(",")[1:3])
    out = text if text.endswith("\n") else text + "\n"
    for offset, line in enumerate(lines, start=1):
        out += f"3,{seq + offset},{timestamp + offset * 1_000_000},-;{line}\n"
    return out


def _exporter_metrics(node: Node, kmsg_text: str) -> list[Metric]:
    """What the exporter's own sources publish for this node and kernel log (NVML aside), health
    series included: the real follower reads the log from a scratch file, the real registry collects."""
    records = sum(1 for line in kmsg_text.splitlines() if line and line[0] != " ")
    with tempfile.TemporaryDirectory(prefix="accel-health-contract-") as scratch:
        kmsg = Path(scratch) / "kmsg"
        kmsg.write_text(kmsg_text)
        follower = KmsgFollower(kmsg, poll_interval=0.01)
        follower.start()
        try:
            deadline = time.monotonic() + 10
            while follower.snapshot().records < records:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"the follower read {follower.snapshot().records} of {records} records"
                    )
                time.sleep(0.01)
            settings = ExporterSettings(kmsg_path=kmsg, sysfs_root=NODES / node.name / "sys")
            families = list(build_registry(build_sources(settings, kmsg=follower, nvml=None)).collect())
        finally:
            follower.stop()
    # Durations vary from run to run; the rules never read them.
    return [f for f in families if f.name != "accel_exporter_collector_duration_seconds"]


def _nvml_series(gpus: Iterable[Mapping[str, str]], *, lost: str | None) -> dict[str, dict[Labels, float]]:
    """Per-GPU NVML series in the NVML collector's shapes (NVLink per GPU, as published by default)."""
    series: dict[str, dict[Labels, float]] = {}

    def add(name: str, labels: Mapping[str, str], value: float) -> None:
        series.setdefault(name, {})[tuple(sorted(labels.items()))] = float(value)

    count = 0
    for info in gpus:
        count += 1
        gpu = {"gpu": info["gpu"], "uuid": info["uuid"], "pci_bus_id": info["pci_bus_id"], "model": MODEL}
        for error_type in ("corrected", "uncorrected"):
            for counter_type in ("volatile", "aggregate"):
                add(
                    "accel_gpu_ecc_errors", {**gpu, "error_type": error_type, "counter_type": counter_type}, 0
                )
        for cause in ("correctable", "uncorrectable"):
            add("accel_gpu_remapped_rows", {**gpu, "cause": cause}, 0)
        add("accel_gpu_remapped_rows_pending", gpu, 0)  # accel_gpu_remapped_rows_failure: only once failed
        for link in ("current", "max"):
            add("accel_gpu_pcie_link_generation", {**gpu, "link": link}, 5)
            add("accel_gpu_pcie_link_width", {**gpu, "link": link}, 16)
        add("accel_gpu_pcie_replay_errors_total", gpu, 0)
        for direction in ("rx", "tx"):
            add("accel_gpu_pcie_throughput_bytes_per_second", {**gpu, "direction": direction}, 12e9)
        add("accel_gpu_nvlink_links", gpu, 18)
        add("accel_gpu_nvlink_links_up", gpu, 18)
        for error in ("crc_flit", "crc_data", "replay", "recovery"):
            add("accel_gpu_nvlink_errors_total", {**gpu, "error": error}, 0)
        for reason in (
            "hw_slowdown",
            "hw_thermal_slowdown",
            "hw_power_brake",
            "sw_thermal_slowdown",
            "sw_power_cap",
        ):
            add("accel_gpu_clock_throttle_active", {**gpu, "reason": reason}, 0)
        add("accel_gpu_temperature_celsius", gpu, 41)
        add("accel_gpu_power_watts", gpu, 312.5)
        add("accel_gpu_nvml_up", gpu, 1)
        if info["pci_bus_id"] == lost:
            add("accel_gpu_lost", gpu, 1)
    add("accel_nvml_gpus", {}, count)
    return series


def _flatten(metrics: Iterable[Metric]) -> dict[str, dict[Labels, float]]:
    series: dict[str, dict[Labels, float]] = {}
    for metric in metrics:
        for sample in metric.samples:
            series.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = float(sample.value)
    return series


def _phase(node: Node, *, faulty: bool) -> dict[str, dict[Labels, float]]:
    """Every series one scrape of this node returns, before or after the faults."""
    kmsg_text = (NODES / node.name / "kmsg").read_text()
    if faulty:
        kmsg_text = _append_records(kmsg_text, node.fault_lines)
    series = _flatten(_exporter_metrics(node, kmsg_text))
    # Damaged state-file reads are counted per process (exporter/sources.py), and this runs in the test
    # process, where other tests damage files on purpose: not a series of these nodes.
    series.pop("accel_exporter_state_file_damaged_total", None)
    # The NVML collector as --nvml=auto reports it: up where the driver answers, absent hardware where
    # there is no NVIDIA driver (the Trainium node).
    nvml = ((("collector", "nvml"),),)
    series["accel_exporter_collector_up"].update(dict.fromkeys(nvml, 1.0 if node.nvml else 0.0))
    series["accel_exporter_collector_hardware_present"].update(dict.fromkeys(nvml, 1.0 if node.nvml else 0.0))
    series["accel_exporter_collector_errors"].update(dict.fromkeys(nvml, 0.0))
    if node.nvml:
        gpus = [dict(labels) for labels in series.get("accel_gpu_info", {})]
        series.update(_nvml_series(gpus, lost=LOST_GPU if faulty else None))
    series["up"] = {(("job", JOB),): 1.0, (("job", FAST_JOB),): 1.0}
    return series


def _format_value(value: float) -> str:
    return str(int(value)) if value.is_integer() else repr(value)


def _values(before: float | None, after: float | None) -> str:
    def run(value: float | None, count: int) -> str:
        if value is None:  # promtool: `_xN` is N missing samples, `VxN` is N+1 samples
            return f"_x{count}"
        return f"{_format_value(value)}x{count - 1}" if count > 1 else _format_value(value)

    return f"{run(before, HEALTHY_SAMPLES)} {run(after, FAULT_SAMPLES)}"


def _selector(name: str, labels: Mapping[str, str]) -> str:
    inner = ",".join(f'{key}="{value}"' for key, value in labels.items())
    return f"{name}{{{inner}}}"


def input_series() -> list[dict[str, str]]:
    """promtool input series for both nodes, healthy then faulty."""
    out: list[dict[str, str]] = []
    for node in NODE_LIST:
        healthy, faulty = _phase(node, faulty=False), _phase(node, faulty=True)
        for name in sorted(set(healthy) | set(faulty)):
            before, after = healthy.get(name, {}), faulty.get(name, {})
            for labels in sorted(set(before) | set(after)):
                job = FAST_JOB if is_fast(name, dict(labels)) else JOB
                full = {"job": job, "instance": node.instance, "node": node.name, **dict(labels)}
                out.append(
                    {
                        "series": _selector(name, full),
                        "values": _values(before.get(labels), after.get(labels)),
                    }
                )
    return out


def alert_names() -> list[str]:
    """Every alert defined in alerts/*.yaml, in file order."""
    names: list[str] = []
    for path in sorted(RULES.glob("*.yaml")):
        for group in yaml.safe_load(path.read_text())["groups"]:
            names.extend(rule["alert"] for rule in group["rules"] if "alert" in rule)
    return names


def _expected_firing() -> dict[str, list[dict[str, object]]]:
    gpu = {
        "job": FAST_JOB,
        "instance": "10.0.0.1:9835",
        "node": "gpu-node-1",
        "pci_bus_id": LOST_GPU,
        "gpu": "4",
    }
    uuid = next(
        dict(labels)["uuid"]
        for labels in _phase(NODE_LIST[0], faulty=False)["accel_gpu_info"]
        if dict(labels)["pci_bus_id"] == LOST_GPU
    )
    return {
        "AccelGPUFatalXid": [
            {
                "exp_labels": {
                    "severity": "critical",
                    "remediation": "drain",
                    "xid_class": "reset",
                    **gpu,
                    "xid": "79",
                },
                "exp_annotations": {
                    "summary": "GPU 0000:9d:00 (index 4) on gpu-node-1 had fatal Xid 79",
                    "description": "Xid 79 was logged 1 time(s) since boot for the GPU at PCI 0000:9d:00 "
                    "on node gpu-node-1. NVIDIA's catalog says the GPU or the machine must be reset; jobs on "
                    "this node will fail or hang until then.",
                    "runbook_url": f"{RUNBOOK}#accelgpufatalxid",
                },
            }
        ],
        "AccelGPULost": [
            {
                "exp_labels": {
                    "severity": "critical",
                    "remediation": "drain",
                    **gpu,
                    "uuid": uuid,
                    "model": MODEL,
                },
                "exp_annotations": {
                    "summary": "GPU 4 (0000:9d:00) on gpu-node-1 is lost",
                    "description": f"NVML reports GPU 4 ({uuid}) at PCI 0000:9d:00 on node gpu-node-1 as "
                    "lost: it no longer answers the driver. Only a reboot (or a reseat) brings it back.",
                    "runbook_url": f"{RUNBOOK}#accelgpulost",
                },
            }
        ],
        "AccelNeuronHardwareError": [
            {
                "exp_labels": {
                    "severity": "critical",
                    "remediation": "replace",
                    "job": FAST_JOB,
                    "instance": "10.0.1.1:9835",
                    "node": "trn-node-1",
                    "neuron_device": "0",
                    "error": "DMA_ERROR",
                },
                "exp_annotations": {
                    "summary": "Neuron device 0 on trn-node-1 reported DMA_ERROR",
                    "description": "The Neuron driver logged NEURON_HW_ERR=DMA_ERROR 1 time(s) since boot "
                    "for device 0 on node trn-node-1. AWS's guidance for this error is to replace the "
                    "instance.",
                    "runbook_url": f"{RUNBOOK}#accelneuronhardwareerror",
                },
            }
        ],
    }


def _seconds(samples: int) -> str:
    return f"{samples * SCRAPE}s"


def render() -> str:
    """The whole test file."""
    firing = _expected_firing()
    last_healthy = _seconds(HEALTHY_SAMPLES - 1)
    fault = _seconds(HEALTHY_SAMPLES)
    end = _seconds(HEALTHY_SAMPLES + FAULT_SAMPLES - 1)
    checks: list[dict[str, object]] = []
    for name in alert_names():
        checks.append({"eval_time": last_healthy, "alertname": name, "exp_alerts": []})
    for at in (fault, end):
        for name in alert_names():
            checks.append({"eval_time": at, "alertname": name, "exp_alerts": firing.get(name, [])})
    document = {
        "rule_files": [f"../{path.name}" for path in sorted(RULES.glob("*.yaml"))],
        "evaluation_interval": f"{SCRAPE}s",
        "tests": [
            {
                "name": "the exporter's real series: a healthy cluster is silent; the demo's faults fire "
                "exactly their alerts",
                "interval": f"{SCRAPE}s",
                "input_series": input_series(),
                "alert_rule_test": checks,
            }
        ],
    }
    header = (
        "# GENERATED by `.venv/bin/python -m tests.contract_rule_test > alerts/tests/contract_test.yaml`;\n"
        "# tests/test_rules_contract.py fails when this file is stale. Input series: the exporter's own\n"
        "# collectors run on examples/nodes/ (all their labels, plus node/instance/job from the scrape) and\n"
        "# NVML series in the NVML collector's shapes; 10s scrape and evaluation, as shipped. Until 20m the\n"
        "# cluster is healthy and every alert is silent; at 20m the demo's kernel-log lines are appended\n"
        "# (Xid 79 and a single Xid 13 on gpu-node-1, NEURON_HW_ERR=DMA_ERROR on trn-node-1): the fatal\n"
        "# alerts fire on that very evaluation, everything else (the application Xid, the nvml collector\n"
        "# that is down on the Trainium node, idle links) stays silent.\n"
    )
    body: str = yaml.safe_dump(document, sort_keys=False, width=200, allow_unicode=False)
    return header + body


if __name__ == "__main__":
    sys.stdout.write(render())
