"""Configs: the model's shape (read from a Hugging Face config.json) and the engine's knobs.

Every config is a frozen dataclass validated in `__post_init__`; the CLI flags map onto the
fields of `EngineConfig` one to one.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Any


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling: Llama 3's (`rope_type: llama3`) or Phi-3's LongRoPE (`longrope`:
    per-frequency factors, `short_factor` below `original_max_position_embeddings` and
    `long_factor` from there, cos and sin scaled by `attention_factor`)."""

    original_max_position_embeddings: int
    kind: str = "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 1.0
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The shape of a Llama-architecture decoder, parsed from an HF `config.json`."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int            # the dense MLP's; in a mixture of experts the shared expert's (0: none)
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    rope_scaling: RopeScaling | None = None
    rotary_dim: int = 0               # the leading head dims RoPE rotates (0: all; Phi's partial_rotary_factor)
    sliding_window: int | None = None  # each query sees the last `sliding_window` keys (itself included)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Mixture of experts (every layer; 0 experts: a dense MLP): each token's MLP is the weighted
    # sum of its `num_experts_per_tok` experts of `moe_intermediate_size`, plus a shared expert
    # under a sigmoid gate where `intermediate_size` is set (Qwen2-MoE)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False      # renormalise the k routing weights to sum to 1
    # Gemma 2 / 3 (and Qwen with `use_sliding_window`): layers whose attention is windowed (the rest
    # see everything; empty: every layer when `sliding_window` is set); Gemma 3: their RoPE base
    # (None: `rope_theta`, unscaled otherwise)
    sliding_layers: tuple[bool, ...] = ()
    local_rope_theta: float | None = None
    gemma: bool = False               # RMSNorm by (1 + w), embeddings times sqrt(hidden), norms
                                      # after attention and MLP too (before the residual add)
    hidden_act: str = "silu"          # silu | gelu_tanh (the MLP's gate)
    query_pre_attn_scalar: float | None = None   # scores scaled by its -1/2 (None: head_dim's)
    attn_logit_softcapping: float | None = None  # scores -> cap * tanh(scores / cap)
    final_logit_softcapping: float | None = None

    def __post_init__(self):
        _require(self.num_heads % self.num_kv_heads == 0,
                 f"num_attention_heads={self.num_heads} must be a multiple of "
                 f"num_key_value_heads={self.num_kv_heads}")
        _require(self.head_dim % 2 == 0, f"head_dim={self.head_dim} must be even for RoPE")
        _require(self.sliding_window is None or self.sliding_window >= 1,
                 f"sliding_window={self.sliding_window} must be at least 1 (or none)")
        _require(self.rotary_dim % 2 == 0 and self.rotary_dim <= self.head_dim,
                 f"rotary_dim={self.rotary_dim} must be even and at most head_dim={self.head_dim}")
        _require(not self.sliding_layers or len(self.sliding_layers) == self.num_layers,
                 f"sliding_layers has {len(self.sliding_layers)} entries for {self.num_layers} layers")
        _require(self.hidden_act in HIDDEN_ACTS, f"hidden_act={self.hidden_act!r} is not one of {HIDDEN_ACTS}")
        _require(not self.num_experts or 1 <= self.num_experts_per_tok <= self.num_experts,
                 f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, num_experts={self.num_experts}]")

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        """Reads the fields we need from a Hugging Face config dict (transformers 4 or 5 style)."""
        from jaxserve.models.registry import family_of  # the registry knows the per-family flags

        architecture = (hf.get("architectures") or ["?"])[0]
        family = family_of(architecture)
        heads = hf["num_attention_heads"]
        rope = dict(hf.get("rope_parameters") or {})
        legacy_scaling = hf.get("rope_scaling") or {}
        rope_theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        params = {"original_max_position_embeddings": hf.get("original_max_position_embeddings"),
                  "max_position_embeddings": hf.get("max_position_embeddings"), **legacy_scaling, **rope}
        scaling = _parse_rope_scaling(params)
        head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
        partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
        eos = hf.get("eos_token_id")
        moe = _read_moe(hf) if family.moe else {}
        gemma = _read_gemma(hf, rope) if family.gemma else {}
        if gemma:
            rope_theta, scaling = gemma.pop("rope_theta"), gemma.pop("rope_scaling")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        return cls(
            architecture=architecture,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=moe.pop("shared_size") if family.moe else hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=family.qkv_bias or bool(hf.get("attention_bias", False)),
            o_bias=bool(hf.get("attention_bias", False)) and not family.qkv_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=family.qk_norm,
            rope_scaling=scaling,
            rotary_dim=0 if partial == 1.0 else int(head_dim * partial),
            **_read_window(hf, family),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            **moe,
            **gemma,
        )


