"""The one typed hand-off from the scheduler to the runner: what to compute in this step."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from jaxserve.sampling_params import SamplingParams


@dataclasses.dataclass(slots=True, eq=False)
class ScheduledSequence:
    """`token_ids` are computed at positions `start_position ...`; the pages are the whole table.

    Read-only by convention, not frozen: the scheduler makes one per running sequence a step, and a
    frozen dataclass's `__init__` took 2.9 us against 0.8 us with slots (256 sequences: 0.5 ms).
    Compared by identity: `block_table` is a numpy array, whose `==` has no single truth value."""

    request_id: str
    token_ids: tuple[int, ...]
    start_position: int
    block_table: Sequence[int]    # the allocator's read-only int32 snapshot (PageAllocator.table_snapshot)
    samples: bool                 # the chunk reaches the sequence's end, so a token is sampled
    params: SamplingParams
    seed: int
    num_output_tokens: int        # outputs so far: the sample's index, folded into its seed
    history: Sequence[int] = ()   # prompt then output token ids (placeholder excluded), given only
                                  # when the params penalise repetitions: Request.known_token_array
    num_prompt_tokens: int = 0    # how many of `history` are the prompt's
    suppressed_token_ids: tuple[int, ...] = () # EOS and stop ids, masked while below min_tokens
    data_slice: int = 0           # which data-parallel slice (and its part of the KV pool) runs it
    prompt_targets: tuple[int, ...] = ()   # prompt_logprobs: the prompt token each of the first tokens
                                           # predicts (token j's is the prompt's token at position + 1)
    placeholder: bool = False     # its one token is the sample of the step launched before this one,
                                  # not read back yet: the step takes its id on the device
    lora_id: int = 0              # its LoRA adapter (LoRARequest.lora_int_id); 0: the base model
    draft_token_ids: tuple[int, ...] = ()   # speculative decoding: the last tokens of `token_ids` are
                                  # proposals; the step samples after each of them (and after the token
                                  # before them), and keeps the run its samples confirm

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclasses.dataclass(frozen=True)
class SchedulerOutput:
    sequences: tuple[ScheduledSequence, ...]
    preempted_ids: tuple[str, ...] = ()
    page_copies: tuple[tuple[int, int], ...] = ()   # (source, destination) pages, copied before the step
                                                    # (global ids: slice * pages_per_slice + page)
    token_masks: Mapping[str, Sequence[int]] | None = None  # id -> packed allowed tokens of each constrained
                                                    # sampling sequence ([ceil(vocab / 32)] int32), added by
                                                    # the engine from the samples' grammars
    lora_slots: Mapping[str, int] | None = None     # id -> the device slot of its LoRA adapter (none: 0),
                                                    # added by the engine once the adapters are resident

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.sequences)

    @property
    def is_empty(self) -> bool:
        return not self.sequences
