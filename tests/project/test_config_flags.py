"""EngineConfig fields become flags in one place (serve/config_flags.py): every entry point's engine flags parse
to the EngineConfig it builds, with the field's type, choices and the entry point's own defaults."""

from __future__ import annotations

import argparse

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
    from bench.replay import build_parser, engine_config

    args = build_parser().parse_args(["--threads", "1", "--slo-ttft", "3", "--max-num-seqs", "5"])
    cfg = engine_config(args, "off")
    assert (cfg.num_threads, cfg.slo_ttft_s, cfg.max_num_seqs, cfg.device, cfg.model) == (1, 3.0, 5, "cpu", "smollm2-135m")


def test_the_dynamo_worker_reaches_cuda_and_slai_through_its_flags() -> None:
    from serve.dynamo.cli import parse_worker_args

    opts = parse_worker_args(["--device", "cuda:1", "--dtype", "bfloat16", "--scheduler", "slai"])
    assert (opts.engine.device, opts.engine.dtype, opts.engine.scheduler) == ("cuda:1", "bfloat16", "slai")
