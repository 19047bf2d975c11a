"""Quantized Hugging Face checkpoints (`jaxserve.checkpoint.hf_quantized`): compressed-tensors
checkpoints written here in the library's packing, read by transformers (with the
compressed-tensors package) as the oracle; the ones transformers does not read here (asymmetric
pack-quantized: it expects an unpacked zero point its own decompressor refuses; int-quantized
weight-only; AWQ, whose kernels need a GPU) against a float checkpoint of the same weights dequantised in numpy."""

import json
import shutil

import ml_dtypes
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from safetensors.numpy import load_file, save_file

from jaxserve.checkpoint.loader import load_model
from jaxserve.convert import convert

from test_llama import _paged_logits

PROMPT = list(range(3, 40))
CONTINUATION = [7, 9, 11]
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _pack(unsigned: np.ndarray, bits: int) -> np.ndarray:
    """[rows, cols] of 0..2^bits-1 -> int32 [rows, cols * bits / 32], element i at bits i * bits."""
    per = 32 // bits
    u = unsigned.astype(np.uint64).reshape(unsigned.shape[0], -1, per)
    words = sum(u[:, :, i] << np.uint64(bits * i) for i in range(per))
    return words.astype(np.uint32).view(np.int32)


def _int_quantize(w: np.ndarray, bits: int, group: int, symmetric: bool, scale_dtype=np.float32):
    """compressed-tensors' arithmetic: signed q and zero point, w ~ (q - z) * s, s in `scale_dtype`."""
    out, inp = w.shape
    g = w.reshape(out, inp // (group or inp), -1)
    top = 1 << (bits - 1)
    if symmetric:
        s = np.abs(g).max(-1) / (top - 1)
        z = np.zeros_like(s)
    else:
        low, high = g.min(-1), g.max(-1)
        s = (high - low) / (2 * top - 1)
        z = np.clip(np.rint(-top - low / s), -top, top - 1)
    q = np.clip(np.rint(g / s[..., None] + z[..., None]), -top, top - 1)
    s = s.astype(scale_dtype).astype(np.float32)
    return q.reshape(out, inp), s, z, ((q - z[..., None]) * s[..., None]).reshape(out, inp)


def _compressed_tensors(w: np.ndarray, scheme: str) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """One module's tensors in `scheme`, and the weight they stand for."""
    if scheme.startswith("fp8"):
        s = (np.abs(w).max(axis=1, keepdims=True) if scheme == "fp8-channel" else np.abs(w).max().reshape(1)) / 448
        q = (w / s).astype(ml_dtypes.float8_e4m3fn)
        return {"weight": q, "weight_scale": s.astype(np.float32)}, q.astype(np.float32) * s
    bits, group = {"w8-channel": (8, 0), "w4-group": (4, 32), "w4-asym": (4, 32), "int8-naive": (8, 0)}[scheme]
    q, s, z, reference = _int_quantize(w, bits, group, symmetric=scheme != "w4-asym")
    if scheme == "int8-naive":
        return {"weight": q.astype(np.int8), "weight_scale": s}, reference
    top = 1 << (bits - 1)
    parts = {"weight_packed": _pack(q + top, bits), "weight_scale": s, "weight_shape": np.array(w.shape)}
    if scheme == "w4-asym":
        parts["weight_zero_point"] = _pack((z + top).T, bits).T.copy()   # packed along `out`
    return parts, reference


CT_CONFIG = {  # scheme -> (format, weights args)
    "w8-channel": ("pack-quantized", dict(num_bits=8, type="int", symmetric=True, strategy="channel")),
    "w4-group": ("pack-quantized", dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32)),
    "w4-asym": ("pack-quantized", dict(num_bits=4, type="int", symmetric=False, strategy="group", group_size=32)),
    "int8-naive": ("int-quantized", dict(num_bits=8, type="int", symmetric=True, strategy="channel")),
    "fp8-channel": ("float-quantized", dict(num_bits=8, type="float", symmetric=True, strategy="channel")),
    "fp8-tensor": ("float-quantized", dict(num_bits=8, type="float", symmetric=True, strategy="tensor")),
}


def _awq(w: np.ndarray, group: int = 32) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """AutoAWQ's gemm packing of an `[out, in]` weight: eight columns a word, in the order 0 2 4 6 1 3 5 7."""
    q, s, z, reference = _int_quantize(w, 4, group, symmetric=False, scale_dtype=np.float16)
    q, z = (q + 8).T, (z + 8).T   # [in, out], [groups, out] unsigned

    def pack(a):
        words = np.zeros((a.shape[0], a.shape[1] // 8), np.uint32)
        for i, column in enumerate((0, 2, 4, 6, 1, 3, 5, 7)):
            words |= a[:, column::8].astype(np.uint32) << np.uint32(4 * i)
        return words.view(np.int32)

    return {"qweight": pack(q), "qzeros": pack(z), "scales": s.T.astype(np.float16)}, reference


def _write_quantized(directory, out, module_tensors, quantization_config):
    """A copy of the float checkpoint in `directory` whose projections `module_tensors` replaces
    (weight -> (parts, reference)); returns the float checkpoint of the reference weights too."""
    weights = load_file(directory / "model.safetensors")
    quantized, reference = {}, {}
    for name, w in weights.items():
        module = name[:-len(".weight")]
        if module.rsplit(".", 1)[-1] in PROJECTIONS:
            parts, reference[name] = module_tensors(w.astype(np.float32))
            quantized.update({f"{module}.{part}": a for part, a in parts.items()})
        else:
            quantized[name] = reference[name] = w
    for target, tensors in ((out / "quantized", quantized), (out / "reference", reference)):
        shutil.copytree(directory, target)
        save_file({k: np.ascontiguousarray(v.astype(np.float32) if v.dtype == np.float64 else v)
                   for k, v in tensors.items()}, target / "model.safetensors")
    config = json.loads((directory / "config.json").read_text())
    (out / "quantized" / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}))
    return out / "quantized", out / "reference"


