"""GGUF reading: config mapping, dequantisation, the q/k un-permutation, and parity with transformers."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter, RopeScalingType
from gguf.quants import quantize

from jaxserve.checkpoint.default_model import default_model_path
from jaxserve.checkpoint.gguf import load_gguf

HIDDEN, FFN, HEADS, KV_HEADS, HEAD_DIM, VOCAB, LAYERS = 64, 128, 4, 2, 16, 96, 2


def _to_gguf_rows(w, heads):
    """llama.cpp's HF->GGUF q/k permutation: each head's rotate-half halves become interleaved pairs."""
    out, inp = w.shape
    return w.reshape(heads, 2, out // heads // 2, inp).swapaxes(1, 2).reshape(out, inp)


def _hf_weights(seed=0, lm_head=False):
    """Random tiny-Llama weights under HF names, HF layout."""
    rng = np.random.default_rng(seed)
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "model.norm.weight": (HIDDEN,)}
    if lm_head:
        shapes["lm_head.weight"] = (VOCAB, HIDDEN)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (HIDDEN,),
            p + "post_attention_layernorm.weight": (HIDDEN,),
            p + "self_attn.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
            p + "mlp.gate_proj.weight": (FFN, HIDDEN),
            p + "mlp.up_proj.weight": (FFN, HIDDEN),
            p + "mlp.down_proj.weight": (HIDDEN, FFN),
        }
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


def _gguf_name(hf_name):
    """Inverse of the loader's name table, for writing test files."""
    table = {
        "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    if hf_name in table:
        return table[hf_name]
    _, _, layer, *module, _ = hf_name.split(".")
    return f"blk.{layer}.{table['.'.join(module)]}.weight"


def _write_gguf(path, weights, matrix_type=Q.F32, arch="llama", rope_scaling=None):
    """Write `weights` as a GGUF file the way llama.cpp's converter lays it out."""
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if rope_scaling:
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope_scaling)
    for name, w in weights.items():
        if "q_proj" in name:
            w = _to_gguf_rows(w, HEADS)
        elif "k_proj" in name:
            w = _to_gguf_rows(w, KV_HEADS)
        if w.ndim == 1 or matrix_type == Q.F32:
            writer.add_tensor(_gguf_name(name), w)
        elif matrix_type == Q.F16:
            writer.add_tensor(_gguf_name(name), w.astype(np.float16))
        else:
            writer.add_tensor(_gguf_name(name), quantize(w, matrix_type), raw_dtype=matrix_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_tiny_llama_config_names_and_exact_unpermutation(tmp_path):
    weights = _hf_weights()
    ckpt = load_gguf(_write_gguf(tmp_path / "tiny.gguf", weights))
    assert ckpt.config == {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB,
        "hidden_size": HIDDEN, "intermediate_size": FFN, "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
        "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 256,
        "tie_word_embeddings": True, "attention_bias": False, "mlp_bias": False,
        "bos_token_id": 1, "eos_token_id": 2,
    }
    assert ckpt.tensors.keys() == weights.keys()
    for name, w in weights.items():
        assert ckpt.tensors[name].dtype == np.float32
        np.testing.assert_array_equal(ckpt.tensors[name], w, err_msg=name)


def test_untied_lm_head_and_rope_scaling(tmp_path):
    ckpt = load_gguf(_write_gguf(tmp_path / "t.gguf", _hf_weights(lm_head=True), rope_scaling=4.0))
    assert ckpt.config["tie_word_embeddings"] is False
    assert ckpt.tensors["lm_head.weight"].shape == (VOCAB, HIDDEN)
    assert ckpt.config["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}


# Worst-case error as a fraction of the tensor's largest magnitude (per-block scales are no larger).
# Q4_0 maps a block's signed extreme to -8, so the opposite extreme may clip at +7: a full step, 1/8.
@pytest.mark.parametrize(
    "qtype, tolerance", [(Q.Q8_0, 1 / 120), (Q.Q4_0, 1 / 7.9), (Q.Q4_1, 1 / 14), (Q.F16, 1e-3), (Q.BF16, 1e-2)]
)
def test_dequantisation_within_quantisation_error(tmp_path, qtype, tolerance):
    weights = _hf_weights(seed=1)
    ckpt = load_gguf(_write_gguf(tmp_path / "q.gguf", weights, matrix_type=qtype))
    for name, w in weights.items():
        err = np.abs(ckpt.tensors[name] - w).max()
        assert err <= tolerance * np.abs(w).max(), (name, err)
        if w.ndim == 2 and qtype in (Q.Q4_0, Q.Q4_1, Q.Q8_0):
            assert err > 0, "quantised data came back bit-exact: was it quantised at all?"


def test_unsupported_quant_type_is_named(tmp_path):
    path = _write_gguf(tmp_path / "q5.gguf", _hf_weights(), matrix_type=Q.Q5_0)
    with pytest.raises(NotImplementedError, match=r"Q5_0.*supported: .*Q4_1"):
        load_gguf(path)


def test_other_architecture_is_named(tmp_path):
    path = _write_gguf(tmp_path / "qwen.gguf", _hf_weights(), arch="qwen2")
    with pytest.raises(NotImplementedError, match="'qwen2'"):
        load_gguf(path)


@pytest.fixture(scope="module")
def smollm2():
    return load_gguf(default_model_path())


def test_smollm2_config(smollm2):
    config = smollm2.config
    assert (config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"]) == (30, 576, 1536)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (9, 3, 64)
    assert config["vocab_size"] == 49152 and config["tie_word_embeddings"] is True
    assert config["rope_theta"] == 100000.0 and config["rms_norm_eps"] == 1e-5
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert "lm_head.weight" not in smollm2.tensors
    assert smollm2.tensors["model.embed_tokens.weight"].shape == (49152, 576)
    assert smollm2.tensors["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert len(smollm2.tensors) == 2 + 30 * 9


@pytest.mark.slow
def test_smollm2_matches_transformers_gguf_loading(smollm2):
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    reference = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name).state_dict()
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    for i in (0, 17, 29):
        names += [name for name in smollm2.tensors if name.startswith(f"model.layers.{i}.")]
    assert len(names) == 2 + 3 * 9
    for name in names:
        np.testing.assert_allclose(smollm2.tensors[name], reference[name].numpy(), atol=1e-6, err_msg=name)
