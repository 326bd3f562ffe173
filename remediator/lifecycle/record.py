"""What this service holds on a node, kept on the node itself (pure: no client library, no I/O).

The record of an action is the action's own write. The PATCH that cordons, taints, sets the condition,
starts or ends a drain, or announces an AWS call also carries, in the same request (with the node's
resourceVersion as precondition), the node's record: which alert episodes hold the node, for which
policy rule, and which of the rule's steps were decided. Nothing is kept in an object that grows with
the fleet; a new leader derives what it must remember (budget holders, ownership, idempotency, running
drains, rate-limit times) from the nodes it watches, before it is ready.

The annotations this service writes on a Node (prefix `accel-health.io/`):

- `cordoned-by`, `cordoned-at`: this service cordoned the node (un-cordon requires it);
- `taints-added`: JSON list of `key:effect` of taints this service added (only these are removed);
- `drain-started`, `drain-deadline`, `drain-status`, `drain-blocked`: the drain's progress, so that a
  drain interrupted by a fail-over resumes with its original deadline;
- `episodes` (this module): the record, compact JSON

      {"e": {"<fingerprint>": ["<rule>", "<alertname>", <startsAt, unix s>, <steps>(, "h")]},
       "t": {"<action kind>": <unix s>},
       "p": ["<phase>", <since, unix s>]}

  `e` holds one entry per alert episode (fingerprint + startsAt) that acted on the node; `steps` is a
  bit set over the rule's `actions` (bit i: action i was decided; for an AWS action, asked for: the
  intent is written before the call, and after a fail-over the instance's state is read before the
  call is made again); a fifth element `"h"` says a human ended the episode's remediation (an
  uncordon or a taint removed by someone else): nothing more is done for it. `t` holds, per action
  kind, when this service last did it on the node (the rate limits of a new leader). `p` is the
  node's phase in its lifecycle (remediator/lifecycle/phases.py) and since when, written by the
  same request that moves it. No alert labels are stored. At most `MAX_EPISODES` episodes per node
  (the oldest dropped first); an episode entry is about 60 bytes, so a node's record stays under
  3 KiB however many alerts fire in the fleet. The record is removed when the node returns to the
  pool (the return's own write), or when its episodes ended and nothing of this service's holds the
  node any more;
- `quarantine`, `quarantine-history`, `repair-failed`, `rebooted`: the repair loop's
  (remediator/lifecycle/repair.py).
- `evidence`: where the newest evidence capture of the node is (`s3://bucket/key` or
  `configmap/<namespace>/<name>`), written with the `evidence` step's record (remediator/evidence/).
"""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

PREFIX = "accel-health.io/"
MANAGER = "accel-health-remediator"
"""This service's name: the value of `cordoned-by` and the field manager of its writes."""
CORDONED_BY = PREFIX + "cordoned-by"
"""Set when this service cordoned the node (value: the service's name); un-cordon requires it."""
CORDONED_AT = PREFIX + "cordoned-at"
"""When this service cordoned the node (RFC 3339)."""
TAINTS_ADDED = PREFIX + "taints-added"
"""JSON list of `key:effect` of taints this service added; only these are ever removed."""
DRAIN_STARTED = PREFIX + "drain-started"
"""When the current drain started (RFC 3339)."""
DRAIN_DEADLINE = PREFIX + "drain-deadline"
"""When the current drain gives up (RFC 3339); a resumed drain keeps it."""
DRAIN_STATUS = PREFIX + "drain-status"
"""`in-progress`, `done`, `timed-out` or `refused` (an eviction answered 403 or denied by admission)."""
DRAIN_BLOCKED = PREFIX + "drain-blocked"
"""After a drain that could not finish: `namespace/name` of the pods that blocked it."""
RETURN_FORGETS = (CORDONED_BY, CORDONED_AT, DRAIN_STARTED, DRAIN_DEADLINE, DRAIN_STATUS, DRAIN_BLOCKED)
"""What a node's return to the pool removes besides its record and the taints it gives back."""
EPISODES = PREFIX + "episodes"
"""The record of this module: the episodes holding the node and the steps decided for each."""

MAX_EPISODES = 32
"""Episodes kept per node (the oldest by startsAt dropped first): bounds a node's record to ~2 KiB."""

_FRACTION = re.compile(r"\.\d+")


def episode_start(starts_at: str) -> int:
    """An alert's startsAt as whole seconds since the epoch: what the record stores, and what the
    engine's idempotency keys use, so that a key rebuilt from a record equals the one a delivery
    makes. Alertmanager writes up to nanoseconds; they are dropped. A value that is not a time (only
    in hand-made payloads) becomes a stable number of its own."""
    text = _FRACTION.sub("", starts_at.strip()).replace("Z", "+00:00")
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        return -int(zlib.crc32(starts_at.encode("utf-8", "surrogatepass")))
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return int(when.timestamp())


