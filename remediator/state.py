"""Gate state: everything the safety gates and reversals must remember across restarts (pure).

One JSON document, kept in the cluster through `Cluster.load_gate_state` / `Cluster.save_gate_state`
(the snapshot backend keeps it in memory; the Kubernetes executor keeps it in a small object), read
read back by a replica each time it becomes the leader, and written after every delivery that
changed it, with the resourceVersion it was read at as a precondition (a conflict means another
writer was there: read again, merge, write again):

    {"version": 1,
     "pause":       {"paused": false, "since": 0, "reason": ""},
     "breaker":     {"open": false, "opened_at": 0, "below_since": null, "trips": 0, "eligible": 5,
                     "alerting": {"gpu-node-1": {"<fingerprint>": 1732312800.0}}},
     "rate_limits": {"drain": [1732312800.0]},
     "budget":      {"gpu-node-1": {"since": 1732312800.0, "kinds": ["cordon", "drain"]}},
     "cordoned":    ["gpu-node-1"],
     "tainted":     {"gpu-node-2": [{"key": "accel-health.io/unhealthy", "value": "true",
                                     "effect": "NoSchedule"}]},
     "decided":     ["9f86d081884c7d65", ...],
     "firing":      {"gpu-node-1": {"<fingerprint>": {"alertname": "...", "rule": "drain",
                                                      "holds": ["cordon"], "expires": 1732327800.0}}},
     "drains":      {"gpu-node-3": [<webhook alert>, ...]},
     "held":        {"gpu-node-4": [{"rule": "pcie", "alert": <resolved webhook alert>}]}}

Decisions taken in dry-run are remembered in memory only: they never reach the document, so a dry-run
service writes nothing and a dry-run rule never uses up the real budget.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Hashable, Mapping
from typing import Any

from remediator.cluster import Taint
from remediator.desired import FiringSet
from remediator.safety import (
    Clock,
    DisruptionBudget,
    PauseSwitch,
    RateLimiter,
    SafetySettings,
    StormBreaker,
)

STATE_VERSION = 1
PERSISTED_KEYS = 20_000
"""Idempotency keys written to the document (16 hex digits each: about 400 KB at most)."""


class StateError(ValueError):
    """The stored gate state cannot be read; the message names the field."""


def key_digest(key: Hashable) -> str:
    """A stable 64-bit digest of an idempotency key (what is stored)."""
    return hashlib.blake2b(repr(key).encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()


class DecidedKeys:
    """Idempotency keys already decided, as digests, bounded (oldest forgotten first)."""

    def __init__(self, *, keep: int = 100_000) -> None:
        self._keys: OrderedDict[str, bool] = OrderedDict()  # digest -> persisted (decided for real)
        self._keep = keep

    def __contains__(self, key: Hashable) -> bool:
        return key_digest(key) in self._keys

    def add(self, key: Hashable, *, persist: bool = True) -> None:
        digest = key_digest(key)
        self._keys[digest] = persist
        self._keys.move_to_end(digest)
        while len(self._keys) > self._keep:
            self._keys.popitem(last=False)

    def __len__(self) -> int:
        return len(self._keys)

    def persisted(self, limit: int = PERSISTED_KEYS) -> list[str]:
        """The newest `limit` real (not dry-run) digests, oldest first."""
        out: list[str] = []
        for digest in reversed(self._keys):
            if self._keys[digest]:
                out.append(digest)
                if len(out) >= limit:
                    break
        out.reverse()
        return out

    def load(self, digests: list[Any]) -> None:
        for digest in digests:
            if not isinstance(digest, str):
                raise StateError(f"decided: expected strings, got {digest!r}")
            self._keys[digest] = True
            self._keys.move_to_end(digest)


class Ownership:
    """What this service did to nodes that it may undo: cordons and taints (reversal needs this)."""

    def __init__(self) -> None:
        self.cordoned: dict[str, bool] = {}  # node -> dry_run
        self.tainted: dict[str, dict[tuple[str, str], tuple[str, bool]]] = {}
        # node -> (key, effect) -> (value, dry_run)

    def add_cordon(self, node: str, *, dry_run: bool) -> None:
        if not (node in self.cordoned and not self.cordoned[node]):
            self.cordoned[node] = dry_run

    def add_taint(self, node: str, taint: Taint, *, dry_run: bool) -> None:
        self.tainted.setdefault(node, {})[(taint.key, taint.effect)] = (taint.value, dry_run)

    def our_taints(self, node: str) -> list[Taint]:
        return [Taint(key=k, value=v, effect=e) for (k, e), (v, _) in self.tainted.get(node, {}).items()]

    def drop_taint(self, node: str, taint: Taint) -> None:
        taints = self.tainted.get(node, {})
        taints.pop((taint.key, taint.effect), None)
        if not taints:
            self.tainted.pop(node, None)

    def forget(self, node: str) -> None:
        self.cordoned.pop(node, None)
        self.tainted.pop(node, None)

    def to_state(self) -> tuple[list[str], dict[str, list[dict[str, str]]]]:
        cordoned = sorted(n for n, dry in self.cordoned.items() if not dry)
        tainted = {
            node: [
                {"key": k, "value": v, "effect": e} for (k, e), (v, dry) in sorted(taints.items()) if not dry
            ]
            for node, taints in sorted(self.tainted.items())
        }
        return cordoned, {n: t for n, t in tainted.items() if t}

    def load_state(self, cordoned: Any, tainted: Any) -> None:
        if not isinstance(cordoned, list) or not all(isinstance(n, str) for n in cordoned):
            raise StateError("cordoned: expected a list of node names")
        if not isinstance(tainted, Mapping):
            raise StateError("tainted: expected a mapping of node -> taints")
        self.cordoned = dict.fromkeys(cordoned, False)
        self.tainted = {}
        for node, taints in tainted.items():
            if not isinstance(taints, list):
                raise StateError(f"tainted.{node}: expected a list of taints")
            for i, t in enumerate(taints):
                if not isinstance(t, Mapping) or not all(
                    isinstance(t.get(f), str) for f in ("key", "effect")
                ):
                    raise StateError(f"tainted.{node}[{i}]: expected {{key, value, effect}}")
                taint = Taint(key=t["key"], value=str(t.get("value", "")), effect=t["effect"])
                self.add_taint(str(node), taint, dry_run=False)


class GateState:
    """The gates and the memory behind idempotency and reversal, with the document codec."""

    def __init__(self, *, settings: SafetySettings, clock: Clock) -> None:
        self.pause = PauseSwitch(clock=clock)
        self.breaker = StormBreaker(settings=settings.storm_breaker, clock=clock)
        self.rate = RateLimiter(limits=settings.rate_limits, clock=clock)
        self.budget = DisruptionBudget(
            max_nodes=settings.max_disrupted_nodes, max_percent=settings.max_disrupted_percent, clock=clock
        )
        self.ownership = Ownership()
        self.decided = DecidedKeys()
        self.firing = FiringSet(clock=clock, expiry_seconds=settings.alert_expiry_seconds)
        self.drains: dict[str, list[dict[str, Any]]] = {}
        """Node -> the alerts (webhook documents) its running drain was started for, so that a new
        leader resumes the drains the previous one left running."""
        self.held: dict[str, list[dict[str, Any]]] = {}
        """Node -> the resolved alerts whose reversals (on_resolved) wait for other causes still
        firing on the node, each {"rule": name, "alert": webhook document}: a new leader releases
        them when the last cause resolves."""

    def to_document(self) -> dict[str, Any]:
        cordoned, tainted = self.ownership.to_state()
        return {
            "version": STATE_VERSION,
            "pause": self.pause.to_state(),
            "breaker": self.breaker.to_state(),
            "rate_limits": self.rate.to_state(),
            "budget": self.budget.to_state(),
            "cordoned": cordoned,
            "tainted": tainted,
            "decided": self.decided.persisted(),
            "firing": self.firing.to_state(),
            "drains": {node: list(alerts) for node, alerts in self.drains.items()},
            "held": {node: list(items) for node, items in self.held.items()},
        }

    def load_document(self, doc: Any) -> None:
        """Restore from a document; StateError naming the field when it cannot be used."""
        if not isinstance(doc, Mapping):
            raise StateError(f"expected a mapping, got {type(doc).__name__}")
        if doc.get("version") != STATE_VERSION:
            raise StateError(f"version: expected {STATE_VERSION}, got {doc.get('version')!r}")
        for key, part in (("pause", self.pause), ("breaker", self.breaker), ("rate_limits", self.rate)):
            section = doc.get(key, {})
            if not isinstance(section, Mapping):
                raise StateError(f"{key}: expected a mapping")
            try:
                part.load_state(section)
            except ValueError as exc:
                raise StateError(f"{key}.{exc}") from exc
        budget = doc.get("budget", {})
        if not isinstance(budget, Mapping):
            raise StateError("budget: expected a mapping")
        try:
            self.budget.load_state(budget)
        except ValueError as exc:
            raise StateError(f"budget.{exc}") from exc
        self.ownership.load_state(doc.get("cordoned", []), doc.get("tainted", {}))
        decided = doc.get("decided", [])
        if not isinstance(decided, list):
            raise StateError("decided: expected a list")
        self.decided.load(decided)
        firing = doc.get("firing", {})
        if not isinstance(firing, Mapping):
            raise StateError("firing: expected a mapping of node -> fingerprint -> cause")
        try:
            self.firing.load_state(firing)
        except ValueError as exc:
            raise StateError(f"firing.{exc}") from exc
        drains = doc.get("drains", {})
        if not isinstance(drains, Mapping) or not all(
            isinstance(alerts, list) and all(isinstance(a, Mapping) for a in alerts)
            for alerts in drains.values()
        ):
            raise StateError("drains: expected a mapping of node to a list of alerts")
        self.drains = {str(node): [dict(a) for a in alerts] for node, alerts in drains.items()}
        held = doc.get("held", {})
        if not isinstance(held, Mapping) or not all(
            isinstance(items, list)
            and all(isinstance(i, Mapping) and isinstance(i.get("alert"), Mapping) for i in items)
            for items in held.values()
        ):
            raise StateError("held: expected a mapping of node to a list of {rule, alert}")
        self.held = {str(node): [dict(i) for i in items] for node, items in held.items()}

    def merge_unsaved(self, mine: GateState) -> None:
        """This state was just read back after another writer changed the stored document since
        `mine` was read: keep everything the other writer stored (pause, breaker), and add what
        `mine` knows that it lacks (nodes held, ownership, decided keys, rate-limited actions,
        firing alerts), so that neither writer's actions are forgotten."""
        for node, hold in mine.budget.holders().items():
            if not hold.dry_run:
                for kind in hold.kinds:
                    self.budget.commit(node, kind=kind, dry_run=False)
        for node, dry in mine.ownership.cordoned.items():
            if not dry:
                self.ownership.add_cordon(node, dry_run=False)
        for node in list(mine.ownership.tainted):
            for taint in mine.ownership.our_taints(node):
                self.ownership.add_taint(node, taint, dry_run=False)
        self.decided.load(mine.decided.persisted())
        self.rate.merge(mine.rate)
        self.firing.merge(mine.firing)
        for node, alerts in mine.drains.items():
            self.drains.setdefault(node, alerts)
        for node, items in mine.held.items():
            self.held.setdefault(node, items)
