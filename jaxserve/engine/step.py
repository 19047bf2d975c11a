"""The jitted functions of a serving step: model forward, then sampling, with the pool donated. A
step runs as two programs split at the logits (`compile_split_step`), so that steps of one number
of logit rows share the sampling program, and a step's masks may come after its launch; as one
(`compile_step`) over several processes on CPUs."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxserve.engine.batch import StepInput
from jaxserve.engine.prompt_logprobs import PromptLogprobs, no_prompt_logprobs, score_prompt
from jaxserve.engine.sampler import Sampled, Samples, SamplingTensors, count_samples, fill_slots, sample
from jaxserve.models.layers.attention import AttentionBackend, KVPages
from jaxserve.sharding import BATCH_SPEC


def forward(graphdef: nnx.GraphDef, attention: AttentionBackend, params: nnx.State, kv_pages: KVPages, lora,
            batch: StepInput) -> tuple[jax.Array, KVPages]:
    """(logits [S, vocab] float32, kv_pages with the step's K/V written)."""
    model = nnx.merge(graphdef, params)
    return model(batch.token_ids, kv_pages, batch.attention, batch.logits_index, attention, lora, batch.lora_slots)


def step(graphdef, attention, params, kv_pages, sampled: Sampled, lora, batch: StepInput,
         score: bool, candidates: bool = True) -> tuple[Samples, PromptLogprobs, KVPages, Sampled]:
    """(next tokens [S] and their logprobs, the prompt rows' logprobs, kv_pages, sampled).

    `sampled.tokens` [R] int32 holds the tokens of the step before in its first rows; placeholders
    read their ids from it, so the host never waits for them, and it comes back with this step's
    (and the penalty slots' counts with them).
    `lora`: the LoRA slots (models/layers/lora.py), None without adapters. `score` (static): the
    batch has prompt rows to score (prompt_logprobs); without it their logprobs are zeros. The
    scoring is a program of its own, not a `lax.cond` branch: few steps need it, and in every
    program it was 11% of the start-up's compile (the 12 shapes of the defaults: 28.5 s with it,
    25.3 s without). `candidates`: see `sampler.sample`."""
    logits, last_tokens, prompt, kv_pages = logits_step(graphdef, attention, params, kv_pages, sampled, lora, batch,
                                                        score)
    samples, sampled = sample_step(logits, last_tokens, sampled, batch.sampling, candidates)
    return samples, prompt, kv_pages, sampled


def logits_step(graphdef, attention, params, kv_pages, sampled: Sampled, lora, batch: StepInput,
                score: bool) -> tuple[jax.Array, jax.Array, PromptLogprobs, KVPages]:
    """`step` up to its logits: (the sampling rows' logits [S, vocab], their input tokens [S], the
    prompt rows' logprobs, kv_pages). `sample_step` finishes it."""
    model = nnx.merge(graphdef, params)
    rows = batch.placeholder_rows
    token_ids = jnp.where(rows >= 0, sampled.tokens[jnp.maximum(rows, 0)], batch.token_ids)
    x, kv_pages = model.hidden_states(token_ids, kv_pages, batch.attention, attention, lora, batch.lora_slots)
    if score:
        prompt = score_prompt(lambda rows: model.logits(x, rows), batch.prompt_index, batch.prompt_target)
    else:
        prompt = no_prompt_logprobs(batch.prompt_index.shape[0])
    return model.logits(x, batch.logits_index), token_ids[batch.logits_index], prompt, kv_pages


def sample_step(logits: jax.Array, last_tokens: jax.Array, sampled: Sampled, sampling: SamplingTensors,
                candidates: bool = True) -> tuple[Samples, Sampled]:
    """The rest of `step`: (the samples, sampled with their tokens in its first rows and counted
    in the penalty slots)."""
    counts = fill_slots(sampled.counts, sampling, last_tokens, skip_empty=candidates)
    samples = sample(logits, sampling, last_tokens, candidates, counts)
    return samples, Sampled(sampled.tokens.at[:samples.tokens.shape[0]].set(samples.tokens),
                            count_samples(counts, sampling, samples.tokens))


def compile_step(graphdef, attention, mesh: Mesh | None = None):
    """`step(params, kv_pages, sampled, lora, batch, score)` jitted with the pool donated: written
    in place, never copied. On a mesh the samples are replicated, so that every process holds all
    of them."""
    replicated = None if mesh is None else NamedSharding(mesh, P())
    out_shardings = None if mesh is None else (replicated, replicated, None, replicated)
    return jax.jit(functools.partial(step, graphdef, attention, candidates=samples_from_candidates(mesh)),
                   donate_argnums=(1,), out_shardings=out_shardings, static_argnames=("score",),
                   compiler_options=compiler_options(mesh))


def compile_split_step(graphdef, attention, mesh: Mesh | None = None):
    """`step` as two programs: `logits(params, kv_pages, sampled, lora, batch, score)`, with the
    pool donated, then `sample(logits, last_tokens, sampled, sampling)`, with `sampled` donated.
    Buckets with as many logit rows share the second; a step launched before its allowed-token
    masks are known (a grammar's mask needs the token of the step before, on the host) runs the
    first at once and the second once they are."""
    replicated = None if mesh is None else NamedSharding(mesh, P())
    # The logits and their tokens split by rows as the batch is: left to XLA, the shardings it
    # chose were not those the sampling program was compiled for, which then compiled again.
    rows = None if mesh is None else NamedSharding(mesh, BATCH_SPEC)
    logits = jax.jit(functools.partial(logits_step, graphdef, attention), donate_argnums=(1,),
                     out_shardings=None if mesh is None else (rows, rows, replicated, None), static_argnames=("score",),
                     compiler_options=compiler_options(mesh))
    sampling = jax.jit(functools.partial(sample_step, candidates=samples_from_candidates(mesh)), donate_argnums=(2,),
                       out_shardings=None if mesh is None else (replicated, replicated),
                       compiler_options=compiler_options(mesh))
    return logits, sampling


def compiler_options(mesh: Mesh | None) -> dict[str, int] | None:
    """On a CPU, XLA's LLVM backend at optimisation level 1 instead of its default 3: the embedded
    model's 12 step programs compiled in 19.3-19.4 s against 20.7 s, and ran as fast or faster
    (anchor-64's first 32 requests: 90.4-94.5 out tok/s against 88.0-88.3; one stream 26.6
    against 26.2-26.4; alternated runs). Level 0 compiled in 13.6 s but decoded 6.5x slower;
    level 2 was level 1's equal. XLA's older fusion emitters compiled 15% faster but made the
    tiny model's 256-row decode step 3-5% slower (README, cold start)."""
    platform = jax.default_backend() if mesh is None else mesh.devices.flat[0].platform
    return {"xla_backend_optimization_level": 1} if platform == "cpu" else None


def samples_from_candidates(mesh: Mesh | None) -> bool:
    """Whether the step's top-k/top-p thresholds come from candidates (see `sampler._threshold`):
    not on a mesh over several processes on CPUs, whose gloo collectives mismatched with them."""
    return not over_gloo(mesh)


def over_gloo(mesh: Mesh | None) -> bool:
    """A mesh over several processes on CPUs: XLA runs its collectives through gloo, where two
    programs of ours (with top-k/top-p candidates, or with KV pages as bytes) made processes
    fail on mismatched messages ("64 vs 4"), as if two collectives were in flight at once."""
    return mesh is not None and jax.process_count() > 1 and mesh.devices.flat[0].platform == "cpu"


def compile_forward(graphdef, attention):
    """Like `compile_step` but returning the logits (tests)."""
    return jax.jit(functools.partial(forward, graphdef, attention), donate_argnums=(1,),
                   compiler_options=compiler_options(None))


def copy_pages(kv_pages: KVPages, source: jax.Array, destination: jax.Array) -> KVPages:
    """Copies whole pages, scales included (copy on write): every source is read before any
    destination is written."""
    return jax.tree.map(lambda pool: pool.at[:, :, destination].set(pool[:, :, source]), kv_pages)


def compile_copy_pages():
    return jax.jit(copy_pages, donate_argnums=(0,))
