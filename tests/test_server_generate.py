"""`POST /generate` through a raw aiohttp client, and clients that go away mid-request."""

import asyncio
import json
import time

import aiohttp
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from server_fixtures import pool_is_full, serving, tiny_engine  # noqa: F401 - fixture


@pytest.fixture(scope="module")
def server(tiny_engine):
    with serving(tiny_engine, max_n=4) as server:
        yield server


def post(server, body):
    """(status, JSON body or list of SSE payloads) of a POST /generate."""
    async def main():
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{server.url}/generate", json=body) as reply:
                if reply.content_type == "text/event-stream":
                    return reply.status, [line[len(b"data: "):].decode().rstrip() async for line in reply.content
                                          if line.startswith(b"data: ")]
                return reply.status, await reply.json()
    return asyncio.run(main())


def test_non_streamed(server, tiny_engine):
    status, body = post(server, {"prompt": "The sea", "max_tokens": 6, "temperature": 0})
    assert status == 200
    [output] = body["outputs"]
    assert output["index"] == 0 and output["finish_reason"] == "length" and len(output["token_ids"]) == 6
    assert output["output_text"] == tiny_engine.tokenizer.decode(output["token_ids"], skip_special_tokens=True)
    prompt_len = len(tiny_engine.tokenizer.encode("The sea", add_special_tokens=False))
    assert {k: body["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")} == {
        "prompt_tokens": prompt_len, "completion_tokens": 6, "total_tokens": prompt_len + 6}


def test_streamed_text_equals_non_streamed_text_for_the_same_seed(server):
    body = {"prompt": "Tell me", "n": 2, "max_tokens": 12, "temperature": 1.0, "top_p": 0.9, "top_k": 50,
            "seed": 1234}
    _, whole = post(server, body)
    status, events = post(server, {**body, "stream": True})
    assert status == 200 and events[-1] == "[DONE]"
    texts, reasons = {0: "", 1: ""}, {}
    for event in events[:-1]:
        for output in json.loads(event)["outputs"]:
            texts[output["index"]] += output["output_text"]
            reasons[output["index"]] = output["finish_reason"]
    assert texts == {o["index"]: o["output_text"] for o in whole["outputs"]}
    assert reasons == {0: "length", 1: "length"}
    assert len(events) > 3, "the text came in pieces"


def test_token_id_prompt_and_stop_token_ids(server):
    _, free = post(server, {"prompt": [100, 200, 300], "max_tokens": 8, "temperature": 0})
    ids = free["outputs"][0]["token_ids"]
    _, stopped = post(server, {"prompt": [100, 200, 300], "max_tokens": 8, "temperature": 0,
                               "stop_token_ids": [ids[3]]})
    assert stopped["outputs"][0]["token_ids"] == ids[:ids.index(ids[3]) + 1]
    assert stopped["outputs"][0]["finish_reason"] == "stop"


def _metric(server, name, labels) -> float:
    text = requests.get(f"{server.url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and labels.items() <= sample.labels.items():
                return sample.value
    return 0.0


@pytest.mark.parametrize("path,body", [
    ("/generate", {"prompt": "Go on", "max_tokens": 100, "ignore_eos": True, "stream": True}),
    ("/v1/completions", {"prompt": "Go on", "max_tokens": 100, "ignore_eos": True, "stream": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Go on"}], "max_tokens": 90,
                              "ignore_eos": True, "stream": True}),
    ("/generate", {"prompt": "Go on", "max_tokens": 100, "ignore_eos": True}),
])
def test_client_that_disconnects_frees_its_pages_within_a_second(server, tiny_engine, monkeypatch, path, body):
    execute = tiny_engine.runner.launch
    monkeypatch.setattr(tiny_engine.runner, "launch", lambda output, *rest: (time.sleep(0.05), execute(output, *rest))[1])
    aborted = _metric(server, "jaxserve:request_success_total", {"finished_reason": "abort"})

    async def drop_mid_request():
        async with aiohttp.ClientSession() as session:
            async def request():
                async with session.post(f"{server.url}{path}", json=body) as reply:
                    async for _ in reply.content:
                        pass
            task = asyncio.create_task(request())
            await asyncio.sleep(0.5)  # ~10 of the 100 steps
            busy = not pool_is_full(tiny_engine)
            task.cancel()  # drops the connection
            return busy

    assert asyncio.run(_drop_and_time(server, drop_mid_request, tiny_engine)) < 1.0
    assert _metric(server, "jaxserve:request_success_total", {"finished_reason": "abort"}) == aborted + 1


async def _drop_and_time(server, drop, engine) -> float:
    """Seconds from the client dropping its request to the pool being full again."""
    was_busy = await drop()
    assert was_busy, "the request was still running when the client went away"
    dropped = time.monotonic()
    while not pool_is_full(engine):
        if time.monotonic() - dropped > 5:
            break
        await asyncio.sleep(0.01)
    return time.monotonic() - dropped
