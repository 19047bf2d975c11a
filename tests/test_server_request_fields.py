"""vLLM's extra request fields on the OpenAI endpoints: echo, prompt_logprobs, return_token_ids,
return_tokens_as_token_ids, continuous_usage_stats, truncate_prompt_tokens, allowed_token_ids,
cached_tokens, and chat's add_generation_prompt / continue_final_message / echo."""

import json
import random

import pytest
import requests

from server_fixtures import openai_client, serving, tiny_engine  # noqa: F401 - fixture

MODEL = "test-model"
GREEDY = dict(model=MODEL, temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def server(tiny_engine):
    with serving(tiny_engine) as server:
        yield server


def post(server, path: str, status: int = 200, **body) -> dict:
    reply = requests.post(f"{server.url}{path}", json=body, timeout=60)
    assert reply.status_code == status, reply.text
    return reply.json()


def events(server, path: str, **body) -> list[dict]:
    with requests.post(f"{server.url}{path}", json={**body, "stream": True}, stream=True, timeout=60) as reply:
        assert reply.status_code == 200, reply.text
        lines = [line[len(b"data: "):] for line in reply.iter_lines() if line.startswith(b"data: ")]
    assert lines[-1] == b"[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def encode(engine, text: str) -> list[int]:
    return engine.tokenizer.encode(text, add_special_tokens=False)


def test_echo_puts_the_prompt_before_the_completion(server, tiny_engine):
    plain = post(server, "/v1/completions", prompt="The sea", **GREEDY)["choices"][0]["text"]
    echoed = post(server, "/v1/completions", prompt="The sea", echo=True, **GREEDY)["choices"][0]["text"]
    assert echoed == "The sea" + plain
    by_ids = post(server, "/v1/completions", prompt=encode(tiny_engine, "The sea"), echo=True, **GREEDY)
    assert by_ids["choices"][0]["text"] == tiny_engine.tokenizer.decode(encode(tiny_engine, "The sea")) + plain
    streamed = events(server, "/v1/completions", prompt="The sea", echo=True, **GREEDY)
    assert "".join(e["choices"][0]["text"] for e in streamed) == echoed


def test_echo_with_logprobs_shows_the_prompts_logprobs_first(server, tiny_engine):
    prompt = encode(tiny_engine, "The sea is wide and deep")
    reply = post(server, "/v1/completions", prompt=prompt, echo=True, logprobs=2, prompt_logprobs=2,
                 return_token_ids=True, **GREEDY)
    [choice] = reply["choices"]
    logprobs, scored = choice["logprobs"], choice["prompt_logprobs"]
    assert len(logprobs["tokens"]) == len(prompt) + 6 and logprobs["token_logprobs"][0] is None
    assert logprobs["top_logprobs"][0] is None and scored[0] is None and len(scored) == len(prompt)
    for i, token in enumerate(prompt[1:], start=1):   # the same figures in both shapes
        assert logprobs["token_logprobs"][i] == scored[i][str(token)]["logprob"]
        assert len(logprobs["top_logprobs"][i]) <= 3 and scored[i][str(token)]["rank"] >= 1
    plain = post(server, "/v1/completions", prompt=prompt, logprobs=2, **GREEDY)["choices"][0]["logprobs"]
    assert logprobs["token_logprobs"][len(prompt):] == plain["token_logprobs"]
    assert logprobs["text_offset"] == sorted(logprobs["text_offset"])
    streamed = events(server, "/v1/completions", prompt=prompt, echo=True, logprobs=2, **GREEDY)
    joined = [t for e in streamed if e["choices"][0]["logprobs"] for t in e["choices"][0]["logprobs"]["tokens"]]
    assert joined == logprobs["tokens"]
    chat = post(server, "/v1/chat/completions", messages=[{"role": "user", "content": "Hi"}], prompt_logprobs=0,
                return_token_ids=True, **GREEDY)
    assert len(chat["prompt_logprobs"]) == len(chat["prompt_token_ids"]) and chat["prompt_logprobs"][0] is None
    assert all(len(entry) == 1 for entry in chat["prompt_logprobs"][1:])   # the token itself, no top
    error = post(server, "/v1/completions", 400, prompt=prompt, prompt_logprobs=1, stream=True, **GREEDY)["error"]
    assert error["param"] == "prompt_logprobs"


def test_return_token_ids_gives_the_prompts_and_the_choices_ids(server, tiny_engine):
    reply = post(server, "/v1/completions", prompt="The sea", return_token_ids=True, **GREEDY)
    [choice] = reply["choices"]
    assert choice["prompt_token_ids"] == encode(tiny_engine, "The sea")
    reference = post(server, "/generate", prompt="The sea", temperature=0, max_tokens=6, ignore_eos=True)
    assert choice["token_ids"] == reference["outputs"][0]["token_ids"]
    assert "token_ids" not in post(server, "/v1/completions", prompt="The sea", **GREEDY)["choices"][0]

    streamed = events(server, "/v1/completions", prompt="The sea", return_token_ids=True, **GREEDY)
    assert streamed[0]["choices"][0]["prompt_token_ids"] == choice["prompt_token_ids"]
    assert all("prompt_token_ids" not in e["choices"][0] for e in streamed[1:])
    assert [t for e in streamed for t in e["choices"][0]["token_ids"]] == choice["token_ids"]

    messages = [{"role": "user", "content": "Hi there"}]
    chat = post(server, "/v1/chat/completions", messages=messages, return_token_ids=True, **GREEDY)
    assert chat["prompt_token_ids"] == post(server, "/tokenize", model=MODEL, messages=messages)["tokens"]
    assert len(chat["choices"][0]["token_ids"]) == chat["usage"]["completion_tokens"] == 6
    chunks = events(server, "/v1/chat/completions", messages=messages, return_token_ids=True, **GREEDY)
    assert chunks[0]["prompt_token_ids"] == chat["prompt_token_ids"]
    assert [t for c in chunks[1:] for t in c["choices"][0].get("token_ids", [])] == chat["choices"][0]["token_ids"]


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(server):
    reply = post(server, "/v1/completions", prompt="The sea", logprobs=2, return_tokens_as_token_ids=True,
                 return_token_ids=True, **GREEDY)
    [choice] = reply["choices"]
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert all(key.startswith("token_id:") for top in choice["logprobs"]["top_logprobs"] for key in top)
    chat = post(server, "/v1/chat/completions", messages=[{"role": "user", "content": "Hi"}], logprobs=True,
                top_logprobs=1, return_tokens_as_token_ids=True, return_token_ids=True, **GREEDY)
    content = chat["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == [f"token_id:{t}" for t in chat["choices"][0]["token_ids"]]


def test_continuous_usage_stats_put_usage_in_every_chunk(server):
    for path, body in (("/v1/completions", dict(prompt="The sea")),
                       ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "Hi"}]))):
        chunks = events(server, path, **body, **GREEDY,
                        stream_options={"include_usage": True, "continuous_usage_stats": True})
        counted = [c["usage"]["completion_tokens"] for c in chunks if c["choices"] and c["usage"]]
        assert counted and counted == sorted(counted) and counted[-1] == 6, counted
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
        plain = events(server, path, **body, **GREEDY, stream_options={"include_usage": True})
        assert all(c["usage"] is None for c in plain[:-1])


