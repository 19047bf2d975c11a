"""Mixture of experts: the ragged expert computation against the dense one-hot reference, experts
split like expert parallelism splits them, batch invariance, and an MoE model served by the engine
(its logits against transformers are in test_llama.py; on meshes in test_sharding.py)."""

import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh

from jaxserve.checkpoint.loader import load_model
from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.engine.engine import LLMEngine
from jaxserve.models.layers.moe import ExpertStack, dense_experts, route, routed_experts
from jaxserve.quantization import AT_LOAD, quantize
from jaxserve.models.llama import abstract_model
from jaxserve.sampling_params import SamplingParams


def _random_moe(rng, tokens, hidden, ffn, num_experts, top_k, normalize=True):
    x = jnp.asarray(rng.normal(size=(tokens, hidden)), jnp.float32)
    router = jnp.asarray(rng.normal(size=(hidden, num_experts)), jnp.float32)
    gate, up = (jnp.asarray(rng.normal(size=(num_experts, hidden, ffn)) / hidden ** 0.5, jnp.float32)
                for _ in range(2))
    down = jnp.asarray(rng.normal(size=(num_experts, ffn, hidden)) / ffn ** 0.5, jnp.float32)
    weights, ids = route(x, router, top_k, normalize)
    return x, weights, ids, gate, up, down


# (1, .., 2, 1) and (3, .., 8, 2): no more pairs than experts, so `tiled` gathers each pair's
# expert; (40, .., 8, 3): 120 pairs in tiles of 64, several tiles for some experts
@pytest.mark.parametrize("method", ["ragged", "tiled"])
@pytest.mark.parametrize("tokens, hidden, ffn, num_experts, top_k", [
    (1, 8, 4, 2, 1), (3, 16, 8, 8, 2), (13, 16, 8, 5, 2), (40, 32, 24, 8, 3), (64, 16, 8, 16, 8)])
def test_routed_experts_equal_the_dense_reference(method, tokens, hidden, ffn, num_experts, top_k):
    rng = np.random.default_rng(tokens)
    args = _random_moe(rng, tokens, hidden, ffn, num_experts, top_k)
    np.testing.assert_allclose(routed_experts(*args, method=method), dense_experts(*args), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("method", ["ragged", "tiled"])
@pytest.mark.parametrize("tokens, per_device", [(24, 2), (2, 4)])   # (2, 4): tiled gathers
def test_experts_split_over_devices_sum_to_all_of_them(method, tokens, per_device):
    """What each device of an expert-parallel mesh computes, summed, is the whole."""
    x, weights, ids, gate, up, down = _random_moe(np.random.default_rng(0), tokens, 16, 8, 8, 2)
    parts = [routed_experts(x, weights, ids, gate[i:i + per_device], up[i:i + per_device], down[i:i + per_device],
                            i, method) for i in range(0, 8, per_device)]
    assert all(np.abs(p).max() > 0 for p in parts) or tokens < 8, "every device has pairs to run"
    np.testing.assert_allclose(sum(parts), dense_experts(x, weights, ids, gate, up, down), atol=1e-5, rtol=0)


def _quantized_stack(w: jnp.ndarray, fmt) -> tuple[ExpertStack, np.ndarray]:
    """[E, in, out] float -> (the stack quantized per expert, its dequantised float [E, in, out])."""
    tensors = [quantize(np.asarray(e).T, fmt) for e in w]           # checkpoints hold [out, in]
    parts = [t.ours() for t in tensors]
    stack = ExpertStack(*(None if name not in parts[0] else jnp.asarray(np.stack([p[name] for p in parts]))
                          for name in ("value", "scale", "min")), kind=fmt.kind)
    return stack, np.stack([t.dequantized().T for t in tensors])


@pytest.mark.parametrize("quantization", ["int8", "fp8", "int4"])
@pytest.mark.parametrize("method, tokens", [("ragged", 20), ("tiled", 20), ("tiled", 3)])   # 3: per pair
def test_quantized_experts_equal_their_dequantised_weights(quantization, method, tokens):
    x, weights, ids, gate, up, down = _random_moe(np.random.default_rng(4), tokens, 64, 64, 8, 2)
    stacks, floats = zip(*(_quantized_stack(w, AT_LOAD[quantization]) for w in (gate, up, down)))
    assert stacks[0].value.dtype != jnp.float32 and np.abs(floats[0] - gate).max() > 0
    np.testing.assert_allclose(routed_experts(x, weights, ids, *stacks, method=method),
                               dense_experts(x, weights, ids, *map(jnp.asarray, floats)), atol=1e-5, rtol=1e-5)


def test_a_tokens_output_does_not_depend_on_the_rest_of_the_batch():
    x, weights, ids, gate, up, down = _random_moe(np.random.default_rng(1), 32, 16, 8, 8, 3)
    whole = routed_experts(x, weights, ids, gate, up, down)
    for rows in (np.array([3, 17, 30]), np.array([5, 6])):   # tiled, and per pair (6 pairs, 8 experts)
        alone = routed_experts(x[rows], weights[rows], ids[rows], gate, up, down)
        np.testing.assert_allclose(alone, whole[rows], atol=1e-6, rtol=0)


@pytest.mark.parametrize("normalize", [True, False])
def test_route_takes_the_top_k_softmax_probabilities(normalize):
    rng = np.random.default_rng(2)
    h, router = rng.normal(size=(5, 8)).astype(np.float32), rng.normal(size=(8, 6)).astype(np.float32)
    weights, ids = route(jnp.asarray(h), jnp.asarray(router), 2, normalize)
    logits = h @ router
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    expected_ids = np.argsort(-probs, axis=-1)[:, :2]
    expected = np.take_along_axis(probs, expected_ids, -1)
    if normalize:
        expected /= expected.sum(-1, keepdims=True)
    np.testing.assert_array_equal(ids, expected_ids)
    np.testing.assert_allclose(weights, expected, rtol=1e-5)


def _moe_config(**overrides):
    fields = dict(architecture="Qwen3MoeForCausalLM", vocab_size=16, hidden_size=16, intermediate_size=0,
                  num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8, rms_norm_eps=1e-6, rope_theta=1e4,
                  max_position_embeddings=64, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=8)
    return ModelConfig(**{**fields, **overrides})


def test_bad_expert_settings_are_refused():
    with pytest.raises(ValueError, match="num_experts=6 does not split over the mesh's model axis"):
        abstract_model(_moe_config(), jnp.float32, mesh=AbstractMesh((1, 4), ("data", "model")))
    with pytest.raises(ValueError, match=r"num_experts_per_tok=7 must be in \[1, num_experts=6\]"):
        _moe_config(num_experts_per_tok=7)
    hf = dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=16, hidden_size=16, intermediate_size=32,
              num_hidden_layers=2, num_attention_heads=2, num_experts=4, num_experts_per_tok=2,
              moe_intermediate_size=8, mlp_only_layers=[1])
    with pytest.raises(ValueError, match=r"mlp_only_layers=\[1\].*not supported"):
        ModelConfig.from_hf(hf)
    assert ModelConfig.from_hf({**hf, "mlp_only_layers": []}).num_experts == 4


