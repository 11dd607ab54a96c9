"""serve/dynamo pieces that need no Dynamo process: request mapping, chunks, metrics text, the snapshot
publisher, the tokenizer card, the async bridge, the worker's command line, and the engine features the
worker relies on (min_tokens, step listeners)."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from types import SimpleNamespace

import pytest

from serve.dynamo.bridge import OutputStream
from serve.dynamo.cli import parse_worker_args
from serve.dynamo.http import metric_values
from serve.dynamo.metrics import CapacityPublisher, KvSnapshot, RequestMetrics, exposition
from serve.dynamo.requests import RequestError, chunk, finish_reason, to_engine_request
from serve.engine.outputs import RequestMetrics as EngineRequestMetrics
from serve.engine.stats import EngineStats
from serve.guided.spec import GuidedDecoding


def _request(**groups):
    req = {"token_ids": [1, 2, 3], "stop_conditions": {}, "sampling_options": {}, "output_options": {}}
    for key, value in groups.items():
        req[key].update(value)
    return req


# ---- request mapping -------------------------------------------------------------------------------
def test_request_maps_every_supported_option() -> None:
    r = to_engine_request(_request(
        stop_conditions={"max_tokens": 12, "min_tokens": 3, "ignore_eos": False, "stop_token_ids": [7],
                         "stop_token_ids_hidden": [2], "stop": None},
        sampling_options={"temperature": 0.7, "top_p": 0.9, "top_k": 40, "seed": 5}), eos_token_ids=[2])
    p = r.params
    assert r.prompt_token_ids == [1, 2, 3]
    assert (p.max_tokens, p.min_tokens, p.temperature, p.top_p, p.top_k, p.seed) == (12, 3, 0.7, 0.9, 40, 5)
    assert p.stop_token_ids == (2, 7) and not p.ignore_eos


def test_unset_fields_take_openai_defaults() -> None:
    p = to_engine_request(_request(), default_max_tokens=33).params
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed) == (33, 1.0, 1.0, 0, None)
    assert to_engine_request(_request(sampling_options={"top_k": -1})).params.top_k == 0


def test_ignore_eos_drops_eos_from_the_stop_ids() -> None:
    req = _request(stop_conditions={"ignore_eos": True, "stop_token_ids_hidden": [2], "stop_token_ids": [9]})
    p = to_engine_request(req, eos_token_ids=[2]).params
    assert p.ignore_eos and p.stop_token_ids == (9,)


def test_stop_strings_reach_the_engine_unless_min_tokens_is_set() -> None:
    assert to_engine_request(_request(stop_conditions={"stop": ["\n\n"]})).params.stop == ("\n\n",)
    p = to_engine_request(_request(stop_conditions={"stop": ["\n\n"], "min_tokens": 2, "max_tokens": 8})).params
    assert p.stop == () and p.min_tokens == 2


@pytest.mark.parametrize("group, key, value", [
    ("sampling_options", "n", 2), ("sampling_options", "best_of", 3), ("sampling_options", "presence_penalty", 0.5),
    ("sampling_options", "frequency_penalty", -0.1), ("sampling_options", "repetition_penalty", 1.2),
    ("sampling_options", "min_p", 0.05), ("sampling_options", "use_beam_search", True),
    ("output_options", "logprobs", 1),
    ("output_options", "prompt_logprobs", 2),
])
def test_unsupported_options_are_rejected_by_name(group: str, key: str, value: object) -> None:
    with pytest.raises(RequestError, match=f"{group}.{key}"):
        to_engine_request(_request(**{group: {key: value}}))


@pytest.mark.parametrize("options, expected", [
    # the shapes Dynamo 1.6.1's frontend sends (response_format json_object / json_schema, guided_* fields)
    ({"json": {"type": "object"}}, {"type": "json_schema", "guide": '{"type": "object"}'}),
    ({"json": {"type": "object", "properties": {"a": {"type": "integer"}}}},
     {"type": "json_schema", "guide": '{"type": "object", "properties": {"a": {"type": "integer"}}}'}),
    ({"json": '{"type": "array"}'}, {"type": "json_schema", "guide": '{"type": "array"}'}),
    ({"regex": "[a-z]+", "backend": "xgrammar"}, {"type": "regex", "guide": "[a-z]+"}),
    ({"choice": ["yes", "no"]}, {"type": "choice", "guide": '["yes", "no"]'}),
    ({"grammar": 'root ::= "a"'}, {"type": "ebnf_grammar", "guide": 'root ::= "a"'}),
    (None, None), ({"backend": "xgrammar"}, None),
])
def test_dynamo_guided_decoding_becomes_the_engines_guide(options, expected) -> None:
    params = to_engine_request(_request(sampling_options={"guided_decoding": options})).params
    assert params.guided_decoding == GuidedDecoding.from_value(expected)


@pytest.mark.parametrize("options, match", [
    ({"regex": "a", "backend": "outlines"}, "cannot be chosen per request"),
    ({"json": {"type": "object"}, "whitespace_pattern": " *"}, "whitespace_pattern"),
    ({"regex": "a", "choice": ["a"]}, "only one guided decoding constraint"),
    ({"json": "{not json"}, "not valid JSON"),
])
def test_bad_dynamo_guides_are_refused(options, match) -> None:
    with pytest.raises(ValueError, match=match):
        to_engine_request(_request(sampling_options={"guided_decoding": options}))


def test_neutral_values_of_unsupported_options_are_accepted() -> None:
    """The "off" value of every option the worker cannot honour (as clients send it: ints for floats too) is
    accepted and changes nothing: the request maps exactly as one without those fields."""
    neutral = _request(sampling_options={"n": 1, "best_of": 1, "presence_penalty": 0, "frequency_penalty": 0.0,
                                         "repetition_penalty": 1, "min_p": 0.0, "use_beam_search": False,
                                         "length_penalty": 1.0},
                       output_options={"logprobs": None, "prompt_logprobs": None})
    assert to_engine_request(neutral) == to_engine_request(_request())


@pytest.mark.parametrize("groups", [
    {"sampling_options": {"top_p": 0.0}}, {"sampling_options": {"temperature": -1.0}},
    {"stop_conditions": {"max_tokens": 0}}, {"stop_conditions": {"max_tokens": 4, "min_tokens": 5}},
    {"sampling_options": {"top_k": -5}},
])
def test_bad_values_are_value_errors(groups: dict) -> None:
    with pytest.raises(ValueError):
        to_engine_request(_request(**groups))


@pytest.mark.parametrize(("extra", "speculate"), [
    ({}, True),
    ({"annotations": ["formatted_prompt", "speculate:false"]}, False),  # what nvext.annotations arrives as (1.6.1)
    ({"annotations": ["speculate:true"]}, True),
    ({"extra_args": {"speculate": False, "nvext": {"extra_fields": ["worker_id"]}}}, False),
    ({"extra_args": {"nvext": {"extra_fields": ["worker_id"]}}}, True),   # the frontend's own extra_args
    ({"annotations": ["speculate:false"], "extra_args": {"speculate": False}}, False),
])
def test_per_request_speculation_opt_out(extra: dict, speculate: bool) -> None:
    assert to_engine_request({**_request(), **extra}).params.speculate is speculate


@pytest.mark.parametrize(("extra", "match"), [
    ({"annotations": ["speculate:no"]}, "speculate:false"),
    ({"extra_args": {"speculate": "false"}}, "extra_args.speculate must be true or false"),
    ({"annotations": ["speculate:true"], "extra_args": {"speculate": False}}, "both true and false"),
])
def test_bad_speculation_opt_outs_are_refused(extra: dict, match: str) -> None:
    with pytest.raises(RequestError, match=match):
        to_engine_request({**_request(), **extra})


def test_empty_prompt_is_rejected() -> None:
    with pytest.raises(RequestError, match="no prompt"):
        to_engine_request({"token_ids": []})


def test_chunks_and_finish_reasons() -> None:
    assert chunk([5]) == {"token_ids": [5], "index": 0}
    final = chunk([6], "length", prompt_tokens=3, completion_tokens=4)
    assert final["finish_reason"] == "length"
    assert final["completion_usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    assert [finish_reason(r) for r in ("stop", "length", "abort", "error")] == ["stop", "length", "cancelled", "error"]


def test_engine_data_carries_the_requests_quality() -> None:
    metrics = EngineRequestMetrics(1.0, quantized_layer_tokens=6, kv_8bit_tokens=2, quality_samples=4, quality_agreed=3)
    data = chunk([6], "length", 3, 8, out=SimpleNamespace(metrics=metrics, stop_reason=None),
                 block_size=16)["engine_data"]
    assert (data["quantized_layer_tokens"], data["kv_8bit_tokens"], data["quality_samples"]) == (6, 2, 4)
    assert data["quality_agreement"] == 0.75 and data["kv_cache_hit_rate"] == 0.0  # beside the perf metrics
    unsampled = chunk([6], "length", 3, 8, out=SimpleNamespace(metrics=EngineRequestMetrics(1.0), stop_reason=None))
    assert unsampled["engine_data"]["quality_agreement"] is None


# ---- metrics -----------------------------------------------------------------------------------------
def engine_stats(**given) -> EngineStats:
    """An EngineStats with ``given`` and zeros (empty dicts, healthy) elsewhere."""
    blank = {f.name: {} if "dict" in str(f.type) else 0 for f in dataclasses.fields(EngineStats)}
    return EngineStats(**{**blank, "scheduler": "fcfs", "healthy": True, "last_step_error": None,
                          "memory_outside_free_bytes": None, **given})


STATS = engine_stats(kv_blocks_total=160, kv_blocks_used=40, kv_blocks_base=96, kv_cache_usage_perc=0.25,
                     num_running=2, num_waiting=1, swaps_total=4, restores_total=0, num_preemptions=0,
                     num_generated_tokens=99, layers_quantized={"int4": 4})


def test_exposition_carries_the_morph_gauges_with_labels() -> None:
    text = exposition(STATS, {"worker_id": "ab", "model": 'a"b'})
    assert metric_values(text, "morphserve_kv_blocks_total") == [160.0]
    assert metric_values(text, "morphserve_kv_blocks_base") == [96.0]
    assert metric_values(text, "morphserve_swaps_total") == [4.0]
    assert 'morphserve_layers_quantized{worker_id="ab",model="a\\"b",precision="int4"} 4' in text
    assert 'precision="int8"} 0' in text
    assert "# TYPE morphserve_swaps_total counter" in text
    assert "morphserve_memory_outside_free_bytes" not in text  # None: not reported


def test_request_metrics_exposition_has_cumulative_buckets_and_finish_reasons() -> None:
    """The Dynamo worker's request histograms: the catalogue's names and buckets, fed by the request tracker."""
    from serve.engine.outputs import FinishReason, RequestOutput
    from serve.metrics_catalogue import INTER_TOKEN_LATENCY, TIME_TO_FIRST_TOKEN
    from serve.request_tracker import CANCELLED, RequestTracker

    metrics = RequestMetrics()
    tracker = RequestTracker(metrics)
    tracker.start("a", arrival=10.0)
    tracker.on_output(RequestOutput("a", [7], "x", num_prompt_tokens=5), t=10.00390625)  # TTFT 2**-8 s
    tracker.on_output(RequestOutput("a", [7, 8], "yz", True, FinishReason.LENGTH, num_prompt_tokens=5),
                      t=11.00390625)  # two tokens after 1 s: two gaps of 0.5 s
    tracker.start("b", arrival=11.0)
    tracker.finish("b", CANCELLED, t=11.5)
    text = metrics.exposition({"worker_id": "ab"})
    ttft, itl = TIME_TO_FIRST_TOKEN.name, INTER_TOKEN_LATENCY.name
    assert metric_values(text, f"{ttft}_count") == [1.0] and metric_values(text, f"{ttft}_sum") == [2**-8]
    assert f'{ttft}_bucket{{worker_id="ab",le="0.0025"}} 0' in text
    assert f'{ttft}_bucket{{worker_id="ab",le="0.005"}} 1' in text
    assert f'{ttft}_bucket{{worker_id="ab",le="+Inf"}} 1' in text
    assert f'{itl}_bucket{{worker_id="ab",le="0.4"}} 0' in text
    assert f'{itl}_bucket{{worker_id="ab",le="0.5"}} 2' in text  # a bound holds what equals it (le)
    assert metric_values(text, f"{itl}_count") == [2.0] and metric_values(text, f"{itl}_sum") == [1.0]
    assert metric_values(text, "morphserve_e2e_request_latency_seconds_count") == [1.0]  # not the cancelled one
    assert 'morphserve_requests_finished_total{worker_id="ab",finish_reason="length"} 1' in text
    assert 'morphserve_requests_finished_total{worker_id="ab",finish_reason="cancelled"} 1' in text
    assert metric_values(text, "morphserve_prompt_tokens_total") == [5.0]  # b never saw an output
    assert f"# TYPE {ttft} histogram" in text


def test_request_metrics_exposition_has_a_series_per_tier() -> None:
    """The per-tier ITL histogram on the Dynamo worker: one labelled series per tier seen, none before."""
    from serve.engine.outputs import FinishReason, RequestOutput
    from serve.metrics_catalogue import TIER_INTER_TOKEN_LATENCY
    from serve.request_tracker import RequestTracker

    metrics = RequestMetrics()
    name = TIER_INTER_TOKEN_LATENCY.name
    assert f"{name}_count" not in metrics.exposition()
    tracker = RequestTracker(metrics)
    for rid, tier in (("a", 0), ("b", 4)):
        tracker.start(rid, arrival=0.0)
        tracker.on_output(RequestOutput(rid, [1], "x", priority=tier), t=1.0)
    tracker.on_output(RequestOutput("a", [2, 3], "yz", True, FinishReason.LENGTH, priority=0), t=1.5)  # 2 x 0.25 s
    tracker.on_output(RequestOutput("b", [2], "y", True, FinishReason.LENGTH, priority=4), t=3.0)  # 1 x 2 s
    text = metrics.exposition({"worker_id": "ab"})
    assert f'{name}_bucket{{worker_id="ab",tier="0",le="0.2"}} 0' in text
    assert f'{name}_bucket{{worker_id="ab",tier="0",le="0.3"}} 2' in text
    assert f'{name}_bucket{{worker_id="ab",tier="4",le="1.0"}} 0' in text
    assert f'{name}_bucket{{worker_id="ab",tier="4",le="2.5"}} 1' in text
    assert metric_values(text, f"{name}_count") == [2.0, 1.0] and metric_values(text, f"{name}_sum") == [0.5, 2.0]
    assert text.count(f"# TYPE {name} histogram") == 1


def test_capacity_publisher_publishes_changes_only() -> None:
    stats = [STATS]
    sent: list[KvSnapshot] = []
    pub = CapacityPublisher(lambda: stats[-1])
    pub.on_step()  # not attached yet: nothing to send
    pub.attach(sent.append)  # attaching publishes the current state
    pub.on_step()
    stats.append(dataclasses.replace(STATS, kv_blocks_used=41))
    pub.on_step()
    stats.append(dataclasses.replace(STATS, kv_blocks_used=41, kv_blocks_total=176))  # a morph transition
    pub.on_step()
    assert sent == [KvSnapshot(40, 160), KvSnapshot(41, 160), KvSnapshot(41, 176)]
    assert pub.published == 3 and sent[-1].usage == pytest.approx(41 / 176)


def test_capacity_publisher_never_raises_into_the_engine_loop() -> None:
    def broken():
        raise RuntimeError("boom")
    pub = CapacityPublisher(broken)
    pub.attach(lambda snap: None)
    pub.on_step()
    none_yet = CapacityPublisher(lambda: None)
    none_yet.attach(lambda snap: pytest.fail("published without stats"))
    assert none_yet.published == 0


# ---- bridge ------------------------------------------------------------------------------------------
def test_output_stream_carries_outputs_from_another_thread_in_order() -> None:
    async def run() -> list[int]:
        stream = OutputStream(asyncio.get_running_loop())

        def engine_thread() -> None:
            for i in range(5):
                stream.push(SimpleNamespace(value=i, finished=i == 4))
            stream.push(SimpleNamespace(value=99, finished=True))  # after the final one: never read
        threading.Thread(target=engine_thread).start()
        return [out.value async for out in stream]
    assert asyncio.run(asyncio.wait_for(run(), 10)) == [0, 1, 2, 3, 4]


# ---- command line -----------------------------------------------------------------------------------
def test_worker_command_line() -> None:
    opts = parse_worker_args(["--model", "engines/x", "--morph-mode", "off", "--num-kv-blocks", "64",
                              "--policy", "kv_high=0.7", "--policy", "persist_iters=2", "--served-model-name", "m"])
    assert opts.engine.model == "engines/x" and opts.engine.num_kv_blocks == 64
    assert opts.engine.policy_overrides == {"kv_high": 0.7, "persist_iters": 2}
    assert opts.served_model_name == "m" and opts.discovery_backend in ("file", "etcd", "kubernetes", "mem")
    assert parse_worker_args([]).engine.morph_mode == "default"
    with pytest.raises(ValueError):
        parse_worker_args(["--morph-mode", "fastest"])
    with pytest.raises(ValueError):
        parse_worker_args(["--policy", "kv_high"])


# ---- tokenizer card -----------------------------------------------------------------------------------
def test_model_card_tokenizes_like_the_engine(tmp_path, smollm) -> None:
    """transformers reading the card (as an HF-style consumer does) gives the engine's chat prompt ids."""
    from transformers import AutoTokenizer

    from serve.dynamo.model_card import FILES, write_model_card_dir

    card = write_model_card_dir(tmp_path / "card", smollm.tokenizer, smollm.config, 512)
    assert sorted(p.name for p in card.iterdir()) == sorted(FILES)
    hf = AutoTokenizer.from_pretrained(str(card))
    messages = [{"role": "user", "content": "What is 2 + 2? Answer in one word."}]
    ours = smollm.tokenizer.encode(smollm.tokenizer.apply_chat_template(messages))
    theirs = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    theirs = theirs["input_ids"] if isinstance(theirs, dict) or hasattr(theirs, "keys") else theirs
    assert list(theirs) == ours
    assert hf.decode(ours[5:12]) == smollm.tokenizer.decode(ours[5:12])


