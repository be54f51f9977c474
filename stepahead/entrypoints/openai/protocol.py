"""OpenAI-compatible request and response models (pydantic).

Requests accept unknown fields (`extra="allow"`, as OpenAI clients send new ones all the time); the
serving layer logs each ignored field name once. Fields that would change the output but that
stepahead does not implement are rejected with a 400 instead of being silently ignored.

Numbers are strict: no NaN or infinity, OpenAI's ranges for the sampling fields, integers in bounds
that name the field when exceeded, and no booleans where token ids or counts are expected.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_MAX_COUNT = 2**31 - 1  # token counts and the like: anything larger is a mistake
TokenId = Annotated[StrictInt, Field(ge=-(2**31), le=2**31 - 1)]  # true/false are not token ids; the vocabulary check names bad ones
LogitBias = Annotated[float, Field(ge=-100.0, le=100.0)]  # OpenAI's range


# OpenAI's reasoning efforts (chat's reasoning_effort, the Responses API's reasoning.effort).
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high"]
REASONING_EFFORTS: tuple[str, ...] = get_args(ReasoningEffort)


def random_id(prefix: str, chosen: str | None = None) -> str:
    """prefix-<chosen>, or prefix-<random hex> when the client chose no id."""
    return f"{prefix}-{chosen if chosen is not None else uuid.uuid4().hex}"


class OpenAIRequest(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class StreamOptions(OpenAIRequest):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM's: usage on every chunk (with include_usage)


class StructuredOutputs(OpenAIRequest):
    """vLLM's `structured_outputs` extra field: exactly one constraint, and JSON's whitespace options."""

    json_schema: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict[str, Any] | None = None  # JSON text (vLLM's type), or the object itself
    disable_any_whitespace: StrictBool = False
    whitespace_pattern: str | None = None  # refused by name: xgrammar has no whitespace pattern


class TaggedStructure(OpenAIRequest):
    """One structure of vLLM's legacy structural_tag response_format: `begin`, JSON matching `schema`, `end`."""

    begin: str
    json_schema: dict[str, Any] = Field(alias="schema")
    end: str


class ResponseFormat(OpenAIRequest):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: dict[str, Any] | None = None
    # type "structural_tag": vLLM's legacy form (structures and triggers) or xgrammar's (format).
    structures: list[TaggedStructure] | None = None
    triggers: list[str] | None = None
    format: dict[str, Any] | None = None


class SamplingFields(OpenAIRequest):
    """Fields shared by completions and chat completions (OpenAI's plus vLLM's sampling extras)."""

    model: str | None = None
    n: StrictInt = Field(default=1, ge=0, le=_MAX_COUNT)
    best_of: StrictInt | None = Field(default=None, ge=0, le=_MAX_COUNT)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: StrictInt | None = Field(default=None, ge=-1, le=2**31 - 1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: StrictInt | None = Field(default=None, ge=_INT64_MIN, le=_INT64_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    min_tokens: StrictInt = Field(default=0, ge=0, le=_MAX_COUNT)
    presence_penalty: float | None = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=2.0)
    logit_bias: dict[str, LogitBias] | None = None  # token id (as text) -> bias added to its logit
    allowed_token_ids: list[TokenId] | None = None
    bad_words: list[str] | None = None  # vLLM's: words the output never completes
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # vLLM's: with skip_special_tokens false, false joins a special token right after another without
    # the space the tokenizer's decoder may put between them
    spaces_between_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    # vLLM's older spellings of structured_outputs' fields.
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None  # refused, as structured_outputs.whitespace_pattern is
    structural_tag: str | None = None
    return_tokens_as_token_ids: bool | None = None  # logprobs' tokens as "token_id:N"
    prompt_logprobs: StrictInt | None = Field(default=None, ge=-(2**31), le=2**31 - 1)  # top-N per prompt token
    # vLLM's: keep this many prompt tokens (-1: the context length), from the end unless truncation_side "right"
    truncate_prompt_tokens: StrictInt | None = Field(default=None, ge=-1, le=_MAX_COUNT)
    truncation_side: Literal["left", "right"] | None = None
    return_token_ids: bool | None = None  # vLLM's: the prompt's and the output's token ids in the response
    # vLLM's: lower runs earlier under --scheduling-policy priority; anything but 0 is a 400 under fcfs
    priority: StrictInt = Field(default=0, ge=-(2**31), le=2**31 - 1)
    # vLLM's: the response's id is built from it (one in use by a running request is a 400)
    request_id: str | None = Field(default=None, min_length=1, max_length=256)
    # vLLM's: isolates this client's prefix-cache entries (blocks hashed with the salt match only the same salt)
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)
    # Fields stepahead does not implement (serving_utils.UNIMPLEMENTED_FIELDS): declared so that setting one is
    # a 400 naming it, never a silent ignore.
    use_beam_search: bool = False
    length_penalty: float = 1.0  # vLLM's, for beam search
    logits_processors: list[Any] | None = None  # vLLM's, behind --logits-processor-pattern
    thinking_token_budget: StrictInt | None = None  # vLLM's: the most reasoning tokens before the end is forced
    prediction: dict[str, Any] | None = None  # OpenAI's predicted outputs
    guided_decoding_backend: str | None = None  # vLLM's older per-request backend choice
    mm_processor_kwargs: dict[str, Any] | None = None  # vLLM's, for multimodal processors
    kv_transfer_params: dict[str, Any] | None = None  # vLLM's, for disaggregated serving
    vllm_xargs: dict[str, Any] | None = None  # vLLM's, for custom extensions


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: StrictInt | None = Field(default=16, ge=0, le=_MAX_COUNT)
    echo: bool = False
    logprobs: StrictInt | None = Field(default=None, ge=-1, le=_MAX_COUNT)  # -1: the whole vocabulary
    suffix: str | None = None
    prompt_embeds: Any = None  # vLLM's; refused by name (stepahead takes text or token ids)
    add_special_tokens: bool = True


