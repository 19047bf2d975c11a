"""Request and response bodies of the HTTP API, as pydantic models.

Validation, the 400 messages and the OpenAPI schema all come from these models. Requests are
parsed strictly from JSON (`model_validate_json`) and forbid unknown fields, so a parameter we do
not implement is refused rather than silently ignored; the OpenAI parameters clients commonly
send with their neutral value are declared, and refused only when set to something else
(in `check()`, which also holds the rules between fields that a schema cannot say).
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from jaxserve.engine.beam_search import BeamSearchParams
from jaxserve.engine.request import FinishReason   # "error" never reaches a body: a failed request is an error reply
from jaxserve.errors import InvalidRequestError
from jaxserve.sampling_params import (
    MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_STOP, RequestOutputKind, SamplingParams, StructuredOutputsParams)


TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
Stop = str | Annotated[list[str], Field(max_length=MAX_STOP)] | None
NumLogprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]
Penalty = Annotated[float, Field(ge=-2, le=2)]


class _Request(BaseModel):
    # Strict: JSON `false` is not the token id 0, nor `0` the boolean false.
    model_config = ConfigDict(extra="forbid", strict=True)

    # Declared for compatibility; a value other than this default is answered with a 400.
    UNSUPPORTED: ClassVar[dict] = {}

    def check(self) -> None:
        """Raises InvalidRequestError for what the field types cannot refuse on their own: here, a
        parameter set to a value we do not implement yet."""
        for name, neutral in self.UNSUPPORTED.items():
            value = getattr(self, name)
            if value not in (None, neutral):
                raise InvalidRequestError(name, f"{name}={value!r} is not supported yet (only {neutral!r})")


class StructuredOutputs(_Request):
    """vLLM's `structured_outputs`: the text must match exactly one of these."""

    json_: dict | str | None = Field(None, alias="json", description="A JSON schema (an object, or its text).")
    regex: str | None = None
    choice: list[str] | None = Field(None, description="The text is exactly one of these strings.")
    grammar: str | None = Field(None, description="A Lark grammar, or GBNF as llama.cpp writes it.")
    json_object: bool | None = Field(None, description="Any JSON object.")

    def params(self) -> StructuredOutputsParams:
        return StructuredOutputsParams(json=self.json_, regex=self.regex, choice=self.choice, grammar=self.grammar,
                                       json_object=bool(self.json_object))


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
    presence_penalty: Penalty | None = 0.0
    frequency_penalty: Penalty | None = 0.0
    repetition_penalty: Annotated[float, Field(gt=0, le=2)] | None = Field(
        1.0, description="vLLM's: divides the logits of tokens seen in the prompt or output (1 = off).")
    logit_bias: Annotated[dict[str, float], Field(max_length=MAX_LOGIT_BIAS)] | None = Field(
        None, description="Token id (a decimal string) -> bias in [-100, 100], added to its logit.")
    structured_outputs: StructuredOutputs | None = None
    # vLLM's older spellings of structured_outputs: clients still send them, so they are honoured.
    guided_json: dict | str | None = Field(None, description="As structured_outputs.json.")
    guided_regex: str | None = Field(None, description="As structured_outputs.regex.")
    guided_choice: list[str] | None = Field(None, description="As structured_outputs.choice.")
    guided_grammar: str | None = Field(None, description="As structured_outputs.grammar.")
    priority: int = Field(0, description="Lower runs sooner under --scheduling-policy priority (first come, "
                                         "first served within a level); no effect under fcfs.")
    allowed_token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)] | None = Field(
        None, description="vLLM's: only these tokens may be sampled.")
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = Field(
        None, description="vLLM's: keep only the prompt's last k tokens (-1: max_model_len's worth).")
    stream: bool | None = False

    def sampling_params(self, max_tokens: int | None, vocab_size: int) -> SamplingParams:
        return SamplingParams(
            n=self.n or 1, temperature=_default(self.temperature, 1.0), top_p=_default(self.top_p, 1.0),
            top_k=_default(self.top_k, -1), min_p=_default(self.min_p, 0.0), seed=self.seed,
            max_tokens=max_tokens, min_tokens=self.min_tokens, stop_token_ids=tuple(self.stop_token_ids or ()),
            stop=self.stop or (), ignore_eos=self.ignore_eos,
            presence_penalty=_default(self.presence_penalty, 0.0),
            frequency_penalty=_default(self.frequency_penalty, 0.0),
            repetition_penalty=_default(self.repetition_penalty, 1.0),
            logit_bias=token_bias(self.logit_bias or {}, vocab_size),
            logprobs=self.num_logprobs(), best_of=self.samples_to_rank(), structured_outputs=self.constraint(),
            allowed_token_ids=None if self.allowed_token_ids is None else tuple(self.allowed_token_ids),
            truncate_prompt_tokens=self.truncate_prompt_tokens, prompt_logprobs=self.num_prompt_logprobs(),
            # a stream's handler sends what is new at each step; a reply sent whole needs no output at
            # every step (the metrics still see each step)
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY)

    def constraints(self) -> dict[str, StructuredOutputsParams]:
        """The structured-output constraints the body gives, by the field that gives each."""
        given = {}
        if self.structured_outputs is not None:
            given["structured_outputs"] = self.structured_outputs.params()
        for kind in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{kind}")
            if value is not None:
                given[f"guided_{kind}"] = StructuredOutputsParams(**{kind: value})
        return given

    def constraint(self) -> StructuredOutputsParams | None:
        given = self.constraints()
        if len(given) > 1:
            raise InvalidRequestError(list(given)[1], f"{' and '.join(given)} each constrain the output: give one")
        return next(iter(given.values()), None)

    def constraint_field(self) -> str | None:
        """The field that gave the constraint, for errors found when it is compiled."""
        return next(iter(self.constraints()), None)

    def num_logprobs(self) -> int | None:
        """Top logprobs per token the reply shows (None: no logprobs at all)."""
        return None

    def samples_to_rank(self) -> int | None:
        """best_of: samples generated to return the n most likely (None: just n)."""
        return None

    def num_prompt_logprobs(self) -> int | None:
        """Top logprobs per prompt token the engine computes (None: no prompt logprobs)."""
        return None


