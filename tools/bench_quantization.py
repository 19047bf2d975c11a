"""Accuracy of quantized weights and KV caches against float32, on one fixed text.

    python tools/bench_quantization.py                     # every configuration, the whole text
    python tools/bench_quantization.py --tokens 512 --config int8 --config kv-int8

For each configuration the embedded SmolLM2 (or --model) scores `tools/data/accuracy_text.txt`
teacher-forced, and the table compares its next-token predictions with the float32 model's
(weights dequantised from the same checkpoint, float32 KV cache): top-1 agreement, mean KL
divergence (nats) and the perplexity ratio. The README quotes its table; the thresholds in
tests/test_quantization_accuracy.py are set from it.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

TEXT = pathlib.Path(__file__).with_name("data") / "accuracy_text.txt"

# name -> (--quantization, --kv-cache-dtype)
CONFIGS = {
    "float32": ("none", "auto"),
    "int8": ("int8", "auto"),
    "fp8": ("fp8", "auto"),
    "int4": ("int4", "auto"),
    "native": ("auto", "auto"),       # the checkpoint's own formats (SmolLM2: Q4_1 layers, Q8_0 embedding)
    "kv-int8": ("none", "int8"),
    "kv-fp8": ("none", "fp8"),
}
CHUNK = 256


def score(model, kv_cache_dtype: str, tokens: list[int]):
    """Teacher-forced logits over `tokens`, a chunk at a time, and the model's weight bytes."""
    from jaxserve.engine.runner import Runner

    page_size = 16
    runner = Runner(model, pages_per_slice=len(tokens) // page_size + 2, page_size=page_size,
                    max_model_len=len(tokens) + page_size, max_num_seqs=1, max_num_batched_tokens=CHUNK,
                    prefill_segment=16, kv_cache_dtype=kv_cache_dtype)
    return runner.prompt_logits(tokens, CHUNK), model.weight_bytes


def measure(model_path, names: list[str], tokens: list[int]) -> list[dict]:
    import numpy as np

    from jaxserve.checkpoint.loader import load_model
    from jaxserve.evaluation import Agreement

    models = {}   # --quantization -> the model, loaded once (the float one serves three configs)

    def scored(name):
        quantization, kv_cache_dtype = CONFIGS[name]
        if quantization not in models:
            models[quantization] = load_model(model_path, "float32", quantization=quantization)
        return score(models[quantization], kv_cache_dtype, tokens)

    reference = list(scored("float32")[0])
    next_tokens = np.asarray(tokens[1:])
    results = []
    for name in names:
        started = time.perf_counter()
        chunks, weight_bytes = scored(name)
        agreement = Agreement()
        for i, (ref, logits) in enumerate(zip(reference, chunks)):
            targets = next_tokens[i * CHUNK:(i + 1) * CHUNK]
            agreement.add(ref[:len(targets)], logits[:len(targets)], targets)
        results.append({"config": name, "quantization": CONFIGS[name][0], "kv_cache_dtype": CONFIGS[name][1],
                        "weight_mib": weight_bytes / 2**20, "positions": agreement.positions,
                        "top1_agreement": agreement.top1, "mean_kl": agreement.mean_kl,
                        "perplexity": agreement.perplexity, "perplexity_ratio": agreement.perplexity_ratio,
                        "seconds": time.perf_counter() - started})
    return results


def print_table(results: list[dict]) -> None:
    print(f"\n{'config':<10}{'weights':>9}{'kv cache':>10}{'MiB':>8}{'top-1 agree':>13}{'mean KL':>10}"
          f"{'ppl':>8}{'ppl ratio':>11}")
    for r in results:
        print(f"{r['config']:<10}{r['quantization']:>9}{r['kv_cache_dtype']:>10}{r['weight_mib']:>8.1f}"
              f"{100 * r['top1_agreement']:>12.2f}%{r['mean_kl']:>10.5f}{r['perplexity']:>8.3f}"
              f"{r['perplexity_ratio']:>11.4f}")
    print(f"({results[0]['positions']} predicted positions of {TEXT.name})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    parser.add_argument("--config", action="append", choices=sorted(CONFIGS), help="repeatable; default: all")
    parser.add_argument("--tokens", type=int, default=None, help="score only the text's first N tokens")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    from jaxserve.checkpoint.loader import resolve_model_path
    from jaxserve.tokenizer import load_tokenizer

    tokens = load_tokenizer(resolve_model_path(args.model)).encode(TEXT.read_text(), add_special_tokens=False)
    tokens = tokens[:args.tokens] if args.tokens else tokens
    results = measure(args.model, args.config or list(CONFIGS), tokens)
    print_table(results)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
