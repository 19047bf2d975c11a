"""Beam search over the engine, as vLLM's `use_beam_search` and transformers' `num_beams` do it.

A search is stepped from outside: each round, every live beam (the prompt and the beam's tokens)
is sent to the engine as a one-token request that asks for the top `2 x beam_width` logprobs;
the prefix cache shares the prompt's and the beams' common pages between those requests, and the
page allocator copies a shared page before a beam writes into it. `advance` takes each beam's
candidates and keeps, as transformers does:

- running beams: the `beam_width` best non-EOS candidates by cumulative logprob;
- finished beams: an EOS candidate ranked within the first `beam_width`, scored
  `cumulative logprob / generated tokens ** length_penalty`; the best `beam_width` are kept.

It stops at `max_tokens`, when no beam runs, or by `early_stopping`: True when `beam_width` beams
have finished; False when they have and no running beam can score better any more (its score
now, as the logprobs only fall); "never" only at `max_tokens` (or for length_penalty > 0, when
no running beam can beat the finished ones even at `max_tokens`). The result: the `beam_width`
best of the finished and running beams by score, best first. Host side: no JAX.
"""

from __future__ import annotations

import dataclasses
import math

from jaxserve.engine.output import RequestOutput
from jaxserve.errors import InvalidRequestError
from jaxserve.sampling_params import SamplingParams

EARLY_STOPPING = (True, False, "never")


@dataclasses.dataclass(frozen=True)
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    ignore_eos: bool = False

    def __post_init__(self):
        if not 1 <= self.beam_width <= 10:
            raise ValueError(f"beam_width={self.beam_width} must be in [1, 10] (each beam asks for the top "
                             f"2 x beam_width logprobs, at most 20)")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be >= 1")
        if self.early_stopping not in EARLY_STOPPING:
            raise ValueError(f"early_stopping={self.early_stopping!r} is not one of {EARLY_STOPPING}")

    @property
    def candidates(self) -> int:
        """Top logprobs asked of each beam: enough for beam_width non-EOS continuations."""
        return 2 * self.beam_width


@dataclasses.dataclass(frozen=True)
class Beam:
    tokens: tuple[int, ...]            # generated so far
    logprobs: tuple[float, ...]        # of each token
    finished: bool = False             # ended with EOS

    @property
    def cumulative_logprob(self) -> float:
        return math.fsum(self.logprobs)

    def score(self, length_penalty: float) -> float:
        return self.cumulative_logprob / len(self.tokens) ** length_penalty if self.tokens else 0.0


class BeamSearch:
    """One prompt's search: `live` beams to score, `advance` with their candidates, until `done`."""

    def __init__(self, params: BeamSearchParams, eos_token_ids: tuple[int, ...]):
        self.params = params
        self.eos = () if params.ignore_eos else tuple(eos_token_ids)
        self.live: list[Beam] = [Beam((), ())]
        self.finished: list[Beam] = []
        self._stopped = False

    @property
    def done(self) -> bool:
        return self._stopped or not self.live

    def advance(self, candidates: list[list[tuple[int, float]]]) -> None:
        """`candidates[i]`: live beam i's most likely next (token id, logprob), at least
        `params.candidates` of them (fewer only when the vocabulary is smaller)."""
        p = self.params
        pooled = sorted(((beam.cumulative_logprob + logprob, i, token, logprob)
                         for i, (beam, tops) in enumerate(zip(self.live, candidates))
                         for token, logprob in tops[:p.candidates]), key=lambda c: c[0], reverse=True)
        pooled = pooled[:p.candidates]
        running = []   # (beam, its rank among the candidates)
        for rank, (_, i, token, logprob) in enumerate(pooled):
            beam = self.live[i]
            grown = Beam(beam.tokens + (token,), beam.logprobs + (logprob,), token in self.eos)
            if grown.finished:
                if rank < p.beam_width:   # an EOS beyond the first beam_width is not taken (transformers)
                    self.finished.append(grown)
            elif len(running) < p.beam_width:
                running.append((grown, rank))
        self.finished = sorted(self.finished, key=lambda b: b.score(p.length_penalty), reverse=True)[:p.beam_width]
        if running and len(running[0][0].tokens) >= p.max_tokens:
            # the last step: as transformers, only the first beam_width candidates end the search
            self.live, self._stopped = [b for b, rank in running if rank < p.beam_width], True
            return
        self.live = [b for b, _ in running]
        self._stopped = self._early_stop()

    def _early_stop(self) -> bool:
        p = self.params
        if len(self.finished) < p.beam_width:
            return False
        if p.early_stopping is True:
            return True
        worst = self.finished[-1].score(p.length_penalty)
        best = max(b.cumulative_logprob for b in self.live)
        if p.early_stopping is False or p.length_penalty <= 0:
            length = len(self.live[0].tokens)
        else:   # "never" with a length bonus: the best a beam could still reach, at max_tokens
            length = p.max_tokens
        return best / length ** p.length_penalty <= worst

    def best(self) -> list[Beam]:
        """The result: the best `beam_width` beams, finished or not, by score."""
        everyone = self.finished + self.live
        return sorted(everyone, key=lambda b: b.score(self.params.length_penalty), reverse=True)[:self.params.beam_width]


def round_params(params: BeamSearchParams) -> SamplingParams:
    """What each beam's one-token request asks for: no sampling, the top candidates' logprobs."""
    return SamplingParams(max_tokens=1, temperature=0, logprobs=params.candidates, ignore_eos=True)


def candidates(output: RequestOutput) -> list[tuple[int, float]]:
    """A one-token request's most likely next tokens, from its logprobs."""
    return list(output.outputs[0].logprobs[0].top)


def check_length(prompt_len: int, params: BeamSearchParams, max_model_len: int) -> None:
    if prompt_len + params.max_tokens > max_model_len:
        raise InvalidRequestError("max_tokens", f"max_tokens={params.max_tokens} plus the prompt's {prompt_len} "
                                                f"tokens exceeds max_model_len={max_model_len}")
