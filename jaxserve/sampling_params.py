"""How to sample one request's tokens, and when to stop; shaped like vLLM's `SamplingParams`."""

from __future__ import annotations

import dataclasses
import enum
import functools
import json

from jaxserve.errors import InvalidRequestError


def _check(ok: bool, param: str, value, allowed: str) -> None:
    if not ok:
        raise InvalidRequestError(param, f"{param}={value!r} is out of range: {allowed}")


MAX_LOGPROBS = 20          # top logprobs per token (OpenAI's chat limit)
MAX_LOGIT_BIAS = 300       # logit_bias entries per request
MAX_STOP_TOKEN_IDS = 64    # stop_token_ids per request (suppressed with EOS until min_tokens)
MAX_STOP = 16              # stop strings per request: each new token's text is checked against all


class RequestOutputKind(enum.Enum):
    """What each of a request's outputs holds (vLLM's): everything so far, only what is new since
    the request's last output, or nothing until the final one (what `LLM.generate` asks for).
    Outputs at every step cost the engine 3.2-4.0 ms a step for 256 decodes, final ones only
    1.7-1.8 ms (tools/bench_host.py --tiny, one run)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on the generated text (vLLM's `structured_outputs`): exactly one of these."""

    json: str | None = None             # a JSON schema (text; a dict is accepted)
    regex: str | None = None
    choice: tuple[str, ...] | None = None   # the text is one of these strings
    grammar: str | None = None          # Lark, or GBNF as llama.cpp writes it
    json_object: bool = False           # any JSON object

    def __post_init__(self):
        if isinstance(self.json, dict):   # as text, so that the params stay hashable (keys keep their order)
            object.__setattr__(self, "json", json.dumps(self.json))
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
            _check(len(self.choice) >= 1, "structured_outputs.choice", list(self.choice), "give at least one choice")
        _check(len(self._given()) == 1, "structured_outputs", self._given() or None,
               "give exactly one of json, regex, choice, grammar, json_object")

    def _given(self) -> list[str]:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        return given + ["json_object"] if self.json_object else given

    @property
    def kind(self) -> str:
        return self._given()[0]


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    n: int = 1                          # independent samples for the prompt
    temperature: float = 1.0            # 0 = greedy
    top_p: float = 1.0                  # nucleus mass, (0, 1]
    top_k: int = -1                     # -1 or 0 = all tokens
    min_p: float = 0.0                  # drop tokens below min_p * p(most likely), [0, 1]
    seed: int | None = None             # same seed, same tokens, whatever else is batched
    max_tokens: int | None = 16         # None: up to the model's context length
    min_tokens: int = 0                 # EOS and stop ids are not honoured before this many tokens
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()          # stop strings, applied to the detokenised text
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0       # subtracted once from every token already generated
    frequency_penalty: float = 0.0      # subtracted per occurrence in the generated tokens
    repetition_penalty: float = 1.0     # divides (positive) or multiplies (negative) logits of tokens
                                        # in the prompt or the output; 1 = off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) added to the logits; a dict is accepted
    logprobs: int | None = None         # None: no logprobs; k: the sampled token's and the top k's
    best_of: int | None = None          # samples to generate, of which the n most likely are returned
    structured_outputs: StructuredOutputsParams | None = None   # the text must match this constraint
    allowed_token_ids: tuple[int, ...] | None = None   # only these tokens may be sampled (vLLM's)
    truncate_prompt_tokens: int | None = None   # keep only the prompt's last k tokens; -1: max_model_len
    prompt_logprobs: int | None = None  # None: none; k: each prompt token's logprob, rank and the top k's
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self):
        # Accept lists from callers, keep tuples so the object stays hashable.
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        object.__setattr__(self, "stop", stop)
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else (self.logit_bias or ())
        object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in bias)))
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", tuple(sorted({int(t) for t in self.allowed_token_ids})))
            _check(len(self.allowed_token_ids) >= 1, "allowed_token_ids", [], "must name at least one token")
        _check(self.truncate_prompt_tokens is None or self.truncate_prompt_tokens == -1
               or self.truncate_prompt_tokens >= 1, "truncate_prompt_tokens", self.truncate_prompt_tokens,
               "must be >= 1, or -1 (max_model_len)")
        _check(self.n >= 1, "n", self.n, "must be >= 1")
        _check(self.temperature >= 0, "temperature", self.temperature, "must be >= 0")
        _check(0 < self.top_p <= 1, "top_p", self.top_p, "must be in (0, 1]")
        _check(self.top_k >= -1, "top_k", self.top_k, "must be -1 (disabled), 0 (disabled) or >= 1")
        _check(0 <= self.min_p <= 1, "min_p", self.min_p, "must be in [0, 1]")
        _check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens", self.max_tokens, "must be >= 1")
        _check(self.min_tokens >= 0, "min_tokens", self.min_tokens, "must be >= 0")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
               self.min_tokens, f"must be <= max_tokens={self.max_tokens}")
        _check(self.seed is None or 0 <= self.seed < 2**63, "seed", self.seed, "must be in [0, 2**63)")
        _check(len(self.stop) <= MAX_STOP, "stop", f"{len(self.stop)} strings", f"at most {MAX_STOP} stop strings")
        _check(all(s for s in self.stop), "stop", self.stop, "stop strings must be non-empty")
        _check(len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS, "stop_token_ids", len(self.stop_token_ids),
               f"at most {MAX_STOP_TOKEN_IDS} ids")
        _check(-2 <= self.presence_penalty <= 2, "presence_penalty", self.presence_penalty, "must be in [-2, 2]")
        _check(-2 <= self.frequency_penalty <= 2, "frequency_penalty", self.frequency_penalty,
               "must be in [-2, 2]")
        _check(0 < self.repetition_penalty <= 2, "repetition_penalty", self.repetition_penalty,
               "must be in (0, 2]")
        _check(len(self.logit_bias) <= MAX_LOGIT_BIAS, "logit_bias", f"{len(self.logit_bias)} entries",
               f"at most {MAX_LOGIT_BIAS} entries")
        for token, bias in self.logit_bias:
            _check(-100 <= bias <= 100, "logit_bias", {token: bias}, "biases must be in [-100, 100]")
        _check(self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS, "logprobs", self.logprobs,
               f"must be in [0, {MAX_LOGPROBS}]")
        _check(self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS, "prompt_logprobs",
               self.prompt_logprobs, f"must be in [0, {MAX_LOGPROBS}]")
        _check(self.best_of is None or self.best_of >= self.n, "best_of", self.best_of,
               f"must be >= n={self.n}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def num_samples(self) -> int:
        """Samples generated: best_of if given, else n."""
        return self.best_of or self.n

    @property
    def streams(self) -> bool:
        """Whether the request has an output at every step it moves: not when it asks for its final
        output only, nor with best_of > n, whose returned samples are known only at the end."""
        return self.num_samples == self.n and self.output_kind != RequestOutputKind.FINAL_ONLY

    @functools.cached_property   # read for every sequence at every step
    def needs_logprobs(self) -> bool:
        """Whether each sampled token's logprob is needed: asked for, or to rank best_of's samples."""
        return self.logprobs is not None or self.num_samples > self.n

    @functools.cached_property
    def penalizes(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
