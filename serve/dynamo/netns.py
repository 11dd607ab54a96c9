"""Hosts on one machine: Linux network namespaces joined by a bridge, each with its own private address.

The root namespace holds the bridge and its first address (``.1``): it plays the client machine, and nothing
else: the namespaces get no default route and the root namespace forwards nothing (``ip_forward`` is left
as it is; packets to the subnet never leave the bridge), so the only reachable addresses are the hosts' own
and loopback. Each host is a namespace with one link: a veth pair (kernel), or two TAP devices bridged by
the link emulator (``serve/dynamo/linkem.py``, for delay and loss where the kernel has no ``netem``).

Every object is named ``msh<owner pid in hex>-<suffix>`` (namespaces ``msh1f2a-etcd``, links
``msh1f2a-v2``, the bridge ``msh1f2a-br``), so a later run can remove what a crashed run left behind
(:func:`remove_stale`: owners that are no longer alive) without touching anyone else's. Needs root.
"""

from __future__ import annotations

import ipaddress
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass, field
from typing import Protocol

PREFIX = "msh"
_NAME = re.compile(rf"^{PREFIX}([0-9a-f]+)-")


class NetnsError(RuntimeError):
    """An ``ip`` command failed; the message names the command and what it printed."""


def ip(*args: str, check: bool = True) -> str:
    """Run ``ip ARGS``; its stdout, or NetnsError with its stderr."""
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout


def require_root() -> None:
    if os.geteuid() != 0:
        raise PermissionError("network namespaces need root (ip netns add); run as root")


def owner_tag(pid: int | None = None) -> str:
    return f"{PREFIX}{(pid or os.getpid()):x}"


def namespaces() -> list[str]:
    return [line.split()[0] for line in ip("netns", "list").splitlines() if line.strip()]


def links() -> list[str]:
    """Names of the root namespace's links (``veth@ifN`` suffixes cut)."""
    out = []
    for line in ip("-o", "link", "show").splitlines():
        parts = line.split(":", 2)
        if len(parts) >= 2:
            out.append(parts[1].strip().split("@")[0])
    return out


def pids_in(ns: str) -> list[int]:
    return [int(p) for p in ip("netns", "pids", ns, check=False).split() if p.isdigit()]


def kill_namespace_processes(ns: str, sig: int = signal.SIGKILL, wait_s: float = 10.0) -> list[int]:
    """Signal every process inside ``ns`` (a host losing power, with SIGKILL) and wait until they are gone."""
    killed = pids_in(ns)
    for pid in killed:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + wait_s
    while pids_in(ns) and time.monotonic() < deadline:
        time.sleep(0.05)
    return killed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def owned(names: list[str], tag: str) -> list[str]:
    return [n for n in names if n.startswith(tag + "-")]


def leftovers(tag: str) -> dict[str, list]:
    """What of ``tag``'s is still there: namespaces, root-namespace links and processes in those namespaces."""
    ns = owned(namespaces(), tag)
    return {"namespaces": ns, "links": owned(links(), tag), "processes": [p for n in ns for p in pids_in(n)]}


def remove_stale() -> list[str]:
    """Remove the namespaces and links of owners that are no longer running (a run that crashed before its
    teardown). Returns what was removed."""
    removed = []
    for name in namespaces():
        m = _NAME.match(name)
        if m and not _alive(int(m.group(1), 16)):
            kill_namespace_processes(name)
            ip("netns", "del", name, check=False)
            removed.append(name)
    for name in links():
        m = _NAME.match(name)
        if m and not _alive(int(m.group(1), 16)):
            ip("link", "del", name, check=False)
            removed.append(name)
    return removed