def test_engine_serves_an_moe_model_batch_invariantly(tiny_models):
    """Greedy tokens of prompts run together (chunked, beside each other's decodes) equal each run
    alone: which experts a token meets never depends on its neighbours."""
    model = load_model(str(tiny_models("qwen3_moe")[0]), "float32")
    assert model.config.num_experts == 8 and model.config.intermediate_size == 0
    engine = LLMEngine(EngineConfig(max_model_len=128, num_pages=64, max_num_seqs=4, max_num_batched_tokens=32,
                                    prefill_segment=16), model=model)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, model.config.vocab_size, n).tolist() for n in (5, 23, 41)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def generate(batch):
        ids = [engine.add_request(p, params) for p in batch]
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
        return [done[i] for i in ids]

    together = generate(prompts)
    assert together == [generate([p])[0] for p in prompts]
    assert len({tuple(t) for t in together}) == 3


# Mixtral's experts are 32 wide: the input of each down projection is a single int4 group, which
# loads because a byte's two rows (a pair) always sit in one group.
@pytest.mark.parametrize("variant, quantization", [("qwen3_moe", "int8"), ("mixtral", "int4")])
def test_quantized_experts_equal_the_float_model_of_their_dequantised_weights(variant, quantization, tiny_models,
                                                                               tmp_path):
    """`--quantization int8|int4` on an MoE quantizes the experts too: its logits are those of the
    float model whose projections are replaced, in the checkpoint, by their round trips."""
    import re
    import shutil

    from safetensors.numpy import load_file, save_file

    from test_llama import _paged_logits

    directory = tiny_models(variant)[0]
    shutil.copytree(directory, tmp_path, dirs_exist_ok=True)
    tensors = load_file(directory / "model.safetensors")
    projection = re.compile(r".*(self_attn\.[qkvo]_proj|experts\.\d+\.((gate|up|down)_proj|w[123]))\.weight")
    save_file({name: quantize(w, AT_LOAD[quantization]).dequantized() if projection.match(name) else w
               for name, w in tensors.items()}, tmp_path / "model.safetensors")
    quantized = load_model(str(directory), "float32", quantization=quantization)
    assert {"layers/gate_experts", "layers/up_experts", "layers/down_experts"} <= set(quantized.formats)
    experts = quantized.params["layers"]["gate_experts"]["value"]
    num_experts = quantized.config.num_experts
    assert experts.dtype == {"int8": jnp.int8, "int4": jnp.uint8}[quantization]
    assert experts.shape == {"int8": (2, num_experts, 64, 32), "int4": (2, num_experts, 32, 32)}[quantization]
    reference = load_model(str(tmp_path), "float32", quantization="none")
    prompt = np.random.default_rng(5).integers(0, reference.config.vocab_size, 37).tolist()
    for got, want in zip(_paged_logits(quantized, prompt, prompt[:8]), _paged_logits(reference, prompt, prompt[:8])):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
