"""One sequence being generated: its tokens, how far the KV cache has computed them, its state."""

from __future__ import annotations

import dataclasses
import enum
import time

import numpy as np

from jaxserve.engine.page_allocator import page_hashes
from jaxserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"        # EOS, a stop token id or a stop string
    LENGTH = "length"    # max_tokens or the context length
    ABORT = "abort"      # the client went away or asked to cancel
    ERROR = "error"      # the engine step failed


def _read_only(array: np.ndarray) -> np.ndarray:
    view = array.view()
    view.flags.writeable = False
    return view


@dataclasses.dataclass(eq=False)
class Request:
    """A sequence. Its KV cache holds `num_computed_tokens` of `token_ids`; the rest is to compute.

    There is no prefill or decode phase: a new request has everything to compute, a decoding one
    has exactly one token (its last sample) left.

    Under async scheduling that last sample may still be on the device: a step that samples it
    has been launched and not read back. It counts as a placeholder (`num_placeholders`: one per
    such step, so at most one when a step is scheduled): it is part of `num_tokens`, and the next
    step takes its id from the device.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int                       # resolved: the params' seed or one the engine drew
    max_total_tokens: int           # prompt + output may not exceed this (the context length)
    eos_token_ids: tuple[int, ...] = ()
    priority: int = 0               # lower runs sooner under the priority policy
    lora_id: int = 0                # its LoRA adapter (LoRARequest.lora_int_id); 0: the base model
    arrival_time: float = dataclasses.field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None   # monotonic: first admitted to the running batch
    num_cached_tokens: int | None = None   # prompt tokens found in the prefix cache at first admission
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    num_computed_tokens: int = 0   # counted when a step is scheduled (its K/V is written by then)
    num_placeholders: int = 0       # sampled by a launched step, not read back yet
    num_draft_computed_tokens: int = 0   # speculative decoding: tokens whose K/V a draft model holds
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    arrival_index: int = 0          # set by the scheduler: its order of arrival
    steps_waited: int = 0           # scheduling steps spent waiting, over the request's life
    promoted: bool = False          # waited long enough to outrank every priority
    _page_hashes: list[bytes] = dataclasses.field(default_factory=list, init=False, repr=False)
    _known: np.ndarray = dataclasses.field(default_factory=lambda: np.empty(0, np.int32), init=False, repr=False)
    _known_read_only: np.ndarray = dataclasses.field(default_factory=lambda: _read_only(np.empty(0, np.int32)),
                                                     init=False, repr=False)   # a view of _known
    _num_known_filled: int = dataclasses.field(default=0, init=False, repr=False)   # of _known

    @property
    def num_tokens(self) -> int:
        """Prompt, outputs and placeholders."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_placeholders

    @property
    def num_known_tokens(self) -> int:
        """Prompt and outputs: the tokens whose ids the host has."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Outputs and placeholders: the index of the next token sampled."""
        return len(self.output_token_ids) + self.num_placeholders

    @property
    def placeholder_finishes(self) -> bool:
        """Its placeholder, once read back, ends it by length (max_tokens or the context)."""
        p = self.params
        return self.num_placeholders > 0 and (
            (p.max_tokens is not None and self.num_output_tokens >= p.max_tokens)
            or self.num_tokens >= self.max_total_tokens)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def token_slice(self, start: int, stop: int) -> list[int]:
        """token ids [start, stop) of prompt + output."""
        prompt_len = len(self.prompt_token_ids)
        if start >= prompt_len:  # decodes: no copy of the prompt every step
            return self.output_token_ids[start - prompt_len:stop - prompt_len]
        if stop <= prompt_len:
            return self.prompt_token_ids[start:stop]
        return self.prompt_token_ids[start:] + self.output_token_ids[:stop - prompt_len]

    def known_token_array(self) -> np.ndarray:
        """Prompt then output token ids, as a read-only int32 view of a buffer extended in place as
        outputs arrive (a penalised request's sampling history: read from the lists anew every
        step, 256 rows of 1,056 tokens took 5.3 ms a step)."""
        n, filled, prompt_len = self.num_known_tokens, self._num_known_filled, len(self.prompt_token_ids)
        if n > len(self._known):   # grown by doubling: a copy once in as many tokens as it holds
            grown = np.empty(max(n, 2 * len(self._known), 64), np.int32)
            grown[:filled] = self._known[:filled]
            self._known, self._known_read_only = grown, _read_only(grown)
        if filled < prompt_len:
            self._known[filled:prompt_len] = self.prompt_token_ids[filled:]
            filled = prompt_len
        if filled == n - 1:   # the usual step: one output more (a slice of the list took 1 us)
            self._known[filled] = self.output_token_ids[-1]
        elif filled < n:
            self._known[filled:n] = self.output_token_ids[filled - prompt_len:]
        self._num_known_filled = n
        return self._known_read_only[:n]   # read-only as the view it slices: setting the flag took 1 us

    def drop_last_outputs(self, num: int) -> None:
        """Removes the last `num` output tokens (a stop string ended the request before them)."""
        del self.output_token_ids[len(self.output_token_ids) - num:]
        self._num_known_filled = min(self._num_known_filled, self.num_known_tokens)

    def page_hashes(self, page_size: int) -> list[bytes]:
        """Prefix-cache hashes of the full pages of prompt + output (grown as tokens arrive)."""
        if len(self._page_hashes) < self.num_known_tokens // page_size:
            root = self.lora_id.to_bytes(8, "little") if self.lora_id else b""
            page_hashes(self.token_slice(0, self.num_known_tokens), page_size, self._page_hashes, root)
        return self._page_hashes

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def finish(self, reason: FinishReason) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason

    def append_token(self, token: int) -> bool:
        """Records a sampled token (in place of its placeholder, if it has one) and finishes the
        request if it is a stopping one; returns whether it did."""
        if self.num_placeholders:
            self.num_placeholders -= 1
        self.output_token_ids.append(token)
        num_out = len(self.output_token_ids)
        p = self.params
        if num_out >= p.min_tokens and (
                token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids)):
            self.finish(FinishReason.STOP)
        elif ((p.max_tokens is not None and num_out >= p.max_tokens)
              or len(self.prompt_token_ids) + num_out >= self.max_total_tokens):   # num_known_tokens
            self.finish(FinishReason.LENGTH)
        return self.status is RequestStatus.FINISHED