def free_subnet(seed: int) -> ipaddress.IPv4Network:
    """A /24 in 10.213.0.0/16 that no route of this machine overlaps (seeded by the owner pid)."""
    taken = []
    for line in ip("-4", "route", "show", "table", "all").splitlines():
        word = line.split()[0] if line.split() else ""
        if word in ("local", "broadcast"):
            word = line.split()[1]
        try:
            taken.append(ipaddress.ip_network(word, strict=False))
        except ValueError:
            continue
    for i in range(250):
        net = ipaddress.ip_network(f"10.213.{(seed + i) % 250 + 2}.0/24")
        if not any(net.overlaps(t) for t in taken):
            return net
    raise NetnsError("no free /24 in 10.213.0.0/16 for the hosts")


@dataclass
class HostLink:
    """One host: its namespace, its address, and the root-namespace end of its link (what a cut downs)."""
    name: str
    ns: str
    address: str
    outer: str
    emulated: bool = False


@dataclass
class Network:
    """The bridge and the hosts on it. ``create()`` first, ``destroy()`` always (idempotent)."""
    tag: str = field(default_factory=owner_tag)
    subnet: ipaddress.IPv4Network | None = None
    hosts: dict[str, HostLink] = field(default_factory=dict)

    @property
    def bridge(self) -> str:
        return f"{self.tag}-br"

    @property
    def client_address(self) -> str:
        """The root namespace's address on the bridge (where tests and benches connect from)."""
        assert self.subnet is not None
        return str(self.subnet.network_address + 1)

    def create(self) -> None:
        require_root()
        remove_stale()
        self.subnet = self.subnet or free_subnet(os.getpid())
        ip("link", "add", self.bridge, "type", "bridge")
        ip("addr", "add", f"{self.client_address}/{self.subnet.prefixlen}", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")

    def add_host(self, name: str, emulator: LinkEmulatorLike | None = None) -> HostLink:
        """A namespace with one link to the bridge: a veth pair, or (with ``emulator``) a pair of TAP
        devices that the emulator process forwards between, with the delay and loss it is told."""
        assert self.subnet is not None, "create() first"
        index = len(self.hosts) + 2
        ns, outer = f"{self.tag}-{name}", f"{self.tag}-v{index}"
        address = str(self.subnet.network_address + index)
        ip("netns", "add", ns)
        host = HostLink(name, ns, address, outer, emulated=emulator is not None)
        self.hosts[name] = host  # from here on destroy() removes it
        if emulator is None:
            inner = f"{self.tag}-i{index}"
            ip("link", "add", outer, "type", "veth", "peer", "name", inner)
        else:
            inner = f"{self.tag}-t{index}"
            emulator.add_pair(outer, inner)  # the emulator creates both TAP devices and forwards between them
        ip("link", "set", inner, "netns", ns)
        ip("-n", ns, "link", "set", inner, "name", "eth0")
        ip("-n", ns, "addr", "add", f"{address}/{self.subnet.prefixlen}", "dev", "eth0")
        ip("-n", ns, "link", "set", "eth0", "up")
        ip("-n", ns, "link", "set", "lo", "up")
        ip("link", "set", outer, "master", self.bridge)
        ip("link", "set", outer, "up")
        return host

    def cut(self, name: str) -> None:
        """Pull the host's cable: its bridge-side link goes down (the host sees no carrier)."""
        ip("link", "set", self.hosts[name].outer, "down")

    def restore(self, name: str) -> None:
        ip("link", "set", self.hosts[name].outer, "up")

    def destroy(self) -> None:
        """Kill every process in every host, delete links, namespaces and the bridge. Safe to call twice."""
        for host in self.hosts.values():
            kill_namespace_processes(host.ns)
        for host in self.hosts.values():
            ip("link", "del", host.outer, check=False)  # a veth's peer goes with it
            ip("netns", "del", host.ns, check=False)
        ip("link", "del", self.bridge, check=False)
        # anything of ours a half-finished add_host left (a link created before its namespace move)
        for name in owned(links(), self.tag):
            ip("link", "del", name, check=False)
        self.hosts.clear()


class LinkEmulatorLike(Protocol):
    """What Network needs from the link emulator (serve/dynamo/linkem.py): create a TAP pair and forward."""

    def add_pair(self, outer: str, inner: str) -> None: ...
