"""GGUF reading: config mapping, dequantisation, the q/k un-permutation, and parity with transformers."""

import dataclasses

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


@pytest.mark.parametrize("qtype", [Q.Q5_0, Q.Q5_1])
def test_other_quant_types_are_dequantised_at_load(tmp_path, qtype, caplog):
    weights = _hf_weights(seed=2)
    with caplog.at_level("INFO", logger="jaxserve.checkpoint.gguf"):
        ckpt = load_gguf(_write_gguf(tmp_path / "q5.gguf", weights, matrix_type=qtype), native=True)
    assert f"{qtype.name} tensors dequantised to float32 at load" in caplog.text
    for name, w in weights.items():
        assert ckpt.tensors[name].dtype == np.float32, name
        # Q5_0 maps a block's signed extreme to -16, so the other may clip at +15 (as Q4_0 above)
        assert np.abs(ckpt.tensors[name] - w).max() <= np.abs(w).max() / 15, name


def test_other_architecture_is_named(tmp_path):
    path = _write_gguf(tmp_path / "falcon.gguf", _hf_weights(), arch="falcon")
    with pytest.raises(NotImplementedError, match="'falcon' is not supported; supported: llama, qwen2, qwen3"):
        load_gguf(path)


# HF module -> llama.cpp tensor name, for the family writers below
_FAMILY_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
                 "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                 "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
                 "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def _family_writer(path, arch, config) -> GGUFWriter:
    """A writer with the `<arch>.*` keys of a transformers config, as llama.cpp's converter writes them."""
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    rope = config.get("rope_parameters") or {}
    theta = config.get("rope_theta") or rope.get("rope_theta") or rope.get("full_attention", {}).get("rope_theta")
    writer.add_rope_freq_base(theta)
    return writer


def _gguf_family_name(name: str, names: dict[str, str]) -> str:
    globals_ = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}
    if name in globals_:
        return globals_[name]
    _, _, layer, *module, kind = name.split(".")
    return f"blk.{layer}.{names['.'.join(module)]}.{kind}"


def _close(writer: GGUFWriter, path):
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _write_family_gguf(path, directory, arch, config):
    """A transformers checkpoint as llama.cpp's converter writes it for qwen2 / qwen3 (no q/k
    row permutation; biases and q/k norms under their blk names)."""
    from safetensors.numpy import load_file

    writer = _family_writer(path, arch, config)
    for name, w in load_file(directory / "model.safetensors").items():
        writer.add_tensor(_gguf_family_name(name, _FAMILY_NAMES), w.astype(np.float32))
    return _close(writer, path)


@pytest.mark.parametrize("variant", ["qwen2", "qwen3"])
def test_qwen_gguf_files_read_as_transformers_reads_them(variant, tiny_models, smollm2_tokenizer, tmp_path,
                                                         monkeypatch):
    """transformers' own GGUF reader is the oracle for names, layouts and the config. (It reads
    qwen3's head_dim as 128 whatever the file says, so that model has 128.)"""
    import json

    from transformers import AutoModelForCausalLM

    from conftest import write_tiny_model

    if variant == "qwen3":
        directory = tmp_path / "hf"
        write_tiny_model(directory, "qwen3", smollm2_tokenizer, head_dim=128)
    else:
        directory, _ = tiny_models(variant)
    config = json.loads((directory / "config.json").read_text())
    (tmp_path / "gguf").mkdir()
    path = _write_family_gguf(tmp_path / "gguf" / f"{variant}.gguf", directory, variant, config)
    ckpt = load_gguf(path)
    assert ckpt.config["architectures"] == config["architectures"]
    reference = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name).state_dict()
    assert set(ckpt.tensors) == set(reference)
    for name, tensor in ckpt.tensors.items():
        np.testing.assert_array_equal(tensor, reference[name].numpy(), err_msg=name)
    # Served from the GGUF, the model gives the HF directory's logits (its config read right too).
    from jaxserve.checkpoint.loader import load_model
    from test_llama import _paged_logits

    monkeypatch.setattr("jaxserve.checkpoint.loader.load_tokenizer", lambda *args: None)
    ours = [np.concatenate(_paged_logits(load_model(str(p), "float32"), list(range(3, 30)), [5, 6]))
            for p in (path, directory)]
    np.testing.assert_allclose(ours[0], ours[1], atol=1e-5, rtol=0)
    if variant == "qwen2":
        assert "model.layers.0.self_attn.q_proj.bias" in ckpt.tensors
    else:
        assert ckpt.config["head_dim"] == 128 and "model.layers.1.self_attn.k_norm.weight" in ckpt.tensors


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


