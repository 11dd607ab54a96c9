"""Structured output: guides (JSON schema, regex, EBNF grammar, choice) compiled to grammars whose masks the
engine applies to the logits before sampling (serve/engine/engine.py, ``_sample_isolated``)."""

from serve.guided.spec import GUIDE_KINDS, MAX_GUIDE_BYTES, GuidedDecoding

__all__ = ["GUIDE_KINDS", "MAX_GUIDE_BYTES", "GuidedDecoding"]