class TextPart(OpenAIRequest):
    type: str
    text: str | None = None


class ToolCallFunction(OpenAIRequest):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(OpenAIRequest):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(OpenAIRequest):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a role "tool" message: the call it answers


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = Field(default=None, ge=0, le=_MAX_COUNT)  # deprecated alias of max_completion_tokens
    max_completion_tokens: StrictInt | None = Field(default=None, ge=0, le=_MAX_COUNT)
    logprobs: bool = False
    top_logprobs: StrictInt | None = Field(default=None, ge=-1, le=_MAX_COUNT)  # -1: the whole vocabulary
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # the chat template already adds what the model needs
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # refused unless the server trusts request templates
    echo: bool = False  # the last message's content goes before the output when it is the assistant's
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None  # default: "auto" with tools, else "none"
    parallel_tool_calls: bool | None = True
    # OpenAI's: reaches the chat template as its reasoning_effort variable (chat_template_kwargs may override)
    reasoning_effort: ReasoningEffort | None = None
    include_reasoning: bool = True  # vLLM's: false leaves reasoning_content out (with --reasoning-parser)
    documents: list[dict[str, Any]] | None = None  # vLLM's: the chat template's documents variable (RAG templates)


class TokenizeRequest(OpenAIRequest):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool | None = False
    tools: list[dict[str, Any]] | None = None  # rendered by the chat template, as for a chat completion


class DetokenizeRequest(OpenAIRequest):
    model: str | None = None
    tokens: list[TokenId]


# -- responses ---------------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens found in the prefix cache


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None  # with --enable-prompt-tokens-details


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's form of one token's entry in prompt_logprobs."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One entry per prompt token: None for the first, else token id (as text) -> its entry.
PromptLogprobsList = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobsList | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids
    token_ids: list[int] | None = None  # return_token_ids: the output's


class _Response(BaseModel):
    """The head every response shares; subclasses fix `object` and add choices and usage."""

    id: str
    object: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str


class CompletionResponse(_Response):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None  # OpenAI's; null: no backend configuration to fingerprint


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ChatToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None  # with --reasoning-parser: the model's reasoning, apart from content
    tool_calls: list[ChatToolCall] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # return_token_ids: the output's


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None  # OpenAI's; null: no backend configuration to fingerprint
    prompt_logprobs: PromptLogprobsList | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "stepahead"
    root: str
    parent: str | None = None
    max_model_len: int
    permission: list[dict[str, Any]] = Field(default_factory=list)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
