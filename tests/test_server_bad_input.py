"""Bad input gets an OpenAI-shaped JSON error naming the bad value; the server keeps serving."""

import asyncio
import json
import time

import aiohttp
import pytest
import requests

from server_fixtures import serving, tiny_engine  # noqa: F401 - fixture

KEY = {"Authorization": "Bearer secret"}
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tiny_engine):
    with serving(tiny_engine, api_key="secret", max_queue=1, max_n=4, max_body_bytes=4096) as server:
        yield server


def check_error(reply, status: int, param, message: str):
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert message in error["message"], error["message"]
    return error


CASES = [
    # path, body, status, param, words the message must contain
    ("/v1/completions", b'{"prompt": "x",', 400, None, "not valid JSON"),
    ("/v1/completions", b'["x"]', 400, None, "must be a JSON object"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature", "temperature='hot'"),
    ("/v1/completions", {"prompt": 3}, 400, "prompt", "prompt=3"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model", "model='gpt-4' is not served"),
    ("/v1/completions", {"prompt": [5] * 200}, 400, "prompt", "200 tokens, but max_model_len is 128"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens",
     "max_tokens=0 is out of range: must be >= 1"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 500}, 400, "max_tokens", "at most 127 new tokens fit"),
    ("/v1/completions", {"prompt": "x", "temperature": 2.5}, 400, "temperature",
     "temperature=2.5 is out of range: must be in [0, 2]"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature",
     "temperature=-1 is out of range: must be in [0, 2]"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p", "top_p=0 is out of range: must be in (0, 1]"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p",
     "top_p=1.5 is out of range: must be in (0, 1]"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n", "n=0 is out of range: must be >= 1"),
    ("/v1/completions", {"prompt": "x", "n": 5}, 400, "n", "n=5 is out of range: must be in [1, 4]"),
    ("/v1/completions", {"prompt": [60000]}, 400, "prompt", "token id 60000 is outside the vocabulary [0, 49152)"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt", "the prompt is empty"),
    ("/v1/completions", {"prompt": "x", "best_of": 3, "stream": True}, 400, "best_of",
     "best_of=3 cannot be streamed"),
    ("/v1/completions", {"prompt": "x", "n": 3, "best_of": 2}, 400, "best_of",
     "best_of=2 is out of range: must be >= n=3"),
    ("/v1/completions", {"prompt": "x", "best_of": 5}, 400, "best_of",
     "best_of=5 is out of range: must be in [n=1, 4] (--max-n)"),
    ("/v1/completions", {"prompt": "x", "best_of": 0}, 400, "best_of", "best_of=0 is out of range: must be >= 1"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 21}, 400, "prompt_logprobs",
     "prompt_logprobs=21 is out of range: must be in [0, 20]"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs",
     "prompt_logprobs are not streamed"),
    ("/v1/completions", {"prompt": "x", "truncate_prompt_tokens": -2}, 400, "truncate_prompt_tokens",
     "truncate_prompt_tokens=-2 is out of range: must be >= -1"),
    ("/v1/completions", {"prompt": "x", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens",
     "must be >= 1, or -1 (max_model_len)"),
    ("/v1/completions", {"prompt": "x", "allowed_token_ids": []}, 400, "allowed_token_ids", "at least 1 item"),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, 400, "suffix", "suffix='y' is not supported yet"),
    # a constraint whose only token ("7", id 39) is a stop id held back by min_tokens: a dead end
    ("/v1/completions", {"prompt": "Pick:", "temperature": 0, "max_tokens": 8, "min_tokens": 2, "stop_token_ids": [39],
                         "structured_outputs": {"choice": ["7"]}}, 400, "structured_outputs",
     "the constraint allows no continuation"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs",
     "logprobs=21 is out of range: must be in [0, 20]"),
    ("/v1/completions", {"prompt": "x", "logprobs": -1}, 400, "logprobs", "logprobs=-1 is out of range"),
    ("/v1/completions", {"prompt": "x", "logprobs": True}, 400, "logprobs", "logprobs=True is invalid"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias",
     "logit_bias key 'abc' is not a token id: keys must be integers in [0, 49152)"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"-3": 1}}, 400, "logit_bias", "key '-3' is not a token id"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"49152": 1}}, 400, "logit_bias",
     "key '49152' is not a token id: keys must be integers in [0, 49152)"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 101}}, 400, "logit_bias",
     "biases must be in [-100, 100]"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": "up"}}, 400, "logit_bias", "logit_bias='up'"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {str(i): 1 for i in range(301)}}, 400, "logit_bias",
     "at most 300"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty",
     "presence_penalty=2.5 is out of range: must be in [-2, 2]"),
    ("/v1/completions", {"prompt": "x", "frequency_penalty": -3}, 400, "frequency_penalty",
     "frequency_penalty=-3 is out of range: must be in [-2, 2]"),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty",
     "repetition_penalty=0 is out of range: must be in (0, 2]"),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 2.5}, 400, "repetition_penalty",
     "repetition_penalty=2.5 is out of range: must be in (0, 2]"),
    ("/v1/completions", {"prompt": "x", "min_tokens": -1}, 400, "min_tokens", "min_tokens=-1 is out of range"),
    ("/v1/completions", {"prompt": "x", "priority": "high"}, 400, "priority", "priority='high' is invalid"),
    ("/v1/completions", {"prompt": "x", "stop": ["ok", ""]}, 400, "stop", "stop strings must be non-empty"),
    ("/v1/completions", {"prompt": "x", "stop": [f"s{i}" for i in range(17)]}, 400, "stop",
     "List should have at most 16 items"),
    ("/v1/completions", {"prompt": "x", "min_tokens": 20, "max_tokens": 10}, 400, "min_tokens", "min_tokens=20"),
    ("/v1/completions", {"prompt": "x", "seed": -5}, 400, "seed", "seed=-5 is out of range"),
    ("/v1/completions", b'{"prompt": "a\\ud800b"}', 400, None, "not valid JSON: unexpected end of hex escape"),
    ("/v1/completions", {}, 400, "prompt", "prompt is required"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options",
     "stream_options applies to streamed replies only"),
    ("/v1/completions", {"prompt": ["a", "b"], "max_tokens": 1}, 400, "prompt",
     "2 sequences (2 prompts x 1 samples), more than --max-queue=1 can ever hold"),
    ("/v1/completions", {"prompt": "a", "n": 2, "max_tokens": 1}, 400, "n", "more than --max-queue=1"),
    ("/v1/chat/completions", {"messages": CHAT, "stream": False, "stream_options": {}}, 400, "stream_options",
     "stream_options applies to streamed replies only"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", "at least 1 item"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages",
     "messages.0.role='robot'"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 0}, 400, "max_tokens", "must be >= 1"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, 400, "top_logprobs",
     "top_logprobs=2 needs logprobs=true"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": False, "top_logprobs": 0}, 400, "top_logprobs",
     "needs logprobs=true"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs",
     "top_logprobs=21 is out of range: must be in [0, 20]"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": 1}, 400, "logprobs", "logprobs=1 is invalid"),
    ("/v1/chat/completions", {"messages": CHAT, "presence_penalty": -2.1}, 400, "presence_penalty",
     "must be in [-2, 2]"),
    ("/v1/chat/completions", {"messages": CHAT, "logit_bias": {"1.5": 3}}, 400, "logit_bias",
     "key '1.5' is not a token id"),
    ("/v1/chat/completions", {"messages": CHAT, "best_of": 2}, 400, "best_of",
     "best_of is not a supported parameter"),
    ("/generate", {"prompt": "x", "top_k": -2}, 400, "top_k", "top_k=-2 is out of range: must be >= -1"),
    ("/generate", {"prompt": "x", "min_p": 2}, 400, "min_p", "min_p=2 is out of range: must be in [0, 1]"),
    ("/generate", {"prompt": "x", "logprobs": 30}, 400, "logprobs",
     "logprobs=30 is out of range: must be in [0, 20]"),
    ("/generate", {"prompt": "x", "repetition_penalty": -1}, 400, "repetition_penalty", "must be in (0, 2]"),
    ("/generate", {"prompt": "x", "logit_bias": {"99999": 1}}, 400, "logit_bias", "integers in [0, 49152)"),
    ("/generate", {"prompt": "x", "priority": 1.5}, 400, "priority", "priority=1.5 is invalid"),
    ("/generate", {"prompt": "x" * 5000}, 413, None, "Maximum request body size 4096 exceeded"),
]


