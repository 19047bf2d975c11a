"""Sizing the KV pool from the devices' memory (`--gpu-memory-utilization`)."""

import logging

import jax
import pytest

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.engine import kv_pages as kv_pool
from jaxserve.engine import memory_budget
from jaxserve.engine.engine import LLMEngine
from jaxserve.engine.memory_budget import GIB, HOST_RESERVE, DeviceMemory, device_memory, host_memory, pool_budget


class FakeDevice:
    def __init__(self, name, stats):
        self.name, self.stats = name, stats

    def memory_stats(self):
        return self.stats

    def __str__(self):
        return self.name


def test_a_tpu_like_device_gives_its_share_less_weights_and_the_step():
    tpu = FakeDevice("TPU_0", {"bytes_limit": 16 * GIB, "bytes_in_use": 3 * GIB, "peak_bytes_in_use": 3 * GIB})
    budget = pool_budget(device_memory([tpu]), 0.9, step_bytes=GIB // 2)
    assert budget.per_device == int(0.9 * 16 * GIB) - 3 * GIB - GIB // 2
    assert budget.total == budget.per_device
    assert "0.9 x 16.00 GiB (TPU_0) - 3.00 GiB in use - 0.500 GiB for the largest step" in budget.describe()


def test_on_a_mesh_the_device_with_least_room_decides():
    """A GPU-like mesh whose devices differ (another process holds memory on one)."""
    gpus = [FakeDevice(f"cuda:{i}", {"bytes_limit": 60 * GIB, "bytes_in_use": used * GIB, "bytes_reservable_limit": 0})
            for i, used in enumerate((10, 25, 10, 12))]
    budget = pool_budget(device_memory(gpus), 0.5, step_bytes=GIB)
    assert budget.device.name == "cuda:1"
    assert budget.per_device == 30 * GIB - 25 * GIB - GIB
    assert budget.total == 4 * budget.per_device


def test_nothing_left_fails_with_the_numbers_and_the_flag():
    tpu = FakeDevice("TPU_0", {"bytes_limit": 16 * GIB, "bytes_in_use": 15 * GIB})
    with pytest.raises(ValueError, match=r"no memory is left.*0.5 x 16.00 GiB.*15.00 GiB in use.*"
                                         r"--gpu-memory-utilization \(now 0.5"):
        pool_budget(device_memory([tpu]), 0.5, step_bytes=0)


def test_cpu_devices_share_the_host_memory():
    total, in_use = host_memory()
    assert 0 < in_use < total
    memory = device_memory(jax.devices()[:1] * 2)   # two devices reporting no stats
    assert [m.limit for m in memory] == [total // 2] * 2
    assert abs(memory[0].in_use - in_use // 2) < GIB / 4 and "host memory / 2 devices" in memory[0].name
    assert [m.reserve for m in memory] == [HOST_RESERVE // 2] * 2
    budget = pool_budget(memory, 0.9, step_bytes=0)
    assert budget.per_device == int(0.9 * memory[0].limit) - memory[0].in_use - HOST_RESERVE // 2
    assert "GiB kept for compiled programs" in budget.describe()


def test_flags_that_size_the_pool_win_over_the_budget():
    model = ModelConfig("LlamaForCausalLM", vocab_size=32, hidden_size=64, intermediate_size=128, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=1e4,
                        max_position_embeddings=128)
    page = kv_pool.bytes_per_page(model, 16, "float32")
    budget = pool_budget([DeviceMemory("d", 100 * page, 0)], 1.0, 0)
    for config, pages in ((EngineConfig(num_pages=40, kv_cache_gb=1.0), 40),
                          (EngineConfig(kv_cache_memory_bytes=30 * page, kv_cache_gb=1.0), 30),
                          (EngineConfig(kv_cache_gb=20 * page / GIB), 20),
                          (EngineConfig(gpu_memory_utilization=1.0), 100)):
        assert kv_pool.num_pages(config, model, "float32", 128, 1, budget)[0] == pages
    assert not kv_pool.sized_by_budget(EngineConfig(), "cpu")
    assert kv_pool.sized_by_budget(EngineConfig(), "tpu")
    assert kv_pool.sized_by_budget(EngineConfig(gpu_memory_utilization=0.5), "cpu")
    assert not kv_pool.sized_by_budget(EngineConfig(kv_cache_gb=2.0), "gpu")
    with pytest.raises(ValueError, match=r"raise --gpu-memory-utilization or lower --max-model-len"):
        kv_pool.num_pages(EngineConfig(gpu_memory_utilization=1.0), model, "float32", 16 * 100, 1, budget)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=1.5 must be in \(0, 1\]"):
        EngineConfig(gpu_memory_utilization=1.5)


def test_an_engine_on_cpu_sizes_its_pool_from_host_memory(tiny_models, caplog, monkeypatch):
    """A small share above what is in use now: the pool gets the rest, less the largest step. The
    engine reads the host's memory as the test read it: other processes' use moves between two
    readings (a CI run once saw 0.6 MB more free memory in the engine than in the test)."""
    directory, _ = tiny_models("llama")
    total, in_use = host_memory()
    monkeypatch.setattr(memory_budget, "host_memory", lambda: (total, in_use))
    utilization = round((in_use + HOST_RESERVE + GIB / 2) / total, 3)
    with caplog.at_level(logging.INFO, logger="jaxserve.engine.engine"):
        engine = LLMEngine(EngineConfig(model=str(directory), gpu_memory_utilization=utilization, max_num_seqs=1,
                                        max_num_batched_tokens=16, max_model_len=128))
    pool_bytes = engine.allocators[0].num_pages * kv_pool.bytes_per_page(engine.model.config, 16, "float32")
    share = utilization * total - in_use - HOST_RESERVE   # about half a GiB
    assert share - GIB / 8 < pool_bytes <= share
    assert f"from gpu_memory_utilization={utilization:g} ({utilization:g} x " in caplog.text
    assert "for the largest step" in caplog.text
