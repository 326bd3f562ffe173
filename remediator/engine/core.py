"""The engine as the service uses it: lifecycle (sync on leadership, drains waited for or stopped) and
the gates at a glance."""

from __future__ import annotations

import asyncio
import logging

from remediator.engine.intake import Intake
from remediator.engine.model import GateStatus
from remediator.engine.stored import made_up_payload

logger = logging.getLogger("remediator.decisions")


class Engine(Intake):
    """Turns webhook deliveries into decisions and actions. One per service; not thread-safe."""

    async def sync(self) -> None:
        """Read the gate state now if it needs reading (a new leader does this before it is ready),
        then resume the drains a previous leader left running: Alertmanager will not resend their
        alerts for a repeat_interval. A resumed drain keeps its deadline (node annotations) and evicts
        only what is still there; the actions before it are already decided (idempotency keys)."""
        async with self._lock:
            await self._load()
            resume = {n: a for n, a in self._resume.items() if n not in self._drains}
            self._resume = {}
        for node, alerts in resume.items():
            logger.warning("resuming the drain of %s left running by the previous leader", node)
            await self.handle(
                made_up_payload(alerts, group_key="accel-health/resume", receiver="accel-health-remediator")
            )

    async def drained(self) -> None:
        """Wait until no drain runs in the background and the actions after each were decided."""
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def stop(self) -> None:
        """Cancel the drains running in the background (service shutdown); idempotent.

        A cancelled drain is not decided: Alertmanager's next delivery (to this service again or to
        the next leader) starts it again, and the executor resumes it with its original deadline.
        A drain that already ended still records its end and decides the actions after it.
        """
        self._stopping = True
        for drain in self._drains.values():
            if drain.task is not None and not drain.ended:
                drain.task.cancel()
        await self.drained()

    def status(self) -> GateStatus:
        """The gates now (evaluates the breaker on the clock, so a scrape sees it close)."""
        st = self.state
        if st.breaker.evaluate(alerting=self._alerting_nodes()):
            self._dirty = True
        deferred: dict[str, int] = {}
        for pending in self.pending.values():
            gate = pending.record.gate or "unknown"
            deferred[gate] = deferred.get(gate, 0) + 1
        return GateStatus(
            paused=st.pause.paused,
            pause_reason=st.pause.reason,
            breaker_open=st.breaker.open,
            breaker_trips=st.breaker.trips,
            breaker=st.breaker.describe(),
            alerting_nodes=st.breaker.alerting,
            eligible_nodes=st.breaker.eligible,
            budget_in_use=st.budget.in_use,
            budget_capacity=st.budget.capacity,
            budget_holders={
                n: {"since": h.since, "kinds": sorted(h.kinds), "dry_run": h.dry_run}
                for n, h in st.budget.holders().items()
            },
            budget_others=dict(st.budget.others),
            firing=st.firing.as_json(),
            rule_budgets=self.scoped.usage(st.budget.holders()),
            rate_limits=st.rate.usage(),
            deferred=deferred,
            drains={name: running.as_json() for name, running in self._drains.items()},
            # Only the Kubernetes executor has optional APIs; the Cluster seam does not require it.
            api_unavailable=dict(getattr(self._cluster, "api_unavailable", {})),
        )
