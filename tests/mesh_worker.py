"""Run by tests/test_sharding.py in a fresh process with 8 host devices: for each mesh, the paged
logits of one prompt (prefill, then greedy decode steps), and with --engine the engine's greedy
and seeded tokens, with --speculative those of an engine with n-gram speculation and without,
with --lora those of requests mixing the base model and the adapters.

    python tests/mesh_worker.py MODEL_DIR_OR_- OUT.npz 1x1,1x2,2x4 [--engine] [--speculative]
                                [--lora ADAPTER_DIR,ADAPTER_DIR]
"""

import sys

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402

from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxserve.checkpoint.loader import expected_params, load_model  # noqa: E402
from jaxserve.config import EngineConfig  # noqa: E402
from jaxserve.engine.engine import LLMEngine  # noqa: E402
from jaxserve.engine.kv_pages import allocate, resolve_kv_dtype  # noqa: E402
from jaxserve.engine.runner import Runner  # noqa: E402
from jaxserve.engine.scheduler_output import ScheduledSequence, SchedulerOutput  # noqa: E402
from jaxserve.lora_request import LoRARequest  # noqa: E402
from jaxserve.sampling_params import SamplingParams, StructuredOutputsParams  # noqa: E402
from jaxserve.sharding import KV_POOL_SPEC, mesh_from_config, sharding_for  # noqa: E402

PAGE_SIZE, PROMPT_LEN, DECODE_STEPS = 4, 37, 16


def paged_logits(model, kv_cache_dtype: str = "auto") -> tuple[np.ndarray, int]:
    """([2, PROMPT's last position + DECODE_STEPS, vocab], layer permutes): two prompts decoded
    greedily through scattered pages, one in the first data slice and one in the last; then the
    collective permutes in the step's loop over layers, data moved between devices in every layer
    (4-bit weights packed by halves of their rows once needed 10)."""
    runner = Runner(model, pages_per_slice=64, page_size=PAGE_SIZE, max_model_len=128, max_num_seqs=4,
                    max_num_batched_tokens=128, prefill_segment=16, kv_chunk_tokens=8, kv_cache_dtype=kv_cache_dtype)
    pages = np.random.default_rng(0).permutation(np.arange(1, 64)).tolist()
    tables = {"a": tuple(pages[:20]), "b": tuple(pages[20:40])}
    slices = {"a": 0, "b": runner.num_slices - 1}
    rng = np.random.default_rng(1)
    tokens = {name: rng.integers(0, model.config.vocab_size, PROMPT_LEN).tolist() for name in tables}
    rows, start = {name: [] for name in tables}, 0
    for _ in range(DECODE_STEPS + 1):
        seqs = tuple(ScheduledSequence(name, tuple(tokens[name][start:]), start, tables[name], True,
                                       SamplingParams(temperature=0), 0, 0, data_slice=slices[name])
                     for name in tables)
        logits = runner.logits(SchedulerOutput(seqs))
        start = len(tokens["a"])
        for name in tables:
            rows[name].append(logits[name])
            tokens[name].append(int(np.argmax(logits[name])))
    hlo = runner._lower(runner.buckets[0], set())[0].compile().as_text().splitlines()   # the model program
    permutes = sum("collective-permute(" in line and "while/body" in line for line in hlo)
    return np.stack([np.stack(rows[name]) for name in tables]), permutes


def misplaced(model, kv_cache_dtype: str = "auto") -> list[str]:
    """Parameters (and the KV pool) whose sharding is not what the rule table says."""
    if model.mesh is None:
        return []
    wrong = [path for path, param in expected_params(model.params).items()
             if not param.sharding.is_equivalent_to(sharding_for(model.mesh, "/".join(path), param.shape), param.ndim)]
    pool = allocate(model.config, 8, PAGE_SIZE, resolve_kv_dtype(kv_cache_dtype, model.dtype), model.mesh)
    if not pool.k.sharding.is_equivalent_to(NamedSharding(model.mesh, KV_POOL_SPEC), pool.k.ndim):
        wrong.append("kv_pool")
    if pool.k_scale is not None and not pool.k_scale.sharding.is_equivalent_to(
            NamedSharding(model.mesh, P(*KV_POOL_SPEC[:4])), pool.k_scale.ndim):
        wrong.append("kv_pool scales")
    return ["/".join(p) if isinstance(p, tuple) else p for p in wrong]


