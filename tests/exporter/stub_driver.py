"""Builds ``nvml_stub.c`` (a do-nothing libnvidia-ml.so.1 shaped like 8 H100s) for a child process to load.

pynvml loads the driver library by name, so a process finds the stub through ``LD_LIBRARY_PATH``, which
must be set when the process starts: the tests and ``bench/bench_nvml_threads.py`` read through it in a
child process.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

SOURCE = Path(__file__).with_name("nvml_stub.c")


def build(directory: Path) -> Path | None:
    """Compiles the stub into ``directory`` as libnvidia-ml.so.1; returns ``directory``, or None where no
    C compiler is installed."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    library = directory / "libnvidia-ml.so.1"
    subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-o", str(library), str(SOURCE)], check=True)
    return directory


def environment(directory: Path, **settings: object) -> dict[str, str]:
    """This process's environment, loading the stub built in ``directory``, with its ``NVML_STUB_*``
    settings (``gpus=1`` -> ``NVML_STUB_GPUS=1``)."""
    stub = {f"NVML_STUB_{name.upper()}": str(value) for name, value in settings.items()}
    return {**os.environ, "LD_LIBRARY_PATH": str(directory), **stub}