# ---- engine features the worker uses -------------------------------------------------------------------
@pytest.fixture()
def tiny_engine(tiny):
    from serve.config import EngineConfig
    from serve.engine import LLMEngine

    return LLMEngine(EngineConfig(num_kv_blocks=32, max_num_seqs=4), loaded=tiny)


def test_min_tokens_keeps_stop_tokens_out_until_reached(tiny_engine) -> None:
    from serve.engine import SamplingParams

    prompt = [5, 6, 7, 8]
    first = tiny_engine.generate([prompt], SamplingParams(max_tokens=1))[0]["token_ids"][0]
    stopped = tiny_engine.generate([prompt], SamplingParams(max_tokens=6, stop_token_ids=(first,)))[0]
    assert stopped["token_ids"] == [first] and stopped["finish_reason"] == "stop"
    held = tiny_engine.generate([prompt], SamplingParams(max_tokens=6, min_tokens=3, stop_token_ids=(first,)))[0]
    assert first not in held["token_ids"][:3] and len(held["token_ids"]) >= 3
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=2, min_tokens=3)


def test_step_listeners_see_every_step_including_idle_ones(tiny_engine) -> None:
    from serve.engine import SamplingParams

    seen: list[int] = []
    tiny_engine.add_step_listener(lambda: seen.append(tiny_engine.stats().kv_blocks_used))
    tiny_engine.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(seen) >= 3 and max(seen) > 0 and seen[-1] == 0
    before = len(seen)
    tiny_engine.step()  # nothing to do: still a step boundary (where morph transitions happen)
    assert len(seen) == before + 1


