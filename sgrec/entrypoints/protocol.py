"""Request models of the OpenAI-compatible routes (SGLang 0.5.23's field names and defaults).

Unknown fields are ignored, as SGLang does. Range checks are left to the native SamplingParams
validation (reached through TokenizerManager.submit), so both APIs reject the same values with the
same messages; the models here only check JSON types and the OpenAI-only constraints.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Dict, List, Literal, Optional, Union

from pydantic import (
    BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError, field_validator,
)

__all__ = [
    "ChatCompletionRequest", "ChatMessage", "CompletionRequest", "RequestError", "StreamOptions", "ValidationError",
    "validation_message",
]


class RequestError(ValueError):
    """A request the OpenAI routes reject with 400 (or `status`), naming the offending field."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class StreamOptions(_Model):
    include_usage: Optional[StrictBool] = False
    continuous_usage_stats: Optional[StrictBool] = False


class ResponseFormat(_Model):
    type: StrictStr = "text"


Number = StrictFloat  # ints accepted, bools and strings not
Text = Annotated[StrictStr, Field(min_length=1)]  # a prompt: an empty one is a 400
TokenIds = Annotated[List[Annotated[StrictInt, Field(ge=0)]], Field(min_length=1)]  # ids past the vocabulary: 400


class _SamplingFields(_Model):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: Optional[StrictStr] = "default"  # not checked against the served name (as SGLang)
    frequency_penalty: Optional[Number] = None
    presence_penalty: Optional[Number] = None
    logit_bias: Optional[Dict[str, Number]] = None
    n: Optional[StrictInt] = 1
    seed: Optional[StrictInt] = None
    stop: Optional[Union[StrictStr, List[StrictStr]]] = None
    stream: Optional[StrictBool] = False
    stream_options: Optional[StreamOptions] = None
    temperature: Optional[Number] = None
    top_p: Optional[Number] = None
    user: Optional[StrictStr] = None
    response_format: Optional[ResponseFormat] = None

    # SGLang extras
    top_k: Optional[StrictInt] = None
    min_p: Optional[Number] = None
    min_tokens: Optional[StrictInt] = Field(None, ge=0)
    repetition_penalty: Optional[Number] = None
    stop_token_ids: Optional[List[StrictInt]] = None
    ignore_eos: Optional[StrictBool] = None
    skip_special_tokens: Optional[StrictBool] = None
    spaces_between_special_tokens: Optional[StrictBool] = None
    no_stop_trim: Optional[StrictBool] = None
    rid: Optional[Union[Text, List[Text]]] = None
    extra_key: Optional[StrictStr] = None
    cache_salt: Optional[StrictStr] = None
    priority: Optional[StrictInt] = None  # accepted; sgrec has no priority scheduling

    # SGLang extras sgrec does not implement: rejected with a clear 400 when set.
    regex: Optional[Any] = None
    ebnf: Optional[Any] = None
    json_schema: Optional[Any] = None
    stop_regex: Optional[Any] = None
    lora_path: Optional[Any] = None
    custom_logit_processor: Optional[Any] = None
    custom_params: Optional[Any] = None
    return_hidden_states: Optional[Any] = None
    session_params: Optional[Any] = None

    def check_unsupported(self) -> None:
        for name, why in (
            ("regex", "constrained decoding is not implemented"),
            ("ebnf", "constrained decoding is not implemented"),
            ("json_schema", "constrained decoding is not implemented"),
            ("stop_regex", "regex stop conditions are not implemented"),
            ("lora_path", "LoRA adapters are not supported"),
            ("custom_logit_processor", "custom logit processors are not supported"),
            ("custom_params", "custom logit processors are not supported"),
            ("return_hidden_states", "hidden states are not returned"),
            ("session_params", "sessions are not supported"),
        ):
            v = getattr(self, name)
            if not (v is None or v is False or (type(v) in (str, list, dict) and not v)):  # 0 is no False here
                raise RequestError(f"`{name}` is not supported by sgrec ({why})", name)
        if self.response_format is not None and self.response_format.type != "text":
            raise RequestError(
                f"response_format.type {self.response_format.type!r} is not supported by sgrec "
                "(constrained decoding is not implemented); only 'text' is", "response_format")

    def sampling_params(self, max_new_tokens: int) -> dict:
        """The native sampling_params dict; values are range-checked by SamplingParams.from_dict."""
        sp: dict[str, Any] = {"max_new_tokens": max_new_tokens, "n": self.n if self.n is not None else 1}
        for ours, native in (
            ("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"), ("min_p", "min_p"),
            ("frequency_penalty", "frequency_penalty"), ("presence_penalty", "presence_penalty"),
            ("repetition_penalty", "repetition_penalty"), ("min_tokens", "min_new_tokens"),
            ("stop_token_ids", "stop_token_ids"), ("ignore_eos", "ignore_eos"),
            ("skip_special_tokens", "skip_special_tokens"),
            ("spaces_between_special_tokens", "spaces_between_special_tokens"), ("no_stop_trim", "no_stop_trim"),
            ("logit_bias", "logit_bias"), ("seed", "sampling_seed"),
        ):
            value = getattr(self, ours)
            if value is not None:
                sp[native] = value
        if self.stop is not None:
            sp["stop"] = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        return sp

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.include_usage and self.stream_options.continuous_usage_stats)

    def cache_namespace(self) -> str | None:
        """SGLang namespaces the radix cache by cache_salt and extra_key; sgrec has one key for both."""
        if self.cache_salt and self.extra_key:
            return f"{self.cache_salt}\x00{self.extra_key}"
        return self.cache_salt or self.extra_key


