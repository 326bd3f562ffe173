"""The closed loop: a quarantined node comes back to the pool once it is repaired and verified.

A node is *quarantined* while a condition this service writes (`AcceleratorHealthy`, every
`condition` action of the policy) is False. For each such node, one pass of `RepairLoop.reconcile`:

1. records the quarantine once, in the node annotation `accel-health.io/quarantine` (the boot id,
   object uid and provider id it had, the alerts and rules that took it out, when), and appends the
   time to `accel-health.io/quarantine-history` (kept for `repair.window_seconds`);
2. escalates a repeat offender: the `repair.escalate_after`-th quarantine within the window labels
   the node for a human (`repair.escalation_label`=true), writes a Warning Event, counts it, and the
   node is never returned automatically (removing the label hands it back to the loop);
3. recognises a repair: the node booted again (`status.nodeInfo.bootID` changed), or it is another
   machine under the same name (new `metadata.uid` or `spec.providerID`), AND no alert that holds a
   node (the desired state: faults firing now) names it any more (since-boot counters restart at 0);
4. verifies, while the node is still cordoned, with the active checks of its rules (`verify`, or
   `repair.checks`: the cheap ones by default) through the node's exporter (`GET /checks`);
5. on success sets the condition back to True (reason `RepairVerified`), removes the cordon and the
   taints this service made (only if nobody changed them since: the executor checks its annotations
   and managedFields, so a human's re-cordon stays), forgets the quarantine, and records a decision
   and an Event (`AccelReturnedToPool`); on a failed check it keeps the node out, records the failing
   check in `accel-health.io/repair-failed` (one verification per boot), writes a Warning Event
   (`AccelRepairCheckFailed`) and exports `accel_remediator_repair_check_failed{node,check}` = 1,
   which the `AccelNodeRepairCheckFailed` alert turns into a page. A node whose exporter does not
   answer yet (still booting) is tried again on the next pass.

A condition set back to True by someone else ends the quarantine without the loop touching the node.
The loop runs on the leader only, every `repair.interval_seconds` and after every delivery that
acted; in dry-run it records what it would do and changes nothing.

`reboot_step` and `karpenter_managed` are the AWS side (pure): whether an `aws_reboot` reboots, waits
for the reboot it asked for, or escalates to a replacement because the fault came back after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from exporter.checks.fanout import run_checks
from remediator.audit import DecisionRecord, Outcome
from remediator.cluster import BackendUnavailable, Cluster, Node, NodeCondition, Taint
from remediator.desired import Cause
from remediator.policy import AddTaint, AwsReboot, Policy, SetCondition

logger = logging.getLogger("remediator.repair")

PREFIX = "accel-health.io/"
QUARANTINE = PREFIX + "quarantine"
"""JSON: when the node was taken out, its boot id, uid and provider id then, the alerts and rules."""
HISTORY = PREFIX + "quarantine-history"
"""JSON list of the unix times of this node's quarantines within the escalation window."""
REPAIR_FAILED = PREFIX + "repair-failed"
"""JSON: the boot id verified, the failing check and its message (one verification per boot)."""
REBOOTED = PREFIX + "rebooted"
"""JSON: when this service asked EC2 to reboot the instance, and the boot id it had then."""
RETURNED_REASON = "RepairVerified"
KARPENTER_LABELS = ("karpenter.sh/nodepool", "karpenter.sh/provisioner-name", "eks.amazonaws.com/nodeclaim")
"""Labels of nodes that Karpenter or EKS Auto Mode provisions (no Auto Scaling group replaces them)."""
REBOOT_PATIENCE_SECONDS = 900.0
"""A reboot asked for that has not happened (same boot id) after this long is asked for again."""


# -- verification ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Verification:
    """The answer of a node's post-repair checks."""

    verdict: Literal["pass", "fail", "error", "skipped"]
    """The worst verdict of the checks; `error` also when the node did not answer."""
    failing: tuple[tuple[str, str], ...] = ()
    """(check, message) of every check that did not pass."""
    error: str = ""
    """Why the node gave no answer (unreachable, 401, not running yet)."""

    @property
    def answered(self) -> bool:
        return not self.error


class Verifier(Protocol):
    """Runs active checks on one node."""

    async def verify(self, node: str, checks: Sequence[str]) -> Verification: ...


