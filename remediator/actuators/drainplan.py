"""Drain planning with `kubectl drain` semantics (pure: pods and PDBs in, a plan out).

Per pod, as kubectl's filters decide (k8s.io/kubectl/pkg/drain): mirror pods are skipped (the
kubelet owns them); a Succeeded or Failed pod can always go, a DaemonSet's too; a running pod of a
DaemonSet that exists is skipped (its controller would recreate it at once), one whose DaemonSet no
longer exists is an orphan: nothing recreates it, so it needs permission (`force_bare_pods`, as
kubectl's --force) like a pod without a controller; pods with emptyDir volumes need permission too.
The rest are evicted unless a PodDisruptionBudget refuses, as the Eviction API decides it: a
Pending pod or one being deleted ignores budgets; a pod that is not Ready goes without charging its
budget when the budget lets unready pods go (AlwaysAllow, or IfHealthyBudget while the application
is healthy); otherwise the budget's `disruptionsAllowed` is consumed, so with one disruption allowed
the second ready pod under that PDB waits.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from remediator.cluster import Pod, PodDisruptionBudget

MIRROR_ANNOTATION = "kubernetes.io/config.mirror"


class Blocker(enum.Enum):
    """Why a pod cannot be evicted now."""

    PERMISSION = "permission"
    """Evicting it loses something (bare pod, emptyDir data); the policy did not allow that."""
    PDB = "pdb"
    """A PodDisruptionBudget refuses (429) or several match (500): waiting may help."""


@dataclass(frozen=True)
class PlannedPod:
    """One pod's place in a drain plan."""

    namespace: str
    """Pod namespace."""
    name: str
    """Pod name."""
    owner: str | None
    """Controller as `Kind/name`, None for a bare pod."""
    reason: str
    """Why it is skipped or blocked (empty for evictions)."""
    blocker: Blocker | None = None
    """For blocked pods: what blocks it."""

    def as_json(self, *, with_owner: bool) -> dict[str, str | None]:
        """The decision record's `details` entry."""
        if with_owner:
            return {"namespace": self.namespace, "name": self.name, "owner": self.owner}
        return {"namespace": self.namespace, "name": self.name, "reason": self.reason}


@dataclass(frozen=True)
class DrainPlan:
    """What draining a node would do."""

    evict: tuple[PlannedPod, ...]
    """Pods to evict, in order."""
    skip: tuple[PlannedPod, ...]
    """Pods a drain leaves alone (mirror, DaemonSet)."""
    blocked: tuple[PlannedPod, ...]
    """Pods that cannot be evicted now, each with the reason."""

    @property
    def needs_permission(self) -> tuple[PlannedPod, ...]:
        """Blocked pods that waiting will not help: kubectl refuses the whole drain for these."""
        return tuple(p for p in self.blocked if p.blocker is Blocker.PERMISSION)

    @property
    def waiting_on_pdb(self) -> tuple[PlannedPod, ...]:
        """Blocked pods that a later attempt may evict."""
        return tuple(p for p in self.blocked if p.blocker is Blocker.PDB)

    def details(self) -> dict[str, list[dict[str, str | None]]]:
        """The `details` object of a drain decision record."""
        return {
            "evict": [p.as_json(with_owner=True) for p in self.evict],
            "skip": [p.as_json(with_owner=False) for p in self.skip],
            "blocked": [p.as_json(with_owner=False) for p in self.blocked],
        }

    def summary(self, *, dry_run: bool) -> str:
        """One line: `would evict 2 pods [ns/a, ns/b], skip 2 [...], 1 waits [...]`."""

        def names(pods: Iterable[PlannedPod]) -> str:
            return "[" + ", ".join(f"{p.namespace}/{p.name}" for p in pods) + "]"

        verb = "would evict" if dry_run else "evict"
        parts = [f"{verb} {len(self.evict)} pod{'s' if len(self.evict) != 1 else ''} {names(self.evict)}"]
        if self.skip:
            parts.append(f"skip {len(self.skip)} {names(self.skip)}")
        if self.waiting_on_pdb:
            parts.append(
                f"{len(self.waiting_on_pdb)} wait{'s' if len(self.waiting_on_pdb) == 1 else ''} "
                f"on a PodDisruptionBudget {names(self.waiting_on_pdb)}"
            )
        if self.needs_permission:
            parts.append(f"{len(self.needs_permission)} need permission {names(self.needs_permission)}")
        return ", ".join(parts)


