"""Verification of speculative drafts: which of a sequence's proposed tokens it keeps.

A sequence with drafts d1..dK is computed with its last token and the drafts in one step, and
the target samples a token after each of them: sample i is drawn from the target's own
distribution p_i (temperature, truncation, penalties, bias: everything the sampler applies) given
the sequence and d1..di, with the seed of output index n + i, the one it would have without
speculation. The sequence keeps samples 0..a, where a is the number of leading drafts that equal
the samples before them: sample i is valid while d1..di are what was sampled.

This is rejection sampling with shared randomness. A proposal x is accepted exactly when the
target's own sample is x; on a rejection the target's sample stands, distributed as p given that
it is not x; after K acceptances the last sample is the bonus token. For n-gram proposals (a
one-hot q) this is the textbook rule: x is kept with probability p(x) = min(1, p(x)/q(x)), and a
rejection draws from max(p - q, 0) renormalised. A draft model samples its proposal i with the
same seed and sampling parameters as the target's sample i, so the two share their Gumbel noise:
where q is close to p the argmaxes agree (with q = p always), and the kept tokens are still the
target's own samples. Hence every kept token is distributed exactly as without speculation, and a
seeded request gives the same tokens with speculation as without it, whatever was proposed.
"""

from __future__ import annotations

from collections.abc import Sequence


def accepted_length(sampled: Sequence[int], drafts: Sequence[int]) -> int:
    """How many of a sequence's `len(drafts) + 1` samples it keeps (1 to len(drafts) + 1): up to and
    including the first sample that differs from the draft at its place, or all of them."""
    for i, draft in enumerate(drafts):
        if sampled[i] != draft:
            return i + 1
    return len(drafts) + 1
