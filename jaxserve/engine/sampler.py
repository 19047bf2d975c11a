"""Token sampling on the device: structured-output masks, logit bias, min_tokens, penalties, greedy,
temperature, top-k, top-p, min-p, per-request seeds, and logprobs.

Each row's randomness comes only from its own seed and the index of the token it samples, so a
seeded request gives the same tokens whatever else is in the batch. Every optional stage
(penalties, truncation, logprobs, randomness) runs only when some row asks for it.

Order, as vLLM's: a constrained row's allowed-token mask (structured outputs), logit_bias and
min_tokens' suppression of EOS/stop ids, then the repetition penalty (over prompt and output
tokens), frequency and presence penalties (over output tokens), then greedy argmax or temperature
and truncation. Logprobs are of the raw model distribution.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxserve.engine.penalty_slots import PenaltySlots
from jaxserve.engine.structured_output import mask_width
from jaxserve.sampling_params import MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_STOP_TOKEN_IDS

BIAS_WIDTH = MAX_LOGIT_BIAS + MAX_STOP_TOKEN_IDS + 20   # bias entries per row: logit_bias, then suppressed ids
# In `history`: a penalised row's last token when it is a placeholder (async scheduling: sampled by
# the step before, not read back yet). `sample` puts the row's input token there, so that such a
# row's step needs nothing from the host and can be scheduled ahead like any other.
PLACEHOLDER = -1
# In `Sampled.counts`: added to a token's count when the slot's prompt holds it (the repetition
# penalty reads any bit: prompt or output; frequency and presence the bits below).
PROMPT_TOKEN = 1 << 30


@struct.dataclass
class SamplingTensors:
    temperature: jax.Array  # [S] float32; 0 = greedy
    top_k: jax.Array        # [S] int32; <= 0 = off
    top_p: jax.Array        # [S] float32; 1 = off
    min_p: jax.Array        # [S] float32; 0 = off
    seed: jax.Array         # [S] uint32: mixes the request's seed with the sampled token's index
    bias_ids: jax.Array     # [S, BIAS_WIDTH] int32; vocab_size = unused entry
    bias: jax.Array         # [S, BIAS_WIDTH] float32, added to the logits (-inf: suppressed)
    presence: jax.Array     # [S] float32
    frequency: jax.Array    # [S] float32
    repetition: jax.Array   # [S] float32; 1 = off
    history: jax.Array      # [S, H] int32: prompt then output token ids of a row whose penalty slot is
                            # filled this step, vocab_size = unused (all of it: nothing to fill),
                            # PLACEHOLDER = the last token, whose id only the device has
    num_prompt: jax.Array   # [S] int32: how many of `history` are prompt tokens
    penalty_slot: jax.Array # [S] int32: the row's slot in `Sampled.counts` (penalty_slots.py)
    count_sample: jax.Array # [S] bool: the row's sample is added to its slot's counts
    logprobs: jax.Array     # [S] bool: compute the sampled token's logprob and the top ones
    allowed: jax.Array      # [S, ceil(vocab / 32)] int32 bits: token t may be sampled if bit t % 32 of
                            # word t // 32 is set; all bits set (-1) for unconstrained rows


@struct.dataclass
class Sampled:
    """What sampling leaves on the device for the steps after it (a donated carry)."""

    tokens: jax.Array   # [R] int32: the last step's samples, by logit row (placeholders read them)
    counts: jax.Array   # [slots, vocab] int32: each penalty slot's count of each token among its
                        # outputs, plus PROMPT_TOKEN where its prompt holds the token


@struct.dataclass
class Samples:
    tokens: jax.Array        # [S] int32
    logprob: jax.Array       # [S] float32: the sampled token's (0 where not asked)
    top_ids: jax.Array       # [S, MAX_LOGPROBS] int32, most likely first
    top_logprobs: jax.Array  # [S, MAX_LOGPROBS] float32
    finite: jax.Array        # [S] bool: the row's logits held no NaN or inf (else its token means nothing)


def row_seed(seed: int, token_index: int) -> int:
    """A 32-bit seed for sampling token `token_index` of a request seeded with `seed`."""
    return int(row_seeds([seed], [token_index])[0])


def row_seeds(seeds, token_indices) -> np.ndarray:
    """`row_seed` of each (seed, token index) pair, as uint32: splitmix64, a column at a time (256
    rows: 0.02 ms, 0.11 ms one by one). Seeds are in [0, 2**63); an index may be negative."""
    u64 = np.uint64
    z = (np.asarray(seeds, u64) * u64(0x9E3779B97F4A7C15)
         + np.asarray(token_indices, np.int64).astype(u64) + u64(1))   # wraps as the 64-bit hash does
    z = (z ^ (z >> u64(30))) * u64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> u64(27))) * u64(0x94D049BB133111EB)
    return (z ^ (z >> u64(31))).astype(np.uint32)


def sample(logits: jax.Array, s: SamplingTensors, last_tokens: jax.Array | None = None,
           candidates: bool = True, counts: jax.Array | None = None) -> Samples:
    """logits [S, vocab] float32 -> the sampled tokens and, for rows that ask, their logprobs.
    `last_tokens` [S] int32: each row's input token, which replaces PLACEHOLDER in its history.
    `candidates` (static): top-k/top-p thresholds from each row's largest logits first (see
    `_threshold`); False for several processes on CPUs, which also sample without the cond below.
    `counts`: the penalty slots' (`Sampled.counts`, filled by `fill_slots`); None: each penalised
    row's counts from its own history."""
    raw = logits
    # Masks, biases and penalties write a changed copy of the [S, vocab] logits, so only a step that
    # has one of them makes it. The conds here return tokens, never [S, vocab] arrays: a `lax.cond`
    # returning one copies it, even unchanged (on a CPU 256 rows of 49,152 logits took 17 ms to copy,
    # a greedy sampling of them 23.6 ms against 4.4 without). So the tokens are picked in both branches,
    # from the copy or from the logits themselves.
    if candidates:
        changes = _masks(s) | jnp.any(s.bias_ids < logits.shape[-1]) | _penalizes(s)
        tokens = jax.lax.cond(changes, lambda: _tokens(_changed(raw, s, last_tokens, counts), s, candidates),
                              lambda: _tokens(raw, s, candidates))
    else:   # several processes on CPUs (see `_threshold`): that cond's collectives made gloo's pair
            # wrongly too ("64 vs 4": the 4x2 two-process test failed in 2 runs of 4, in none of 6 without it)
        tokens = _tokens(_changed(raw, s, last_tokens, counts), s, candidates)
    samples = jax.lax.cond(jnp.any(s.logprobs), _with_logprobs, _without_logprobs, raw, tokens)
    # A NaN or an inf anywhere makes the row's sum NaN or inf (finite logits would need to be near 1e34
    # to overflow it): one reduction, where all(isfinite) first wrote a [S, vocab] bool array
    # (in a 256-row step of 49,152 logits, 5.9-6.4 ms against ~1.8).
    return samples.replace(finite=jnp.isfinite(raw.sum(-1)))


