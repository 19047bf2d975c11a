"""Logprobs in the wire shapes of completions, chat and /generate, from fixed engine outputs."""

import math

from jaxserve.engine.output import CompletionOutput, RequestOutput, TokenLogprob
from jaxserve.server.logprobs import (
    LOWEST_LOGPROB, TokenTexts, chat_logprobs, completion_logprobs, generate_logprobs)
from jaxserve.server.serving import TextDeltas

# SmolLM2's tokenizer: 1000 '()', 1001 ' loc', 2000 ' temper', 0 '<|endoftext|>'.
ENTRIES = [
    TokenLogprob(1001, -0.5, ((1001, -0.5), (1000, -1.5))),
    TokenLogprob(2000, -3.0, ((1000, -0.25), (1001, -2.0))),   # sampled outside the top 2
    TokenLogprob(0, -math.inf, ((1000, -0.1), (2000, -4.0))),
]


def test_completion_shape(smollm2_tokenizer):
    logprobs = completion_logprobs(ENTRIES, TokenTexts(smollm2_tokenizer)).model_dump()
    assert logprobs == {
        "tokens": [" loc", " temper", "<|endoftext|>"],
        "token_logprobs": [-0.5, -3.0, LOWEST_LOGPROB],
        "top_logprobs": [{" loc": -0.5, "()": -1.5},
                         {"()": -0.25, " loc": -2.0, " temper": -3.0},
                         {"()": -0.1, " temper": -4.0, "<|endoftext|>": LOWEST_LOGPROB}],
        "text_offset": [0, 4, 11],
    }


def test_completion_offsets_continue_from_earlier_chunks(smollm2_tokenizer):
    logprobs = completion_logprobs(ENTRIES[1:], TokenTexts(smollm2_tokenizer), offset=4)
    assert logprobs.text_offset == [4, 11]


def test_completion_top_of_zero_holds_the_sampled_token(smollm2_tokenizer):
    entry = TokenLogprob(1000, -0.75)
    assert completion_logprobs([entry], TokenTexts(smollm2_tokenizer)).top_logprobs == [{"()": -0.75}]


def test_chat_shape(smollm2_tokenizer):
    logprobs = chat_logprobs(ENTRIES[:2], TokenTexts(smollm2_tokenizer)).model_dump()
    loc, paren, temper = list(b" loc"), list(b"()"), list(b" temper")
    assert logprobs == {"content": [
        {"token": " loc", "logprob": -0.5, "bytes": loc, "top_logprobs": [
            {"token": " loc", "logprob": -0.5, "bytes": loc}, {"token": "()", "logprob": -1.5, "bytes": paren}]},
        {"token": " temper", "logprob": -3.0, "bytes": temper, "top_logprobs": [
            {"token": "()", "logprob": -0.25, "bytes": paren}, {"token": " loc", "logprob": -2.0, "bytes": loc}]},
    ]}


def test_chat_bytes_are_utf8(smollm2_tokenizer):
    [café] = smollm2_tokenizer.encode(" café", add_special_tokens=False)
    [entry] = chat_logprobs([TokenLogprob(café, -1.0)], TokenTexts(smollm2_tokenizer)).content
    assert entry.bytes == list(" café".encode()) and entry.top_logprobs == []


def test_generate_shape():
    [first, _, last] = [e.model_dump() for e in generate_logprobs(ENTRIES)]
    assert first == {"token_id": 1001, "logprob": -0.5, "top_logprobs": [
        {"token_id": 1001, "logprob": -0.5}, {"token_id": 1000, "logprob": -1.5}]}
    assert last["logprob"] == LOWEST_LOGPROB


def test_deltas_carry_the_tokens_and_logprobs_whose_text_was_held_back():
    deltas = TextDeltas(n=1)

    def output(text, tokens, reason=None):
        sample = CompletionOutput(0, text, [e.token_id for e in ENTRIES[tokens]], reason, list(ENTRIES[tokens]))
        prompt_logprobs = [None, ENTRIES[0]] if tokens.start == 0 else None   # the first delta's only
        return RequestOutput("r", None, [1, 2], [sample], reason is not None, num_cached_tokens=0,
                             prompt_logprobs=prompt_logprobs)

    [first] = deltas.updates(0, output(" loc", slice(0, 1)))
    assert (first.text, first.logprobs, first.token_ids) == (" loc", ENTRIES[:1], [ENTRIES[0].token_id])
    assert deltas.updates(0, output("", slice(1, 2))) == []   # the new token's text is held back
    [last] = deltas.updates(0, output(" temper", slice(2, 3), "length"))
    assert (last.text, last.logprobs, last.finish_reason) == (" temper", ENTRIES[1:], "length")
    assert last.token_ids == [e.token_id for e in ENTRIES[1:]]
    assert deltas.updates(0, output("", slice(3, 3), "length")) == []   # a finished choice sends nothing more
    assert (deltas.usage().prompt_tokens, deltas.usage().completion_tokens) == (2, 3)
    assert deltas.prompt_logprobs == {0: [None, ENTRIES[0]]}   # kept for a choice whose first piece comes later


def test_deltas_without_logprobs():
    sample = CompletionOutput(0, "hi", [5], "stop")
    [delta] = TextDeltas(n=1).updates(0, RequestOutput("r", None, [1], [sample], True))
    assert delta.logprobs is None