@pytest.mark.parametrize("path,body,status,param,message", CASES, ids=[f"{c[0]}:{c[4][:40]}" for c in CASES])
def test_bad_input(server, path, body, status, param, message):
    data = body if isinstance(body, bytes) else None
    reply = requests.post(f"{server.url}{path}", data=data, json=None if data else body, headers=KEY, timeout=30)
    check_error(reply, status, param, message)


def test_a_batch_past_the_queue_is_400_every_time(server):
    # Once a 200 or a 503 by timing, after seconds of work thrown away.
    for _ in range(3):
        reply = requests.post(f"{server.url}/v1/completions", json={"prompt": ["hi"] * 500, "max_tokens": 1},
                              headers=KEY, timeout=30)
        check_error(reply, 400, "prompt", "500 sequences (500 prompts x 1 samples)")
    assert (server.async_engine.stats.num_running, server.async_engine.stats.num_waiting) == (0, 0)


@pytest.mark.parametrize("content_type, status", [
    ("text/plain", 415), ("application/x-www-form-urlencoded", 415), ("application/json; charset=utf-8", 200),
    ("application/vnd.api+json", 200)])
def test_the_body_must_be_declared_as_json(server, content_type, status):
    body = json.dumps({"prompt": "x", "max_tokens": 1})
    reply = requests.post(f"{server.url}/v1/completions", data=body, timeout=30,
                          headers={**KEY, "Content-Type": content_type})
    if status == 415:
        check_error(reply, 415, None, f"Content-Type {content_type!r} is not supported")
    else:
        assert reply.status_code == 200, reply.text


