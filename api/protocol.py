"""The OpenAI API's wire format: the request models and the limits (the error object is
``api.errors``). Schema only: ``api.translate`` turns a request into what the cluster runs,
``api.responses`` builds what goes back.

Requests are parsed straight from the body bytes into strict pydantic models; anything wrong
(malformed JSON, a wrong type, a value out of range, an unknown field) becomes an ``APIError``
whose ``param`` is the dotted path of the offending field, so the app has one error path.

- **Unknown fields are rejected (400)**, not ignored as vLLM does: a misspelt ``temprature``
  silently sampling at T=1 is worse than a clear error. OpenAI fields this server does not
  implement (``best_of``, ``audio``...) are unknown fields too.
  The engine's extras (``top_k``, ``min_p``... what the openai client sends via ``extra_body``)
  are top-level fields.
- **Types are strict**: ``"0.5"`` is not a number and ``true`` is not an integer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from api.errors import APIError, bad_request

MAX_N = 16
MAX_STOP = 4
MAX_LOGPROBS = 20
MAX_TOOLS = 128  # OpenAI's limit
# The longest timeout a request may ask for (seconds): a deadline further away is as good as
# none, and one past threading.TIMEOUT_MAX would overflow an engine's wait.
MAX_TIMEOUT_S = 86_400.0
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
JSON_MEDIA_TYPE = "application/json"


class CrossFieldError(ValueError):
    """A model-level check failed; pydantic reports it without a field, so it carries one."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


# -- requests -------------------------------------------------------------------------------------


