"""Structured outputs in the engine: grammars compiled and cached, masks obeyed token by token.

The tiny random model picks its tokens at random, so whatever it writes that fits a constraint
fits because of the mask.
"""

import dataclasses
import json
import re
import types

import jax
import jsonschema_rs
import llguidance.numpy
import numpy as np
import pytest

from jaxserve import device_calls
from jaxserve.device_calls import Array, CompileSplit, Inbox, Outbox, ProtocolError, StepSample
from jaxserve.engine.runner import Runner
from jaxserve.engine.structured_output import ConstrainedProposals, Grammars, pack_tokens
from jaxserve.errors import InvalidRequestError
from jaxserve.sampling_params import SamplingParams, StructuredOutputsParams as Constraint
from server_fixtures import pool_is_full, tiny_engine  # noqa: F401 - fixture

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "pets"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "pets": {"type": "array", "maxItems": 3, "items": {"enum": ["cat", "dog"]}}}}


def run(engine, requests: dict[str, tuple[str, SamplingParams]]) -> dict:
    for request_id, (prompt, params) in requests.items():
        engine.add_request(prompt, params, request_id=request_id)
    finished = {}
    while engine.has_unfinished_requests():
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
    return finished


def allowed_ids(mask_row: np.ndarray) -> set[int]:
    return set(np.unpackbits(mask_row.view(np.uint8), bitorder="little").nonzero()[0].tolist())


def test_constrained_tokens_fit_a_fresh_matcher_and_the_neighbour_is_unchanged(tiny_engine):
    engine = tiny_engine
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=100, structured_outputs=Constraint(json=PERSON))
    plain = SamplingParams(temperature=0, max_tokens=30)
    alone = run(engine, {"plain": ("Hello", plain)})["plain"].outputs[0].token_ids
    outputs = run(engine, {"json": ("A person:", params), "plain": ("Hello", plain)})
    assert outputs["plain"].outputs[0].token_ids == alone
    [sample] = outputs["json"].outputs
    assert sample.finish_reason == "stop"
    jsonschema_rs.validate(PERSON, json.loads(sample.text))
    # Replayed through llguidance on its own, every sampled token was allowed where it was sampled.
    grammars = engine.grammars
    matcher = grammars.matcher(grammars.grammar(params.structured_outputs))
    for token in sample.token_ids:
        assert token in allowed_ids(grammars.fill_masks([matcher], [()])[0][0])
        assert matcher.consume_token(token)
    assert matcher.is_stopped() and pool_is_full(engine)