# What beam search does not apply (it ranks beams by the model's own logprobs), refused unless neutral
BEAM_SEARCH_IGNORES = ("stop", "stop_token_ids", "min_tokens", "presence_penalty", "frequency_penalty",
                       "repetition_penalty", "logit_bias", "allowed_token_ids", "truncate_prompt_tokens", "top_k",
                       "top_p", "min_p")
_NEUTRAL = {"repetition_penalty": 1.0, "top_k": -1, "top_p": 1.0}


def _default(value, default):
    return default if value is None else value


def token_bias(bias: dict[str, float], vocab_size: int) -> dict[int, float]:
    """OpenAI's logit_bias (token ids as JSON object keys) with integer keys, checked against the
    vocabulary; the biases themselves are checked by SamplingParams."""
    by_id = {}
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit()) or int(key) >= vocab_size:
            raise InvalidRequestError("logit_bias", f"logit_bias key {key!r} is not a token id: keys must be "
                                                    f"integers in [0, {vocab_size})")
        by_id[int(key)] = value
    return by_id


class JsonSchemaFormat(_Request):
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema", description="The JSON schema; none: any JSON object.")
    strict: bool | None = Field(None, description="Always honoured: the output matches the schema exactly.")


class ResponseFormat(_Request):
    """OpenAI's `response_format`: plain text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(_Request):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = Field(False, description="vLLM's: usage in every chunk as well.")


class _OpenAIRequest(SamplingFields):
    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    user: str | None = None
    store: bool | None = Field(None, description="Only false: nothing is stored.")
    metadata: dict[str, str] | None = Field(None, description="Accepted and ignored (nothing is stored).")
    service_tier: Literal["auto", "default"] | None = None
    return_token_ids: bool | None = Field(False, description="vLLM's: the prompt's and each choice's token ids "
                                                             "too (prompt_token_ids, token_ids).")
    return_tokens_as_token_ids: bool | None = Field(False, description="vLLM's: logprobs name tokens as "
                                                                       "'token_id:N' instead of their text.")
    prompt_logprobs: NumLogprobs | None = Field(None, description="vLLM's: each prompt token's logprob and rank, "
                                                                  "and the k most likely tokens there.")
    use_beam_search: bool | None = Field(False, description="vLLM's: the n best beams of a beam search (n <= 10) "
                                                            "instead of n samples.")
    length_penalty: float | None = Field(1.0, description="Beam search: a beam scores its cumulative logprob / "
                                                          "its length ** length_penalty.")
    early_stopping: bool | Literal["never"] | None = Field(
        False, description="Beam search: true stops once n beams have ended; false once no running beam can "
                           "score better; never only at max_tokens (transformers' meanings).")

    UNSUPPORTED: ClassVar[dict] = {"store": False}

    def constraints(self) -> dict[str, StructuredOutputsParams]:
        given = super().constraints()
        form = self.response_format
        if form is None or form.type == "text":
            return given
        if form.type == "json_object":
            return {"response_format": StructuredOutputsParams(json_object=True), **given}
        if form.json_schema is None:
            raise InvalidRequestError("response_format.json_schema",
                                      "response_format type 'json_schema' needs a json_schema object")
        schema = form.json_schema.schema_
        constraint = StructuredOutputsParams(json=schema) if schema else StructuredOutputsParams(json_object=True)
        return {"response_format": constraint, **given}

    def check(self) -> None:
        super().check()
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options", "stream_options applies to streamed replies only: "
                                                        "send it with stream=true, or leave it out")
        if self.stream and self.prompt_logprobs is not None:   # as vLLM
            raise InvalidRequestError("prompt_logprobs", "prompt_logprobs are not streamed: send stream=false")
        if self.use_beam_search:
            self._check_beam_search()

    def _check_beam_search(self) -> None:
        """What beam search cannot combine with: it returns whole beams, ranked by the model's own logprobs."""
        asked = [name for name, given in (("stream", self.stream), ("logprobs", self.num_logprobs() is not None),
                                          ("best_of", self.samples_to_rank() is not None),
                                          ("prompt_logprobs", self.prompt_logprobs is not None)) if given]
        asked += [self.constraint_field()] if self.constraint_field() is not None else []
        asked += [name for name in BEAM_SEARCH_IGNORES
                  if getattr(self, name) not in (None, False, 0, [], (), _NEUTRAL.get(name))]
        if asked:
            raise InvalidRequestError(asked[0], f"{asked[0]} does not combine with use_beam_search")
        if not 1 <= (self.n or 1) <= 10:
            raise InvalidRequestError("n", f"n={self.n} beams is out of range for use_beam_search: must be in [1, 10]")

    def beam_search_params(self, max_tokens: int) -> BeamSearchParams:
        return BeamSearchParams(self.n or 1, max_tokens, _default(self.length_penalty, 1.0),
                                _default(self.early_stopping, False), self.ignore_eos)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def num_prompt_logprobs(self) -> int | None:
        return self.prompt_logprobs


