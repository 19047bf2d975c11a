"""n-gram proposals: the longest recurring suffix first, its latest earlier occurrence, clipped."""

from jaxserve.engine.ngram_proposer import propose


def test_the_tokens_after_the_latest_earlier_occurrence_of_the_suffix():
    #         0  1  2  3  4  5  6  7  8  9
    prompt = [1, 2, 3, 9, 1, 2, 3, 8, 5, 1]
    assert propose(prompt, [2, 3], 3, 1, 3) == (8, 5, 1)        # "1 2 3" last seen at 4..6
    assert propose(prompt, [2, 3], 1, 1, 3) == (8,)             # clipped to the tokens asked for


def test_a_longer_match_wins_over_a_later_shorter_one():
    # "7 1 2" occurs once, early; "1 2" alone occurs later too
    tokens = [7, 1, 2, 40, 41, 3, 1, 2, 50, 7, 1, 2]
    assert propose(tokens, [], 2, 1, 3) == (40, 41)
    assert propose(tokens, [], 2, 1, 2) == (50, 7)              # only n <= 2: the latest "1 2"


def test_prompt_and_output_are_one_sequence():
    assert propose([4, 5, 6], [7, 4, 5], 2, 2, 2) == (6, 7)


def test_no_proposal_without_a_recurring_ngram_or_below_the_minimum():
    assert propose([1, 2, 3, 4], [5], 4, 1, 4) == ()
    assert propose([1, 2, 9, 2], [], 4, 2, 4) == ()             # "2" recurs, but n >= 2 is asked
    assert propose([3], [], 4, 1, 4) == ()


def test_a_match_at_the_end_proposes_what_is_left():
    assert propose([5, 5], [5], 4, 1, 1) == (5,)                # "5" at 1 is followed by the last 5 only
