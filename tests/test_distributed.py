"""Several processes as one engine: the leader-follower protocol, and two `jaxserve.serve`
processes with 4 host devices each serving one 2x4 mesh."""

import signal
import socket
import struct
import subprocess
import sys
import threading
import time

import jax
import pytest
import requests

from jaxserve.config import EngineConfig
from jaxserve.distributed import Leader, follow
from jaxserve.engine.engine import LLMEngine
from jaxserve.sampling_params import SamplingParams, StructuredOutputsParams
from server_fixtures import TINY_ENGINE, cli_flags, free_port, wait_until_healthy

# Few step shapes: two processes compile them all, on two cores.
SMALL_ENGINE = {**TINY_ENGINE, "max_num_seqs": 4, "max_num_batched_tokens": 32}

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
WORDS = {"regex": "[a-z]+( [a-z]+){0,6}"}   # a constraint: the masks go to the follower too


def _start_followers(address, count: int, replays: list[list]) -> list[threading.Thread]:
    threads = []
    for i in range(count):
        replays.append([])
        result = {}
        thread = threading.Thread(target=lambda i=i, result=result: result.update(
            status=follow(replays[i].append, address, i + 1, timeout=10)))
        thread.result = result
        thread.start()
        threads.append(thread)
    return threads


def test_followers_replay_every_message_in_order_and_stop():
    address = ("127.0.0.1", free_port())
    leader = Leader(address, 2, on_lost=lambda message: pytest.fail(message))
    replays: list[list] = []
    followers = _start_followers(address, 2, replays)
    leader.wait_for_followers(timeout=10)
    messages = [("copy", [1, 2], [3, 4]), ("step", {"tokens": list(range(100_000))}), ("reset",)]
    for message in messages:
        leader.send(message)
    leader.close()
    for thread in followers:
        thread.join(timeout=10)
        assert thread.result["status"] == 0
    assert replays == [messages, messages]


def test_a_follower_whose_leader_goes_away_exits_with_1():
    with socket.create_server(("127.0.0.1", 0)) as server:
        replays: list[list] = []
        (follower,) = _start_followers(server.getsockname(), 1, replays)
        connection, _ = server.accept()
        connection.recv(8)
        connection.close()
        follower.join(timeout=10)
    assert follower.result["status"] == 1 and replays == [[]]


def test_the_leader_hears_of_a_follower_that_goes_away():
    address = ("127.0.0.1", free_port())
    lost = []
    leader = Leader(address, 1, on_lost=lost.append)
    with socket.create_connection(address) as follower:
        follower.sendall(struct.pack("!Q", 7))
        leader.wait_for_followers(timeout=10)
    deadline = time.monotonic() + 10
    while not lost and time.monotonic() < deadline:
        time.sleep(0.05)
    assert lost == ["follower process 7 went away; no step can run without it"]


def test_a_leader_without_its_followers_names_how_many_came():
    leader = Leader(("127.0.0.1", free_port()), 2, on_lost=print)
    with pytest.raises(TimeoutError, match="0 of 2 follower processes connected within 1 s"):
        leader.wait_for_followers(timeout=1)


@pytest.mark.parametrize("bad, message", [
    (dict(num_processes=2), "coordinator_address=None must be HOST:PORT"),
    (dict(num_processes=2, process_id=2, coordinator_address="h:1"), r"process_id=2 is outside \[0, num_processes=2\)"),
    (dict(num_processes=3, coordinator_address="h:1", mesh="2x4"), "do not split evenly over num_processes=3"),
])
def test_bad_process_settings_are_named(bad, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**bad)


def _serve_command(directory, port: int, coordinator: str, process_id: int, cache: str) -> list[str]:
    return [sys.executable, "-m", "jaxserve.serve", "--model", str(directory), *cli_flags(SMALL_ENGINE),
            "--mesh", "2x4", "--coordinator-address", coordinator, "--num-processes", "2",
            "--process-id", str(process_id), "--port", str(port), "--compile-cache-dir", cache]


def _greedy_tokens(url: str, prompt: str, **extra) -> list[int]:
    reply = requests.post(f"{url}/generate", json={"prompt": prompt, "max_tokens": 8, "temperature": 0,
                                                   "ignore_eos": True, **extra}, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()["outputs"][0]["token_ids"]


@pytest.mark.slow
def test_two_processes_serve_one_mesh_and_the_leader_exits_when_a_follower_dies(tiny_models, tmp_path):
    directory, _ = tiny_models("llama")
    engine = LLMEngine(EngineConfig(model=str(directory), **SMALL_ENGINE))
    ids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)) for p in PROMPTS]
    ids.append(engine.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                             structured_outputs=StructuredOutputsParams(**WORDS))))
    expected = {}
    while engine.has_unfinished_requests():
        expected.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})

    port, coordinator = free_port(), f"127.0.0.1:{free_port()}"
    cache = jax.config.jax_compilation_cache_dir or str(tmp_path / "cache")
    logs = [open(tmp_path / f"process{i}.txt", "w") for i in range(2)]
    processes = [subprocess.Popen(_serve_command(directory, port, coordinator, i, cache), stdout=logs[i],
                                  stderr=subprocess.STDOUT) for i in range(2)]
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(url, processes[0], timeout=600)
        assert [_greedy_tokens(url, p) for p in PROMPTS] + [
            _greedy_tokens(url, PROMPTS[0], structured_outputs=WORDS)] == [expected[i] for i in ids]

        stream = requests.post(f"{url}/v1/completions", json={"prompt": "Hello", "max_tokens": 100,
                                                              "ignore_eos": True, "stream": True},
                               stream=True, timeout=60)
        lines = stream.iter_lines()
        assert next(line for line in lines if line).startswith(b"data: {")
        processes[1].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        rest = b"\n".join(lines)
        assert b'"error"' in rest and b'"finish_reason":"length"' not in rest.replace(b" ", b"")
        assert processes[0].wait(timeout=30) == 1
        assert time.monotonic() - killed < 30
        assert "follower process 1 went away" in (tmp_path / "process0.txt").read_text()
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
        for log in logs:
            log.close()
