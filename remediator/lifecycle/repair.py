"""The closed loop: a quarantined node comes back to the pool once it is repaired and verified.

A node is *quarantined* while a condition this service writes (`AcceleratorHealthy`, every
`condition` action of the policy) is False. For each such node, one pass of `RepairLoop.reconcile`:

1. records the quarantine once, in the node annotation `accel-health.io/quarantine` (the boot id,
   object uid and provider id it had, the alerts and rules that took it out, when; see
   `quarantine_annotations`, which the write that sets the condition may use instead), appends the
   time to `accel-health.io/quarantine-history` (kept for `repair.window_seconds`), and saves a
   durable copy of both where deleting the Node object does not take it (`DurableQuarantine`: one
   ConfigMap of at most 1 KiB per quarantined node in the remediator's namespace, keyed by node
   name; created once, written again only when its history or escalation changes, deleted when the
   node is returned or handed back);
2. escalates a repeat offender: the `repair.escalate_after`-th quarantine of the name within the
   window labels the node for a human (`repair.escalation_label`=true), writes a Warning Event,
   counts it, and the node is never returned automatically (removing the label hands it back to
   the loop);
3. recognises a repair: the node booted again (`status.nodeInfo.bootID` changed), or it is another
   machine under the same name (new `metadata.uid` or `spec.providerID`), AND no alert that holds a
   node (the desired state: faults firing now) names it any more (since-boot counters restart at 0);
4. verifies, while the node is still cordoned, with the active checks of its rules (`verify`, or
   `repair.checks`: the cheap ones by default) through the node's exporter (`GET /checks`);
5. on success sets the condition back to True (reason `RepairVerified`), removes the cordon and the
   taints this service made (only if nobody changed them since: the executor checks its annotations
   and managedFields, so a human's re-cordon stays) and the startup taint, forgets the quarantine
   (annotation and durable copy), and records a decision and an Event (`AccelReturnedToPool`); on a
   failed check it keeps the node out, records the failing check in `accel-health.io/repair-failed`
   (one verification per boot), writes a Warning Event (`AccelRepairCheckFailed`) and exports
   `accel_remediator_repair_check_failed{node,check}` = 1, which the `AccelNodeRepairCheckFailed`
   alert turns into a page. A node whose exporter does not answer yet (still booting) is tried again
   on the next pass.

A machine replaced under the same name (a cloud repair) registers as a new Node object: new uid, no
annotations, no cordon, no condition. The loop knows the name from the durable copy: in one write
the new object gets the startup taint `accel-health.io/unverified:NoSchedule` (unless it registered
with it: the node-pool examples in examples/node-pools/ make every node register with it, so it
takes no work even before the loop sees it), the old object's record (so the repair is seen: "a new
node object under the same name") and history (so escalation counts across objects), and the
escalation label when the quarantine was escalated; an Event `AccelUnverifiedNodeHeld` says so. It
is then verified like any repair; it passes: the startup taint is lifted and the quarantine
forgotten; it fails: it stays tainted. A node that registers with the startup taint under a name
with no quarantine recorded is new and nothing says it was bad: its taint is lifted at once (or,
with `repair.verify_new_nodes: true`, once `repair.checks` pass on it). Without a running
enforcing remediator (repair disabled, dry-run) nobody lifts the startup taint.

A condition set back to True by someone else ends the quarantine without the loop touching the node
(only its record goes), and so does removing the startup taint of a held replacement. A name that no
node has had for a whole window (scaled in, replaced under another name) is forgotten. The loop runs
on the leader only, every `repair.interval_seconds` and after every delivery that acted, reading the
durable copies once per leadership; in dry-run it records what it would do and changes nothing.
`accel_remediator_quarantined_nodes` is computed at scrape time from the cluster's node cache.

`reboot_step` and `karpenter_managed` are the AWS side (pure): whether an `aws_reboot` reboots, waits
for the reboot it asked for, or escalates to a replacement because the fault came back after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from exporter.checks.fanout import run_checks
from remediator.audit import DecisionRecord, Outcome
from remediator.cluster import (
    BackendUnavailable,
    Drains,
    EventSink,
    Node,
    NodeCondition,
    NodeReads,
    NodeWrites,
    QuarantineStore,
    Taint,
)
from remediator.desired.firing import Cause
from remediator.lifecycle.record import RecordChange, owned_taints, taint_id
from remediator.lifecycle.record import read as read_record
from remediator.policy import AddTaint, AwsReboot, Policy, SetCondition
from remediator.repairpolicy import MAX_ESCALATE_AFTER

logger = logging.getLogger("remediator.lifecycle.repair")

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
STARTUP_TAINT = Taint(key=PREFIX + "unverified", value="true", effect="NoSchedule")
"""The startup taint the shipped node-pool examples register nodes with (examples/node-pools/): the
node takes no work until this loop lifts it, at once for a new name, after verification for a name
that has a quarantine recorded."""
HISTORY_CAP = MAX_ESCALATE_AFTER
"""At most this many quarantine times are kept (the newest), on the node and in the durable copy."""
DURABLE_MAX_BYTES = 1024
"""The durable copy of a quarantine, as stored, is at most this long."""
RECORD_FIELDS = ("since", "bootID", "uid", "providerID", "alerts", "rules")
"""The fields of the `QUARANTINE` record."""
FIELD_LIMIT = 96
"""Longest string a durable copy keeps of a record's field when nothing else makes it fit."""
NAME_LIMIT = 253
"""Longest node name (a DNS subdomain)."""


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
    cluster: Drains,
    *,
    label: str = "app.kubernetes.io/name=accel-health-exporter",
    port: int = 9835,
    path: str = "/checks",
) -> Callable[[str], Awaitable[str | None]]:
    """node -> `http://<exporter pod IP>:<port><path>` (`/checks`, `/evidence`), from the pods bound
    to the node."""
    key, _, value = label.partition("=")

    async def endpoint(node: str) -> str | None:
        for pod in await cluster.list_pods(node):
            if pod.labels.get(key) == value and pod.phase == "Running" and pod.ip:
                return f"http://{pod.ip}:{port}{path}"
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


