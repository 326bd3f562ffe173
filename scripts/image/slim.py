"""Compiles and trims Python inside the image build (Containerfile); runs on the image's own python3.

    slim.py stdlib        compile the standard library (sources kept, so its tracebacks read)
    slim.py site VENV     compile the dependencies installed in VENV to bytecode and drop their sources;
                          keep only the botocore service models the remediator uses, and of
                          cuda-bindings only its driver API (what pciebw and gpumem call)

Why: the root filesystem is read-only in the cluster, so whatever is not compiled here is compiled
again at every start (the Kubernetes client alone is 74 MB of generated source, and `import
kubernetes` loads both its clients). Shipping the dependencies as bytecode only saves those 74 MB;
their tracebacks still name file and line. The project's own packages are installed afterwards by
pip, compiled beside their sources. Standard library only: no pip, nothing from the host.
"""

from __future__ import annotations

import compileall
import shutil
import sys
import sysconfig
from pathlib import Path

BOTOCORE_SERVICES = frozenset({"autoscaling", "cloudwatch", "ec2", "sts", "sso", "sso-oidc", "signin"})
"""Service models kept in botocore/data: Auto Scaling, CloudWatch and EC2 (RebootInstances), which
remediator/executors/aws.py calls, and those botocore's own credential providers call (STS for IRSA web
identity and assumed roles, SSO, SSO OIDC and sign-in for profiles); of each, only its newest API
version, the one a client loads, without the documentation examples. The other ~440 models are 28 MB
nobody here loads."""


CUDA_MODULES = frozenset({"driver", "cydriver", "utils", "_fast_enum"})
"""Compiled modules kept in cuda/bindings: `cuda.bindings.driver` (exporter/checks/cuda.py imports it,
and nothing else of the bindings) and what it imports. The runtime, NVRTC, nvJitLink, NVVM, nvFatbin,
cuFile, cuDLA and NVML bindings, the `_v2` copies and the Cython headers are 22 MB nobody here loads."""


def compile_stdlib() -> None:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    if not compileall.compile_dir(stdlib, quiet=1, workers=0):
        # A few modules of the standard library's own test data do not compile; they are not imported.
        print(f"slim: some files under {stdlib} did not compile", file=sys.stderr)


def site_packages(venv: Path) -> Path:
    (found,) = venv.glob("lib/python3*/site-packages")
    return found


def trim_botocore(site: Path) -> int:
    """Remove the unused service models; returns how many were removed."""
    data = site / "botocore" / "data"
    if not data.is_dir():
        return 0
    removed = 0
    for service in data.iterdir():
        if service.is_dir() and service.name not in BOTOCORE_SERVICES:
            shutil.rmtree(service)
            removed += 1
        elif service.is_dir():
            *older, _newest = sorted(v for v in service.iterdir() if v.is_dir())
            for version in older:
                shutil.rmtree(version)
            for examples in service.rglob("examples-1.json"):
                examples.unlink()
    return removed


def trim_cuda(site: Path) -> int:
    """Remove what `cuda.bindings.driver` does not load; returns how many files were removed."""
    bindings = site / "cuda" / "bindings"
    if not bindings.is_dir():
        return 0
    removed = 0
    if (bindings / "_v2").is_dir():
        removed += sum(1 for p in (bindings / "_v2").rglob("*") if p.is_file())
        shutil.rmtree(bindings / "_v2")
    for path in list(bindings.rglob("*")):
        if not path.is_file():
            continue
        unused_extension = path.suffix == ".so" and path.name.split(".", 1)[0] not in CUDA_MODULES
        if unused_extension or path.suffix in {".pxd", ".pxi", ".pyx"}:
            path.unlink()
            removed += 1
    return removed


def bytecode_only(site: Path) -> int:
    """Compile every module to a .pyc beside it (the layout Python imports without a source), then
    drop each source that got one; returns how many sources were dropped."""
    compileall.compile_dir(site, quiet=1, legacy=True, workers=0)
    dropped = 0
    for source in site.rglob("*.py"):
        if source.with_suffix(".pyc").is_file():
            source.unlink()
            dropped += 1
    for cache in list(site.rglob("__pycache__")):
        shutil.rmtree(cache)
    return dropped


def main(argv: list[str]) -> int:
    if argv == ["stdlib"]:
        compile_stdlib()
        return 0
    if len(argv) == 2 and argv[0] == "site":
        site = site_packages(Path(argv[1]))
        removed = trim_botocore(site)
        cuda = trim_cuda(site)
        dropped = bytecode_only(site)
        print(
            f"slim: {removed} botocore service models and {cuda} files of cuda-bindings removed, "
            f"{dropped} sources compiled and dropped"
        )
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
