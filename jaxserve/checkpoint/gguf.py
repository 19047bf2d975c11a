"""Read llama.cpp GGUF files: an HF-style config, weights under HF names, and the tokenizer.

Architectures (`general.architecture`): llama (Mixtral too, when it has `expert_count`), qwen2
(q/k/v biases), qwen3 (q/k norms), qwen2moe, qwen3moe, gemma2, gemma3 (text) and phi3 (fused
qkv and gate-up, LongRoPE factors as tensors), with the metadata keys under the architecture's
prefix. What llama.cpp leaves out of a Gemma file and fixes in code, we fix alike
(`_gemma_config`); its converter stores Gemma's norms as 1 + w, which we undo. Experts come
stacked (`ffn_gate_exps` ...: one 3-D tensor per layer) and are split into the HF per-expert
names. Q8_0, Q4_0 and Q4_1 tensors can stay quantized (`native=True`): their blocks of 32 become
a `QuantizedTensor` without a float copy. Every other type the `gguf` package decodes (F16,
BF16, Q5_0, Q4_K, Q5_K, Q6_K, ...) is dequantised to float32, with a log line naming the types.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from tokenizers import pre_tokenizers

from jaxserve.models.layers.linear import WeightFormat
from jaxserve.quantization import QuantizedTensor

log = logging.getLogger(__name__)

# general.architecture -> (HF architecture, model_type)
ARCHITECTURES = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2"),
                 "qwen3": ("Qwen3ForCausalLM", "qwen3"), "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe"),
                 "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"), "gemma2": ("Gemma2ForCausalLM", "gemma2"),
                 "gemma3": ("Gemma3ForCausalLM", "gemma3_text"), "phi3": ("Phi3ForCausalLM", "phi3")}
GEMMA = ("gemma2", "gemma3")
# ends of generation llama.cpp finds by their text, per architecture: where chat turns end
END_TEXTS = {"gemma2": "<end_of_turn>", "gemma3": "<end_of_turn>", "phi3": "<|end|>"}
MIXTRAL = ("MixtralForCausalLM", "mixtral")   # llama.cpp writes Mixtral as llama with experts
# llama.cpp renormalises the k routing weights for these (its `norm_w`); Mixtral always does
NORM_TOPK_PROB = {"llama": True, "qwen2moe": False, "qwen3moe": True}
FLOAT_TYPES = ("F32", "F16", "BF16")
NATIVE_FORMATS = {
    "Q8_0": WeightFormat("int8", 32, "float16", "Q8_0"),
    "Q4_0": WeightFormat("uint4", 32, "float16", "Q4_0"),
    "Q4_1": WeightFormat("uint4", 32, "float16", "Q4_1"),
}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# Gemma's four norms a layer: llama.cpp's ffn_norm is the norm before its MLP, not after attention
_GEMMA_LAYER_NAMES = {**_LAYER_NAMES, "ffn_norm": "pre_feedforward_layernorm",
                      "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
# Phi-3 keeps HF's fused projections: ffn_up is [gate; up] (split at load, weight_maps.py)
_PHI3_LAYER_NAMES = {**_LAYER_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
_ARCH_LAYER_NAMES = {"gemma2": _GEMMA_LAYER_NAMES, "gemma3": _GEMMA_LAYER_NAMES, "phi3": _PHI3_LAYER_NAMES}
_LONGROPE_TENSORS = {"rope_factors_long.weight": "long_factor", "rope_factors_short.weight": "short_factor"}
# stacked experts [experts, out, in] -> each expert's HF name
_EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
# the tokenizer's special tokens -> the key of their id (tokenizer.ggml.*)
_SPECIAL_TOKEN_IDS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
                      "pad_token": "padding_token_id"}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Vocabulary arrays: large, and only the tokenizer needs them.
_VOCAB_KEYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.scores")


@dataclasses.dataclass(frozen=True)
class GGUFCheckpoint:
    """A GGUF model as an HF `config.json` dict and tensors under HF names and layouts (float32,
    or `QuantizedTensor`s for the native types)."""

    config: dict
    tensors: dict[str, np.ndarray | QuantizedTensor]


class GGUFFile(GGUFReader):
    """gguf's reader over a plain ndarray view of its memmap: each slice of an np.memmap runs
    Python's __array_finalize__, and reading SmolLM2's 49k-token vocabulary took 2.0 s that way
    against 0.7 s on the view (the view keeps the mapping alive)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        super().__init__(path)

    @property
    def data(self) -> np.ndarray:
        return self._data

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._data = value.view(np.ndarray)


