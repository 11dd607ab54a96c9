"""The grammar compile worker: ``python -m serve.guided.compile_worker``, one per engine, started and fed by
serve/guided/compile_pool.py. Every compile runs in a child forked from it, which can be stopped.

Why a process: neither xgrammar nor llguidance can stop a compile that has started (xgrammar has no cancellation;
llguidance bounds its own work with fuel limits, xgrammar does not), and a 391-byte regex kept a core busy for 48 s
here, long after its request was refused. This worker imports the grammar engine once; each job is compiled in a
child forked from it (the worker is single-threaded, so forking it is safe) and a child past its ``timeout_s``, or
whose request went away (``cancel``), is ended with SIGKILL, which frees its CPU and memory at once.

- ``timeout_s`` is CPU time: what a compile may cost, the same on a quiet and on a busy host (read from
  /proc/PID/stat ten times a second); a child also ends after ``WALL_FACTOR`` times that in wall time, so a starved
  one does not hold its slot for ever.
- The worker and its children run at a low CPU priority (nice 10: about a tenth of a core's share against the
  serving engine's threads), so compiles take mostly what the engine leaves.
- It dies with the engine's process: end of file on stdin (the engine's process exited, however it died) kills every
  child and exits; a child is sent SIGKILL if the worker dies (PR_SET_PDEATHSIG).
- Before it is returned, a grammar is checked to accept some text: one that allows no first token (``{"$ref": "#"}``,
  ``root ::= root``: a rule that only refers to itself) is refused with that reason.

Protocol (serve/guided/frames.py): in, ``{"init": {"backend", "tokenizer_json", "vocab_size", "eos"}}`` once, then
``{"id", "kind", "source", "timeout_s"}`` (kind: json, json_schema, regex, ebnf_grammar, structural_tag) and
``{"cancel": id}``; out, ``{"ready": true, "tokenizer_info": ...}`` once (xgrammar's view of the tokenizer, so the
engine need not build it), then ``{"id", "ok": <compiled grammar, serialized>}`` or ``{"id", "error", "timeout"}``.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from serve.guided import frames

ANY_JSON_SCHEMA = '{"type": ["object", "array"]}'
# compact JSON, the same in both engines: a small model given free whitespace can emit it until max_tokens
LLG_JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
NO_TEXT = ("it accepts no text: no token can start it (a rule that only refers to itself, e.g. root ::= root or "
           "{\"$ref\": \"#\"}, or no way to end)")
Compile = Callable[[str, str], str]
NICE = 10
WALL_FACTOR = 4.0
POLL_S = 0.1
_TICKS = os.sysconf("SC_CLK_TCK")


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send ``sig`` to this process when its parent dies (Linux; no-op elsewhere)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(sig))  # PR_SET_PDEATHSIG


def first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return " ".join(text.splitlines()[0].split())[:300]


# ---- the grammar engines ----------------------------------------------------------------------------------------

def xgrammar_compiler(init: dict[str, Any]) -> tuple[Compile, dict[str, Any]]:
    import xgrammar as xgr
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(init["tokenizer_json"]))
    vocab = int(init["vocab_size"])
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=list(init["eos"]))
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True)
    compiler.compile_json_schema(ANY_JSON_SCHEMA, any_whitespace=False)  # "json": every child finds it cached

    def compile_one(kind: str, source: str) -> str:
        if kind in ("json", "json_schema"):
            compiled = compiler.compile_json_schema(ANY_JSON_SCHEMA if kind == "json" else source, any_whitespace=False)
        elif kind == "ebnf_grammar":
            compiled = compiler.compile_grammar(source)
        elif kind == "structural_tag":
            compiled = compiler.compile_structural_tag(source)
        else:
            compiled = compiler.compile_regex(source)
        matcher = xgr.GrammarMatcher(compiled)
        mask = xgr.allocate_token_bitmask(1, vocab)
        matcher.fill_next_token_bitmask(mask, 0)
        if not matcher.is_terminated() and not bool(mask.any()):
            raise ValueError(NO_TEXT)
        return compiled.serialize_json()

    return compile_one, {"tokenizer_info": info.serialize_json()}


def llguidance_compiler(init: dict[str, Any]) -> tuple[Compile, dict[str, Any]]:
    import llguidance
    import llguidance.hf
    import llguidance.torch
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(init["tokenizer_json"]))
    tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=int(init["vocab_size"]), eos_token=int(init["eos"][0]))

    def compile_one(kind: str, source: str) -> str:
        matcher_cls = llguidance.LLMatcher
        if kind in ("json", "json_schema"):
            grammar = matcher_cls.grammar_from_json_schema(ANY_JSON_SCHEMA if kind == "json" else source,
                                                           defaults=LLG_JSON_DEFAULTS)
        elif kind == "ebnf_grammar":
            grammar = matcher_cls.grammar_from_lark(llguidance.gbnf_to_lark(source))
        elif kind == "structural_tag":
            raise ValueError("structural_tag needs the xgrammar backend")
        else:
            grammar = matcher_cls.grammar_from_regex(source)
        problem = matcher_cls.validate_grammar(grammar, tokenizer)  # '' when the grammar is fine
        if problem:
            raise ValueError(" ".join(problem.split()))
        matcher = matcher_cls(tokenizer, grammar)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        mask = llguidance.torch.allocate_token_bitmask(1, tokenizer.vocab_size)
        llguidance.torch.fill_next_token_bitmask(matcher, mask, 0)
        if not matcher.is_stopped() and not bool(mask.any()):
            raise ValueError(NO_TEXT)
        return grammar

    return compile_one, {}


COMPILERS = {"xgrammar": xgrammar_compiler, "llguidance": llguidance_compiler}


# ---- the worker's loop ------------------------------------------------------------------------------------------

@dataclass(eq=False)
class _Child:
    job_id: int
    pid: int
    fd: int
    cpu_budget_s: float
    deadline: float           # wall clock (monotonic)
    data: bytearray = field(default_factory=bytearray)


class Worker:
    """Forks one child per job, relays its answer, kills it past its deadline or on cancel."""

    def __init__(self, compile_one: Compile, in_fd: int, out_fd: int) -> None:
        self.compile_one = compile_one
        self.in_fd, self.out_fd = in_fd, out_fd
        self.children: dict[int, _Child] = {}   # by the fd its answer comes on

    def run(self, reader: frames.Reader) -> None:
        while True:
            wait = POLL_S if self.children else None
            ready, _, _ = select.select([self.in_fd, *self.children], [], [], wait)
            if self.in_fd in ready:
                data = os.read(self.in_fd, 1 << 16)
                if not data:  # the engine's process is gone
                    self.kill_all()
                    return
                for message in reader.feed(data):
                    self.handle(message)
            for fd in [fd for fd in ready if fd in self.children]:
                self.read_child(self.children[fd])
            now = time.monotonic()
            for child in [c for c in self.children.values() if now > c.deadline or cpu_s(c.pid) > c.cpu_budget_s]:
                self.end(child, {"error": "timeout", "timeout": True})

    def handle(self, message: dict[str, Any]) -> None:
        if "cancel" in message:
            child = next((c for c in self.children.values() if c.job_id == message["cancel"]), None)
            if child is not None:
                self.end(child, {"error": "cancelled"})
            return
        self.fork(int(message["id"]), str(message["kind"]), str(message["source"]), float(message["timeout_s"]))

    def fork(self, job_id: int, kind: str, source: str, timeout_s: float) -> None:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: compile, answer on w, exit without running any of the worker's cleanup
            try:
                die_with_parent()
                for fd in (r, self.in_fd, self.out_fd, *self.children):
                    with contextlib.suppress(OSError):
                        os.close(fd)
                try:
                    answer = {"ok": self.compile_one(kind, source)}
                except Exception as exc:  # noqa: BLE001 - the guide's fault, said in its words
                    answer = {"error": first_line(exc)}
                frames.write(w, answer)
            finally:
                os._exit(0)
        os.close(w)
        self.children[r] = _Child(job_id, pid, r, timeout_s, time.monotonic() + WALL_FACTOR * timeout_s)

    def read_child(self, child: _Child) -> None:
        data = os.read(child.fd, 1 << 20)
        if data:
            child.data += data
            return
        messages = frames.Reader().feed(bytes(child.data))
        _, status = os.waitpid(child.pid, 0)
        answer = messages[0] if messages else {
            "error": f"the compiler stopped ({_exit_text(status)}) before answering"}
        self.finish(child, answer)

    def end(self, child: _Child, answer: dict[str, Any]) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.pid, signal.SIGKILL)
        os.waitpid(child.pid, 0)
        self.finish(child, answer)

    def finish(self, child: _Child, answer: dict[str, Any]) -> None:
        os.close(child.fd)
        del self.children[child.fd]
        frames.write(self.out_fd, {"id": child.job_id, **answer})

    def kill_all(self) -> None:
        for child in list(self.children.values()):
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(child.pid, 0)
        self.children.clear()


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) the process has used so far; 0 when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICKS  # utime, stime: fields 14 and 15 of stat(5)


def _exit_text(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"signal {os.WTERMSIG(status)}"
    return f"exit status {os.WEXITSTATUS(status)}"


def main() -> int:
    with contextlib.suppress(OSError):
        os.nice(NICE)
    in_fd, out_fd = sys.stdin.fileno(), os.dup(sys.stdout.fileno())
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # stray prints go to stderr; answers to out_fd only
    reader = frames.Reader()
    messages: list[dict[str, Any]] = []
    while not messages:
        data = os.read(in_fd, 1 << 20)
        if not data:
            return 0
        messages = reader.feed(data)
    init = messages[0]["init"]
    compile_one, extra = COMPILERS[init["backend"]](init)
    frames.write(out_fd, {"ready": True, **extra})
    worker = Worker(compile_one, in_fd, out_fd)
    for message in messages[1:]:
        worker.handle(message)
    worker.run(reader)
    return 0


if __name__ == "__main__":
    sys.exit(main())
