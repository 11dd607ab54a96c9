"""make gpu-check's morph-level section (bench/gpu_levels.py) on this CPU: our engine serves every unified checkpoint
of the tiny build, and a peer engine that does not import is reported "not installed" (TensorRT-LLM and vLLM cannot be
installed here, so what they do with the checkpoints is only known from a GPU host's report)."""

from __future__ import annotations

import importlib.util

from bench import gpu_levels


def test_level_section_on_cpu(built) -> None:
    section = gpu_levels.level_section(built.path, "cpu", max_tokens=4)
    assert [r["checkpoint"] for r in section["rows"]] == ["full", "int4@34", "int8@67", "int4@34+int8@67"]
    for row in section["rows"]:
        for name in gpu_levels.PEERS:
            if importlib.util.find_spec(name) is None:
                assert row[name] == {"status": "not installed"}, (row["checkpoint"], name)
            else:
                assert row[name]["status"] in ("loaded", "failed")
    table = "\n".join(gpu_levels.to_markdown(section))
    assert "| int4@34 |" in table and "| checkpoint | tensorrt_llm | vllm |" in table


def test_agreement_counts_equal_prompts_and_where_they_part() -> None:
    got = gpu_levels.agreement([[1, 2, 3], [1, 9, 3], [4, 5]], [[1, 2, 3], [1, 2, 3], [4, 5, 6]])
    assert got == {"same_prompts": 1, "prompts": 3, "first_parting": [None, 1, None]}
