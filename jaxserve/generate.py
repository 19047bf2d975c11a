"""`python -m jaxserve.generate "prompt"`: one completion, streamed to the terminal.

With no `--model` it runs the embedded SmolLM2-135M-Instruct. Instruct models (those whose
tokenizer has a chat template) get the prompt as a user message unless `--raw` is given.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from jaxserve import compile_cache
from jaxserve.checkpoint.loader import load_model
from jaxserve.config import ATTENTION_BACKENDS, KV_CACHE_DTYPES, QUANTIZATIONS, EngineConfig
from jaxserve.engine.engine import LLMEngine
from jaxserve.errors import InvalidRequestError
from jaxserve.progress import progress_bar
from jaxserve.sampling_params import SamplingParams
from jaxserve.tokenizer import chat_prompt_ids


def parse_args(argv=None, prog: str = "python -m jaxserve.generate") -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompt")
    parser.add_argument("--model", default=None, help="HF dir, .gguf file or jaxserve.convert dir "
                                                       "(default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--quantization", default="auto", choices=QUANTIZATIONS,
                        help="weights: auto (the checkpoint's own), none, int8, fp8, int4")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    parser.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS,
                        help="xla, pallas (interpreted on CPU), auto: pallas on TPU and GPU, xla on CPU")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    parser.add_argument("--compile-cache-dir", default=None,
                        help=f"persistent XLA cache (default {compile_cache.default_dir()})")
    return parser.parse_args(argv)


def prompt_ids(tokenizer, prompt: str, raw: bool) -> list[int]:
    if raw or not getattr(tokenizer, "chat_template", None):
        return tokenizer.encode(prompt, add_special_tokens=False)
    return chat_prompt_ids(tokenizer, [{"role": "user", "content": prompt}])


def main(argv=None, prog: str = "python -m jaxserve.generate") -> int:
    args = parse_args(argv, prog)
    logging.basicConfig(level=logging.WARNING)
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.seed)
    except InvalidRequestError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    compile_cache.enable(args.compile_cache_dir)
    model = load_model(args.model, args.dtype, quantization=args.quantization)
    ids = prompt_ids(model.tokenizer, args.prompt, args.raw)
    # One sequence: compile only the shapes this prompt and its decode steps use.
    budget = max(16, -(-len(ids) // 16) * 16)
    max_model_len = min(model.config.max_position_embeddings, len(ids) + args.max_tokens)
    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, max_num_seqs=1,
                                    max_num_batched_tokens=budget, max_model_len=max_model_len,
                                    attention_backend=args.attention_backend, quantization=args.quantization,
                                    kv_cache_dtype=args.kv_cache_dtype),
                       model=model, progress=progress_bar("compiling"))
    started = time.perf_counter()
    engine.add_request(ids, params)
    printed = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            text = output.outputs[0].text
            sys.stdout.write(text[printed:])
            sys.stdout.flush()
            printed = len(text)
            if output.finished:
                sample = output.outputs[0]
                elapsed = time.perf_counter() - started
                print(f"\n[{len(sample.token_ids)} tokens in {elapsed:.1f} s, "
                      f"{len(sample.token_ids) / elapsed:.1f} tokens/s, finish: {sample.finish_reason}]",
                      file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
