"""Meshes: the partition rule table, head rearranging, and the same logits and tokens on every mesh.

Multi-device runs happen in a fresh process with 8 host devices (tests/mesh_worker.py): the device
count is fixed when JAX starts, and the rest of the suite runs on one device.
"""

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxserve.checkpoint.loader import expected_params
from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.models.llama import abstract_model
from jaxserve.config import parse_mesh
from jaxserve.sharding import PARTITION_RULES, head_layout, pad_heads, spec_for

from conftest import write_adapter, write_tiny_model

WORKER = Path(__file__).with_name("mesh_worker.py")


def run_worker(model: str, out: Path, meshes: str, *flags: str) -> dict[str, np.ndarray]:
    """The worker's results; it compiles through the session's compilation cache (conftest), so an
    engine that repeats another's programs loads them. Its engines compile each step shape when a
    step first takes it (enforce_eager)."""
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": jax.config.jax_compilation_cache_dir,
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    subprocess.run([sys.executable, str(WORKER), model, str(out), meshes, *flags], check=True, timeout=900, env=env)
    return dict(np.load(out))


@pytest.mark.parametrize("text, shape", [("1x1", (1, 1)), ("2x4", (2, 4)), (" 1x8 ", (1, 8))])
def test_parse_mesh(text, shape):
    assert parse_mesh(text) == shape


@pytest.mark.parametrize("text", ["8", "0x2", "2x", "axb"])
def test_bad_mesh_is_named(text):
    with pytest.raises(ValueError, match=f"mesh={text!r} is not DxM"):
        parse_mesh(text)
    with pytest.raises(ValueError, match="is not DxM"):
        EngineConfig(mesh=text)


def test_rule_table_covers_every_parameter():
    assert spec_for("layers/q_proj") == spec_for("layers/up_proj") != spec_for("layers/o_proj")
    assert spec_for("layers/input_norm") == spec_for("final_norm") == PARTITION_RULES[-1][1]
    assert spec_for("embed")[0] == "model" and spec_for("lm_head")[1] == "model"
    cfg = dataclasses.replace(_config(8, 2), qkv_bias=True, o_bias=True, mlp_bias=True, qk_norm=True)
    replicated = {"final_norm", "layers/input_norm", "layers/post_attention_norm", "layers/q_norm",
                  "layers/k_norm", "layers/o_bias", "layers/down_bias"}
    for path, param in expected_params(abstract_model(cfg, np.float32)[1]).items():
        name, spec = "/".join(path), spec_for("/".join(path))
        assert len(spec) <= param.ndim, name
        assert ("model" in spec) == (name not in replicated), name   # split exactly where it should be


def test_experts_are_split_whole_over_the_model_axis():
    cfg = dataclasses.replace(_config(8, 2), architecture="Qwen2MoeForCausalLM", num_experts=4,
                              num_experts_per_tok=2, moe_intermediate_size=8)   # with a shared expert
    specs = {"/".join(p): spec_for("/".join(p)) for p in expected_params(abstract_model(cfg, np.float32)[1])}
    assert specs["layers/gate_experts"] == specs["layers/down_experts"] == P(None, "model", None, None)
    assert specs["layers/router"] == specs["layers/shared_expert_gate"] == P()
    assert specs["layers/gate_proj"] == spec_for("layers/q_proj")   # the shared expert: tensor parallel


def _config(heads, kv_heads, head_dim=4):
    return ModelConfig(architecture="LlamaForCausalLM", vocab_size=16, hidden_size=heads * head_dim,
                       intermediate_size=8, num_layers=1, num_heads=heads, num_kv_heads=kv_heads,
                       head_dim=head_dim, rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=64)


@pytest.mark.parametrize("heads, kv_heads, model, expected", [
    (8, 8, 4, (8, 8)),      # divides: unchanged
    (8, 2, 8, (8, 8)),      # KV heads replicated 4x, one query head each
    (32, 8, 8, (32, 8)),
    (9, 3, 4, (12, 4)),     # one zero KV head with its 3 zero query heads
    (9, 3, 2, (12, 4)),
    (9, 3, 8, (24, 8)),
])
def test_head_layout(heads, kv_heads, model, expected):
    layout = head_layout(_config(heads, kv_heads), model)
    assert (layout.new_heads, layout.new_kv_heads) == expected
    assert layout.new_kv_heads % model == 0


