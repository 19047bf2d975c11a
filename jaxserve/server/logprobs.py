"""The engine's per-token logprobs in each endpoint's wire shape.

The engine gives one `TokenLogprob` (token id, logprob, top k) per generated token. Completions
show them in OpenAI's legacy shape (parallel lists, top tokens as a text -> logprob map), chat in
its newer one (an object per token, with the text's UTF-8 bytes), `/generate` by token id. A
token's text is that token decoded on its own, as vLLM shows it; a token holding part of a
multi-byte character therefore shows as U+FFFD.
"""

from __future__ import annotations

import itertools

import math
from collections.abc import Sequence

from jaxserve.engine.output import TokenLogprob
from jaxserve.server.openai_protocol import (
    ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, GenerateTokenLogprob, PromptLogprob, PromptLogprobs,
    TokenIdLogprob, TopLogprob)

# JSON has no -Infinity: a token the model rules out entirely gets this floor instead (as in vLLM).
LOWEST_LOGPROB = -9999.0


class TokenTexts:
    """Each token id's text, decoded once per request; `as_ids`: 'token_id:N' instead (vLLM's
    return_tokens_as_token_ids, for tokens whose text alone is not valid UTF-8)."""

    def __init__(self, tokenizer, as_ids: bool = False):
        self._tokenizer = tokenizer
        self._as_ids = as_ids
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        if token_id not in self._texts:
            self._texts[token_id] = (f"token_id:{token_id}" if self._as_ids else
                                     self._tokenizer.decode([token_id], skip_special_tokens=False))
        return self._texts[token_id]


def wire_logprob(logprob: float) -> float:
    return LOWEST_LOGPROB if math.isnan(logprob) or logprob < LOWEST_LOGPROB else logprob


def completion_logprobs(entries: Sequence[TokenLogprob], texts: TokenTexts,
                        offset: int = 0) -> CompletionLogprobs:
    """OpenAI's completions logprobs; `offset`: where the first token starts in the completion text
    (in a stream, the length of the token texts already sent)."""
    tokens = [texts(e.token_id) for e in entries]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return CompletionLogprobs(tokens=tokens, token_logprobs=[wire_logprob(e.logprob) for e in entries],
                              top_logprobs=[_top_map(e, texts) for e in entries], text_offset=offsets)


def echo_logprobs(prompt_token_ids: Sequence[int], entries: Sequence[TokenLogprob | None], texts: TokenTexts,
                  k: int) -> CompletionLogprobs:
    """The prompt's part of completions' logprobs under echo, from the engine's prompt_logprobs:
    every prompt token, the first with null logprobs (nothing comes before it), the others with
    the top k at their position."""
    tokens = [texts(t) for t in prompt_token_ids]
    offsets = list(itertools.accumulate(map(len, tokens), initial=0))[:-1]   # each token's start in the text
    return CompletionLogprobs(
        tokens=tokens, token_logprobs=[None if e is None else wire_logprob(e.logprob) for e in entries],
        top_logprobs=[None if e is None else _top_map(TokenLogprob(e.token_id, e.logprob, e.top[:k]), texts)
                      for e in entries],
        text_offset=offsets)


def joined(prompt: CompletionLogprobs, completion: CompletionLogprobs | None) -> CompletionLogprobs:
    """echo's logprobs: the prompt's, then the completion's (its offsets already past the prompt's)."""
    if completion is None:
        return prompt
    return CompletionLogprobs(tokens=prompt.tokens + completion.tokens,
                              token_logprobs=prompt.token_logprobs + completion.token_logprobs,
                              top_logprobs=prompt.top_logprobs + completion.top_logprobs,
                              text_offset=prompt.text_offset + completion.text_offset)


def prompt_logprobs(entries: Sequence[TokenLogprob | None], texts: TokenTexts, k: int) -> PromptLogprobs:
    """vLLM's prompt_logprobs: per prompt token, by token id, the token and the k most likely there."""
    wire = []
    for entry in entries:
        if entry is None:
            wire.append(None)
            continue
        found = {str(entry.token_id): PromptLogprob(logprob=wire_logprob(entry.logprob), rank=entry.rank,
                                                    decoded_token=texts(entry.token_id))}
        for rank, (token_id, logprob) in enumerate(entry.top[:k], start=1):
            found.setdefault(str(token_id), PromptLogprob(logprob=wire_logprob(logprob), rank=rank,
                                                          decoded_token=texts(token_id)))
        wire.append(found)
    return wire


def _top_map(entry: TokenLogprob, texts: TokenTexts) -> dict[str, float]:
    """The top tokens, most likely first, then the sampled token if it is not among them (as OpenAI
    does: up to k + 1 entries). Tokens with the same text keep the likelier one's logprob."""
    top: dict[str, float] = {}
    for token_id, logprob in [*entry.top, (entry.token_id, entry.logprob)]:
        top.setdefault(texts(token_id), wire_logprob(logprob))
    return top


def chat_logprobs(entries: Sequence[TokenLogprob], texts: TokenTexts) -> ChatLogprobs:
    """OpenAI's chat logprobs: `{"content": [one object per token]}`."""
    return ChatLogprobs(content=[
        ChatTokenLogprob(**_chat_token(e.token_id, e.logprob, texts),
                         top_logprobs=[TopLogprob(**_chat_token(t, lp, texts)) for t, lp in e.top])
        for e in entries])


def _chat_token(token_id: int, logprob: float, texts: TokenTexts) -> dict:
    """The fields chat shows of one token: its text, logprob and the text's UTF-8 bytes."""
    text = texts(token_id)
    return dict(token=text, logprob=wire_logprob(logprob), bytes=list(text.encode("utf-8")))


def generate_logprobs(entries: Sequence[TokenLogprob]) -> list[GenerateTokenLogprob]:
    """`/generate`'s logprobs: by token id, no text."""
    return [GenerateTokenLogprob(token_id=e.token_id, logprob=wire_logprob(e.logprob), top_logprobs=[
        TokenIdLogprob(token_id=t, logprob=wire_logprob(lp)) for t, lp in e.top]) for e in entries]