def rebooted_boot_id(node: Node) -> str | None:
    """The boot id the node had when this service last asked EC2 to reboot it (None: never, or
    unreadable)."""
    try:
        return str(json.loads(node.annotations.get(REBOOTED, ""))["bootID"])
    except (ValueError, KeyError, TypeError):
        return None


def rebooted_annotation(node: Node, *, now: float) -> dict[str, str | None]:
    return {REBOOTED: json.dumps({"at": now, "bootID": node.boot_id}, sort_keys=True)}


# -- the quarantine record (pure) ------------------------------------------------------------------


class FiringCause(Protocol):
    """What the record needs of a cause firing on the node (remediator.desired.firing.Cause has it)."""

    @property
    def alertname(self) -> str: ...

    @property
    def rule(self) -> str: ...


def quarantine_history(
    node: Node, *, now: float, window_seconds: float, earlier: Iterable[float] = ()
) -> list[float]:
    """The node's quarantine times within the window (from its `HISTORY` annotation and `earlier`
    ones, e.g. those of the durable copy when the Node object was replaced), with `now` appended:
    oldest first, at most `HISTORY_CAP`."""
    own = _times(node.annotations.get(HISTORY))
    kept = sorted(t for t in (*own, *(t for t in earlier if t not in own)) if now - t < window_seconds)
    return [*kept[max(0, len(kept) - HISTORY_CAP + 1) :], now]


def quarantine_annotations(
    node: Node,
    *,
    causes: Iterable[FiringCause],
    now: float,
    window_seconds: float,
    reason: str = "",
    earlier: Iterable[float] = (),
) -> dict[str, str]:
    """The `QUARANTINE` and `HISTORY` annotation values that record a quarantine starting now.

    `QUARANTINE`: when, the boot id, uid and provider id the node has now (a repair changes one of
    them), the alerts and rules of the `causes` firing on it (`reason`, the condition's reason, when
    none is known). `HISTORY`: `quarantine_history`. Written once, when the quarantine starts: by
    the write that sets the condition, or by the repair loop when it finds none.
    """
    causes = list(causes)
    record: dict[str, Any] = {
        "since": now,
        "bootID": node.boot_id,
        "uid": node.uid,
        "providerID": node.provider_id,
        "alerts": sorted({c.alertname for c in causes} or ({reason} if reason else set())),
        "rules": sorted({c.rule for c in causes}),
    }
    history = quarantine_history(node, now=now, window_seconds=window_seconds, earlier=earlier)
    return {QUARANTINE: json.dumps(record, sort_keys=True), HISTORY: json.dumps(history)}


