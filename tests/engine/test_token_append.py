"""serve/engine/token_append.py: the appender takes each sampled token into its sequence (its tokens, stop rules,
detokenizer) and returns what happened (the token, the text it releases, why it ended the request); the counts,
token times, outputs and finishing stay the engine's."""

from __future__ import annotations

import torch

from serve.engine.outputs import FinishReason
from serve.engine.sampling_params import SamplingParams
from serve.engine.scheduler import ScheduledChunk
from serve.engine.sequence import Sequence
from serve.engine.token_append import TokenAppender
from serve.model.tokenizer import IncrementalDetokenizer


def test_the_appender_returns_what_each_token_did_and_leaves_counting_to_the_engine(tiny):
    tok = tiny.tokenizer
    words = [tok.encode(" nice")[-1], tok.encode(" place")[-1]]
    params = SamplingParams(max_tokens=2)
    seq = Sequence("r", tok.encode("Paris is a"), params, 0.0,
                   IncrementalDetokenizer(tok, params.stop, params.include_stop_str_in_output))
    appender = TokenAppender(tiny.config.eos_token_ids, torch.Generator().manual_seed(0), max_model_len=64,
                             clock=lambda: 7.0)

    def sample(token: int):
        logits = torch.full((1, tiny.config.vocab_size), -1e9)
        logits[0, token] = 0.0  # greedy: this token
        [out] = appender.append([ScheduledChunk(seq, seq.num_tokens - 1, 1)], logits)
        return out

    first = sample(words[0])
    assert first.seq is seq and first.now == 7.0 and first.failed is None and first.settle is None
    assert [(t.token, t.finish) for t in first.tokens] == [(words[0], None)] and seq.token_ids[-1] == words[0]
    assert seq.first_token_time is None and seq.finish_reason is None  # token times and finishing: the engine's
    second = sample(words[1])  # max_tokens: the request ends, and its text is all released
    assert [(t.token, t.finish) for t in second.tokens] == [(words[1], FinishReason.LENGTH)]
    assert first.tokens[0].text + second.tokens[0].text == " nice place"
