"""OpenAI wire format: request bodies (validated by pydantic) and response bodies.

Nothing a client sends is silently ignored. Every field of OpenAI's chat and completions schemas and of
vLLM's extensions is declared here: the ones the engine honours with their types and bounds, the others as
``Any`` so that checks.refuse_unsupported can refuse them by name when they ask for something (a value other
than "not set" or the default). A field nobody defines is refused too (400 ``unknown field``), as OpenAI does.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

MAX_TOP_LOGPROBS = 20  # = sequence.MAX_LOGPROBS; kept here so this module stays engine-free
SEED_LIMIT = 1 << 63  # the sampler seeds a torch.Generator: a signed 64-bit integer
TOKEN_LIMIT = (1 << 31) - 1  # no count of tokens (or token id) is larger; the route bounds them further

# Numbers are strict (no "5" for 5, no true for 1) and finite (JSON's NaN and Infinity are refused), so a value
# that reaches the engine is one it can take; each field's bounds are in its type and in the OpenAPI schema.
Int = Annotated[int, Field(strict=True)]
Float = Annotated[float, Field(strict=True, allow_inf_nan=False)]
Bool = Annotated[bool, Field(strict=True)]
TokenCount = Annotated[int, Field(strict=True, ge=1, le=TOKEN_LIMIT)]
TokenId = Annotated[int, Field(strict=True, ge=0, le=TOKEN_LIMIT)]
Penalty = Annotated[float, Field(strict=True, allow_inf_nan=False, ge=-2.0, le=2.0)]
TopLogprobs = Annotated[int, Field(strict=True, ge=0, le=MAX_TOP_LOGPROBS)]


def _has_lone_surrogate(value: Any) -> bool:
    """JSON's \\ud800 escapes decode to a str no tokenizer (or UTF-8 encoder) can take. Iterative: a deeply
    nested value must not exhaust the stack."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(item, list | tuple):
            pending.extend(item)
        elif isinstance(item, dict):
            pending.extend(item.keys())
            pending.extend(item.values())
    return False


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @field_validator("*")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        # Nested requests (messages, their parts) check their own fields, so the error names the deepest one.
        if _has_lone_surrogate(value):
            raise PydanticCustomError(
                "unicode", "must be valid Unicode: a lone UTF-16 surrogate (\\ud800-\\udfff) is not text"
            )
        return value


class StreamOptions(_Request):
    include_usage: Bool = False
    continuous_usage_stats: Bool = False  # vLLM: usage so far on every chunk
    include_obfuscation: Any = None  # refused when true: chunks carry no obfuscation padding


class _SamplingFields(_Request):
    """Fields shared by both endpoints; the route turns them into engine SamplingParams."""

    model: str
    temperature: Float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: Float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: Int | None = Field(default=None, ge=-1, le=TOKEN_LIMIT)  # -1 or 0: off; at most the vocabulary
    seed: Int | None = Field(default=None, ge=0, lt=SEED_LIMIT)
    stop: str | list[str] | None = None
    n: Int = Field(default=1, ge=1, le=128)
    stream: Bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: (
        dict[str, Annotated[float, Field(strict=True, allow_inf_nan=False, ge=-100, le=100)]] | None
    ) = None
    ignore_eos: Bool = False
    user: str | None = None  # a label for the caller's own records: no effect on the output
    # vLLM's sampling extensions
    min_p: Float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: Float | None = Field(default=None, gt=0.0, le=2.0)
    min_tokens: Int = Field(default=0, ge=0, le=TOKEN_LIMIT)
    stop_token_ids: list[TokenId] | None = None
    # Declared so that they are refused by name when set (checks.REFUSED says which values pass).
    best_of: Any = None
    use_beam_search: Any = None
    length_penalty: Any = None
    include_stop_str_in_output: Any = None
    skip_special_tokens: Any = None
    spaces_between_special_tokens: Any = None
    truncate_prompt_tokens: Any = None
    prompt_logprobs: Any = None
    allowed_token_ids: Any = None
    bad_words: Any = None
    add_special_tokens: Bool | None = (
        None  # vLLM: the tokenizer's own special tokens (chat: false, else true)
    )
    response_format: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None
    structural_tag: Any = None
    structured_outputs: Any = None
    priority: Any = None
    request_id: Any = None
    logits_processors: Any = None
    return_tokens_as_token_ids: Any = None
    return_token_ids: Any = None
    cache_salt: Any = None
    kv_transfer_params: Any = None
    vllm_xargs: Any = None


class TextPart(_Request):
    type: Literal["text"]
    text: str


FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]


class FunctionDef(_Request):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema of the arguments object (None: no arguments)
    strict: Bool | None = None  # the arguments always follow the schema when the grammar enforces them


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDef


class ChosenFunction(_Request):
    name: FunctionName


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: ChosenFunction


class CalledFunction(_Request):
    name: str
    arguments: str  # a JSON object, as text (as OpenAI sends it)


class ToolCall(_Request):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls, as it answered them
    tool_call_id: str | None = None  # a tool message: the call it answers
    # An assistant message as the client received it may carry these as null; set, they are refused.
    function_call: Any = None
    refusal: Any = None
    audio: Any = None
    annotations: Any = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: TokenCount | None = None
    max_completion_tokens: TokenCount | None = None
    logprobs: Bool = False
    top_logprobs: TopLogprobs | None = None
    metadata: dict[str, str] | None = None  # labels for the caller's records: no effect on the output
    safety_identifier: str | None = None  # likewise
    prompt_cache_key: str | None = None  # likewise (the prefix cache works on content, whatever the key)
    add_generation_prompt: Bool = True  # vLLM: end the prompt with the template's assistant header
    continue_final_message: Bool = False  # vLLM: go on writing the last (assistant) message
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: Bool | None = None
    # Refused by name when set (checks.REFUSED):
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    moderation: Any = None
    prediction: Any = None
    prompt_cache_options: Any = None
    prompt_cache_retention: Any = None
    reasoning_effort: Any = None
    service_tier: Any = None
    store: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    echo: Any = None  # vLLM: repeat the last message
    documents: Any = None
    chat_template: Any = None
    chat_template_kwargs: Any = None
    mm_processor_kwargs: Any = None


class CompletionRequest(_SamplingFields):
    # str | [str] | [int] | [[int]]; batches of more than one prompt are refused by the route.
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: TokenCount | None = None
    logprobs: TopLogprobs | None = None
    echo: Bool = False
    suffix: Any = None  # refused when set
    prompt_embeds: Any = None  # vLLM; refused when set


# --- responses ------------------------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: ResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None
    stop_reason: int | str | None = None  # vLLM: the stop token id or stop string that ended it


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatChunkChoice(BaseModel):
    index: int = 0
    # {"role": ...} first, then {"content": ...} or {"tool_calls": [...]}, then {} with the finish reason
    delta: dict[str, Any]
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None
    stop_reason: int | str | None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "loraplane"
    root: str | None = None  # the base model for an adapter; itself for the base
    parent: str | None = None  # an adapter's base model
    version: str | None = None  # an adapter's serving version


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