def _owner(pod: Pod) -> str | None:
    ctl = pod.controller
    return f"{ctl.kind}/{ctl.name}" if ctl else None


def plan_drain(  # noqa: PLR0912  one branch per kubectl filter, in kubectl's order
    pods: Iterable[Pod],
    pdbs: Iterable[PodDisruptionBudget],
    *,
    delete_emptydir_data: bool,
    force_bare_pods: bool,
    daemonsets: Collection[tuple[str, str]] | None = None,
) -> DrainPlan:
    """Decide, for every pod on the node, whether a drain evicts, skips or is blocked by it.
    `daemonsets`: (namespace, name) of the DaemonSets that exist (None: unknown, every one counts
    as existing)."""
    budgets = list(pdbs)
    allowed = {(b.namespace, b.name): b.disruptions_allowed for b in budgets}
    evict: list[PlannedPod] = []
    skip: list[PlannedPod] = []
    blocked: list[PlannedPod] = []
    for pod in sorted(pods, key=lambda p: (p.namespace, p.name)):
        owner = _owner(pod)

        def entry(
            reason: str, blocker: Blocker | None = None, *, pod: Pod = pod, owner: str | None = owner
        ) -> PlannedPod:
            return PlannedPod(
                namespace=pod.namespace, name=pod.name, owner=owner, reason=reason, blocker=blocker
            )

        if MIRROR_ANNOTATION in pod.annotations:
            skip.append(entry("mirror pod (static pod managed by the kubelet); kubectl drain skips it"))
            continue
        ctl = pod.controller
        if pod.phase in ("Succeeded", "Failed"):
            evict.append(entry(f"{pod.phase} pod; always deletable"))
            continue
        if ctl is not None and ctl.kind == "DaemonSet":
            if daemonsets is None or (pod.namespace, ctl.name) in daemonsets:
                skip.append(
                    entry(
                        f"managed by DaemonSet {pod.namespace}/{ctl.name}; kubectl drain ignores "
                        "DaemonSet pods"
                    )
                )
                continue
            if not force_bare_pods:
                blocked.append(
                    entry(
                        f"its DaemonSet {pod.namespace}/{ctl.name} no longer exists: nothing would "
                        "recreate it (allow: force_bare_pods: true)",
                        Blocker.PERMISSION,
                    )
                )
                continue
        if ctl is None and not force_bare_pods:
            blocked.append(
                entry(
                    "not managed by a controller: nothing would recreate it (allow: force_bare_pods: true)",
                    Blocker.PERMISSION,
                )
            )
            continue
        if pod.emptydir_volumes and not delete_emptydir_data:
            vols = ", ".join(pod.emptydir_volumes)
            blocked.append(
                entry(
                    f"emptyDir volume(s) {vols} would lose their data (allow: delete_emptydir_data: true)",
                    Blocker.PERMISSION,
                )
            )
            continue
        if pod.phase == "Pending" or pod.deleting:
            evict.append(entry(""))  # the Eviction API ignores budgets for these
            continue
        matching = [b for b in budgets if b.namespace == pod.namespace and b.selector.matches(pod.labels)]
        if len(matching) > 1:
            names = ", ".join(f"{b.namespace}/{b.name}" for b in matching)
            blocked.append(
                entry(
                    f"several PodDisruptionBudgets match ({names}); the eviction API refuses (500)",
                    Blocker.PDB,
                )
            )
            continue
        if matching and not pod.ready and matching[0].lets_unready_go():
            evict.append(entry(""))  # not Ready: it goes without charging the budget
            continue
        if matching:
            pdb = matching[0]
            key = (pdb.namespace, pdb.name)
            if allowed[key] <= 0:
                blocked.append(
                    entry(
                        f"blocked by PodDisruptionBudget {pdb.namespace}/{pdb.name} (disruptionsAllowed=0)",
                        Blocker.PDB,
                    )
                )
                continue
            allowed[key] -= 1
        evict.append(entry(""))
    return DrainPlan(evict=tuple(evict), skip=tuple(skip), blocked=tuple(blocked))