def rfc3339(ts: float) -> str:
    """A unix time as the annotations write it (whole seconds, UTC)."""
    return datetime.fromtimestamp(ts, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_rfc3339(text: str) -> float | None:
    """The unix time of an annotation written by `rfc3339` (None when it is not one)."""
    try:
        return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()
    except ValueError:
        return None


def starts_at_text(start: int) -> str:
    """The RFC 3339 form of a stored startsAt (for an alert the engine makes up from a record)."""
    return rfc3339(start)


@dataclass(frozen=True)
class Episode:
    """One alert episode that acted on the node."""

    fingerprint: str
    """The alert's fingerprint (Alertmanager's hash of its labels)."""
    rule: str
    """The policy rule it fired under (its `on_resolved` is what a resolve runs)."""
    alertname: str
    """Its alertname (for people and Events; no other label is stored)."""
    start: int
    """Its startsAt, unix seconds: with the fingerprint, the episode's identity."""
    steps: int = 0
    """Bit i set: action i of the rule's `actions` was decided (AWS actions: asked for)."""
    released: bool = False
    """A human ended this episode's remediation (uncordoned the node, removed the taint): nothing
    more is done for it, and it holds nothing."""

    def done(self, index: int) -> bool:
        """Was action `index` decided?"""
        return bool(self.released or self.steps >> index & 1)

    def as_json(self) -> list[Any]:
        out: list[Any] = [self.rule, self.alertname, self.start, self.steps]
        return [*out, "h"] if self.released else out


@dataclass(frozen=True)
class NodeRecord:
    """The record on one node."""

    episodes: Mapping[str, Episode] = field(default_factory=dict)
    """By fingerprint: one episode per alert at a time (a new startsAt replaces the old one)."""
    times: Mapping[str, int] = field(default_factory=dict)
    """Action kind -> when this service last did it on the node (unix seconds)."""
    phase: str = ""
    """The node's phase in its lifecycle (remediator/lifecycle/phases.py); empty: none recorded."""
    since: int = 0
    """When the node entered `phase` (unix seconds)."""

    def episode(self, fingerprint: str, start: int) -> Episode | None:
        """The episode with this identity, if recorded."""
        found = self.episodes.get(fingerprint)
        return found if found is not None and found.start == start else None

    @property
    def empty(self) -> bool:
        return not self.episodes and not self.times

    def encode(self) -> str | None:
        """The annotation value (compact JSON), or None when there is nothing to keep."""
        if not self.episodes:
            return None  # nothing holds the node: the times alone are not worth keeping
        doc: dict[str, Any] = {
            "e": {fp: ep.as_json() for fp, ep in sorted(self.episodes.items())},
            "t": dict(sorted(self.times.items())),
        }
        if self.phase:
            doc["p"] = [self.phase, self.since]
        return json.dumps(doc, separators=(",", ":"))


class RecordError(ValueError):
    """A record annotation that cannot be read; the message says what is wrong."""


def decode(text: str | None) -> NodeRecord:
    """The record in an `episodes` annotation value (None or empty: no record). RecordError when the
    value is not a record this service wrote."""
    if not text:
        return NodeRecord()
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise RecordError(f"{EPISODES} is not JSON: {exc}") from exc
    if not isinstance(doc, Mapping):
        raise RecordError(f"{EPISODES}: expected a JSON object")
    raw_episodes, raw_times = doc.get("e", {}), doc.get("t", {})
    if not isinstance(raw_episodes, Mapping) or not isinstance(raw_times, Mapping):
        raise RecordError(f"{EPISODES}: e and t must be objects")
    episodes: dict[str, Episode] = {}
    for fp, raw in raw_episodes.items():
        if (
            not isinstance(raw, list)
            or len(raw) not in (4, 5)
            or not all(isinstance(v, str) for v in raw[:2])
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in raw[2:4])
            or raw[4:] not in ([], ["h"])
        ):
            raise RecordError(
                f'{EPISODES}: episode {fp}: expected [rule, alertname, startsAt, steps] or [..., "h"]'
            )
        episodes[str(fp)] = Episode(
            fingerprint=str(fp),
            rule=raw[0],
            alertname=raw[1],
            start=raw[2],
            steps=raw[3],
            released=len(raw) == 5,
        )
    times: dict[str, int] = {}
    for kind, at in raw_times.items():
        if not isinstance(at, int | float) or isinstance(at, bool):
            raise RecordError(f"{EPISODES}: time of {kind}: expected a number")
        times[str(kind)] = int(at)
    raw_phase = doc.get("p", [])
    if raw_phase == []:
        return NodeRecord(episodes=episodes, times=times)
    if (
        not isinstance(raw_phase, list)
        or len(raw_phase) != 2
        or not isinstance(raw_phase[0], str)
        or not isinstance(raw_phase[1], int | float)
        or isinstance(raw_phase[1], bool)
    ):
        raise RecordError(f"{EPISODES}: p: expected [phase, since]")
    return NodeRecord(episodes=episodes, times=times, phase=raw_phase[0], since=int(raw_phase[1]))


