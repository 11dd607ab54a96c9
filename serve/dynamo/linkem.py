"""A userspace link with delay and loss, for kernels built without ``sch_netem`` (this machine's: ``tc qdisc
add ... netem`` answers "Specified qdisc kind is unknown").

One process (``python -m serve.dynamo.linkem``, run by :class:`LinkEmulator`) owns pairs of TAP devices:
the outer one joins the bridge, the inner one is moved into a host's namespace as its ``eth0``. Every
Ethernet frame read from one device is written to the other after ``delay_ms`` (the same in both
directions, so a round trip gains ``2 * delay_ms``), or dropped with probability ``loss`` (each direction),
as ``netem delay D loss L`` on both ends of a cable would. Order is kept (constant delay, FIFO). A frame
that cannot be written (the outer device is down: a cut cable) is dropped.

Control is line-based on the process's stdin (``add OUTER INNER``, ``set OUTER DELAY_MS LOSS``), one
``ok`` or ``error ...`` line back on stdout; the process exits when stdin closes (its owner went away),
and its TAP devices vanish with it.
"""

from __future__ import annotations

import fcntl
import heapq
import itertools
import os
import random
import select
import struct
import subprocess
import sys
import time
from dataclasses import dataclass

TUNSETIFF = 0x400454CA
IFF_TAP = 0x0002
IFF_NO_PI = 0x1000
MAX_FRAME = 65536


def open_tap(name: str) -> int:
    """Create (and attach to) TAP device ``name``; it lives as long as the returned descriptor."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd


@dataclass
class Pair:
    outer: str
    fds: tuple[int, int]      # (outer, inner)
    delay_s: float = 0.0
    loss: float = 0.0
    forwarded: int = 0
    dropped: int = 0


class Forwarder:
    """The emulator's loop (runs in the child process)."""

    def __init__(self, seed: int | None = None) -> None:
        self.pairs: dict[str, Pair] = {}
        self.peer: dict[int, tuple[Pair, int]] = {}   # fd -> (its pair, the fd frames go to)
        self.queue: list[tuple[float, int, int, bytes]] = []  # (due, seq, destination fd, frame)
        self.seq = itertools.count()
        self.rng = random.Random(seed)

    def command(self, line: str) -> str:
        words = line.split()
        try:
            if words[:1] == ["add"] and len(words) == 3:
                outer, inner = words[1], words[2]
                fo = open_tap(outer)
                fi = open_tap(inner)
                pair = Pair(outer, (fo, fi))
                self.pairs[outer] = pair
                self.peer[fo], self.peer[fi] = (pair, fi), (pair, fo)
                return "ok"
            if words[:1] == ["set"] and len(words) == 4:
                pair = self.pairs[words[1]]
                delay_ms, loss = float(words[2]), float(words[3])
                if delay_ms < 0 or not 0.0 <= loss <= 1.0:
                    return f"error delay must be >= 0 and loss in [0, 1], got {delay_ms} {loss}"
                pair.delay_s, pair.loss = delay_ms / 1000.0, loss
                return "ok"
            if words[:1] == ["stats"]:
                return "ok " + " ".join(f"{p.outer}:{p.forwarded}:{p.dropped}" for p in self.pairs.values())
        except (OSError, KeyError, ValueError) as exc:
            return f"error {type(exc).__name__}: {exc}"
        return f"error unknown command {line.strip()!r} (add OUTER INNER | set OUTER DELAY_MS LOSS | stats)"

    def on_frame(self, src: int, frame: bytes, now: float) -> None:
        pair, dst = self.peer[src]
        if pair.loss and self.rng.random() < pair.loss:
            pair.dropped += 1
            return
        if pair.delay_s:
            heapq.heappush(self.queue, (now + pair.delay_s, next(self.seq), dst, frame))
        else:
            self.write(pair, dst, frame)

    def write(self, pair: Pair, dst: int, frame: bytes) -> None:
        try:
            os.write(dst, frame)
            pair.forwarded += 1
        except OSError:  # EIO: that device is down (a cut cable); EAGAIN: its queue is full
            pair.dropped += 1

    def deliver_due(self, now: float) -> None:
        while self.queue and self.queue[0][0] <= now:
            _, _, dst, frame = heapq.heappop(self.queue)
            if dst in self.peer:
                self.write(self.peer[dst][0], dst, frame)

    def drop_fd(self, fd: int) -> None:
        """A device that went away (its namespace was deleted): forget its pair."""
        pair, other = self.peer.pop(fd, (None, None))
        if pair is not None:
            self.peer.pop(other, None)
            self.pairs.pop(pair.outer, None)
            for f in pair.fds:
                try:
                    os.close(f)
                except OSError:
                    pass

    def run(self, control: int, reply) -> None:
        buf = b""
        while True:
            now = time.monotonic()
            self.deliver_due(now)
            timeout = max(0.0, self.queue[0][0] - now) if self.queue else 1.0
            readable, _, _ = select.select([control, *self.peer], [], [], timeout)
            now = time.monotonic()
            for fd in readable:
                if fd == control:
                    data = os.read(control, 4096)
                    if not data:
                        return  # the owner closed our stdin: exit, and the TAP devices go with us
                    buf += data
                    while b"\n" in buf:
                        line, buf = buf.split(b"\n", 1)
                        reply(self.command(line.decode()))
                    continue
                for _ in range(64):  # drain a burst, then look at the others
                    try:
                        frame = os.read(fd, MAX_FRAME)
                    except BlockingIOError:
                        break
                    except OSError:
                        self.drop_fd(fd)
                        break
                    if fd not in self.peer:
                        break
                    self.on_frame(fd, frame, now)


class LinkEmulator:
    """The owner's handle on the emulator process (root namespace)."""

    def __init__(self, python: str = sys.executable) -> None:
        self.proc = subprocess.Popen([python, "-m", "serve.dynamo.linkem"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1,
                                     cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

    def _ask(self, line: str) -> str:
        if self.proc.poll() is not None:
            raise RuntimeError(f"the link emulator exited with {self.proc.returncode}: "
                               f"{self.proc.stderr.read()[-2000:]}")
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline().strip()
        if not answer.startswith("ok"):
            raise RuntimeError(f"link emulator: {line!r} -> {answer or 'no answer'}")
        return answer

    def add_pair(self, outer: str, inner: str) -> None:
        self._ask(f"add {outer} {inner}")

    def impair(self, outer: str, delay_ms: float, loss: float) -> None:
        """Delay (each direction) and loss (each direction) on the pair whose outer device is ``outer``."""
        self._ask(f"set {outer} {delay_ms:g} {loss:g}")

    def stats(self) -> dict[str, tuple[int, int]]:
        """outer device -> (frames forwarded, frames dropped)."""
        out = {}
        for item in self._ask("stats").split()[1:]:
            name, fwd, drop = item.rsplit(":", 2)
            out[name] = (int(fwd), int(drop))
        return out

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()  # type: ignore[union-attr]
                self.proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(timeout=5)
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()


def main() -> None:
    def reply(text: str) -> None:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
    Forwarder().run(sys.stdin.fileno(), reply)


if __name__ == "__main__":
    main()