def test_truncate_prompt_tokens_keeps_the_prompts_end(server, tiny_engine):
    ids = encode(tiny_engine, "one two three four five six seven eight nine ten")
    kept = post(server, "/v1/completions", prompt=ids, truncate_prompt_tokens=4, return_token_ids=True, **GREEDY)
    assert kept["usage"]["prompt_tokens"] == 4 and kept["choices"][0]["prompt_token_ids"] == ids[-4:]
    alone = post(server, "/v1/completions", prompt=ids[-4:], **GREEDY)
    assert kept["choices"][0]["text"] == alone["choices"][0]["text"]
    whole = post(server, "/v1/completions", prompt=ids, truncate_prompt_tokens=-1, **GREEDY)
    assert whole["usage"]["prompt_tokens"] == len(ids)
    error = post(server, "/v1/completions", 400, prompt=ids, truncate_prompt_tokens=10**6, **GREEDY)["error"]
    assert error["param"] == "truncate_prompt_tokens" and "max_model_len=128" in error["message"]


def test_allowed_token_ids_limit_what_is_sampled(server, tiny_engine):
    allowed = [11, 500, 4242, 49151]
    reply = post(server, "/v1/completions", prompt="The sea", model=MODEL, max_tokens=24, temperature=1.0, seed=3,
                 ignore_eos=True, allowed_token_ids=allowed, return_token_ids=True)
    tokens = reply["choices"][0]["token_ids"]
    assert len(tokens) == 24 and set(tokens) <= set(allowed) and len(set(tokens)) > 1
    greedy = post(server, "/v1/completions", prompt="The sea", allowed_token_ids=[500], return_token_ids=True,
                  **GREEDY)
    assert greedy["choices"][0]["token_ids"] == [500] * 6
    error = post(server, "/v1/completions", 400, prompt="The sea", allowed_token_ids=[10**6], **GREEDY)["error"]
    assert error["param"] == "allowed_token_ids" and "outside the vocabulary" in error["message"]


def test_cached_tokens_count_the_prefix_cache_hits(server, tiny_engine):
    ids = [random.Random(7).randrange(100, 40000) for _ in range(40)]   # 2 full pages of 16, then 8
    first = post(server, "/v1/completions", prompt=ids, **GREEDY)["usage"]
    second = post(server, "/v1/completions", prompt=ids, **GREEDY)["usage"]
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["prompt_tokens_details"]["cached_tokens"] == 32
    reply = openai_client(server).completions.create(model=MODEL, prompt=ids, max_tokens=2)
    assert reply.usage.prompt_tokens_details.cached_tokens == 32