def test_padded_heads_give_the_same_attention_output():
    """Plain GQA attention over random weights, before and after rearranging 9/3 heads for 4 ways."""
    cfg, rng = _config(9, 3), np.random.default_rng(0)
    d, hd = cfg.hidden_size, cfg.head_dim
    weights = {("layers", "q_proj"): rng.normal(size=(1, d, 9 * hd)), ("layers", "k_proj"): rng.normal(size=(1, d, 3 * hd)),
               ("layers", "v_proj"): rng.normal(size=(1, d, 3 * hd)), ("layers", "o_proj"): rng.normal(size=(1, 9 * hd, d))}
    x = rng.normal(size=(5, d))

    def attention(cfg, w):
        q = (x @ w[("layers", "q_proj")][0]).reshape(5, cfg.num_heads, hd)
        k = (x @ w[("layers", "k_proj")][0]).reshape(5, cfg.num_kv_heads, hd)
        v = (x @ w[("layers", "v_proj")][0]).reshape(5, cfg.num_kv_heads, hd)
        group = cfg.num_heads // cfg.num_kv_heads
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, k)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        out = np.einsum("hqk,khd->qhd", p / p.sum(-1, keepdims=True), v).reshape(5, -1)
        return out @ w[("layers", "o_proj")][0]

    for model in (2, 4, 8):
        new_cfg, new_weights = pad_heads(cfg, weights, model)
        np.testing.assert_allclose(attention(new_cfg, new_weights), attention(cfg, weights), atol=1e-10)


PLACE_PROGRAM = """
import jax, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from jaxserve.sharding import AXES, place
jax.config.update("jax_num_cpu_devices", 8)
mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), AXES)
rng = np.random.default_rng(0)
tree = {"weight": rng.normal(size=(6, 8)).astype(np.float32), "packed": rng.integers(0, 255, (4, 8), np.uint8),
        "rows": np.arange(6, dtype=np.int32), "table": rng.integers(0, 9, (4, 3), np.int32)}
specs = {"weight": P(None, "model"), "packed": P("model", None), "rows": P("data"), "table": P("data")}
jax.process_count = lambda: 2   # the path of several processes, on one
for name, value in tree.items():
    sharding = NamedSharding(mesh, specs[name])
    placed, put = place({"x": value}, sharding)["x"], jax.device_put(value, sharding)
    assert placed.sharding == put.sharding and placed.dtype == put.dtype, name
    assert [(s.device, s.index) for s in placed.addressable_shards] == [
        (s.device, s.index) for s in put.addressable_shards], name
    for a, b in zip(placed.addressable_shards, put.addressable_shards):
        np.testing.assert_array_equal(np.asarray(a.data), np.asarray(b.data))
print("placed")
"""


