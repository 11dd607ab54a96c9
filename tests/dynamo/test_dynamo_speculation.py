"""The per-request opt-out of self-speculative decoding through NVIDIA Dynamo: the official openai client ->
`python -m dynamo.frontend` -> one `python -m serve.dynamo --speculation always` worker. Dynamo 1.6.1's frontend
refuses unknown body and ``nvext`` fields and forwards ``nvext.annotations``; ``"speculate:false"`` there opts the
request out (serve/dynamo/requests.py). An opted-out request drafts nothing (the worker's own counter, read on its
system port after the answer, does not move); the same request without it drafts; both equal the engine's greedy
output without speculation; a malformed value is a clear 400."""

from __future__ import annotations

import pytest

from serve.dynamo.http import post_json
from tests.dynamo_cluster_support import ReferenceEngine, openai_client, running_cluster

pytestmark = [pytest.mark.dynamo, pytest.mark.timeout(900)]

TOKENS = 12
PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
OPT_OUT = {"nvext": {"annotations": ["speculate:false"]}}


@pytest.fixture(scope="module")
def cluster():
    with running_cluster(replicas=1, worker_args=["--speculation", "always"]) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    return openai_client(cluster)


@pytest.fixture(scope="module")
def reference() -> ReferenceEngine:
    return ReferenceEngine()  # the embedded model with the default speculation (auto) drafts nothing


def drafts(cluster) -> int:
    """Sequence drafts the worker's engine verified so far (its stats on the system port: exact after an answer)."""
    answer = post_json(f"http://127.0.0.1:{cluster.workers[0].port}/engine/control/state", {})
    assert answer["status"] == "ok", answer
    return int(answer["stats"]["spec_decode_num_drafts"])


@pytest.mark.parametrize("opt_out", [True, False], ids=["opted-out", "default"])
@pytest.mark.parametrize("api", ["completions", "chat"])
def test_opting_out_drafts_nothing_and_the_default_drafts(cluster, client, reference, api: str, opt_out: bool) -> None:
    extra = {"extra_body": OPT_OUT} if opt_out else {}
    before = drafts(cluster)
    if api == "chat":
        want = reference.greedy(reference.chat_prompt(MESSAGES), TOKENS)["text"]
        got = client.chat.completions.create(model="morphserve", messages=MESSAGES, max_tokens=TOKENS, temperature=0,
                                             **extra).choices[0].message.content
    else:
        want = reference.greedy(PROMPT, TOKENS)["text"]
        got = client.completions.create(model="morphserve", prompt=PROMPT, max_tokens=TOKENS, temperature=0,
                                        **extra).choices[0].text
    assert got == want
    after = drafts(cluster)
    if opt_out:
        assert after == before, f"the opted-out request drafted {after - before} times"
    else:
        assert after > before, "the request did not draft (--speculation always)"


def test_a_malformed_opt_out_is_a_clear_400(client) -> None:
    import openai

    with pytest.raises(openai.BadRequestError, match="speculate:false"):
        client.completions.create(model="morphserve", prompt="Hi", max_tokens=2,
                                  extra_body={"nvext": {"annotations": ["speculate:maybe"]}})