class CompletionRequest(_OpenAIRequest):
    prompt: str | Annotated[list[str], Field(min_length=1)] | TokenIds | Annotated[
        list[TokenIds], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
    logprobs: NumLogprobs | None = Field(None, description="Also the logprobs of this many most likely "
                                                           "tokens at each step (OpenAI allows up to 5).")
    echo: bool | None = False
    best_of: Annotated[int, Field(ge=1)] | None = Field(
        None, description="Generate this many samples and return the n with the highest cumulative logprob; "
                          "not with stream.")
    suffix: str | None = None

    UNSUPPORTED: ClassVar[dict] = {**_OpenAIRequest.UNSUPPORTED, "suffix": None}

    def check(self) -> None:
        super().check()
        n = self.n or 1
        if self.stream and self.best_of is not None and self.best_of > n:
            raise InvalidRequestError("best_of", f"best_of={self.best_of} cannot be streamed: only the finished "
                                                 f"samples can be ranked (send stream=false, or best_of <= n={n})")

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def samples_to_rank(self) -> int | None:
        return self.best_of

    def num_prompt_logprobs(self) -> int | None:
        """echo with logprobs shows the prompt's tokens' logprobs too."""
        wanted = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None) if k is not None]
        return max(wanted, default=None)

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of prompts (text or token ids)."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)