class CompletionRequest(_SamplingFields):
    prompt: Union[Text, Annotated[List[Text], Field(min_length=1)], TokenIds,
                  Annotated[List[TokenIds], Field(min_length=1)]]
    max_tokens: Optional[StrictInt] = 16
    echo: Optional[StrictBool] = False
    logprobs: Optional[StrictInt] = None
    best_of: Optional[StrictInt] = Field(None, ge=1)
    suffix: Optional[StrictStr] = None

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens_positive(cls, v):
        if v is not None and v <= 0:
            raise ValueError("max_tokens must be positive")  # as SGLang
        return v

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.suffix:
            raise RequestError("`suffix` is not supported by sgrec (no fill-in-the-middle)", "suffix")
        n = self.n if self.n is not None else 1
        if self.best_of is not None and self.best_of != n:
            raise RequestError(f"best_of ({self.best_of}) other than n ({n}) is not supported by sgrec", "best_of")
        if self.logprobs is not None and self.logprobs < 0:
            raise RequestError(f"logprobs must be a non-negative integer, got {self.logprobs}", "logprobs")


class TextPart(_Model):
    type: Literal["text"]
    text: StrictStr


ROLES = ("system", "developer", "user", "assistant")
TEXT_PART = {"type": "object", "required": ["type", "text"],
             "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}


class ChatMessage(_Model):
    """One chat message. The handler checks the rules below itself (template_dict: its 400s name the
    message); the schema states the same ones (json_schema_extra), so that /openapi.json says what is
    accepted: a supported role, text parts only, no tool calls, content unless the role is assistant."""

    model_config = ConfigDict(json_schema_extra={
        "if": {"properties": {"role": {"const": "assistant"}}},
        "else": {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}}})
    role: StrictStr = Field(json_schema_extra={"enum": list(ROLES)})
    content: Optional[Union[StrictStr, List[Dict[str, Any]]]] = Field(
        None, json_schema_extra={"anyOf": [{"type": "string"}, {"type": "array", "items": TEXT_PART}, {"type": "null"}]})
    name: Optional[StrictStr] = None
    tool_calls: Optional[Any] = Field(None, json_schema_extra={"type": "null"})
    tool_call_id: Optional[Any] = Field(None, json_schema_extra={"type": "null"})

    def template_dict(self, index: int) -> dict:
        where = f"messages[{index}]"
        if self.role not in ROLES:
            raise RequestError(f"{where}.role {self.role!r} is not supported by sgrec "
                               "(supported: system, developer, user, assistant)", "messages")
        for key in ("tool_calls", "tool_call_id"):
            if getattr(self, key) is not None:
                raise RequestError(f"{where}.{key}: tool calls are not supported by sgrec", "messages")
        content = self.content
        if content is None:
            if self.role != "assistant":
                raise RequestError(f"{where}.content is required for role {self.role!r}", "messages")
            content = ""
        elif isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.get("type") != "text":
                    raise RequestError(f"{where}.content[{j}].type {part.get('type')!r} is not "
                                       "supported by sgrec (text only)", "messages")
                try:
                    texts.append(TextPart.model_validate(part).text)
                except ValidationError:
                    raise RequestError(f"{where}.content[{j}].text must be a string", "messages") from None
            content = " ".join(texts)  # SGLang's flattening for string-content chat templates
        msg = {"role": self.role, "content": content}
        if self.name is not None:
            msg["name"] = self.name
        return msg


