"""The record a node carries (remediator/lifecycle/record.py): its codec, its bound, and how a change is
applied to the record as read just before the write, so that a write retried after a conflict neither
loses what another writer recorded meanwhile nor brings back what was forgotten (issue 23: the 409 merge
of the old gate-state document was a union); startsAt as the record keeps it."""

from __future__ import annotations

import json

import pytest

from remediator.lifecycle.record import (
    EPISODES,
    MAX_EPISODES,
    Episode,
    NodeRecord,
    RecordChange,
    RecordError,
    decode,
    episode_start,
    read,
    starts_at_text,
)


def episode(fp: str = "0123456789abcdef", *, steps: int = 0b1, start: int = 1_764_000_000) -> Episode:
    return Episode(fingerprint=fp, rule="drain", alertname="AccelGPUFatalXid", start=start, steps=steps)


def test_a_record_round_trips_through_its_annotation_and_stores_no_label() -> None:
    record = RecordChange(episodes=(episode(steps=0b101),), kind="cordon", at=1_764_000_100).apply(
        NodeRecord()
    )
    text = record.encode()
    assert text is not None
    assert json.loads(text) == {
        "e": {"0123456789abcdef": ["drain", "AccelGPUFatalXid", 1_764_000_000, 5]},
        "t": {"cordon": 1_764_000_100},
    }
    assert decode(text) == record
    assert record.episode("0123456789abcdef", 1_764_000_000) is not None
    assert record.episode("0123456789abcdef", 1_764_000_001) is None  # another episode of the alert


def test_an_episode_entry_costs_about_sixty_bytes() -> None:
    one = RecordChange(episodes=(episode(),)).apply(NodeRecord()).encode()
    two = RecordChange(episodes=(episode(), episode("fedcba9876543210"))).apply(NodeRecord()).encode()
    assert one is not None
    assert two is not None
    assert len(two) - len(one) <= 64


def test_steps_add_up_and_a_new_episode_of_the_same_alert_replaces_the_old_one() -> None:
    record = RecordChange(episodes=(episode(steps=0b01),)).apply(NodeRecord())
    record = RecordChange(episodes=(episode(steps=0b10),)).apply(record)
    assert record.episodes["0123456789abcdef"].steps == 0b11
    newer = RecordChange(episodes=(episode(steps=0b1, start=1_764_009_999),)).apply(record)
    assert newer.episodes["0123456789abcdef"] == episode(steps=0b1, start=1_764_009_999)


def test_a_change_applied_after_a_conflict_keeps_the_other_writers_and_brings_nothing_back() -> None:
    mine = RecordChange(episodes=(episode("aaaaaaaaaaaaaaaa", steps=0b10),), kind="cordon", at=10)
    # What the node holds when the write is retried: another writer recorded b, and a's episode
    # ended meanwhile (its forget was written).
    theirs = RecordChange(episodes=(episode("bbbbbbbbbbbbbbbb"),), kind="taint", at=9).apply(NodeRecord())
    after = mine.apply(theirs)
    assert set(after.episodes) == {"aaaaaaaaaaaaaaaa", "bbbbbbbbbbbbbbbb"}
    assert after.times == {"taint": 9, "cordon": 10}
    ended = RecordChange(forget=frozenset({("bbbbbbbbbbbbbbbb", 1_764_000_000)})).apply(after)
    assert set(ended.episodes) == {"aaaaaaaaaaaaaaaa"}
    again = RecordChange(episodes=(episode("aaaaaaaaaaaaaaaa", steps=0b100),)).apply(ended)
    assert set(again.episodes) == {"aaaaaaaaaaaaaaaa"}  # a forgotten episode does not come back


def test_a_node_keeps_at_most_max_episodes_the_oldest_dropped_first() -> None:
    many = tuple(episode(f"{i:016x}", start=1_764_000_000 + i) for i in range(MAX_EPISODES + 5))
    record = RecordChange(episodes=many).apply(NodeRecord())
    assert len(record.episodes) == MAX_EPISODES
    assert min(e.start for e in record.episodes.values()) == 1_764_000_005
    text = record.encode()
    assert text is not None
    assert len(text) <= 3 * 1024


def test_the_record_goes_when_its_last_episode_does_and_a_clear_removes_it_whole() -> None:
    annotations = {
        EPISODES: RecordChange(episodes=(episode(),), kind="cordon", at=1).apply(NodeRecord()).encode() or ""
    }
    forget = RecordChange(forget=frozenset({("0123456789abcdef", 1_764_000_000)}))
    assert forget.annotation(annotations) == {EPISODES: None}
    assert RecordChange(clear=True).annotation(annotations) == {EPISODES: None}
    assert RecordChange(episodes=(episode(),)).annotation(annotations) == {}  # nothing new: no change


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "is not JSON"),
        ("[]", "expected a JSON object"),
        ('{"e": []}', "e and t must be objects"),
        ('{"e": {"fp": ["r", "a", "x", 1]}}', "expected \\[rule, alertname, startsAt, steps\\]"),
        ('{"t": {"cordon": "now"}}', "expected a number"),
    ],
)
def test_an_unreadable_record_is_an_error_naming_what_is_wrong_and_reads_as_empty(
    text: str, message: str
) -> None:
    with pytest.raises(RecordError, match=message):
        decode(text)
    assert read({EPISODES: text}) == NodeRecord()


def test_starts_at_is_kept_to_the_second_and_reads_back_the_same_way() -> None:
    assert episode_start("2025-11-22T20:00:00Z") == episode_start("2025-11-22T20:00:00.123456789Z")
    assert episode_start("2025-11-22T20:00:00.000Z") == 1_763_841_600
    assert episode_start(starts_at_text(1_763_841_600)) == 1_763_841_600
    assert episode_start("not a time") == episode_start("not a time") < 0  # stable, never a real time
