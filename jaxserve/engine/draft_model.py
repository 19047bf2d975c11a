"""Speculative proposals from a draft model: a smaller model with the target's vocabulary proposes
the next K tokens of each speculating request, and the target verifies them in its next step.

The draft has a `Runner` of its own: its weights, its compiled programs and a KV pool of as many
pages as the target's, on the same mesh. That pool is addressed by the target's block tables, so
the draft needs no allocator: page p holds the draft's K/V of the tokens the target's page p holds.
A request's `num_draft_computed_tokens` says how many of its tokens the draft holds; it falls back
when drafts are rejected (those positions hold tokens that were not kept), to the first copied
page when the scheduler copies pages on write (the copies are the target's only), and to 0 when
the request is preempted. New requests start at 0 even where the target found its prefix cached:
the draft recomputes the prompt the first time a request speculates, writing into shared pages
the same K/V that any other request with that prefix wrote there.

`propose` (called by the scheduler once it has given the drafts their pages):
  1. catch-up: the draft computes every token it lacks but the last, in calls of up to the token
     budget, without sampling (the whole prompt, the first time; one token after a full accept);
  2. call 1 computes each request's last token and samples draft 1; calls 2..K compute each draft
     as a placeholder (its id read on the device from the call before) and sample the next. The
     calls are launched back to back, then read back together; when a grammar (structured
     outputs) or allowed_token_ids constrain some of the requests, each call is read back before
     the next, whose masks are theirs after the drafts so far (`masks_after`; where the drafts
     end the grammar, what the call samples after them is cut by `ConstrainedProposals`).
Draft i is sampled with the request's seed for its output index and its sampling parameters, so
the draft shares its Gumbel noise with the target's sample at that index: where q is close to p
they agree, and with q = p always (see rejection_sampler). Penalties too: call 1 sends a penalised
request's history and fills the draft runner's penalty slot anew from it (the slot's counts held
the last proposal's drafts, which the target may have rejected), and each call adds its draft there
on the device, so draft i is penalised for the drafts before it, as the target's row after them
is (batch.draft_row). Logprobs are left out: a proposal that differs is only rejected, never sent.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref

from jaxserve.engine.request import Request
from jaxserve.engine.runner import Runner
from jaxserve.engine.scheduler import MasksAfter, SchedulerConfig
from jaxserve.engine.scheduler_output import ScheduledSequence, SchedulerOutput
from jaxserve.sampling_params import SamplingParams

log = logging.getLogger(__name__)


def check_draft(draft, target, max_model_len: int) -> None:
    """A draft must share the target's vocabulary and hold its context: the error names both."""
    name = f"speculative_config model={str(draft.path)!r}"
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"{name} has a vocabulary of {draft.config.vocab_size} tokens, the target "
                         f"{target.config.vocab_size}: a draft model must share the target's vocabulary")
    if draft.tokenizer.get_vocab() != target.tokenizer.get_vocab():
        raise ValueError(f"{name} has {draft.config.vocab_size} tokens, as the target, but other token ids "
                         f"for them: a draft model must share the target's tokenizer")
    if draft.config.max_position_embeddings < max_model_len:
        raise ValueError(f"{name} has a context of {draft.config.max_position_embeddings} tokens, shorter than "
                         f"max_model_len={max_model_len}; lower --max-model-len or pick a draft that holds it")


def draft_params(params: SamplingParams) -> SamplingParams:
    """The request's sampling, without what a proposal does not need (see the module docstring)."""
    return dataclasses.replace(params, logprobs=None, prompt_logprobs=None, n=1, best_of=None)


