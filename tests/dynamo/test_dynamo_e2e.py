"""End-to-end through NVIDIA Dynamo: the official openai client -> `python -m dynamo.frontend` ->
one `python -m serve.dynamo` worker, real processes on free loopback ports.

Greedy outputs must equal the engine's own greedy output (in-process, same configuration, same chat
template); a client that disconnects mid-stream must free the worker's KV blocks without the worker
generating the rest; unsupported options get a clear 400 and the worker keeps serving.
"""

from __future__ import annotations

import json
import re

import pytest

from serve.dynamo.http import post_json
from tests.dynamo_cluster_support import ReferenceEngine, openai_client, running_cluster, wait_for, worker_metric

pytestmark = [pytest.mark.dynamo, pytest.mark.timeout(900)]

TOKENS = 16
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three primary colors."}],
]
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]


@pytest.fixture(scope="module")
def cluster():
    with running_cluster(replicas=1) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    return openai_client(cluster)


@pytest.fixture(scope="module")
def reference() -> ReferenceEngine:
    return ReferenceEngine()


def test_models_lists_the_served_model(client) -> None:
    assert [m.id for m in client.models.list().data] == ["morphserve"]


@pytest.mark.parametrize("messages", CHATS, ids=["user", "system+user"])
def test_chat_greedy_equals_the_engine(client, reference, messages) -> None:
    want = reference.greedy(reference.chat_prompt(messages), TOKENS)
    got = client.chat.completions.create(model="morphserve", messages=messages, max_tokens=TOKENS, temperature=0)
    assert got.choices[0].message.content == want["text"]
    assert got.choices[0].finish_reason == want["finish_reason"]
    assert got.usage.completion_tokens == len(want["token_ids"])
    assert got.usage.prompt_tokens == len(reference.engine.tokenizer.encode(reference.chat_prompt(messages)))


def test_chat_stream_equals_the_engine(client, reference) -> None:
    messages = CHATS[0]
    want = reference.greedy(reference.chat_prompt(messages), TOKENS)
    stream = client.chat.completions.create(model="morphserve", messages=messages, max_tokens=TOKENS, temperature=0,
                                            stream=True)
    parts, reasons = [], []
    for ev in stream:
        for choice in ev.choices:
            parts.append(choice.delta.content or "")
            reasons.append(choice.finish_reason)
    assert "".join(parts) == want["text"]
    assert len([p for p in parts if p]) > 1  # streamed, not one blob
    assert reasons[-1] == want["finish_reason"]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_text_completion_greedy_equals_the_engine(client, reference, prompt) -> None:
    want = reference.greedy(prompt, TOKENS)
    got = client.completions.create(model="morphserve", prompt=prompt, max_tokens=TOKENS, temperature=0)
    assert got.choices[0].text == want["text"]
    stream = client.completions.create(model="morphserve", prompt=prompt, max_tokens=TOKENS, temperature=0, stream=True)
    assert "".join(ev.choices[0].text for ev in stream if ev.choices) == want["text"]


def test_stop_string_and_min_tokens_and_ignore_eos(client, reference) -> None:
    prompt = PROMPTS[0]
    full = reference.greedy(prompt, TOKENS)["text"]
    stop = full.strip().split()[1]  # a word the greedy continuation contains
    got = client.completions.create(model="morphserve", prompt=prompt, max_tokens=TOKENS, temperature=0, stop=[stop])
    assert got.choices[0].text == full[: full.index(stop)] and got.choices[0].finish_reason == "stop"
    eos_free = reference.greedy(prompt, 40, ignore_eos=True, min_tokens=40)
    got = client.completions.create(model="morphserve", prompt=prompt, max_tokens=40, temperature=0,
                                    extra_body={"ignore_eos": True, "min_tokens": 40})
    assert got.usage.completion_tokens == 40 and got.choices[0].text == eos_free["text"]


def test_seeded_sampling_is_reproducible(client) -> None:
    kwargs = dict(model="morphserve", prompt="Tell me a story:", max_tokens=12, temperature=0.9, top_p=0.9, seed=7,
                  extra_body={"top_k": 50})
    first = client.completions.create(**kwargs).choices[0].text
    assert client.completions.create(**kwargs).choices[0].text == first


@pytest.mark.parametrize("extra, named", [
    ({"n": 2, "temperature": 0.8}, "n=2"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"logprobs": 2}, "logprobs"),
])
def test_unsupported_options_get_a_clear_error(client, extra, named) -> None:
    import openai

    with pytest.raises(openai.BadRequestError, match=named):
        client.completions.create(model="morphserve", prompt="Hi", max_tokens=4, **extra)
    assert client.completions.create(model="morphserve", prompt="Hi", max_tokens=2, temperature=0).choices[0].text