def test_chat_continues_the_final_message(server, tiny_engine):
    messages = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "The colour is"}]
    reply = post(server, "/v1/chat/completions", messages=messages, add_generation_prompt=False,
                 continue_final_message=True, echo=True, return_token_ids=True, **GREEDY)
    expected = tiny_engine.tokenizer.apply_chat_template(messages, continue_final_message=True, tokenize=True,
                                                         return_dict=False)
    assert reply["prompt_token_ids"] == list(expected)
    assert reply["choices"][0]["message"]["content"].startswith("The colour is")
    plain = post(server, "/v1/chat/completions", messages=messages, add_generation_prompt=False,
                 continue_final_message=True, **GREEDY)
    assert reply["choices"][0]["message"]["content"] == "The colour is" + plain["choices"][0]["message"]["content"]
    chunks = events(server, "/v1/chat/completions", messages=messages, add_generation_prompt=False,
                    continue_final_message=True, echo=True, **GREEDY)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == \
        reply["choices"][0]["message"]["content"]
    no_prompt = post(server, "/v1/chat/completions", messages=messages[:1], add_generation_prompt=False,
                     return_token_ids=True, **GREEDY)
    with_prompt = post(server, "/v1/chat/completions", messages=messages[:1], return_token_ids=True, **GREEDY)
    assert with_prompt["prompt_token_ids"][:len(no_prompt["prompt_token_ids"])] == no_prompt["prompt_token_ids"]
    assert len(with_prompt["prompt_token_ids"]) > len(no_prompt["prompt_token_ids"])


@pytest.mark.parametrize("body, param", [
    (dict(continue_final_message=True), "continue_final_message"),   # add_generation_prompt is true by default
    (dict(continue_final_message=True, add_generation_prompt=False, last="user"), "continue_final_message"),
])
def test_chat_refuses_what_cannot_be_continued(server, body, param):
    role = body.pop("last", "assistant")
    messages = [{"role": "user", "content": "Hi"}, {"role": role, "content": "Hello"}]
    assert post(server, "/v1/chat/completions", 400, messages=messages, **body, **GREEDY)["error"]["param"] == param


def test_chat_messages_ignore_unknown_keys(server):
    messages = [{"role": "user", "content": "Hi", "name": "ann", "x-client-id": 7}]
    assert post(server, "/v1/chat/completions", messages=messages, **GREEDY)["usage"]["completion_tokens"] == 6


def test_beam_search_returns_transformers_beams(server, tiny_engine, tiny_models):
    from test_beam_search import hf_beams

    _, hf_model = tiny_models("llama")
    prompt = encode(tiny_engine, "The sea is wide and deep")
    reply = post(server, "/v1/completions", model=MODEL, prompt=prompt, n=4, use_beam_search=True, max_tokens=8,
                 ignore_eos=True, return_token_ids=True)
    beams, _ = hf_beams(hf_model, prompt, None)
    assert [c["token_ids"] for c in reply["choices"]] == beams
    assert [c["text"] for c in reply["choices"]] == [tiny_engine.tokenizer.decode(b, skip_special_tokens=True)
                                                     for b in beams]
    assert {c["finish_reason"] for c in reply["choices"]} == {"length"} and reply["usage"]["completion_tokens"] == 32
    chat = post(server, "/v1/chat/completions", model=MODEL, messages=[{"role": "user", "content": "Hi"}], n=2,
                use_beam_search=True, max_tokens=5, ignore_eos=True, length_penalty=0.5, early_stopping="never")
    assert len(chat["choices"]) == 2 and chat["usage"]["completion_tokens"] == 10
    assert tiny_engine.stats().kv_cache_usage == 0


@pytest.mark.parametrize("body, param", [
    (dict(stream=True), "stream"), (dict(logprobs=2), "logprobs"), (dict(n=11), "n"),
    (dict(prompt_logprobs=1), "prompt_logprobs"), (dict(structured_outputs={"regex": "a+"}), "structured_outputs"),
    (dict(early_stopping="sometimes"), "early_stopping"), (dict(stop=["x"]), "stop"),
    (dict(frequency_penalty=0.5), "frequency_penalty"), (dict(top_p=0.9), "top_p"),
    (dict(allowed_token_ids=[5]), "allowed_token_ids"),
])
def test_beam_search_refuses_what_it_cannot_do(server, body, param):
    error = post(server, "/v1/completions", 400, model=MODEL, prompt="The sea", use_beam_search=True, max_tokens=4,
                 **body)["error"]
    assert error["param"] == param, error