class ChatCompletionRequest(_SamplingFields):
    messages: List[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[StrictInt] = None
    max_completion_tokens: Optional[StrictInt] = None
    logprobs: Optional[StrictBool] = False
    top_logprobs: Optional[StrictInt] = None
    tools: Optional[List[Any]] = None
    tool_choice: Optional[Union[StrictStr, Dict[str, Any]]] = None
    functions: Optional[List[Any]] = None
    function_call: Optional[Any] = None
    # SGLang chat extras
    chat_template_kwargs: Optional[Dict[str, Any]] = None
    continue_final_message: Optional[StrictBool] = False
    separate_reasoning: Optional[StrictBool] = True  # no reasoning parser: reasoning_content stays null
    input_ids: Optional[TokenIds] = None  # skips the chat template

    def check_unsupported(self) -> None:
        super().check_unsupported()
        for key, off in (("tools", (None, [])), ("functions", (None, [])), ("function_call", (None, "none")),
                         ("tool_choice", (None, "none", "auto"))):
            v = getattr(self, key)
            if not any(v is o or (type(v) is type(o) and v == o) for o in off):
                raise RequestError(f"{key}: tool calling is not supported by sgrec", key)
        for key in ("max_tokens", "max_completion_tokens"):  # the field's own name, not max_new_tokens
            v = getattr(self, key)
            if v is not None and v < 0:
                raise RequestError(f"{key} must be at least 0, got {v}", key)
        if self.top_logprobs is not None:
            if not 0 <= self.top_logprobs <= 20:
                raise RequestError(f"top_logprobs must be in [0, 20], got {self.top_logprobs}", "top_logprobs")
            if self.top_logprobs > 0 and not self.logprobs:
                raise RequestError("top_logprobs requires logprobs to be true", "top_logprobs")

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


_UNION_MESSAGES = {
    "prompt": "prompt must be a string, a list of strings, a list of token ids or a list of token-id lists",
    "stop": "stop must be a string or a list of strings",
    "rid": "rid must be a string or a list of strings",
}


def validation_message(exc: ValidationError) -> tuple[str, str | None]:
    """A readable one-line message for a pydantic error, and the top-level field it concerns."""
    errors = exc.errors()
    fields = {str(e["loc"][0]) for e in errors if e.get("loc")}
    if len(fields) == 1 and (only := fields.pop()) in _UNION_MESSAGES and len(errors) > 1:
        return _UNION_MESSAGES[only], only
    parts, param = [], None
    for err in errors[:5]:
        # the field's path, without pydantic's union-member tags (`content.str`, `content.list[...]`)
        field = [x for x in err.get("loc", ())]
        tag = next((i for i, x in enumerate(field) if isinstance(x, str) and _UNION_TAG.match(x)), None)
        loc = ".".join(str(x) for x in field[:tag])
        if param is None and err.get("loc"):
            param = str(err["loc"][0])
        part = f"{loc}: {err.get('msg')}" if loc else str(err.get("msg"))
        if part not in parts:
            parts.append(part)
    return "; ".join(parts) or str(exc), param


_UNION_TAG = re.compile(r"^(str|int|float|bool|none|dict|list)(\[.*\])?$|^[\w-]+\[.*\]$")