def test_structured_output_through_response_format_and_guided_fields(client, reference) -> None:
    """The official client's response_format (json_schema, json_object) and the guided_* fields in extra_body
    reach the worker (serve/dynamo/requests.py guided_decoding) and constrain the answer; greedy equals the
    engine's own guided greedy run; a bad regex is a clear 400."""
    import jsonschema
    import openai

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
              "population_millions": {"type": "number", "minimum": 0}}, "required": ["city", "population_millions"]}
    messages = [{"role": "user", "content": "Give the capital of France and its population as JSON."}]
    got = client.chat.completions.create(
        model="morphserve", messages=messages, max_tokens=80, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}})
    text = got.choices[0].message.content
    jsonschema.validate(json.loads(text), schema)
    want = reference.greedy(reference.chat_prompt(messages), 80,
                            guided_decoding={"type": "json_schema", "guide": json.dumps(schema)})
    assert text == want["text"] and got.choices[0].finish_reason == "stop"
    got = client.chat.completions.create(model="morphserve", messages=messages, max_tokens=120, temperature=0,
                                         response_format={"type": "json_object"})
    assert isinstance(json.loads(got.choices[0].message.content), dict)
    got = client.completions.create(model="morphserve", prompt="The year after 2024 is", max_tokens=8, temperature=0,
                                    extra_body={"guided_regex": "[0-9]{4}"})
    assert re.fullmatch("[0-9]{4}", got.choices[0].text), got.choices[0].text
    got = client.completions.create(model="morphserve", prompt="Is water wet? Answer:", max_tokens=8, temperature=0,
                                    extra_body={"guided_choice": ["yes", "no"]})
    assert got.choices[0].text in ("yes", "no")
    with pytest.raises(openai.BadRequestError, match="invalid regex guide"):
        client.completions.create(model="morphserve", prompt="Hi", max_tokens=4, extra_body={"guided_regex": "([0-9"})


def test_too_long_request_is_rejected_and_the_worker_keeps_serving(client) -> None:
    import openai

    with pytest.raises(openai.BadRequestError, match="context length"):
        client.completions.create(model="morphserve", prompt="Hi", max_tokens=400)
    assert client.completions.create(model="morphserve", prompt="Hi", max_tokens=2,
                                     temperature=0).usage.completion_tokens == 2


def test_client_disconnect_mid_stream_frees_kv_blocks(cluster, client) -> None:
    worker = cluster.workers[0]
    generated_before = worker_metric(worker, "morphserve_generation_tokens_total")
    stream = client.completions.create(model="morphserve", prompt="Write a long essay about rivers.", max_tokens=200,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True})
    received = 0
    for ev in stream:
        received += 1
        if received == 3:
            break
    assert worker_metric(worker, "morphserve_kv_blocks_used") > 0  # the request holds blocks while it runs
    stream.close()  # the client goes away
    wait_for(lambda: worker_metric(worker, "morphserve_kv_blocks_used") == 0
             and worker_metric(worker, "morphserve_num_requests_running") == 0, 60, what="KV blocks to be freed")
    generated = worker_metric(worker, "morphserve_generation_tokens_total") - generated_before
    assert received <= generated < 200  # aborted, not run to completion
    assert worker_metric(worker, "dynamo_component_gpu_cache_usage_percent") == 0  # the router's view too


def test_morph_state_control_and_published_capacity(cluster) -> None:
    worker = cluster.workers[0]
    state = post_json(f"http://127.0.0.1:{worker.port}/engine/control/morph_state", {})
    assert state["status"] == "ok" and state["morph_mode"] == "off"
    assert state["stats"]["kv_blocks_total"] == 64 == state["registered_total_kv_blocks"]
    assert state["published"]["kv_total_blocks"] == 64
    assert worker_metric(worker, "dynamo_component_total_blocks") == 64
    assert worker_metric(worker, "morphserve_kv_blocks_total") == 64


def test_per_request_metrics_in_nvext_and_cached_tokens(client) -> None:
    """Dynamo's nvext fields a worker fills: ``engine_data`` (the request's perf metrics under TensorRT-LLM's names)
    and ``stop_reason``, on request (``nvext.extra_fields``); a repeated prompt's blocks served from the prefix cache
    show as usage.prompt_tokens_details.cached_tokens, equal to the reused blocks times the block size."""
    prompt = "The history of the city begins with a small settlement by the river. " * 4
    body = {"nvext": {"extra_fields": ["engine_data", "stop_reason"]}}
    first = client.completions.create(model="morphserve", prompt=prompt, max_tokens=4, temperature=0, extra_body=body)
    second = client.completions.create(model="morphserve", prompt=prompt, max_tokens=4, temperature=0, extra_body=body)
    data = second.model_extra["nvext"]["engine_data"]
    assert data["kv_cache_reused_block"] > 0 and first.model_extra["nvext"]["engine_data"]["kv_cache_reused_block"] == 0
    assert second.usage.prompt_tokens_details.cached_tokens == data["kv_cache_reused_block"] * 16
    assert 0 < data["arrival_time_ns"] <= data["first_token_time_ns"] <= data["last_token_time_ns"]
    stopped = client.completions.create(model="morphserve", prompt="Count: one, two, three,", max_tokens=30,
                                        temperature=0, stop=[","], extra_body=body)
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.model_extra["nvext"].get("stop_reason") == ",", stopped.model_extra
