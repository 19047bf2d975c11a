"""Several processes as one engine: the leader-follower protocol, and two `jaxserve.serve`
processes serving one mesh (2x4, 4x2 or 1x8: 4 host devices each; 1x2: one each)."""

import contextlib
import dataclasses
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest
import requests
import zmq

from jaxserve import distributed
from jaxserve.config import EngineConfig
from jaxserve.device_calls import Array, CopyPages, Hello, Outbox, ProtocolError, ResetPool, Step, Welcome
from jaxserve.distributed import EngineMismatchError, Keys, Leader, follow, load_keys
from jaxserve.engine.engine import LLMEngine
from jaxserve.lora_request import LoRARequest
from jaxserve.sampling_params import SamplingParams, StructuredOutputsParams
from conftest import write_adapter
from server_fixtures import TINY_ENGINE, cli_flags, free_port, tiny_engine, wait_until_healthy  # noqa: F401

# Few step shapes, each compiled by the first step that takes it (two processes on two cores).
SMALL_ENGINE = {**TINY_ENGINE, "max_num_seqs": 4, "max_num_batched_tokens": 32, "enforce_eager": True}

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
WORDS = {"regex": "[a-z]+( [a-z]+){0,6}"}   # a constraint: the masks go to the follower too
COPY = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19] * 3 + [10, 11]   # the served processes speculate, the
                                                                 # model drafting for itself


FINGERPRINT = {"config.max_num_seqs": "4", "weights": "3 arrays"}


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    directory = tmp_path_factory.mktemp("keys")
    assert distributed.main(["keys", str(directory), "--num-processes", "3"]) == 0
    return directory


def _follower(address, process_id: int, keys=None, fingerprint=FINGERPRINT) -> threading.Thread:
    """`follow` in a thread: its replays in `.replays`, its exit status in `.status`."""
    thread = threading.Thread(target=lambda: setattr(thread, "status", follow(
        thread.replays.append, address, process_id, 10, fingerprint, keys)))
    thread.replays, thread.status = [], None
    thread.start()
    return thread


