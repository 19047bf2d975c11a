"""Mixture of experts, timed two ways in one run.

1. The expert layer alone (jaxserve/models/layers/moe.py): ragged (`jax.lax.ragged_dot` over the
   pairs grouped by expert) and tiled (a loop over row tiles within one expert, the CPU's method)
   against the dense one-hot reference (every token through every
   expert) and against a dense SwiGLU MLP of the active width (k x the expert's), per step size.
2. With --models: a random Mixtral-shaped MoE (8 experts, top-2, hidden 512, 8 layers) and a dense
   Llama of the same active parameters (MLP width 2 x the expert's), both written by transformers,
   served by `jaxserve bench offline` over the same workload, float and int8 weights; the MoE also
   on a 1x2 mesh (experts split over `model`) against 1x1.

    python tools/bench_moe.py                           # the layer table
    python tools/bench_moe.py --models --limit 16       # and the models (a few minutes)
"""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bench_lora import timed   # tools/ is the script's directory
from jaxserve.models.layers.moe import dense_experts, route, routed_experts

WORKLOAD = Path(__file__).resolve().parents[2] / "shared" / "workloads" / "anchor-64.jsonl"


def dense_mlp(x, gate, up, down):
    return (jax.nn.silu(x @ gate) * (x @ up)) @ down


def layer_table(args) -> None:
    rng = np.random.default_rng(0)
    e, d, f, k = args.experts, args.hidden, args.expert_ffn, args.top_k

    def weights(*shape):
        return jnp.asarray(rng.normal(size=shape).astype(np.float32) / shape[-2] ** 0.5)

    gate, up, down, router = weights(e, d, f), weights(e, d, f), weights(e, f, d), weights(d, e)
    active = weights(d, k * f), weights(d, k * f), weights(k * f, d)
    ragged = jax.jit(functools.partial(routed_experts, method="ragged"))
    tiled = jax.jit(functools.partial(routed_experts, method="tiled"))
    dense, mlp = jax.jit(dense_experts), jax.jit(dense_mlp)
    print(f"experts {e} top-{k}, hidden {d}, expert width {f}; ms per call (median of {args.repeat})")
    print(f"{'tokens':>7}{'ragged':>10}{'tiled':>10}{'one-hot':>10}{'dense k*f':>11}{'one-hot/tiled':>15}"
          f"{'tiled/dense':>13}")
    for tokens in args.tokens:
        x = jnp.asarray(rng.normal(size=(tokens, d)).astype(np.float32))
        w, ids = route(x, router, k, True)
        reference = dense(x, w, ids, gate, up, down)
        for method in (ragged, tiled):
            np.testing.assert_allclose(method(x, w, ids, gate, up, down), reference, rtol=1e-3, atol=1e-3)
        r, t, o = (timed(fn, x, w, ids, gate, up, down, repeat=args.repeat) for fn in (ragged, tiled, dense))
        m = timed(mlp, x, *active, repeat=args.repeat)
        print(f"{tokens:>7}{r:>10.3f}{t:>10.3f}{o:>10.3f}{m:>11.3f}{o / t:>14.2f}x{t / m:>12.2f}x")


def write_models(directory: Path, args) -> tuple[Path, Path]:
    import torch
    import transformers

    from jaxserve.checkpoint.default_model import default_model_path
    from jaxserve.tokenizer import load_tokenizer

    common = dict(vocab_size=49152, hidden_size=args.hidden, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=4, max_position_embeddings=4096, initializer_range=0.05)
    moe = transformers.MixtralConfig(**common, intermediate_size=args.expert_ffn, num_local_experts=args.experts,
                                     num_experts_per_tok=args.top_k)
    dense = transformers.LlamaConfig(**common, intermediate_size=args.top_k * args.expert_ffn)
    tokenizer = load_tokenizer(default_model_path())
    paths = []
    for name, config, cls in (("moe", moe, transformers.MixtralForCausalLM),
                              ("dense", dense, transformers.LlamaForCausalLM)):
        torch.manual_seed(0)
        cls(config).save_pretrained(directory / name)
        tokenizer.save_pretrained(directory / name)
        paths.append(directory / name)
    return paths[0], paths[1]


def offline(model: Path, args, meshes: list[str], out: Path) -> list[dict]:
    flags = [f"--mesh={m}" for m in meshes] + [f"--quantization={q}" for q in args.quantization]
    subprocess.run([sys.executable, "-m", "jaxserve.cli", "bench", "offline", "--model", str(model),
                    "--workload", args.workload, "--limit", str(args.limit), "--json", str(out), *flags],
                   check=True)
    return json.loads(out.read_text())


def model_table(args) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        moe, dense = write_models(Path(tmp), args)
        moe_rows = offline(moe, args, ["1x1", "1x2"], Path(tmp) / "moe.json")
        dense_rows = offline(dense, args, ["1x1"], Path(tmp) / "dense.json")
    print(f"\n{'model':<44}{'weights MiB':>12}{'output tok/s':>14}{'vs dense':>10}")
    rate = {id(r): r["output_tokens"] / r["elapsed_s"] for r in moe_rows + dense_rows}
    for i, q in enumerate(args.quantization):
        base = dense_rows[i]
        for name, row in (("dense, active-equivalent", base), ("MoE", moe_rows[i]),
                          ("MoE, experts split 1x2", moe_rows[len(args.quantization) + i])):
            print(f"{name + ' w:' + q:<44}{row['weight_mib']:>12.1f}{rate[id(row)]:>14.1f}"
                  f"{rate[id(row)] / rate[id(base)]:>9.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--expert-ffn", type=int, default=1024)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 256, 512])
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--models", action="store_true", help="also serve a random MoE and its dense twin")
    parser.add_argument("--workload", default=str(WORKLOAD))
    parser.add_argument("--limit", type=int, default=16)
    parser.add_argument("--quantization", nargs="+", default=["none", "int8"], help="each compared, as --quantization")
    args = parser.parse_args()
    layer_table(args)
    if args.models:
        model_table(args)


if __name__ == "__main__":
    main()
