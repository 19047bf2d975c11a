"""`python -m jaxserve.serve`: 503 while loading, one ready line, SIGTERM drains and exits 0."""

import json
import pathlib
import signal
import subprocess
import sys

import jax
import pytest
import requests

from jaxserve.serve import parse_args, warn_if_open
from server_fixtures import TINY_ENGINE, cli_flags, free_port, wait_until_healthy


def test_flags_map_onto_the_configs():
    engine, server = parse_args(["--max-num-seqs", "4", "--kv-cache-gb", "0.5", "--max-model-len", "256",
                                 "--port", "9000", "--api-key", "k", "--max-queue", "3"])
    assert (engine.max_num_seqs, engine.kv_cache_gb, engine.max_model_len, engine.model) == (4, 0.5, 256, None)
    assert (server.port, server.api_key, server.max_queue) == (9000, "k", 3)
    assert server.served_model_name == "SmolLM2-135M-Instruct.Q4_1"
    with pytest.raises(SystemExit):
        parse_args(["--page-size", "3"])  # EngineConfig refuses it: argparse reports it


@pytest.mark.parametrize("flags, mesh", [
    ([], "1x1"), (["--tensor-parallel-size", "2"], "1x2"), (["-tp", "4", "-dp", "2"], "2x4"),
    (["--data-parallel-size", "2"], "2x1"), (["--mesh", "2x4", "-tp", "4"], "2x4"),
    (["-pp", "1", "--distributed-executor-backend", "uni"], "1x1"),
])
def test_vllm_parallel_flags_make_the_mesh(flags, mesh):
    assert parse_args(flags)[0].mesh == mesh


@pytest.mark.parametrize("flags, message", [
    (["--mesh", "1x4", "-tp", "2"], "tensor_parallel_size=2 disagrees with mesh=1x4"),
    (["--mesh", "2x1", "--data-parallel-size", "4"], "data_parallel_size=4 disagrees with mesh=2x1"),
    (["--pipeline-parallel-size", "2"], "--tensor-parallel-size"),
    (["--distributed-executor-backend", "ray"], "--num-processes"),
    (["-tp", "0"], "tensor_parallel_size=0 must be >= 1"),
    (["--max-model-len", "4q"], "k/m/g"),
])
def test_refused_parallel_and_length_flags_say_what_to_do(flags, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(flags)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("text, length", [("4k", 4000), ("4K", 4096), ("32K", 32768), ("25.6k", 25600), ("512", 512)])
def test_max_model_len_takes_vllm_sizes(text, length):
    assert parse_args(["--max-model-len", text])[0].max_model_len == length


def test_speculative_config_takes_vllms_json_and_a_toml_table(tmp_path, capsys):
    engine, _ = parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    assert (engine.speculative_config.method, engine.speculative_config.num_speculative_tokens) == ("ngram", 3)
    config = tmp_path / "engine.toml"
    config.write_text('[speculative_config]\nmethod = "ngram"\nprompt_lookup_max = 5\n')
    assert parse_args(["--config", str(config)])[0].speculative_config.prompt_lookup_max == 5
    with pytest.raises(SystemExit):
        parse_args(["--speculative-config", '{"method": "medusa"}'])
    assert "method='medusa' is not one of" in capsys.readouterr().err


def test_served_model_name_takes_aliases():
    assert parse_args(["--served-model-name", "a", "b"])[1].served_model_name == ("a", "b")
    assert parse_args(["--served-model-name", "a"])[1].served_model_name == "a"


def test_an_open_host_without_a_key_is_warned_about(caplog):
    for flags, warned in ((["--host", "0.0.0.0"], True), (["--host", "0.0.0.0", "--api-key", "k"], False),
                          ([], False)):
        caplog.clear()
        warn_if_open(parse_args(flags)[1])
        assert ("no --api-key" in caplog.text) == warned


def test_serve_loads_serves_and_drains_on_sigterm(tiny_models, tmp_path):
    directory, _ = tiny_models("llama")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "jaxserve.serve", "--model", str(directory), *cli_flags(TINY_ENGINE),
               "--port", str(port), "--served-model-name", "tiny",
               "--compile-cache-dir", jax.config.jax_compilation_cache_dir or str(tmp_path / "cache")]
    stderr = open(tmp_path / "stderr.txt", "w")
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, text=True)
    try:
        assert 503 in wait_until_healthy(url, server), "/health said 503 while the engine loaded"
        ready = server.stdout.readline()
        assert ready.startswith("jaxserve ready in ") and f"{url}/v1 (model 'tiny')" in ready

        body = {"prompt": "x", "max_tokens": 120, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        with requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=60) as reply:
            events = reply.iter_lines()
            assert next(events).startswith(b"data: ")
            server.send_signal(signal.SIGTERM)
            payloads = [line[len(b"data: "):] for line in events if line.startswith(b"data: ")]
        assert payloads[-1] == b"[DONE]"
        assert json.loads(payloads[-2])["usage"]["completion_tokens"] == 120, "the running request finished"
        assert server.wait(timeout=60) == 0
    finally:
        if server.poll() is None:
            server.kill()
        stderr.close()


