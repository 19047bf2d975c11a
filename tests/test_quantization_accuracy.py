"""Quantized weights and KV caches stay within measured bounds of float32 on the embedded SmolLM2,
scored by `tools/bench_quantization.py` over the first 512 tokens of its text.

Measured (2026-12-02, 511 positions): top-1 agreement / mean KL / perplexity ratio
  int8 weights 96.9% / 0.0031 / 0.994     fp8 weights 93.2% / 0.0210 / 1.032
  native Q4_1  100%  / 0.0000 / 1.000     (the GGUF's own weights, without a float copy)
  int8 KV      97.9% / 0.0009 / 1.001     fp8 KV      93.9% / 0.0084 / 1.014
(On the first 768 tokens, 2026-12-01: 96.5 / 92.7 / 100 / 98.3 / 93.5% top-1.)
The bounds leave room for another CPU's float rounding, not for a regression.
"""

import importlib.util
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[1] / "tools" / "bench_quantization.py"

# config -> (least top-1 agreement, most mean KL, most perplexity ratio)
BOUNDS = {
    "int8": (0.95, 0.006, 1.01),
    "fp8": (0.90, 0.035, 1.06),
    "native": (0.995, 1e-4, 1.001),
    "kv-int8": (0.96, 0.002, 1.005),
    "kv-fp8": (0.90, 0.02, 1.04),
}


@pytest.mark.slow
def test_accuracy_against_float32_stays_within_the_measured_bounds(smollm2_tokenizer):
    spec = importlib.util.spec_from_file_location("bench_quantization", TOOL)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    tokens = smollm2_tokenizer.encode(tool.TEXT.read_text(), add_special_tokens=False)
    assert len(tokens) >= 2000   # the text the README's table is measured on
    results = {r["config"]: r for r in tool.measure(None, list(BOUNDS), tokens[:512])}
    for name, (top1, kl, ppl_ratio) in BOUNDS.items():
        r = results[name]
        assert r["top1_agreement"] >= top1, (name, r)
        assert r["mean_kl"] <= kl, (name, r)
        assert r["perplexity_ratio"] <= ppl_ratio, (name, r)
    assert results["native"]["weight_mib"] < results["int8"]["weight_mib"] / 2
