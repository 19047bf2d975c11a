"""SampleText: stop strings end the text before them, even split across tokens; nothing leaks."""

import pytest

from jaxserve.engine.output import SampleText


class CharTokenizer:
    """One token per character: enough to drive the detokenizer."""

    all_special_ids = []

    def convert_ids_to_tokens(self, ids, skip_special_tokens=False):
        return [chr(i) for i in ids]

    def convert_tokens_to_string(self, tokens):
        return "".join(tokens)

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids)


def feed(text, stop):
    tokens = []
    sample = SampleText(CharTokenizer(), tuple(stop), skip_special_tokens=True, tokens=tokens)
    seen = []
    for ch in text:
        tokens.append(ord(ch))
        hit = sample.add(ord(ch))
        seen.append(sample.text)
        if hit:
            break
    sample.finish()
    return sample, seen


def test_stop_string_split_across_tokens_is_never_shown():
    sample, seen = feed("Hello END world", ["END"])
    assert sample.stopped and sample.text == "Hello "
    assert all("E" not in s for s in seen)


def test_partial_match_is_released_when_it_does_not_complete():
    sample, seen = feed("a EN b", ["END"])
    assert not sample.stopped and sample.text == "a EN b"
    assert seen[3] == "a "          # "EN" held back while it could still become "END"


@pytest.mark.parametrize("stops, expected", [(["b", "abc"], "xa"), (["zz"], "xabcd")])
def test_earliest_stop_wins(stops, expected):
    assert feed("xabcd", stops)[0].text == expected


def test_text_without_stop_strings_is_detokenised_when_read_and_equals_the_eager_text():
    calls = []

    class Counting(CharTokenizer):
        def decode(self, ids, skip_special_tokens=False):
            calls.append(len(ids))
            return super().decode(ids, skip_special_tokens)

    tokens = []   # the sample's, which both texts are told of: the lazy one reads it
    lazy = SampleText(Counting(), (), skip_special_tokens=True, tokens=tokens)
    eager = SampleText(CharTokenizer(), ("\x00",), skip_special_tokens=True, tokens=tokens)   # a stop that never comes
    for i, ch in enumerate("héllo wörld"):
        tokens.append(ord(ch))
        assert not lazy.add(ord(ch)) and not eager.add(ord(ch))
        if i == 4:
            assert not calls                           # nothing decoded while nobody reads it
            assert lazy.text == eager.text == "héllo"  # read: caught up
    lazy.finish()
    eager.finish()
    assert lazy.text == eager.text == "héllo wörld"