def test_constrained_steps_launch_ahead_and_sample_once_the_grammars_have_the_last_token(tiny_engine, monkeypatch):
    """Under async scheduling a step that samples for constrained sequences is launched before the
    step before is read back, up to its logits, and sampled once their grammars took that step's
    tokens: the same tokens as serial steps, the constraints kept, every page back."""
    engine = tiny_engine
    masked_later = []   # (constrained rows, whether the step ran to its logits before its masks came)
    sample = engine.runner.sample
    monkeypatch.setattr(engine.runner, "sample", lambda step, masks: masked_later.append(
        (len(masks), step.logits is not None)) or sample(step, masks))
    requests = {
        "json": ("A person:", SamplingParams(temperature=1.0, seed=3, max_tokens=80,
                                             structured_outputs=Constraint(json=PERSON))),
        "date": ("Today:", SamplingParams(temperature=0.8, seed=1, max_tokens=20,
                                          structured_outputs=Constraint(regex=r"\d{4}-\d{2}-\d{2}"))),
        "plain": ("Hello", SamplingParams(temperature=0.7, seed=2, max_tokens=30)),
    }
    assert engine.config.async_scheduling
    first = run(engine, requests)   # meanwhile each bucket's two programs compile; until then it waits whole
    engine.runner.wait_compiled()
    masked_later.clear()
    overlapped = run(engine, requests)
    assert len(masked_later) >= 10 and max(n for n, _ in masked_later) == 2 and all(ran for _, ran in masked_later)
    assert pool_is_full(engine)
    config = engine.config
    engine.config = dataclasses.replace(config, async_scheduling=False)
    try:
        stepped = run(engine, requests)
    finally:
        engine.config = config

    def samples(outputs):
        return {i: [(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for i, o in outputs.items()}

    assert samples(first) == samples(overlapped) == samples(stepped)
    jsonschema_rs.validate(PERSON, json.loads(overlapped["json"].outputs[0].text))
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", overlapped["date"].outputs[0].text)
    assert pool_is_full(engine)


def test_a_step_whose_sampling_after_its_masks_fails_fails_its_requests_only(tiny_engine, monkeypatch):
    """Sampling a step launched ahead raises once: its requests fail with the error, the engine
    goes on (a request after them is served) and every page returns to the pool."""
    engine = tiny_engine
    sample, calls = engine.runner.sample, []

    def fails_third(step, masks):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("device on fire")
        return sample(step, masks)

    monkeypatch.setattr(engine.runner, "sample", fails_third)
    words = SamplingParams(temperature=0.8, seed=1, max_tokens=30, structured_outputs=Constraint(regex=r"[a-z]{20,40}"))
    failed = run(engine, {"a": ("Word:", words), "b": ("Other:", words)})
    assert len(calls) >= 3
    assert {i: (o.outputs[0].finish_reason, o.error) for i, o in failed.items()} == {
        i: ("error", "engine step failed: RuntimeError: device on fire") for i in ("a", "b")}
    assert pool_is_full(engine)
    served = run(engine, {"c": ("Word:", words)})["c"].outputs[0]
    assert served.finish_reason == "stop" and re.fullmatch(r"[a-z]{20,40}", served.text)
    assert pool_is_full(engine)


class _FollowerHere:
    """Followers in this process: each device call goes through the wire's framing and `runner`,
    another runner over the same weights, replays it."""

    def __init__(self, runner: Runner):
        self.runner, self.outbox, self.inbox, self.kinds = runner, Outbox(), Inbox(), []
        self.num_changed = 0   # steps' arrays sent as their changes to the step before

    def send(self, call) -> None:
        call = self.inbox.read(self.outbox.frame(call))
        self.kinds.append("to_logits" if getattr(call, "to_logits", False) else type(call).__name__)
        self.num_changed += sum(array.changed is not None for array in getattr(call, "leaves", ()))
        self.runner.replay(call)


def test_a_follower_replays_steps_split_at_their_logits_to_the_leaders_pool_and_samples(tiny_engine, monkeypatch):
    """Several processes keep constrained steps overlapped too: the follower compiles the split
    pair when the leader does, runs each step to its logits and samples it with the masks sent
    after; its pool and its last samples then equal the leader's, and the tokens equal serial steps'."""
    engine, config = tiny_engine, tiny_engine.config
    leader = engine.runner
    follower = _FollowerHere(Runner(engine.model, engine.allocators[0].num_pages, config.page_size,
                                    engine.max_model_len, config.max_num_seqs, config.max_num_batched_tokens,
                                    config.prefill_segment))
    words = SamplingParams(temperature=0.8, seed=5, max_tokens=24, structured_outputs=Constraint(regex=r"[a-z]{6,40}"))
    requests = {"words": ("Word:", words), "plain": ("Hello", SamplingParams(temperature=0.7, seed=2, max_tokens=30)),
                "greedy": ("Hi", SamplingParams(temperature=0, max_tokens=12, structured_outputs=Constraint(
                    choice=("alpha", "beta", "gamma")))),
                # its token counts on the follower's device equal the leader's (`_sampled` below)
                "penalised": ("Once", SamplingParams(temperature=0.7, seed=3, max_tokens=20, frequency_penalty=0.8))}
    serial_config = dataclasses.replace(config, async_scheduling=False)
    monkeypatch.setattr(engine, "config", serial_config)
    stepped = run(engine, requests)
    # The tiny engine's arrays are small: those of 64 bytes and more are compared with the step before's
    monkeypatch.setattr(device_calls, "_CHANGES_MIN_BYTES", 64)
    monkeypatch.setattr(device_calls, "_FILL_MIN_BYTES", 64)
    monkeypatch.setattr(engine, "config", config)
    monkeypatch.setattr(leader, "followers", follower)
    compiled_before = set(leader._split_compiles)
    leader.reset_pool()   # sent to the follower: both start from an empty pool, no cached prefix
    engine.scheduler.clear_cache()
    first = run(engine, requests)
    leader.wait_compiled()
    follower.runner.wait_compiled()
    started_here = set(leader._split_compiles) - compiled_before   # earlier tests compiled some
    assert follower.kinds.count("CompileSplit") == len(started_here)
    assert set(follower.runner._split_compiles) == follower.runner._split_ready == started_here
    follower.kinds.clear()
    overlapped = run(engine, requests)

    def samples(outputs):
        return {i: [(c.token_ids, c.finish_reason) for c in o.outputs] for i, o in outputs.items()}

    assert samples(first) == samples(overlapped) == samples(stepped)
    assert follower.kinds.count("to_logits") >= 5 and follower.kinds.count("to_logits") == follower.kinds.count(
        "StepSample")
    for mine, theirs in zip(jax.tree.leaves((leader.kv_pages, leader._sampled)),
                            jax.tree.leaves((follower.runner.kv_pages, follower.runner._sampled))):
        np.testing.assert_array_equal(np.asarray(mine), np.asarray(theirs))
    assert follower.num_changed >= 10   # positions, slots, block tables: as changes to the step before
    for mine, theirs in zip(leader._step_arrays._before, follower.runner._step_arrays._before, strict=True):
        assert mine.tobytes() == theirs.tobytes()
    assert pool_is_full(engine)


def test_a_follower_refuses_a_sampling_with_no_step_at_its_logits_or_masks_of_another_shape(tiny_engine):
    runner = tiny_engine.runner
    with pytest.raises(ProtocolError, match="no step ran to its logits before it"):
        runner.replay(StepSample(Array.of(np.zeros((1, 4), np.int32))))
    batch = runner._empty_step(runner.buckets[0])
    runner._replayed_logits = (None, batch)
    with pytest.raises(ProtocolError, match=r"allowed-token masks int32\[1, 4\] for a step whose sampling takes"):
        runner.replay(StepSample(Array.of(np.zeros((1, 4), np.int32))))
    with pytest.raises(ProtocolError, match="is not one of this engine's"):
        runner.replay(CompileSplit(999, 0))


@pytest.mark.parametrize("constraint, pattern", [
    (Constraint(regex=r"\d{4}-\d{2}-\d{2}"), r"\d{4}-\d{2}-\d{2}"),
    (Constraint(regex=r"[a-z]{3,8}@[a-z]{3,8}\.(com|org)"), r"[a-z]{3,8}@[a-z]{3,8}\.(com|org)"),
    (Constraint(choice=("red", "green", "blue")), r"red|green|blue"),
    (Constraint(grammar='start: "yes" | "no" | NUMBER\nNUMBER: /[0-9]{1,3}/'), r"yes|no|[0-9]{1,3}"),
    (Constraint(grammar='root ::= "(" [a-c]+ ")"'), r"\([a-c]+\)"),    # GBNF
])
def test_each_kind_of_constraint_is_obeyed_by_every_sample(tiny_engine, constraint, pattern):
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=60, structured_outputs=constraint)
    [output] = run(tiny_engine, {"r": ("Answer:", params)}).values()
    for sample in output.outputs:
        assert sample.finish_reason == "stop", sample
        assert re.fullmatch(pattern, sample.text), sample.text
    assert pool_is_full(tiny_engine)


def test_max_tokens_cuts_a_constraint_short_with_length(tiny_engine):
    params = SamplingParams(temperature=0, max_tokens=4, structured_outputs=Constraint(json=PERSON))
    [sample] = run(tiny_engine, {"r": ("A person:", params)})["r"].outputs
    assert sample.finish_reason == "length" and sample.text.startswith('{"name": "')


def test_a_dead_end_fails_its_request_and_the_engine_goes_on(tiny_engine):
    # The only token the choice allows is also a stop id, suppressed below min_tokens: nothing fits.
    [seven] = tiny_engine.tokenizer.encode("7", add_special_tokens=False)
    stuck = SamplingParams(temperature=0, max_tokens=8, min_tokens=2, stop_token_ids=(seven,),
                           structured_outputs=Constraint(choice=("7",)))
    outputs = run(tiny_engine, {"stuck": ("Pick:", stuck), "fine": ("Hello", SamplingParams(max_tokens=6))})
    assert "constraint allows no continuation" in outputs["stuck"].error
    assert outputs["stuck"].error_param == "structured_outputs"   # the client's to change: a 400 over HTTP
    assert outputs["fine"].error is None and len(outputs["fine"].outputs[0].token_ids) == 6
    assert pool_is_full(tiny_engine)


def test_grammars_are_compiled_once_per_constraint(tiny_engine):
    grammars = tiny_engine.grammars
    first = grammars.grammar(Constraint(json=dict(PERSON)))
    assert grammars.grammar(Constraint(json=json.dumps(PERSON))) is first


@pytest.mark.parametrize("constraint, field, message", [
    (Constraint(regex="a(b"), "structured_outputs.regex", "unclosed group"),
    (Constraint(json='{"type": "frobnicate"}'), "structured_outputs.json", "frobnicate"),
    (Constraint(json="[1, 2]"), "structured_outputs.json", "must be a JSON object"),
    (Constraint(json="{not json"), "structured_outputs.json", "invalid"),
    (Constraint(grammar="start: undefined_rule"), "structured_outputs.grammar", "undefined_rule"),
    (Constraint(regex="x" * 70000), "structured_outputs.regex", "--max-structured-output-bytes"),
])
def test_bad_constraints_are_refused_naming_the_field(tiny_engine, constraint, field, message):
    with pytest.raises(InvalidRequestError, match=re.escape(message)) as error:
        tiny_engine.add_request("Hi", SamplingParams(structured_outputs=constraint))
    assert error.value.param == field
    assert not tiny_engine.has_unfinished_requests()


@pytest.mark.parametrize("fields, message", [
    ({}, "give exactly one of"),
    ({"regex": "a", "choice": ["a"]}, "give exactly one of"),
    ({"choice": []}, "give at least one choice"),
])
def test_a_constraint_names_exactly_one_kind(fields, message):
    with pytest.raises(InvalidRequestError, match=message):
        Constraint(**fields)


def test_masks_fill_in_parallel_as_one_by_one_and_after_each_draft(smollm2_tokenizer):
    """A sequence with drafts gets a mask per sampling row: its grammar's state after 0, 1, ... of
    its drafts, each the mask of a matcher that took them; the matcher itself does not move."""
    grammars = Grammars(smollm2_tokenizer, 49152, (2,), 65536)
    grammar = grammars.grammar(Constraint(json=PERSON))
    matchers = [grammars.matcher(grammar) for _ in range(3)]
    for matcher, text in zip(matchers, ['{"name": "Al', '{"name": "Bo", "age": 4', '']):
        assert matcher.consume_tokens(smollm2_tokenizer.encode(text, add_special_tokens=False))
    drafts = [tuple(smollm2_tokenizer.encode('", "age', add_special_tokens=False)), (),
              tuple(smollm2_tokenizer.encode('{"', add_special_tokens=False))]
    masks = grammars.fill_masks(matchers, drafts)
    assert [len(m) for m in masks] == [1 + len(d) for d in drafts]
    for matcher, rows, proposed in zip(matchers, masks, drafts):
        for i, mask in enumerate(rows):
            one = llguidance.numpy.allocate_token_bitmask(1, 49152)
            llguidance.numpy.fill_next_token_bitmask(matcher, one)
            assert (mask == one[0]).all()
            if i < len(proposed):
                assert matcher.consume_token(proposed[i])
    starts = {smollm2_tokenizer.decode([t]) for t in allowed_ids(masks[2][0])}
    assert starts and all(text.startswith("{") for text in starts)


def test_best_of_logprobs_and_stop_strings_compose_with_a_constraint(tiny_engine):
    choices = ("apple pie", "banana split", "cherry tart")
    ranked = SamplingParams(n=1, best_of=3, temperature=1.0, seed=2, logprobs=2, max_tokens=20,
                            structured_outputs=Constraint(choice=choices))
    stopped = SamplingParams(temperature=0, max_tokens=40, stop=(" ",), structured_outputs=Constraint(choice=choices))
    outputs = run(tiny_engine, {"ranked": ("Dessert:", ranked), "stopped": ("Dessert:", stopped)})
    [best] = outputs["ranked"].outputs
    assert best.text in choices and len(best.logprobs) == len(best.token_ids)
    [cut] = outputs["stopped"].outputs
    assert cut.finish_reason == "stop" and cut.text in {c.split(" ")[0] for c in choices}
    assert pool_is_full(tiny_engine)


def test_proposals_are_cut_and_masked_by_grammars_and_allowed_token_ids(smollm2_tokenizer):
    """A proposal is cut before the first token its allowed_token_ids or its grammar reject; the
    draft's masks are the grammar's after the drafts, the allowed ids', or both combined."""
    grammars = Grammars(smollm2_tokenizer, 49152, (2,), 65536)
    yes, no = (smollm2_tokenizer.encode(word, add_special_tokens=False)[0] for word in ("yes", "no"))
    matcher = grammars.matcher(grammars.grammar(Constraint(choice=["yes", "no"])))
    allowed = {"ids": pack_tokens([yes, 7], 49152), "both": pack_tokens([yes, 7], 49152)}

    class Fixed:   # the same proposal for every request; keeps the masks it was given
        def propose(self, requests, rooms, tables, data_slice, masks_after=None):
            self.masks_after = masks_after
            return [(yes, 7, no, yes)] * len(requests)

    fixed = Fixed()
    proposals = ConstrainedProposals(fixed, {"grammar": matcher, "both": matcher.deep_copy()}, allowed, grammars)
    requests = [types.SimpleNamespace(request_id=i) for i in ("plain", "ids", "grammar", "both")]
    assert proposals.propose(requests, [4] * 4, [[]] * 4, 0) == [(yes, 7, no, yes), (yes, 7), (yes,), (yes,)]
    masks = fixed.masks_after(requests, [()] * 4)
    assert "plain" not in masks and allowed_ids(masks["ids"]) == {yes, 7}
    assert {yes, no} <= allowed_ids(masks["grammar"]) and 7 not in allowed_ids(masks["grammar"])
    assert allowed_ids(masks["both"]) == {yes}
    unconstrained = ConstrainedProposals(fixed, {}, {}, grammars)
    assert unconstrained.propose(requests, [4] * 4, [[]] * 4, 0) == [(yes, 7, no, yes)] * 4
    assert fixed.masks_after is None   # nothing to steer: a draft model's calls go back to back
