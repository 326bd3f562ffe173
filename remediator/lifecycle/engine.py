"""The engine the service uses: its parts put together, the intake of desired state (webhook
deliveries, Alertmanager's API), a new leader's rebuild from the nodes, and the gates at a glance."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from remediator.actuators.aws import AwsActuator
from remediator.actuators.events import EventRecorder
from remediator.actuators.evidence import EvidenceActuator
from remediator.actuators.nodes import NodeActuator
from remediator.audit import DecisionLog, DecisionRecord
from remediator.cluster import Aws, BackendUnavailable, Cluster, Node
from remediator.desired.alertmanager import AlertmanagerView
from remediator.desired.firing import Cause, FiringSet
from remediator.desired.stored import made_up_payload, resolved_alert
from remediator.evidence.fetch import EvidenceFetcher
from remediator.evidence.store import EvidenceStore
from remediator.gates.gates import Gates, LatchStore
from remediator.gates.safety import DisruptionBudget
from remediator.intake.payload import Alert, WebhookPayload
from remediator.lifecycle.drains import DrainRunner
from remediator.lifecycle.migrate import migrate_legacy_state
from remediator.lifecycle.model import AlertPlan, EngineSettings, GateStatus, Observed, PendingAction
from remediator.lifecycle.node import NodeLifecycle
from remediator.lifecycle.queue import NodeQueue
from remediator.lifecycle.record import (
    CORDONED_BY,
    DRAIN_STATUS,
    EPISODES,
    TAINTS_ADDED,
    Episode,
    starts_at_text,
)
from remediator.lifecycle.repair import QUARANTINE, REPAIR_FAILED, quarantine_annotations
from remediator.lifecycle.status import phase_counts
from remediator.lifecycle.steps import Decided, Decisions, Key, Reconciler
from remediator.lifecycle.view import NodeView, taint_values
from remediator.policy import Policy, Selection

logger = logging.getLogger("remediator.decisions")

AlertmanagerRead = Callable[[], Awaitable[AlertmanagerView | None]]
MARKS = (CORDONED_BY, TAINTS_ADDED, EPISODES, DRAIN_STATUS)
"""Annotations that make a node this service's business (a change to such a node is looked at)."""
NODE_BATCH = 32
"""Nodes decided together when one payload names many (remediator/lifecycle/engine.py, `handle`)."""
ALERTMANAGER_READ_SECONDS = 2.0
"""How long a new leader waits for its one Alertmanager read before it reports ready anyway (the
poller keeps reading; until one answers, the nodes' records and the webhook are the desired state)."""


