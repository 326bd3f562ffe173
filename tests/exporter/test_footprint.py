"""What the exporter process loads: on a node that offers no checks, none of the checks' libraries,
and nowhere prometheus_client's package or http.server, which would load ssl and email (18 MB together).

The exporter's main path runs in a child interpreter (``exporter.cli.main`` on a fixture node, scraped
over HTTP once), which then reports the modules it holds; a module imported by this test process
cannot leak into that answer.
"""

from __future__ import annotations

import ctypes
import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from examples.pipeline import free_port
from exporter.readers.nvml import NVML_LIBRARY
from tests.exporter.helpers import GPU_NODE

REPOSITORY = Path(__file__).resolve().parents[2]

CHECKS_ONLY = ("aiohttp", "yaml", "kubernetes", "boto3", "botocore", "cuda", "exporter.checks")
"""Modules only the active checks (or the remediator) use."""
NEVER = ("prometheus_client", "http.server", "http.client", "ssl", "email")
"""Modules the exporter never needs: prometheus_client's package (exporter.metric is its data model)
and the HTTP modules that import ssl and email (exporter.server answers on socketserver alone)."""

_PROBE = textwrap.dedent(
    """
    import json, os, signal, socket, sys, threading, time

    from exporter import cli

    PORT = %(port)d
    seen = {}

    def get(path):  # a plain socket: urllib would load http.client, ssl and email into this process
        with socket.create_connection(("127.0.0.1", PORT), timeout=10) as conn:
            conn.sendall(f"GET {path} HTTP/1.1\\r\\nHost: probe\\r\\n\\r\\n".encode())
            chunks = []
            while chunk := conn.recv(65536):
                chunks.append(chunk)
        head, _, body = b"".join(chunks).partition(b"\\r\\n\\r\\n")
        assert head.startswith(b"HTTP/1.0 200 "), head
        return body

    def probe():
        deadline = time.monotonic() + 20
        while True:
            try:
                get("/healthz")
                break
            except OSError:
                if time.monotonic() > deadline:
                    os._exit(3)
                time.sleep(0.05)
        seen["scraped"] = len(get("/metrics"))
        seen["modules"] = sorted(sys.modules)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=probe, daemon=True).start()
    code = cli.main(%(argv)r)
    print(json.dumps({"exit": code, **seen}))
    """
)


def exporter_modules(tmp_path: Path, *flags: str) -> set[str]:
    """The modules an exporter started with ``flags`` on gpu-node-1 holds after its first scrape."""
    kmsg = tmp_path / "kmsg"
    shutil.copyfile(GPU_NODE / "kmsg", kmsg)
    port = free_port()
    argv = [f"--listen=127.0.0.1:{port}", f"--kmsg={kmsg}", f"--sysfs-root={GPU_NODE / 'sys'}", *flags]
    done = subprocess.run(
        [sys.executable, "-c", _PROBE % {"port": port, "argv": argv}],
        cwd=REPOSITORY,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["exit"] == 0
    assert report["scraped"] > 10_000  # a whole node's exposition, not an error page
    return set(report["modules"])


def _loaded(modules: set[str], names: tuple[str, ...]) -> list[str]:
    return sorted(m for m in modules if any(m == name or m.startswith(name + ".") for name in names))


def test_an_exporter_without_checks_loads_none_of_the_checks_libraries(tmp_path: Path) -> None:
    modules = exporter_modules(tmp_path, "--nvml=off")
    assert "exporter.sources" in modules  # the probe saw a real exporter
    assert _loaded(modules, (*CHECKS_ONLY, *NEVER, "pynvml")) == []


def test_without_the_drivers_nvml_library_nvml_auto_does_not_import_pynvml(tmp_path: Path) -> None:
    try:
        ctypes.CDLL(NVML_LIBRARY)
    except OSError:
        pass
    else:
        pytest.skip(f"{NVML_LIBRARY} loads here: a driver is present")
    modules = exporter_modules(tmp_path, "--nvml=auto")
    assert "exporter.readers.nvml" in modules
    assert _loaded(modules, ("pynvml",)) == []


def test_an_empty_checks_flag_is_no_checks(tmp_path: Path) -> None:
    modules = exporter_modules(tmp_path, "--nvml=off", "--checks=")
    assert _loaded(modules, CHECKS_ONLY) == []