def _write_moe_gguf(path, directory, arch, config, experts_type=Q.F32):
    """A transformers mixture of experts as llama.cpp's converter writes it: experts stacked
    [experts, out, in] per layer (`ffn_gate_exps` ...), the router as `ffn_gate_inp`, Qwen2-MoE's
    shared expert as `*_shexp`, and Mixtral as `llama` with q/k rows permuted."""
    import re

    from safetensors.numpy import load_file

    writer = _family_writer(path, arch, config)
    writer.add_expert_count(config.get("num_experts") or config["num_local_experts"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    if arch != "llama":
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    if config.get("shared_expert_intermediate_size"):
        writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    names = {**_FAMILY_NAMES, "mlp.gate": "ffn_gate_inp", "block_sparse_moe.gate": "ffn_gate_inp",
             "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
             "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}
    expert = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")
    stacks = {}
    for name, w in load_file(directory / "model.safetensors").items():
        if m := expert.fullmatch(name):
            kind = {"w1": "gate", "w3": "up", "w2": "down"}.get(m[3], m[3].removesuffix("_proj"))
            stacks.setdefault(f"blk.{m[1]}.ffn_{kind}_exps.weight", {})[int(m[2])] = w
            continue
        if arch == "llama" and ("q_proj" in name or "k_proj" in name):
            w = _to_gguf_rows(w, config["num_attention_heads" if "q_proj" in name else "num_key_value_heads"])
        writer.add_tensor(_gguf_family_name(name, names),
                          w.astype(np.float32).reshape(-1) if "shared_expert_gate" in name else w)
    for gguf, by_expert in stacks.items():
        w = np.stack([by_expert[e] for e in sorted(by_expert)]).astype(np.float32)
        if experts_type == Q.F32:
            writer.add_tensor(gguf, w)
        else:
            writer.add_tensor(gguf, quantize(w, experts_type), raw_dtype=experts_type)
    return _close(writer, path)


def _assert_twins(path, directory, monkeypatch, prompt=tuple(range(3, 30)), continuation=(5, 6)):
    """The GGUF at `path` and its HF twin `directory` load to the same config (special tokens
    aside: the writers leave them out) and the same paged logits (1e-5); returns the config."""
    from jaxserve.checkpoint.loader import load_model
    from test_llama import _paged_logits

    monkeypatch.setattr("jaxserve.checkpoint.loader.load_tokenizer", lambda *args: None)
    models = [load_model(str(p), "float32") for p in (path, directory)]
    tokens_aside = [dataclasses.replace(m.config, bos_token_id=None, eos_token_ids=()) for m in models]
    assert tokens_aside[0] == tokens_aside[1]
    ours = [np.concatenate(_paged_logits(m, list(prompt), list(continuation))) for m in models]
    np.testing.assert_allclose(ours[0], ours[1], atol=1e-5, rtol=0)
    return tokens_aside[0]


@pytest.mark.parametrize("variant, arch", [("mixtral", "llama"), ("qwen2_moe", "qwen2moe"), ("qwen3_moe", "qwen3moe")])
def test_moe_gguf_files_give_their_hf_twins_logits(variant, arch, tiny_models, tmp_path, monkeypatch):
    import json

    directory, _ = tiny_models(variant)
    config = json.loads((directory / "config.json").read_text())
    (tmp_path / "gguf").mkdir()
    path = _write_moe_gguf(tmp_path / "gguf" / f"{variant}.gguf", directory, arch, config)
    _assert_twins(path, directory, monkeypatch)


def test_q8_0_experts_are_served_as_they_are_stored(tiny_models, tmp_path, monkeypatch):
    """Stacked Q8_0 experts stay Q8_0 (split per expert without a float copy) and give the logits
    of the same file dequantised at load."""
    import json

    from jaxserve.checkpoint.loader import load_model
    from test_llama import _paged_logits

    directory, _ = tiny_models("qwen3_moe")
    config = json.loads((directory / "config.json").read_text())
    path = _write_moe_gguf(tmp_path / "q8.gguf", directory, "qwen3moe", config, Q.Q8_0)
    monkeypatch.setattr("jaxserve.checkpoint.loader.load_tokenizer", lambda *args: None)
    native, dequantised = load_model(str(path), "float32"), load_model(str(path), "float32", quantization="none")
    assert {native.formats[f"layers/{p}_experts"].name for p in ("gate", "up", "down")} == {"Q8_0"}
    assert not dequantised.formats
    for got, want in zip(_paged_logits(native, list(range(3, 30)), [5, 6]),
                         _paged_logits(dequantised, list(range(3, 30)), [5, 6])):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def _write_gemma_gguf(path, directory, arch, config, end_of_turn: int):
    """A transformers Gemma 2 / 3 as llama.cpp's converter writes it: norms stored as 1 + w, the
    four norms of a layer under their llama.cpp names, no query scale (llama.cpp derives it),
    Gemma 3's full layers' linear scaling; a vocabulary with `<end_of_turn>` at `end_of_turn`."""
    from safetensors.numpy import load_file

    writer = _family_writer(path, arch, config)
    writer.add_sliding_window(config["sliding_window"])
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    else:   # 3 layers: llama.cpp's default (all but every 6th windowed) would window all, so list them
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in config["layer_types"]])
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(config["rope_parameters"]["full_attention"]["factor"])
    tokens = [f"t{i}" for i in range(config["vocab_size"])]
    tokens[end_of_turn] = "<end_of_turn>"
    writer.add_token_list(tokens)
    writer.add_eos_token_id(1)
    names = {**_FAMILY_NAMES, "post_attention_layernorm": "post_attention_norm",
             "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}
    for name, w in load_file(directory / "model.safetensors").items():
        w = w.astype(np.float32)
        writer.add_tensor(_gguf_family_name(name, names), w + 1 if name.endswith("norm.weight") else w)
    return _close(writer, path)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gemma_gguf_files_give_their_hf_twins_logits(arch, smollm2_tokenizer, tmp_path, monkeypatch):
    """The HF twin scales queries by head_dim ** -0.5, as llama.cpp assumes for every Gemma but the
    27B ones; Gemma 2's windows follow llama.cpp's default alternation, Gemma 3's the file's list."""
    import json

    from conftest import write_tiny_model

    directory = tmp_path / "hf"
    write_tiny_model(directory, arch, smollm2_tokenizer, query_pre_attn_scalar=16)
    config = json.loads((directory / "config.json").read_text())
    (tmp_path / "gguf").mkdir()
    path = _write_gemma_gguf(tmp_path / "gguf" / f"{arch}.gguf", directory, arch, config, end_of_turn=7)
    assert load_gguf(path).config["eos_token_id"] == [1, 7]
    _assert_twins(path, directory, monkeypatch)


@pytest.mark.parametrize("arch, layers, scalar, windowed", [
    ("gemma2", 4, 16, [True, False, True, False]),
    ("gemma3", 7, 16, [True] * 5 + [False, True]),
    ("gemma3", 62, 2048 // 8, None),   # the 27B: by hidden / heads
])
def test_gemma_gguf_defaults_are_llama_cpps(arch, layers, scalar, windowed):
    from jaxserve.checkpoint.gguf import _hf_config

    fields = {f"{arch}.{k}": v for k, v in dict(
        embedding_length=2048, **{"attention.head_count": 8, "attention.key_length": 16,
                                  "attention.layer_norm_rms_epsilon": 1e-6, "attention.sliding_window": 512},
        feed_forward_length=64, block_count=layers, context_length=8192).items()}
    config = _hf_config(fields, arch, {"token_embd.weight": [2048, 100]})
    assert config["query_pre_attn_scalar"] == scalar
    if windowed is not None:
        assert config["layer_types"] == ["sliding_attention" if w else "full_attention" for w in windowed]
    assert config.get("rope_local_base_freq") == (10000.0 if arch == "gemma3" else None)


def test_phi3_gguf_gives_its_hf_twins_logits(tiny_models, tmp_path, monkeypatch):
    """Phi-3 as llama.cpp's converter writes it: qkv and gate-up fused (`attn_qkv`, `ffn_up`), the
    rotated dimensions as `rope.dimension_count`, LongRoPE's factors as two tensors. The tiny
    model rotates 12 of 16 head dims and switches to the long factors past position 64, which
    the compared tokens cross."""
    import json

    from safetensors.numpy import load_file

    directory, _ = tiny_models("phi3")
    config = json.loads((directory / "config.json").read_text())
    rope = config.get("rope_parameters") or config["rope_scaling"]
    partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor"))
    (tmp_path / "gguf").mkdir()
    path = tmp_path / "gguf" / "phi3.gguf"
    writer = _family_writer(path, "phi3", config)
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    writer.add_rope_dimension_count(int(partial * head_dim))
    writer.add_rope_scaling_orig_ctx_len(config["original_max_position_embeddings"])
    tokens = [f"t{i}" for i in range(config["vocab_size"])]
    tokens[9] = "<|end|>"
    writer.add_token_list(tokens)
    writer.add_eos_token_id(2)
    writer.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], np.float32))
    writer.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], np.float32))
    names = {**_FAMILY_NAMES, "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}
    for name, w in load_file(directory / "model.safetensors").items():
        writer.add_tensor(_gguf_family_name(name, names), w.astype(np.float32))
    _close(writer, path)
    assert load_gguf(path).config["eos_token_id"] == [2, 9]
    served = _assert_twins(path, directory, monkeypatch, range(3, 64), range(5, 13))   # decodes to 68
    assert served.rotary_dim == 12
