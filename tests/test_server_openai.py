"""The official `openai` client against our server: completions and chat, streamed and not."""

import pytest
import requests

from server_fixtures import openai_client, serving, tiny_engine  # noqa: F401 - fixture

MODEL = "test-model"
CHAT = [{"role": "user", "content": "Hi there"}]


@pytest.fixture(scope="module")
def server(tiny_engine):
    with serving(tiny_engine, max_n=4) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server, timeout=60)


def counts(usage) -> tuple[int, int, int]:
    return usage.prompt_tokens, usage.completion_tokens, usage.total_tokens


def generate(server, **body):
    reply = requests.post(f"{server.url}/generate", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_completion(server, client, tiny_engine):
    reference = generate(server, prompt="The sea", max_tokens=8, temperature=0)["outputs"][0]
    reply = client.completions.create(model=MODEL, prompt="The sea", max_tokens=8, temperature=0)
    assert reply.object == "text_completion" and reply.model == MODEL and reply.id.startswith("cmpl-")
    [choice] = reply.choices
    assert choice.index == 0 and choice.finish_reason == "length"
    assert choice.text == reference["output_text"]
    prompt_len = len(tiny_engine.tokenizer.encode("The sea", add_special_tokens=False))
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens, reply.usage.total_tokens) == (
        prompt_len, 8, prompt_len + 8)


def test_completion_token_id_prompt_equals_text_prompt(client, tiny_engine):
    ids = tiny_engine.tokenizer.encode("The sea", add_special_tokens=False)
    by_text = client.completions.create(model=MODEL, prompt="The sea", max_tokens=6, temperature=0)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text


def test_streamed_completion_equals_non_streamed(client):
    args = dict(model=MODEL, prompt="Once upon", max_tokens=10, temperature=0.8, seed=11)
    whole = client.completions.create(**args)
    chunks = list(client.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks[:-1]) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert counts(chunks[-1].usage) == counts(whole.usage)   # cached_tokens differ: the second finds the first's pages


def test_n2_and_several_prompts(client):
    args = dict(model=MODEL, prompt=["Red", "Blue sky"], n=2, max_tokens=5, seed=3, temperature=1.0)
    whole = client.completions.create(**args)
    assert [c.index for c in whole.choices] == [0, 1, 2, 3]
    assert whole.usage.completion_tokens == 20
    streamed = {}
    for chunk in client.completions.create(**args, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert streamed == {c.index: c.text for c in whole.choices}
    assert len({c.text for c in whole.choices[:2]}) == 2, "the two samples of a prompt differ"


def test_chat(client, tiny_engine):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=7, temperature=0)
    assert reply.object == "chat.completion" and reply.id.startswith("chatcmpl-")
    [choice] = reply.choices
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    templated = tiny_engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert reply.usage.prompt_tokens == len(templated["input_ids"]) and reply.usage.completion_tokens == 7
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=7, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == choice.message.content
    assert chunks[-2].choices[0].finish_reason == "length"
    assert counts(chunks[-1].usage) == counts(reply.usage)   # cached_tokens differ: the second finds the first's pages


def test_chat_n2_streamed_with_max_completion_tokens(client):
    args = dict(model=MODEL, messages=[{"role": "user", "content": "Count"}], n=2, seed=5,
                max_completion_tokens=4)
    whole = client.chat.completions.create(**args)
    streamed = {0: "", 1: ""}
    for chunk in client.chat.completions.create(**args, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert streamed == {c.index: c.message.content for c in whole.choices}
    assert whole.usage.completion_tokens == 8


def test_stop_string_split_across_tokens_is_held_back(server, client, tiny_engine):
    reference = generate(server, prompt="Stop here", max_tokens=24, temperature=0)["outputs"][0]
    text, ids = reference["output_text"], reference["token_ids"]
    start = _stop_across_tokens(tiny_engine.tokenizer, ids, text)
    stop = text[start:start + 4]
    args = dict(model=MODEL, prompt="Stop here", max_tokens=24, temperature=0, stop=[stop])
    whole = client.completions.create(**args)
    assert whole.choices[0].text == text[:start] and whole.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(**args, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == text[:start]
    assert chunks[-1].choices[0].finish_reason == "stop"


def _stop_across_tokens(tokenizer, ids, text) -> int:
    """Start of a 4-character piece of `text` that spans two tokens and occurs only there."""
    for i in range(1, len(ids)):
        head = tokenizer.decode(ids[:i])
        start = len(head) - 2
        piece = text[start:start + 4]
        if start > 0 and len(piece) == 4 and text.find(piece) == start and text.startswith(head):
            return start
    raise AssertionError(f"no stop string spanning two tokens in {text!r}")


def test_models(client):
    [model] = client.models.list().data
    assert model.id == MODEL and model.owned_by == "jaxserve"


def test_logprobs_not_asked_for_are_null(client):
    completion = client.completions.create(model=MODEL, prompt="x", max_tokens=2)
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)
    assert completion.choices[0].logprobs is None and chat.choices[0].logprobs is None


def test_completion_logprobs(server, client):
    args = dict(model=MODEL, prompt="The sea", max_tokens=6, temperature=0, logprobs=3)
    [choice] = client.completions.create(**args).choices
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 6
    reference = generate(server, prompt="The sea", max_tokens=6, temperature=0, logprobs=3)["outputs"][0]
    assert logprobs.token_logprobs == [e["logprob"] for e in reference["logprobs"]]
    offset = 0
    for token, logprob, top, text_offset in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs,
                                                logprobs.text_offset):
        assert logprob <= 0 and 1 <= len(top) <= 4
        assert next(iter(top)) == token and top[token] == logprob, "greedy: the sampled token is the top one"
        assert text_offset == offset
        offset += len(token)
    chunks = list(client.completions.create(**args, stream=True))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
    for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert sum((getattr(s, field) for s in streamed), []) == getattr(logprobs, field)


