"""The node-pool examples (examples/node-pools/) register nodes with the repair loop's startup taint.

Each example names exactly the taint the loop lifts (`remediator.lifecycle.repair.STARTUP_TAINT`: key, value
and effect), in its own syntax: a Karpenter NodePool's `startupTaints`, an eksctl managed node
group's `taints`, the kubelet's `--register-with-taints` in a nodeadm NodeConfig; and docs/closed-loop.md's
node-pool section points at each of them. That the loop lifts it from a node that registered with
it is shown on the real API server (tests/kube/test_repair.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from remediator.lifecycle.repair import STARTUP_TAINT

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples" / "node-pools"


def load(name: str) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((EXAMPLES / name).read_text(encoding="utf-8"))
    return doc


def kubelet_taint(flag: str) -> dict[str, str]:
    """`--register-with-taints=key=value:effect` -> the taint, as the kubelet reads it."""
    spec = flag.removeprefix("--register-with-taints=")
    key_value, _, effect = spec.rpartition(":")
    key, _, value = key_value.partition("=")
    return {"key": key, "value": value, "effect": effect}


STARTUP = {"key": STARTUP_TAINT.key, "value": STARTUP_TAINT.value, "effect": STARTUP_TAINT.effect}


def test_the_karpenter_node_pool_registers_nodes_with_the_startup_taint_only_as_a_startup_taint() -> None:
    spec = load("karpenter-nodepool.yaml")["spec"]["template"]["spec"]
    assert spec["startupTaints"] == [STARTUP]
    assert STARTUP_TAINT.key not in {t["key"] for t in spec.get("taints", [])}  # pods need not tolerate it


def test_the_eks_managed_node_group_registers_nodes_with_the_startup_taint() -> None:
    (group,) = load("eks-managed-nodegroup.yaml")["managedNodeGroups"]
    assert STARTUP in group["taints"]


def test_the_nodeadm_config_passes_the_kubelet_the_startup_taint() -> None:
    flags = load("nodeadm-nodeconfig.yaml")["spec"]["kubelet"]["flags"]
    taints = [kubelet_taint(f) for f in flags if f.startswith("--register-with-taints=")]
    assert taints == [STARTUP]


def test_the_readme_points_at_every_node_pool_example() -> None:
    readme = (REPO / "docs" / "closed-loop.md").read_text(encoding="utf-8")
    for example in sorted(EXAMPLES.glob("*.yaml")):
        assert f"examples/node-pools/{example.name}" in readme, example.name
