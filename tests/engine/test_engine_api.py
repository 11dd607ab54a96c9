"""Bad input, sampling options, stop conditions, streaming callbacks and the background loop."""

from __future__ import annotations

import threading

import pytest

from serve.config import EngineConfig, parse_size
from serve.engine.engine import LLMEngine
from serve.engine.outputs import FinishReason
from serve.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engine(smollm):
    return LLMEngine(EngineConfig(num_kv_blocks=64, max_model_len=1024), loaded=smollm)


@pytest.fixture(scope="module")
def tiny_engine(tiny):
    return LLMEngine(EngineConfig(num_kv_blocks=8, block_size=4, max_model_len=256), loaded=tiny)


@pytest.mark.parametrize("kwargs, match", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"temperature": -0.1}, "temperature"),
    ({"top_k": -1}, "top_k"),
    ({"stop": [""]}, "non-empty"),
])
def test_invalid_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_unknown_stop_type():
    with pytest.raises(TypeError, match="stop"):
        SamplingParams(stop=[3])


def test_bad_requests_raise_and_engine_keeps_serving(tiny_engine):
    e = tiny_engine
    with pytest.raises(ValueError, match="empty"):
        e.add_request("", SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        e.add_request([], SamplingParams())
    with pytest.raises(ValueError, match="context"):
        e.add_request(list(range(10, 300)), SamplingParams())          # longer than max_model_len 256
    with pytest.raises(ValueError, match="KV pool can never hold"):
        e.add_request(list(range(10, 40)), SamplingParams(max_tokens=8))  # 38 tokens > 8 blocks * 4
    with pytest.raises(ValueError, match="token ids"):
        e.add_request([10, 10**9], SamplingParams())
    with pytest.raises(TypeError):
        e.add_request("hi", {"max_tokens": 3})
    assert not e.has_unfinished_requests() and e.pool.num_used == 0
    out = e.generate([[11, 12, 13]], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert len(out["token_ids"]) == 4 and out["finish_reason"] == "length"


def test_duplicate_request_id_rejected(tiny_engine):
    rid = tiny_engine.add_request([5, 6], SamplingParams(max_tokens=2), request_id="dup")
    with pytest.raises(ValueError, match="already in use"):
        tiny_engine.add_request([5, 6], SamplingParams(max_tokens=2), request_id="dup")
    assert tiny_engine.abort_request(rid)
    assert tiny_engine.pool.num_used == 0


def test_abort_frees_blocks_at_once(tiny_engine):
    e = tiny_engine
    finals = []
    rid = e.add_request(list(range(100, 120)), SamplingParams(max_tokens=8, ignore_eos=True),
                        callback=lambda o: o.finished and finals.append(o))
    e.step()
    assert e.pool.num_used > 0
    assert e.abort_request(rid)
    assert e.pool.num_used == 0 and not e.has_unfinished_requests()
    assert finals[-1].finish_reason is FinishReason.ABORT
    assert not e.abort_request(rid)


def test_seed_is_reproducible_regardless_of_batch(engine):
    p = "Write a short poem about the sea."
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = engine.generate([p], params)[0]["token_ids"]
    other = SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    batched = engine.generate(["Tell me a joke.", p, "Count to five."], [other, params, other])[1]["token_ids"]
    assert alone == batched
    different = engine.generate([p], SamplingParams(max_tokens=12, temperature=1.0, seed=99, ignore_eos=True))[0]
    assert different["token_ids"] != alone


def test_top_k_one_and_tiny_top_p_equal_greedy(engine):
    p = "The weather today is"
    greedy = engine.generate([p], SamplingParams(max_tokens=10, ignore_eos=True))[0]["token_ids"]
    k1 = engine.generate([p], SamplingParams(max_tokens=10, temperature=1.5, top_k=1, seed=3, ignore_eos=True))[0]
    p0 = engine.generate([p], SamplingParams(max_tokens=10, temperature=1.5, top_p=1e-6, seed=3, ignore_eos=True))[0]
    assert k1["token_ids"] == greedy and p0["token_ids"] == greedy


def test_eos_stops_and_stop_strings_truncate(engine):
    chat = engine.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    full = engine.generate([chat], SamplingParams(max_tokens=40))[0]
    assert full["finish_reason"] == "stop" and full["token_ids"][-1] in engine.model_config.eos_token_ids
    assert "Paris" in full["text"]
    cut = engine.generate([chat], SamplingParams(max_tokens=40, stop=["Paris"]))[0]
    assert cut["finish_reason"] == "stop"
    assert cut["text"] == full["text"][: full["text"].index("Paris")]
    n = engine.generate([chat], SamplingParams(max_tokens=3))[0]
    assert n["finish_reason"] == "length" and len(n["token_ids"]) == 3


def test_streamed_deltas_concatenate_to_the_full_text(engine):
    deltas, finals = [], []
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    engine.add_request("Here is a list of fruits:", params,
                       callback=lambda o: (deltas.append(o.new_text), o.finished and finals.append(o)))
    while engine.has_unfinished_requests():
        engine.step()
    whole = engine.generate(["Here is a list of fruits:"], params)[0]
    assert "".join(deltas) == whole["text"] and len(deltas) == 24
    assert finals[0].num_output_tokens == 24 and finals[0].first_token_time >= finals[0].arrival_time


def test_background_loop_serves_concurrent_callers(engine):
    done = threading.Event()
    results: dict[str, list[int]] = {}
    finished: list[str] = []
    lock = threading.Lock()

    def cb(o):
        with lock:
            results.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                finished.append(o.request_id)
                if len(finished) == 4:
                    done.set()
    engine.start_background()
    try:
        params = SamplingParams(max_tokens=6, ignore_eos=True)
        rids = [engine.add_request(f"Item number {i} is", params, callback=cb) for i in range(4)]
        assert done.wait(60)
    finally:
        engine.stop()
    expected = engine.generate([f"Item number {i} is" for i in range(4)], params)
    assert [results[r] for r in rids] == [x["token_ids"] for x in expected]
    assert engine.pool.num_used == 0


def test_engine_config_validation():
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig(block_size=0)
    with pytest.raises(ValueError, match="device"):
        EngineConfig(device="tpu")
    with pytest.raises(ValueError, match="size"):
        EngineConfig(kv_cache_memory="lots")
    assert parse_size("600MiB") == 600 * 2**20 and parse_size("1.5GB") == 1_500_000_000
