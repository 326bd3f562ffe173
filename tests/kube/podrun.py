"""Runs one container's process as the kubelet would: inside the pod's network namespace (the caller
runs this under `ip netns exec`) and private mount and UTS namespaces (`unshare -m -u`), with the
pod's volumes bind-mounted at their mountPaths and the pod's name as hostname, then execs the
container's command.

    ip netns exec NS unshare -m -u --propagation private python -m tests.kube.podrun SPEC.json

SPEC: {"argv": [...], "env": {...}, "hostname": NAME, "mounts": [[source, target, read_only], ...]}.
The targets must exist (the kubelet stand-in creates missing mount points before and removes them after).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys


def main() -> None:
    with open(sys.argv[1], encoding="utf-8") as f:
        spec = json.load(f)
    for source, target, read_only in spec["mounts"]:
        subprocess.run(["mount", "--bind", source, target], check=True)
        if read_only:
            subprocess.run(["mount", "-o", "remount,bind,ro", target], check=True)
    socket.sethostname(spec["hostname"])  # a pod's hostname is its name (own UTS namespace)
    os.chdir("/")
    argv = spec["argv"]
    os.execvpe(argv[0], argv, spec["env"])  # noqa: S606 -- the container's own command, by design


if __name__ == "__main__":
    main()
