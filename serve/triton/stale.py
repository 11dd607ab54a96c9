"""A killed launcher leaves no model process behind (docs/hardening.md, Reliability III, finding 10).

SIGKILL of ``python -m serve.triton`` with streams in flight: tritonserver got SIGTERM through its parent-death
signal and exited, but the morphserve model's Python-backend stub was reparented to init and kept running (2.4 GB
resident, two threads at ~100 % CPU, SIGTERM ignored, 8 minutes later still there). On a GPU it would hold device
memory the restarted server needs. Three guards, each enough on its own for its case:

- the model watches its parent (:func:`exit_with_parent`, started by each model's ``initialize``): when tritonserver
  is gone, the stub exits at once (``os._exit``: stuck threads cannot hold it; the device frees its memory) and its
  grammar compile worker follows (end of file on its socket);
- every process of a server carries its launcher's mark in its environment (:func:`mark`, the model repository and
  the launcher's pid); before a launcher starts tritonserver it ends, with SIGKILL, every marked process of the
  same repository whose launcher is gone (:func:`end_stale`), which covers a stub too stuck to watch;
- the supervisor's restart path waits until the dead server's process group is empty (:func:`wait_group_gone`)
  before it starts the next one, so exactly one model process serves.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

REPOSITORY_MARK = "MORPHSERVE_REPOSITORY"
LAUNCHER_MARK = "MORPHSERVE_LAUNCHER_PID"
EXIT_PARENT_GONE = 75


def mark(env: dict[str, str], repository: Path) -> dict[str, str]:
    """``env`` with this launcher's mark, inherited by tritonserver, its stubs and their workers."""
    return {**env, REPOSITORY_MARK: str(Path(repository).resolve()), LAUNCHER_MARK: str(os.getpid())}


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:  # gone, or another user's
        return {}
    out = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep and key in (REPOSITORY_MARK.encode(), LAUNCHER_MARK.encode()):
            out[key.decode()] = value.decode(errors="replace")
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    stat = _stat(pid)
    return stat is not None and stat[0] != "Z"


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, process group) of ``pid``; None when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()
    except OSError:
        return None
    return fields[0].decode(), int(fields[2])


def _pids() -> Iterator[int]:
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            yield int(entry.name)


def find_stale(repository: Path) -> list[int]:
    """Processes marked with ``repository`` whose launcher is no longer alive."""
    want = str(Path(repository).resolve())
    stale = []
    for pid in _pids():
        env = _environ(pid)
        if env.get(REPOSITORY_MARK) != want:
            continue
        launcher = env.get(LAUNCHER_MARK, "")
        if not launcher.isdigit() or not _alive(int(launcher)):
            stale.append(pid)
    return stale


def end_stale(repository: Path, timeout_s: float = 10.0) -> list[int]:
    """SIGKILL every stale process of ``repository`` (:func:`find_stale`) and wait until they are gone; their pids."""
    stale = find_stale(repository)
    for pid in stale:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    _wait(lambda: not any(_alive(pid) for pid in stale), timeout_s)
    return stale


def group_members(pgid: int) -> list[int]:
    """Live processes in process group ``pgid``."""
    return [pid for pid in _pids() if (stat := _stat(pid)) is not None and stat[1] == pgid and stat[0] != "Z"]


def wait_group_gone(pgid: int, timeout_s: float = 10.0) -> list[int]:
    """Wait until process group ``pgid`` is empty (SIGKILL again to what is left half-way); what is still there."""
    if not _wait(lambda: not group_members(pgid), timeout_s / 2):
        for pid in group_members(pgid):
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        _wait(lambda: not group_members(pgid), timeout_s / 2)
    return group_members(pgid)


def _wait(done: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


ON_EXIT_TIMEOUT_S = 2.0
"""How long :func:`exit_with_parent` gives its ``on_exit`` before ending the process regardless: a last log line
written into a pipe nobody reads any more would otherwise block the exit for good."""


def exit_with_parent(on_exit: Callable[[int], None] | None = None, interval_s: float = 0.5,
                     on_exit_timeout_s: float = ON_EXIT_TIMEOUT_S) -> threading.Thread:
    """Watch this process's parent; once it is gone (this process was reparented), call ``on_exit(old parent)`` (for
    at most ``on_exit_timeout_s``) and end the process with status EXIT_PARENT_GONE."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval_s)
        if on_exit is not None:
            last = threading.Thread(target=on_exit, args=(parent,), name="morphserve-watchdog-exit", daemon=True)
            last.start()
            last.join(on_exit_timeout_s)
        os._exit(EXIT_PARENT_GONE)

    thread = threading.Thread(target=watch, name="morphserve-watchdog", daemon=True)
    thread.start()
    kill_when_reparented(parent, grace_s=interval_s + on_exit_timeout_s + 1.0)
    return thread


def kill_when_reparented(parent: int, grace_s: float, interval_s: float = 0.5) -> None:
    """A backstop outside this interpreter: a detached shell loop that SIGKILLs this process ``grace_s`` after it
    stops being ``parent``'s child, and ends when this process does. The watchdog thread above needs the GIL, and a
    Python backend stub whose tritonserver died can deadlock with the GIL held (seen: every thread of the stub asleep
    on a futex 20 s after tritonserver's SIGKILL, reparented, the watchdog among them); the shell needs nothing from
    us. Started twice-forked, so it is never our zombie."""
    me = os.getpid()
    ticks = max(1, int(grace_s / 0.1))
    loop = (f"while [ -e /proc/{me} ]; do "
            f"p=$(sed -n 's/.*) [A-Za-z] \\([0-9]*\\) .*/\\1/p' /proc/{me}/stat 2>/dev/null); "
            f'if [ -n "$p" ] && [ "$p" != "{parent}" ]; then '
            f"i=0; while [ -e /proc/{me} ] && [ $i -lt {ticks} ]; do sleep 0.1; i=$((i+1)); done; "
            f"kill -9 {me} 2>/dev/null; exit 0; fi; "
            f"sleep {interval_s}; done")
    # the shell needs PATH only: none of the server's environment (it is no model process)
    subprocess.run(["sh", "-c", f"( {loop} ) </dev/null >/dev/null 2>&1 &"], check=False, timeout=10,
                   env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