def _changed(logits: jax.Array, s: SamplingTensors, last_tokens: jax.Array | None,
             counts: jax.Array | None) -> jax.Array:
    """The logits with the allowed-token masks, the biases and the penalties applied."""
    rows = jnp.arange(logits.shape[0])[:, None]
    logits = jax.lax.cond(_masks(s), _mask, lambda x, _: x, logits, s.allowed)
    logits = logits.at[rows, s.bias_ids].add(s.bias, mode="drop")
    return jax.lax.cond(_penalizes(s), _penalize, lambda x, *_: x, logits, s, last_tokens, counts)


def _masks(s: SamplingTensors) -> jax.Array:
    return jnp.any(s.allowed != -1)


def _penalizes(s: SamplingTensors) -> jax.Array:
    return jnp.any((s.presence != 0) | (s.frequency != 0) | (s.repetition != 1))


@functools.partial(jax.jit, static_argnames=("candidates",))
def _tokens(logits: jax.Array, s: SamplingTensors, candidates: bool) -> jax.Array:
    """Each row's token: the largest logit's at temperature 0, else drawn from the truncated
    distribution at its temperature (Gumbel-max). Jitted so that its second use in a program (the
    other branch of `sample`'s cond) reuses the first one's trace: traced twice, it made the 12 step
    programs of a cold start compile 1.0-1.8 s longer than with one use; jitted, 0.6-1.2 s."""
    greedy = argmax(logits)

    def random_tokens():
        scaled = logits / jnp.where(s.temperature > 0, s.temperature, 1.0)[:, None]
        truncates = jnp.any((s.top_k > 0) | (s.top_p < 1) | (s.min_p > 0))
        threshold = jax.lax.cond(truncates, functools.partial(_threshold, candidates=candidates),
                                 lambda x, _: jnp.full(x.shape[:1], -jnp.inf), scaled, s)
        kept = jnp.where(scaled >= threshold[:, None], scaled, -jnp.inf)
        return argmax(kept + gumbel_noise(s.seed, logits.shape[-1]))

    sampled = jax.lax.cond(jnp.all(s.temperature == 0), lambda: greedy, random_tokens)
    return jnp.where(s.temperature == 0, greedy, sampled)