def _ct_config(scheme: str) -> dict:
    fmt, weights = CT_CONFIG[scheme]
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "ignore": ["lm_head"], "config_groups": {"group_0": {
                "targets": ["Linear"], "input_activations": None, "output_activations": None,
                "weights": {"group_size": None, "dynamic": False, "observer": "minmax", **weights}}}}


def _projection_bytes(model) -> int:
    return sum(v.get_value().nbytes for path, v in nnx.to_flat_state(model.params) if path[:2] in {("layers", p) for p in PROJECTIONS})


def _logits(path, quantization="auto"):
    model = load_model(str(path), "float32", quantization=quantization)
    return model, np.concatenate(_paged_logits(model, PROMPT, CONTINUATION))


@pytest.mark.parametrize("variant, scheme", [("llama", "w8-channel"), ("llama", "w4-group"), ("llama", "fp8-channel"),
                                             ("llama", "fp8-tensor"), ("qwen2", "w4-group"), ("qwen3", "w4-group")])
def test_compressed_tensors_checkpoints_give_transformers_logits(variant, scheme, tiny_models, tmp_path):
    directory, _ = tiny_models(variant)
    quantized, _ = _write_quantized(directory, tmp_path, lambda w: _compressed_tensors(w, scheme), _ct_config(scheme))
    model, ours = _logits(quantized)
    kind = {"w8": "int8", "w4": "uint4", "fp": "fp8"}[scheme[:2]]
    assert {f.kind for f in model.formats.values()} == {kind}
    # qwen3's o_proj has 4 x 24 inputs: an odd number of groups (three of 32), whose nibbles pack by
    # pairs of rows all the same; qwen2's biases stay float beside their quantized weights.
    assert set(model.formats) == {f"layers/{p}" for p in PROJECTIONS}
    oracle = transformers.AutoModelForCausalLM.from_pretrained(quantized).eval()
    with torch.no_grad():
        reference = oracle(torch.tensor([PROMPT + CONTINUATION])).logits[0].numpy()
    np.testing.assert_allclose(ours, reference, atol=1e-4, rtol=0)   # prefill rows, then the decode steps


@pytest.mark.parametrize("kind", ["w4-asym", "int8-naive", "awq"])
def test_zero_point_checkpoints_equal_their_dequantised_weights(kind, tiny_models, tmp_path):
    directory, _ = tiny_models("llama")
    if kind == "awq":
        config = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}
        quantized, reference = _write_quantized(directory, tmp_path, _awq, config)
    else:
        quantized, reference = _write_quantized(directory, tmp_path, lambda w: _compressed_tensors(w, kind),
                                                _ct_config(kind))
    model, ours = _logits(quantized)
    names = {"w4-asym": "compressed-tensors int4", "int8-naive": "compressed-tensors int8", "awq": "AWQ int4"}
    assert {f.name for f in model.formats.values()} == {names[kind]}
    floats, expected = _logits(reference)
    assert _projection_bytes(model) < 0.3 * _projection_bytes(floats)
    np.testing.assert_allclose(ours, expected, atol=1e-4, rtol=0)
    _, dequantised = _logits(quantized, "none")   # the same weights, dequantised at load
    np.testing.assert_allclose(dequantised, expected, atol=1e-4, rtol=0)


def test_a_compressed_tensors_checkpoint_converts_and_loads_bit_identical(tiny_models, tmp_path):
    directory, _ = tiny_models("llama")
    quantized, _ = _write_quantized(directory, tmp_path, lambda w: _compressed_tensors(w, "w4-group"),
                                    _ct_config("w4-group"))
    restored = load_model(str(convert(str(quantized), tmp_path / "out")), "float32")
    direct = load_model(str(quantized), "float32")
    assert restored.formats == direct.formats
    for (path, x), (_, y) in zip(nnx.to_flat_state(direct.params), nnx.to_flat_state(restored.params)):
        np.testing.assert_array_equal(np.asarray(x.get_value()), np.asarray(y.get_value()), err_msg=str(path))


@pytest.mark.parametrize("change, message", [
    ({"quant_method": "gptq"}, "quant_method 'gptq'"),
    ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes'"),
    ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"},
     "compressed-tensors format 'nvfp4-pack-quantized'"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {"g": {"weights": {"num_bits": 8, "type": "float", "strategy": "block"}}}},
     "config_groups.g.weights strategy 'block'"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {"g": {"weights": {"num_bits": 2, "type": "int", "strategy": "group"}}}},
     "type/num_bits 'int2'"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "AWQ version 'gemv'"),
])
def test_formats_we_do_not_read_are_refused_by_name(change, message, tiny_models, tmp_path):
    directory, _ = tiny_models("llama")
    bad = tmp_path / "bad"
    shutil.copytree(directory, bad)
    config = json.loads((directory / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "quantization_config": change}))
    with pytest.raises(ValueError, match=message):
        load_model(str(bad), "float32")