def load_gguf(source: str | Path | GGUFFile, native: bool = False) -> GGUFCheckpoint:
    """Read a GGUF file (a path, or the file read already) of one of `ARCHITECTURES`. Every tensor
    is dequantised to float32, except with `native` the 2-D tensors of a type in `NATIVE_FORMATS`,
    which stay quantized."""
    reader = source if isinstance(source, GGUFFile) else GGUFFile(source)
    path = reader.path
    fields = _fields(reader)
    arch = fields.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise NotImplementedError(f"{path}: GGUF architecture {arch!r} is not supported; supported: "
                                  f"{', '.join(ARCHITECTURES)}")
    config = _hf_config(fields, arch, {t.name: [int(d) for d in t.shape] for t in reader.tensors})
    if arch in END_TEXTS:
        config["eos_token_id"] = _end_ids(reader, config["eos_token_id"], END_TEXTS[arch])
    if arch == "phi3":
        config.update(_longrope(reader, fields, config))
    # llama.cpp interleaves q/k rows for its llama architecture only.
    unpermute = _unpermute if arch == "llama" else (lambda name, w, config: w)
    names = _ARCH_LAYER_NAMES.get(arch, _LAYER_NAMES)
    tensors, dequantised = {}, set()
    for tensor in reader.tensors:
        if tensor.name in _LONGROPE_TENSORS:   # read into the config
            continue
        qtype = GGMLQuantizationType(tensor.tensor_type).name
        if native and qtype in NATIVE_FORMATS and len(tensor.shape) >= 2:
            weight = _blocks(tensor, NATIVE_FORMATS[qtype])
        else:
            weight = _dequantize(tensor)
            if qtype not in FLOAT_TYPES and len(tensor.shape) >= 2:
                dequantised.add(qtype)
        for name, part in _hf_tensors(tensor, weight, names):
            if arch in GEMMA and name.endswith("norm.weight"):
                part = part - np.float32(1)   # stored as 1 + w, the factor Gemma's norm multiplies by
            tensors[name] = (part.map_rows(lambda rows: unpermute(name, rows, config))
                             if isinstance(part, QuantizedTensor) else unpermute(name, part, config))
    if dequantised:
        log.info("%s: %s tensors dequantised to float32 at load (served natively: %s)", Path(path).name,
                 ", ".join(sorted(dequantised)), ", ".join(NATIVE_FORMATS) if native else "none, as asked")
    return GGUFCheckpoint(config=config, tensors=tensors)


def load_gguf_tokenizer(source: str | Path | GGUFFile):
    """Return a fast tokenizer for a GGUF file (a path, or the file read already: its metadata
    takes 0.7-0.8 s to read for the embedded model), with the pre-tokenizer and specials the GGUF
    asks for.

    transformers builds it from the file's vocabulary (`convert_gguf_tokenizer`), but its own way
    in (`AutoTokenizer.from_pretrained(gguf_file=...)`) imports torch, which serving does not
    install, and reads the file three times (8.5 s of a 35 s cold start): so the metadata is read
    here, once, and grouped as transformers' `get_gguf_tokenizer` groups it."""
    from transformers import PreTrainedTokenizerFast  # heavy; only callers that tokenize pay for it
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (GGUF_TOKENIZER_MAPPING,
                                                                           convert_gguf_tokenizer)
    except ImportError:   # transformers before 5.2x kept them in one module
        from transformers.integrations.ggml import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer

    fields = _fields(source if isinstance(source, GGUFFile) else GGUFFile(source), vocab=True)
    vocab, config = ({name: fields[f"tokenizer.{key}"] for key, name in GGUF_TOKENIZER_MAPPING[group].items()
                      if f"tokenizer.{key}" in fields} for group in ("tokenizer", "tokenizer_config"))
    if vocab.get("tokenizer_type") == "llama":   # llama.cpp adds BOS to a sentencepiece vocabulary
        config.setdefault("add_bos_token", True)
    for name, key in _SPECIAL_TOKEN_IDS.items():
        token_id = fields.get(f"tokenizer.ggml.{key}")
        config[name] = vocab["tokens"][int(token_id)] if token_id is not None else None
    backend, extra = convert_gguf_tokenizer(fields["general.architecture"], vocab)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, **config, **extra)
    # transformers ignores some `tokenizer.ggml.pre` values and falls back to GPT-2 splitting.
    make_pre_tokenizer = _PRE_TOKENIZERS.get(fields.get("tokenizer.ggml.pre"))
    if make_pre_tokenizer is not None:
        tokenizer.backend_tokenizer.pre_tokenizer = make_pre_tokenizer()
    return tokenizer


