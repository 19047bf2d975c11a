"""Request and response bodies of the HTTP API, as pydantic models.

Validation, the 400 messages and the OpenAPI schema all come from these models. Requests are
parsed strictly from JSON (`model_validate_json`) and forbid unknown fields, so a parameter we do
not implement is refused rather than silently ignored; the OpenAI parameters clients commonly
send with their neutral value are declared, and refused only when set to something else
(`unsupported()`).
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from jaxserve.errors import InvalidRequestError
from jaxserve.sampling_params import SamplingParams


TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
Stop = str | Annotated[list[str], Field(max_length=16)] | None
FinishReason = Literal["stop", "length", "abort"] | None


class _Request(BaseModel):
    # Strict: JSON `false` is not the token id 0, nor `0` the boolean false.
    model_config = ConfigDict(extra="forbid", strict=True)

    # Declared for compatibility; a value other than this default is answered with a 400.
    UNSUPPORTED: ClassVar[dict] = {}

    def unsupported(self) -> None:
        """Raises InvalidRequestError for a parameter set to a value we do not implement yet."""
        for name, neutral in self.UNSUPPORTED.items():
            value = getattr(self, name)
            if value not in (None, neutral):
                raise InvalidRequestError(name, f"{name}={value!r} is not supported yet (only {neutral!r})")


class SamplingFields(_Request):
    """Sampling fields shared by every generation endpoint (OpenAI's and vLLM's extras)."""

    n: Annotated[int, Field(ge=1)] | None = 1
    temperature: Annotated[float, Field(ge=0, le=2)] | None = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] | None = 1.0
    top_k: Annotated[int, Field(ge=-1)] | None = -1
    min_p: Annotated[float, Field(ge=0, le=1)] | None = 0.0
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    stop: Stop = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0)] = 0
    priority: int = Field(0, description="Accepted for vLLM compatibility; not used yet.")
    stream: bool | None = False

    def sampling_params(self, max_tokens: int | None) -> SamplingParams:
        return SamplingParams(
            n=self.n or 1, temperature=_default(self.temperature, 1.0), top_p=_default(self.top_p, 1.0),
            top_k=_default(self.top_k, -1), min_p=_default(self.min_p, 0.0), seed=self.seed,
            max_tokens=max_tokens, min_tokens=self.min_tokens, stop_token_ids=tuple(self.stop_token_ids or ()),
            stop=self.stop or (), ignore_eos=self.ignore_eos)


def _default(value, default):
    return default if value is None else value


class StreamOptions(_Request):
    include_usage: bool | None = False


class _OpenAIRequest(SamplingFields):
    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None

    UNSUPPORTED: ClassVar[dict] = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "logit_bias": None}

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_OpenAIRequest):
    prompt: str | Annotated[list[str], Field(min_length=1)] | TokenIds | Annotated[
        list[TokenIds], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None

    UNSUPPORTED: ClassVar[dict] = {"logprobs": None, "echo": False, "best_of": 1, "suffix": None,
                                   **_OpenAIRequest.UNSUPPORTED}

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of prompts (text or token ids)."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_OpenAIRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    logprobs: bool | None = False
    top_logprobs: int | None = None

    UNSUPPORTED: ClassVar[dict] = {"logprobs": False, "top_logprobs": None, **_OpenAIRequest.UNSUPPORTED}


class GenerateRequest(SamplingFields):
    prompt: str | TokenIds
    max_tokens: Annotated[int, Field(ge=1)] | None = 16


# ---- responses -----------------------------------------------------------------------------

class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None = None
    finish_reason: FinishReason = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: None = None
    finish_reason: FinishReason = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    # Left out of the JSON when unset, as OpenAI does: the role comes only in a choice's first chunk.
    role: Literal["assistant"] | None = Field(None, exclude_if=lambda v: v is None)
    content: str | None = Field(None, exclude_if=lambda v: v is None)


class ChatStreamChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: None = None
    finish_reason: FinishReason = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None


class GenerateOutput(BaseModel):
    index: int
    output_text: str
    token_ids: list[int]
    finish_reason: FinishReason = None


class GenerateResponse(BaseModel):
    outputs: list[GenerateOutput]
    usage: Usage


class GenerateStreamOutput(BaseModel):
    index: int
    output_text: str = Field(description="The text added since the previous chunk.")
    finish_reason: FinishReason = None


class GenerateChunk(BaseModel):
    outputs: list[GenerateStreamOutput]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "jaxserve"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["loading", "ready", "draining", "stopped", "failed"]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
