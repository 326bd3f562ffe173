"""The real ``accel-health-exporter`` process: HTTP scrape, a live Xid, promtool, clean signal exits."""

from __future__ import annotations

import re
import shutil
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from exporter.cli import main, parse_listen
from tests.exporter.helpers import GPU_NODE, TRN_NODE, Running, sample_value, spawn_exporter, wait_until

REPOSITORY = Path(__file__).resolve().parents[2]
XID_79 = "NVRM: Xid (PCI:0000:9d:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."


def start_exporter(node: Path, tmp_path: Path, *flags: str) -> Running:
    kmsg = tmp_path / "kmsg"
    shutil.copyfile(node / "kmsg", kmsg)
    return spawn_exporter(
        kmsg=kmsg, sysfs_root=node / "sys", log=tmp_path / "exporter.log", flags=flags or ("--nvml=auto",)
    )


@pytest.fixture
def gpu_exporter(tmp_path: Path) -> Iterator[Running]:
    running = start_exporter(GPU_NODE, tmp_path)
    yield running
    if running.process.poll() is None:
        running.process.kill()
        running.process.wait()


def test_an_xid_appended_to_the_kernel_log_shows_up_with_its_gpu_index(gpu_exporter: Running) -> None:
    labels = {"pci_bus_id": "0000:9d:00", "gpu": "4", "xid": "79"}
    first = gpu_exporter.scrape()
    assert sample_value(first, "accel_gpu_xid_errors_total", labels) is None
    assert sample_value(first, "accel_exporter_collector_up", {"collector": "kmsg"}) == 1
    assert sample_value(first, "accel_exporter_collector_up", {"collector": "nvml"}) == 0

    with gpu_exporter.kmsg.open("a") as out:
        out.write(f"3,55,9000000,-;{XID_79}\n")
    assert wait_until(
        lambda: sample_value(gpu_exporter.scrape(), "accel_gpu_xid_errors_total", labels) == 1, timeout=0.5
    )

    gpu_exporter.process.send_signal(signal.SIGTERM)
    assert gpu_exporter.process.wait(timeout=1.0) == 0
    assert "received SIGTERM" in gpu_exporter.log.read_text()


def test_the_scrape_passes_promtool_check_metrics(gpu_exporter: Running) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not on PATH")
    checked = subprocess.run(
        [promtool, "check", "metrics"], input=gpu_exporter.scrape().encode(), capture_output=True, check=False
    )
    assert checked.returncode == 0, checked.stdout.decode() + checked.stderr.decode()


def test_healthz_answers_ok(gpu_exporter: Running) -> None:
    assert gpu_exporter.scrape("/healthz") == "ok\n"


def test_sigint_stops_a_trainium_node_exporter_cleanly(tmp_path: Path) -> None:
    running = start_exporter(TRN_NODE, tmp_path)
    try:
        with running.kmsg.open("a") as out:
            out.write("4,37,9000000,-;NEURON_HW_ERR=DMA_ERROR instance-id=i-0 hostname=trn nd-id=0 nc-id=0\n")
        labels = {"neuron_device": "0", "error": "DMA_ERROR"}
        assert wait_until(lambda: sample_value(running.scrape(), "accel_neuron_hw_errors_total", labels) == 1)
        running.process.send_signal(signal.SIGINT)
        assert running.process.wait(timeout=1.0) == 0
    finally:
        if running.process.poll() is None:
            running.process.kill()
            running.process.wait()


