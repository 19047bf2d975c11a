"""prompt_logprobs on the device: the logprob and rank of each prompt token under the positions
before it, and the most likely tokens there.

Only steps that carry prompt rows pay for it (step.py compiles it into their program alone), and
the [rows, vocab] logits are made `BLOCK_ROWS` rows at a time (`lax.map`), so a long prefill
chunk never holds them all at once.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import struct

from jaxserve.sampling_params import MAX_LOGPROBS

BLOCK_ROWS = 32


@struct.dataclass
class PromptLogprobs:
    logprob: jax.Array        # [T] float32: of the prompt token the row predicts
    rank: jax.Array           # [T] int32: 1 + how many tokens are more likely than it
    top_ids: jax.Array        # [T, MAX_LOGPROBS] int32, most likely first
    top_logprobs: jax.Array   # [T, MAX_LOGPROBS] float32


def score_prompt(logits_of: Callable[[jax.Array], jax.Array], index: jax.Array, target: jax.Array) -> PromptLogprobs:
    """`logits_of(rows)` -> [rows, vocab] float32 logits of those packed token rows; `index` [T] the
    rows to score, `target` [T] the token each predicts (-1: padding, scored as 0 and ignored)."""
    rows = index.shape[0]
    pad = -rows % BLOCK_ROWS
    blocks = (jnp.pad(index, (0, pad)).reshape(-1, BLOCK_ROWS),
              jnp.pad(jnp.maximum(target, 0), (0, pad)).reshape(-1, BLOCK_ROWS))
    scored = jax.lax.map(lambda block: _score_block(logits_of(block[0]), block[1]), blocks)
    return jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:])[:rows], scored)


def no_prompt_logprobs(rows: int) -> PromptLogprobs:
    """What a step without prompt rows returns in their place: zeros of the same shapes."""
    return PromptLogprobs(jnp.zeros(rows, jnp.float32), jnp.zeros(rows, jnp.int32),
                          jnp.zeros((rows, MAX_LOGPROBS), jnp.int32), jnp.zeros((rows, MAX_LOGPROBS), jnp.float32))


def _score_block(logits: jax.Array, target: jax.Array) -> PromptLogprobs:
    logprobs = logits - jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    chosen = jnp.take_along_axis(logprobs, target[:, None], axis=1)[:, 0]
    rank = 1 + jnp.sum(logprobs > chosen[:, None], axis=-1, dtype=jnp.int32)
    top_logprobs, top_ids = jax.lax.top_k(logprobs, MAX_LOGPROBS)
    return PromptLogprobs(chosen, rank, top_ids.astype(jnp.int32), top_logprobs)


def reference_prompt_logprobs(logits: jax.Array, target: jax.Array) -> PromptLogprobs:
    """The same over whole [T, vocab] logits at once: the plain reference the tests compare with."""
    return _score_block(logits, target)