def _wait(condition, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_followers_replay_every_call_in_order_and_stop(keys):
    address = ("127.0.0.1", free_port())
    leader = Leader(address, 2, lambda message: pytest.fail(message), load_keys(keys, 0, 3))
    followers = [_follower(address, i, load_keys(keys, i, 3)) for i in (1, 2)]
    leader.wait_for_followers(10, FINGERPRINT)
    calls = [CopyPages(Array.of(np.array([1, 2], np.int32)), Array.of(np.array([3, 4], np.int32))),
             Step(2, 0, (Array.of(np.arange(100_000, dtype=np.int32)),)), ResetPool()]
    for call in calls:
        leader.send(call)
    leader.close()
    for follower in followers:
        follower.join(10)
        assert follower.status == 0 and follower.replays == calls


def test_key_files_are_private_and_a_missing_one_is_named(keys, tmp_path):
    assert sorted(p.name for p in keys.iterdir())[:2] == ["process-0.key", "process-0.key_secret"]
    assert (keys / "process-1.key_secret").stat().st_mode & 0o077 == 0
    with pytest.raises(FileNotFoundError, match="process-1.key_secret is missing: make them with"):
        load_keys(tmp_path, 1, 2)
    with pytest.raises(ValueError, match="holds no secret key"):
        (tmp_path / "process-1.key_secret").write_bytes((keys / "process-1.key").read_bytes())
        load_keys(tmp_path, 1, 2)


def test_a_follower_whose_key_is_not_listed_is_never_admitted(keys, tmp_path):
    address = ("127.0.0.1", free_port())
    leader = Leader(address, 1, lambda message: pytest.fail(message), load_keys(keys, 0, 2))
    distributed.make_keys(tmp_path, 2)   # another deployment's keys
    stranger = load_keys(tmp_path, 1, 2)
    impostor = _follower(address, 1, Keys(stranger.public, stranger.secret, load_keys(keys, 0, 2).public, {}))
    with pytest.raises(TimeoutError, match="0 of 1 follower processes connected within 2 s"):
        leader.wait_for_followers(2, FINGERPRINT)
    impostor.join(10)
    assert impostor.status == 1 and impostor.replays == []
    mine = load_keys(keys, 1, 2)
    wrong_leader = _follower(address, 1, dataclasses.replace(mine, leader=stranger.public))
    wrong_leader.join(10)   # the leader cannot prove the key this follower expects
    assert wrong_leader.status == 1
    leader.close()


def test_strangers_on_the_port_learn_nothing_and_do_not_count(keys):
    address = ("127.0.0.1", free_port())
    lost = []
    leader = Leader(address, 1, lost.append, load_keys(keys, 0, 2))
    with socket.create_connection(address) as raw:   # not ZeroMQ at all
        raw.sendall(b"GET / HTTP/1.1\r\n\r\n" + bytes(range(256)))
        context = zmq.Context()
        plain = context.socket(zmq.DEALER)   # ZeroMQ without CURVE
        plain.connect(f"tcp://{address[0]}:{address[1]}")
        plain.send(Outbox().frame(Hello(1, FINGERPRINT)))
        follower = _follower(address, 1, load_keys(keys, 1, 2))
        leader.wait_for_followers(10, FINGERPRINT)
        assert plain.poll(500) == 0   # it was told nothing
        plain.close(linger=0)
        context.term()
    time.sleep(0.5)   # the strangers' disconnects reach the watcher
    assert lost == []
    leader.send(ResetPool())
    leader.close()
    follower.join(10)
    assert follower.status == 0 and follower.replays == [ResetPool()]


def test_a_follower_with_another_engine_is_refused_naming_the_field():
    address = ("127.0.0.1", free_port())
    leader = Leader(address, 1, print, None)
    follower = _follower(address, 1, fingerprint={**FINGERPRINT, "config.max_num_seqs": "8"})
    with pytest.raises(EngineMismatchError, match=r"process 1 built another engine .*config.max_num_seqs: 4 != 8"):
        leader.wait_for_followers(10, FINGERPRINT)
    follower.join(10)
    assert follower.status == 1 and follower.replays == []
    leader.close()


def test_the_fingerprint_tells_apart_checkpoints_of_other_values(tiny_models, tmp_path):
    """`sharding.place` does not compare the processes' weights, so the fingerprint holds a digest of
    a sample of their values: the same checkpoint loaded twice gives the same one, a checkpoint
    with one matrix scaled another."""
    import shutil

    from safetensors.numpy import load_file, save_file

    from jaxserve.checkpoint.loader import load_model
    from jaxserve.sharding import AXES

    directory, _ = tiny_models("llama")
    other = tmp_path / "other"
    shutil.copytree(directory, other)
    tensors = load_file(other / "model.safetensors")
    tensors["model.layers.1.mlp.down_proj.weight"] *= 1.5
    save_file(tensors, str(other / "model.safetensors"), metadata={"format": "pt"})
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), AXES)

    def weights(path):
        model = load_model(str(path), mesh=mesh)
        return distributed.fingerprint(EngineConfig(), model.params, [], (1,), model.values_digest)["weights"]

    assert weights(directory) == weights(directory) != weights(other)
    assert re.fullmatch(r"\d+ arrays, digest [0-9a-f]{16}, values [0-9a-f]{16}", weights(directory))


def test_a_follower_whose_leader_goes_away_exits_with_1():
    address = ("127.0.0.1", free_port())
    context = zmq.Context()
    fake = context.socket(zmq.ROUTER)   # a leader that welcomes the follower, then dies
    fake.bind(f"tcp://{address[0]}:{address[1]}")
    follower = _follower(address, 1)
    routing_id, _ = fake.recv_multipart()
    fake.send_multipart([routing_id, Outbox().frame(Welcome())])
    time.sleep(0.3)
    fake.close(linger=0)
    context.term()
    follower.join(10)
    assert follower.status == 1 and follower.replays == []


