"""The official `openai` client against our server: completions and chat, streamed and not."""

import openai
import pytest
import requests

from server_fixtures import serving, tiny_engine  # noqa: F401 - fixture

MODEL = "test-model"


@pytest.fixture(scope="module")
def server(tiny_engine):
    with serving(tiny_engine, max_n=4) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


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
    assert chunks[-1].usage == whole.usage


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
    assert chunks[-1].usage == reply.usage


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


def test_logprobs_are_refused_not_ignored(client):
    with pytest.raises(openai.BadRequestError, match="logprobs=2 is not supported yet"):
        client.completions.create(model=MODEL, prompt="x", logprobs=2)
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], top_logprobs=2)