HIDDEN_ACTS = ("silu", "gelu_tanh")


def _read_gemma(hf: dict[str, Any], rope: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2 / 3's fields. Their windowed and full layers are listed in `layer_types` (or follow
    `sliding_window_pattern`); Gemma 3
    gives each kind its RoPE (transformers 5: `rope_parameters` per layer type; 4:
    `rope_theta` and `rope_scaling` for full layers, `rope_local_base_freq` for windowed ones)."""
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    _require(act in ("gelu_pytorch_tanh", "gelu_tanh"), f"hidden_activation={act!r} is not supported for Gemma; "
             "supported: gelu_pytorch_tanh")
    types = hf.get("layer_types")
    if not types:   # configs before `layer_types`: every `pattern`-th layer full (Gemma 2: 2, Gemma 3: 6)
        pattern = hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 2
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                 for i in range(hf["num_hidden_layers"])]
    if "full_attention" in rope:        # per layer type
        full, local = dict(rope["full_attention"]), dict(rope.get("sliding_attention") or {})
    else:
        full = {**(hf.get("rope_scaling") or {}), **rope}
        local = {"rope_theta": hf.get("rope_local_base_freq")} if hf.get("rope_local_base_freq") else {}
    full.setdefault("max_position_embeddings", hf.get("max_position_embeddings"))
    local_kind = local.get("rope_type", "default")
    _require(local_kind in (None, "default"), f"rope type {local_kind!r} of Gemma's windowed layers is not supported")
    return dict(gemma=True, hidden_act="gelu_tanh",
                sliding_layers=tuple(t == "sliding_attention" for t in types),
                local_rope_theta=float(local["rope_theta"]) if local.get("rope_theta") else None,
                query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar") or hf["head_dim"]),
                attn_logit_softcapping=hf.get("attn_logit_softcapping"),
                final_logit_softcapping=hf.get("final_logit_softcapping"),
                rope_theta=float(full.get("rope_theta", hf.get("rope_theta", 10000.0))),
                rope_scaling=_parse_rope_scaling(full))


def _read_moe(hf: dict[str, Any]) -> dict[str, Any]:
    """The mixture-of-experts fields of Mixtral, Qwen2-MoE and Qwen3-MoE configs. Layers that
    mix dense and sparse MLPs (`mlp_only_layers`, `decoder_sparse_step` > 1) are refused: every
    layer runs one program under `scan`."""
    _require(not hf.get("mlp_only_layers") and hf.get("decoder_sparse_step", 1) == 1,
             f"mlp_only_layers={hf.get('mlp_only_layers')} and decoder_sparse_step={hf.get('decoder_sparse_step')}: "
             "models with dense layers among the expert layers are not supported (every layer must be sparse)")
    mixtral = "moe_intermediate_size" not in hf
    return dict(num_experts=hf.get("num_local_experts") or hf["num_experts"],
                num_experts_per_tok=hf["num_experts_per_tok"],
                moe_intermediate_size=hf["intermediate_size"] if mixtral else hf["moe_intermediate_size"],
                norm_topk_prob=mixtral or bool(hf.get("norm_topk_prob", False)),
                shared_size=hf.get("shared_expert_intermediate_size") or 0)


def _read_window(hf: dict[str, Any], family) -> dict[str, Any]:
    """`sliding_window`, the context, and for Qwen the layers that take the window. Mistral,
    Phi-3 and Mixtral window every layer; Gemma lists its layers (`_read_gemma`). Qwen windows
    only with `use_sliding_window`, and then the layers `_qwen_window_layers` names."""
    window, length = hf.get("sliding_window") or None, hf.get("max_position_embeddings", 2048)
    if family.sliding_window or family.gemma:
        return dict(sliding_window=window, max_position_embeddings=length)
    if not family.qwen_windows or window is None or not hf.get("use_sliding_window", False):
        return dict(sliding_window=None, max_position_embeddings=length)
    layers = _qwen_window_layers(hf, family.qwen_windows)
    return dict(sliding_window=window if any(layers) else None, max_position_embeddings=length,
                sliding_layers=() if all(layers) or not any(layers) else layers)


def _qwen_window_layers(hf: dict[str, Any], rule: str) -> tuple[bool, ...]:
    """Which layers of a Qwen config with `use_sliding_window` are windowed, as transformers 5
    reads it (`Family.qwen_windows`): Qwen3-MoE every layer (it reads no `layer_types`); the
    others the layers `layer_types` names, and without it (configs written before transformers
    5) Qwen2-MoE the even layers below `max_window_layers`, dense Qwen those from it on."""
    num_layers = hf["num_hidden_layers"]
    if rule == "all":
        return (True,) * num_layers
    if hf.get("layer_types") is not None:
        return tuple(t == "sliding_attention" for t in hf["layer_types"])
    below = hf.get("max_window_layers", num_layers)
    if rule == "even_below_max":
        return tuple(i % 2 == 0 and i < below for i in range(num_layers))
    return tuple(i >= below for i in range(num_layers))


ROPE_TYPES = ("default", "linear", "llama3", "longrope")


def _parse_rope_scaling(params: dict[str, Any]) -> RopeScaling | None:
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in (None, "default"):
        return None
    _require(kind in ROPE_TYPES, f"rope scaling type {kind!r} is not supported; supported: {ROPE_TYPES}")
    if kind == "linear":   # positions divided by `factor` (Gemma 3's full layers)
        return RopeScaling(0, "linear", float(params["factor"]))
    original = int(params["original_max_position_embeddings"])
    if kind == "longrope":
        # As transformers: without `factor`, the context's growth over the original; the attention
        # factor from the paper unless given.
        factor = float(params.get("factor") or params["max_position_embeddings"] / original)
        attention = params.get("attention_factor")
        if attention is None:
            attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        return RopeScaling(original, "longrope", factor, short_factor=tuple(map(float, params["short_factor"])),
                           long_factor=tuple(map(float, params["long_factor"])), attention_factor=float(attention))
    return RopeScaling(original, "llama3", float(params["factor"]), float(params["low_freq_factor"]),
                       float(params["high_freq_factor"]))


def parse_mesh(text: str) -> tuple[int, int]:
    """'2x4' -> (data, model) = (2, 4): the one parser of `--mesh`."""
    match = re.fullmatch(r"(\d+)x(\d+)", text.strip())
    if not match or int(match[1]) < 1 or int(match[2]) < 1:
        raise ValueError(f"mesh={text!r} is not DxM with D, M >= 1 (data x model), e.g. 1x8 or 2x4")
    return int(match[1]), int(match[2])


def parse_size(text: str, name: str) -> int:
    """vLLM's human-readable sizes: '4k' = 4,000, '4K' = 4,096, '25.6k' = 25,600 (also m/M, g/G)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgKMG]?)", text.strip())
    if not match:
        raise ValueError(f"{name}={text!r} is not a number, optionally with k/m/g (x1000) or K/M/G (x1024)")
    unit = match[2]
    scale = 1 if not unit else (1000 if unit.islower() else 1024) ** ("kmg".index(unit.lower()) + 1)
    return int(float(match[1]) * scale)