def test_a_follower_exits_on_a_frame_it_cannot_follow():
    address = ("127.0.0.1", free_port())
    context = zmq.Context()
    fake = context.socket(zmq.ROUTER)   # a leader whose second frame is not a message
    fake.bind(f"tcp://{address[0]}:{address[1]}")
    follower = _follower(address, 1)
    routing_id, _ = fake.recv_multipart()
    fake.send_multipart([routing_id, Outbox().frame(Welcome())])
    fake.send_multipart([routing_id, b"\x93\x01\x01\x81\xa4type\xa4exec"])
    follower.join(10)
    fake.close(linger=0)
    context.term()
    assert follower.status == 1 and follower.replays == []


def test_the_leader_hears_of_a_follower_that_goes_away():
    address = ("127.0.0.1", free_port())
    lost = []
    leader = Leader(address, 1, lost.append, None)
    context = zmq.Context()
    follower = context.socket(zmq.DEALER)
    follower.connect(f"tcp://{address[0]}:{address[1]}")
    follower.send(Outbox().frame(Hello(1, FINGERPRINT)))
    leader.wait_for_followers(10, FINGERPRINT)
    follower.close(linger=0)
    context.term()
    _wait(lambda: lost)
    assert lost == ["follower process 1 went away; no step can run without it"]
    leader.close()


def test_a_leader_without_its_followers_names_how_many_came():
    leader = Leader(("127.0.0.1", free_port()), 2, print, None)
    with pytest.raises(TimeoutError, match="0 of 2 follower processes connected within 1 s"):
        leader.wait_for_followers(1, FINGERPRINT)
    leader.close()


def test_a_replayed_step_must_have_the_runners_shapes(tiny_engine):
    runner = tiny_engine.runner
    with pytest.raises(ProtocolError, match=r"bucket Bucket\(num_decode=3, num_segments=0, decode_len=1\) is not one of"):
        runner.replay(Step(3, 0, ()))
    with pytest.raises(ProtocolError, match="where this engine builds"):
        runner.replay(Step(1, 0, (Array.of(np.zeros(7, np.int32)),)))
    with pytest.raises(ProtocolError, match="Hello is not a device call"):
        runner.replay(Hello(1, {}))


@pytest.mark.parametrize("bad, message", [
    (dict(num_processes=2), "coordinator_address=None must be HOST:PORT"),
    (dict(num_processes=2, process_id=2, coordinator_address="h:1"), r"process_id=2 is outside \[0, num_processes=2\)"),
    (dict(num_processes=3, coordinator_address="h:1", mesh="2x4", insecure_distributed=True),
     "do not split evenly over num_processes=3"),
    (dict(num_processes=2, coordinator_address="h:1", mesh="1x2"),
     "num_processes=2 needs distributed_key_dir .* or insecure_distributed"),
])
def test_bad_process_settings_are_named(bad, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**bad)


def _lora_and_draft_flags(directory, adapter) -> list[str]:
    return ["--enable-lora", "--max-lora-rank", "8", "--lora-modules", f"a0={adapter}",
            "--speculative-config", json.dumps({"model": str(directory), "num_speculative_tokens": 3,
                                                "disable_by_batch_size": 1})]


def _coordinator_port(avoid: int) -> int:
    """A free port whose next one, the leader's control channel (`distributed.control_address`),
    is free too, neither being `avoid`: two ports taken one after the other are often neighbours,
    and a run failed with the HTTP port on the control channel's."""
    while True:
        port = free_port()
        if avoid in (port, port + 1):
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port


@contextlib.contextmanager
def _two_processes(directory, flags: list[str], mesh: str, tmp_path, keys):
    """Two `jaxserve.serve` processes serving `directory` on one `mesh`, their output in
    tmp_path/process{0,1}.txt: yields (process 0's URL, the processes); both are gone after."""
    port = free_port()
    coordinator = f"127.0.0.1:{_coordinator_port(avoid=port)}"
    cache = jax.config.jax_compilation_cache_dir or str(tmp_path / "cache")
    logs = [open(tmp_path / f"process{i}.txt", "w") for i in range(2)]
    processes = [subprocess.Popen(
        [sys.executable, "-m", "jaxserve.serve", "--model", str(directory), *flags, "--mesh", mesh,
         "--coordinator-address", coordinator, "--num-processes", "2", "--distributed-key-dir", str(keys),
         "--process-id", str(i), "--port", str(port), "--compile-cache-dir", cache],
        stdout=logs[i], stderr=subprocess.STDOUT) for i in range(2)]
    try:
        yield f"http://127.0.0.1:{port}", processes
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
        for log in logs:
            log.close()


