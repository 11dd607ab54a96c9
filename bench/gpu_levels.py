"""``make gpu-check``'s morph-level section: today's engines load the unified checkpoints ``make build-engines`` writes
(hf/full, hf/levels/<level>) and give our greedy tokens, or say why not.

Per checkpoint directory, the same prompts (as token ids, so every engine sees the same input) and greedy decoding:

- ours: this engine on the directory (morph mode off), on the GPU when there is one;
- TensorRT-LLM's PyTorch backend: ``tensorrt_llm.LLM(model=<dir>)`` (the LLM API ``trtllm-serve <dir>`` serves);
- vLLM: ``vllm.LLM(model=<dir>)``;

each peer in a subprocess of its own (a failure or a held GPU does not leak into the next), "not installed" where it
does not import. The report gives per engine and directory: loaded or the error, and for how many prompts its tokens
equal ours, with the first position they part at. Ours computes in float32 on CPU and bfloat16 on CUDA, the peers in
the checkpoint's float16, so a parting deep into a prompt is rounding, not a misread checkpoint.

The checkpoints: ``--levels-engine-dir`` (an engine directory with levels, e.g. engines/smollm2-135m), else a small
random model built here (modelopt calibration on CPU, levels int4@25, int8@25, int4@25+int8@50; random weights, so
only the machinery is checked, and tokens part early).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

PROMPTS = ("The capital of France is", "Water boils at", "def fibonacci(n):", "Once upon a time,")
MAX_TOKENS = 12
PEER_TIMEOUT_S = 480.0
RANDOM_LEVELS = ("int4@25", "int8@25", "int4@25+int8@50")

_TRTLLM = """
import json, sys
from tensorrt_llm import LLM, SamplingParams
ids, n = json.loads(sys.argv[2]), int(sys.argv[3])
llm = LLM(model=sys.argv[1])
outs = llm.generate(ids, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
print("TOKENS " + json.dumps([list(o.outputs[0].token_ids) for o in outs]))
"""
_VLLM = """
import json, sys
from vllm import LLM, SamplingParams
ids, n = json.loads(sys.argv[2]), int(sys.argv[3])
llm = LLM(model=sys.argv[1], gpu_memory_utilization=0.4, enforce_eager=True)
outs = llm.generate([{"prompt_token_ids": p} for p in ids], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
print("TOKENS " + json.dumps([list(o.outputs[0].token_ids) for o in outs]))
"""  # noqa: E501 - a script, not prose
PEERS = {"tensorrt_llm": _TRTLLM, "vllm": _VLLM}


def checkpoint_dirs(engine_dir: Path) -> dict[str, Path]:
    """``{"full": hf/full, level name: its directory}`` of an engine directory's unified checkpoints."""
    from serve.model import engine_dir as ed  # noqa: PLC0415

    engine = ed.load_engine_dir(engine_dir)
    full = (engine.manifest.get("hf") or {}).get("full") or {}
    out = {"full": engine_dir / full["dir"]} if full.get("status") == "exported" else {}
    return {**out, **{name: engine_dir / rec["dir"] for name, rec in engine.levels.items()}}


def random_engine_dir(work: Path) -> Path:
    """A small random Llama (byte-level tokenizer) built into an engine directory with three levels."""
    from builder.build import BuildOptions, build_engine  # noqa: PLC0415
    from serve.model.loader import save_hf_directory  # noqa: PLC0415
    from serve.model.random_model import make_tiny_model  # noqa: PLC0415

    model = make_tiny_model(seed=5, hidden_size=256, intermediate_size=512, num_layers=8, num_heads=4, num_kv_heads=2,
                            head_dim=64, max_position_embeddings=1024)
    source = save_hf_directory(model, work / "random-llama")
    return build_engine(BuildOptions(model=str(source), output=str(work / "engine"), levels=RANDOM_LEVELS,
                                     calib_tokens=512, profile_tokens=64, progress=False)).path


def ours(directory: Path, ids: list[list[int]], max_tokens: int, device: str) -> list[list[int]]:
    from serve.config import EngineConfig  # noqa: PLC0415
    from serve.engine.engine import LLMEngine  # noqa: PLC0415
    from serve.engine.sampling_params import SamplingParams  # noqa: PLC0415

    engine = LLMEngine(EngineConfig(model=str(directory), device=device, morph_mode="off", speculation="off",
                                    num_kv_blocks=128, enable_prefix_caching=False))
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        return [r["token_ids"] for r in engine.generate(ids, params)]
    finally:
        engine.shutdown()


def peer(name: str, directory: Path, ids: list[list[int]], max_tokens: int) -> dict[str, Any]:
    """``{"status": "not installed" | "loaded" | "failed", "tokens" | "error"}`` of one peer engine on ``directory``."""
    if importlib.util.find_spec(name) is None:
        return {"status": "not installed"}
    cmd = [sys.executable, "-c", PEERS[name], str(directory), json.dumps(ids), str(max_tokens)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PEER_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"status": "failed", "error": f"no answer in {PEER_TIMEOUT_S:.0f} s"}
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("TOKENS ")), None)
    if proc.returncode != 0 or line is None:
        return {"status": "failed", "error": (proc.stderr or proc.stdout)[-3000:]}
    return {"status": "loaded", "tokens": json.loads(line[len("TOKENS "):])}


