"""`python -m jaxserve.convert SRC OUT`: rewrites a checkpoint in jaxserve's own format.

SRC is a `.gguf` file, a Hugging Face directory, or `default` (the embedded SmolLM2). OUT gets an
orbax-checkpoint tree of the parameters already in our layout, `config.json` and the tokenizer
files; `--model OUT` then loads without dequantising, renaming or transposing anything.
`--quantization` (as `jaxserve.serve`'s) chooses which weights are written quantized, and how.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax.numpy as jnp
from tqdm import tqdm

from jaxserve.checkpoint import orbax
from jaxserve.checkpoint.loader import (expected_params, open_gguf, read_checkpoint, resolve_model_path,
                                       weight_formats)
from jaxserve.checkpoint.weight_maps import map_hf_weights
from jaxserve.config import ModelConfig
from jaxserve.models.llama import abstract_model
from jaxserve.quantization import QUANTIZATIONS, check_quantization
from jaxserve.tokenizer import load_tokenizer


def convert(source: str, out_dir: str | Path, dtype: str = "float32", quantization: str = "auto") -> Path:
    """Writes `out_dir`; returns it. `quantization` is `--quantization`: auto (float weights stay
    float, a GGUF's own Q8_0/Q4_0/Q4_1 stay quantized), none (all float), int8, fp8 or int4
    (quantized here)."""
    check_quantization(quantization)
    path = resolve_model_path(None if source == "default" else source)
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"output directory {str(out)!r} exists and is not empty")
    out.mkdir(parents=True, exist_ok=True)
    gguf_file = open_gguf(path)
    hf_config, tensors, native = read_checkpoint(path, quantization == "auto", gguf_file)
    config = ModelConfig.from_hf(hf_config)
    formats = weight_formats(quantization, config, native)
    _, abstract = abstract_model(config, jnp.dtype(dtype), formats)
    shapes = {p: s.shape for p, s in expected_params(abstract).items()}
    tensors = tqdm(tensors, desc="converting", unit="tensor", total=_count(tensors))
    flat = map_hf_weights(tensors, shapes, jnp.dtype(dtype), formats)
    orbax.save_params(out, flat, dtype, formats)
    (out / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    load_tokenizer(path, gguf_file).save_pretrained(out)
    return out


def _count(tensors) -> int | None:
    return len(tensors) if hasattr(tensors, "__len__") else None


def main(argv=None, prog: str = "python -m jaxserve.convert") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", help="a .gguf file, an HF directory, or 'default'")
    parser.add_argument("out", help="the directory to write (must be new or empty)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--quantization", default="auto", choices=QUANTIZATIONS,
                        help="auto: the checkpoint's own (a GGUF's Q8_0/Q4_0/Q4_1 stay quantized); none: all "
                             "float; int8, fp8, int4: quantize the linear layers here")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    out = convert(args.source, args.out, args.dtype, args.quantization)
    print(f"wrote {out} in {time.perf_counter() - started:.1f} s; serve it with --model {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
