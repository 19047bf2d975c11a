"""Structured outputs: a grammar per constrained sample, and each step's allowed-token masks.

llguidance does the grammar work: it compiles JSON schemas, regexes, choices and Lark/GBNF
grammars against the tokenizer, tracks each sample's position in its grammar (a matcher), and
fills a packed bitmask of the tokens that may come next, in parallel over rows (its own threads,
without the GIL). The sampler applies the mask before anything else (`jaxserve.engine.sampler`).

A compiled grammar is cached by its constraint, so a schema sent with every request is compiled
once. A matcher only ever moves forward with the sample's tokens: preemption recomputes the KV
cache, not the tokens, so the matcher survives it unchanged.

Speculative decoding: a draft model samples each constrained sample's drafts under its grammar's
mask after the drafts before them (and its allowed_token_ids'), and any proposal is cut to what
they allow (`ConstrainedProposals`); the step gets a mask per sampling row, after 0, 1, ... of its
drafts (`Grammars.fill_masks`), filled without moving the matcher; it takes the kept tokens afterwards.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping

import llguidance
import llguidance.numpy
import numpy as np

from jaxserve.errors import InvalidRequestError
from jaxserve.sampling_params import StructuredOutputsParams

# JSON on one line, spaced as json.dumps writes it: a flexible-whitespace grammar lets a small
# model emit newlines until max_tokens instead of closing the object.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_GRAMMAR_CACHE_SIZE = 256
_WHAT = {"json": "the JSON schema", "regex": "the regex", "choice": "the choices", "grammar": "the grammar",
         "json_object": "the JSON object grammar"}


def mask_width(vocab_size: int) -> int:
    """int32 words per row of a packed token mask: one bit per token, token t in word t // 32."""
    return (vocab_size + 31) // 32


def pack_tokens(token_ids, vocab_size: int) -> np.ndarray:
    """[mask_width] int32: the packed mask that allows exactly `token_ids` (allowed_token_ids)."""
    words = np.zeros(mask_width(vocab_size), np.uint32)
    ids = np.asarray(token_ids, np.int64)
    np.bitwise_or.at(words, ids // 32, (np.uint32(1) << (ids % 32).astype(np.uint32)))
    return words.view(np.int32)


def within_allowed(masks: dict[str, np.ndarray], allowed: Mapping[str, np.ndarray], ids) -> dict[str, np.ndarray]:
    """`masks` (packed, by id) with the allowed_token_ids mask of each of `ids` that has one put in,
    or combined with its grammar's (a token must pass both)."""
    for i in (i for i in ids if i in allowed):
        masks[i] = masks[i] & allowed[i] if i in masks else allowed[i]
    return masks


class Grammars:
    """Compiles constraints for one tokenizer and fills the allowed-token masks of a step."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...], max_bytes: int):
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.max_bytes = max_bytes
        self._compiled = functools.lru_cache(_GRAMMAR_CACHE_SIZE)(self._compile)

    @functools.cached_property
    def _llg(self) -> tuple:
        """llguidance's tokenizer and thread pool (about a second to build: only once a request asks
        for a constraint)."""
        import llguidance.hf   # imports transformers: only here, not wherever the sampler is imported

        tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self.vocab_size,
                                                 eos_token=list(self.eos_token_ids))
        return tokenizer, llguidance.LLExecutor()

    def grammar(self, constraint: StructuredOutputsParams) -> str:
        """The llguidance grammar of `constraint`, compiled and checked; InvalidRequestError naming
        the field and llguidance's message when it does not compile."""
        field, what = _names(constraint)
        size = len((constraint.json or constraint.regex or constraint.grammar or "").encode())
        size += sum(len(c.encode()) for c in constraint.choice or ())
        if size > self.max_bytes:
            raise InvalidRequestError(field, f"{what} is {size} bytes; at most {self.max_bytes} are allowed "
                                             f"(--max-structured-output-bytes)")
        return self._compiled(constraint)

    def _compile(self, constraint: StructuredOutputsParams) -> str:
        tokenizer, _ = self._llg
        field, what = _names(constraint)
        try:
            grammar = _grammar_text(constraint)
        except ValueError as error:
            raise InvalidRequestError(field, f"{what} is invalid: {error}") from None
        message = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
        if message and not message.startswith("WARNING"):
            raise InvalidRequestError(field, f"{what} does not compile: {message.strip()}")
        return grammar

    def matcher(self, grammar: str):
        """A fresh matcher: one per sample, at the grammar's start."""
        tokenizer, _ = self._llg
        return llguidance.LLMatcher(tokenizer, grammar, log_level=0)

    def fill_masks(self, matchers: list, drafts: list[tuple[int, ...]]) -> list[np.ndarray]:
        """For each matcher, [1 + len(its drafts), mask_width] int32: the tokens it allows next, then
        after each of its drafts (speculative decoding: the grammar's drafts, see `ConstrainedProposals`),
        its state left as it was; filled in parallel."""
        _, executor = self._llg
        starts = np.cumsum([0] + [1 + len(d) for d in drafts]).tolist()
        masks = np.zeros((starts[-1], mask_width(self.vocab_size)), np.int32)
        plain = [(m, start) for m, start, d in zip(matchers, starts, drafts) if not d]
        drafted = [(m, start, list(d)) for m, start, d in zip(matchers, starts, drafts) if d]
        if plain:
            llguidance.numpy.fill_next_token_bitmask_par(executor, plain, masks)
        if drafted:   # (llguidance refuses empty drafts there)
            llguidance.numpy.fill_next_token_bitmask_par_with_draft_tokens(executor, drafted, masks)
        return np.split(masks, starts[1:-1])