def test_api_key(server):
    body = {"prompt": "x", "max_tokens": 1}
    missing = requests.post(f"{server.url}/v1/completions", json=body, timeout=30)
    check_error(missing, 401, None, "missing API key")
    assert missing.headers["WWW-Authenticate"].startswith("Bearer")
    wrong = {"Authorization": "Bearer nope"}
    check_error(requests.post(f"{server.url}/v1/completions", json=body, headers=wrong, timeout=30), 401, None,
                "wrong API key")
    for scheme in ("Basic secret", "Bearersecret", "secret"):
        check_error(requests.post(f"{server.url}/v1/completions", json=body, headers={"Authorization": scheme},
                                  timeout=30), 401, None, "wrong API key")
    for scheme in ("bearer secret", "BEARER  secret"):   # HTTP auth schemes are case-insensitive
        assert requests.post(f"{server.url}/v1/completions", json=body, headers={"Authorization": scheme},
                             timeout=30).status_code == 200
    check_error(requests.get(f"{server.url}/v1/models", timeout=30), 401, None, "missing API key")
    for path in ("/tokenize", "/detokenize", "/invocations"):
        check_error(requests.post(f"{server.url}{path}", json={"prompt": "x"}, timeout=30), 401, None,
                    "missing API key")
    assert requests.get(f"{server.url}/health", timeout=30).status_code == 200
    assert requests.get(f"{server.url}/ping", timeout=30).status_code == 200
    assert requests.post(f"{server.url}/v1/completions", json=body, headers=KEY, timeout=30).status_code == 200


def test_unknown_path_and_wrong_method_are_json(server):
    check_error(requests.get(f"{server.url}/v2/nothing", headers=KEY, timeout=30), 404, None, "Not Found")
    check_error(requests.get(f"{server.url}/v1/completions", headers=KEY, timeout=30), 405, None,
                "Method Not Allowed")


def test_full_queue_is_503_with_retry_after(server, tiny_engine, monkeypatch):
    execute = tiny_engine.runner.launch
    monkeypatch.setattr(tiny_engine.runner, "launch", lambda output, *rest: (time.sleep(0.02), execute(output, *rest))[1])
    stats = server.async_engine

    async def scenario():
        async with aiohttp.ClientSession(headers=KEY) as session:
            async def stream(n):
                body = {"prompt": "x", "n": n, "max_tokens": 100, "ignore_eos": True, "stream": True}
                async with session.post(f"{server.url}/generate", json=body) as reply:
                    async for _ in reply.content:
                        pass
            busy = []
            for running in range(1, 9):  # one at a time: with max_queue=1, 2 sequences waiting is too many
                busy.append(asyncio.create_task(stream(1)))
                await until(lambda: stats.stats.num_running == running)
            busy.append(asyncio.create_task(stream(1)))
            await until(lambda: stats.stats.num_waiting == 1)
            async with session.post(f"{server.url}/generate", json={"prompt": "x"}) as reply:
                result = reply.status, reply.headers.get("Retry-After"), await reply.json()
            for task in busy:
                task.cancel()
            await asyncio.gather(*busy, return_exceptions=True)
        # The clients are gone: their requests are aborted, nothing runs or waits.
        await until(lambda: (stats.stats.num_running, stats.stats.num_waiting) == (0, 0))
        return result

    status, retry_after, body = asyncio.run(scenario())
    assert status == 503 and retry_after == "1"
    assert "1 sequences are waiting and this request adds 1 (--max-queue=1)" in body["error"]["message"]


async def until(condition, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_engine_step_failure_is_500_and_the_next_request_is_served(server, tiny_engine, monkeypatch):
    execute = tiny_engine.runner.launch
    failures = iter([True, True])

    def fail_twice(output, *rest):
        if next(failures, False):
            raise RuntimeError("device on fire")
        return execute(output, *rest)

    monkeypatch.setattr(tiny_engine.runner, "launch", fail_twice)
    body = {"prompt": "x", "max_tokens": 3}
    error = check_error(requests.post(f"{server.url}/v1/completions", json=body, headers=KEY, timeout=30), 500,
                        None, "device on fire")
    assert error["type"] == "server_error"
    events = requests.post(f"{server.url}/v1/completions", json={**body, "stream": True}, headers=KEY, timeout=30)
    assert events.status_code == 200
    *_, last, done = [line[len("data: "):] for line in events.text.splitlines() if line.startswith("data: ")]
    assert json.loads(last)["error"]["code"] == "engine_error" and "device on fire" in last
    assert done == "[DONE]"
    assert requests.post(f"{server.url}/v1/completions", json=body, headers=KEY, timeout=30).status_code == 200


def test_still_serving_after_all_that(server):
    reply = requests.post(f"{server.url}/v1/chat/completions", json={"messages": CHAT, "max_tokens": 4},
                          headers=KEY, timeout=30)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] >= 1