def _smollm_pre_tokenizer():
    """SmolLM's pre-tokenizer: every digit alone, then GPT-2 byte-level splitting."""
    return pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
    ])


_PRE_TOKENIZERS = {"smollm": _smollm_pre_tokenizer}


def _fields(reader: GGUFReader, vocab: bool = False) -> dict:
    """Decode the reader's metadata fields to Python values (the vocabulary arrays only with `vocab`)."""
    return {key: field.contents() for key, field in reader.fields.items() if vocab or key not in _VOCAB_KEYS}


def _hf_config(fields: dict, arch: str, shapes: dict[str, list[int]]) -> dict:
    """Build an HF config.json dict from the GGUF `<arch>.*` keys."""
    def key(name):
        return f"{arch}.{name}"

    hidden = int(fields[key("embedding_length")])
    heads = int(fields[key("attention.head_count")])
    architecture, model_type = ARCHITECTURES[arch]
    config = {
        "architectures": [architecture],
        "model_type": model_type,
        # ggml shapes list the fastest dimension first: token_embd is [hidden, vocab].
        "vocab_size": int(fields.get(key("vocab_size"), shapes["token_embd.weight"][1])),
        "hidden_size": hidden,
        "intermediate_size": int(fields[key("feed_forward_length")]),
        "num_hidden_layers": int(fields[key("block_count")]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(fields.get(key("attention.head_count_kv"), heads)),
        "head_dim": int(fields.get(key("attention.key_length"), hidden // heads)),
        "hidden_act": "silu",
        "rms_norm_eps": _f32(fields[key("attention.layer_norm_rms_epsilon")]),
        "rope_theta": _f32(fields.get(key("rope.freq_base"), 10000.0)),
        "max_position_embeddings": int(fields[key("context_length")]),
        "tie_word_embeddings": "output.weight" not in shapes,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": fields.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": fields.get("tokenizer.ggml.eos_token_id"),
    }
    rope_scaling = _rope_scaling(fields, arch)
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    if key("expert_count") in fields:
        config.update(_moe_config(fields, arch, key))
    if arch in GEMMA:
        config.update(_gemma_config(fields, arch, key, config))
    return config


def _gemma_config(fields: dict, arch: str, key, config: dict) -> dict:
    """Gemma's fields as llama.cpp sets them (llama-model.cpp): every other layer windowed (Gemma 2)
    or all but every 6th (Gemma 3), unless the file lists them; Gemma 3's windowed layers on base
    10,000; queries scaled by head_dim ** -0.5, or by (hidden / heads) ** -0.5 on the 27B models
    (46 and 62 layers)."""
    layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
    pattern = fields.get(key("attention.sliding_window_pattern"))
    if isinstance(pattern, list):   # per layer: windowed or not
        sliding = [bool(p) for p in pattern]
    else:
        every = int(pattern) if pattern else {"gemma2": 2, "gemma3": 6}[arch]
        sliding = [i % every < every - 1 for i in range(layers)]
    big = layers == {"gemma2": 46, "gemma3": 62}[arch]
    gemma = {
        "hidden_act": "gelu_pytorch_tanh",
        "sliding_window": int(fields[key("attention.sliding_window")]),
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "query_pre_attn_scalar": config["hidden_size"] // heads if big else config["head_dim"],
        "attn_logit_softcapping": _optional_f32(fields.get(key("attn_logit_softcapping"))),
        "final_logit_softcapping": _optional_f32(fields.get(key("final_logit_softcapping"))),
    }
    if arch == "gemma3":
        gemma["rope_local_base_freq"] = 10000.0
    return gemma


def _end_ids(reader: GGUFReader, eos, text: str) -> list[int]:
    """The ends of generation: eos and, as llama.cpp adds by its text, the token `text` ending a
    chat turn (where instruction-tuned models stop)."""
    ends = [] if eos is None else [int(eos)]
    field = reader.fields.get("tokenizer.ggml.tokens")
    if field is not None:
        tokens = field.contents()
        end = tokens.index(text) if text in tokens else None
        if end is not None and end not in ends:
            ends.append(end)
    return ends


def _longrope(reader: GGUFReader, fields: dict, config: dict) -> dict:
    """Phi-3's rotated share of each head (`rope.dimension_count`), its window, and LongRoPE:
    llama.cpp stores the factors as tensors, beside the original context and attention factor."""
    rotated = int(fields.get("phi3.rope.dimension_count", config["head_dim"]))
    phi3 = {"partial_rotary_factor": rotated / config["head_dim"]}
    if "phi3.attention.sliding_window" in fields:
        phi3["sliding_window"] = int(fields["phi3.attention.sliding_window"])
    factors = {_LONGROPE_TENSORS[t.name]: [_f32(f) for f in np.asarray(t.data, np.float32)]
               for t in reader.tensors if t.name in _LONGROPE_TENSORS}
    if factors:
        original = int(fields["phi3.rope.scaling.original_context_length"])
        phi3["original_max_position_embeddings"] = original
        phi3["rope_scaling"] = {"rope_type": "longrope", **factors, "original_max_position_embeddings": original}
        if "phi3.rope.scaling.attn_factor" in fields:
            phi3["rope_scaling"]["attention_factor"] = _f32(fields["phi3.rope.scaling.attn_factor"])
    return phi3


def _optional_f32(value) -> float | None:
    return None if value is None else _f32(value)


def _moe_config(fields: dict, arch: str, key) -> dict:
    experts = {"num_experts_per_tok": int(fields[key("expert_used_count")]),
               "norm_topk_prob": NORM_TOPK_PROB[arch]}
    if arch == "llama":
        architecture, model_type = MIXTRAL
        return {"architectures": [architecture], "model_type": model_type,
                "num_local_experts": int(fields[key("expert_count")]), **experts}
    return {"num_experts": int(fields[key("expert_count")]),
            "moe_intermediate_size": int(fields[key("expert_feed_forward_length")]),
            "shared_expert_intermediate_size": int(fields.get(key("expert_shared_feed_forward_length"), 0)),
            **experts}


def _f32(value: float) -> float:
    """Return a GGUF float32 as the shortest decimal that round-trips (1e-05, not 9.9999997e-06)."""
    return float(str(np.float32(value)))


def _rope_scaling(fields: dict, arch: str) -> dict | None:
    """Return HF `rope_scaling` from the GGUF `<arch>.rope.scaling.*` keys, or None when absent."""
    kind = fields.get(f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    scaling = {"rope_type": kind, "factor": _f32(fields[f"{arch}.rope.scaling.factor"])}
    optional = {
        "original_max_position_embeddings": "rope.scaling.original_context_length",
        "attention_factor": "rope.scaling.attn_factor",
        "beta_fast": "rope.scaling.yarn_beta_fast",
        "beta_slow": "rope.scaling.yarn_beta_slow",
    }
    scaling.update({hf: fields[f"{arch}.{key}"] for hf, key in optional.items() if f"{arch}.{key}" in fields})
    return scaling


def _hf_tensors(tensor, weight, names: dict[str, str]):
    """(HF name, tensor) pairs for one GGUF tensor: itself, or each expert of a stacked one;
    `names`: the architecture's layer names (`_ARCH_LAYER_NAMES`)."""
    match = _LAYER_RE.fullmatch(tensor.name)
    if match is None or match[2] not in _EXPERT_NAMES:
        if match is not None and match[2] == "ffn_gate_inp_shexp" and not isinstance(weight, QuantizedTensor):
            weight = weight.reshape(1, -1)   # llama.cpp stores the shared expert's gate as a vector
        return [(_hf_name(tensor.name, names), weight)]
    experts = int(tensor.shape[2])

    def expert(e):
        if isinstance(weight, QuantizedTensor):   # its rows are the experts' rows end to end
            rows = weight.shape[0] // experts
            return weight.map_rows(lambda a: a[e * rows:(e + 1) * rows])
        return weight[e]

    return [(f"model.layers.{match[1]}.mlp.experts.{e}.{_EXPERT_NAMES[match[2]]}.{match[3]}", expert(e))
            for e in range(experts)]


def _hf_name(name: str, names: dict[str, str]) -> str:
    """Map a llama.cpp tensor name to its HF name."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    match = _LAYER_RE.fullmatch(name)
    if match is None or match[2] not in names:
        # e.g. rope_freqs.weight (Llama 3.1 rope scaling), which has no HF tensor.
        raise NotImplementedError(f"GGUF tensor {name!r} has no HF equivalent")
    return f"model.layers.{match[1]}.{names[match[2]]}.{match[3]}"


def _dequantize(tensor) -> np.ndarray:
    """Return one GGUF tensor as float32 in HF layout ([out, in] for matrices)."""
    qtype = GGMLQuantizationType(tensor.tensor_type)
    shape = tuple(int(d) for d in reversed(tensor.shape))
    return np.asarray(dequantize(tensor.data, qtype), dtype=np.float32).reshape(shape)


def _blocks(tensor, fmt: WeightFormat) -> QuantizedTensor:
    """A Q8_0 / Q4_0 / Q4_1 tensor's blocks of 32 along each row, without dequantising.

    Q8_0 is (f16 d, 32 x int8 q): w = q * d. Q4_0 is (f16 d, 16 bytes): w = (q - 8) * d. Q4_1 is
    (f16 d, f16 m, 16 bytes): w = q * d + m. A 4-bit block's byte j holds element j in its low
    nibble and element j + 16 in its high one.
    """
    rows = int(np.prod(tensor.shape[1:]))   # a stack of experts: their rows end to end
    data = np.asarray(tensor.data, np.uint8).reshape(rows, -1)
    header = {"Q8_0": 2, "Q4_0": 2, "Q4_1": 4}[fmt.name]
    block_bytes = header + (32 if fmt.name == "Q8_0" else 16)
    blocks = data.reshape(rows, -1, block_bytes)
    scale = blocks[..., :2].copy().view(np.float16)[..., 0]
    body = blocks[..., header:]
    if fmt.name == "Q8_0":
        return QuantizedTensor(fmt, body.copy().view(np.int8).reshape(rows, -1), scale)
    q = np.concatenate([body & 0xF, body >> 4], axis=-1).reshape(rows, -1)
    if fmt.name == "Q4_1":
        minimum = blocks[..., 2:4].copy().view(np.float16)[..., 0]
    else:
        minimum = (scale * np.float16(-8)).astype(np.float16)
    return QuantizedTensor(fmt, q, scale, minimum)


def _unpermute(name: str, weight: np.ndarray, config: dict) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation, which interleaves each head's rotary pairs."""
    if name.endswith("q_proj.weight"):
        heads = config["num_attention_heads"]
    elif name.endswith("k_proj.weight"):
        heads = config["num_key_value_heads"]
    else:
        return weight
    out, inp = weight.shape
    # GGUF rows per head are (pair index, member); HF's rotate-half wants (member, pair index).
    return weight.reshape(heads, out // heads // 2, 2, inp).swapaxes(1, 2).reshape(out, inp)
