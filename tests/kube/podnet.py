"""Pod networking for process-backed pods: one Linux bridge on the host and a network namespace per
pod, each with its own address, so every pod listens on its manifest's own port (0.0.0.0:9836 twice
is two pods, not a conflict) and Prometheus scrapes pod IPs as it does in a cluster. A pod may also be
attached to secondary networks (`attach`: a bridge per network, an interface `net1`, ... in the pod,
as Multus attaches RDMA/RoCE networks), which the exporters' ping and iperf checks measure.

Addresses come from 10.213.N.0/24, N chosen per run; they exist only inside this machine's own
namespaces and the bridge this module creates and removes. Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN)
and iproute2; `available()` says whether this machine can.

Each pod's namespace also keeps a connection-tracking table of its own (for tests/kube/connections.py,
which reads what the pods connect to): where iptables is installed, two rules in that namespace (never
the host's) match on conntrack state, which switches the kernel's tracking on for it, and a holder
process (`sleep`, the pause container's part) keeps it open so that `conntrack_tables()` can name its
/proc/PID/net/nf_conntrack, also after the pod's own process is gone.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from examples.pipeline import die_with_parent


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=20)


def set_sysctl(ns: str, name: str, value: str) -> None:
    """Sets the sysctl ``name`` (a ``net.*`` one, per network namespace) in the namespace ``ns``."""
    subprocess.run(
        ["ip", "netns", "exec", ns, "sysctl", "-q", "-w", f"{name}={value}"], check=True, timeout=20
    )


def available() -> str | None:
    """None when pod networks can be made here, else the reason they cannot."""
    if os.geteuid() != 0:
        return "pod network namespaces need root"
    for tool in ("ip", "unshare", "mount"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    probe = f"ahprobe{os.getpid() % 100000}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


_INSTANCES = itertools.count()
_SUBNETS = itertools.count()


@dataclass
class PodNetwork:
    """A bridge `ahb<id>` with the host at 10.213.N.1 (and, for servers the harness runs on the host in
    a pod's stead, 10.213.N.2 to .9) and pods from 10.213.N.10 up."""

    ident: str = field(default_factory=lambda: f"{os.getpid() % 10000}{next(_INSTANCES) % 10}")
    """Names of its own per network: a namespace a lingering process keeps (and its veth pair) must
    not collide with the next network of the same test process."""
    subnet: int = field(default_factory=lambda: 1 + (os.getpid() + next(_SUBNETS)) % 250)
    _next: int = 10
    _next_host: int = 2
    track_problem: str | None = field(
        default_factory=lambda: None if shutil.which("iptables") else "iptables is not installed"
    )
    """Why pod namespaces get no connection-tracking table; None: they each get one."""
    _namespaces: list[str] = field(default_factory=list)
    _host_ends: list[str] = field(default_factory=list)
    _holders: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    _secondary: dict[str, int] = field(default_factory=dict)
    """Secondary network name -> its index k: bridge `ahs<id>k`, addresses 10.(214+k).N.0/24."""
    _attached: dict[str, int] = field(default_factory=dict)

    @property
    def bridge(self) -> str:
        return f"ahb{self.ident}"

    @property
    def host_ip(self) -> str:
        return f"10.213.{self.subnet}.1"

    def create(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.host_ip}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")

    def add_host_address(self) -> str:
        """One more address of the host on the bridge: a process of the harness bound to it is reached
        by pods at an address of its own (and so on a port of its own choosing, e.g. 9093 twice)."""
        n = self._next_host
        if n >= 10:
            raise RuntimeError("no host address left on the pod network (8)")
        self._next_host += 1
        ip = f"10.213.{self.subnet}.{n}"
        _ip("addr", "add", f"{ip}/24", "dev", self.bridge)
        return ip

    def add_pod(self) -> tuple[str, str]:
        """A new namespace wired to the bridge: (namespace name, pod IP)."""
        n = self._next
        self._next += 1
        if n > 250:
            raise RuntimeError("pod network exhausted (240 pods)")
        ns = f"ah{self.ident}p{n}"
        host_end, pod_end = f"ah{self.ident}h{n}", f"ah{self.ident}c{n}"
        ip = f"10.213.{self.subnet}.{n}"
        _ip("netns", "add", ns)
        self._namespaces.append(ns)
        _ip("-n", ns, "link", "set", "lo", "up")
        self._wire(ns, self.bridge, (host_end, pod_end), "eth0", ip)
        _ip("-n", ns, "route", "add", "default", "via", self.host_ip)
        if self.track_problem is None:
            self._track(ns)
        return ns, ip

    def attach(self, ns: str, network: str, interface: str) -> str:
        """Attaches the pod namespace ``ns`` to the secondary network ``network`` (a bridge of its own,
        as a Multus NetworkAttachmentDefinition of the bridge plugin makes one) as ``interface``;
        returns the pod's address there. Its routes stay on eth0: the network is reached only by its
        own subnet, as an RDMA/RoCE attachment is."""
        if network not in self._secondary:
            if len(self._secondary) >= 8:
                raise RuntimeError("no secondary network left (8)")
            k = self._secondary[network] = len(self._secondary)
            bridge = f"ahs{self.ident}{k}"
            _ip("link", "add", bridge, "type", "bridge")
            _ip("link", "set", bridge, "up")
        k = self._secondary[network]
        n = self._attached.get(network, 10)
        if n > 250:
            raise RuntimeError(f"secondary network {network} exhausted (240 pods)")
        self._attached[network] = n + 1
        ip = f"10.{214 + k}.{self.subnet}.{n}"
        ends = (f"as{self.ident}{k}h{n}", f"as{self.ident}{k}c{n}")
        self._wire(ns, f"ahs{self.ident}{k}", ends, interface, ip)
        return ip

    def _wire(self, ns: str, bridge: str, ends: tuple[str, str], interface: str, ip: str) -> None:
        """A veth pair (host end, pod end) from ``bridge`` into ``ns``, the pod end named ``interface``
        there with ``ip``/24, both up."""
        host_end, pod_end = ends
        _ip("link", "add", host_end, "type", "veth", "peer", "name", pod_end)
        self._host_ends.append(host_end)
        _ip("link", "set", pod_end, "netns", ns)
        _ip("link", "set", host_end, "master", bridge)
        _ip("link", "set", host_end, "up")
        _ip("-n", ns, "link", "set", pod_end, "name", interface)
        _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", interface)
        _ip("-n", ns, "link", "set", interface, "up")

    def _track(self, ns: str) -> None:
        """Switch connection tracking on inside `ns` (a rule that matches on conntrack state makes the
        kernel track that namespace's connections; it accepts what the policy ACCEPT would anyway) and
        start its holder."""
        for chain in ("OUTPUT", "INPUT"):
            rule = ["-A", chain, "-m", "conntrack", "--ctstate", "NEW", "-j", "ACCEPT"]
            done = subprocess.run(
                ["ip", "netns", "exec", ns, "iptables", "-w", *rule],
                capture_output=True,
                text=True,
                check=False,
                timeout=20,
            )
            if done.returncode != 0:
                # The pod runs all the same; the scenario's check of the connections says why it cannot.
                self.track_problem = f"iptables {' '.join(rule)} in {ns}: {done.stderr.strip()}"
                return
        self._holders[ns] = subprocess.Popen(
            ["ip", "netns", "exec", ns, "sleep", "infinity"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=die_with_parent,  # noqa: PLW1509 -- prctl only, no locks or threads touched
        )

    def conntrack_tables(self) -> dict[str, Path]:
        """Namespace -> its connection-tracking table, for every pod namespace tracked so far."""
        return {
            ns: Path(f"/proc/{holder.pid}/net/nf_conntrack")
            for ns, holder in list(self._holders.items())
            if holder.poll() is None
        }

    def destroy(self) -> None:
        for holder in self._holders.values():
            holder.kill()
            holder.wait(timeout=10)
        self._holders.clear()
        # Deleting the host end removes the pair even where a process still holds the pod's namespace
        # (which `ip netns del` only unmounts).
        for host_end in self._host_ends:
            _ip("link", "del", host_end, check=False)
        self._host_ends.clear()
        for ns in self._namespaces:
            _ip("netns", "del", ns, check=False)
        self._namespaces.clear()
        for k in self._secondary.values():
            _ip("link", "del", f"ahs{self.ident}{k}", check=False)
        self._secondary.clear()
        _ip("link", "del", self.bridge, check=False)
