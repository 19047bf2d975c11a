"""PenaltySlots: which device slot holds a penalised sequence's token counts, and when it is filled."""

from jaxserve.engine.batch import draft_row
from jaxserve.engine.penalty_slots import PenaltySlots
from jaxserve.engine.scheduler_output import ScheduledSequence
from jaxserve.sampling_params import SamplingParams

PENALISED = SamplingParams(temperature=0, frequency_penalty=0.5)


def row(request_id: str, num_output_tokens: int, drafts=()):
    return ScheduledSequence(request_id, (1, *drafts), 10 + num_output_tokens, (1,), True, PENALISED, 0,
                             num_output_tokens, history=tuple(range(3 + num_output_tokens)), num_prompt_tokens=3,
                             draft_token_ids=tuple(drafts))


def test_a_sequence_fills_its_slot_once_then_counts_each_sample_there():
    slots = PenaltySlots(4)
    first = slots.slot_for(row("a", 0))
    assert first[1:] == (True, True)
    for n in range(1, 6):   # each step's sample was counted on the device: the slot is current
        assert slots.slot_for(row("a", n)) == (first[0], False, True)


def test_a_slot_behind_or_ahead_of_the_sequence_is_filled_again():
    """A preempted sequence drops its placeholder (its slot counted one sample too many); after a
    step with drafts it has more outputs than its slot counted."""
    slots = PenaltySlots(4)
    slot = slots.slot_for(row("a", 0))[0]
    slots.slot_for(row("a", 1))            # counts sample 2
    assert slots.slot_for(row("a", 1)) == (slot, True, True)   # sample 2 dropped: filled anew
    assert slots.slot_for(row("a", 2)) == (slot, False, True)
    drafted = row("a", 3, drafts=(7, 8))
    rows = [slots.slot_for(r) for r in (drafted, draft_row(drafted, 1), draft_row(drafted, 2))]
    assert [fill for _, fill, _ in rows] == [True] * 3 and not any(counted for _, _, counted in rows)
    assert len({s for s, _, _ in rows} | {slot}) == 4   # a slot per row, the sequence's own kept
    assert slots.slot_for(row("a", 5)) == (slot, True, True)   # 2 drafts kept and a sample: refilled


def test_the_least_recently_used_slot_is_taken_and_its_owner_refills():
    slots = PenaltySlots(2)
    a, b = slots.slot_for(row("a", 0))[0], slots.slot_for(row("b", 0))[0]
    assert a != b
    slots.slot_for(row("a", 1))                       # b is now the least recently used
    c = slots.slot_for(row("c", 0))
    assert c == (b, True, True)
    assert slots.slot_for(row("a", 2)) == (a, False, True)
    assert slots.slot_for(row("b", 1)) == (b, True, True)   # b lost its slot: c's, the oldest now


def test_a_step_as_large_as_the_slots_gives_each_row_its_own():
    slots = PenaltySlots(8)
    for step in range(3):   # a different mix each step: old owners are pushed out
        rows = [row(f"s{step}-{i}", 0) for i in range(6)] + [row(f"s{step - 1}-{i}", 1) for i in range(2)]
        taken = [slots.slot_for(r)[0] for r in rows]
        assert sorted(taken) == list(range(8))


def test_a_released_slot_is_filled_anew_and_taken_before_any_owners():
    """A draft model's proposer releases a sequence's slot before each proposal: the slot may have
    counted a draft the target rejected, as many outputs as the sequence has but not the same."""
    slots = PenaltySlots(2)
    a, b = slots.slot_for(row("a", 0))[0], slots.slot_for(row("b", 0))[0]
    slots.release("a")
    slots.release("z")                                  # no slot: nothing to free
    assert slots.slot_for(row("c", 0)) == (a, True, True)   # the free slot, b kept
    assert slots.slot_for(row("b", 1)) == (b, False, True)
    assert slots.slot_for(row("a", 1)) == (a, True, True)   # a's slot went to c: taken back, the oldest
