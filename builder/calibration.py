"""Calibration tokens: the built-in offline corpus (builder/calibration_corpus.py) or ``--calib-text``."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch

from builder import defaults
from builder.calibration_corpus import DEFAULT_CALIBRATION_NAME, DEFAULT_CALIBRATION_TEXT
from builder.errors import BuildError
from serve.model.tokenizer import Tokenizer

DEFAULT_SEQ_LEN = defaults.SEQ_LEN


@dataclass(frozen=True)
class CalibrationData:
    source: str          # DEFAULT_CALIBRATION_NAME or the file path given
    sha256: str          # of the UTF-8 text
    token_ids: tuple[int, ...]
    seq_len: int

    def batches(self) -> list[torch.Tensor]:
        """The tokens as ``[1, <= seq_len]`` sequences, for modelopt's forward loop."""
        ids = list(self.token_ids)
        return [torch.tensor([ids[i : i + self.seq_len]]) for i in range(0, len(ids), self.seq_len)]

    def profile_ids(self, num_tokens: int) -> torch.Tensor:
        """The first ``num_tokens`` tokens as one ``[1, num_tokens]`` sequence (layer-importance profile)."""
        if not 0 < num_tokens <= len(self.token_ids):
            raise BuildError(f"profile tokens ({num_tokens}) must be between 1 and the calibration tokens "
                             f"({len(self.token_ids)})")
        return torch.tensor([list(self.token_ids[:num_tokens])])

    def describe(self) -> dict[str, object]:
        return {"source": self.source, "sha256": self.sha256, "tokens": len(self.token_ids), "seq_len": self.seq_len}


def calibration_text(path: str | None) -> tuple[str, str]:
    """(source name, text): the built-in corpus when ``path`` is None."""
    if path is None:
        return DEFAULT_CALIBRATION_NAME, DEFAULT_CALIBRATION_TEXT
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise BuildError(f"calibration text {path!r} is unreadable: {exc}") from exc
    if not text.strip():
        raise BuildError(f"calibration text {path!r} is empty")
    return str(path), text


def text_sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def load_calibration(tokenizer: Tokenizer, path: str | None, num_tokens: int,
                     seq_len: int = DEFAULT_SEQ_LEN) -> CalibrationData:
    if num_tokens < 1 or seq_len < 1:
        raise BuildError(f"calibration tokens ({num_tokens}) and sequence length ({seq_len}) must be positive")
    source, text = calibration_text(path)
    ids = tokenizer.encode(text)
    if len(ids) < num_tokens:
        raise BuildError(f"calibration text {source} has {len(ids)} tokens, fewer than the {num_tokens} requested "
                         "(give a longer --calib-text or a smaller --calib-tokens)")
    return CalibrationData(source, text_sha256(text), tuple(ids[:num_tokens]), seq_len)