class ExporterChecks:
    """A Verifier over the exporter's `GET /checks` (exporter/checks/endpoint.py), bearer token."""

    def __init__(
        self,
        *,
        endpoint: Callable[[str], Awaitable[str | None]],
        token: str | None = None,
        token_file: Path | None = None,
        timeout_seconds: float = 120.0,
    ) -> None:
        self._endpoint = endpoint
        self._token = token
        self._token_file = token_file
        """Read at every verification: the Secret may be set or rotated after the start."""
        self._timeout = timeout_seconds

    def _current_token(self) -> str | None:
        if self._token_file is None:
            return self._token
        try:
            return self._token_file.read_text(encoding="utf-8").strip() or None
        except OSError:
            return None

    async def verify(self, node: str, checks: Sequence[str]) -> Verification:
        token = self._current_token()
        if self._token_file is not None and token is None:
            # Not a failed check: the node stays out and is verified again once the token is there.
            return Verification("error", error=f"no checks token in {self._token_file} yet")
        url = await self._endpoint(node)
        if url is None:
            return Verification("error", error="no running exporter pod with an IP on the node")
        (answer,) = await run_checks(
            {node: url}, checks=checks, params={}, token=token, batch=1, seconds=self._timeout
        )
        if answer.error:
            return Verification("error", error=answer.error)
        failing = tuple((r.check, r.message or r.verdict) for r in answer.results if r.verdict != "pass")
        return Verification(answer.verdict, failing=failing)


def exporter_pod_endpoint(
    cluster: Cluster, *, label: str = "app.kubernetes.io/name=accel-health-exporter", port: int = 9835
) -> Callable[[str], Awaitable[str | None]]:
    """node -> `http://<exporter pod IP>:<port>/checks`, from the pods bound to the node."""
    key, _, value = label.partition("=")

    async def endpoint(node: str) -> str | None:
        for pod in await cluster.list_pods(node):
            if pod.labels.get(key) == value and pod.phase == "Running" and pod.ip:
                return f"http://{pod.ip}:{port}/checks"
        return None

    return endpoint


def url_template_endpoint(template: str) -> Callable[[str], Awaitable[str | None]]:
    """node -> `template` with `{node}` replaced (a port-forward, a demo, a test)."""

    async def endpoint(node: str) -> str | None:
        return template.replace("{node}", node)

    return endpoint


# -- the AWS side (pure) ---------------------------------------------------------------------------


def karpenter_managed(node: Node) -> bool:
    """Provisioned by Karpenter or EKS Auto Mode: its own node repair replaces it, no ASG does."""
    return any(label in node.labels for label in KARPENTER_LABELS) or (
        node.labels.get("eks.amazonaws.com/compute-type") == "auto"
    )


RebootStep = Literal["reboot", "wait", "replace"]


def reboot_step(node: Node, action: AwsReboot, *, now: float) -> tuple[RebootStep, str]:
    """What an `aws_reboot` does on this node now, and why."""
    raw = node.annotations.get(REBOOTED)
    if not raw:
        return "reboot", "no reboot asked for before"
    try:
        doc = json.loads(raw)
        at, boot = float(doc["at"]), str(doc["bootID"])
    except (ValueError, KeyError, TypeError):
        return "reboot", f"unreadable {REBOOTED} annotation; treated as none"
    age = now - at
    if boot == node.boot_id:
        if age < REBOOT_PATIENCE_SECONDS:
            return "wait", f"reboot asked for {age:.0f} s ago; the node has not booted since"
        return "reboot", f"reboot asked for {age:.0f} s ago never happened (same boot id); asked again"
    if age <= action.replace_after_reboot_seconds:
        return "replace", (
            f"the fault came back {age:.0f} s after the reboot accel-health asked for "
            f"(within {action.replace_after_reboot_seconds} s): escalated to a replacement"
        )
    return "reboot", f"last reboot {age:.0f} s ago, longer than {action.replace_after_reboot_seconds} s"


def rebooted_annotation(node: Node, *, now: float) -> dict[str, str | None]:
    return {REBOOTED: json.dumps({"at": now, "bootID": node.boot_id}, sort_keys=True)}


# -- the loop --------------------------------------------------------------------------------------


