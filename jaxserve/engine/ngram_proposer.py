"""n-gram speculative proposals (prompt lookup): the tokens that followed the latest earlier
occurrence of a sequence's last n tokens, over its own prompt and output. Host side, numpy only.

Longest n first (`prompt_lookup_max` down to `prompt_lookup_min`): a longer match is a likelier
continuation. The latest occurrence wins, since text being copied or edited repeats what came
shortly before. One comparison of every window with the suffix per n: ~0.1 ms on 8k tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def propose(prompt: Sequence[int], output: Sequence[int], num_tokens: int, min_n: int, max_n: int) -> tuple[int, ...]:
    """Up to `num_tokens` proposed tokens to follow prompt + output; () when no n-gram recurs."""
    tokens = np.concatenate((np.asarray(prompt, np.int64), np.asarray(output, np.int64)))
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # windows start at 0 .. length - n - 1, so each is followed by at least one token
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
        hits = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tuple(tokens[start:start + num_tokens].tolist())
    return ()


class NgramProposer:
    """The scheduler's `Proposer` for method ngram."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, requests, rooms: list[int], tables, data_slice: int, masks_after=None) -> list[tuple[int, ...]]:
        return [propose(r.prompt_token_ids, r.output_token_ids, room, self.min_n, self.max_n)
                for r, room in zip(requests, rooms)]