def gumbel_noise(seeds: jax.Array, vocab: int) -> jax.Array:
    """seeds [S] uint32 -> [S, vocab] float32 standard Gumbel noise: token t's is -log(-log u), u
    from a hash of (seed, t), so a row's noise depends only on its seed. The hash, two rounds of a
    32-bit finaliser (lowbias32) with the seed mixed in before and between them, replaces
    jax.random's threefry, whose bits cost most of a step on a CPU: sampling 256 rows of 49,152
    tokens took 137 ms with threefry's noise and 30 ms with this."""
    seed = seeds.astype(jnp.uint32)[:, None]
    bits = _mix(_mix(jnp.arange(vocab, dtype=jnp.uint32)[None, :] ^ _mix(seed)) + seed)
    u = ((bits >> 8).astype(jnp.float32) + 0.5) * (1.0 / (1 << 24))   # 24 bits, in (0, 1)
    return -jnp.log(-jnp.log(u))


def _mix(x: jax.Array) -> jax.Array:
    """lowbias32 (Wellons' hash prospector): a bijection of uint32 with near-ideal avalanche."""
    x = (x ^ (x >> 16)) * jnp.uint32(0x7FEB352D)
    x = (x ^ (x >> 15)) * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def argmax(values: jax.Array) -> jax.Array:
    """`jnp.argmax` over the last axis (int32: the first index of the largest value), in two levels
    of plain max and min reductions: each block of about 1,024 values' largest, the first block that
    holds the row's largest, then the first index within it that does. XLA's CPU argmax, one
    reduction over (value, index) pairs, took 28 ms over 256 rows of SmolLM2's 49,152 logits and
    3.7 ms over 32; this 4.2 and 0.26 ms. A row holding a NaN gets an index in range, not the
    NaN's (`finite` flags the row)."""
    rows, vocab = values.shape
    size = next((b for b in range(1024, 127, -1) if vocab % b == 0), vocab)   # a block size dividing vocab
    num_blocks = vocab // size
    blocks = values.reshape(rows, num_blocks, size)
    block_max = blocks.max(axis=-1)                                   # [rows, blocks]
    largest = block_max.max(axis=-1, keepdims=True)
    block = jnp.minimum(_first(block_max == largest), num_blocks - 1)
    within = _first(jnp.take_along_axis(blocks, block[:, None, None], axis=1)[:, 0] == largest)
    return jnp.minimum(block * size + within, vocab - 1)


def _first(hits: jax.Array) -> jax.Array:
    """[rows, n] bool -> [rows] int32: each row's first True (n where none is)."""
    n = hits.shape[-1]
    return jnp.min(jnp.where(hits, jnp.arange(n, dtype=jnp.int32), n), axis=-1)


