"""Shutting down: running requests get --drain-timeout-s to finish; what is cut short then ends
in a way each endpoint's clients understand."""

import threading
import time

import openai
import requests

from server_fixtures import openai_client, pool_is_full, serving, tiny_engine  # noqa: F401 - fixture

LONG = {"max_tokens": 90, "temperature": 0}


def test_requests_cut_by_the_drain_timeout_end_as_errors_on_the_openai_endpoints(tiny_engine, monkeypatch):
    execute = tiny_engine.runner.launch
    monkeypatch.setattr(tiny_engine.runner, "launch", lambda output, *rest: (time.sleep(0.1), execute(output, *rest))[1])
    results: dict[str, object] = {}

    def streamed_chat(server):
        try:
            stream = openai_client(server).chat.completions.create(
                model="test-model", messages=[{"role": "user", "content": "hi"}], stream=True,
                extra_body={"ignore_eos": True}, **LONG)
            results["chat"] = [chunk for chunk in stream]
        except Exception as error:   # openai.APIError: how the client surfaces a stream's error event
            results["chat"] = error

    def completion(server):
        results["completion"] = requests.post(f"{server.url}/v1/completions", timeout=60,
                                              json={"prompt": "x", "ignore_eos": True, **LONG})

    def generate(server):
        reply = requests.post(f"{server.url}/generate", json={"prompt": "y", "ignore_eos": True, **LONG},
                              timeout=60)
        results["generate"] = reply

    with serving(tiny_engine, drain_timeout_s=0.3) as server:
        threads = [threading.Thread(target=f, args=(server,)) for f in (streamed_chat, completion, generate)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 30
        while server.async_engine.stats.num_running < 3:
            assert time.monotonic() < deadline, f"the requests never ran: {results}"
            time.sleep(0.01)
    for thread in threads:   # leaving `serving` drained for 0.3 s, then aborted the rest
        thread.join(30)

    assert isinstance(results["chat"], openai.APIError), results["chat"]
    assert "shutting down" in str(results["chat"])
    reply = results["completion"]
    assert reply.status_code == 503 and reply.json()["error"]["code"] == "server_shutting_down", reply.text
    assert "--drain-timeout-s" in reply.json()["error"]["message"]
    # vLLM's own endpoint keeps vLLM's "abort"
    assert results["generate"].status_code == 200
    assert results["generate"].json()["outputs"][0]["finish_reason"] == "abort"
    assert pool_is_full(tiny_engine) and tiny_engine.stats().num_running == 0