def test_generate_logprobs(server):
    [output] = generate(server, prompt="The sea", max_tokens=5, temperature=0, logprobs=4)["outputs"]
    assert [e["token_id"] for e in output["logprobs"]] == output["token_ids"]
    for entry in output["logprobs"]:
        top = entry["top_logprobs"]
        assert len(top) == 4 and top[0] == {"token_id": entry["token_id"], "logprob": entry["logprob"]}
        assert [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
    assert output["cumulative_logprob"] == pytest.approx(sum(e["logprob"] for e in output["logprobs"]), abs=1e-4)


def test_chat_logprobs(client):
    args = dict(model=MODEL, messages=CHAT, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
    reply = client.chat.completions.create(**args)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens == 6
    for entry in content:
        assert entry.logprob <= 0 and entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 2
        assert (entry.top_logprobs[0].token, entry.top_logprobs[0].logprob) == (entry.token, entry.logprob)
    chunks = list(client.chat.completions.create(**args, stream=True))
    streamed = [e for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert streamed == content
    assert chunks[0].choices[0].logprobs is None, "the role chunk carries no tokens"


def test_chat_logprobs_without_top_logprobs(client):
    reply = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, logprobs=True)
    assert [e.top_logprobs for e in reply.choices[0].logprobs.content] == [[], [], []]


def test_logit_bias_forces_a_token(server, client, tiny_engine):
    token = 1001  # ' loc'
    reply = generate(server, prompt="The sea", max_tokens=6, temperature=0, ignore_eos=True,
                     logit_bias={str(token): 100})
    assert reply["outputs"][0]["token_ids"] == [token] * 6
    completion = client.completions.create(model=MODEL, prompt="The sea", max_tokens=4, temperature=0,
                                           logit_bias={str(token): 100})
    assert completion.choices[0].text == tiny_engine.tokenizer.decode([token]) * 4
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, temperature=0,
                                          logit_bias={str(token): 100})
    assert chat.choices[0].message.content == " loc" * 3


def test_penalties_and_min_tokens_are_accepted(server, client):
    reply = client.completions.create(model=MODEL, prompt="The sea", max_tokens=8, temperature=0,
                                      presence_penalty=1.5, frequency_penalty=-0.5,
                                      extra_body={"repetition_penalty": 1.3, "min_tokens": 8})
    assert reply.usage.completion_tokens == 8
    assert len(generate(server, prompt="x", max_tokens=4, repetition_penalty=0.8)["outputs"]) == 1


def test_best_of_returns_the_n_most_likely_samples(client):
    args = dict(model=MODEL, prompt="Once", max_tokens=6, temperature=1.0, seed=21, logprobs=0)
    ranked = client.completions.create(**args, n=2, best_of=4)
    assert [c.index for c in ranked.choices] == [0, 1] and ranked.usage.completion_tokens == 12
    every = client.completions.create(**args, n=4)
    likelihood = {c.text: sum(c.logprobs.token_logprobs) for c in every.choices}
    best = sorted(likelihood.values(), reverse=True)[:2]
    assert sorted((likelihood[c.text] for c in ranked.choices), reverse=True) == pytest.approx(best, abs=1e-4)


@pytest.mark.parametrize("path,body", [
    ("/generate", {"prompt": "x"}),
    ("/v1/completions", {"prompt": "x"}),
    ("/v1/chat/completions", {"messages": CHAT}),
])
def test_priority_reaches_the_engine_on_every_endpoint(server, tiny_engine, monkeypatch, path, body):
    add_request = tiny_engine.add_request
    seen = []

    def record(prompt, params, request_id=None, priority=0, lora_request=None):
        seen.append(priority)
        return add_request(prompt, params, request_id, priority, lora_request)

    monkeypatch.setattr(tiny_engine, "add_request", record)
    for stream in (False, True):
        reply = requests.post(f"{server.url}{path}", json={**body, "max_tokens": 2, "priority": -7,
                                                           "stream": stream}, timeout=60)
        assert reply.status_code == 200, reply.text
    assert seen == [-7, -7]


def test_neutral_openai_fields_are_accepted_and_the_others_named(server):
    neutral = {"store": False, "metadata": {"team": "a"}, "service_tier": "auto", "user": "u",
               "response_format": {"type": "text"}, "tools": [], "tool_choice": "none", "parallel_tool_calls": True}
    body = {"messages": CHAT, "max_tokens": 2, **neutral}
    assert requests.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).status_code == 200
    reply = requests.post(f"{server.url}/v1/chat/completions", json={**body, "store": True}, timeout=60)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "store"