def test_a_port_already_in_use_is_an_exit_code_not_a_traceback(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code = main([f"--listen=127.0.0.1:{port}", f"--kmsg={tmp_path / 'none'}", f"--sysfs-root={tmp_path}"])
    assert code == 1


def test_a_malformed_listen_address_is_a_usage_error() -> None:
    assert main(["--listen=nonsense"]) == 2


@pytest.mark.parametrize("listen", ["0.0.0.0:9835", "10.213.1.10:9835", "[::]:9835", "node-1:9835"])
def test_no_token_is_refused_on_any_address_but_loopback(
    listen: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Without a token, /checks and /evidence answer anyone who reaches the port: only on loopback."""
    code = main(
        [f"--listen={listen}", "--checks-insecure-no-auth", f"--kmsg={tmp_path / 'none'}", "--nvml=off"]
    )
    assert code == 2
    assert "only for a loopback --listen address" in caplog.text


@pytest.mark.parametrize("seconds", ["0", "-1", "soon", "inf"])
def test_an_nvml_timeout_that_is_not_a_positive_number_is_a_usage_error(seconds: str) -> None:
    assert main([f"--nvml-timeout={seconds}"]) == 2


def test_without_a_driver_nvml_auto_starts_and_reports_nvml_down(tmp_path: Path) -> None:
    running = start_exporter(GPU_NODE, tmp_path, "--nvml=auto", "--nvml-timeout=0.5")
    try:
        scrape = running.scrape()
        if sample_value(scrape, "accel_nvml_gpus") is not None:
            pytest.skip("an NVIDIA driver is present here")
        assert sample_value(scrape, "accel_exporter_collector_up", {"collector": "nvml"}) == 0
        nvml = {"collector": "nvml"}
        assert sample_value(scrape, "accel_exporter_collector_hardware_present", nvml) == 0
        assert sample_value(scrape, "accel_exporter_collector_errors", nvml) == 0
        for collector in ("kmsg", "pci", "infiniband"):
            assert sample_value(scrape, "accel_exporter_collector_up", {"collector": collector}) == 1
        labels = {"pci_bus_id": "0000:52:00", "gpu": "2", "vendor": "nvidia"}
        assert sample_value(scrape, "accel_pcie_max_link_width", labels) == 16
        running.process.send_signal(signal.SIGTERM)
        assert running.process.wait(timeout=2.0) == 0
        log = running.log.read_text()
        assert "INFO exporter.collectors.framework: collector nvml is down: no hardware: NVML" in log
    finally:
        if running.process.poll() is None:
            running.process.kill()
            running.process.wait()


@pytest.mark.parametrize(
    ("text", "expected"),
    [("0.0.0.0:9835", ("0.0.0.0", 9835)), ("[::1]:9100", ("::1", 9100)), (":9835", ("0.0.0.0", 9835))],
)
def test_listen_addresses_parse_to_host_and_port(text: str, expected: tuple[str, int]) -> None:
    assert parse_listen(text) == expected


def test_metrics_are_served_in_the_text_format_whatever_the_scraper_accepts(gpu_exporter: Running) -> None:
    request = urllib.request.Request(  # noqa: S310 -- loopback URL
        gpu_exporter.url + "/metrics",
        headers={"Accept": "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"},
    )
    with urllib.request.urlopen(request, timeout=5) as response:  # noqa: S310 -- loopback URL
        assert response.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
        body = response.read().decode()
    assert "# EOF" not in body
    assert 'accel_pci_devices{vendor="nvidia"} 8.0' in body


def _get(url: str, token: str | None = None) -> tuple[int, str]:
    request = urllib.request.Request(url)  # noqa: S310 -- loopback URL
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=5) as response:  # noqa: S310 -- loopback URL
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def test_checks_wait_for_a_token_set_after_start_and_follow_its_rotation(tmp_path: Path) -> None:
    token_file = tmp_path / "secret" / "token"
    running = start_exporter(
        GPU_NODE,
        tmp_path,
        "--nvml=off",
        "--checks=pciebw",
        f"--checks-token-file={token_file}",
        "--checks-schedule=off",
    )
    try:
        assert "accel_exporter_collector_up" in running.scrape()
        status, body = _get(running.url + "/checks", "anything")
        assert status == 503
        assert f"until {token_file} holds a token" in body

        token_file.parent.mkdir()
        token_file.write_text("first-token\n")
        assert _get(running.url + "/checks?check=pciebw", "first-token")[0] == 200
        token_file.write_text("second-token\n")
        assert _get(running.url + "/checks?check=pciebw", "first-token")[0] == 401
        assert _get(running.url + "/checks?check=pciebw", "second-token")[0] == 200
        token_file.write_text("")
        assert _get(running.url + "/checks?check=pciebw", "second-token")[0] == 503
    finally:
        running.process.terminate()
        running.process.wait(timeout=5)
    assert "GET /checks answers 503 until it holds a token" in running.log.read_text()


def _fake_gpu_node(tmp_path: Path, *flags: str) -> Running:
    """The exporter on gpu-node-1 with its eight simulated H100s (examples/fake_gpus.py)."""
    kmsg = tmp_path / "kmsg"
    shutil.copyfile(GPU_NODE / "kmsg", kmsg)
    log = tmp_path / "exporter.log"
    argv = [sys.executable, "-m", "examples.fake_gpus", "--listen=127.0.0.1:0", f"--kmsg={kmsg}"]
    with log.open("wb") as out:
        process = subprocess.Popen(
            [*argv, f"--sysfs-root={GPU_NODE / 'sys'}", *flags],
            cwd=REPOSITORY,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    assert wait_until(lambda: "listening on" in log.read_text(), timeout=20), log.read_text()
    found = re.findall(r"listening on (\S+)", log.read_text())
    return Running(process=process, url=f"http://{found[0]}", kmsg=kmsg, log=log)


@pytest.mark.parametrize("per_link", [False, True])
def test_nvlink_is_published_per_gpu_and_per_link_only_with_the_flag(tmp_path: Path, per_link: bool) -> None:
    running = _fake_gpu_node(tmp_path, *(["--nvlink-per-link"] if per_link else []))
    try:
        scrape = running.scrape()
        gpu3 = {
            "gpu": "3",
            "uuid": "GPU-35be2791-0f30-550d-89c1-c29455a5ca63",
            "pci_bus_id": "0000:61:00",
            "model": "NVIDIA H100 80GB HBM3",
        }
        assert sample_value(scrape, "accel_gpu_nvlink_links", gpu3) == 18
        assert sample_value(scrape, "accel_gpu_nvlink_links_up", gpu3) == 18
        assert sample_value(scrape, "accel_gpu_nvlink_errors_total", {**gpu3, "error": "crc_flit"}) == 12
        link7 = {**gpu3, "link": "7", "error": "crc_flit"}
        assert sample_value(scrape, "accel_gpu_nvlink_link_errors_total", link7) == (12 if per_link else None)
        series = [line for line in scrape.splitlines() if line.startswith("accel_gpu_nvlink")]
        assert len(series) == 8 * 6 + (8 * 18 * 5 if per_link else 0)
    finally:
        running.process.send_signal(signal.SIGTERM)
        assert running.process.wait(timeout=5) == 0