def agreement(theirs: list[list[int]], mine: list[list[int]]) -> dict[str, Any]:
    parts = [next((i for i, (a, b) in enumerate(zip(t, m)) if a != b), None) for t, m in zip(theirs, mine)]
    return {"same_prompts": sum(p is None and len(t) == len(m) for p, t, m in zip(parts, theirs, mine)),
            "prompts": len(mine), "first_parting": parts}


def level_section(engine_dir: Path | None, device: str, max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="gpu-levels-") as work:
        root = engine_dir if engine_dir is not None else random_engine_dir(Path(work))
        from serve.model.loader import load_model  # noqa: PLC0415

        dirs = checkpoint_dirs(root)
        if not dirs:
            raise ValueError(f"{root} holds no unified checkpoint (built with --no-hf-export?)")
        tokenizer = load_model(str(next(iter(dirs.values())))).tokenizer
        ids = [tokenizer.encode(p) for p in PROMPTS]
        rows = []
        for name, directory in dirs.items():
            mine = ours(directory, ids, max_tokens, device)
            row: dict[str, Any] = {"checkpoint": name, "dir": str(directory.relative_to(root))}
            for peer_name in PEERS:
                got = peer(peer_name, directory, ids, max_tokens)
                if got["status"] == "loaded":
                    got.update(agreement(got.pop("tokens"), mine))
                row[peer_name] = got
            rows.append(row)
    return {"engine_dir": str(engine_dir) if engine_dir is not None else "random model built here",
            "prompts": len(PROMPTS), "max_tokens": max_tokens, "rows": rows}


def to_markdown(section: dict[str, Any]) -> list[str]:
    lines = [f"## Unified checkpoints in today's engines ({section['engine_dir']}; {section['prompts']} prompts x "
             f"{section['max_tokens']} greedy tokens vs ours)", "", "| checkpoint | " + " | ".join(PEERS) + " |",
             "|---|" + "---|" * len(PEERS)]
    for row in section["rows"]:
        cells = []
        for name in PEERS:
            got = row[name]
            if got["status"] == "loaded":
                cells.append(f"loaded; same tokens on {got['same_prompts']}/{got['prompts']} "
                             f"(first parting {got['first_parting']})")
            else:
                cells.append(got["status"]
                             + (f": {got['error'].strip().splitlines()[-1][:160]}" if "error" in got else ""))
        lines.append(f"| {row['checkpoint']} | " + " | ".join(cells) + " |")
    return lines + [""]