class ConstrainedProposals:
    """A speculative `Proposer` whose proposals each constrained sample's grammar and
    allowed_token_ids allow: a draft model samples them under the masks (`masks_after`), and any
    proposal is cut before the first token they reject, so that every draft row is sampled under
    the mask of the grammar's state after the drafts before it (`Grammars.fill_masks`)."""

    def __init__(self, proposer, matchers: Mapping[str, llguidance.LLMatcher], allowed: Mapping[str, np.ndarray],
                 grammars: Grammars):
        self._proposer = proposer
        self._matchers = matchers   # the engine's, by sample id: read as they are at each proposal
        self._allowed = allowed     # the engine's packed allowed_token_ids masks, by sample id
        self._grammars = grammars

    def propose(self, requests: list, rooms: list[int], tables: list[list[int]], data_slice: int
                ) -> list[tuple[int, ...]]:
        steer = any(r.request_id in self._matchers or r.request_id in self._allowed for r in requests)
        proposals = self._proposer.propose(requests, rooms, tables, data_slice, self.masks_after if steer else None)
        return [self._allowed_prefix(r.request_id, proposed) for r, proposed in zip(requests, proposals)]

    def masks_after(self, requests: list, drafts: list[tuple[int, ...]]) -> dict[str, np.ndarray]:
        """The packed allowed-token mask of each constrained request after its drafts: its grammar's
        (the matcher does not move; all zero once the drafts end the grammar or leave it), its
        allowed_token_ids', or both combined."""
        in_grammar = [(r.request_id, d) for r, d in zip(requests, drafts) if r.request_id in self._matchers]
        masks = {}
        if in_grammar:
            filled = self._grammars.fill_masks([self._matchers[i] for i, _ in in_grammar], [d for _, d in in_grammar])
            masks = {i: rows[-1] for (i, _), rows in zip(in_grammar, filled)}
        return within_allowed(masks, self._allowed, [r.request_id for r in requests])

    def _allowed_prefix(self, sample_id: str, proposed: tuple[int, ...]) -> tuple[int, ...]:
        allowed = self._allowed.get(sample_id)
        if allowed is not None:
            proposed = proposed[:next((k for k, t in enumerate(proposed) if not allowed[t >> 5] >> (t & 31) & 1),
                                      len(proposed))]
        matcher = self._matchers.get(sample_id)
        return proposed[:matcher.validate_tokens(list(proposed))] if matcher is not None and proposed else proposed


def _names(constraint: StructuredOutputsParams) -> tuple[str, str]:
    """The constraint's field (an error's param) and how a message names it."""
    return f"structured_outputs.{constraint.kind}", _WHAT[constraint.kind]


def _grammar_text(constraint: StructuredOutputsParams) -> str:
    if constraint.json is not None:
        schema = json.loads(constraint.json)
        if not isinstance(schema, dict):
            raise ValueError("a JSON schema must be a JSON object")
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
    if constraint.json_object:
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
    if constraint.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(constraint.regex)
    if constraint.choice is not None:
        return llguidance.grammar_from("choice", list(constraint.choice))
    return llguidance.grammar_from("grammar", constraint.grammar)   # Lark or GBNF, told apart by llguidance
