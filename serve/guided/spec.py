"""What a client asks the output to follow: a guide's kind and text, checked before the request is admitted.

Kinds are TensorRT-LLM's ``guided_decoding_guide_type`` values (``json``: any JSON value the grammar engine's
built-in JSON grammar accepts; ``json_schema``; ``regex``; ``ebnf_grammar``; ``structural_tag``), plus ``choice``
(one of a list of strings, as vLLM's and Dynamo's ``guided_choice``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping

GUIDE_KINDS = ("json", "json_schema", "regex", "ebnf_grammar", "structural_tag", "choice")
MAX_GUIDE_BYTES = 64 * 1024
"""A guide's size limit (UTF-8 bytes of its text). A 64 KiB JSON schema is already far beyond tool schemas
seen in practice; larger ones cost compile time and memory for every replica they are sent to."""
MAX_CHOICES = 256


@dataclass(frozen=True)
class GuidedDecoding:
    """``kind`` and ``guide``: a JSON schema's text, a regex, an EBNF (GBNF-style) grammar, a structural tag's
    JSON; for ``json`` the guide is empty; for ``choice`` it is a JSON list of strings. Equal specs compile to
    the same grammar (the compile cache is keyed by ``(kind, guide)``)."""

    kind: str
    guide: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.kind, str) or self.kind not in GUIDE_KINDS:
            raise ValueError(f"guided decoding type must be one of {', '.join(GUIDE_KINDS)}, got {self.kind!r}")
        if not isinstance(self.guide, str):
            raise TypeError(f"the guide must be a string, got {type(self.guide).__name__}")
        size = len(self.guide.encode("utf-8"))
        if size > MAX_GUIDE_BYTES:
            raise ValueError(f"the {self.kind} guide has {size} bytes; at most {MAX_GUIDE_BYTES} are allowed")
        if self.kind != "json" and not self.guide.strip():
            raise ValueError(f"guided decoding type {self.kind!r} needs a guide (guided_decoding_guide)")
        if self.kind in ("json_schema", "structural_tag"):
            _json_value(self.guide, self.kind, dict)
        if self.kind == "choice":
            choices = _json_value(self.guide, "choice", list)
            if not choices or len(choices) > MAX_CHOICES or not all(isinstance(c, str) and c for c in choices):
                raise ValueError(f"a choice guide is a JSON list of 1 to {MAX_CHOICES} non-empty strings")

    @property
    def choices(self) -> list[str]:
        return json.loads(self.guide) if self.kind == "choice" else []

    @classmethod
    def from_value(cls, value: "GuidedDecoding | Mapping[str, Any] | None") -> "GuidedDecoding | None":
        """A spec from the forms clients send: this class, None, or ``{"type": ..., "guide": ...}`` (the
        guide of ``json_schema`` / ``structural_tag`` may be an object, of ``choice`` a list)."""
        if value is None or isinstance(value, GuidedDecoding):
            return value
        if not isinstance(value, Mapping):
            raise TypeError(f"guided decoding must be an object with 'type' and 'guide', got {type(value).__name__}")
        unknown = set(value) - {"type", "guide"}
        if unknown:
            raise ValueError(f"unknown guided decoding field(s) {sorted(unknown)}; known: type, guide")
        guide = value.get("guide", "")
        if guide is None:
            guide = ""
        if not isinstance(guide, str):
            guide = json.dumps(guide, ensure_ascii=False)
        return cls(str(value.get("type", "")), guide)


def _json_value(text: str, kind: str, expected: type) -> Any:
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise ValueError(f"the {kind} guide is not valid JSON: {exc}") from None
    if not isinstance(value, expected):
        raise ValueError(f"the {kind} guide must be a JSON {'object' if expected is dict else 'list'}")
    return value