def engine_tokens(model, mesh: str) -> np.ndarray:
    engine = LLMEngine(EngineConfig(mesh=mesh, enforce_eager=True, num_pages=96, max_num_seqs=4,
                                    max_num_batched_tokens=64, prefill_segment=32, max_model_len=256), model=model)
    prompts = ["The capital of France is", "def fibonacci(n):", "List three colours:", "Once upon a time"]
    ids = [engine.add_request(p, SamplingParams(temperature=t, seed=7, max_tokens=16, ignore_eos=True))
           for p in prompts for t in (0.0, 0.8)]
    # Constrained samples beside them (structured outputs' masks laid out over the data slices too).
    words = StructuredOutputsParams(regex="[A-Za-z]+( [A-Za-z]+){0,12}")
    ids += [engine.add_request(p, SamplingParams(temperature=t, seed=7, max_tokens=16, structured_outputs=words))
            for p in prompts[:2] for t in (0.0, 0.8)]
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    return np.array([done[i] + [-1] * (16 - len(done[i])) for i in ids])   # -1: a constrained sample ended


def speculative_tokens(model, mesh: str) -> tuple[np.ndarray, np.ndarray]:
    """[3 engines, 8 requests, 24 tokens]: without speculation, with n-gram drafts and with the model
    drafting for itself, copy-heavy prompts over the data slices, greedy and seeded; then the
    drafts proposed and accepted by each speculating engine."""
    copy = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19] * 3
    tokens, drafted = [], []
    for spec in (None, {"method": "ngram", "num_speculative_tokens": 3},
                 {"model": str(model.path), "num_speculative_tokens": 3}):
        engine = LLMEngine(EngineConfig(mesh=mesh, enforce_eager=True, num_pages=48, page_size=8, max_num_seqs=8,
                                        max_num_batched_tokens=64, max_model_len=128, speculative_config=spec),
                           model=model)
        ids = [engine.add_request(copy[i:] + [i], SamplingParams(temperature=t, seed=i, max_tokens=24, ignore_eos=True,
                                                                 logit_bias={10: 6.0, 11: 6.0}))
               for i in range(4) for t in (0.0, 0.8)]
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
        tokens.append([done[i] for i in ids])
        stats = engine.stats()
        drafted.append([stats.spec_decode_num_draft_tokens, stats.spec_decode_num_accepted_tokens])
    return np.array(tokens), np.array(drafted[1:])


def lora_tokens(model, mesh: str, adapter_dirs: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """[9 requests, 12 tokens]: the base model and each adapter on three prompts (two greedy, one
    seeded), two adapters resident; then the LoRA slots whose sharding is not the rule table's."""
    engine = LLMEngine(EngineConfig(mesh=mesh, enforce_eager=True, num_pages=48, page_size=8, max_num_seqs=8,
                                    max_num_batched_tokens=64, max_model_len=128, enable_lora=True, max_loras=2,
                                    max_lora_rank=8), model=model)
    loras = [None] + [LoRARequest(f"a{i}", i + 1, path) for i, path in enumerate(adapter_dirs)]
    ids = [engine.add_request(list(range(5 + p, 14 + 3 * p)), SamplingParams(temperature=0.8 * (p == 2), seed=p,
                                                                              max_tokens=12, ignore_eos=True),
                              lora_request=lora) for lora in loras for p in range(3)]
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    wrong = [f"lora/{m}/{part}" for m, pair in engine.runner.lora.items() for part, x in zip("ab", pair)
             if model.mesh is not None and not x.sharding.is_equivalent_to(
                 sharding_for(model.mesh, f"lora/{m}/{part}", x.shape), x.ndim)]
    return np.array([done[i] for i in ids]), np.array(wrong)


def main(model_dir: str, out: str, meshes: str, with_engine: bool, quantization: str, kv_cache_dtype: str,
         speculative: bool = False, lora: str | None = None) -> None:
    results = {}
    for mesh in meshes.split(","):
        model = load_model(None if model_dir == "-" else model_dir, "float32", mesh_from_config(mesh), quantization)
        results[f"logits_{mesh}"], results[f"layer_permutes_{mesh}"] = paged_logits(model, kv_cache_dtype)
        results[f"heads_{mesh}"] = np.array([model.config.num_heads, model.config.num_kv_heads])
        results[f"misplaced_{mesh}"] = np.array(misplaced(model, kv_cache_dtype))
        results[f"formats_{mesh}"] = np.array(sorted(f.name for f in model.formats.values()))
        if with_engine:
            results[f"tokens_{mesh}"] = engine_tokens(model, mesh)
        if speculative and mesh != "1x1":   # each mesh against itself without drafts
            results[f"speculative_{mesh}"], results[f"drafted_{mesh}"] = speculative_tokens(model, mesh)
        if lora:
            results[f"lora_{mesh}"], results[f"lora_misplaced_{mesh}"] = lora_tokens(model, mesh, lora.split(","))
    np.savez(out, **results)


if __name__ == "__main__":
    switches = {"--engine", "--speculative"}
    rest = [arg for arg in sys.argv[4:] if arg not in switches]
    flags = dict(zip(rest[::2], rest[1::2]))
    main(sys.argv[1], sys.argv[2], sys.argv[3], "--engine" in sys.argv, flags.get("--quantization", "auto"),
         flags.get("--kv-cache-dtype", "auto"), "--speculative" in sys.argv, flags.get("--lora"))
