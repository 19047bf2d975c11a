"""Load a model's tokenizer and turn streamed token ids back into text."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

# Tokens decoded before the first new one, so that the first piece gets the spacing it has mid-text.
_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


def load_tokenizer(model_path: str | Path, gguf_file=None):
    """Return the tokenizer of a `.gguf` file or of an HF model directory. `gguf_file`: the GGUF
    file read already (`checkpoint.gguf.GGUFFile`), so that its metadata is not read again."""
    model_path = Path(model_path)
    if model_path.suffix == ".gguf":
        from jaxserve.checkpoint.gguf import load_gguf_tokenizer

        return load_gguf_tokenizer(gguf_file or model_path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


class IncrementalDetokenizer:
    """Turns one request's generated token ids into text pieces as soon as they are final.

    Only a window of recent tokens is decoded per step: text is emitted from `read_offset` on,
    and the tokens from `prefix_offset` to `read_offset` give it context. Text ending in U+FFFD
    is an incomplete UTF-8 character and is held back until later tokens complete it.

    A fast tokenizer whose `decode` is its backend's alone (no clean-up of spaces) streams through
    the `tokenizers` library's `DecodeStream` instead, the same method in one Rust call a token:
    1.35 us a token instead of 8.1 (SmolLM2's tokenizer, 256 streams). What it still holds at the
    end (an incomplete character) is decoded as above.
    """

    def __init__(self, tokenizer, prompt_ids: Iterable[int] = (), skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_ids)
        self.read_offset = len(self.ids)
        self.prefix_offset = max(self.read_offset - _CONTEXT_TOKENS, 0)
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._stream = None
        if self._backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
            for token_id in self.ids[self.prefix_offset:]:   # the prompt's last tokens as context
                self._stream.step(self._backend, token_id)

    def add(self, token_ids: int | Iterable[int]) -> str:
        """Append token ids; return the text they finalised (possibly empty)."""
        token_ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        if self._stream is not None:
            text = ""
            for token_id in token_ids:
                self.ids.append(token_id)
                piece = self._stream.step(self._backend, token_id)
                if piece is not None:
                    text += self._advance(piece)
            return text
        self.ids.extend(token_ids)
        prefix_text, new_text = self._window_texts()
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            return ""
        return self._advance(new_text[len(prefix_text):])

    def flush(self) -> str:
        """Return whatever text is still held back (the request has ended)."""
        prefix_text, new_text = self._window_texts()
        return self._advance(new_text[len(prefix_text):])

    def _window_texts(self) -> tuple[str, str]:
        """Decode the context tokens alone, and the context plus the unread tokens."""
        return self._decode(self.ids[self.prefix_offset:self.read_offset]), self._decode(self.ids[self.prefix_offset:])

    def _decode(self, ids: list[int]) -> str:
        """Decode `ids` the way the contract's full `tokenizer.decode` does."""
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _advance(self, piece: str) -> str:
        """Mark every token so far as read and return `piece`."""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return piece


def chat_prompt_ids(tokenizer, messages: list[dict], tools: list[dict] | None = None,
                    add_generation_prompt: bool = True, continue_final_message: bool = False) -> list[int]:
    """Token ids of a conversation through the tokenizer's chat template, ready for the reply
    unless `add_generation_prompt` is false, or with the last message left open for the reply to
    continue (`continue_final_message`); `tools` (OpenAI function definitions) for a template
    that renders them."""
    ids = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                        continue_final_message=continue_final_message, tokenize=True,
                                        return_dict=False)
    return [int(i) for i in ids]
