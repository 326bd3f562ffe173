"""Drain planning with kubectl semantics: which pods are evicted, skipped or blocked, and why."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from remediator.actuators.drainplan import Blocker, DrainPlan, plan_drain
from remediator.cluster import LabelSelector, OwnerReference, Pod, PodDisruptionBudget

JOB = (OwnerReference(kind="Job", name="train", controller=True),)
DAEMONSET = (OwnerReference(kind="DaemonSet", name="exporter", controller=True),)
NOT_CONTROLLER = (OwnerReference(kind="ConfigMap", name="cm", controller=False),)


def pod(name: str, **kwargs: object) -> Pod:
    fields: dict[str, object] = {"namespace": "ml", "name": name, "node_name": "n1", "owners": JOB}
    fields.update(kwargs)
    return Pod(**fields)  # type: ignore[arg-type]


def pdb(
    allowed: int, *, name: str = "train-pdb", labels: dict[str, str] | None = None
) -> PodDisruptionBudget:
    return PodDisruptionBudget(
        namespace="ml",
        name=name,
        selector=LabelSelector(match_labels=labels if labels is not None else {"app": "train"}),
        disruptions_allowed=allowed,
    )


def plan(
    pods: list[Pod],
    pdbs: Sequence[PodDisruptionBudget] = (),
    *,
    delete_emptydir_data: bool = False,
    force_bare_pods: bool = False,
) -> DrainPlan:
    return plan_drain(pods, pdbs, delete_emptydir_data=delete_emptydir_data, force_bare_pods=force_bare_pods)


def where(result: DrainPlan, name: str) -> tuple[str, str]:
    for bucket in ("evict", "skip", "blocked"):
        for planned in getattr(result, bucket):
            if planned.name == name:
                return bucket, planned.reason
    raise AssertionError(name)


@pytest.mark.parametrize(
    ("the_pod", "perms", "bucket", "reason_part"),
    [
        (pod("job-pod"), {}, "evict", ""),
        (pod("mirror", annotations={"kubernetes.io/config.mirror": "abc"}), {}, "skip", "mirror pod"),
        (pod("ds", owners=DAEMONSET), {}, "skip", "DaemonSet ml/exporter"),
        (pod("bare", owners=()), {}, "blocked", "not managed by a controller"),
        (pod("not-controller", owners=NOT_CONTROLLER), {}, "blocked", "not managed by a controller"),
        (pod("bare", owners=()), {"force_bare_pods": True}, "evict", ""),
        (pod("scratch", emptydir_volumes=("tmp",)), {}, "blocked", "emptyDir volume(s) tmp"),
        (pod("scratch", emptydir_volumes=("tmp",)), {"delete_emptydir_data": True}, "evict", ""),
        (pod("done", owners=(), phase="Succeeded"), {}, "evict", "always deletable"),
        (pod("crashed", phase="Failed", emptydir_volumes=("x",)), {}, "evict", "always deletable"),
    ],
)
def test_each_kind_of_pod_lands_where_kubectl_drain_puts_it(
    the_pod: Pod, perms: dict[str, bool], bucket: str, reason_part: str
) -> None:
    got_bucket, reason = where(
        plan(
            [the_pod],
            delete_emptydir_data=perms.get("delete_emptydir_data", False),
            force_bare_pods=perms.get("force_bare_pods", False),
        ),
        the_pod.name,
    )
    assert got_bucket == bucket
    assert reason_part in reason


def test_permission_blocks_say_which_permission_is_missing() -> None:
    result = plan([pod("bare", owners=()), pod("scratch", emptydir_volumes=("tmp",))])
    assert [p.blocker for p in result.needs_permission] == [Blocker.PERMISSION, Blocker.PERMISSION]
    reasons = " ".join(p.reason for p in result.blocked)
    assert "force_bare_pods" in reasons
    assert "delete_emptydir_data" in reasons


def test_a_pdb_with_no_disruptions_allowed_blocks_the_eviction() -> None:
    result = plan([pod("w0", labels={"app": "train"})], (pdb(0),))
    assert where(result, "w0") == (
        "blocked",
        "blocked by PodDisruptionBudget ml/train-pdb (disruptionsAllowed=0)",
    )
    assert result.waiting_on_pdb[0].blocker is Blocker.PDB


def test_planned_evictions_use_up_the_pdb_so_the_second_pod_waits() -> None:
    result = plan([pod("w0", labels={"app": "train"}), pod("w1", labels={"app": "train"})], (pdb(1),))
    assert [p.name for p in result.evict] == ["w0"]
    assert where(result, "w1")[0] == "blocked"


def test_a_pdb_in_another_namespace_or_with_another_selector_does_not_apply() -> None:
    other_ns = PodDisruptionBudget(
        namespace="other", name="p", selector=LabelSelector(), disruptions_allowed=0
    )
    result = plan(
        [pod("w0", labels={"app": "train"})],
        (
            other_ns,
            pdb(0, labels={"app": "serve"}),
        ),
    )
    assert [p.name for p in result.evict] == ["w0"]


def test_an_empty_selector_covers_every_pod_of_its_namespace() -> None:
    result = plan([pod("w0", labels={"app": "anything"})], (pdb(0, labels={}),))
    assert where(result, "w0")[0] == "blocked"


def test_several_matching_pdbs_block_because_the_api_refuses() -> None:
    result = plan(
        [pod("w0", labels={"app": "train"})],
        (
            pdb(5, name="a"),
            pdb(5, name="b"),
        ),
    )
    assert "several PodDisruptionBudgets match" in where(result, "w0")[1]


def test_terminal_pods_do_not_use_up_a_pdb() -> None:
    result = plan(
        [pod("a-done", labels={"app": "train"}, phase="Succeeded"), pod("b-live", labels={"app": "train"})],
        [pdb(1)],
    )
    assert [p.name for p in result.evict] == ["a-done", "b-live"]


def test_details_and_summary_have_the_shape_the_decision_record_promises() -> None:
    result = plan(
        [pod("w0", labels={"app": "train"}), pod("w1", labels={"app": "train"}), pod("ds", owners=DAEMONSET)],
        [pdb(1)],
    )
    assert result.details() == {
        "evict": [{"namespace": "ml", "name": "w0", "owner": "Job/train"}],
        "skip": [{"namespace": "ml", "name": "ds", "reason": result.skip[0].reason}],
        "blocked": [{"namespace": "ml", "name": "w1", "reason": result.blocked[0].reason}],
    }
    assert result.summary(dry_run=True).startswith("would evict 1 pod [ml/w0], skip 1 [ml/ds], 1 waits")


# -- where the plan used to depart from kubectl drain (compared with kubectl's filters and the
# Eviction API's own rules) ------------------------------------------------------------------------


def test_a_pod_whose_daemonset_is_gone_is_an_orphan_that_needs_force_as_kubectl_says() -> None:
    orphan = pod("ds-orphan", owners=DAEMONSET)
    refused = plan_drain([orphan], [], delete_emptydir_data=False, force_bare_pods=False, daemonsets=set())
    bucket, reason = where(refused, "ds-orphan")
    assert bucket == "blocked"
    assert reason.startswith("its DaemonSet ml/exporter no longer exists: nothing would recreate it")
    assert refused.needs_permission  # kubectl refuses the whole drain without --force
    forced = plan_drain([orphan], [], delete_emptydir_data=False, force_bare_pods=True, daemonsets=set())
    assert where(forced, "ds-orphan")[0] == "evict"
    kept = plan_drain(
        [orphan], [], delete_emptydir_data=False, force_bare_pods=True, daemonsets={("ml", "exporter")}
    )
    assert where(kept, "ds-orphan")[0] == "skip"  # its DaemonSet exists: left alone even with force


@pytest.mark.parametrize("phase", ["Succeeded", "Failed"])
def test_a_finished_daemonset_pod_goes_as_kubectl_lets_it(phase: str) -> None:
    assert where(plan([pod("ds-done", owners=DAEMONSET, phase=phase)]), "ds-done") == (
        "evict",
        f"{phase} pod; always deletable",
    )


def test_a_pod_that_is_not_ready_goes_without_charging_a_budget_with_no_disruption_left() -> None:
    budget = PodDisruptionBudget(
        namespace="ml",
        name="train-pdb",
        selector=LabelSelector(match_labels={"app": "train"}),
        disruptions_allowed=0,
        current_healthy=3,
        desired_healthy=3,
    )
    unready = pod("train-unready", labels={"app": "train"}, ready=False)
    ready = pod("train-ready", labels={"app": "train"})
    result = plan([unready, ready], [budget])
    assert where(result, "train-unready")[0] == "evict"
    assert where(result, "train-ready")[0] == "blocked"  # a ready pod still waits on the budget


def test_an_unready_pod_waits_when_the_budgets_application_is_unhealthy_unless_always_allow() -> None:
    unhealthy = PodDisruptionBudget(
        namespace="ml",
        name="train-pdb",
        selector=LabelSelector(match_labels={"app": "train"}),
        disruptions_allowed=0,
        current_healthy=1,
        desired_healthy=3,
    )
    unready = pod("train-unready", labels={"app": "train"}, ready=False)
    assert where(plan([unready], [unhealthy]), "train-unready")[0] == "blocked"
    always = PodDisruptionBudget(
        namespace="ml",
        name="train-pdb",
        selector=LabelSelector(match_labels={"app": "train"}),
        disruptions_allowed=0,
        current_healthy=1,
        desired_healthy=3,
        unhealthy_pod_eviction_policy="AlwaysAllow",
    )
    assert where(plan([unready], [always]), "train-unready")[0] == "evict"


def test_pending_pods_and_pods_being_deleted_ignore_budgets() -> None:
    budget = pdb(0)
    pending = pod("train-pending", labels={"app": "train"}, phase="Pending")
    deleting = pod("train-deleting", labels={"app": "train"}, deleting=True)
    result = plan([pending, deleting], [budget])
    assert where(result, "train-pending")[0] == "evict"
    assert where(result, "train-deleting")[0] == "evict"
