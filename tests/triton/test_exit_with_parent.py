"""A Triton model's stub ends when tritonserver is gone (serve/triton/stale.py ``exit_with_parent``), even when its
last words cannot be written (the exit is not hostage to ``on_exit``) and even when none of its threads can run (a
stub deadlocked with the GIL held: the shell backstop ``kill_when_reparented`` ends it)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent("""
    import sys, threading, time
    sys.path.insert(0, {root!r})
    from serve.triton.stale import exit_with_parent
    on_exit = {on_exit}
    exit_with_parent(on_exit, interval_s=0.05, on_exit_timeout_s=0.5)
    print("watching", flush=True)
    if {stop}:  # no thread of ours runs again (as a stub deadlocked with the GIL held): only the shell can end us
        import os, signal
        os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(60)
""")

PARENT = textwrap.dedent("""
    import subprocess, sys
    child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "watching"
    print(child.pid, flush=True)
""")  # then the parent exits: the child is reparented, as a stub is when tritonserver is killed


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.parametrize(("on_exit", "stop"), [("None", False), ("lambda parent: None", False),
                                               ("lambda parent: threading.Event().wait()", False), ("None", True)],
                         ids=["no-callback", "quick-callback", "callback-that-never-returns", "no-thread-can-run"])
def test_a_reparented_process_ends_within_the_timeout_whatever_on_exit_does(on_exit: str, stop: bool) -> None:
    child = CHILD.format(root=str(ROOT), on_exit=on_exit, stop=stop)
    out = subprocess.run([sys.executable, "-c", PARENT, child], capture_output=True, text=True, timeout=60, check=True)
    pid = int(out.stdout.strip())
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid), f"pid {pid} still alive 10 s after its parent ended"