class FunctionDefinition(_Request):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: str | None = None
    parameters: dict | None = Field(None, description="A JSON schema of the arguments object.")
    strict: bool | None = Field(None, description="Always honoured when the call is constrained "
                                                  "(tool_choice required or a named function).")


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: FunctionName


class FunctionCall(_Request):
    name: str
    arguments: str = Field(description="The arguments as a JSON object's text.")


class ToolCall(_Request):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    # Unknown keys are ignored, as OpenAI and vLLM do: clients add their own to messages.
    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, description="An assistant's earlier calls.")
    tool_call_id: str | None = Field(None, description="A tool message's: the call it answers.")

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_OpenAIRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    logprobs: bool | None = False
    top_logprobs: NumLogprobs | None = Field(None, description="Needs logprobs=true.")
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="Default: auto with tools (needs --enable-auto-tool-choice), none without.")
    parallel_tool_calls: bool | None = Field(True, description="False: at most one call per reply.")
    echo: bool | None = Field(False, description="vLLM's: the reply starts with the last message's content when "
                                                 "that message is the assistant's (continue_final_message).")
    add_generation_prompt: bool | None = Field(True, description="End the prompt ready for an assistant reply.")
    continue_final_message: bool | None = Field(False, description="Leave the last (assistant) message open: "
                                                                   "the reply continues it.")

    def check(self) -> None:
        super().check()
        if self.continue_final_message and self.add_generation_prompt:
            raise InvalidRequestError("continue_final_message", "continue_final_message and add_generation_prompt "
                                                                "cannot both be true: send add_generation_prompt "
                                                                "false to continue the last message")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise InvalidRequestError("continue_final_message", f"continue_final_message continues the last "
                                                                f"message, which must be the assistant's, not "
                                                                f"{self.messages[-1].role!r}")
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs", f"top_logprobs={self.top_logprobs} needs logprobs=true")
        choice = self.tool_mode()
        names = [t.function.name for t in self.tools or ()]
        if choice != "none" and not names:
            raise InvalidRequestError("tool_choice", f"tool_choice={self.tool_choice!r} needs tools")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise InvalidRequestError("tool_choice", f"tool_choice names the function "
                                                     f"{self.tool_choice.function.name!r}, which is not among "
                                                     f"the tools: {names}")

    def tool_mode(self) -> str:
        """none, auto, required, or named (tool_choice names one function)."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or ("auto" if self.tools else "none")

    def constraints(self) -> dict[str, StructuredOutputsParams]:
        given = super().constraints()
        mode = self.tool_mode()
        if mode == "named":
            [tool] = [t for t in self.tools if t.function.name == self.tool_choice.function.name]
            return {"tool_choice": StructuredOutputsParams(json=tool.function.parameters or {"type": "object"}),
                    **given}
        if mode == "required":
            return {"tool_choice": StructuredOutputsParams(json=calls_schema(self.tools, self.parallel_tool_calls)),
                    **given}
        return given

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def calls_schema(tools: list[Tool], parallel: bool | None) -> dict:
    """The JSON a reply to tool_choice "required" must be: a list of calls, each a tool's name and
    arguments that match its parameters."""
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
              "properties": {"name": {"const": t.function.name},
                             "parameters": t.function.parameters or {"type": "object"}}} for t in tools]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    return {**schema, "maxItems": 1} if parallel is False else schema


class GenerateRequest(SamplingFields):
    prompt: str | TokenIds
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
    logprobs: NumLogprobs | None = Field(None, description="Return each token's logprob and those of this "
                                                           "many most likely tokens.")

    def num_logprobs(self) -> int | None:
        return self.logprobs


class TokenizeRequest(_Request):
    """vLLM's `/tokenize`: a prompt, or a conversation through the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool | None = Field(None, description="Default: true for a prompt, false for messages "
                                                              "(the template adds its own).")
    add_generation_prompt: bool = Field(True, description="Messages only: end ready for the assistant's reply.")
    return_token_strs: bool = False

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequestError("prompt", "give either prompt or messages")
        if self.messages is None and not self.add_generation_prompt:
            raise InvalidRequestError("add_generation_prompt", "add_generation_prompt applies to messages only")


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