def _mask(logits: jax.Array, allowed: jax.Array) -> jax.Array:
    bits = (allowed[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
    keep = bits.reshape(allowed.shape[0], -1)[:, :logits.shape[-1]].astype(jnp.bool_)
    return jnp.where(keep, logits, -jnp.inf)


def _penalize(logits: jax.Array, s: SamplingTensors, last_tokens: jax.Array | None = None,
              counts: jax.Array | None = None) -> jax.Array:
    """The penalties, from the rows' slots in `counts`, or without them from the rows' histories."""
    if counts is None:
        counts = history_counts(s, last_tokens, logits.shape[1])
    else:   # out of range (an unpenalised row): no counts
        counts = jnp.take(counts, s.penalty_slot, axis=0, mode="fill", fill_value=0)
    seen = counts != 0
    output_counts = (counts & (PROMPT_TOKEN - 1)).astype(jnp.float32)
    repetition = s.repetition[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / repetition, logits * repetition), logits)
    logits = logits - s.frequency[:, None] * output_counts
    return logits - s.presence[:, None] * (output_counts > 0)


def history_counts(s: SamplingTensors, last_tokens: jax.Array | None, vocab: int) -> jax.Array:
    """[S, vocab] int32: each row's counts from its history alone, as a slot holds them."""
    num_rows = s.history.shape[0]
    return _count_history(jnp.zeros((num_rows, vocab), jnp.int32), jnp.arange(num_rows), s, last_tokens)


def fill_slots(counts: jax.Array, s: SamplingTensors, last_tokens: jax.Array, skip_empty: bool = True) -> jax.Array:
    """`counts` with the slots of the rows that bring a history filled from it (penalty_slots.py).
    `skip_empty` (static): only when some row does (a cond; several processes on CPUs run it always,
    as they sample without conds, see `sample`)."""
    num_slots, vocab = counts.shape
    fills = s.history[:, 0] != vocab   # a history holds a prompt, so at least one token

    def fill(counts):
        slots = jnp.where(fills, s.penalty_slot, num_slots)
        emptied = jnp.zeros(num_slots, jnp.bool_).at[slots].set(True, mode="drop")
        return _count_history(jnp.where(emptied[:, None], 0, counts), slots, s, last_tokens)

    return jax.lax.cond(jnp.any(fills), fill, lambda counts: counts, counts) if skip_empty else fill(counts)


def _count_history(counts: jax.Array, slots: jax.Array, s: SamplingTensors, last_tokens: jax.Array | None
                   ) -> jax.Array:
    """`counts` with each row's history counted into its slot's row, which is empty (a slot out of
    range: nowhere): PROMPT_TOKEN for each token of its prompt, then 1 for each of its outputs.
    Written into the slots directly: counted apart and then copied in, a mixed step of 172 rows at
    256 sequences took 132-134 ms on the device against 95-96 ms (tools/bench_host.py --tiny)."""
    vocab = counts.shape[1]
    history = s.history
    if last_tokens is not None:
        history = jnp.where(history == PLACEHOLDER, last_tokens[:, None], history)
    is_output = jnp.arange(history.shape[1])[None, :] >= s.num_prompt[:, None]
    rows = slots[:, None]
    counts = counts.at[rows, jnp.where(is_output, vocab, history)].set(PROMPT_TOKEN, mode="drop")
    return counts.at[rows, jnp.where(is_output, history, vocab)].add(1, mode="drop")


def count_samples(counts: jax.Array, s: SamplingTensors, tokens: jax.Array) -> jax.Array:
    """`counts` with each counting row's sample added to its slot."""
    slots = jnp.where(s.count_sample, s.penalty_slot, counts.shape[0])
    return counts.at[slots, tokens].add(1, mode="drop")


def _with_logprobs(raw: jax.Array, tokens: jax.Array) -> Samples:
    logprobs = jax.nn.log_softmax(raw, axis=-1)
    top_logprobs, top_ids = jax.lax.top_k(logprobs, min(MAX_LOGPROBS, raw.shape[-1]))
    pad = ((0, 0), (0, MAX_LOGPROBS - top_ids.shape[-1]))   # tiny test vocabularies only
    logprob = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    return Samples(tokens, logprob, jnp.pad(top_ids.astype(jnp.int32), pad), jnp.pad(top_logprobs, pad),
                   jnp.ones(tokens.shape, jnp.bool_))


def _without_logprobs(raw: jax.Array, tokens: jax.Array) -> Samples:
    num_rows = raw.shape[0]
    return Samples(tokens, jnp.zeros(num_rows, jnp.float32), jnp.zeros((num_rows, MAX_LOGPROBS), jnp.int32),
                   jnp.zeros((num_rows, MAX_LOGPROBS), jnp.float32), jnp.ones(num_rows, jnp.bool_))


# A row's largest scaled logits among which top-k and top-p thresholds are sought first.
CANDIDATES = 256


def _threshold(scaled: jax.Array, s: SamplingTensors, candidates: bool = True) -> jax.Array:
    """[S]: each row's smallest logit kept by its top-k, then top-p of what is left, then min-p
    (every logit at or above it is kept: ties at a threshold are all kept, as a sort-based cut keeps
    them). A threshold, not the truncated logits, so that no [S, vocab] array leaves a `lax.cond`.

    The thresholds are read off each row's CANDIDATES largest logits (`_candidate_thresholds`). A
    row whose top-k is wider than that, or whose top-p mass the candidates do not reach, sends the
    whole batch to `_bisection_threshold`, which needs no sort but passes over every logit about
    a hundred times: on a CPU, 638 ms against 123 ms for 256 rows of 49,152 peaked logits at
    top_p 0.9, and 28 against 9 ms for 32 rows.

    Without `candidates`, bisection alone: for several processes on CPUs. With the candidates in
    the step, two processes serving a 4x2 mesh failed in XLA's gloo collectives with a size
    mismatch ("64 vs 4") in 9 of 22 runs, against none of 46 without them. XLA's gloo
    communicator gives every collective the same tag, so two in flight at once can pair wrongly;
    which program shape exposes it is not understood, and one process (in-process collectives)
    never failed."""
    if not candidates:
        return _bisection_threshold(scaled, s)
    # A batch with a row the candidates cannot serve skips them: a flat distribution paid for them
    # and then bisected (the tiny random model of tools/bench_host.py at 256 rows: 632-651 ms a
    # step against 565-570 by bisection alone; 593-643 against 555-659 with this check).
    threshold, wider = jax.lax.cond(
        jnp.any(_past_candidates(scaled, s)),
        lambda x, _: (jnp.full(x.shape[:1], -jnp.inf), jnp.ones(x.shape[:1], jnp.bool_)),
        _candidate_thresholds, scaled, s)
    return jax.lax.cond(jnp.any(wider), _bisection_threshold, lambda *_: threshold, scaled, s)


def _past_candidates(scaled: jax.Array, s: SamplingTensors) -> jax.Array:
    """[S] bool: rows whose cut certainly lies past the CANDIDATES largest logits, known without
    finding them: a top-k wider than they are, or (no top-k) a top-p that CANDIDATES tokens of the
    row's largest probability could not reach."""
    vocab = scaled.shape[-1]
    width = min(CANDIDATES, vocab)
    k = jnp.where(s.top_k > 0, jnp.minimum(s.top_k, vocab), vocab)
    largest_probability = 1 / jnp.sum(jnp.exp(scaled - scaled.max(-1, keepdims=True)), axis=-1)
    return ((k > width) & (k < vocab)) | ((k >= vocab) & (s.top_p < 1) & (width * largest_probability < s.top_p))


def _candidate_thresholds(scaled: jax.Array, s: SamplingTensors) -> tuple[jax.Array, jax.Array]:
    """(each row's truncation threshold [S], whether it lies past the candidates [S] bool)."""
    vocab = scaled.shape[-1]
    # [S, C], largest first. The barrier keeps XLA from fusing top_k's slice of its sort into the
    # uses below, which turned it into a sort of the whole vocabulary (50x slower on a CPU).
    top = jax.lax.optimization_barrier(jax.lax.top_k(scaled, min(CANDIDATES, vocab))[0])
    width = top.shape[-1]
    k = jnp.where(s.top_k > 0, jnp.minimum(s.top_k, vocab), vocab)
    top_k_threshold = jnp.where(k >= vocab, -jnp.inf,
                                jnp.take_along_axis(top, jnp.clip(k - 1, 0, width - 1)[:, None], axis=-1)[:, 0])
    largest = top[:, :1]
    mass = jnp.sum(jnp.exp(scaled - largest) * (scaled >= top_k_threshold[:, None]), axis=-1, keepdims=True)
    reached = jnp.cumsum(jnp.exp(top - largest) * (top >= top_k_threshold[:, None]) / mass, axis=-1) >= s.top_p[:, None]
    first = _first(reached)
    top_p_threshold = jnp.where(s.top_p >= 1, -jnp.inf,
                                jnp.take_along_axis(top, jnp.minimum(first, width - 1)[:, None], axis=-1)[:, 0])
    min_p_threshold = jnp.where(s.min_p > 0, largest[:, 0] + jnp.log(jnp.maximum(s.min_p, 1e-38)), -jnp.inf)
    wider = ((k > width) & (k < vocab)) | ((s.top_p < 1) & (first >= width))
    return jnp.maximum(jnp.maximum(top_k_threshold, top_p_threshold), min_p_threshold), wider


def _bisection_threshold(scaled: jax.Array, s: SamplingTensors) -> jax.Array:
    """`_threshold` found by bisection on the logit value: about 100 passes of compare-and-sum over
    the vocabulary, for rows whose thresholds lie past the candidates."""
    vocab = scaled.shape[-1]
    k = jnp.where(s.top_k > 0, jnp.minimum(s.top_k, vocab), vocab).astype(jnp.float32)
    top_k_threshold = _bisect(scaled, lambda kept: kept.sum(-1, dtype=jnp.float32) >= k)
    probs = jnp.exp(scaled - scaled.max(-1, keepdims=True)) * (scaled >= top_k_threshold[:, None])
    probs = probs / probs.sum(-1, keepdims=True)
    top_p_threshold = _bisect(scaled, lambda kept: jnp.sum(probs * kept, -1) >= s.top_p)
    min_p_threshold = jnp.where(s.min_p > 0, scaled.max(-1) + jnp.log(jnp.maximum(s.min_p, 1e-38)), -jnp.inf)
    return jnp.maximum(jnp.maximum(top_k_threshold, top_p_threshold), min_p_threshold)


def _bisect(values: jax.Array, enough, steps: int = 48) -> jax.Array:
    """Per row, the largest t with `enough(values >= t)`, given that the row's smallest finite value
    qualifies (masked tokens are -inf: bisecting from -inf would give NaN and keep every token)."""
    lo, hi = jnp.where(values > -jnp.inf, values, jnp.inf).min(-1), values.max(-1) + 1.0

    def halve(_, bounds):
        lo, hi = bounds
        mid = lo + (hi - lo) / 2
        ok = enough(values >= mid[:, None])
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    return jax.lax.fori_loop(0, steps, halve, (lo, hi))[0]


def _filled(shape: tuple[int, ...], value, rows_written: list[int], dtype=np.int32) -> np.ndarray:
    """`shape` filled with `value`: a new array where rows will be written, else a shared one."""
    return np.full(shape, value, dtype) if rows_written else _constant(shape, value, np.dtype(dtype))


@functools.lru_cache(maxsize=64)
def _constant(shape: tuple[int, ...], value, dtype: np.dtype) -> np.ndarray:
    array = np.full(shape, value, dtype)
    array.setflags(write=False)
    return array


def sampling_tensors(rows: list, num_rows: int, vocab_size: int, history_width: int,
                     token_masks: dict[str, np.ndarray] | None = None,
                     penalty_slots: PenaltySlots | None = None) -> SamplingTensors:
    """Host arrays for `num_rows` rows from `rows`: per row a `ScheduledSequence` (anything with its
    request_id, params, seed, num_output_tokens, history, num_prompt_tokens and suppressed token ids)
    or None (padding: greedy). `token_masks`: the packed allowed-token mask of each constrained row, by id.
    `penalty_slots`: the slots of the penalised rows' counts; without it, row i's is slot i, filled
    from its history, counting nothing."""
    present = [i for i, row in enumerate(rows) if row is not None]
    # The wide arrays are shared read-only constants when no row needs them: filled anew each
    # step, they made this function take 2.6-3.1 ms for 256 rows, against 0.3 ms now (the
    # history alone is 2 MB).
    biased = [i for i in present if rows[i].params.logit_bias or rows[i].suppressed_token_ids]
    penalized = [i for i in present if rows[i].params.penalizes]
    temperature = np.zeros(num_rows, np.float32)
    top_k = np.zeros(num_rows, np.int32)
    top_p = np.ones(num_rows, np.float32)
    min_p = np.zeros(num_rows, np.float32)
    seed = np.zeros(num_rows, np.uint32)
    bias_ids = _filled((num_rows, BIAS_WIDTH), vocab_size, biased)
    bias = _filled((num_rows, BIAS_WIDTH), 0.0, biased, np.float32)
    presence = np.zeros(num_rows, np.float32)
    frequency = np.zeros(num_rows, np.float32)
    repetition = np.ones(num_rows, np.float32)
    slots = [penalty_slots.slot_for(rows[i]) if penalty_slots else (i, True, False) for i in penalized]
    filled = [i for i, (_, fill, _) in zip(penalized, slots) if fill]
    history = _filled((num_rows, history_width), vocab_size, filled)
    num_prompt = np.zeros(num_rows, np.int32)
    penalty_slot = np.full(num_rows, penalty_slots.num_slots if penalty_slots else num_rows, np.int32)
    count_sample = np.zeros(num_rows, np.bool_)
    logprobs = np.zeros(num_rows, np.bool_)
    if present:   # what every row has, a column at a time (indexed by an array: a list is converted each time)
        at, params = np.array(present), [rows[i].params for i in present]
        temperature[at] = [p.temperature for p in params]
        top_k[at] = [p.top_k for p in params]
        top_p[at] = [p.top_p for p in params]
        min_p[at] = [p.min_p for p in params]
        seed[at] = row_seeds([rows[i].seed for i in present], [rows[i].num_output_tokens for i in present])
        logprobs[at] = [p.needs_logprobs for p in params]
    for i in biased:   # what few rows have
        row = rows[i]
        ids, values = zip(*row.params.logit_bias, *((t, -np.inf) for t in row.suppressed_token_ids))
        bias_ids[i, :len(ids)], bias[i, :len(ids)] = ids, values
    for i, (slot, fill, counted) in zip(penalized, slots):
        row, p = rows[i], rows[i].params
        presence[i], frequency[i], repetition[i] = p.presence_penalty, p.frequency_penalty, p.repetition_penalty
        penalty_slot[i], count_sample[i] = slot, counted
        if fill:
            num_prompt[i] = row.num_prompt_tokens
            history[i, :len(row.history)] = row.history
            if row.placeholder:
                history[i, len(row.history)] = PLACEHOLDER
    allowed = allowed_rows(rows, num_rows, token_masks or {}, vocab_size)
    return SamplingTensors(temperature, top_k, top_p, min_p, seed, bias_ids, bias, presence, frequency,
                           repetition, history, num_prompt, penalty_slot, count_sample, logprobs, allowed)


def allowed_rows(rows: list, num_rows: int, token_masks: dict[str, np.ndarray], vocab_size: int) -> np.ndarray:
    """SamplingTensors.allowed for `num_rows` rows from `rows` (as `sampling_tensors` takes them):
    the packed mask of each row whose id has one in `token_masks`, all bits set elsewhere. A
    sequence with drafts has a mask per row ([rows, words]: after 0, 1, ... of its drafts), and
    its rows are consecutive."""
    masked = ([i for i, row in enumerate(rows) if row is not None and row.request_id in token_masks]
              if token_masks else [])
    allowed = _filled((num_rows, mask_width(vocab_size)), -1, masked)
    rows_before: dict[str, int] = {}   # a sequence's rows with drafts filled so far
    for i in masked:
        request_id = rows[i].request_id
        mask = np.asarray(token_masks[request_id])
        if mask.ndim == 2:
            k = rows_before.get(request_id, 0)
            mask, rows_before[request_id] = mask[k], k + 1
        allowed[i] = mask
    return allowed