def _finished_tokens(engine: LLMEngine) -> dict[str, list[int]]:
    """Steps `engine` until it is idle: each finished request's first sample's tokens."""
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    return finished


def _greedy_tokens(url: str, prompt: str | list[int], max_tokens: int = 8, **extra) -> list[int]:
    reply = requests.post(f"{url}/generate", json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                                   "ignore_eos": True, **extra}, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()["outputs"][0]["token_ids"]


def _wait_for_line(tmp_path, text: str, timeout: float = 120) -> None:
    """Waits until both processes' output holds `text`."""
    deadline = time.monotonic() + timeout
    while not all(text in (tmp_path / f"process{i}.txt").read_text() for i in range(2)):
        assert time.monotonic() < deadline, f"{text!r} not in both processes' output after {timeout} s"
        time.sleep(0.5)


def _adapter_tokens(url: str, prompt: list[int]) -> list[int]:
    reply = requests.post(f"{url}/v1/completions", json={"model": "a0", "prompt": prompt, "max_tokens": 8,
                                                         "temperature": 0, "ignore_eos": True,
                                                         "return_token_ids": True}, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["token_ids"]


@pytest.mark.slow
def test_two_processes_serve_one_mesh_and_the_leader_exits_when_a_follower_dies(tiny_models, tmp_path, keys):
    directory, _ = tiny_models("llama")
    write_adapter(directory, tmp_path / "adapter")   # its slot's weights go to the follower too
    adapter = LoRARequest("a0", 1, str(tmp_path / "adapter"))
    engine = LLMEngine(EngineConfig(model=str(directory), **SMALL_ENGINE, enable_lora=True, max_lora_rank=8))
    ids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)) for p in PROMPTS]
    ids.append(engine.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                             structured_outputs=StructuredOutputsParams(**WORDS))))
    ids.append(engine.add_request(COPY, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)))
    ids.append(engine.add_request(COPY[:9], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                                  lora_request=adapter))
    # a penalised history: sent whole once, then as its changes (a token a step) to the step before
    ids.append(engine.add_request(COPY, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                                       repetition_penalty=1.5)))
    expected = _finished_tokens(engine)

    flags = [*cli_flags(SMALL_ENGINE), *_lora_and_draft_flags(directory, adapter.lora_path)]
    with _two_processes(directory, flags, "2x4", tmp_path, keys) as (url, processes):
        wait_until_healthy(url, processes[0], timeout=600)
        assert [_greedy_tokens(url, p) for p in PROMPTS] + [
            _greedy_tokens(url, PROMPTS[0], structured_outputs=WORDS),
            _greedy_tokens(url, COPY, max_tokens=30), _adapter_tokens(url, COPY[:9]),
            _greedy_tokens(url, COPY, max_tokens=30, repetition_penalty=1.5)] == [expected[i] for i in ids]
        # Two constrained samples (more than disable_by_batch_size, so steps are launched ahead): once
        # both processes have compiled the split step, such steps run to their logits on both and are
        # sampled with the masks sent after.
        constrained = expected[ids[len(PROMPTS)]]
        assert _greedy_tokens(url, PROMPTS[0], structured_outputs=WORDS, n=2) == constrained
        _wait_for_line(tmp_path, "compiled the split step for")
        assert _greedy_tokens(url, PROMPTS[0], structured_outputs=WORDS, n=2) == constrained
        metrics = requests.get(f"{url}/metrics", timeout=10).text
        accepted = re.search(r"^jaxserve:spec_decode_num_accepted_tokens_total\{.*\} (\S+)$", metrics, re.M)
        assert float(accepted[1]) > 0, "the draft model's calls and steps of 1 + K tokens went to the follower"

        # two samples: more than disable_by_batch_size, so one token a step, still running at the kill
        stream = requests.post(f"{url}/v1/completions", json={"prompt": "Hello", "max_tokens": 100, "n": 2,
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
    for i in range(2):   # each process froze its start-up heap (host_memory) once it was serving
        assert re.search(r"start-up heap frozen: [1-9]\d{5,} objects", (tmp_path / f"process{i}.txt").read_text())


def _native_gguf(tiny_models, path):
    """The tiny Llama as llama.cpp writes a quantized file: Q4_1 matrices, a Q8_0 embedding, and
    the embedded SmolLM2's tokenizer (the tiny models' vocabulary), so that a server can load it."""
    import gguf
    from gguf import GGMLQuantizationType as Q
    from safetensors.numpy import load_file

    from jaxserve.checkpoint.default_model import default_model_path
    from test_checkpoint_gguf import _FAMILY_NAMES, _close, _family_writer, _gguf_family_name, _to_gguf_rows

    directory, _ = tiny_models("llama")
    config = json.loads((directory / "config.json").read_text())
    writer = _family_writer(path, "llama", config)
    for key, field in gguf.GGUFReader(default_model_path()).fields.items():
        if key.startswith("tokenizer."):
            writer.add_key_value(key, field.contents(), field.types[0],
                                 field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None)
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    for name, w in load_file(directory / "model.safetensors").items():
        w = w.astype(np.float32)
        module = name.split(".")[-2]
        if module in heads:
            w = _to_gguf_rows(w, heads[module])
        qtype = Q.F32 if w.ndim == 1 else Q.Q8_0 if module == "embed_tokens" else Q.Q4_1
        writer.add_tensor(_gguf_family_name(name, _FAMILY_NAMES), gguf.quants.quantize(w, qtype), raw_dtype=qtype)
    return _close(writer, path)


@pytest.mark.slow
@pytest.mark.parametrize("variant, mesh, settings", [
    ("qwen3_moe", "1x8", {}), ("qwen2_moe", "2x4", {}), ("gemma2", "2x4", {}),
    ("phi3", "2x4", {"quantization": "int8", "kv_cache_dtype": "int8"}),
    ("llama", "4x2", {"quantization": "int4", "kv_cache_dtype": "fp8"}),
    ("mistral_window", "2x4", {"quantization": "fp8"}),
    ("llama.gguf", "1x2", {}), ("mixtral", "1x2", {"quantization": "int4"}), ("gemma3", "1x2", {})])
def test_two_processes_serve_other_models(variant, mesh, settings, tiny_models, tmp_path, keys):
    """Greedy tokens as one process computes them alone: Qwen3-MoE's 8 experts one per device of a
    1x8 mesh, four in each process (expert parallelism across processes); Qwen2-MoE's 4 experts
    over a model axis of 4 beside its sigmoid-gated shared expert; Gemma 2's windowed and
    soft-capped layers with a data slice in each process; Phi-3's LongRoPE with int8 weights and
    KV pages (their scales split and sent like the values); int4 weights (packed nibbles, group
    scales and minimums) with fp8 KV pages, four data slices and two model shards; Mistral's
    sliding window (12 tokens, shorter than prompt and reply) with fp8 weights; a GGUF file's own
    Q4_1 and Q8_0 blocks, each matrix split between the two processes; Mixtral's int4 experts, two
    in each process; Gemma 3's RoPE per layer type and q/k norms with each process holding half of
    every layer's heads."""
    if variant == "llama.gguf":
        directory = _native_gguf(tiny_models, tmp_path / variant)
    else:
        directory, _ = tiny_models(variant)
    engine = LLMEngine(EngineConfig(model=str(directory), **SMALL_ENGINE, **settings))
    formats = sorted({f.name for f in engine.model.formats.values()})
    if variant == "llama.gguf":
        assert formats == ["Q4_1", "Q8_0"]
    ids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)) for p in PROMPTS]
    expected = _finished_tokens(engine)
    with _two_processes(directory, cli_flags({**SMALL_ENGINE, **settings}), mesh, tmp_path, keys) as (url, processes):
        wait_until_healthy(url, processes[0], timeout=600)
        assert [_greedy_tokens(url, p) for p in PROMPTS] == [expected[i] for i in ids]
    for i in range(2):   # each process loaded the weights in the formats the one process had
        assert not formats or f"quantized weights ({', '.join(formats)})" in (tmp_path / f"process{i}.txt").read_text()