@dataclass(frozen=True)
class DurableQuarantine:
    """The copy of a node's quarantine kept where deleting the Node object does not take it (one
    small ConfigMap per node in the remediator's namespace; `Cluster.save_quarantine`), so that a
    machine replaced under the same name is still known as quarantined and its history still counts.

    Saved when the loop first sees the quarantine, saved again only when its history or escalation
    changes, deleted when the node is returned to the pool or handed back (or, for a name no node
    has any more, once its last quarantine left the window)."""

    node: str
    """The node name (the key; a ConfigMap name may carry only a hash of a long one)."""
    record: Mapping[str, Any]
    """The `QUARANTINE` annotation's record: since, bootID, uid, providerID, alerts, rules."""
    history: tuple[float, ...] = ()
    """Unix times of the name's quarantines within `repair.window_seconds`, oldest first."""
    escalated: bool = False
    """The quarantine was escalated to a human (the escalation label): a replacement gets it too."""

    @property
    def uid(self) -> str:
        """metadata.uid of the Node object that was quarantined."""
        return str(self.record.get("uid") or "")

    @property
    def last(self) -> float:
        """When the name was last quarantined."""
        return max((*self.history, _float(self.record.get("since"))), default=0.0)

    def same_quarantine(self, record: Mapping[str, Any]) -> bool:
        """The node's `QUARANTINE` record is this one (not a later quarantine)."""
        return (record.get("since"), record.get("uid")) == (self.record.get("since"), self.record.get("uid"))

    def document(self) -> dict[str, Any]:
        """The stored form: JSON of at most `DURABLE_MAX_BYTES`. Extra alert names, then the oldest
        times, then the provider id are left out until it fits; as a last resort (names far longer
        than Kubernetes makes them) only the newest time, the first rule and the uid, boot id and
        alert, cut to `FIELD_LIMIT` characters, are kept, or only when it was."""
        record = {k: self.record[k] for k in RECORD_FIELDS if k in self.record}
        history = list(self.history)
        while True:
            doc = {"node": self.node, "record": record, "history": history, "escalated": self.escalated}
            if _json_size(doc) <= DURABLE_MAX_BYTES:
                return doc
            alerts = list(record.get("alerts") or [])
            if len(alerts) > 1:
                record = {**record, "alerts": alerts[:-1]}
            elif len(history) > 1:
                history = history[1:]
            elif record.get("providerID"):
                record = {**record, "providerID": ""}
            else:
                break
        cut = {k: str(record.get(k) or "")[:FIELD_LIMIT] for k in ("uid", "bootID")}
        first = {
            k: [str(v)[:FIELD_LIMIT] for v in list(record.get(k) or [])[:1]] for k in ("alerts", "rules")
        }
        record = {"since": _float(record.get("since")), "providerID": "", **cut, **first}
        doc = {
            "node": self.node[:NAME_LIMIT],
            "record": record,
            "history": history[-1:],
            "escalated": self.escalated,
        }
        if _json_size(doc) > DURABLE_MAX_BYTES:  # characters JSON escapes take six bytes each
            doc["record"] = {"since": record["since"], "uid": "", "bootID": "", "alerts": [], "rules": []}
        return doc

    @classmethod
    def from_document(cls, node: str, doc: Mapping[str, Any]) -> DurableQuarantine | None:
        """Read back a stored document; None when it is not one."""
        record = doc.get("record")
        history = doc.get("history")
        if not isinstance(record, Mapping) or not isinstance(history, list):
            return None
        times = tuple(float(t) for t in history if isinstance(t, int | float) and not isinstance(t, bool))
        return cls(node=node, record=dict(record), history=times, escalated=doc.get("escalated") is True)


def replaced(record: Mapping[str, Any], node: Node) -> bool:
    """The record was made on another Node object than this one under the same name."""
    uid = str(record.get("uid") or "")
    return bool(uid and node.uid and uid != node.uid)


def unverified(node: Node) -> bool:
    """The node carries the startup taint (any effect): it takes no work until the loop lifts it."""
    return any(t.key == STARTUP_TAINT.key for t in node.taints)


# -- the loop --------------------------------------------------------------------------------------


@dataclass
class RepairStatus:
    """What the last pass saw (metrics, GET /state)."""

    quarantined: set[str] = field(default_factory=set)
    check_failed: dict[str, str] = field(default_factory=dict)
    """node -> the failing check."""
    escalated: set[str] = field(default_factory=set)
    results: dict[str, int] = field(default_factory=dict)
    """Counts by result: returned, check_failed, escalated, handed_back (someone else returned it),
    admitted (a new node's startup taint lifted)."""
    last_pass: float = 0.0