def test_place_puts_every_shard_where_device_put_does():
    """`place` over several processes (each cutting its devices' shards from its own copy) gives
    the arrays device_put gives: shardings, shards and dtypes, on a 2x4 mesh of host devices."""
    result = subprocess.run([sys.executable, "-c", PLACE_PROGRAM], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.split()[-1] == "placed", result.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("heads, kv_heads, hidden, meshes", [
    (8, 2, 64, "1x1,2x4"),            # data slices, KV heads replicated 2x; and speculation on 2x4
    (9, 3, 72, "1x1,1x2,2x1,1x8"),    # 9/3 heads padded to 12/4 for 2 ways, 24/8 for 8 (SmolLM2: 2x4)
])
def test_logits_agree_across_meshes(heads, kv_heads, hidden, meshes, tmp_path, smollm2_tokenizer):
    write_tiny_model(tmp_path / "model", "llama", smollm2_tokenizer, num_attention_heads=heads,
                     num_key_value_heads=kv_heads, hidden_size=hidden)
    speculative = "2x4" in meshes
    results = run_worker(str(tmp_path / "model"), tmp_path / "out.npz", meshes,
                         *["--speculative"] * speculative)
    for mesh in meshes.split(",")[1:]:
        np.testing.assert_allclose(results[f"logits_{mesh}"], results["logits_1x1"], atol=1e-4, rtol=0)
        assert results[f"heads_{mesh}"][1] % int(mesh.split("x")[1]) == 0
        assert results[f"misplaced_{mesh}"].tolist() == [], "shardings differ from the rule table"
    if speculative:   # the same tokens with n-gram or draft-model drafts as without, over slices and heads
        without, *speculating = results["speculative_2x4"]
        assert all((tokens == without).all() for tokens in speculating)
        (ngram_proposed, ngram_accepted), (draft_proposed, draft_accepted) = results["drafted_2x4"]
        assert 0 < ngram_accepted < ngram_proposed and 0 < draft_accepted == draft_proposed


@pytest.mark.slow
@pytest.mark.parametrize("quantization, kv_cache_dtype, heads, kv_heads, hidden", [
    ("int4", "int8", 8, 2, 128),    # KV heads replicated on M = 4 (packed o_proj untouched)
    ("int8", "fp8", 12, 4, 192),    # zero heads added on M = 8: rows of quantized o_proj rearranged
])
def test_quantized_weights_and_kv_cache_agree_across_meshes(quantization, kv_cache_dtype, heads, kv_heads, hidden,
                                                          tmp_path, smollm2_tokenizer):
    write_tiny_model(tmp_path / "model", "llama", smollm2_tokenizer, num_attention_heads=heads,
                     num_key_value_heads=kv_heads, hidden_size=hidden)
    meshes = "1x1,1x2,2x1,1x8" if heads == 12 else "1x1,1x2,2x1,2x4"
    results = run_worker(str(tmp_path / "model"), tmp_path / "out.npz", meshes, "--quantization", quantization,
                         "--kv-cache-dtype", kv_cache_dtype)
    assert results["formats_1x1"].tolist() == [quantization] * 7
    for mesh in meshes.split(",")[1:]:
        # float32 sums in another order move a K/V value across an fp8 rounding boundary now and
        # then (a step of 1/16 of its magnitude): seen up to 1.3e-3 on logits of ~3 on an AVX-512 CPU
        atol = 5e-3 if kv_cache_dtype == "fp8" else 1e-4
        np.testing.assert_allclose(results[f"logits_{mesh}"], results["logits_1x1"], atol=atol, rtol=0)
        assert results[f"formats_{mesh}"].tolist() == [quantization] * 7
        assert results[f"misplaced_{mesh}"].tolist() == [], "shardings differ from the rule table"
        assert results[f"layer_permutes_{mesh}"] == 0, "the layers move weights or activations between devices"


@pytest.mark.slow
def test_lora_adapters_give_the_1x1_tokens_on_meshes(tmp_path, smollm2_tokenizer):
    # 9/3 heads padded to 12/4 on M = 2: the adapters' q/k/v B columns and o A rows move with them
    write_tiny_model(tmp_path / "model", "llama", smollm2_tokenizer, num_attention_heads=9, num_key_value_heads=3,
                     hidden_size=72)
    write_adapter(tmp_path / "model", tmp_path / "a0", r=4, alpha=8, seed=1)
    write_adapter(tmp_path / "model", tmp_path / "a1", ["q_proj", "v_proj", "o_proj", "down_proj"], r=8, alpha=8,
                  seed=2)
    meshes = "1x1,1x2,2x2"
    results = run_worker(str(tmp_path / "model"), tmp_path / "out.npz", meshes,
                         "--lora", f"{tmp_path / 'a0'},{tmp_path / 'a1'}")
    base, a0, a1 = np.split(results["lora_1x1"], 3)
    assert (base != a0).any() and (base != a1).any(), "the adapters change the tokens"
    for mesh in meshes.split(",")[1:]:
        assert (results[f"lora_{mesh}"] == results["lora_1x1"]).all(), mesh
        assert results[f"lora_misplaced_{mesh}"].tolist() == [], "LoRA shardings differ from the rule table"


@pytest.mark.slow
def test_experts_split_over_the_model_axis_give_the_1x1_logits(tmp_path, smollm2_tokenizer):
    # Qwen2-MoE: 4 int8 experts (2, 1 per device on M = 2, 4: their parts split alike) beside a
    # tensor-parallel shared expert; float experts take the same shard_map (test_moe.py covers
    # both kinds of stack against the reference)
    write_tiny_model(tmp_path / "model", "qwen2_moe", smollm2_tokenizer)
    meshes = "1x1,1x2,2x2,1x4"
    results = run_worker(str(tmp_path / "model"), tmp_path / "out.npz", meshes, "--quantization", "int8")
    # q, k, v, o, the shared expert's three and the experts' three
    assert results["formats_1x1"].tolist() == ["int8"] * 10
    for mesh in meshes.split(",")[1:]:
        np.testing.assert_allclose(results[f"logits_{mesh}"], results["logits_1x1"], atol=1e-4, rtol=0)
        assert results[f"misplaced_{mesh}"].tolist() == [], "shardings differ from the rule table"


@pytest.mark.slow
def test_gemma_logits_agree_across_meshes(tmp_path, smollm2_tokenizer):
    # Gemma 3: each layer's window read inside the sharded attention, RoPE per layer type
    write_tiny_model(tmp_path / "model", "gemma3", smollm2_tokenizer)
    meshes = "1x1,1x2,2x2"
    results = run_worker(str(tmp_path / "model"), tmp_path / "out.npz", meshes)
    for mesh in meshes.split(",")[1:]:
        np.testing.assert_allclose(results[f"logits_{mesh}"], results["logits_1x1"], atol=1e-4, rtol=0)
        assert results[f"misplaced_{mesh}"].tolist() == [], "shardings differ from the rule table"


@pytest.mark.slow
def test_smollm2_tokens_are_identical_across_meshes(tmp_path):
    # 2x4: data slices and 12/4 heads (3 KV heads padded to 4). The tiny models cover 1x2, 2x1 and
    # 1x8's 24/8 padding (test_logits_agree_across_meshes); here each mesh costs ~90 s.
    meshes = "1x1,2x4"
    results = run_worker("-", tmp_path / "out.npz", meshes, "--engine")
    for mesh in meshes.split(",")[1:]:
        # 30 layers, logits up to ~20: float32 sums in another order drift by up to ~1.2e-4
        np.testing.assert_allclose(results[f"logits_{mesh}"], results["logits_1x1"], atol=3e-4, rtol=0)
        assert (results[f"tokens_{mesh}"] == results["tokens_1x1"]).all(), mesh