SPECULATIVE_METHODS = ("ngram", "draft_model")   # jaxserve.engine.ngram_proposer, .draft_model


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `--speculative-config`: propose `num_speculative_tokens` tokens per decoding sequence
    and verify them in the next step (speculative decoding).

    ngram (prompt lookup): the tokens that followed the latest earlier occurrence of the sequence's
    last n tokens (prompt_lookup_max >= n >= prompt_lookup_min, longest first). draft_model: a
    smaller model (`model`: an HF directory, GGUF file or convert directory with the target's
    vocabulary) proposes them, one greedy or sampled token after another. Speculation pauses in a
    step of more than `disable_by_batch_size` sequences, where verifying costs more than it saves.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    model: str | None = None          # draft_model: the draft's checkpoint
    disable_by_batch_size: int = 8

    def __post_init__(self):
        _require(self.method in SPECULATIVE_METHODS,
                 f"speculative_config method={self.method!r} is not one of {SPECULATIVE_METHODS}")
        _require(1 <= self.num_speculative_tokens <= 16,
                 f"speculative_config num_speculative_tokens={self.num_speculative_tokens} must be in [1, 16]")
        _require(1 <= self.prompt_lookup_min <= self.prompt_lookup_max,
                 f"speculative_config prompt_lookup_min={self.prompt_lookup_min} and prompt_lookup_max="
                 f"{self.prompt_lookup_max} must satisfy 1 <= min <= max")
        _require(self.disable_by_batch_size >= 1,
                 f"speculative_config disable_by_batch_size={self.disable_by_batch_size} must be >= 1")
        _require((self.model is not None) == (self.method == "draft_model"),
                 f"speculative_config model={self.model!r}: method draft_model needs a model and "
                 f"method {self.method!r} takes none")

    @classmethod
    def parse(cls, given: "SpeculativeConfig | dict | str") -> "SpeculativeConfig":
        """From a config, a dict or vLLM's JSON text; an unknown key names the known ones. A model
        without a method is a draft model, as in vLLM."""
        if isinstance(given, cls):
            return given
        if isinstance(given, str):
            try:
                given = json.loads(given)
            except json.JSONDecodeError as error:
                raise ValueError(f"speculative_config={given!r} is not JSON: {error}") from None
        if not isinstance(given, dict):
            raise ValueError(f"speculative_config={given!r} must be a JSON object")
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(given) - set(known))
        _require(not unknown, f"speculative_config has unknown keys {unknown}; known: {known}")
        for key, value in given.items():
            kind = str if key in ("method", "model") else int
            _require(isinstance(value, kind) and not isinstance(value, bool),
                     f"speculative_config {key}={value!r} must be {'a string' if kind is str else 'an integer'}")
        if "model" in given and "method" not in given:
            given = {**given, "method": "draft_model"}
        return cls(**given)


