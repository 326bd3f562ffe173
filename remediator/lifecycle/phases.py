"""The phases of a node's remediation: from the first fault back to the pool, each written on the node
(its record's `p`, remediator/lifecycle/record.py) by the same request that moves it, each
transition told by an Event. Pure: no I/O.

    healthy ──fault──> held ──> evidence ──> draining ──> repair ──> verifying ──> returned (healthy)
                        │           │            │           │            │
                        └───────────┴──── escalated (a human decides) ────┘
              any phase ──a human uncordons or removes the taint──> released

A node with no record is healthy (or was returned: the return's own write removes the record).
"""

from __future__ import annotations

from dataclasses import dataclass

from remediator.lifecycle.record import PHASE_ORDER


@dataclass(frozen=True)
class Phase:
    """One phase of the lifecycle."""

    name: str
    """As the record stores it and `accel-health status` prints it."""
    meaning: str
    """What the node is going through, in words."""
    entered_by: str
    """The write (or writes) that move a node into it."""
    event: str
    """The Event reason(s) that tell of the transition."""
    leaves_when: str
    """What moves the node on."""


PHASES: tuple[Phase, ...] = (
    Phase(
        "held",
        "out of the pool: the condition set, cordoned or tainted",
        "a `condition` (False), `cordon` or `taint` step of a firing alert",
        "AccelConditionSet, AccelCordoned, AccelTainted (the first with AccelFaultDetected)",
        "the rule's next step (evidence, drain); a repair (new boot id, new node) then verification; "
        "a human's uncordon or taint removal",
    ),
    Phase(
        "evidence",
        "the node's evidence captured for the vendor before anything loses it",
        "the `evidence` step's write (where the capture is)",
        "AccelEvidenceCaptured, AccelEvidenceCaptureFailed (never holds the next step back)",
        "the next step",
    ),
    Phase(
        "draining",
        "its pods are being evicted, PodDisruptionBudgets honoured, until done or the deadline",
        "the drain's start (cordon, deadline and episode in one write)",
        "AccelDrainStarted",
        "the drain's end: done or on_timeout: proceed -> repair; refused or timed out -> escalated; a "
        "human's uncordon -> released (the drain stops, recorded `stopped`)",
    ),
    Phase(
        "repair",
        "drained and waiting for its repair: a reboot asked of EC2, a replacement by its Auto Scaling "
        "group or provisioner, or a human's",
        "the drain's end; `aws_reboot`, `aws_set_unhealthy` (the intent, before the call); a failed "
        "verification (the next repair is awaited)",
        "AccelDrainFinished, AccelInstanceRebooted, AccelInstanceMarkedUnhealthy",
        "a new boot id or a new node object/instance, and no fault firing: verifying",
    ),
    Phase(
        "verifying",
        "repaired; the active checks run on it while it is still cordoned",
        "the repair loop, before it asks the node's exporter for the checks",
        "AccelRepairVerifying",
        "checks pass and no fault fires at the return's write: returned (the record removed, "
        "AccelReturnedToPool); a check fails: repair (AccelRepairCheckFailed)",
    ),
    Phase(
        "escalated",
        "a human decides: the drain was refused or timed out (on_timeout: stop), or the node was "
        "quarantined too often within the window",
        "the drain's end; the repair loop's escalation (the needs-human label)",
        "AccelDrainBlocked, AccelRepeatedFaultsEscalated",
        "a human: uncordon (released), or remove the label (the repair loop takes it again)",
    ),
    Phase(
        "released",
        "someone other than accel-health uncordoned it or removed its taint: the remediation of the "
        "episodes recorded then ends, their budget slot is free, nothing more is done for them",
        "the node watch sees the change; one write marks the episodes (and stops a running drain)",
        "AccelReleasedByHuman",
        "a new alert episode starts afresh (held); the record goes when the old episodes end",
    ),
)
"""Every phase, in the order of the way out and back."""

NAMES: tuple[str, ...] = tuple(p.name for p in PHASES)
assert NAMES[: len(PHASE_ORDER)] == PHASE_ORDER  # the record's order of the way out and back

KIND_PHASE = {
    "condition": "held",
    "cordon": "held",
    "taint": "held",
    "evidence": "evidence",
    "drain": "draining",
    "aws_reboot": "repair",
    "aws_set_unhealthy": "repair",
}
"""The phase a firing alert's step moves its node to (with the step's own write)."""

HEALTHY = "healthy"
"""No record on the node: nothing of this service's holds it (also the phase after a return)."""


def phase_of(kind: str) -> str:
    """The phase the write of a firing alert's `kind` step asks for ("" for none)."""
    return KIND_PHASE.get(kind, "")
