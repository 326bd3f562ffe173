"""The `evidence` step: fetch the node's evidence from its exporter, add what this service knows, store
it, and say on the Node where it is, all within the step's deadline.

Once per alert episode, like every step: the Node write that sets the `accel-health.io/evidence`
annotation also records the step in the node's record (remediator/lifecycle/record.py), so a resend, or a new
leader, never captures again. A fetch that fails (no exporter pod, 401, no answer in time) still
stores a capture with this service's part and the error; a store that fails stores nothing. Either is
decided `failed` (an AccelEvidenceCaptureFailed Event, `accel_remediator_evidence_captures_total`),
and the next step runs: evidence never holds a remediation back longer than its deadline. A dry run
fetches and stores nothing."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Literal

from remediator.actuators.nodes import done
from remediator.audit import DecisionRecord
from remediator.cluster import Node, NodeWrites
from remediator.desired.firing import FiringSet
from remediator.evidence.bundle import ANNOTATION, FetchResult, build_capture, encode, remediator_version
from remediator.evidence.fetch import EvidenceFetcher
from remediator.evidence.store import EvidenceStore, EvidenceStoreError
from remediator.gates.gates import Gates
from remediator.lifecycle.model import ActionResult, Context
from remediator.policy import CaptureEvidence

logger = logging.getLogger("remediator.evidence")

CaptureOutcome = Literal["captured", "fetch_failed", "store_failed"]
CAPTURE_OUTCOMES: tuple[CaptureOutcome, ...] = ("captured", "fetch_failed", "store_failed")
"""The outcomes `accel_remediator_evidence_captures_total{outcome}` counts: stored with the node's
evidence; stored without it (the exporter did not answer); nothing stored."""
FETCH_SHARE = 0.6
"""The part of the deadline the fetch may use; the rest is the store's (a capture without the node's
evidence is still worth storing)."""


class EvidenceActuator:
    """Captures evidence through the fetcher and the store it is handed."""

    def __init__(
        self,
        *,
        fetcher: EvidenceFetcher | None,
        store: EvidenceStore | None,
        nodes: NodeWrites,
        gates: Gates,
        firing: FiringSet,
        history: Callable[[str], Sequence[DecisionRecord]],
        clock: Callable[[], float],
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._fetcher = fetcher
        self._store = store
        self._cluster = nodes
        self._gates = gates
        self._firing = firing
        self._history = history
        """node -> this service's decision records for it, oldest first."""
        self._clock = clock
        self._monotonic = monotonic
        """Measures the deadline (asyncio's own timeouts run on the loop's clock)."""
        self._version = remediator_version()

    def _store_words(self) -> str:
        return self._store.describe() if self._store is not None else "nowhere"

    async def capture(self, ctx: Context, node: Node, action: CaptureEvidence) -> ActionResult:
        if self._store is None or self._fetcher is None:
            return ActionResult("skipped", "evidence capture is not configured in this service")
        if (held := self._gates.check(ctx, "evidence", node.name)) is not None:
            return held
        if ctx.dry_run:
            self._gates.commit(ctx, "evidence", node.name)
            return done(
                ctx,
                "",
                would=(
                    f"would fetch the node's evidence from its exporter and store it in "
                    f"{self._store_words()} (deadline {action.timeout_seconds} s)"
                ),
            )
        began = self._monotonic()
        deadline = float(action.timeout_seconds)
        fetch = await self._fetch(node.name, deadline * FETCH_SHARE)
        captured_at = self._clock()
        capture = build_capture(
            node_name=node.name,
            node=node,
            alert=ctx.alert,
            rule=ctx.rule.name,
            others=self._firing.causes(node.name),
            decisions=self._history(node.name),
            fetch=fetch,
            captured_at=captured_at,
            version=self._version,
        )
        body = encode(capture)
        alertname = ctx.alert.labels.get("alertname", "")
        location, store_error = "", ""
        left = max(deadline - (self._monotonic() - began), 0.001)
        try:
            async with asyncio.timeout(left):
                location = await self._store.put(
                    node=node.name, captured_at=captured_at, alertname=alertname, body=body
                )
        except TimeoutError:
            store_error = f"not stored within the {action.timeout_seconds} s deadline"
        except EvidenceStoreError as exc:
            store_error = str(exc)
        seconds = self._monotonic() - began
        outcome: CaptureOutcome = (
            "store_failed" if store_error else "captured" if fetch.ok else "fetch_failed"
        )
        annotations = {ANNOTATION: location} if location else {}
        # The step's record (and where the capture is) in one write: a resend never captures again.
        await self._cluster.annotate_node(
            node.name, annotations, record=ctx.record("evidence", self._clock())
        )
        self._gates.commit(ctx, "evidence", node.name)
        details = {
            "capture": outcome,
            "location": location or None,
            "bytes": len(body),
            "seconds": round(seconds, 3),
            "fetch": fetch.as_json(),
            **({"store_error": store_error} if store_error else {}),
        }
        if outcome == "captured":
            return done(ctx, f"evidence stored at {location}", would="", details=details)
        logger.warning("%s: evidence capture %s: %s", node.name, outcome, store_error or fetch.error)
        if outcome == "fetch_failed":
            why = f"the node's evidence not fetched ({fetch.error}); this service's part stored at {location}"
        else:
            why = f"evidence not stored ({store_error})" + (
                "" if fetch.ok else f"; nor fetched ({fetch.error})"
            )
        return ActionResult("failed", why, details=details, done=why)

    async def _fetch(self, node: str, seconds: float) -> FetchResult:
        assert self._fetcher is not None  # capture() checked
        began = self._monotonic()
        try:
            async with asyncio.timeout(seconds):
                return await self._fetcher.fetch(node)
        except TimeoutError:
            return FetchResult(
                None, None, f"no answer within {seconds:.1f} s", seconds=self._monotonic() - began
            )