class StrictModel(BaseModel):
    """A request body's model: unknown fields refused, types strict, no NaN, immutable."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, frozen=True)


# What the before-validators below accept, for the OpenAPI document (the Python types are what
# they normalise to): schema-driven clients and fuzzers then send every accepted form.
_TEXT = {"type": "string", "minLength": 1}
_TOKEN_ID_LIST = {"type": "array", "items": {"type": "integer", "minimum": 0}}
_TOKEN_IDS = {**_TOKEN_ID_LIST, "minItems": 1}  # a prompt
_PROMPT_SCHEMA = WithJsonSchema(
    {
        "description": "one text, one token id list, or a batch of either (all texts or all "
        "token id lists); each prompt's choices count towards the server's max_choices",
        "anyOf": [
            _TEXT,
            {"type": "array", "items": _TEXT, "minItems": 1},
            _TOKEN_IDS,
            {"type": "array", "items": _TOKEN_IDS, "minItems": 1},
        ],
    }
)
_STOP_SCHEMA = WithJsonSchema(
    {"anyOf": [_TEXT, {"type": "array", "items": _TEXT, "maxItems": MAX_STOP}, {"type": "null"}]}
)
_LOGIT_BIAS = {
    "type": "object",
    "propertyNames": {"pattern": "^[0-9]+$"},
    "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
}
_CONTENT_SCHEMA = WithJsonSchema(
    {
        "anyOf": [
            {"type": "string"},
            {"type": "null"},
            {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
                    "required": ["type", "text"],
                    "additionalProperties": False,
                },
            },
        ]
    }
)


@dataclass(frozen=True)
class PromptReport:
    """What each choice of a completions request reports of its prompt. ``echo``: the prompt's
    text leads the choice's text and, with ``logprobs``, its tokens lead the ``logprobs``
    object (the first token's logprob and top_logprobs null: nothing predicts it), OpenAI's
    legacy scoring. ``prompt_logprobs``: vLLM's extra choice field of that name."""

    echo: bool = False
    logprobs: int | None = None  # the request's: the alternatives an echoed token shows
    prompt_logprobs: int | None = None
    token_ids: bool = False  # return_tokens_as_token_ids: logprobs name tokens `token_id:N`

    @property
    def num_prompt_logprobs(self) -> int | None:
        """The alternatives the engine computes per prompt token (both fields' most)."""
        wanted = [self.prompt_logprobs, self.logprobs if self.echo else None]
        return max((k for k in wanted if k is not None), default=None)


class StreamOptions(StrictModel):
    include_usage: bool = False


class FunctionCall(StrictModel):
    name: str
    arguments: str = Field(description="the arguments, as the JSON text of an object")


class ToolCall(StrictModel):
    """A call an assistant message made (what a response's ``message.tool_calls`` holds)."""

    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(StrictModel):
    role: Literal["system", "user", "assistant", "tool"]
    # a list of text parts arrives joined with "\n" (vLLM's convention); null only for an
    # assistant message that made tool calls
    content: Annotated[str | None, _CONTENT_SCHEMA] = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(
        default=None, description="an assistant message's calls (sent back with their results)"
    )
    tool_call_id: str | None = Field(
        default=None, description="a tool message's: the id of the call it answers"
    )

    @field_validator("content", mode="before")
    @classmethod
    def _join_text_parts(cls, value: Any) -> Any:
        if not isinstance(value, list):
            return value
        texts = []
        for i, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"part {i} is {kind!r}: only text parts are supported")
            if set(part) != {"type", "text"} or not isinstance(part["text"], str):
                raise ValueError(f"part {i} must be exactly {{'type': 'text', 'text': <string>}}")
            texts.append(part["text"])
        return "\n".join(texts)

    @model_validator(mode="after")
    def _role_fields(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise CrossFieldError("tool_calls", "only an assistant message makes tool calls")
        if (self.tool_call_id is None) != (self.role != "tool"):
            raise CrossFieldError("tool_call_id", "a tool message, and only one, names its call")
        if self.content is None and not self.tool_calls:
            raise CrossFieldError("content", "required (null only beside tool_calls)")
        return self


class FunctionDefinition(StrictModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(
        default=None, description="the JSON Schema of the arguments object; none: no arguments"
    )
    strict: bool | None = Field(
        default=None, description="accepted; required and named calls always match the schema"
    )


class ToolDefinition(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: FunctionName


class JSONSchemaFormat(StrictModel):
    """``response_format.json_schema``: OpenAI's named schema."""

    model_config = ConfigDict(populate_by_name=True)
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema", description="the JSON Schema to match")
    strict: bool | None = Field(
        default=None, description="accepted; the output always matches the schema"
    )


class TextFormat(StrictModel):
    type: Literal["text"]


class JSONObjectFormat(StrictModel):
    type: Literal["json_object"]


class JSONSchemaResponseFormat(StrictModel):
    type: Literal["json_schema"]
    json_schema: JSONSchemaFormat


# OpenAI's ``response_format``: free text, any JSON object, or a JSON schema.
ResponseFormat = Annotated[
    TextFormat | JSONObjectFormat | JSONSchemaResponseFormat, Field(discriminator="type")
]


class StructuredOutputs(StrictModel):
    """vLLM's ``structured_outputs`` (an extra body field): exactly one of a JSON schema, a
    regex, a choice of strings, or a Lark / GBNF grammar."""

    model_config = ConfigDict(
        populate_by_name=True, json_schema_extra={"minProperties": 1, "maxProperties": 1}
    )
    json_schema: Annotated[
        dict[str, Any] | str | None,
        WithJsonSchema({"anyOf": [{"type": "object"}, {"type": "string"}]}),
    ] = Field(default=None, alias="json", description="a JSON Schema (an object, or its text)")
    regex: Annotated[str | None, WithJsonSchema({"type": "string", "minLength": 1})] = Field(
        default=None, min_length=1
    )
    choice: Annotated[
        list[str] | None,
        WithJsonSchema({"type": "array", "items": {"type": "string"}, "minItems": 1}),
    ] = Field(default=None, min_length=1)
    grammar: Annotated[str | None, WithJsonSchema({"type": "string", "minLength": 1})] = Field(
        default=None, min_length=1, description="a Lark or GBNF grammar"
    )

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        kinds = ("json_schema", "regex", "choice", "grammar")
        given = [k for k in kinds if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"exactly one of json, regex, choice, grammar; got {len(given)}")
        return self


class _SamplingFields(StrictModel):
    """The fields both endpoints share: OpenAI's, then the engine's extras."""

    model: str
    max_tokens: int | None = Field(
        default=None, ge=1, description="at most the context length left after the prompt"
    )
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Annotated[list[str] | None, _STOP_SCHEMA] = None
    seed: int | None = Field(default=None, ge=_INT64_MIN, le=_INT64_MAX)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: Annotated[
        dict[str, float] | None, WithJsonSchema({"anyOf": [_LOGIT_BIAS, {"type": "null"}]})
    ] = None
    user: str | None = None
    # engine extras
    top_k: int = Field(default=0, ge=-1)  # -1 (vLLM's "off") and 0 both disable
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    typical_p: float = Field(default=1.0, gt=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    return_tokens_as_token_ids: bool = Field(
        default=False,
        description="vLLM's: logprobs name each token `token_id:N` instead of its text (exact "
        "where texts collide or a token is part of a UTF-8 character)",
    )
    stop_token_ids: Annotated[
        list[int] | None, WithJsonSchema({"anyOf": [_TOKEN_ID_LIST, {"type": "null"}]})
    ] = None
    include_stop_str_in_output: bool = False
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = Field(
        default=None,
        description="vLLM's: the output held to a JSON schema, regex, choice or grammar",
    )
    # serving extras
    priority: int = Field(default=0, ge=-(2**31), le=2**31 - 1)  # lower first, as vLLM's
    timeout: float | None = Field(  # as X-Request-Timeout
        default=None, gt=0, le=MAX_TIMEOUT_S, description="seconds until the request's deadline"
    )

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list):
            return value  # None, or a wrong type for pydantic to report
        if len(value) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences, got {len(value)}")
        for i, s in enumerate(value):
            if s == "":
                raise ValueError(f"stop sequence {i} is empty")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not (key.isascii() and key.isdigit()):
                raise ValueError(f"key {key!r} is not a token id (a decimal integer string)")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"bias {bias} for token {key} is outside [-100, 100]")
        return value

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_token_ids(cls, value: list[int] | None) -> list[int] | None:
        for tid in value or []:
            if tid < 0:
                raise ValueError(f"token id {tid} is negative")
        return value

    @model_validator(mode="after")
    def _one_output_format(self) -> _SamplingFields:
        if self.structured_outputs is not None and self.response_format is not None:
            if not isinstance(self.response_format, TextFormat):
                raise CrossFieldError(
                    "structured_outputs", "give response_format or structured_outputs, not both"
                )
        return self

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise CrossFieldError("stream_options", "only allowed when stream is true")
        return self

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk (empty choices) before [DONE]."""
        return self.stream and self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``. ``prompt`` is normalised to a batch: one str or one token list
    becomes a batch of one."""

    prompt: Annotated[list[str | list[int]], _PROMPT_SCHEMA]  # all strings or all token lists
    max_tokens: int | None = Field(
        default=None,
        ge=0,
        description="at most the context length left after the prompt; 0 (only with echo) "
        "scores the prompt alone",
    )
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = Field(
        default=False,
        description="the prompt leads each choice's text and, with logprobs, its logprobs",
    )
    prompt_logprobs: int | None = Field(
        default=None,
        ge=0,
        le=MAX_LOGPROBS,
        description="each choice's prompt_logprobs (vLLM's): per prompt token, null for the "
        "first, else {token id: {logprob, rank, decoded_token}} for it and this many top ones",
    )

    @model_validator(mode="after")
    def _no_tokens_only_with_echo(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise CrossFieldError(
                "max_tokens", "must be >= 1 (0 only with echo: the prompt scored alone)"
            )
        return self

    @property
    def prompt_report(self) -> PromptReport:
        return PromptReport(
            self.echo, self.logprobs, self.prompt_logprobs, self.return_tokens_as_token_ids
        )

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_batch(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not value:
            raise ValueError(
                "must be a non-empty string, list of strings, list of token ids "
                "or list of token id lists"
            )
        if all(type(t) is int for t in value):
            value = [value]
        for i, item in enumerate(value):
            if isinstance(item, str):
                if item == "":
                    raise ValueError(f"prompt {i} is empty")
            elif isinstance(item, list) and all(type(t) is int for t in item):
                if not item:
                    raise ValueError(f"prompt {i} is an empty token list")
                if any(t < 0 for t in item):
                    raise ValueError(f"prompt {i} holds a negative token id")
            else:
                raise ValueError(f"prompt {i} is neither a string nor a list of token ids")
        kinds = {isinstance(item, str) for item in value}
        if len(kinds) > 1:
            raise ValueError("a batch must be all strings or all token id lists")
        return value


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``. ``max_completion_tokens`` (OpenAI's current name) wins
    over the deprecated ``max_tokens`` when both are given."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(
        default=None, ge=1, description="at most the context length left after the prompt"
    )
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[ToolDefinition] | None = Field(
        default=None, min_length=1, max_length=MAX_TOOLS, description="functions the model may call"
    )
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        default=None,
        description="auto (the default with tools): the model decides; required: at least one "
        "call; a named function: a call of it; none (the default without): no call",
    )
    parallel_tool_calls: bool | None = Field(
        default=None, description="false: at most one call (true, the default: any number)"
    )

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise CrossFieldError("top_logprobs", "requires logprobs to be true")
        return self

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice_kind(cls, value: Any) -> Any:
        """One error for the member the value is meant as, not one per member tried."""
        if value is None or value in ("none", "auto", "required"):
            return value
        if not isinstance(value, dict):
            raise ValueError("one of 'none', 'auto', 'required' or a named function")
        try:
            return NamedToolChoice.model_validate(value)
        except ValidationError as exc:
            err = exc.errors(include_url=False)[0]
            where = ".".join(str(p) for p in err["loc"])
            raise ValueError(f"a named function's {where or 'object'}: {err['msg']}") from None

    @model_validator(mode="after")
    def _tool_choice_needs_tools(self) -> ChatCompletionRequest:
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) < len(names):
            raise CrossFieldError("tools", "two tools have the same name")
        choice = self.tool_choice
        if choice not in (None, "none") and not names:
            raise CrossFieldError("tool_choice", "only allowed when tools are given")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise CrossFieldError(
                "tool_choice", f"names {choice.function.name!r}, which is not one of the tools"
            )
        forced = choice == "required" or isinstance(choice, NamedToolChoice)
        formatted = self.structured_outputs is not None or not isinstance(
            self.response_format, TextFormat | None
        )
        if forced and formatted:
            raise CrossFieldError(
                "tool_choice", "a required or named tool call leaves no room for an output format"
            )
        return self

    @property
    def tool_mode(self) -> Literal["none", "auto", "required", "named"]:
        """How the request uses its tools: not at all, as the model decides, or forced."""
        choice = self.tool_choice or ("auto" if self.tools else "none")
        return "named" if isinstance(choice, NamedToolChoice) else choice


def parse_completion(body: bytes) -> CompletionRequest:
    """Raises: APIError(400) naming the field for anything the model rejects."""
    return parse_body(CompletionRequest, body)


def parse_chat(body: bytes) -> ChatCompletionRequest:
    """Raises: APIError(400) naming the field for anything the model rejects."""
    return parse_body(ChatCompletionRequest, body)


_M = TypeVar("_M", bound=BaseModel)


def parse_body(model: type[_M], body: bytes) -> _M:
    """``body`` parsed into ``model``. Raises: APIError(400) naming the field."""
    if not body.strip():
        raise APIError(400, "the body is empty: expected a JSON object")
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise _api_error(exc) from None


def _api_error(exc: ValidationError) -> APIError:
    """The first pydantic error as a 400: ``param`` is the dotted field path."""
    err = exc.errors(include_url=False)[0]
    param = ".".join(str(p) for p in err["loc"]) or None
    kind, msg = err["type"], err["msg"].removeprefix("Value error, ")
    if kind == "json_invalid":  # pydantic's message names the line and column
        return APIError(400, f"the body is not valid JSON: {msg.removeprefix('Invalid JSON: ')}")
    if kind == "model_type" and param is None:
        return APIError(400, f"the body must be a JSON object, not {_json_kind(err['input'])}")
    if kind == "extra_forbidden":
        return bad_request(param, f"unknown field {param!r}: this server does not support it")
    if kind == "missing":
        return bad_request(param, f"{param!r} is required")
    cause = err.get("ctx", {}).get("error")
    if isinstance(cause, CrossFieldError):  # its field, under the section that raised it
        field = ".".join([*(str(p) for p in err["loc"]), cause.field])
        return bad_request(field, f"{field!r}: {msg}")
    value = _short(err.get("input"))
    return bad_request(param, f"invalid value for {param!r} ({value}): {msg}")


def _json_kind(value: Any) -> str:
    kinds = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    return kinds.get(type(value), "a number")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_content_type(content_type: str | None) -> None:
    """Raises: APIError(415) when the body is declared as anything but JSON (parameters such
    as ``charset`` aside). A body with no Content-Type is read as JSON (RFC 9110 lets the
    recipient look; vLLM refuses it): clients that send none, such as ``http.client`` or
    ``requests``' ``data=``, work, and the parser's 400 says what is wrong with a body that
    is not JSON."""
    if content_type is None:
        return
    if content_type.split(";", 1)[0].strip().lower() != JSON_MEDIA_TYPE:
        raise APIError(
            415,
            f"Content-Type {_short(content_type)} is not supported: send the body as "
            f"{JSON_MEDIA_TYPE}",
            param="Content-Type",
            code="unsupported_media_type",
        )