@dataclass
class RepairStatus:
    """What the last pass saw (metrics, GET /state)."""

    quarantined: set[str] = field(default_factory=set)
    check_failed: dict[str, str] = field(default_factory=dict)
    """node -> the failing check."""
    escalated: set[str] = field(default_factory=set)
    results: dict[str, int] = field(default_factory=dict)
    """Counts by result: returned, check_failed, escalated, handed_back (someone else returned it)."""
    last_pass: float = 0.0


class RepairLoop:
    """Brings repaired, verified nodes back to the pool. One per service, on the leader."""

    def __init__(
        self,
        *,
        policy: Policy,
        cluster: Cluster,
        verifier: Verifier,
        firing: Callable[[str], Sequence[Cause]],
        publish: Callable[[DecisionRecord], None],
        clock: Callable[[], float] = time.time,
        dry_run: bool = False,
    ) -> None:
        self.policy = policy
        self.settings = policy.repair
        self.status = RepairStatus()
        self._cluster = cluster
        self._verifier = verifier
        self._firing = firing
        self._publish = publish
        self._clock = clock
        self._dry_run = dry_run
        self._planned: set[tuple[str, str, str]] = set()
        """(node, action, boot id) already planned in dry-run: nothing is written, so each pass would
        plan it again; recorded once."""
        self._wake = asyncio.Event()
        self._lock = asyncio.Lock()
        self._conditions = tuple(
            sorted({a.condition_type for r in policy.rules for a in r.actions if isinstance(a, SetCondition)})
        )
        self._taints = tuple(
            sorted({(a.key, a.effect) for r in policy.rules for a in r.actions if isinstance(a, AddTaint)})
        )
        self._rules = {r.name: r for r in policy.rules}

    def poke(self) -> None:
        """Look again soon (a delivery acted)."""
        self._wake.set()

    async def run(self, *, should_run: Callable[[], bool] = lambda: True) -> None:
        """Reconcile every interval and when poked, while `should_run()` (the leader); until cancelled."""
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=self.settings.interval_seconds)
            self._wake.clear()
            if not should_run():
                continue
            try:
                await self.reconcile()
            except BackendUnavailable as exc:
                logger.warning(
                    "repair pass stopped: %s; tried again in %.0f s", exc, self.settings.interval_seconds
                )

    async def reconcile(self) -> list[DecisionRecord]:
        """One pass over every node; returns the decisions it made."""
        if not self.settings.enabled or not self._conditions:
            return []
        async with self._lock:
            records: list[DecisionRecord] = []
            seen = RepairStatus(results=self.status.results)
            for node in await self._cluster.list_nodes():
                records.extend(await self._reconcile_node(node, seen))
            seen.last_pass = self._clock()
            self.status = seen
            return records

    # -- per node ----------------------------------------------------------------------------------

    def _quarantine_condition(self, node: Node) -> NodeCondition | None:
        return next((c for c in node.conditions if c.type in self._conditions and c.status == "False"), None)

    async def _reconcile_node(  # noqa: PLR0911  one return per stage of the loop, in order
        self, node: Node, seen: RepairStatus
    ) -> list[DecisionRecord]:
        cond = self._quarantine_condition(node)
        record = _load(node.annotations.get(QUARANTINE))
        if cond is None:
            if record is not None:  # someone else set the condition back: the quarantine ended
                await self._annotate(node.name, {QUARANTINE: None, REPAIR_FAILED: None})
                self._count("handed_back")
            return []
        seen.quarantined.add(node.name)
        if record is None:
            return await self._quarantined(node, cond, seen)
        if node.labels.get(self.settings.escalation_label) == "true":
            seen.escalated.add(node.name)
            return []
        failed = _load(node.annotations.get(REPAIR_FAILED))
        if failed is not None and failed.get("bootID") == node.boot_id:
            seen.check_failed[node.name] = str(failed.get("check", ""))
            return []  # this boot failed its checks: out until the next repair
        repair = self._repair_seen(node, record)
        if repair is None or not node.ready:
            return []
        holding = [c for c in self._firing(node.name) if c.holds]
        if holding:
            logger.info(
                "%s: %s; waiting for %s to resolve",
                node.name,
                repair,
                ", ".join(sorted({c.alertname for c in holding})),
            )
            return []
        if self._dry_run and any(
            (node.name, a, node.boot_id) in self._planned for a in ("return_to_pool", "verify")
        ):
            return []  # planned already for this boot; a dry-run writes nothing, so it would repeat
        return await self._verify(node, record, repair, seen)

    def _repair_seen(self, node: Node, record: Mapping[str, Any]) -> str | None:
        if record.get("uid") and node.uid and record["uid"] != node.uid:
            return "a new node object under the same name"
        if record.get("providerID") and node.provider_id and record["providerID"] != node.provider_id:
            return f"a new instance ({node.provider_id})"
        if record.get("bootID") and node.boot_id and record["bootID"] != node.boot_id:
            return "the node rebooted (new boot id)"
        return None

    async def _quarantined(self, node: Node, cond: NodeCondition, seen: RepairStatus) -> list[DecisionRecord]:
        now = self._clock()
        causes = list(self._firing(node.name))
        record: dict[str, Any] = {
            "since": now,
            "bootID": node.boot_id,
            "uid": node.uid,
            "providerID": node.provider_id,
            "alerts": sorted({c.alertname for c in causes} or {cond.reason}),
            "rules": sorted({c.rule for c in causes}),
        }
        history = [t for t in _times(node.annotations.get(HISTORY)) if now - t < self.settings.window_seconds]
        history.append(now)
        await self._annotate(
            node.name, {QUARANTINE: json.dumps(record, sort_keys=True), HISTORY: json.dumps(history)}
        )
        alertname = record["alerts"][0]
        if len(history) < self.settings.escalate_after:
            return self._decide(
                node.name,
                "quarantine",
                "done",
                f"quarantine {len(history)} of {self.settings.escalate_after} allowed within "
                f"{self.settings.window_seconds:.0f} s; returned to the pool after a verified repair",
                alertname=alertname,
                details=record,
                boot=node.boot_id,
            )
        seen.escalated.add(node.name)
        self._count("escalated")
        text = (
            f"quarantined {len(history)} times within {self.settings.window_seconds:.0f} s (limit "
            f"{self.settings.escalate_after}): not returned automatically; labelled "
            f"{self.settings.escalation_label}=true for a human"
        )
        if not self._dry_run:
            await self._cluster.label_node(node.name, {self.settings.escalation_label: "true"})
            await self._cluster.record_event(
                node=node.name, reason="AccelRepeatedFaultsEscalated", message=text, type_="Warning"
            )
        return self._decide(
            node.name, "escalate", "done", text, alertname=alertname, details=record, boot=node.boot_id
        )

    def _checks_for(self, record: Mapping[str, Any]) -> tuple[str, ...]:
        rules = [self._rules[name] for name in record.get("rules", []) if name in self._rules]
        explicit = [r.verify for r in rules if r.verify is not None]
        if not explicit:
            return self.settings.checks
        return tuple(dict.fromkeys(c for checks in explicit for c in checks))

    async def _verify(
        self, node: Node, record: Mapping[str, Any], repair: str, seen: RepairStatus
    ) -> list[DecisionRecord]:
        checks = self._checks_for(record)
        alertname = str((record.get("alerts") or ["AcceleratorFault"])[0])
        result = await self._verifier.verify(node.name, checks) if checks else Verification("pass")
        if not result.answered:
            logger.info("%s: %s; checks not answered yet (%s); tried again", node.name, repair, result.error)
            return []
        if result.verdict != "pass":
            check, message = result.failing[0] if result.failing else (",".join(checks), result.verdict)
            text = f"{repair}, but check {check} did not pass ({message}): kept out of the pool"
            seen.check_failed[node.name] = check
            self._count("check_failed")
            if not self._dry_run:
                failed = {"bootID": node.boot_id, "check": check, "message": message, "at": self._clock()}
                await self._annotate(node.name, {REPAIR_FAILED: json.dumps(failed, sort_keys=True)})
                await self._cluster.record_event(
                    node=node.name, reason="AccelRepairCheckFailed", message=text, type_="Warning"
                )
            details = {"checks": list(checks), "failing": [list(f) for f in result.failing]}
            return self._decide(
                node.name, "verify", "failed", text, alertname=alertname, details=details, boot=node.boot_id
            )
        return await self._return(node, checks, repair, alertname)

    async def _return(
        self, node: Node, checks: Sequence[str], repair: str, alertname: str
    ) -> list[DecisionRecord]:
        passed = f"checks {', '.join(checks)} passed" if checks else "no checks configured"
        parts = [f"{repair}; {passed}"]
        if not self._dry_run:
            for ctype in self._conditions:
                if any(c.type == ctype and c.status == "False" for c in node.conditions):
                    await self._cluster.set_condition(
                        node.name,
                        NodeCondition(type=ctype, status="True", reason=RETURNED_REASON, message=parts[0]),
                    )
            for key, effect in self._taints:
                if any(t.key == key and t.effect == effect for t in node.taints):
                    await self._cluster.remove_taint(node.name, Taint(key=key, value="", effect=effect))
            if node.unschedulable:
                if await self._cluster.uncordon(node.name):
                    parts.append("uncordoned")
                else:
                    parts.append("cordon kept: not made by accel-health, or changed by someone since")
            await self._annotate(node.name, {QUARANTINE: None, REPAIR_FAILED: None})
            await self._cluster.record_event(
                node=node.name, reason="AccelReturnedToPool", message="; ".join(parts), type_="Normal"
            )
        self._count("returned")
        return self._decide(
            node.name,
            "return_to_pool",
            "done",
            "; ".join(parts),
            alertname=alertname,
            details={"checks": list(checks)},
            boot=node.boot_id,
        )

    # -- helpers -----------------------------------------------------------------------------------

    async def _annotate(self, node: str, annotations: Mapping[str, str | None]) -> None:
        if not self._dry_run:
            await self._cluster.annotate_node(node, annotations)

    def _count(self, result: str) -> None:
        self.status.results[result] = self.status.results.get(result, 0) + 1

    def _decide(
        self,
        node: str,
        action: str,
        outcome: Outcome,
        reason: str,
        *,
        alertname: str,
        details: Mapping[str, Any] | None = None,
        boot: str = "",
    ) -> list[DecisionRecord]:
        if self._dry_run:
            key = (node, action, boot)
            if key in self._planned:
                return []
            self._planned.add(key)
        if self._dry_run and outcome == "done":
            outcome, reason = "planned", f"would: {reason}"
        record = DecisionRecord(
            time=self._clock(),
            node=node,
            action=action,
            alertname=alertname,
            fingerprint="",
            starts_at="",
            status="resolved",
            rule=None,
            dry_run=self._dry_run,
            outcome=outcome,
            reason=reason,
            details=dict(details or {}),
        )
        logger.info("%s", record.log_line())
        self._publish(record)
        return [record]


