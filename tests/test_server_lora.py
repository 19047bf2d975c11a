"""LoRA adapters behind the server: a request's `model` picks the adapter, /v1/models lists them
under their base, vLLM's load/unload endpoints, 404 for names not served, the LoRA metrics, and
the flags that set it up."""

import json

import pytest
import requests

from jaxserve.config import EngineConfig
from jaxserve.engine.engine import LLMEngine
from jaxserve.lora_request import LoRARequest
from jaxserve.sampling_params import SamplingParams
from jaxserve.serve import parse_args
from jaxserve.server.config import LoraModule, ServerConfig, lora_module

from conftest import write_adapter
from server_fixtures import TINY_ENGINE, serving

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13]


@pytest.fixture(scope="module")
def adapter_dirs(tiny_models, tmp_path_factory):
    base_dir, _ = tiny_models("llama")
    root = tmp_path_factory.mktemp("server_adapters")
    write_adapter(base_dir, root / "a0", r=4, alpha=8, seed=20)
    write_adapter(base_dir, root / "a1", ["q_proj", "v_proj", "down_proj"], r=8, alpha=8, seed=21)
    return [str(root / "a0"), str(root / "a1")]


@pytest.fixture(scope="module")
def engine(tiny_models):
    return LLMEngine(EngineConfig(model=str(tiny_models("llama")[0]), **TINY_ENGINE, enable_lora=True, max_loras=2,
                                  max_lora_rank=8))


def offline(engine, lora: LoRARequest | None, max_tokens: int = 8) -> list[int]:
    request_id = engine.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                                    lora_request=lora)
    while True:
        for output in engine.step():
            if output.request_id == request_id and output.finished:
                return output.outputs[0].token_ids


def complete(server, model: str, max_tokens: int = 8) -> requests.Response:
    return requests.post(f"{server.url}/v1/completions", timeout=60, json={
        "model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True})


def test_requests_name_adapters_and_runtime_updates_add_and_remove_them(engine, adapter_dirs):
    served = {}   # model -> the tokens the server gave, compared with the engine's offline ones at the end
    modules = (f"a0={adapter_dirs[0]}", json.dumps({"name": "a1", "path": adapter_dirs[1],
                                                    "base_model_name": "test-model"}))
    with serving(engine, lora_modules=modules, enable_lora_runtime_updates=True) as server:
        models = {m["id"]: m for m in requests.get(f"{server.url}/v1/models", timeout=10).json()["data"]}
        assert list(models) == ["test-model", "a0", "a1"]
        assert models["a0"]["parent"] == "test-model" and models["a0"]["root"] == adapter_dirs[0]
        assert models["test-model"]["parent"] is None
        for name in ("test-model", "a0"):
            reply = complete(server, name)
            assert reply.status_code == 200, reply.text
            assert reply.json()["model"] == name
            served[name] = reply.json()["choices"][0]["token_ids"]

        unknown = complete(server, "nope")
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
        assert "'nope'" in unknown.json()["error"]["message"]

        load = lambda name, path: requests.post(f"{server.url}/v1/load_lora_adapter", timeout=60,  # noqa: E731
                                                json={"lora_name": name, "lora_path": path})
        unload = lambda name: requests.post(f"{server.url}/v1/unload_lora_adapter", timeout=60,  # noqa: E731
                                            json={"lora_name": name})
        bad = load("broken", adapter_dirs[0] + "-missing")
        assert bad.status_code == 400 and "broken" in bad.text and "-missing" in bad.text
        reply = load("late", adapter_dirs[1])
        assert reply.status_code == 200 and "late" in reply.text, reply.text
        assert load("late", adapter_dirs[1]).status_code == 400   # already served
        assert load("test-model", adapter_dirs[1]).status_code == 400
        served["late"] = complete(server, "late").json()["choices"][0]["token_ids"]
        assert requests.get(f"{server.url}/v1/models/late", timeout=10).json()["parent"] == "test-model"

        metrics = requests.get(f"{server.url}/metrics", timeout=10).text
        assert 'jaxserve:lora_requests_total{lora_name="a0",model_name="test-model"} 1.0' in metrics
        assert 'jaxserve:lora_requests_total{lora_name="late",model_name="test-model"} 1.0' in metrics
        info = [line for line in metrics.splitlines() if line.startswith("jaxserve:lora_requests_info{")]
        assert len(info) == 1 and 'max_lora="2"' in info[0] and 'running_lora_adapters=""' in info[0]

        assert unload("late").status_code == 200
        assert complete(server, "late").status_code == 404
        assert unload("late").status_code == 404
        assert "late" not in [m["id"] for m in requests.get(f"{server.url}/v1/models", timeout=10).json()["data"]]
        assert complete(server, "a0").json()["choices"][0]["token_ids"] == served["a0"]
    assert engine.stats().kv_cache_usage == 0
    expected = {name: offline(engine, lora) for name, lora in [
        ("test-model", None), ("a0", LoRARequest("a0", 101, adapter_dirs[0])),
        ("late", LoRARequest("late", 102, adapter_dirs[1]))]}
    assert served == expected
    assert len({tuple(t) for t in expected.values()}) == 3, "each adapter changes the tokens"


def test_without_runtime_updates_the_endpoints_are_not_served(engine, adapter_dirs):
    with serving(engine, lora_modules=(f"a0={adapter_dirs[0]}",)) as server:
        reply = requests.post(f"{server.url}/v1/load_lora_adapter", timeout=10,
                              json={"lora_name": "x", "lora_path": adapter_dirs[1]})
        assert reply.status_code == 404
        assert complete(server, "a0").status_code == 200


def test_an_adapter_in_flight_is_not_unloaded(engine, adapter_dirs):
    lora = LoRARequest("busy", 50, adapter_dirs[0])
    engine.add_request(PROMPT, SamplingParams(max_tokens=4), request_id="busy-1", lora_request=lora)
    with pytest.raises(ValueError, match="'busy' has 1 sequence"):
        engine.remove_lora(50)
    while engine.has_unfinished_requests():
        engine.step()
    engine.remove_lora(50)
    assert 50 not in engine.lora_adapters.known


def test_lora_flags_map_onto_the_configs(adapter_dirs):
    engine_config, server = parse_args(["--enable-lora", "--max-loras", "3", "--max-lora-rank", "32",
                                        "--max-cpu-loras", "5", "--lora-modules", f"a0={adapter_dirs[0]}",
                                        '{"name": "a1", "path": "/x", "base_model_name": "base"}',
                                        "--enable-lora-runtime-updates"])
    assert (engine_config.enable_lora, engine_config.max_loras, engine_config.max_lora_rank,
            engine_config.max_cpu_loras) == (True, 3, 32, 5)
    assert [lora_module(m) for m in server.lora_modules] == [LoraModule("a0", adapter_dirs[0]),
                                                            LoraModule("a1", "/x", "base")]
    assert server.enable_lora_runtime_updates
    with pytest.raises(SystemExit):
        parse_args(["--lora-modules", "a=/x"])   # without --enable-lora
    for bad in ("noequals", "=/path", '{"name": "a"}', '{"name": "a", "path": "/p", "extra": 1}'):
        with pytest.raises(ValueError, match="lora_modules entry"):
            ServerConfig(lora_modules=(bad,))
    with pytest.raises(ValueError, match="names an adapter twice"):
        ServerConfig(lora_modules=("a=/x", "a=/y"))
    with pytest.raises(ValueError, match="max_cpu_loras=1 must be >= max_loras=2"):
        EngineConfig(enable_lora=True, max_loras=2, max_cpu_loras=1)
