"""Offline throughput: replays a workload through `LLM.generate` (and, with --compare-hf, through
Hugging Face transformers one request at a time in the same run) and prints a table.

    jaxserve bench offline --workload ../shared/workloads/anchor-64.jsonl [--compare-hf] [--limit N]
    jaxserve bench offline --workload ... --mesh 1x1 --mesh 1x2     # meshes compared, one run
    jaxserve bench offline --workload ... --quantization none --quantization int8 --quantization auto
    jaxserve bench offline --single-stream --quantization none --quantization auto   # one request
    jaxserve bench offline --workload ../shared/workloads/copy-edit.jsonl --eos --concurrency 1 \
        --speculative-config none --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'
    jaxserve bench offline --workload ... --lora off --lora 0 --lora 4   # LoRA's cost: off, on, 4 adapters
    jaxserve bench offline --workload ... --repetition-penalty 1.2 --speculative-config ...   # every request penalised
    jaxserve bench offline --workload ... --structured-outputs '{"json_object": true}'      # every request constrained

Repeated --mesh, --quantization, --kv-cache-dtype, --speculative-config and --lora values are all combined,
each in the same run; with several, the table says whether each gave the first one's tokens.
`--single-stream` replaces the workload by one request of 128 prompt tokens and 256 output tokens.
With `--concurrency 1` it also prints the medians of each request's time to first token and time
per output token after it, as `jaxserve bench serve` measures a stream's: the server's single-stream
figures against the engine's own, in one session.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

DEFAULT_WORKLOAD = str(Path(__file__).resolve().parents[3] / "shared" / "workloads" / "anchor-64.jsonl")


def read_workload(path: str, limit: int | None) -> list[dict]:
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return rows[:limit] if limit else rows


def single_stream(rows) -> list[dict]:
    """One request: the workload's prompts' tokens, 128 of them, then 256 output tokens."""
    tokens = [t for r in rows for t in r["prompt_token_ids"]][:128]
    return [{"prompt_token_ids": tokens, "max_tokens": 256}]


def random_adapters(model_config, num: int, rank: int, directory: Path) -> list:
    """`num` random PEFT adapters of `rank` on every projection (small weights: the text stays
    text), as LoRARequests round-robin over the requests."""
    import numpy as np
    from safetensors.numpy import save_file

    from jaxserve.lora_request import LoRARequest
    from jaxserve.models.llama import lora_shapes

    rng = np.random.default_rng(0)
    requests = []
    for i in range(num):
        path = directory / f"adapter{i}"
        path.mkdir(parents=True)
        weights = {}
        for layer in range(model_config.num_layers):
            for module, (fan_in, fan_out) in lora_shapes(model_config).items():
                key = f"base_model.model.model.layers.{layer}.self_attn.{module}"
                weights[f"{key}.lora_A.weight"] = rng.normal(0, fan_in ** -0.5, (rank, fan_in)).astype(np.float32)
                weights[f"{key}.lora_B.weight"] = rng.normal(0, 0.01, (fan_out, rank)).astype(np.float32)
        save_file(weights, str(path / "adapter_model.safetensors"))
        (path / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": sorted(lora_shapes(model_config))}))
        requests.append(LoRARequest(f"adapter{i}", i + 1, str(path)))
    return requests


def bench_jaxserve(rows, args, mesh: str, quantization: str, kv_cache_dtype: str, speculative: str,
                   lora: str = "off") -> dict:
    import tempfile

    from jaxserve import LLM, SamplingParams
    from jaxserve.config import ModelConfig, parse_mesh
    from jaxserve.sampling_params import StructuredOutputsParams

    # The limits are per data slice: split the step's totals so that every mesh holds the same batch.
    slices = parse_mesh(mesh)[0]
    started = time.perf_counter()
    llm = LLM(args.model, max_num_seqs=args.max_num_seqs // slices,
              max_num_batched_tokens=args.max_num_batched_tokens // slices,
              max_model_len=args.max_model_len, kv_cache_gb=args.kv_cache_gb, dtype=args.dtype, mesh=mesh,
              quantization=quantization, kv_cache_dtype=kv_cache_dtype,
              speculative_config=None if speculative == "none" else speculative,
              enable_lora=lora != "off", max_loras=max(1, int(lora)) if lora != "off" else 1,
              max_lora_rank=args.max_lora_rank)
    startup = time.perf_counter() - started
    loras = [None]
    if lora not in ("off", "0"):
        scratch = tempfile.TemporaryDirectory()
        loras = random_adapters(ModelConfig.from_hf(llm.engine.model.hf_config), int(lora), args.max_lora_rank,
                                Path(scratch.name))
    lora_of = [loras[i % len(loras)] for i in range(len(rows))]
    weight_mib = llm.engine.model.weight_bytes / 2**20
    constraint = StructuredOutputsParams(**json.loads(args.structured_outputs)) if args.structured_outputs else None
    params = [SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=not args.eos,
                             repetition_penalty=args.repetition_penalty, structured_outputs=constraint) for r in rows]
    prompts = [r["prompt_token_ids"] for r in rows]
    at_a_time = args.concurrency or len(rows)
    batches = [slice(i, i + at_a_time) for i in range(0, len(rows), at_a_time)]
    times, latencies = [], []
    before = llm.engine.stats()
    for _ in range(args.repeat):
        llm.engine.scheduler.clear_cache()   # every repeat computes its prompts: none is a cache hit
        started = time.perf_counter()
        outputs = []
        for b in batches:
            outputs += llm.generate(prompts[b], params[b], use_tqdm=args.repeat == 1, lora_request=lora_of[b])
            if at_a_time == 1:
                latencies.append(latency(outputs[-1], time.monotonic()))
        times.append(time.perf_counter() - started)
    elapsed = sorted(times)[len(times) // 2]
    load_ms = adapter_load_ms(llm.engine, loras[0]) if loras[0] is not None else None
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    system = f"jaxserve {mesh} w:{quantization} kv:{kv_cache_dtype}" + (f" spec:{speculative}" if args.speculative_config
                                                                        else "") + (f" lora:{lora}" if args.lora else "")
    after = llm.engine.stats()
    drafts = after.spec_decode_num_drafts - before.spec_decode_num_drafts
    proposed = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    accepted = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    return {"system": system, "startup_s": startup, "elapsed_s": elapsed, "output_tokens": generated,
            "prompt_tokens": sum(len(p) for p in prompts), "weight_mib": weight_mib,
            **({"tokens": [o.outputs[0].token_ids for o in outputs]} if loras == [None] else {}),   # adapters
            "drafts": drafts, "adapter_load_ms": load_ms,                                        # change them
            "latencies": latencies,   # (TTFT, TPOT) of each request, when they ran one at a time
            "acceptance_rate": accepted / proposed if proposed else None,
            "mean_accepted_length": 1 + accepted / drafts if drafts else None}


def latency(output, done: float) -> tuple[float, float | None]:
    """A request's time to first token and time per output token after it (seconds; None for a
    single token), as `jaxserve bench serve` measures a stream's: `done` is when it returned
    (time.monotonic, the clock of its metrics)."""
    metrics, tokens = output.metrics, len(output.outputs[0].token_ids)
    tpot = (done - metrics.first_token_time) / (tokens - 1) if tokens > 1 else None
    return metrics.first_token_time - metrics.arrival_time, tpot


def adapter_load_ms(engine, lora) -> tuple[float, float]:
    """(reading and checking `lora`'s adapter, writing it into its device slot), milliseconds, median
    of 5. The slot rewritten is the adapter's own, so the engine's slot table stays true."""
    import jax

    slot = engine.lora_adapters.slots_for([lora.lora_int_id])[lora.lora_int_id]
    reads, loads = [], []
    for _ in range(5):
        started = time.perf_counter()
        adapter = engine.read_adapter(lora.lora_path)
        read = time.perf_counter()
        engine.runner.load_lora(slot, adapter.modules)
        jax.block_until_ready(engine.runner.lora)
        reads.append(read - started)
        loads.append(time.perf_counter() - read)
    return sorted(reads)[2] * 1000, sorted(loads)[2] * 1000


def bench_hf(rows, args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from jaxserve.checkpoint.default_model import default_model_path

    path = default_model_path()
    started = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    startup = time.perf_counter() - started
    generated = 0
    started = time.perf_counter()
    with torch.no_grad():
        for r in rows:
            ids = torch.tensor([r["prompt_token_ids"]])
            out = model.generate(ids, max_new_tokens=r["max_tokens"], min_new_tokens=r["max_tokens"],
                                 do_sample=False, repetition_penalty=args.repetition_penalty)
            generated += out.shape[1] - ids.shape[1]
    elapsed = time.perf_counter() - started
    return {"system": "transformers", "startup_s": startup, "elapsed_s": elapsed, "output_tokens": generated,
            "prompt_tokens": sum(len(r["prompt_token_ids"]) for r in rows)}


def print_table(results: list[dict]) -> None:
    print(f"\n{'system':<36}{'weights MiB':>12}{'requests':>9}{'prompt tok':>11}{'output tok':>11}{'time s':>9}"
          f"{'out tok/s':>11}{'startup s':>10}")
    for r in results:
        r["output_tokens_per_s"] = r["output_tokens"] / r["elapsed_s"]
        mib = f"{r['weight_mib']:.1f}" if "weight_mib" in r else "-"
        print(f"{r['system']:<36}{mib:>12}{r['requests']:>9}{r['prompt_tokens']:>11}{r['output_tokens']:>11}"
              f"{r['elapsed_s']:>9.1f}{r['output_tokens_per_s']:>11.1f}{r['startup_s']:>10.1f}")
    for r in results[1:]:
        same = "" if "tokens" not in r else f" (tokens {'equal' if r['tokens'] == results[0].get('tokens') else 'DIFFER'})"
        print(f"{r['system']} / {results[0]['system']}: "
              f"{r['output_tokens_per_s'] / results[0]['output_tokens_per_s']:.2f}x{same}")
    for r in results:
        if r.get("adapter_load_ms"):
            print(f"{r['system']}: an adapter is read in {r['adapter_load_ms'][0]:.1f} ms and written into a device "
                  f"slot in {r['adapter_load_ms'][1]:.1f} ms")
        if r.get("latencies"):
            ttft = statistics.median(t for t, _ in r["latencies"])
            tpot = statistics.median(t for _, t in r["latencies"] if t is not None)
            print(f"{r['system']}: one request at a time ({len(r['latencies'])}): time to first token p50 "
                  f"{ttft * 1e3:.1f} ms, time per output token p50 {tpot * 1e3:.1f} ms ({1 / tpot:.1f} tok/s)")
        if r.get("drafts"):
            print(f"{r['system']}: {r['drafts']} drafts, acceptance rate {r['acceptance_rate']:.3f}, "
                  f"mean accepted length {r['mean_accepted_length']:.2f} tokens per verifying step")


def main(argv=None, prog: str = "jaxserve bench offline") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default=DEFAULT_WORKLOAD)
    parser.add_argument("--single-stream", action="store_true", help="one request: 128 prompt, 256 output tokens")
    parser.add_argument("--quantization", action="append", default=None,
                        help="repeat to compare (default auto): auto, none, int8, fp8, int4")
    parser.add_argument("--kv-cache-dtype", action="append", default=None,
                        help="repeat to compare (default auto): auto, int8, fp8")
    parser.add_argument("--speculative-config", action="append", default=None,
                        help="repeat to compare: none, or vLLM's JSON, e.g. '{\"method\": \"ngram\"}'")
    parser.add_argument("--eos", action="store_true", help="end requests at EOS (default: ignored, so every "
                                                            "system makes the workload's max_tokens)")
    parser.add_argument("--repetition-penalty", type=float, default=1.0,
                        help="every request's (default 1.0: none), as vLLM's SamplingParams take it")
    parser.add_argument("--structured-outputs", help="every request's constraint, as vLLM's structured_outputs "
                                                      "JSON, e.g. '{\"json_object\": true}' (jaxserve's runs only)")
    parser.add_argument("--lora", action="append", default=None,
                        help="off (default), 0 (--enable-lora, requests on the base model) or N (N random adapters "
                             "of --max-lora-rank on every projection, round-robin over the requests, N slots)")
    parser.add_argument("--max-lora-rank", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=0, help="requests at a time (default: all at once)")
    parser.add_argument("--repeat", type=int, default=1, help="generate N times on each engine, keep the median time")
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    parser.add_argument("--limit", type=int, default=None, help="first N requests only")
    parser.add_argument("--compare-hf", action="store_true", help="also run transformers, one request at a time")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="per step, over all data slices")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512, help="per step, over all data slices")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--kv-cache-gb", type=float, default=1.0)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--mesh", action="append", default=None,
                        help="DxM; repeat to compare meshes in one run (default 1x1)")
    args = parser.parse_args(argv)
    meshes = args.mesh or ["1x1"]
    from jaxserve.config import parse_mesh
    from jaxserve.sharding import ensure_devices

    ensure_devices(max(d * m for d, m in map(parse_mesh, meshes)))   # before JAX starts
    rows = read_workload(args.workload, args.limit)
    if args.single_stream:
        rows = single_stream(rows)
    results = []
    for mesh, quantization, kv, spec, lora in itertools.product(meshes, args.quantization or ["auto"],
                                                                args.kv_cache_dtype or ["auto"],
                                                                args.speculative_config or ["none"],
                                                                args.lora or ["off"]):
        results.append(bench_jaxserve(rows, args, mesh, quantization, kv, spec, lora))
    if args.compare_hf:
        results.append(bench_hf(rows, args))
    for r in results:
        r["requests"] = len(rows)
    print_table(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{k: v for k, v in r.items() if k != "tokens"} for r in results], f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
