"""How to sample one request's tokens, and when to stop; shaped like vLLM's `SamplingParams`."""

from __future__ import annotations

import dataclasses

from jaxserve.errors import InvalidRequestError


def _check(ok: bool, param: str, value, allowed: str) -> None:
    if not ok:
        raise InvalidRequestError(param, f"{param}={value!r} is out of range: {allowed}")


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

    def __post_init__(self):
        # Accept lists from callers, keep tuples so the object stays hashable.
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        object.__setattr__(self, "stop", stop)
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
        _check(all(s for s in self.stop), "stop", self.stop, "stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
