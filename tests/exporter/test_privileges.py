"""exporter/privileges.py on this machine's kernel: capabilities raised for a block and lowered after,
given up for good, per thread. Each case runs on a thread of its own (capabilities belong to a thread),
so the test process keeps its own. The image's exporter, as uid 65532 with the file capabilities,
is tested in tests/image."""

from __future__ import annotations

import ctypes
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

from exporter.privileges import Capability, CapabilitySets, current, give_up, raised, settle, take_directory

T = TypeVar("T")
SYSLOG = 1 << Capability.SYSLOG
CHOWN = 1 << Capability.CHOWN

pytestmark = pytest.mark.skipif(
    current().permitted & (SYSLOG | CHOWN) != SYSLOG | CHOWN or os.uname().machine != "x86_64",
    reason="needs CAP_SYSLOG and CAP_CHOWN permitted (root), and x86_64 (the setresuid syscall's number)",
)
_SYS_SETRESUID, _PR_SET_KEEPCAPS = 117, 8
_libc = ctypes.CDLL(None, use_errno=True)


def on_a_thread(work: Callable[[], T]) -> T:
    """``work``'s result, run on a new thread (its capability changes end with it)."""
    result: list[T] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            result.append(work())
        except BaseException as exc:  # handed to the test's thread
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(timeout=10)
    if errors:
        raise errors[0]
    return result[0]


def _lower(mask: int) -> None:
    """Clears ``mask`` from the calling thread's effective set only (it stays permitted)."""
    from exporter import privileges  # noqa: PLC0415 -- the private setter, for the arrangement only

    sets = current()
    privileges._set(CapabilitySets(sets.effective & ~mask, sets.permitted, sets.inheritable))


def test_a_permitted_capability_is_effective_inside_the_block_only() -> None:
    def work() -> tuple[int, bool, int, int]:
        _lower(SYSLOG)
        before = current().effective & SYSLOG
        with raised(Capability.SYSLOG) as effective:
            inside = current().effective & SYSLOG
        return before, effective, inside, current().effective & SYSLOG

    before, effective, inside, after = on_a_thread(work)
    assert (before, effective, inside, after) == (0, True, SYSLOG, 0)


def test_a_capability_already_effective_stays_so_after_the_block() -> None:
    def work() -> tuple[bool, int]:
        with raised(Capability.SYSLOG) as effective:
            pass
        return effective, current().effective & SYSLOG

    assert on_a_thread(work) == (True, SYSLOG)


def test_a_capability_given_up_cannot_be_raised_again_on_that_thread_or_its_children() -> None:
    def work() -> tuple[int, bool, bool]:
        give_up(Capability.CHOWN)
        with raised(Capability.CHOWN) as effective:
            pass
        child = on_a_thread(lambda: bool(current().permitted & CHOWN))
        return current().permitted & CHOWN, effective, child

    assert on_a_thread(work) == (0, False, False)
    assert current().permitted & CHOWN  # the test's own thread is untouched


def _become_65532(*, keep_capabilities: bool) -> None:
    """The calling thread alone becomes uid 65532 (the raw syscall: glibc's setresuid changes every
    thread), keeping its permitted capabilities, not effective, where asked (as the image's exporter
    holds them) or losing them all."""
    _libc.prctl(_PR_SET_KEEPCAPS, int(keep_capabilities), 0, 0, 0)
    assert _libc.syscall(_SYS_SETRESUID, 65532, 65532, 65532) == 0, os.strerror(ctypes.get_errno())


@pytest.fixture
def root_state() -> Iterator[Path]:
    """A state directory as the kubelet makes a hostPath (root, 0755), with a file an earlier
    exporter left there as root; in a folder uid 65532 can reach (pytest's own are root's alone)."""
    folder = Path(tempfile.mkdtemp(prefix="accel-health-privileges-"))
    folder.chmod(0o755)
    state = folder / "state"
    state.mkdir(mode=0o755)
    (state / "kmsg-state.json").write_text("{}")
    (state / "link").symlink_to("/etc/hostname")
    try:
        yield state
    finally:
        shutil.rmtree(folder)


def test_uid_65532_with_chown_permitted_takes_the_directory_and_its_files_and_nothing_beyond(
    root_state: Path,
) -> None:
    state = root_state

    def work() -> tuple[bool, int, int]:
        _become_65532(keep_capabilities=True)
        assert current().effective & CHOWN == 0
        taken = take_directory(state)
        return taken, current().effective & CHOWN, current().permitted & CHOWN

    assert on_a_thread(work) == (True, 0, CHOWN)
    assert state.stat().st_uid == 65532
    assert (state / "kmsg-state.json").stat().st_uid == 65532
    assert Path("/etc/hostname").stat().st_uid == 0  # a link is not followed
    assert os.lstat(state / "link").st_uid == 0


def test_without_chown_the_directory_is_left_as_it_was_and_nothing_fails(root_state: Path) -> None:
    state = root_state

    def work() -> bool:
        _become_65532(keep_capabilities=False)
        return take_directory(state)

    assert on_a_thread(work) is False
    assert state.stat().st_uid == 0
    assert (state / "kmsg-state.json").stat().st_uid == 0


def test_settle_changes_nothing_for_root(tmp_path: Path) -> None:
    before = current()
    assert on_a_thread(lambda: settle(tmp_path)) == before
    assert current() == before
