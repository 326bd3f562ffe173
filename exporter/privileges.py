"""The exporter's capabilities: which it may use, where, and for how long.

The image runs the exporter as uid 65532 through its own copy of the interpreter, which carries two
*permitted* file capabilities (scripts/image/capabilities.py): ``CAP_SYSLOG``, which opening
/dev/kmsg asks for where ``kernel.dmesg_restrict=1``, and ``CAP_CHOWN``, which taking over a state
directory the kubelet (or an earlier exporter running as root) created asks for. Permitted is not
effective: the exporter holds no capability at all except on the one thread, around the one call,
that needs it (:func:`raised`), and gives ``CAP_CHOWN`` up for good once the state directory is its
own (:func:`settle`). What the process may get at all is also bounded by the container's capability
set: the manifests add exactly these two (and a privileged container bounds nothing, which is why the
exporter runs as a user who holds nothing by itself).

Capabilities belong to a thread on Linux: a change here applies to the calling thread and to the
threads it starts afterwards. :func:`settle` therefore runs first, before any thread is started.

Run as root, or from an interpreter without file capabilities (the virtualenv, the tests), the
capability asked for is either already effective or not permitted, and everything here changes
nothing.
"""

from __future__ import annotations

import ctypes
import enum
import logging
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

_VERSION_3 = 0x20080522  # _LINUX_CAPABILITY_VERSION_3: two 32-bit words per set
_PR_GET_DUMPABLE, _PR_SET_DUMPABLE = 3, 4


class Capability(enum.IntEnum):
    """The capabilities the exporter knows by name (their numbers in linux/capability.h)."""

    CHOWN = 0
    SYSLOG = 34


class _Header(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _Data(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


@dataclass(frozen=True)
class CapabilitySets:
    """The calling thread's capability sets, as bit masks (bit n: capability n)."""

    effective: int
    permitted: int
    inheritable: int

    def names(self, mask: int) -> list[str]:
        """The capabilities of ``mask`` by name (``CAP_12`` for one not named here)."""
        known = {c.value: c.name for c in Capability}
        return [known.get(bit, f"CAP_{bit}") for bit in range(64) if mask >> bit & 1]


_libc = ctypes.CDLL(None, use_errno=True)


def current() -> CapabilitySets:
    """The calling thread's capability sets (capget(2))."""
    header, data = _Header(_VERSION_3, 0), (_Data * 2)()
    if _libc.capget(ctypes.byref(header), data) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"capget: {os.strerror(errno)}")
    return CapabilitySets(
        effective=data[0].effective | data[1].effective << 32,
        permitted=data[0].permitted | data[1].permitted << 32,
        inheritable=data[0].inheritable | data[1].inheritable << 32,
    )


def _set(sets: CapabilitySets) -> None:
    """Sets the calling thread's capability sets (capset(2)); OSError when the kernel refuses."""
    header, data = _Header(_VERSION_3, 0), (_Data * 2)()
    for word in (0, 1):
        shift = 32 * word
        data[word].effective = sets.effective >> shift & 0xFFFFFFFF
        data[word].permitted = sets.permitted >> shift & 0xFFFFFFFF
        data[word].inheritable = sets.inheritable >> shift & 0xFFFFFFFF
    if _libc.capset(ctypes.byref(header), data) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"capset: {os.strerror(errno)}")


@contextmanager
def raised(capability: Capability) -> Iterator[bool]:
    """``capability`` effective on the calling thread for the block, where it is permitted and not
    effective already, and lowered again afterwards. Yields whether it is effective in the block."""
    bit = 1 << capability
    sets = current()
    if sets.effective & bit or not sets.permitted & bit:
        yield bool(sets.effective & bit)
        return
    _set(CapabilitySets(sets.effective | bit, sets.permitted, sets.inheritable))
    try:
        yield True
    finally:
        _set(CapabilitySets(current().effective & ~bit, sets.permitted, sets.inheritable))


def give_up(*capabilities: Capability) -> None:
    """Drops ``capabilities`` from every set of the calling thread (and of the threads it starts from
    now on), for good: a thread can never take back a capability it no longer has permitted."""
    mask = sum(1 << c for c in capabilities)
    sets = current()
    if (sets.effective | sets.permitted | sets.inheritable) & mask:
        _set(CapabilitySets(sets.effective & ~mask, sets.permitted & ~mask, sets.inheritable & ~mask))


def take_directory(path: Path) -> bool:
    """Makes ``path`` and the regular files in it the process's own (uid and gid) where it cannot write
    there, with ``CAP_CHOWN`` raised for the purpose: the kubelet creates a hostPath directory as root,
    and an exporter of an earlier version ran as root. Returns whether anything was handed over; a
    directory that is absent, already writable or cannot be taken is left as it is (the state stores
    log their own failures to write)."""
    if not path.is_dir() or os.access(path, os.W_OK):
        return False
    uid, gid = os.geteuid(), os.getegid()
    with raised(Capability.CHOWN) as effective:
        if not effective:
            logger.warning(
                "state directory %s is not writable by uid %d, and CAP_CHOWN is not permitted to take "
                "it: the counts will not survive a restart",
                path,
                uid,
            )
            return False
        try:
            os.chown(path, uid, gid)
            for entry in path.iterdir():
                found = entry.lstat()
                if stat.S_ISREG(found.st_mode) and found.st_uid != uid:
                    os.chown(entry, uid, gid, follow_symlinks=False)
        except OSError as exc:
            logger.warning("cannot take state directory %s for uid %d: %s", path, uid, exc.strerror or exc)
            return False
    logger.info("state directory %s handed over to uid %d", path, uid)
    return True


def settle(state_dir: Path | None) -> CapabilitySets:
    """The exporter's first step, before it starts any thread: takes ``state_dir`` where needed, gives
    ``CAP_CHOWN`` up and keeps only ``CAP_SYSLOG`` permitted (for each open of /dev/kmsg). A process
    that gained file capabilities at exec is made dumpable again, so it can read its own /proc/self/fd
    (the process metrics) as any other process; no process without those capabilities can trace it.
    As root it changes nothing: root needs no file capability, and a development run or a test in
    the same process keeps what it has. Returns the sets it ends with."""
    if os.geteuid() == 0:
        return current()
    if state_dir is not None:
        take_directory(state_dir)
    give_up(Capability.CHOWN)
    if _libc.prctl(_PR_GET_DUMPABLE, 0, 0, 0, 0) == 0:
        _libc.prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0)
    sets = current()
    logger.info(
        "running as uid %d; capabilities permitted: %s; effective: %s",
        os.geteuid(),
        ", ".join(sets.names(sets.permitted)) or "none",
        ", ".join(sets.names(sets.effective)) or "none",
    )
    return sets


__all__ = ["Capability", "CapabilitySets", "current", "give_up", "raised", "settle", "take_directory"]