def read(annotations: Mapping[str, str]) -> NodeRecord:
    """The record on a node with these annotations; an unreadable one reads as empty (the engine
    then knows nothing of the node's episodes and decides them again, which its other checks make
    harmless: it never cordons twice, never claims another's cordon)."""
    try:
        return decode(annotations.get(EPISODES))
    except RecordError:
        return NodeRecord()


@dataclass(frozen=True)
class RecordChange:
    """A change to a node's record, applied to the record as the node is read just before the write
    (so a write retried after a conflict never undoes what another writer recorded meanwhile)."""

    episodes: tuple[Episode, ...] = ()
    """Record these episodes: the steps of each are added to those already recorded for it (a new
    startsAt of the same fingerprint replaces the old episode)."""
    kind: str = ""
    """An action kind done now (its time goes into `times`); empty: none."""
    at: int = 0
    """When, unix seconds."""
    forget: frozenset[tuple[str, int]] = frozenset()
    """Episodes (fingerprint, startsAt) that ended: removed."""
    clear: bool = False
    """Remove the whole record (the node returned to the pool)."""
    phase: str = ""
    """The phase this write moves the node to (empty: unchanged). Applied as
    remediator/lifecycle/phases.py `advance` says: a phase never moves back within the node's
    episodes, except where `force` says so."""
    force: bool = False
    """Set `phase` whatever the node's phase is (a human's release, an escalation, a failed check)."""
    release: bool = False
    """Every episode recorded now is ended by a human (marked `released`)."""

    def apply(self, record: NodeRecord) -> NodeRecord:
        if self.clear:
            return NodeRecord()
        episodes = {
            fp: ep for fp, ep in record.episodes.items() if (ep.fingerprint, ep.start) not in self.forget
        }
        if self.release:
            episodes = {fp: replace(ep, released=True) for fp, ep in episodes.items()}
        for given in self.episodes:
            old = episodes.get(given.fingerprint)
            if old is not None and old.start == given.start:
                given = replace(  # noqa: PLW2901  merged with what is there
                    given, steps=given.steps | old.steps, released=given.released or old.released
                )
            episodes[given.fingerprint] = given
        if len(episodes) > MAX_EPISODES:
            kept = sorted(episodes.values(), key=lambda e: (e.start, e.fingerprint))[-MAX_EPISODES:]
            episodes = {e.fingerprint: e for e in kept}
        times = dict(record.times)
        if self.kind:
            times[self.kind] = self.at
        phase, since = record.phase, record.since
        if self.phase and (self.force or moves_forward(phase, self.phase)) and self.phase != phase:
            phase, since = self.phase, self.at
        return NodeRecord(episodes=episodes, times=times, phase=phase, since=since)

    def annotation(self, annotations: Mapping[str, str]) -> dict[str, str | None]:
        """The merge-patch entry that applies this change to a node with these annotations ({}
        when it changes nothing)."""
        before = annotations.get(EPISODES)
        after = self.apply(read(annotations)).encode()
        return {} if after == before else {EPISODES: after}


PHASE_ORDER = ("held", "evidence", "draining", "repair", "verifying")
"""The phases of the way out and back, in order (remediator/lifecycle/phases.py says what each is);
`escalated` and `released` stand apart: a human has the node."""


def moves_forward(current: str, new: str) -> bool:
    """Does a write that asks for phase `new` move a node in `current` on? Within the way out and
    back only forward (a second alert's cordon does not take a draining node back to held); from
    none or `released` (a new episode after a human's release) to any; never out of `escalated`
    but by force (the human's label decides)."""
    if not current or current == "released":
        return True
    if current == "escalated" or new not in PHASE_ORDER or current not in PHASE_ORDER:
        return new == "escalated" and current != "escalated"
    return PHASE_ORDER.index(new) > PHASE_ORDER.index(current)


def owned_taints(annotations: Mapping[str, str]) -> list[str]:
    """`key:effect` of the taints this service added (per `taints-added`)."""
    raw = annotations.get(TAINTS_ADDED, "")
    try:
        value = json.loads(raw) if raw else []
    except ValueError:
        return []
    return [str(v) for v in value] if isinstance(value, list) else []


def taint_id(key: str, effect: str) -> str:
    """How `taints-added` names a taint."""
    return f"{key}:{effect}"


def cordoned_by_us(annotations: Mapping[str, str], *, manager: str = MANAGER) -> bool:
    """Did this service cordon the node (and nobody took the cordon over since, as far as the
    annotation can tell)?"""
    return annotations.get(CORDONED_BY) == manager
