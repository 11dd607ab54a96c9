"""EngineConfig fields become flags in one place (serve/config_flags.py): every entry point's engine flags parse
to the EngineConfig it builds, with the field's type, choices and the entry point's own defaults."""

from __future__ import annotations

import argparse
import ast
import dataclasses
from pathlib import Path

import pytest

from serve.config import EngineConfig
from serve.config_flags import add_engine_flags, engine_kwargs, flag_name


def test_types_choices_and_booleans_come_from_the_field() -> None:
    p = argparse.ArgumentParser()
    fields = ("max_num_seqs", "slo_ttft_s", "enable_prefix_caching", "scheduler", "memory_floor")
    add_engine_flags(p, fields)
    args = p.parse_args(["--max-num-seqs", "4", "--slo-ttft-s", "0.5", "--no-enable-prefix-caching",
                         "--scheduler", "slai", "--memory-floor", "1GiB"])
    kwargs = engine_kwargs(args, fields)
    assert kwargs == {"max_num_seqs": 4, "slo_ttft_s": 0.5, "enable_prefix_caching": False, "scheduler": "slai",
                      "memory_floor": "1GiB"}
    cfg = EngineConfig(**kwargs, morph_mode="default")
    assert (cfg.max_num_seqs, cfg.slo_ttft_s, cfg.enable_prefix_caching, cfg.scheduler) == (4, 0.5, False, "slai")
    assert engine_kwargs(p.parse_args([]), fields) == {}  # unset flags leave EngineConfig's defaults
    with pytest.raises(SystemExit):
        p.parse_args(["--scheduler", "lifo"])
    with pytest.raises(SystemExit):
        p.parse_args(["--max-num-seqs", "four"])


def test_unknown_field_is_refused() -> None:
    with pytest.raises(ValueError, match="not an EngineConfig field"):
        add_engine_flags(argparse.ArgumentParser(), ["max_num_seq"])


@pytest.mark.parametrize("module", ["serve.dynamo.cli", "bench.replay", "serve.generate", "serve.triton.__main__"])
def test_every_entry_point_names_its_engine_flags_after_the_fields(module: str) -> None:
    import importlib

    mod = importlib.import_module(module)
    parser = mod.build_parser()
    by_dest = {a.dest: a.option_strings for a in parser._actions}
    for field in mod.ENGINE_FIELDS:
        assert flag_name(field) in by_dest[field], (module, field, by_dest.get(field))


def test_older_spellings_still_work_for_the_replay() -> None:
    from workload.replay import build_parser, engine_config

    args = build_parser().parse_args(["--threads", "1", "--slo-ttft", "3", "--max-num-seqs", "5"])
    cfg = engine_config(args, "off")
    assert (cfg.num_threads, cfg.slo_ttft_s, cfg.max_num_seqs, cfg.device, cfg.model) == (
        1, 3.0, 5, "cpu", "smollm2-135m")
    own = engine_config(args, "default+speculation=off+kv_cache_dtype=int8+kv_high=0.8")  # a mode's own settings
    assert (own.speculation, own.kv_cache_dtype, own.policy_overrides, cfg.speculation) == (
        "off", "int8", {"kv_high": 0.8}, "auto")
    slai = engine_config(args, "off+scheduler=slai+quality_meter=0")  # compared with fcfs / the meter in one command
    assert (slai.scheduler, slai.quality_meter, slai.policy_overrides, cfg.scheduler) == ("slai", 0.0, {}, "fcfs")


def test_the_dynamo_worker_reaches_cuda_and_slai_through_its_flags() -> None:
    from serve.dynamo.cli import parse_worker_args

    opts = parse_worker_args(["--device", "cuda:1", "--dtype", "bfloat16", "--scheduler", "slai"])
    assert (opts.engine.device, opts.engine.dtype, opts.engine.scheduler) == ("cuda:1", "bfloat16", "slai")


