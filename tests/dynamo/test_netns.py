"""The hosts' plumbing, with real namespaces (root; under CI=true a non-root run fails instead of skipping):
a veth host and an emulated host reach each other over the bridge; the link emulator delays and drops
what it is told to; a cut link carries nothing and a restored one does; destroy() leaves nothing; a dead
owner's namespaces and links are removed by the next run, a live owner's are not."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from serve.dynamo.linkem import LinkEmulator
from serve.dynamo.netns import Network, leftovers, links, namespaces, owner_tag, remove_stale
from tests.dynamo_cluster_support import require_root

pytestmark = [pytest.mark.timeout(300)]

ECHO_SERVER = """
import socket
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(('0.0.0.0', 9999))
while True:
    data, addr = s.recvfrom(100); s.sendto(data, addr)
"""
ECHO_CLIENT = """
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(float(sys.argv[3]))
answered, rtts = 0, []
for i in range(int(sys.argv[2])):
    t = time.monotonic(); s.sendto(b"x", (sys.argv[1], 9999))
    try:
        s.recvfrom(100); answered += 1; rtts.append(time.monotonic() - t)
    except socket.timeout:
        pass
print(answered, min(rtts) if rtts else -1)
"""


@pytest.fixture
def pair():
    require_root()
    net, emulator = Network(), LinkEmulator()
    server = None
    try:
        net.create()
        a = net.add_host("a")
        b = net.add_host("b", emulator=emulator)
        server = subprocess.Popen(["ip", "netns", "exec", b.ns, sys.executable, "-c", ECHO_SERVER])
        yield net, emulator, a, b
    finally:
        if server is not None:
            server.kill()
            server.wait()
        net.destroy()
        emulator.close()
        assert leftovers(net.tag) == {"namespaces": [], "links": [], "processes": []}


def echo(host, target, n: int, timeout_s: float = 1.0) -> tuple[int, float]:
    out = subprocess.run(["ip", "netns", "exec", host.ns, sys.executable, "-c", ECHO_CLIENT, target.address, str(n),
                          str(timeout_s)], capture_output=True, text=True, timeout=120, check=True).stdout.split()
    return int(out[0]), float(out[1])


def test_hosts_reach_each_other_and_the_emulator_delays_drops_and_cuts(pair) -> None:
    net, emulator, a, b = pair
    time.sleep(0.3)  # the echo server binds
    answered, _ = echo(a, b, 5)
    assert answered == 5
    emulator.impair(b.outer, 100, 0.0)
    answered, fastest = echo(a, b, 3)
    assert answered == 3 and fastest >= 0.2  # 100 ms each way: no round trip can be shorter than 200 ms
    emulator.impair(b.outer, 0, 1.0)
    assert echo(a, b, 3, 0.3)[0] == 0        # every frame dropped
    emulator.impair(b.outer, 0, 0.0)
    net.cut("b")
    assert echo(a, b, 3, 0.3)[0] == 0        # no cable, no answer
    net.restore("b")
    time.sleep(0.3)
    assert echo(a, b, 5)[0] == 5
    forwarded, dropped = emulator.stats()[b.outer]
    assert forwarded > 0 and dropped >= 3


def test_bad_impairments_are_refused(pair) -> None:
    _, emulator, _, b = pair
    with pytest.raises(RuntimeError, match="loss in"):
        emulator.impair(b.outer, 10, 1.5)
    with pytest.raises(RuntimeError, match="KeyError"):
        emulator.impair("no-such-link", 10, 0.1)


def test_a_dead_owners_objects_are_removed_and_a_live_owners_kept() -> None:
    require_root()
    dead_pid = next(p for p in range(4_000_000, 4_100_000) if not os.path.exists(f"/proc/{p}"))
    dead, live = Network(tag=owner_tag(dead_pid)), Network()
    try:
        live.create()
        live.add_host("y")
        dead.create()
        dead.add_host("x")
        removed = remove_stale()
        assert f"{dead.tag}-x" in removed and f"{dead.tag}-br" in removed
        assert not [n for n in namespaces() + links() if n.startswith(dead.tag + "-")]
        assert f"{live.tag}-y" in namespaces() and f"{live.tag}-br" in links()
    finally:
        dead.destroy()
        live.destroy()
    assert leftovers(live.tag) == {"namespaces": [], "links": [], "processes": []}