class DraftModelProposer:
    """The scheduler's `Proposer` for method draft_model."""

    def __init__(self, runner: Runner, max_num_seqs: int, max_num_batched_tokens: int, prefill_segment: int):
        self.runner = runner
        self._chunks = SchedulerConfig(max_num_seqs, max_num_batched_tokens, prefill_segment)
        self._seen: weakref.WeakSet[Request] = weakref.WeakSet()   # whose draft K/V a lost pool takes along

    def propose(self, requests: list[Request], rooms: list[int], tables: list[list[int]],
                data_slice: int, masks_after: MasksAfter | None = None) -> list[tuple[int, ...]]:
        try:
            return self._propose(requests, rooms, [tuple(t) for t in tables], data_slice, masks_after)
        except Exception:  # noqa: BLE001 - a failed proposal costs the drafts, never the requests
            log.exception("the draft model's proposals failed: this step verifies no drafts")
            if self.runner.pool_is_lost():
                self.runner.reset_pool()
                for request in self._seen:
                    request.num_draft_computed_tokens = 0
            return [()] * len(requests)

    def _propose(self, requests, rooms, tables, data_slice, masks_after) -> list[tuple[int, ...]]:
        for request in requests:
            self._seen.add(request)
            # positions past the last kept token hold rejected drafts
            request.num_draft_computed_tokens = min(request.num_draft_computed_tokens, request.num_tokens - 1)
        self._catch_up(requests, tables, data_slice)
        self.runner.release_penalty_slots(r.request_id for r in requests if r.params.penalizes)
        drafts = [[] for _ in requests]
        masks = masks_after(requests, [()] * len(requests)) if masks_after else {}
        launched = []
        for i in range(max(rooms)):
            live = [k for k, room in enumerate(rooms) if room > i]
            sequences = tuple(self._sequence(requests[k], tables[k], data_slice, i) for k in live)
            launched.append((self.runner.launch(SchedulerOutput(sequences, token_masks=masks or None)), live))
            if masks:   # steered: the next call's masks follow this call's drafts
                self._take(*launched.pop(), requests, drafts)
                going = [k for k in live if rooms[k] > i + 1]
                masks = masks_after([requests[k] for k in going], [tuple(drafts[k]) for k in going])
        for step, live in launched:
            self._take(step, live, requests, drafts)
        for request, room in zip(requests, rooms):
            request.num_draft_computed_tokens = request.num_tokens + room - 1   # its last token, drafts 1..K-1
        return [tuple(d) for d in drafts]

    def _take(self, step, live: list[int], requests: list[Request], drafts: list[list[int]]) -> None:
        """Reads a call back: its draft for each request it sampled for (`live`: their indices)."""
        tokens = self.runner.collect(step).tokens
        for k in live:
            drafts[k].append(tokens[requests[k].request_id][0])

    def _catch_up(self, requests, tables, data_slice) -> None:
        """Computes each request's tokens up to its last one (exclusive), in calls within the budget."""
        while any(r.num_draft_computed_tokens < r.num_tokens - 1 for r in requests):
            budget, sequences = self._chunks.max_num_batched_tokens, []
            for request, table in zip(requests, tables):
                start = request.num_draft_computed_tokens
                num_tokens = self._chunks.largest_chunk(request.num_tokens - 1 - start, budget)
                if num_tokens == 0:
                    continue
                sequences.append(ScheduledSequence(
                    request.request_id, tuple(request.token_slice(start, start + num_tokens)), start, table, False,
                    draft_params(request.params), request.seed, 0, data_slice=data_slice))
                request.num_draft_computed_tokens += num_tokens
                budget -= self._chunks.chunk_cost(num_tokens)
            self.runner.launch(SchedulerOutput(tuple(sequences)))

    @staticmethod
    def _sequence(request: Request, table: tuple[int, ...], data_slice: int, i: int) -> ScheduledSequence:
        """Call i: the request's last token (i = 0) or draft i, a placeholder, sampling draft i + 1
        with the seed of the target's sample at that place. A penalised request's call 0 brings its
        history, to fill its released penalty slot; the calls after find the slot current."""
        position = request.num_tokens - 1 + i
        token_ids = (request.token_slice(position, position + 1)[0],) if i == 0 else (0,)
        sequence = ScheduledSequence(request.request_id, token_ids, position, table, True,
                                     draft_params(request.params), request.seed, len(request.output_token_ids) + i,
                                     data_slice=data_slice, placeholder=i > 0)
        if i == 0 and request.params.penalizes:
            sequence.history, sequence.num_prompt_tokens = request.known_token_array(), len(request.prompt_token_ids)
        return sequence