# ---- launcher ----------------------------------------------------------------------------------------
def test_dynamo_env_pins_every_address_to_loopback(tmp_path) -> None:
    from serve.dynamo.cluster import dynamo_env, free_system_port

    env = dynamo_env("file", tmp_path)
    for key in ("DYN_TCP_RPC_HOST", "DYN_TCP_RESPONSE_STREAM_HOST", "DYN_EVENT_PLANE_HOST", "DYN_SYSTEM_HOST",
                "DYN_HTTP_HOST"):
        assert env[key] == "127.0.0.1"
    assert env["DYN_DISCOVERY_BACKEND"] == "file" and env["DYN_FILE_KV"] == str(tmp_path)
    etcd = dynamo_env("etcd", None, "http://127.0.0.1:2379", host="10.1.2.3")
    assert etcd["ETCD_ENDPOINTS"] == "http://127.0.0.1:2379" and etcd["DYN_TCP_RPC_HOST"] == "10.1.2.3"
    assert etcd["DYN_SYSTEM_HOST"] == "127.0.0.1" and "DYN_FILE_KV" not in etcd
    assert all(20000 <= free_system_port() < 32768 for _ in range(5))  # Dynamo reads the port as i16


def test_launcher_keeps_serving_while_one_worker_is_left(capsys) -> None:
    from serve.dynamo.launch import watch

    def proc(name: str, code: int | None):
        return SimpleNamespace(name=name, alive=lambda: code is None, popen=SimpleNamespace(returncode=code),
                               log_path=f"/tmp/{name}.log")
    cluster = SimpleNamespace(frontend=proc("frontend", None), workers=[proc("worker-0", -9), proc("worker-1", None)])
    reported: set[str] = set()
    assert watch(cluster, reported) is False and watch(cluster, reported) is False
    assert capsys.readouterr().err.count("worker-0 exited") == 1  # said once
    cluster.workers[1] = proc("worker-1", 1)
    assert watch(cluster, reported) is True  # nothing left to serve
    cluster = SimpleNamespace(frontend=proc("frontend", 1), workers=[proc("worker-0", None)])
    assert watch(cluster, set()) is True


def test_expired_contexts_refuse_the_frontends_retries_for_a_while() -> None:
    """Dynamo's frontend migrates a request that ended with ConnectionTimeout under the same context id: the worker
    refuses each retry of a context past its deadline at once, for ttl_s, keeping at most max_entries ids."""
    from serve.dynamo.deadlines import ExpiredContexts

    now = [0.0]
    expired = ExpiredContexts(ttl_s=10.0, max_entries=2, clock=lambda: now[0])
    expired.add("a", "request timed out after timeout_s=4 s (9 tokens generated)")
    assert expired.get("a") == "request timed out after timeout_s=4 s (9 tokens generated)" and expired.get("b") is None
    now[0] = 5.0
    expired.add("b", "b's")
    expired.add("c", "c's")  # a third id: the oldest goes
    assert expired.get("a") is None and expired.get("b") == "b's" and len(expired) == 2
    now[0] = 15.5  # b is 10.5 s old, c too: both forgotten
    assert expired.get("c") is None and len(expired) == 0