def test_the_quality_meters_fraction_reaches_every_engine_a_command_builds() -> None:
    """--quality-meter on each command line lands in its EngineConfig (serve.triton: in config.pbtxt's parameter, which
    the shipped model declares and the model's load checks); a replay mode's own setting still wins over it."""
    from serve.dynamo.cli import parse_worker_args
    from serve.generate import ENGINE_FIELDS as GENERATE_FIELDS
    from serve.generate import build_parser as generate_parser
    from serve.triton.__main__ import build_parser as triton_parser
    from serve.triton.__main__ import check_params, params_from_args
    from serve.triton.repository import DEFAULT_MODEL_REPOSITORY
    from workload.replay import build_parser as replay_parser
    from workload.replay import engine_config

    assert parse_worker_args(["--quality-meter", "0"]).engine.quality_meter == 0.0
    replay = replay_parser().parse_args(["--quality-meter", "0.05"])
    assert engine_config(replay, "default").quality_meter == 0.05
    assert engine_config(replay, "default+quality_meter=0").quality_meter == 0.0
    generate = generate_parser().parse_args(["--prompt", "x", "--quality-meter", "0.1"])
    assert EngineConfig(**engine_kwargs(generate, GENERATE_FIELDS)).quality_meter == 0.1
    params = params_from_args(triton_parser().parse_args(["--quality-meter", "0.25"]))
    assert params["quality_meter"] == 0.25
    check_params(params, DEFAULT_MODEL_REPOSITORY, "morphserve")  # a declared parameter, a valid value
    with pytest.raises(ValueError, match="quality_meter"):
        check_params({"quality_meter": -1}, DEFAULT_MODEL_REPOSITORY, "morphserve")


# ------------------------------------------------------------------------- no engine flag written by hand

REPO_ROOT = Path(__file__).resolve().parents[2]
FLAG_EXEMPT = {("serve/triton/client.py", "--model"): "deprecated alias of --model-name (the served model's name)"}
"""(file, flag) pairs that spell an EngineConfig field's flag without meaning the field, each with its reason."""


def hand_written_engine_flags(paths: list[Path]) -> list[str]:
    """``add_argument("--max-num-seqs", ...)``-style calls spelling an EngineConfig field's flag (``--model`` included:
    an engine source everywhere) outside serve/config_flags.py; bench/peers/ runs in the peers' venvs, without ours.
    ``--seed`` is left out: every command's seeds what it draws (a request's sampling, a workload, a calibration);
    EngineConfig.seed is no command's flag."""
    flags = {flag_name(f.name) for f in dataclasses.fields(EngineConfig) if f.name != "seed"}
    found = []
    for path in paths:
        rel = path.relative_to(REPO_ROOT).as_posix() if path.is_relative_to(REPO_ROOT) else path.name
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
                for arg in node.args:
                    if isinstance(arg, ast.Constant) and arg.value in flags and (rel, arg.value) not in FLAG_EXEMPT:
                        found.append(f"{rel}:{node.lineno}: {arg.value}")
    return found


def test_every_cli_takes_its_engine_flags_from_config_flags() -> None:
    """One meaning, name, type and help per engine flag: every command line adds them with add_engine_flags."""
    paths = [p for top in ("serve", "bench", "builder", "sim", "policy") for p in (REPO_ROOT / top).rglob("*.py")
             if "__pycache__" not in p.parts and "peers" not in p.parts and p.name != "config_flags.py"]
    assert hand_written_engine_flags(paths) == []


def test_the_flag_check_finds_a_hand_written_engine_flag(tmp_path: Path) -> None:
    f = tmp_path / "cli.py"
    f.write_text('import argparse\np = argparse.ArgumentParser()\np.add_argument("--threads")\n'
                 'p.add_argument("--max-num-seqs", type=int)\ng = '
                 'p.add_argument_group("x")\ng.add_argument("--model")\n')
    assert hand_written_engine_flags([f]) == ["cli.py:4: --max-num-seqs", "cli.py:6: --model"]


def test_the_clients_served_model_name_is_model_name_and_model_an_alias() -> None:
    from serve.triton.client import build_parser

    assert build_parser().parse_args(["--prompt", "x", "--model-name", "ensemble"]).model_name == "ensemble"
    assert build_parser().parse_args(["--prompt", "x", "--model", "ensemble"]).model_name == "ensemble"
    assert "deprecated alias" in build_parser().format_help()