RESULTS = ("returned", "check_failed", "escalated", "handed_back", "admitted")
"""The results `RepairStatus.results` counts (accel_remediator_repairs_total{result})."""
OWN_ACTIONS = frozenset({"return_to_pool", "quarantine", "escalate", "verify", "hold_unverified", "admit"})
"""The actions of the loop's own decision records."""


class RepairCluster(NodeReads, NodeWrites, EventSink, QuarantineStore, Protocol):
    """What the repair loop reads and writes: the nodes, their Events, the durable quarantine copies."""


class RepairLoop:
    """Brings repaired, verified nodes back to the pool. One per service, on the leader."""

    def __init__(
        self,
        *,
        policy: Policy,
        cluster: RepairCluster,
        verifier: Verifier,
        firing: Callable[[str], Sequence[Cause]],
        publish: Callable[[DecisionRecord], None],
        clock: Callable[[], float] = time.time,
        dry_run: bool = False,
        node_lock: Callable[[str], contextlib.AbstractAsyncContextManager[None]] | None = None,
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
        self._durable: dict[str, DurableQuarantine] | None = None
        """Node name -> the durable copy of its quarantine: read at the first pass of a leadership
        (one LIST), then kept by this loop's own writes (only the leader writes them); None: read
        again (not leading, or a pass that failed)."""
        self._wake = asyncio.Event()
        self._lock = asyncio.Lock()
        self._conditions = tuple(
            sorted({a.condition_type for r in policy.rules for a in r.actions if isinstance(a, SetCondition)})
        )
        values: dict[tuple[str, str], set[str]] = {}
        for rule in policy.rules:
            for action in rule.actions:
                if isinstance(action, AddTaint):
                    values.setdefault((action.key, action.effect), set()).add(action.value)
        self._taint_values = {k: frozenset(v) for k, v in values.items()}
        """(key, effect) -> the values the policy's taint steps set: a taint of this service's."""
        self._node_lock = node_lock if node_lock is not None else _no_lock
        """The node's lock in the engine's work queue: a return is decided while no delivery for
        the node is (remediator/lifecycle/queue.py)."""
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
                self._durable = None  # another replica leads and writes them: read again when leading
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
            try:
                return await self._pass()
            except BackendUnavailable:
                self._durable = None  # a write may have half-happened: read the copies again
                raise

    async def _pass(self) -> list[DecisionRecord]:
        if self._durable is None:
            self._durable = await self._load_durable()
        records: list[DecisionRecord] = []
        seen = RepairStatus(results=self.status.results)
        nodes = await self._cluster.list_nodes()
        for node in nodes:
            records.extend(await self._reconcile_node(node, seen))
        await self._forget_absent({n.name for n in nodes})
        seen.last_pass = self._clock()
        self.status = seen
        return records

    def quarantined_now(self) -> set[str] | None:
        """The nodes out of the pool for a fault, from the cluster's observed nodes now (no request);
        None when the cluster has no such view (the last pass's `status.quarantined` tells then)."""
        nodes = self._cluster.observed_nodes()
        if nodes is None:
            return None
        durable = self._durable or {}
        out = set()
        for node in nodes:
            record = _load(node.annotations.get(QUARANTINE))
            copy = durable.get(node.name)
            if (
                self._quarantine_condition(node) is not None
                or (record is not None and replaced(record, node) and unverified(node))
                or (record is None and copy is not None and replaced(copy.record, node))
            ):
                out.add(node.name)
        return out

    # -- per node ----------------------------------------------------------------------------------

    def _quarantine_condition(self, node: Node) -> NodeCondition | None:
        return next((c for c in node.conditions if c.type in self._conditions and c.status == "False"), None)

    async def _reconcile_node(  # noqa: PLR0911  one return per stage of the loop, in order
        self, node: Node, seen: RepairStatus
    ) -> list[DecisionRecord]:
        cond = self._quarantine_condition(node)
        record = _load(node.annotations.get(QUARANTINE))
        durable = (self._durable or {}).get(node.name)
        if cond is None and (record is None or not replaced(record, node)):
            return await self._not_quarantined(node, record, durable, seen)
        if cond is None and not unverified(node):
            # A replacement held with the startup taint, whose taint someone removed: handed back.
            await self._hand_back(node, durable)
            return []
        seen.quarantined.add(node.name)
        if record is None:
            assert cond is not None  # a node with no record and no condition was handled above
            return await self._quarantined(node, cond, durable, seen)
        out: list[DecisionRecord] = []
        if durable is None or not durable.same_quarantine(record):
            out += await self._copy(node, record, durable, seen)
            if node.name in seen.escalated:
                return out
        elif durable.escalated and node.labels.get(self.settings.escalation_label) != "true":
            # A human removed the escalation label: a replacement no longer inherits it.
            await self._save_durable(dataclasses.replace(durable, escalated=False))
        if node.labels.get(self.settings.escalation_label) == "true":
            seen.escalated.add(node.name)
            return out
        failed = _load(node.annotations.get(REPAIR_FAILED))
        if failed is not None and failed.get("bootID") == node.boot_id:
            seen.check_failed[node.name] = str(failed.get("check", ""))
            return out  # this boot failed its checks: out until the next repair
        repair = self._repair_seen(node, record)
        if repair is None or not node.ready:
            return out
        holding = [c for c in self._firing(node.name) if c.holds]
        if holding:
            logger.info(
                "%s: %s; waiting for %s to resolve",
                node.name,
                repair,
                ", ".join(sorted({c.alertname for c in holding})),
            )
            return out
        if self._dry_run and any(
            (node.name, a, node.boot_id) in self._planned for a in ("return_to_pool", "verify")
        ):
            return out  # planned already for this boot; a dry-run writes nothing, so it would repeat
        return [*out, *await self._verify(node, record, repair, seen)]

    async def _not_quarantined(
        self,
        node: Node,
        record: Mapping[str, Any] | None,
        durable: DurableQuarantine | None,
        seen: RepairStatus,
    ) -> list[DecisionRecord]:
        """No condition False on this node object, and no quarantine of another object adopted."""
        if record is not None or (durable is not None and not replaced(durable.record, node)):
            # Someone else set the condition back (or removed the record): the quarantine ended.
            await self._hand_back(node, durable)
            return []
        if durable is not None:
            return await self._adopt(node, durable, seen)
        if unverified(node):
            return await self._admit(node, seen)
        return []

    def _repair_seen(self, node: Node, record: Mapping[str, Any]) -> str | None:
        if replaced(record, node):
            return "a new node object under the same name"
        if record.get("providerID") and node.provider_id and record["providerID"] != node.provider_id:
            return f"a new instance ({node.provider_id})"
        if record.get("bootID") and node.boot_id and record["bootID"] != node.boot_id:
            return "the node rebooted (new boot id)"
        return None

    async def _quarantined(
        self, node: Node, cond: NodeCondition, durable: DurableQuarantine | None, seen: RepairStatus
    ) -> list[DecisionRecord]:
        """A quarantine nobody recorded yet: record it on the node and in the durable copy, count it."""
        annotations = quarantine_annotations(
            node,
            causes=self._firing(node.name),
            now=self._clock(),
            window_seconds=self.settings.window_seconds,
            reason=cond.reason,
            earlier=durable.history if durable is not None else (),
        )
        await self._annotate(node.name, annotations)
        record: dict[str, Any] = json.loads(annotations[QUARANTINE])
        history = json.loads(annotations[HISTORY])
        return await self._counted(node, record, history, seen, announce=True)

    async def _copy(
        self, node: Node, record: Mapping[str, Any], durable: DurableQuarantine | None, seen: RepairStatus
    ) -> list[DecisionRecord]:
        """A quarantine recorded on the node (by the write that set its condition) with no durable
        copy yet: save one and count it. A copy of an earlier quarantine under the name (an object
        replaced before the loop adopted it) adds its history, written back onto the node."""
        own = _times(node.annotations.get(HISTORY))
        history = own
        if durable is not None:
            since = _float(record.get("since")) or self._clock()
            earlier = [t for t in durable.history if t not in own]
            merged = sorted(t for t in (*own, *earlier) if since - t < self.settings.window_seconds)
            history = merged[max(0, len(merged) - HISTORY_CAP) :]
            if history != own:
                await self._annotate(node.name, {HISTORY: json.dumps(history)})
        # Told once, when the loop first sees it, as for one it records itself (a record from before
        # the history was kept is not told again).
        return await self._counted(node, record, history, seen, announce=bool(own), recorded=True)

    async def _counted(
        self,
        node: Node,
        record: Mapping[str, Any],
        history: Sequence[float],
        seen: RepairStatus,
        *,
        announce: bool,
        recorded: bool = False,
    ) -> list[DecisionRecord]:
        """Save the durable copy of a quarantine just seen and escalate a repeat offender (the
        `escalate_after`-th within the window). `announce`: publish the `quarantine` decision.
        `recorded`: the quarantine was recorded by another write (the engine's condition, or the
        adoption of a re-created node, which carries an escalation label over): a node labelled
        already is not escalated again."""
        labelled = node.labels.get(self.settings.escalation_label) == "true"
        alertname = str((record.get("alerts") or ["AcceleratorFault"])[0])
        if len(history) < self.settings.escalate_after or (labelled and recorded):
            await self._save_durable(DurableQuarantine(node.name, record, tuple(history), escalated=labelled))
            if labelled:
                seen.escalated.add(node.name)
            if not announce:
                return []
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
            await self._cluster.annotate_node(
                node.name, {}, record=RecordChange(phase="escalated", at=int(self._clock()))
            )
            await self._cluster.record_event(
                node=node.name, reason="AccelRepeatedFaultsEscalated", message=text, type_="Warning"
            )
        await self._save_durable(DurableQuarantine(node.name, record, tuple(history), escalated=True))
        return self._decide(
            node.name, "escalate", "done", text, alertname=alertname, details=record, boot=node.boot_id
        )

    async def _adopt(
        self, node: Node, durable: DurableQuarantine, seen: RepairStatus
    ) -> list[DecisionRecord]:
        """A new Node object under a quarantined name (the machine was replaced and registered again):
        in one write it gets the startup taint (it takes no work), the quarantine record (of the old
        object, so the repair is seen) and its history (so escalation still counts), and the
        escalation label when the quarantine was escalated; then it is verified like any repair."""
        annotations = {
            QUARANTINE: json.dumps(dict(durable.record), sort_keys=True),
            HISTORY: json.dumps(list(durable.history)),
        }
        labels = {self.settings.escalation_label: "true"} if durable.escalated else {}
        alertname = str((durable.record.get("alerts") or ["AcceleratorFault"])[0])
        text = (
            f"a new node object under the name of a node quarantined for {alertname} "
            f"({len(durable.history)} quarantine(s) within the window): it takes no work "
            f"({STARTUP_TAINT.key}:{STARTUP_TAINT.effect}) until its checks pass"
        )
        seen.quarantined.add(node.name)
        if not self._dry_run:
            held = await self._cluster.set_startup_taint(
                node.name,
                uid=node.uid,
                taint=STARTUP_TAINT,
                present=True,
                annotations=annotations,
                labels=labels,
            )
            if not held:
                return []  # gone, or replaced again since the cache saw it: the next pass looks
            await self._cluster.record_event(
                node=node.name, reason="AccelUnverifiedNodeHeld", message=text, type_="Normal"
            )
        decision = self._decide(
            node.name,
            "hold_unverified",
            "done",
            text,
            alertname=alertname,
            details=durable.record,
            boot=node.boot_id,
        )
        held_node = dataclasses.replace(
            node,
            taints=node.taints if unverified(node) else (*node.taints, STARTUP_TAINT),
            annotations={**node.annotations, **annotations},
            labels={**node.labels, **labels},
        )
        return [*decision, *await self._reconcile_node(held_node, seen)]

    async def _admit(self, node: Node, seen: RepairStatus) -> list[DecisionRecord]:
        """A node that registered with the startup taint under a name with no quarantine recorded: new,
        and nothing says it was bad. Its taint is lifted at once, or (`repair.verify_new_nodes`) once
        `repair.checks` pass on it; a failed check keeps it out like a failed repair."""
        checks = self.settings.checks if self.settings.verify_new_nodes else ()
        if checks:
            failed = _load(node.annotations.get(REPAIR_FAILED))
            if failed is not None and failed.get("bootID") == node.boot_id:
                seen.check_failed[node.name] = str(failed.get("check", ""))
                return []
            if not node.ready or (
                self._dry_run
                and any((node.name, a, node.boot_id) in self._planned for a in ("admit", "verify"))
            ):
                return []
            result = await self._verifier.verify(node.name, checks)
            if not result.answered:
                logger.info(
                    "%s: new node; checks not answered yet (%s); tried again", node.name, result.error
                )
                return []
            if result.verdict != "pass":
                return await self._check_failed(node, "a new node", checks, result, alertname="", seen=seen)
        text = (
            f"a new node, no quarantine recorded under its name; {self._passed(checks)}: "
            f"startup taint {STARTUP_TAINT.key} removed"
        )
        if not self._dry_run:
            await self._cluster.set_startup_taint(
                node.name,
                uid=node.uid,
                taint=STARTUP_TAINT,
                present=False,
                annotations={REPAIR_FAILED: None} if REPAIR_FAILED in node.annotations else {},
                labels={},
            )
        self._count("admitted")
        return self._decide(
            node.name,
            "admit",
            "done",
            text,
            alertname="",
            details={"checks": list(checks)},
            boot=node.boot_id,
        )

    async def _hand_back(self, node: Node, durable: DurableQuarantine | None) -> None:
        """Someone else ended the quarantine (the condition set back, the startup taint removed): the
        record goes, nothing else is touched."""
        if QUARANTINE in node.annotations or REPAIR_FAILED in node.annotations:
            await self._annotate(node.name, {QUARANTINE: None, REPAIR_FAILED: None})
        if durable is not None:
            await self._drop_durable(node.name)
        self._count("handed_back")

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
        await self._enter_verifying(node, repair, checks)
        result = await self._verifier.verify(node.name, checks) if checks else Verification("pass")
        if not result.answered:
            logger.info("%s: %s; checks not answered yet (%s); tried again", node.name, repair, result.error)
            return []
        if result.verdict != "pass":
            return await self._check_failed(node, repair, checks, result, alertname=alertname, seen=seen)
        return await self._return(node, record, checks, repair, alertname)

    async def _enter_verifying(self, node: Node, repair: str, checks: Sequence[str]) -> None:
        """The node's phase becomes `verifying` (once per repair: not again while the checks are
        retried), with an AccelRepairVerifying Event."""
        if self._dry_run or read_record(node.annotations).phase in ("verifying", ""):
            return
        await self._cluster.annotate_node(
            node.name, {}, record=RecordChange(phase="verifying", at=int(self._clock()))
        )
        text = (
            f"{repair}: checks {', '.join(checks) or '(none configured)'} run before it returns to the pool"
        )
        await self._cluster.record_event(
            node=node.name, reason="AccelRepairVerifying", message=text, type_="Normal"
        )

    async def _check_failed(
        self,
        node: Node,
        repair: str,
        checks: Sequence[str],
        result: Verification,
        *,
        alertname: str,
        seen: RepairStatus,
    ) -> list[DecisionRecord]:
        check, message = result.failing[0] if result.failing else (",".join(checks), result.verdict)
        text = f"{repair}, but check {check} did not pass ({message}): kept out of the pool"
        seen.check_failed[node.name] = check
        self._count("check_failed")
        if not self._dry_run:
            failed = {"bootID": node.boot_id, "check": check, "message": message, "at": self._clock()}
            await self._cluster.annotate_node(
                node.name,
                {REPAIR_FAILED: json.dumps(failed, sort_keys=True)},
                record=RecordChange(phase="repair", force=True, at=int(self._clock())),
            )
            await self._cluster.record_event(
                node=node.name, reason="AccelRepairCheckFailed", message=text, type_="Warning"
            )
        details = {"checks": list(checks), "failing": [list(f) for f in result.failing]}
        return self._decide(
            node.name, "verify", "failed", text, alertname=alertname, details=details, boot=node.boot_id
        )

    @staticmethod
    def _passed(checks: Sequence[str]) -> str:
        return f"checks {', '.join(checks)} passed" if checks else "no checks configured"

    async def _return(
        self, node: Node, record: Mapping[str, Any], checks: Sequence[str], repair: str, alertname: str
    ) -> list[DecisionRecord]:
        """Give the node back: under the node's lock (no delivery for it decides meanwhile), after a
        last look at the faults firing on it (one that fires now stops the return), in two writes:
        the cordon, the exact taints this service added (by value), its record and its drain and
        ownership annotations in one; the condition set back True with the quarantine forgotten in
        the other (last, so that a failure between the two leaves a quarantine the next pass finds
        and finishes)."""
        parts = [f"{repair}; {self._passed(checks)}"]
        if self._dry_run:
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
        async with self._node_lock(node.name):
            current = await self._cluster.get_node(node.name)
            if current is None or current.uid != node.uid:
                return []  # gone, or replaced again while it was verified: the next pass looks
            holding = [c for c in self._firing(node.name) if c.holds]
            if holding:
                names = ", ".join(sorted({c.alertname for c in holding}))
                logger.info("%s: %s fires again; not returned", node.name, names)
                return self._decide(
                    node.name,
                    "return_to_pool",
                    "skipped",
                    f"{names} fires on the node now: not returned (it stays out until this fault's "
                    "repair too)",
                    alertname=alertname,
                    boot=node.boot_id,
                )
            returned = await self._cluster.return_node(
                node.name,
                uid=node.uid,
                taints=self._our_taints(current),
                annotations={},
                record=RecordChange(clear=True),
            )
            if returned is None:
                return []
            if returned.uncordoned:
                parts.append("uncordoned")
            elif returned.cordon_kept:
                parts.append("cordon kept: not made by accel-health, or changed by someone since")
            if returned.taints_removed:
                parts.append(f"taint {', '.join(returned.taints_removed)} removed")
            clear: dict[str, str | None] = {QUARANTINE: None, REPAIR_FAILED: None}
            if unverified(current) or replaced(record, current):
                await self._cluster.set_startup_taint(
                    node.name, uid=node.uid, taint=STARTUP_TAINT, present=False, annotations=clear, labels={}
                )
                if unverified(current):
                    parts.append(f"startup taint {STARTUP_TAINT.key} removed")
                clear = {}
            conditions = [
                ctype
                for ctype in self._conditions
                if any(c.type == ctype and c.status == "False" for c in current.conditions)
            ]
            for ctype in conditions:
                await self._cluster.set_condition(
                    node.name,
                    NodeCondition(type=ctype, status="True", reason=RETURNED_REASON, message=parts[0]),
                    annotations=clear,
                )
                clear = {}
            if clear and any(k in current.annotations for k in clear):
                await self._annotate(node.name, clear)
        await self._drop_durable(node.name)
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

    def _our_taints(self, node: Node) -> list[Taint]:
        """The taints on the node that this service added, as it set them (key, effect and one of
        the values the policy's taint steps set): what a return removes, and nothing else."""
        owned = set(owned_taints(node.annotations))
        return [
            t
            for t in node.taints
            if taint_id(t.key, t.effect) in owned and t.value in self._taint_values.get((t.key, t.effect), ())
        ]

    # -- the durable copies ------------------------------------------------------------------------

    async def _load_durable(self) -> dict[str, DurableQuarantine]:
        out: dict[str, DurableQuarantine] = {}
        for node, doc in (await self._cluster.load_quarantines()).items():
            copy = DurableQuarantine.from_document(node, doc)
            if copy is None:
                logger.warning("the durable quarantine copy of %s is not one; ignored", node)
            else:
                out[node] = copy
        return out

    async def _save_durable(self, copy: DurableQuarantine) -> None:
        if self._dry_run:
            return
        await self._cluster.save_quarantine(copy.node, copy.document())
        if self._durable is not None:
            self._durable[copy.node] = copy

    async def _drop_durable(self, node: str) -> None:
        if self._dry_run:
            return
        await self._cluster.delete_quarantine(node)
        if self._durable is not None:
            self._durable.pop(node, None)

    async def _forget_absent(self, present: set[str]) -> None:
        """A quarantined name no node has had for a whole window (scaled in, replaced under another
        name) is forgotten: the copies stay bounded by the nodes quarantined within one window."""
        if self._dry_run:
            return
        now = self._clock()
        for name, copy in list((self._durable or {}).items()):
            if name not in present and now - copy.last >= self.settings.window_seconds:
                logger.info("%s: no such node for %.0f s; its quarantine is forgotten", name, now - copy.last)
                await self._drop_durable(name)

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
    """`accel_remediator_*` series of the repair loop: the quarantined nodes from the cluster's
    observed nodes at scrape time (the last pass's view where it has none), the rest from the last
    pass."""

    def __init__(self, loop: RepairLoop) -> None:
        self._loop = loop

    def describe(self) -> list[GaugeMetricFamily]:
        return []

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        st = self._loop.status
        now = self._loop.quarantined_now()
        yield GaugeMetricFamily(
            "accel_remediator_quarantined_nodes",
            "Nodes out of the pool for an accelerator fault (a condition False, or a replacement under a "
            "quarantined name not verified yet).",
            value=len(now if now is not None else st.quarantined),
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
            "Outcomes of the repair loop: returned, check_failed, escalated, handed_back, admitted.",
            labels=["result"],
        )
        for result in RESULTS:
            results.add_metric([result], st.results.get(result, 0))
        yield results


@contextlib.asynccontextmanager
async def _no_lock(node: str) -> AsyncIterator[None]:
    del node
    yield


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


def _json_size(doc: Mapping[str, Any]) -> int:
    return len(json.dumps(doc, separators=(",", ":"), sort_keys=True).encode())


def _float(value: Any) -> float:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0.0
