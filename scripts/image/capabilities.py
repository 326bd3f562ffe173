"""Grants the image's only file capability (the Containerfile runs it as root, last); runs on the
image's own python3, standard library only.

/opt/accel-health/bin/exporter-python is a copy of the interpreter with CAP_SYSLOG and CAP_CHOWN
*permitted* (not effective), and the `accel-health-exporter` console script is started by it. The
exporter runs as uid 65532 and raises CAP_SYSLOG only around opening /dev/kmsg (the kernel asks for it
where kernel.dmesg_restrict=1) and CAP_CHOWN only to take over its state hostPath, which it then gives
up (exporter/privileges.py). Kubernetes hands a non-root container no capability of its own (no ambient
set), so a file capability is the one way for uid 65532 to hold these two. A copy, not the interpreter
itself: the remediator and everything else in the image run /usr/bin/python3.11 and get nothing.

What the process gets is also bounded by its container: a capability the securityContext does not add,
or `allowPrivilegeEscalation: false` (no_new_privs), leaves the file capability unused, and with the
effective bit unset the interpreter still starts. ping needs none: the active-checks component lets the
pod's user open ICMP datagram sockets (the namespaced sysctl net.ipv4.ping_group_range). tests/image
checks that this is the image's only file capability and that nothing in it is setuid or setgid.
"""

from __future__ import annotations

import os
import shutil
import struct
from pathlib import Path

CAP_CHOWN, CAP_SYSLOG = 0, 34
_REVISION_2 = 0x02000000  # VFS_CAP_REVISION_2: 64-bit sets; the effective flag (bit 0) left unset
VENV = Path("/opt/accel-health")
EXPORTER_PYTHON = VENV / "bin" / "exporter-python"


def permitted_only(*capabilities: int) -> bytes:
    """security.capability's value (struct vfs_cap_data, revision 2) granting ``capabilities`` as
    permitted, none inheritable, effective bit unset."""
    mask = sum(1 << c for c in capabilities)
    return struct.pack("<5I", _REVISION_2, mask & 0xFFFFFFFF, 0, mask >> 32, 0)


def main() -> None:
    shutil.copy2(os.path.realpath("/usr/bin/python3"), EXPORTER_PYTHON)  # the file, not its link
    script = VENV / "bin" / "accel-health-exporter"
    first, _, rest = script.read_text().partition("\n")
    if first != f"#!{VENV}/bin/python":
        raise SystemExit(f"capabilities: unexpected first line of {script}: {first!r}")
    script.write_text(f"#!{EXPORTER_PYTHON}\n{rest}")
    os.setxattr(EXPORTER_PYTHON, "security.capability", permitted_only(CAP_SYSLOG, CAP_CHOWN))


if __name__ == "__main__":
    main()
