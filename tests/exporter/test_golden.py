"""The whole exporter binary against the fixture nodes, diffed with golden expositions.

The golden files are the contract users' rules and dashboards see. They are regenerated on purpose,
and reviewed, with ``ACCEL_HEALTH_UPDATE_GOLDEN=1 make unit``; ``promtool check metrics`` checks them.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from tests.exporter.helpers import GPU_NODE, TRN_NODE, sample_value, spawn_exporter, wait_until

GOLDEN = Path(__file__).resolve().parents[1] / "fixtures" / "golden"
UPDATE = os.environ.get("ACCEL_HEALTH_UPDATE_GOLDEN") == "1"

FAULTS = {
    "gpu-node-1": [
        "NVRM: Xid (PCI:0000:9d:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
        "NVRM: Xid (PCI:0000:43:00): 13, pid=48213, name=python3, Graphics Exception: ESR 0x404600=0x8",
        "NVRM: Xid (PCI:0000:d1:00 GPU-I:02 GPU-CI:00): 43, pid=5120, name=python3, Ch 00000010",
        "NVRM: The NVIDIA GPU 0000:c3:00.0",
        "NVRM: (PCI ID: 10de:2330) installed in this system has",
        "NVRM: fallen off the bus and is not responding to commands.",
        "nvidia-nvswitch2: SXid (PCI:0000:07:00.0): 20034, Fatal, Link 04 LTSSM Fault Up",
    ],
    "trn-node-1": [
        "NEURON_HW_ERR=DMA_ERROR instance-id=i-0a1b2c3d4e5f60002 hostname=trn-node-1 nd-id=0 nc-id=0 "
        "serial-num=0x4f2a action=TERMINATE_INSTANCE",
        "test NEURON_HW_ERR=DMA_ERROR test",
    ],
}
_DURATION = re.compile(r"^(accel_exporter_collector_duration_seconds\{[^}]*\}) .*$", re.MULTILINE)
_BOOT = re.compile(r'^accel_node_boot_time_seconds\{boot_id="[^"]*"\} .*$', re.MULTILINE)


def normalise(exposition: str) -> str:
    """The exposition with the only varying values, collector durations and the machine's boot, set
    to 0 and ``BOOT``."""
    exposition = _BOOT.sub('accel_node_boot_time_seconds{boot_id="BOOT"} 0.0', exposition)
    return _DURATION.sub(r"\1 0.0", exposition)


def scrape_node(node: Path, tmp_path: Path) -> str:
    kmsg = tmp_path / "kmsg"
    text = (node / "kmsg").read_text()
    seq = max(int(m) for m in re.findall(r"^\d+,(\d+),", text, re.MULTILINE))
    records = seq + 1 + len(FAULTS[node.name])
    for fault in FAULTS[node.name]:
        seq += 1
        text += f"3,{seq},{9_000_000 + seq},-;{fault}\n"
    kmsg.write_text(text)
    log = tmp_path / "exporter.log"
    running = spawn_exporter(kmsg=kmsg, sysfs_root=node / "sys", log=log, flags=("--nvml=off",))
    try:
        assert wait_until(
            lambda: sample_value(running.scrape(), "accel_kmsg_records_total") == records, timeout=5
        )
        return running.scrape()
    finally:
        running.process.send_signal(signal.SIGTERM)
        running.process.wait(timeout=10)


@pytest.mark.parametrize("node", [GPU_NODE, TRN_NODE], ids=lambda n: n.name)
def test_the_exposition_matches_the_golden_file(node: Path, tmp_path: Path) -> None:
    got = normalise(scrape_node(node, tmp_path))
    golden = GOLDEN / f"{node.name}.prom"
    if UPDATE:
        golden.write_text(got)
    assert golden.exists(), "run with ACCEL_HEALTH_UPDATE_GOLDEN=1 to create it"
    assert got == golden.read_text()


@pytest.mark.skipif(shutil.which("promtool") is None, reason="needs promtool (make test installs it)")
@pytest.mark.parametrize("golden", ["gpu-node-1.prom", "trn-node-1.prom"])
def test_the_golden_files_pass_promtool_check_metrics(golden: str) -> None:
    checked = subprocess.run(
        [str(shutil.which("promtool")), "check", "metrics"],
        input=(GOLDEN / golden).read_bytes(),
        capture_output=True,
        check=False,
    )
    assert checked.returncode == 0, checked.stdout.decode() + checked.stderr.decode()


def test_the_golden_files_hold_the_contract_series() -> None:
    gpu = (GOLDEN / "gpu-node-1.prom").read_text()
    fatal = {"pci_bus_id": "0000:9d:00", "gpu": "4", "xid": "79"}
    assert sample_value(gpu, "accel_gpu_xid_errors_total", fatal) == 1
    mig = {"pci_bus_id": "0000:d1:00", "gpu": "6", "xid": "43", "gpu_instance": "2", "compute_instance": "0"}
    assert sample_value(gpu, "accel_gpu_xid_errors_total", mig) == 1
    assert sample_value(gpu, "accel_gpu_fallen_off_bus_total", {"pci_bus_id": "0000:c3:00", "gpu": "5"}) == 1
    assert sample_value(gpu, "accel_infiniband_port_state", {"device": "mlx5_7", "port": "1"}) == 4
    trn = (GOLDEN / "trn-node-1.prom").read_text()
    assert (
        sample_value(trn, "accel_neuron_hw_errors_total", {"neuron_device": "0", "error": "DMA_ERROR"}) == 1
    )
    assert sample_value(trn, "accel_neuron_hw_errors_total", {"neuron_device": "", "error": "DMA_ERROR"}) == 1