def test_config_file_sets_defaults_and_flags_override(tmp_path):
    config = tmp_path / "engine.toml"
    config.write_text('max_num_seqs = 3\nmesh = "1x2"\nport = 9100\n')
    engine, server = parse_args(["--config", str(config), "--port", "9200"])
    assert (engine.max_num_seqs, engine.mesh, server.port) == (3, "1x2", 9200)
    config.write_text("max_num_sequences = 3\n")
    with pytest.raises(SystemExit):
        parse_args(["--config", str(config)])


def test_shipped_configs_parse():
    from pathlib import Path

    for path in sorted((Path(__file__).parents[1] / "configs").glob("*.toml")):
        engine, _ = parse_args(["--config", str(path)])
        assert engine.mesh, path


@pytest.mark.slow
def test_serve_on_a_2x4_mesh_of_host_devices_answers(tmp_path, tiny_models):
    """Two data slices of four devices each (the tiny model's 2 KV heads replicated over 4)."""
    directory, _ = tiny_models("llama")
    log = serve_one_completion([sys.executable, "-m", "jaxserve.serve", "--model", str(directory),
                                *cli_flags(TINY_ENGINE), "--mesh", "2x4"], tmp_path)
    assert "running on 8 host devices" in log


def serve_one_completion(command: list[str], tmp_path, timeout: float = 300) -> str:
    """Starts `command` (a server) on a free port, asks it for one 5-token completion, stops it
    with SIGTERM (it must exit 0); returns its log."""
    port = free_port()
    command = [*command, "--port", str(port),
               "--compile-cache-dir", jax.config.jax_compilation_cache_dir or str(tmp_path / "cache")]
    stderr = open(tmp_path / "stderr.txt", "w")
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, text=True)
    try:
        wait_until_healthy(f"http://127.0.0.1:{port}", server, timeout=timeout)
        reply = requests.post(f"http://127.0.0.1:{port}/v1/completions",
                              json={"prompt": "Hello", "max_tokens": 5, "ignore_eos": True}, timeout=60)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 5
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) == 0
        return (tmp_path / "stderr.txt").read_text()
    finally:
        if server.poll() is None:
            server.kill()
        stderr.close()


JAXSERVE = str(pathlib.Path(sys.executable).parent / "jaxserve")   # the console script the package installs


@pytest.mark.parametrize("command, says", [
    ([], "serve      the OpenAI-compatible server"), (["serve"], "usage: jaxserve serve [-h]"),
    (["bench", "serve"], "usage: jaxserve bench serve"), (["bench", "offline"], "usage: jaxserve bench offline"),
    (["generate"], "usage: jaxserve generate"), (["convert"], "usage: jaxserve convert"),
    (["keys"], "usage: jaxserve keys"),
])
def test_the_console_command_has_help_for_each_command(command, says):
    done = subprocess.run([JAXSERVE, *command, "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and says in done.stdout, done.stderr


def test_the_console_command_refuses_an_unknown_command():
    done = subprocess.run([JAXSERVE, "srve"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "unknown command 'srve'" in done.stderr and "'serve'" in done.stderr


def test_serve_takes_the_model_as_vllm_serve_does():
    assert parse_args(["some/dir"])[0].model == "some/dir"
    assert parse_args(["some/dir", "--model", "some/dir"])[0].model == "some/dir"
    with pytest.raises(SystemExit):
        parse_args(["some/dir", "--model", "other/dir"])


@pytest.mark.slow
def test_the_guides_vllm_command_line_serves(tmp_path, smollm2_tokenizer):
    """The guide's vLLM line with only the command and the model changed: a 1x2 mesh, the pool sized
    from the memory budget. 0.5 is the guide's share; where the host already uses more than 40% of
    its memory (other test processes), the share is what is in use plus 10%."""
    from conftest import write_tiny_model
    from jaxserve.engine.memory_budget import host_memory

    directory = tmp_path / "model"
    write_tiny_model(directory, "llama", smollm2_tokenizer, max_position_embeddings=4096)
    total, in_use = host_memory()
    utilization = max(0.5, round(in_use / total + 0.1, 2))
    log = serve_one_completion([JAXSERVE, "serve", str(directory), "--tensor-parallel-size", "2", "--dtype",
                                "float32", "--max-model-len", "4096", "--gpu-memory-utilization", str(utilization),
                                "--host", "127.0.0.1", "--enable-prefix-caching"], tmp_path, timeout=600)
    assert "mesh 1x2 on the CPU: running on 2 host devices" in log
    assert f"from gpu_memory_utilization={utilization:g} ({utilization:g} x " in log
    assert "x 2 devices = " in log