class Engine:
    """Turns webhook deliveries into decisions and actions. One per service; not thread-safe.

    Handed its collaborators (the cluster and AWS seams, the clock, optionally a decision log), it
    builds its parts, each with a small interface of its own:
    `NodeView` (the nodes and this service's records on them), `Gates` (+ `LatchStore`),
    `EventRecorder`, `NodeActuator`, `AwsActuator`, `EvidenceActuator` (handed the evidence fetcher
    and store, when the service has them), `DrainRunner` and the `Reconciler` that decides one
    alert's actions through them.
    """

    def __init__(
        self,
        *,
        policy: Policy,
        cluster: Cluster,
        aws: Aws,
        settings: EngineSettings,
        clock: Callable[[], float],
        log: DecisionLog | None = None,
        evidence_fetcher: EvidenceFetcher | None = None,
        evidence_store: EvidenceStore | None = None,
    ) -> None:
        self.policy = policy
        self.settings = settings
        self._cluster = cluster
        self._clock = clock
        self.queue = NodeQueue()
        """One reconcile per node at a time, nodes in parallel (remediator/lifecycle/queue.py)."""
        self._sync_lock = asyncio.Lock()
        self._latch_lock = asyncio.Lock()
        values = taint_values(policy.rules)
        self.view = NodeView(cluster=cluster, taints=values)
        self.gates = Gates(policy=policy, clock=clock, dry_run=settings.dry_run)
        self.latches = LatchStore(store=cluster, clock=clock)
        self.firing = FiringSet(clock=clock, expiry_seconds=policy.safety.alert_expiry_seconds)
        """The desired state: the alerts firing now, per node."""
        self.decided = Decided()
        self.decisions = Decisions(log=log if log is not None else DecisionLog(), clock=clock)
        self.events = EventRecorder(sink=cluster, mode=policy.events, seen=self.decided.first)
        self.drains = DrainRunner(
            cluster=cluster,
            gates=self.gates,
            view=self.view,
            settings=settings.drain,
            clock=clock,
            lock=self.queue.lock,
        )
        actuator = NodeActuator(
            nodes=cluster,
            events=cluster,
            view=self.view,
            gates=self.gates,
            firing=self.firing,
            draining=self.drains.draining,
            taint_values=values,
            clock=clock,
            quarantine=self._quarantine if policy.repair.enabled else None,
        )
        self.reconciler = Reconciler(
            policy=policy,
            settings=settings,
            view=self.view,
            gates=self.gates,
            firing=self.firing,
            events=self.events,
            nodes=actuator,
            aws=AwsActuator(aws=aws, nodes=cluster, gates=self.gates, clock=clock),
            evidence=EvidenceActuator(
                fetcher=evidence_fetcher,
                store=evidence_store,
                nodes=cluster,
                gates=self.gates,
                firing=self.firing,
                history=self._history,
                clock=clock,
            ),
            drains=self.drains,
            decisions=self.decisions,
            decided=self.decided,
            clock=clock,
        )
        self.lifecycle = NodeLifecycle(
            policy=policy,
            view=self.view,
            firing=self.firing,
            drains=self.drains,
            reconciler=self.reconciler,
            events=self.events,
            decisions=self.decisions,
            writer=cluster,
            observe=self._observe_nodes,
            resume=self._resume,
            clock=clock,
            node_label=settings.node_label,
            dry_run=settings.dry_run,
        )
        """The background reconcile of one node (a human's release, a drain nobody runs)."""
        self.queue.bind(self._reconcile_node)
        watch = getattr(cluster, "watch_nodes", None)
        if callable(watch):
            watch(self._node_changed)
        self.alertmanager: AlertmanagerRead | None = None
        """One read of Alertmanager's API, made by a new leader before it is ready (the service sets it)."""
        self._synced = False
        self._latch_dirty = False
        self._phase_memo: dict[str, tuple[Node, str]] = {}
        self.rebuilds = 0
        """How often the view was rebuilt from the nodes (a metric for tests)."""

    # -- what tests, the service and the metrics read ----------------------------------------------

    @property
    def log(self) -> DecisionLog:
        return self.decisions.log

    @property
    def pending(self) -> Mapping[Key, PendingAction]:
        """Deferred actions by idempotency key, oldest first."""
        return self.reconciler.pending

    @property
    def budget(self) -> DisruptionBudget:
        return self.gates.budget

    @property
    def suppressed(self) -> dict[str, str]:
        return self.reconciler.suppressed

    def subscribe(self, listener: Callable[[DecisionRecord], None]) -> None:
        """Call `listener` with every new decision record (metrics, audit sinks)."""
        self.decisions.subscribe(listener)

    def publish(self, record: DecisionRecord) -> None:
        """A decision made outside a delivery (the repair loop): logged and shown like the others."""
        self.decisions.publish(record)

    def causes(self, node: str) -> list[Cause]:
        """The alerts firing now on `node` (the repair loop waits until none holds it)."""
        return self.firing.causes(node)

    def _history(self, node: str) -> list[DecisionRecord]:
        """This service's decision records for `node`, oldest first (what a capture of evidence keeps)."""
        return [r for r in self.decisions.log.records() if r.node == node]

    def _quarantine(self, node: Node, ctx: Any, status: str) -> dict[str, str | None]:
        """The repair loop's record of a quarantine (remediator/lifecycle/repair.py), in the write that
        sets the condition: started by status False, ended by True. The loop then finds it as it should be and
        writes nothing on the node (it keeps or drops its durable copy)."""
        if status != "False":
            return dict.fromkeys((k for k in (QUARANTINE, REPAIR_FAILED) if k in node.annotations), None)
        if QUARANTINE in node.annotations:
            return {}
        started: dict[str, str | None] = {}
        started |= quarantine_annotations(
            node,
            causes=self.firing.causes(node.name),
            now=self._clock(),
            window_seconds=self.policy.repair.window_seconds,
            reason=ctx.alert.labels.get("alertname", ""),
        )
        return started

    # -- leadership and the rebuild ----------------------------------------------------------------

    async def start(self) -> None:
        """Rebuild the view from the nodes now. Unusable stored gates pause the service (loudly);
        BackendUnavailable propagates."""
        await self._ensure_synced()

    async def _ensure_synced(self) -> None:
        """Rebuild from the nodes unless done since start or since this replica last became leader
        (one rebuild at a time; the nodes' reconciles wait for it, not for each other)."""
        if self._synced:
            return
        async with self._sync_lock:
            await self._rebuild()

    def became_leader(self) -> None:
        """This replica now leads: what it derived before may be stale; it rebuilds before its next
        decision (`synced` is False until then)."""
        if not self.settings.dry_run:
            self._synced = False

    @property
    def synced(self) -> bool:
        """The view was rebuilt since start or since this replica last became the leader."""
        return self._synced

    async def sync(self) -> None:
        """Rebuild from the nodes if needed (a new leader does this before it is ready; raises
        BackendUnavailable when the API cannot be read: the caller retries), read Alertmanager once,
        then resume the drains a previous leader left running: Alertmanager will not resend their
        alerts for a repeat_interval."""
        fresh = not self._synced
        await self._ensure_synced()
        if fresh and self.alertmanager is not None:
            try:
                async with asyncio.timeout(ALERTMANAGER_READ_SECONDS):
                    view = await self.alertmanager()
            except TimeoutError:
                view = None
                logger.warning(
                    "Alertmanager not read within %.0f s; ready without it", ALERTMANAGER_READ_SECONDS
                )
            if view is not None:
                await self.reconcile(view)
        if fresh and not self.settings.dry_run:
            # Every node that carries this service's marks is looked at once: a drain left running is
            # resumed (or ended), a human's release seen while no leader watched is honoured.
            for node in await self.view.all():
                if any(k in node.annotations for k in MARKS):
                    self.queue.add(node.name)

    async def _rebuild(self) -> None:
        """Derive what this replica must remember from the nodes: budget holders and ownership (read
        afresh at every decision anyway), the alerts whose episodes hold nodes (desired state until
        Alertmanager or a delivery says otherwise), rate-limit times, the drains to resume; read the
        gates document; move an older release's document onto the nodes."""
        if self._synced:
            return
        nodes = await self.view.all()
        if not self.settings.dry_run:
            try:
                if await migrate_legacy_state(cluster=self._cluster, policy=self.policy, nodes=nodes):
                    nodes = await self.view.all()
            except BackendUnavailable as exc:  # a follower (NotLeader): the leader moves it
                logger.info("the older release's gate state not moved now (%s)", exc)
        await self.latches.load(self.gates.pause, self.gates.breaker)
        self.gates.observe(nodes, self.view.holds(nodes))
        self.gates.rebuild_rate_limits(
            (kind, float(at)) for node in nodes for kind, at in self.view.record(node).times.items()
        )
        label = self.settings.node_label
        by_name = {n.name: n for n in nodes}
        draining = 0
        for name, episodes in self.view.episodes(nodes).items():
            node = by_name[name]
            for episode in episodes:
                rule = self.policy.rule(episode.rule)
                if rule is None:
                    logger.warning(
                        "%s: episode of rule %r no longer in the policy; ignored", name, episode.rule
                    )
                    continue
                alert = _alert_of(episode, node=name, label=label)
                if self.firing.known(name, episode.fingerprint) is None:
                    self.firing.firing(
                        name,
                        fingerprint=episode.fingerprint,
                        alertname=episode.alertname,
                        rule=rule,
                        labels=alert.labels,
                        starts_at=alert.starts_at,
                        released=episode.released,
                    )
            if node.annotations.get(DRAIN_STATUS) == "in-progress":
                draining += 1
        self._synced = True
        self.rebuilds += 1
        logger.info(
            "rebuilt from %d node(s): %d held, %d with alerts recorded, %d drain(s) in progress; "
            "breaker %s, %s",
            len(nodes),
            len(self.gates.budget.holders()),
            len(self.firing.nodes()),
            draining,
            "OPEN" if self.gates.breaker.open else "closed",
            "PAUSED" if self.gates.pause.paused else "not paused",
        )

    # -- desired state in, decisions out ----------------------------------------------------------

    async def handle(self, payload: WebhookPayload) -> list[AlertPlan]:
        """Decide (and act) on every alert of a delivery: the desired state and the breaker first
        (no lock: memory only), then each node's alerts under that node's lock, nodes in parallel.
        BackendUnavailable (the webhook's 503) once every node's work has ended."""
        await self._ensure_synced()
        observed = await self._observe(payload)
        by_node: dict[str, list[int]] = {}
        for index, item in enumerate(observed):
            by_node.setdefault(item.node_name, []).append(index)
        plans: list[AlertPlan | None] = [None] * len(observed)

        async def one(node: str, indices: list[int]) -> None:
            items = [observed[i] for i in indices]
            async with self.queue.lock(node) if node else contextlib.nullcontext():
                for index, plan in zip(indices, await self._decide_node(node, items), strict=True):
                    plans[index] = plan

        try:
            if len(by_node) == 1:  # one node (most deliveries): no task of its own
                await one(*next(iter(by_node.items())))
            else:
                # Many nodes (Alertmanager's view, thousands in a storm): NODE_BATCH nodes at a time,
                # the event loop free between batches. All at once, their decisions (milliseconds
                # each when nothing is written) ran in one turn of the loop: every delivery, probe
                # and Lease renewal waited for the whole view (seconds at 5,000 alerts).
                items = list(by_node.items())
                failure: BaseException | None = None
                for start in range(0, len(items), NODE_BATCH):
                    if start:
                        await asyncio.sleep(0)
                    batch = items[start : start + NODE_BATCH]
                    results = await asyncio.gather(
                        *(one(node, indices) for node, indices in batch), return_exceptions=True
                    )
                    failure = failure or next((r for r in results if isinstance(r, BaseException)), None)
                if failure is not None:
                    raise failure
            done = [p for p in plans if p is not None]
            if not self.settings.dry_run and any(r.outcome == "done" for p in done for r in p.records):
                await self._observe_nodes()  # what it holds now, as the nodes show it
            return done
        finally:
            await self._save_latches()

    async def _decide_node(self, node: str, items: list[Observed]) -> list[AlertPlan]:
        """Decide these alerts of one node, in order (the caller holds the node's lock)."""
        plans = [await self.reconciler.handle_alert(item) for item in items]
        if node and any(item.alert.status == "resolved" for item in items):
            await self.reconciler.release_held({node})
            if not self.settings.dry_run:
                self.queue.add(node)  # the record goes once nothing holds the node
        return plans

    async def _reconcile_node(self, name: str) -> None:
        """The queue's reconcile of one node, once this replica's view is rebuilt: a node queued
        before a new leader's rebuild (by the watch, a timer, a resolve) is looked at with the alerts
        and holds the rebuild finds, not with what this replica knew before it led (where a drain
        left running would look as if no alert wanted it and be ended)."""
        if not self.settings.dry_run:
            await self._ensure_synced()
        await self.lifecycle(name)

    async def _resume(self, node: str, items: list[Observed]) -> None:
        """The lifecycle's resume of a drain nobody runs (under the node's lock)."""
        await self._decide_node(node, items)

    def _node_changed(self, name: str, annotations: Mapping[str, str] | None) -> None:
        """The node watch saw `name` change (None: deleted): a look when it carries this service's
        marks (a human may have given it back), or this service drains it."""
        if annotations is None:
            if name in self.drains.running:
                self.queue.add(name)
            return
        if self.settings.dry_run or not self._synced:
            return
        if any(k in annotations for k in MARKS):
            self.queue.add(name)

    async def reconcile(self, view: AlertmanagerView) -> list[AlertPlan]:
        """Converge on what Alertmanager shows now (remediator/desired/alertmanager.py): decide the alerts
        active there, keep (without acting) those silenced or inhibited, and resolve those this
        service knew firing that no Alertmanager shows any more."""
        await self._ensure_synced()
        label = self.settings.node_label
        suppressed = {fp: s.suppressed for fp, s in view.alerts.items() if s.suppressed}
        self.reconciler.suppressed = suppressed
        active = [s.alert for s in view.alerts.values() if not s.suppressed]
        quiet: list[Alert] = []
        for shown in view.alerts.values():
            if shown.suppressed:
                self.firing.touch(shown.alert.labels.get(label, ""), shown.alert.fingerprint)
                quiet.append(shown.alert)
        # Not shown any more: resolved (the API does not list resolved alerts, so absence is
        # all there is to tell; every member of the cluster is read, so one that restarted a
        # moment ago and shows nothing yet is outvoted by the others). Not an alert a delivery
        # said fires after the read began: the answers may predate it (the next read tells).
        now = self._clock()
        read_at = view.read_at
        resolved = [
            resolved_alert(cause.fingerprint, cause.labels, cause.starts_at, now)
            for _, cause in self.firing.all()
            if cause.fingerprint not in view.alerts and (read_at is None or cause.seen <= read_at)
        ]
        plans = [
            self.reconciler.suppressed_plan(
                a, (await self.reconciler.select(a, a.labels.get(label, ""))).rule
            )
            for a in quiet
        ]
        if active or resolved:
            plans += await self.handle(made_up_payload([*active, *resolved], group_key="alertmanager-api"))
        return plans

    async def _observe(self, payload: WebhookPayload) -> list[Observed]:
        """Update the desired state (alerts firing now) from the delivery, then the observed state
        (eligible nodes, nodes out of service, this service's holds) and the breaker."""
        label = self.settings.node_label
        observed = []
        acting = False
        for alert in payload.alerts:
            node_name = alert.labels.get(label, "")
            chosen = await self.reconciler.select(alert, node_name) if node_name else Selection(None)
            rule = chosen.rule
            observed.append(
                Observed(alert=alert, node_name=node_name, rule=rule, passed_over=chosen.passed_over)
            )
            if not node_name:
                continue
            if alert.status == "resolved":
                self.firing.resolved(node_name, alert.fingerprint)
            elif rule is not None and rule.actions:
                self.firing.firing(
                    node_name,
                    fingerprint=alert.fingerprint,
                    alertname=alert.labels.get("alertname", ""),
                    rule=rule,
                    # What a resolve made up later needs (its rule is the cause's): not every label.
                    labels={k: v for k, v in alert.labels.items() if k in ("alertname", label)},
                    starts_at=alert.starts_at,
                )
                acting = True
        if acting:
            await self._observe_nodes()
        self._breaker(self.gates.breaker.evaluate(alerting=self._alerting_nodes()))
        return observed

    async def _observe_nodes(self) -> list[Node]:
        """The eligible nodes, those out of service and this service's holds, as they are now."""
        nodes = await self.view.all()
        self.gates.observe(nodes, self.view.holds(nodes))
        return nodes

    def _alerting_nodes(self) -> int | None:
        """Eligible nodes with a fault firing now (what the breaker counts); None before the
        cluster was first observed."""
        eligible = self.gates.eligible_nodes
        if eligible is None:
            return None
        return len(self.firing.nodes(among=eligible))

    # -- the gates document -----------------------------------------------------------------------

    def _breaker(self, changed: bool) -> None:
        if changed:
            self._latch_dirty = True

    def _dirty(self) -> bool:
        return self._latch_dirty

    async def _save_latches(self) -> None:
        if not self._latch_dirty or self.settings.dry_run:
            self._latch_dirty = False
            return
        async with self._latch_lock:
            if not self._dirty():
                return  # saved by another delivery meanwhile
            self._latch_dirty = False
            try:
                await self.latches.save(self.gates.pause, self.gates.breaker)
            except BackendUnavailable as exc:  # the decisions are on the nodes; saved next time
                self._latch_dirty = True
                logger.warning("storm breaker latch not saved (%s); saved with the next change", exc)

    async def set_paused(self, paused: bool, reason: str = "") -> bool:
        """Pause or resume every action; True when the switch changed. Saved at once (not in dry-run)."""
        await self._ensure_synced()
        async with self._latch_lock:

            def apply(pause: Any, _breaker: Any) -> bool:
                if paused:
                    was = pause.paused
                    pause.pause(reason or "paused by an operator")
                    return not was
                return bool(pause.resume())

            changed = apply(self.gates.pause, self.gates.breaker)
            if changed and not self.settings.dry_run:
                await self.latches.save(self.gates.pause, self.gates.breaker, reapply=apply)
            return changed

    # -- lifecycle -----------------------------------------------------------------------------------

    async def drained(self) -> None:
        """Wait until no drain runs in the background and the actions after each were decided."""
        await self.drains.wait()

    async def stop(self) -> None:
        """Cancel the drains running in the background (service shutdown); idempotent.

        A cancelled drain is not decided: Alertmanager's next delivery (to this service again or to
        the next leader) starts it again, and the executor resumes it with its original deadline.
        A drain that already ended still records its end and decides the actions after it.
        """
        await self.queue.stop()
        await self.drains.stop()

    # -- the gates at a glance ---------------------------------------------------------------------

    async def refresh(self) -> None:
        """Observe the nodes now (GET /state, a metrics scrape): a human's uncordon frees the budget
        at once, not at the next delivery."""
        if self._synced and not self._sync_lock.locked():
            await self._observe_nodes()
            self._breaker(self.gates.breaker.evaluate(alerting=self._alerting_nodes()))
            await self._save_latches()

    def _phases(self) -> dict[str, int]:
        """Phase -> nodes in it, from the nodes the backend observes now (no request); the counts are
        cached per node object, so a scrape parses only the records that changed."""
        nodes = self._cluster.observed_nodes()
        if nodes is None:
            return {}
        return phase_counts(nodes, self.policy, memo=self._phase_memo)

    def deferred_by_node(self) -> dict[str, str]:
        """node -> why its next step waits, for the actions deferred now (the gate and its reason)."""
        out: dict[str, str] = {}
        for pending in self.pending.values():
            record = pending.record
            if record.node and record.node not in out:
                out[record.node] = f"gate {record.gate}: {record.reason}"
        return out

    def status(self) -> GateStatus:
        """The gates now (evaluates the breaker on the clock, so a scrape sees it close)."""
        gates = self.gates
        self._breaker(gates.breaker.evaluate(alerting=self._alerting_nodes()))
        deferred: dict[str, int] = {}
        for pending in self.pending.values():
            gate = pending.record.gate or "unknown"
            deferred[gate] = deferred.get(gate, 0) + 1
        budget = gates.budget
        return GateStatus(
            paused=gates.pause.paused,
            pause_reason=gates.pause.reason,
            breaker_open=gates.breaker.open,
            breaker_trips=gates.breaker.trips,
            breaker=gates.breaker.describe(),
            alerting_nodes=gates.breaker.alerting,
            eligible_nodes=gates.breaker.eligible,
            budget_in_use=budget.in_use,
            budget_capacity=budget.capacity,
            budget_holders={
                n: {"since": h.since, "kinds": sorted(h.kinds), "dry_run": h.dry_run}
                for n, h in budget.holders().items()
            },
            budget_others=dict(budget.others),
            firing=self.firing.as_json(),
            rule_budgets=gates.scoped.usage(budget.holders()),
            rate_limits=gates.rate.usage(),
            deferred=deferred,
            drains={name: running.as_json() for name, running in self.drains.running.items()},
            phases=self._phases(),
            # Only the Kubernetes executor has optional APIs; the Cluster seam does not require it.
            api_unavailable=dict(getattr(self._cluster, "api_unavailable", {})),
        )


def _alert_of(episode: Episode, *, node: str, label: str) -> Alert:
    """The firing alert a recorded episode stands for (no labels are stored but its name and node)."""
    return Alert(
        status="firing",
        labels={"alertname": episode.alertname, label: node},
        annotations={},
        starts_at=starts_at_text(episode.start),
        ends_at="",
        generator_url="",
        fingerprint=episode.fingerprint,
    )
