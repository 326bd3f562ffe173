"""Rendering the kustomize overlays with kubectl, shared by the deploy and dashboard tests."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent.parent
DEPLOY = REPO / "deploy"
OVERLAYS = ("dry-run", "enforce", "aws")
MIN_KUSTOMIZE_MAJOR = 4


class _Loader(yaml.SafeLoader):
    """YAML as Kubernetes reads it: a bare `=` (kustomize prints `matchType: =`) is a string; PyYAML
    alone resolves it to YAML 1.1's obsolete `value` tag and refuses it."""


_Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:value"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}


def load_all(text: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.load_all(text, Loader=_Loader) if doc]


def kubectl_problem() -> str | None:
    """Why the overlays cannot be rendered here, or None when they can."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        return "kubectl is not installed (make test installs it: scripts/install-tools.sh)"
    out = subprocess.run(
        [kubectl, "version", "--client", "-o", "json"], capture_output=True, text=True, check=False
    )
    try:
        version = str(json.loads(out.stdout).get("kustomizeVersion", ""))
    except json.JSONDecodeError:
        version = ""
    match = re.match(r"v?(\d+)\.", version)
    if not match or int(match.group(1)) < MIN_KUSTOMIZE_MAJOR:
        return (
            f"kubectl at {kubectl} embeds kustomize {version or 'v2 (unversioned)'}; the manifests use "
            f"components and need kustomize v{MIN_KUSTOMIZE_MAJOR}+ (kubectl >= 1.21)"
        )
    return None


def render(path: Path) -> list[dict[str, Any]]:
    """`kubectl kustomize PATH`, parsed; fails with kubectl's message."""
    kubectl = shutil.which("kubectl")
    assert kubectl is not None, "kubectl disappeared"
    out = subprocess.run(
        [kubectl, "kustomize", str(path)], capture_output=True, text=True, check=False, timeout=60
    )
    assert out.returncode == 0, f"kubectl kustomize {path.relative_to(REPO)} failed:\n{out.stderr}"
    return load_all(out.stdout)


def find(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def containers(objects: list[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(workload, container) for every container of every pod template."""
    for obj in objects:
        template = obj.get("spec", {}).get("template")
        if template:
            for container in template["spec"].get("containers", []):
                yield obj, container


_VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def manifest_env(objects: list[dict[str, Any]], container: dict[str, Any]) -> dict[str, str]:
    """The container's env vars whose values the manifests hold: plain values and keys of the rendered
    ConfigMaps (fieldRefs and Secrets are the cluster's, not the manifests')."""
    env: dict[str, str] = {}
    for item in container.get("env", []):
        ref = (item.get("valueFrom") or {}).get("configMapKeyRef")
        if "value" in item:
            env[item["name"]] = str(item["value"])
        elif ref is not None:
            env[item["name"]] = str(find(objects, "ConfigMap", ref["name"])["data"][ref["key"]])
    return env


def expanded_args(objects: list[dict[str, Any]], container: dict[str, Any]) -> list[str]:
    """The container's args as the kubelet runs them: $(VAR) replaced by `manifest_env`."""
    env = manifest_env(objects, container)
    return [_VAR_REF.sub(lambda m: env.get(m.group(1), m.group(0)), a) for a in container.get("args", [])]
