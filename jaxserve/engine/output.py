"""What the engine returns for a request, and the per-sample text: detokenised, stop strings applied.

Text that might be the start of a stop string is held back until it resolves, so no client ever
sees a piece of a stop string; when one completes, the text ends just before it.
"""

from __future__ import annotations

import dataclasses

from jaxserve.tokenizer import IncrementalDetokenizer


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """A sampled token's log-probability under the model (before penalties, bias and temperature)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()   # the k most likely (token id, logprob), most likely first
    rank: int | None = None                   # prompt_logprobs: 1 + the tokens more likely than it


@dataclasses.dataclass
class CompletionOutput:
    """One sample. `text`, `token_ids` and `logprobs` are cumulative."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None   # None while running; "stop", "length", "abort" or "error"
    logprobs: list[TokenLogprob] | None = None   # one per token when the request asked for logprobs
    cumulative_logprob: float | None = None      # sum of the tokens' logprobs, when they were computed

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    error: str | None = None          # set with finish_reason "error"
    metrics: RequestMetrics | None = None
    num_cached_tokens: int | None = None   # prompt tokens read from the prefix cache (None: not admitted yet)
    prompt_logprobs: list[TokenLogprob | None] | None = None   # per prompt token (the first: None), when asked
    error_param: str | None = None    # the request field an error comes from (the client's to change)


@dataclasses.dataclass(frozen=True)
class RequestMetrics:
    """When a request got where (time.monotonic seconds; None: not yet), as vLLM's."""

    arrival_time: float
    first_scheduled_time: float | None   # first in the running batch (queue time ends)
    first_token_time: float | None       # its first token sampled (prefill ends)


class SampleText:
    """Text of one sample, grown token by token. Without stop strings nothing in the text can end
    the sample, so its tokens are detokenised only when the text is read (`catch_up`): once per
    output for a stream, once at the end for a request that asks for its final output only.
    `tokens` is the sample's own list of output token ids (`Request.output_token_ids`), which the
    scheduler appends to: a text without stop strings reads them from there when it is read, and
    `add` has nothing to do for it."""

    def __init__(self, tokenizer, stop: tuple[str, ...], skip_special_tokens: bool, tokens: list[int]):
        self._detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
        self._stop = stop
        self._held = ""
        self._tokens = tokens
        self._num_read = 0   # of `tokens`, detokenised (no stop strings)
        self._text = ""
        self.stopped = False

    @property
    def text(self) -> str:
        self.catch_up()
        return self._text

    def add(self, token_id: int) -> bool:
        """Adds the sample's next token (in `tokens` already); True if a stop string completed (the
        text then ends before it)."""
        if self._stop and not self.stopped:
            self.stopped = self._release(self._detokenizer.add(token_id), final=False)
        return self.stopped

    def catch_up(self) -> None:
        """Detokenises the tokens added since the text was last read (no stop strings)."""
        if not self._stop and self._num_read < len(self._tokens):
            pending, self._num_read = self._tokens[self._num_read:], len(self._tokens)   # read once,
            self._text += self._detokenizer.add(pending)   # even when a tokenizer fails on them

    def finish(self) -> None:
        """Releases whatever was held back, unless a stop string already ended the text."""
        self.catch_up()
        if not self.stopped:
            self._release(self._detokenizer.flush(), final=True)

    def _release(self, piece: str, final: bool) -> bool:
        pending = self._held + piece
        if not self._stop:
            self._text += pending
            self._held = ""
            return False
        hits = [i for i in (pending.find(s) for s in self._stop) if i >= 0]
        if hits:
            self._text += pending[:min(hits)]
            self._held = ""
            return True
        keep = 0 if final else _longest_stop_prefix_suffix(pending, self._stop)
        self._text += pending[:len(pending) - keep]
        self._held = pending[len(pending) - keep:]
        return False


def _longest_stop_prefix_suffix(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that begins some stop string."""
    longest = 0
    for stop in stops:
        for length in range(min(len(stop) - 1, len(text)), longest, -1):
            if stop.startswith(text[-length:]):
                longest = length
                break
    return longest
