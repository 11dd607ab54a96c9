"""Tokenizer with the model's chat template, built from a GGUF's vocabulary or an HF tokenizer.json."""

from __future__ import annotations

from typing import Any, Sequence

import jinja2.sandbox
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

# llama.cpp's pre-tokenizer names whose HF counterpart splits digits one by one before byte-level BPE.
_DIGIT_SPLITTING_PRE = {"smollm", "starcoder", "refact", "command-r", "codeshell"}
_GGUF_TOKEN_TYPE_CONTROL = 3


class Tokenizer:
    def __init__(self, backend: HFTokenizer, chat_template: str | None, bos_token_id: int | None,
                 eos_token_ids: Sequence[int], add_bos: bool = False) -> None:
        self.backend = backend
        self.chat_template = chat_template
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self.add_bos = add_bos
        self._template = None
        if chat_template:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_template_error
            self._template = env.from_string(chat_template)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_str(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def encode(self, text: str) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if self._template is None:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        bos = self.token_to_str(self.bos_token_id) if self.bos_token_id is not None else ""
        eos = self.token_to_str(self.eos_token_ids[0]) if self.eos_token_ids else ""
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=bos, eos_token=eos)

    @classmethod
    def from_gguf_fields(cls, fields: dict[str, Any]) -> "Tokenizer":
        """fields: GGUF metadata keys -> python values (tokens, merges, token_type, ids, chat template)."""
        model_kind = fields.get("tokenizer.ggml.model")
        if model_kind != "gpt2":
            raise ValueError(f"GGUF tokenizer model {model_kind!r} is not supported (only byte-level BPE 'gpt2'); "
                             "load the model from a Hugging Face directory with tokenizer.json instead")
        tokens: list[str] = fields["tokenizer.ggml.tokens"]
        merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"]]
        vocab = {tok: i for i, tok in enumerate(tokens)}
        backend = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if fields.get("tokenizer.ggml.pre") in _DIGIT_SPLITTING_PRE:
            backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        else:
            backend.pre_tokenizer = byte_level
        backend.decoder = decoders.ByteLevel()
        types = fields.get("tokenizer.ggml.token_type") or []
        specials = [AddedToken(tokens[i], special=True, normalized=False)
                    for i, t in enumerate(types) if t == _GGUF_TOKEN_TYPE_CONTROL]
        backend.add_special_tokens(specials)
        eos = fields.get("tokenizer.ggml.eos_token_id")
        return cls(backend, fields.get("tokenizer.chat_template"), fields.get("tokenizer.ggml.bos_token_id"),
                   [eos] if eos is not None else [], add_bos=bool(fields.get("tokenizer.ggml.add_bos_token", False)))

    @classmethod
    def from_hf_files(cls, tokenizer_json: str, tokenizer_config: dict[str, Any],
                      eos_token_ids: Sequence[int], bos_token_id: int | None) -> "Tokenizer":
        backend = HFTokenizer.from_file(tokenizer_json)
        template = tokenizer_config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])
        eos_ids = list(eos_token_ids)
        eos_tok = tokenizer_config.get("eos_token")
        if isinstance(eos_tok, dict):
            eos_tok = eos_tok.get("content")
        if eos_tok and backend.token_to_id(eos_tok) is not None and backend.token_to_id(eos_tok) not in eos_ids:
            eos_ids.append(backend.token_to_id(eos_tok))
        return cls(backend, template, bos_token_id, eos_ids,
                   add_bos=bool(tokenizer_config.get("add_bos_token", False)))


def _raise_template_error(message: str) -> None:
    raise ValueError(f"chat template error: {message}")


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas that never split a UTF-8 character.

    Text that could still be the start of a stop string is held back until it is known not to be one,
    so a client never sees part of a stop string. Each token is decoded once (``tokenizers.DecodeStream``
    keeps the few tokens of context a byte-level decoder needs), so a request's detokenization is linear in
    its length, not quadratic; the final delta re-decodes the whole output once, as before.
    """

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = (), include_stop: bool = False) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.include_stop = include_stop  # keep the stop string at the end of the text (TensorRT-LLM's way)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""          # full decoded text so far (stable part)
        self.emitted = 0        # characters already handed out
        self.stopped_by: str | None = None
        self._stream = DecodeStream(skip_special_tokens=True)

    def add(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        if self.stopped_by is not None:
            return
        chunk = self._stream.step(self.tokenizer.backend, token_id)
        if not chunk:
            return  # an incomplete multi-byte character (or a skipped special token): wait for the next token
        self.text += chunk
        if self.stop and self.stopped_by is None:
            search_from = max(0, self.emitted - self.hold)
            hits = [(i, s) for s in self.stop if (i := self.text.find(s, search_from)) >= 0]
            if hits:
                cut, self.stopped_by = min(hits)
                self.text = self.text[:cut + (len(self.stopped_by) if self.include_stop else 0)]

    def delta(self, final: bool) -> str:
        if final and self.stopped_by is None:
            self.text = self.tokenizer.decode(self.token_ids)
        end = len(self.text) if (final or self.stopped_by is not None) else max(self.emitted, len(self.text)
                                                                                - self.hold)
        out = self.text[self.emitted:end]
        self.emitted = end
        return out