class RepairCollector:
    """`accel_remediator_*` series of the repair loop, from its last pass."""

    def __init__(self, loop: RepairLoop) -> None:
        self._loop = loop

    def describe(self) -> list[GaugeMetricFamily]:
        return []

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        st = self._loop.status
        yield GaugeMetricFamily(
            "accel_remediator_quarantined_nodes",
            "Nodes out of the pool with an accelerator condition False.",
            value=len(st.quarantined),
        )
        failed = GaugeMetricFamily(
            "accel_remediator_repair_check_failed",
            "1 for a node whose post-repair check failed; it stays out of the pool.",
            labels=["node", "check"],
        )
        for node, check in sorted(st.check_failed.items()):
            failed.add_metric([node, check], 1)
        yield failed
        escalated = GaugeMetricFamily(
            "accel_remediator_node_escalated",
            "1 for a node quarantined too often within the window; a human decides.",
            labels=["node"],
        )
        for node in sorted(st.escalated):
            escalated.add_metric([node], 1)
        yield escalated
        results = CounterMetricFamily(
            "accel_remediator_repairs",
            "Outcomes of the repair loop: returned, check_failed, escalated, handed_back.",
            labels=["result"],
        )
        for result in ("returned", "check_failed", "escalated", "handed_back"):
            results.add_metric([result], st.results.get(result, 0))
        yield results


def _load(raw: str | None) -> dict[str, Any] | None:
    if not raw:
        return None
    try:
        doc = json.loads(raw)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


def _times(raw: str | None) -> list[float]:
    try:
        doc = json.loads(raw or "[]")
    except ValueError:
        return []
    return [float(t) for t in doc if isinstance(t, int | float)] if isinstance(doc, list) else []