PIPELINE_ADVICE = ("jaxserve splits a model over devices by tensor parallelism; give --tensor-parallel-size "
                   "(or --mesh DxM) across a host's devices, with --num-processes for several hosts")
DTYPES = ("auto", "float32", "bfloat16", "float16")
SCHEDULING_POLICIES = ("fcfs", "priority")
ATTENTION_BACKENDS = ("auto", "xla", "pallas")
QUANTIZATIONS = ("auto", "none", "int8", "fp8", "int4")    # see jaxserve.quantization
KV_CACHE_DTYPES = ("auto", "int8", "fp8", "fp8_e4m3")       # see jaxserve.engine.kv_pages


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs besides the weights. `None` means: derive it at load time."""

    model: str | None = None              # HF dir, .gguf file, jaxserve.convert dir; None: embedded SmolLM2
    dtype: str = "auto"                   # auto: float32 on CPU, bfloat16 on TPU/GPU
    quantization: str = "auto"            # weights: auto (the checkpoint's), none, int8, fp8, int4
    kv_cache_dtype: str = "auto"          # KV pages: auto (the compute dtype), int8, fp8 (fp8_e4m3)
    max_model_len: int | None = None      # default: the model's context length (also "4k", "32K")
    page_size: int = 16                   # tokens per KV page
    gpu_memory_utilization: float | None = None   # vLLM's: the share of each device's memory for weights,
                                          # steps and KV pool (default 0.9 on TPU/GPU; on CPU only if given)
    kv_cache_memory_bytes: int | None = None   # KV pool size in bytes (also "8G"), over all devices
    kv_cache_gb: float | None = None      # KV pool size in GiB; none: from the budget above (CPU: 1 GiB)
    num_pages: int | None = None          # exact KV pool size in pages (tests); wins over the three above
    max_num_seqs: int = 32                # sequences per step
    max_num_batched_tokens: int = 512     # tokens per step (prefill chunks + decodes)
    prefill_segment: int = 16             # query tokens per prefill segment in the attention layout
    attention_backend: str = "auto"       # auto: pallas on TPU and GPU, xla on CPU
    seed: int = 0                         # seeds requests that give no seed of their own
    enable_prefix_caching: bool = True    # reuse the KV pages of earlier requests' common prefixes
    enable_chunked_prefill: bool = True   # split prompts over steps; off: a prompt is prefilled in one
    async_scheduling: bool = True         # schedule and launch step N+1 before step N is read back
    compile_in_background: bool = False   # serve once the largest and smallest steps compile; the rest
                                          # compile meanwhile, steps padded to a compiled one until then
    enforce_eager: bool = False           # vLLM's: no start-up compile; each step shape compiles when a
                                          # step first needs it (wins over compile_in_background)
    speculative_config: SpeculativeConfig | None = None   # vLLM's: speculative decoding (also a dict or
                                          # its JSON text, e.g. '{"method": "ngram", "num_speculative_tokens": 4}')
    enable_lora: bool = False             # serve LoRA adapters (PEFT) beside the base model
    max_loras: int = 1                    # adapters resident on the device at once (slots)
    max_lora_rank: int = 16               # the largest adapter rank; slots are padded to it
    max_cpu_loras: int | None = None      # adapters kept in host memory (LRU); default max_loras
    scheduling_policy: str = "fcfs"       # fcfs, or priority (lower runs sooner, fcfs within a level)
    priority_max_wait_steps: int = 256    # steps a request may wait before it outranks every priority
    max_structured_output_bytes: int = 65536   # largest JSON schema, regex, grammar or choice list
    mesh: str | None = None               # DxM devices: data x model (tensor) parallel; default from
                                          # the two sizes below (1x1 without them)
    tensor_parallel_size: int | None = None   # vLLM's -tp: the mesh's M
    data_parallel_size: int | None = None     # vLLM's -dp: the mesh's D
    pipeline_parallel_size: int = 1       # vLLM's -pp: only 1 (see PIPELINE_ADVICE)
    distributed_executor_backend: str | None = None   # vLLM's; only "uni" (one process drives a host's devices)
    coordinator_address: str | None = None  # HOST:PORT of process 0, for several processes (hosts)
    num_processes: int = 1                # processes (hosts) the mesh spans
    process_id: int = 0                   # this process; 0 serves HTTP and schedules
    distributed_key_dir: str | None = None   # CURVE keys of the processes' channel (process-I.key[_secret])
    insecure_distributed: bool = False    # several processes without keys: an unauthenticated channel

    def _resolve_mesh(self) -> None:
        """mesh from -dp/-tp when not given; when both are given they must agree."""
        for name in ("tensor_parallel_size", "data_parallel_size"):
            value = getattr(self, name)
            _require(value is None or value >= 1, f"{name}={value} must be >= 1")
        if self.mesh is None:
            object.__setattr__(self, "mesh", f"{self.data_parallel_size or 1}x{self.tensor_parallel_size or 1}")
            return
        data, model = parse_mesh(self.mesh)
        for name, size, flag in (("tensor_parallel_size", model, "M"), ("data_parallel_size", data, "D")):
            given = getattr(self, name)
            _require(given is None or given == size,
                     f"{name}={given} disagrees with mesh={self.mesh} (its {flag} is {size}): give one of them")

    def __post_init__(self):
        _require(self.dtype in DTYPES, f"dtype={self.dtype!r} is not one of {DTYPES}")
        _require(self.quantization in QUANTIZATIONS,
                 f"quantization={self.quantization!r} is not one of {QUANTIZATIONS}")
        _require(self.kv_cache_dtype in KV_CACHE_DTYPES,
                 f"kv_cache_dtype={self.kv_cache_dtype!r} is not one of {KV_CACHE_DTYPES}")
        _require(self.page_size >= 1 and self.page_size & (self.page_size - 1) == 0,
                 f"page_size={self.page_size} must be a power of two >= 1")
        _require(self.kv_cache_gb is None or self.kv_cache_gb > 0, f"kv_cache_gb={self.kv_cache_gb} must be > 0")
        _require(self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes >= 1,
                 f"kv_cache_memory_bytes={self.kv_cache_memory_bytes} must be >= 1")
        _require(self.gpu_memory_utilization is None or 0 < self.gpu_memory_utilization <= 1,
                 f"gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]")
        _require(self.num_pages is None or self.num_pages >= 2,
                 f"num_pages={self.num_pages} must be >= 2 (page 0 is reserved for padding)")
        _require(self.max_num_seqs >= 1, f"max_num_seqs={self.max_num_seqs} must be >= 1")
        _require(self.max_model_len is None or self.max_model_len >= 1,
                 f"max_model_len={self.max_model_len} must be >= 1")
        _require(self.prefill_segment >= 1 and self.prefill_segment & (self.prefill_segment - 1) == 0,
                 f"prefill_segment={self.prefill_segment} must be a power of two >= 1")
        _require(self.max_num_batched_tokens >= self.prefill_segment,
                 f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= "
                 f"prefill_segment={self.prefill_segment}")
        _require(self.scheduling_policy in SCHEDULING_POLICIES,
                 f"scheduling_policy={self.scheduling_policy!r} is not one of {SCHEDULING_POLICIES}")
        _require(self.priority_max_wait_steps >= 1,
                 f"priority_max_wait_steps={self.priority_max_wait_steps} must be >= 1")
        _require(self.enable_chunked_prefill or self.max_model_len is None
                 or self.max_num_batched_tokens >= self.max_model_len,
                 f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= max_model_len="
                 f"{self.max_model_len} when chunked prefill is off (a prompt is prefilled in one step)")
        _require(self.num_processes >= 1, f"num_processes={self.num_processes} must be >= 1")
        _require(0 <= self.process_id < self.num_processes,
                 f"process_id={self.process_id} is outside [0, num_processes={self.num_processes})")
        _require(self.num_processes == 1 or re.fullmatch(r".+:\d+", self.coordinator_address or "") is not None,
                 f"coordinator_address={self.coordinator_address!r} must be HOST:PORT when num_processes="
                 f"{self.num_processes} > 1")
        _require(self.num_processes == 1 or self.distributed_key_dir is not None or self.insecure_distributed,
                 f"num_processes={self.num_processes} needs distributed_key_dir (make the keys with `jaxserve "
                 f"keys DIR --num-processes {self.num_processes}`), or insecure_distributed "
                 f"for a channel anyone who reaches it can read and drive")
        _require(self.max_structured_output_bytes >= 1,
                 f"max_structured_output_bytes={self.max_structured_output_bytes} must be >= 1")
        if self.speculative_config is not None:
            object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        _require(self.max_loras >= 1, f"max_loras={self.max_loras} must be >= 1")
        _require(self.max_lora_rank >= 1, f"max_lora_rank={self.max_lora_rank} must be >= 1")
        if self.max_cpu_loras is None:
            object.__setattr__(self, "max_cpu_loras", self.max_loras)
        _require(self.max_cpu_loras >= self.max_loras,
                 f"max_cpu_loras={self.max_cpu_loras} must be >= max_loras={self.max_loras}: a resident "
                 f"adapter is also kept in host memory")
        if isinstance(self.max_model_len, str):
            object.__setattr__(self, "max_model_len", parse_size(self.max_model_len, "max_model_len"))
        self._resolve_mesh()
        data, model = parse_mesh(self.mesh)
        _require(data * model % self.num_processes == 0,
                 f"mesh={self.mesh} has {data * model} devices, which do not split evenly over "
                 f"num_processes={self.num_processes}")
        _require(self.pipeline_parallel_size == 1,
                 f"pipeline_parallel_size={self.pipeline_parallel_size} is not supported: {PIPELINE_ADVICE}")
        _require(self.distributed_executor_backend in (None, "uni"),
                 f"distributed_executor_backend={self.distributed_executor_backend!r} is not supported: one "
                 f"process drives all of a host's devices ('uni'); for several hosts give --num-processes, "
                 f"--process-id and --coordinator-address")
        _require(self.attention_backend in ATTENTION_BACKENDS,
                 f"attention_backend={self.attention_backend!r} is not one of {ATTENTION_BACKENDS}")