class LoadLoRAAdapterRequest(_Request):
    """vLLM's `/v1/load_lora_adapter`: a PEFT adapter directory on the server, served as `lora_name`."""

    lora_name: Annotated[str, Field(min_length=1)]
    lora_path: Annotated[str, Field(min_length=1)]


class UnloadLoRAAdapterRequest(_Request):
    lora_name: Annotated[str, Field(min_length=1)]


# ---- responses -----------------------------------------------------------------------------

class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="Prompt tokens read from the prefix cache.")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy shape: parallel lists, one entry per token (with echo, the prompt's first,
    its first token's null)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] = Field(description="The most likely tokens' texts and logprobs, "
                                                                    "and the sampled token's.")
    text_offset: list[int] = Field(description="Where each token's text starts in the completion text.")


# return_token_ids's and prompt_logprobs' fields: left out of the JSON unless asked for
_WHEN_ASKED = dict(default=None, exclude_if=lambda v: v is None)


class PromptLogprob(BaseModel):
    logprob: float
    rank: int = Field(description="1 + the tokens more likely than this one at its position.")
    decoded_token: str


# vLLM's prompt_logprobs: per prompt token (the first: null), the token itself and the k most
# likely there, by token id
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None
    prompt_token_ids: list[int] | None = Field(**_WHEN_ASKED)
    token_ids: list[int] | None = Field(**_WHEN_ASKED)
    prompt_logprobs: PromptLogprobs | None = Field(**_WHEN_ASKED)


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = Field(None, exclude_if=lambda v: not v)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = Field(description="The token's text in UTF-8.")


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None


ChatFinishReason = FinishReason | Literal["tool_calls"]   # tool_calls: the reply is calls


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: ChatFinishReason | None = None
    token_ids: list[int] | None = Field(**_WHEN_ASKED)


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] | None = Field(**_WHEN_ASKED)
    prompt_logprobs: PromptLogprobs | None = Field(**_WHEN_ASKED)


class FunctionCallDelta(BaseModel):
    name: str | None = Field(None, exclude_if=lambda v: v is None)
    arguments: str


class ToolCallDelta(BaseModel):
    """A piece of a streamed call: its id, type and name come first, its arguments in pieces."""

    index: int
    id: str | None = Field(None, exclude_if=lambda v: v is None)
    type: Literal["function"] | None = Field(None, exclude_if=lambda v: v is None)
    function: FunctionCallDelta


class Delta(BaseModel):
    # Left out of the JSON when unset, as OpenAI does: the role comes only in a choice's first chunk.
    role: Literal["assistant"] | None = Field(None, exclude_if=lambda v: v is None)
    content: str | None = Field(None, exclude_if=lambda v: v is None)
    tool_calls: list[ToolCallDelta] | None = Field(None, exclude_if=lambda v: v is None)


class ChatStreamChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: ChatFinishReason | None = None
    token_ids: list[int] | None = Field(**_WHEN_ASKED)


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = Field(**_WHEN_ASKED)


class TokenIdLogprob(BaseModel):
    token_id: int
    logprob: float


class GenerateTokenLogprob(TokenIdLogprob):
    top_logprobs: list[TokenIdLogprob] = Field(description="The most likely tokens, most likely first.")


class GenerateOutput(BaseModel):
    index: int
    output_text: str
    token_ids: list[int]
    logprobs: list[GenerateTokenLogprob] | None = Field(None, description="One per token, when asked for.")
    cumulative_logprob: float | None = None
    finish_reason: FinishReason | None = None


class GenerateResponse(BaseModel):
    outputs: list[GenerateOutput]
    usage: Usage


class GenerateStreamOutput(BaseModel):
    index: int
    output_text: str = Field(description="The text added since the previous chunk.")
    logprobs: list[GenerateTokenLogprob] | None = Field(
        None, description="The tokens generated since the previous chunk, when asked for.")
    finish_reason: FinishReason | None = None


class GenerateChunk(BaseModel):
    outputs: list[GenerateStreamOutput]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "jaxserve"
    root: str = Field(description="The checkpoint served under this name.")
    parent: str | None = None
    max_model_len: int


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class Version(BaseModel):
    version: str


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
