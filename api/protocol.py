"""The OpenAI API's wire format and its translation to the engine: pure functions, no I/O.

Requests are parsed straight from the body bytes into strict pydantic models; anything wrong
(malformed JSON, a wrong type, a value out of range, an unknown field) becomes an ``APIError``
whose ``param`` is the dotted path of the offending field, so the app has one error path.

Decisions the app relies on:

- **Unknown fields are rejected (400)**, not ignored as vLLM does: a misspelt ``temprature``
  silently sampling at T=1 is worse than a clear error. OpenAI fields this server does not
  implement (``tools``, ``best_of``, ``response_format``...) are unknown fields too.
  The engine's extras (``top_k``, ``min_p``... what the openai client sends via ``extra_body``)
  are top-level fields.
- **Types are strict**: ``"0.5"`` is not a number and ``true`` is not an integer.
- **One SamplingParams per choice**: the cluster serves n=1 per request, so
  ``sampling_params`` returns ``n=1`` and the app runs ``len(prompts) * req.n`` requests,
  choice ``prompt_i * n + j`` with ``choice_params(params, j)``: the request's seed (drawn by
  the app when the client gives none, and reported as the responses' top-level ``seed``) and
  choice index j, the key the engine itself gives sample j of an n > 1 request, so a seeded
  n=2 request draws the same texts through the cluster as through one engine.
- **Scoring a prompt** (completions): ``echo`` and vLLM's ``prompt_logprobs``
  (:class:`PromptReport`). The engine computes the prompt's logprobs in its prefill, the same
  way it computes a generated token's, so a token scored in a prompt has the bits it had when
  it was sampled. ``max_tokens: 0`` (only with ``echo``) scores the prompt alone: the engine
  still samples one token (it always does), which the app drops.
- **Finish reasons** are the engine's :class:`FinishReason` up to here; this module's
  :func:`openai_finish_reason` is the one place OpenAI's strings are made: an EOS, stop token
  or stop string is ``stop``; max tokens or the context limit ``length``; a deadline that passed
  mid-generation (the app answers 504 first, but a finished stream may carry it) and a
  cancellation report ``length``, the one OpenAI value that says "the text is cut short". Any
  other reason (an error, a rejection, a hand-off) must not reach a response: APIError(500).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
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

from engine.request import FinishReason
from engine.sampler import TokenLogprobs
from engine.sampling_params import InvalidSamplingParams, SamplingParams
from engine.tokenizer import Tokenizer

MAX_N = 16
MAX_STOP = 4
MAX_LOGPROBS = 20
# The longest timeout a request may ask for (seconds): a deadline further away is as good as
# none, and one past threading.TIMEOUT_MAX would overflow an engine's wait.
MAX_TIMEOUT_S = 86_400.0
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
# A logprob JSON cannot carry (-inf for a token the model gives no mass): vLLM's stand-in.
_MIN_LOGPROB = -9999.0

_ERROR_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


class ErrorInfo(BaseModel):
    model_config = ConfigDict(extra="forbid")

    message: str = Field(description="what was wrong, and the limit where one was passed")
    type: str = Field(description="the class of error, e.g. invalid_request_error")
    param: str | None = Field(description="the offending field's dotted path, or header")
    code: str | None = Field(description="a stable code a client may branch on")


class ErrorResponse(BaseModel):
    """OpenAI's error object: the body of every 4xx and 5xx answer."""

    model_config = ConfigDict(extra="forbid")

    error: ErrorInfo


class APIError(Exception):
    """An error the client sees as OpenAI's error object with this HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        default = "server_error" if status >= 500 else "invalid_request_error"
        self.type = type or _ERROR_TYPES.get(status, default)
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        """``Retry-After`` in whole seconds (RFC 9110), rounded up, when there is one."""
        if self.retry_after_s is None:
            return {}
        return {"Retry-After": str(max(1, math.ceil(self.retry_after_s)))}

    def body(self) -> dict[str, Any]:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()


def _bad(param: str | None, message: str) -> APIError:
    return APIError(400, message, param=param)


class _CrossFieldError(ValueError):
    """A model-level check failed; pydantic reports it without a field, so it carries one."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


# -- requests -------------------------------------------------------------------------------------


class _Strict(BaseModel):
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


class StreamOptions(_Strict):
    include_usage: bool = False


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant"]
    # a list of text parts arrives joined with "\n" (vLLM's convention)
    content: Annotated[str, _CONTENT_SCHEMA]
    name: str | None = None

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


class _SamplingFields(_Strict):
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
    stop_token_ids: Annotated[
        list[int] | None, WithJsonSchema({"anyOf": [_TOKEN_ID_LIST, {"type": "null"}]})
    ] = None
    include_stop_str_in_output: bool = False
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
    def _stream_options_need_stream(self) -> _SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise _CrossFieldError("stream_options", "only allowed when stream is true")
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
            raise _CrossFieldError(
                "max_tokens", "must be >= 1 (0 only with echo: the prompt scored alone)"
            )
        return self

    @property
    def prompt_report(self) -> PromptReport:
        return PromptReport(self.echo, self.logprobs, self.prompt_logprobs)

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

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise _CrossFieldError("top_logprobs", "requires logprobs to be true")
        return self


def parse_completion(body: bytes) -> CompletionRequest:
    """Raises: APIError(400) naming the field for anything the model rejects."""
    return _parse(CompletionRequest, body)


def parse_chat(body: bytes) -> ChatCompletionRequest:
    """Raises: APIError(400) naming the field for anything the model rejects."""
    return _parse(ChatCompletionRequest, body)


_M = TypeVar("_M", bound=BaseModel)


def _parse(model: type[_M], body: bytes) -> _M:
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
        return _bad(param, f"unknown field {param!r}: this server does not support it")
    if kind == "missing":
        return _bad(param, f"{param!r} is required")
    cause = err.get("ctx", {}).get("error")
    if isinstance(cause, _CrossFieldError):
        return _bad(cause.field, f"{cause.field!r}: {msg}")
    value = _short(err.get("input"))
    return _bad(param, f"invalid value for {param!r} ({value}): {msg}")


def _json_kind(value: Any) -> str:
    kinds = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    return kinds.get(type(value), "a number")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_model(model: str, served: Sequence[str]) -> None:
    """Raises: APIError(404, code model_not_found) unless ``model`` is one of ``served``."""
    if model not in served:
        raise APIError(
            404,
            f"the model {model!r} does not exist; this server serves {list(served)}",
            param="model",
            code="model_not_found",
        )


JSON_MEDIA_TYPE = "application/json"


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


def check_choices(num_prompts: int, n: int, max_choices: int) -> None:
    """A request runs ``num_prompts * n`` choices, each one request to the cluster.

    Raises: APIError(400, code too_many_choices) over ``max_choices``, naming ``prompt`` when
    the prompts alone are too many, else ``n``."""
    if num_prompts * n > max_choices:
        raise APIError(
            400,
            f"the request asks for {num_prompts * n} choices ({num_prompts} prompt(s) x n={n}); "
            f"this server runs at most {max_choices} per request (max_choices)",
            param="prompt" if num_prompts > max_choices else "n",
            code="too_many_choices",
        )


# -- translation to the engine --------------------------------------------------------------------


def sampling_params(
    req: CompletionRequest | ChatCompletionRequest, *, vocab_size: int, default_max_tokens: int
) -> SamplingParams:
    """The engine's parameters for ONE choice (``n=1``; see ``choice_params``).

    ``default_max_tokens`` applies when the request names none; the app should pass the room left
    in the context, and check ``prompt + max_tokens`` against the context itself.
    Raises: APIError(400) naming the field (token ids outside the vocabulary included)."""
    max_tokens = req.max_tokens
    if isinstance(req, ChatCompletionRequest):
        max_tokens = req.max_completion_tokens or max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        prompt_logprobs = None
    else:
        logprobs = req.logprobs
        prompt_logprobs = req.prompt_report.num_prompt_logprobs
    if max_tokens is None:
        max_tokens = default_max_tokens
    if req.min_tokens > max_tokens:
        raise _bad("min_tokens", f"min_tokens={req.min_tokens} exceeds max_tokens={max_tokens}")
    if req.top_k > vocab_size:
        raise _bad("top_k", f"top_k={req.top_k} is larger than the vocabulary ({vocab_size})")
    logit_bias = {int(k): v for k, v in (req.logit_bias or {}).items()}
    for field, ids in (("logit_bias", logit_bias), ("stop_token_ids", req.stop_token_ids or [])):
        for tid in ids:
            if tid >= vocab_size:
                raise _bad(field, f"token id {tid} is outside the vocabulary (size {vocab_size})")
    try:
        return SamplingParams(
            n=1,
            max_tokens=1 if req.max_tokens == 0 else max_tokens,  # 0: the prompt scored alone
            min_tokens=req.min_tokens,
            temperature=req.temperature,
            top_k=max(req.top_k, 0),
            top_p=req.top_p,
            min_p=req.min_p,
            typical_p=req.typical_p,
            repetition_penalty=req.repetition_penalty,
            frequency_penalty=req.frequency_penalty,
            presence_penalty=req.presence_penalty,
            logit_bias=logit_bias,
            seed=req.seed,
            stop=tuple(req.stop or ()),
            stop_token_ids=tuple(req.stop_token_ids or ()),
            include_stop_str_in_output=req.include_stop_str_in_output,
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )
    except InvalidSamplingParams as exc:  # e.g. default_max_tokens < 1: no room left
        field = str(exc).split("=", 1)[0]
        raise _bad(field, str(exc)) from None


def choice_params(params: SamplingParams, choice: int) -> SamplingParams:
    """The parameters of choice ``choice`` (0-based, within one prompt) of an n > 1 request:
    the same seed, drawing stream ``choice`` of it (docs/design.md#sampling-seeds), as the
    engine's own sample ``choice`` does, so the choices differ and each is reproducible."""
    return params if choice == 0 else replace(params, choice=choice)


def completion_prompts(req: CompletionRequest, tokenizer: Tokenizer) -> list[list[int]]:
    """Token ids of each prompt of the batch (text gets the tokenizer's BOS).

    Raises: APIError(400, param "prompt") for a token id outside the vocabulary or a prompt
    that encodes to nothing."""
    prompts = []
    for i, item in enumerate(req.prompt):
        ids = _encode(tokenizer, item, "prompt") if isinstance(item, str) else list(item)
        if not ids:
            raise _bad("prompt", f"prompt {i} encodes to no tokens")
        _check_vocab(ids, tokenizer.vocab_size, "prompt")
        prompts.append(ids)
    return prompts


def echo_texts(
    req: CompletionRequest, prompts: Sequence[Sequence[int]], tokenizer: Tokenizer
) -> list[str]:
    """What ``echo`` shows of each prompt: its text as sent, or its token ids decoded."""
    return [
        item if isinstance(item, str) else tokenizer.decode(ids)
        for item, ids in zip(req.prompt, prompts, strict=True)
    ]


def chat_prompt(req: ChatCompletionRequest, tokenizer: Tokenizer) -> list[int]:
    """Token ids of the conversation through the model's chat template, ending with the
    assistant's turn opened (``add_generation_prompt``).

    Raises: APIError(400, param "messages") if the template refuses the conversation (or the
    model has no template)."""
    messages = [m.model_dump(exclude_none=True) for m in req.messages]
    try:
        ids = tokenizer.encode_chat(messages, add_generation_prompt=True)
    except ValueError as exc:
        raise _bad("messages", str(exc)) from None
    _check_vocab(ids, tokenizer.vocab_size, "messages")
    return ids


def _encode(tokenizer: Tokenizer, text: str, param: str) -> list[int]:
    try:
        return tokenizer.encode(text)
    except ValueError as exc:
        raise _bad(param, str(exc)) from None


def _check_vocab(ids: Sequence[int], vocab_size: int, param: str) -> None:
    for tid in ids:
        if not 0 <= tid < vocab_size:
            raise _bad(param, f"token id {tid} is outside the vocabulary (size {vocab_size})")


# -- responses ------------------------------------------------------------------------------------

_OPENAI_FINISH_REASONS = {
    FinishReason.EOS: "stop",
    FinishReason.STOP_TOKEN: "stop",
    FinishReason.STOP_STRING: "stop",
    FinishReason.MAX_TOKENS: "length",
    FinishReason.CONTEXT_LIMIT: "length",
    FinishReason.DEADLINE: "length",
    FinishReason.CANCELLED: "length",
}


def openai_finish_reason(reason: FinishReason) -> str:
    """OpenAI's ``finish_reason`` for the engine's (see the module docstring).

    Raises: APIError(500) for a reason that must not reach a client (an error...)."""
    try:
        return _OPENAI_FINISH_REASONS[reason]
    except KeyError:
        raise APIError(500, f"the request ended with finish_reason={reason.value!r}") from None


@dataclass(frozen=True)
class ResponseMeta:
    """What every object of one response shares: ``id`` (``cmpl-...`` / ``chatcmpl-...``),
    the model id the client asked for, the Unix time of creation and the seed the choices drew
    from (an extra top-level ``seed``, when known: resending it reproduces the response)."""

    id: str
    model: str
    created: int
    seed: int | None = None


def _head(meta: ResponseMeta, object: str) -> dict[str, Any]:
    """The leading fields of every object of one response."""
    head: dict[str, Any] = {
        "id": meta.id,
        "object": object,
        "created": meta.created,
        "model": meta.model,
    }
    if meta.seed is not None:
        head["seed"] = meta.seed
    return head


@dataclass(frozen=True)
class PromptReport:
    """What each choice of a completions request reports of its prompt. ``echo``: the prompt's
    text leads the choice's text and, with ``logprobs``, its tokens lead the ``logprobs``
    object (the first token's logprob and top_logprobs null: nothing predicts it), OpenAI's
    legacy scoring. ``prompt_logprobs``: vLLM's extra choice field of that name."""

    echo: bool = False
    logprobs: int | None = None  # the request's: the alternatives an echoed token shows
    prompt_logprobs: int | None = None

    @property
    def num_prompt_logprobs(self) -> int | None:
        """The alternatives the engine computes per prompt token (both fields' most)."""
        wanted = [self.prompt_logprobs, self.logprobs if self.echo else None]
        return max((k for k in wanted if k is not None), default=None)


@dataclass(frozen=True)
class Prompt:
    """One choice's prompt, for what a :class:`PromptReport` shows of it."""

    text: str  # what echo shows: the request's prompt text, or its token ids decoded
    token_ids: Sequence[int]
    logprobs: Sequence[TokenLogprobs | None] | None = None  # the engine's, when computed


@dataclass(frozen=True)
class Choice:
    """One finished choice, gathered by the app from the cluster's deltas."""

    index: int
    text: str
    token_ids: Sequence[int]
    finish_reason: FinishReason
    logprobs: Sequence[TokenLogprobs] | None = None
    prompt: Prompt | None = None  # completions: what ``report`` shows of it leads the choice


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """``prompt_tokens`` counts each prompt once, whatever ``n`` (OpenAI's and vLLM's way)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_response(
    meta: ResponseMeta,
    choices: Sequence[Choice],
    *,
    prompt_tokens: int,
    tokenizer: Tokenizer,
    report: PromptReport = PromptReport(),
) -> dict[str, Any]:
    """The non-streaming ``text_completion`` object."""
    return {
        **_head(meta, "text_completion"),
        "choices": [
            {
                "index": c.index,
                **completion_fields(tokenizer, report, c.prompt, c.text, c.token_ids, c.logprobs),
                "finish_reason": openai_finish_reason(c.finish_reason),
            }
            for c in sorted(choices, key=lambda c: c.index)
        ],
        "usage": usage(prompt_tokens, sum(len(c.token_ids) for c in choices)),
    }


def chat_response(
    meta: ResponseMeta, choices: Sequence[Choice], *, prompt_tokens: int, tokenizer: Tokenizer
) -> dict[str, Any]:
    """The non-streaming ``chat.completion`` object."""
    return {
        **_head(meta, "chat.completion"),
        "choices": [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": None
                if c.logprobs is None
                else chat_logprobs(tokenizer, c.token_ids, c.logprobs),
                "finish_reason": openai_finish_reason(c.finish_reason),
            }
            for c in sorted(choices, key=lambda c: c.index)
        ],
        "usage": usage(prompt_tokens, sum(len(c.token_ids) for c in choices)),
    }


def completion_chunk(
    meta: ResponseMeta,
    index: int,
    text: str,
    *,
    finish_reason: FinishReason | None = None,
    logprobs: dict[str, Any] | None = None,
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None,
) -> dict[str, Any]:
    """One streamed ``text_completion`` chunk: a text delta, the last one with its
    ``finish_reason`` (the engine's); ``logprobs`` from ``completion_logprobs``; a choice's first
    chunk carries what it reports of its prompt (``completion_fields``)."""
    choice: dict[str, Any] = {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": None if finish_reason is None else openai_finish_reason(finish_reason),
    }
    if prompt_logprobs is not None:
        choice["prompt_logprobs"] = prompt_logprobs
    return {**_head(meta, "text_completion"), "choices": [choice]}


def chat_chunk(
    meta: ResponseMeta,
    index: int,
    *,
    role: bool = False,
    content: str | None = None,
    finish_reason: FinishReason | None = None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One ``chat.completion.chunk``. A choice's stream is: a first chunk with ``role=True``
    (delta ``{"role": "assistant", "content": ""}``), content chunks, then a chunk with only
    the ``finish_reason`` (the engine's) and an empty delta, as OpenAI sends it."""
    delta: dict[str, Any] = {}
    if role:
        delta = {"role": "assistant", "content": content or ""}
    elif content is not None:
        delta = {"content": content}
    return {
        **_head(meta, "chat.completion.chunk"),
        "choices": [
            {
                "index": index,
                "delta": delta,
                "logprobs": logprobs,
                "finish_reason": None
                if finish_reason is None
                else openai_finish_reason(finish_reason),
            }
        ],
    }


def usage_chunk(
    meta: ResponseMeta,
    object: Literal["text_completion", "chat.completion.chunk"],
    *,
    prompt_tokens: int,
    completion_tokens: int,
) -> dict[str, Any]:
    """The last chunk of a stream with ``include_usage``: no choices, the whole request's usage."""
    return {
        **_head(meta, object),
        "choices": [],
        "usage": usage(prompt_tokens, completion_tokens),
    }


def models_response(model_ids: Sequence[str], *, created: int = 0) -> dict[str, Any]:
    """``GET /v1/models``."""
    return {
        "object": "list",
        "data": [
            {"id": m, "object": "model", "created": created, "owned_by": "tandem"}
            for m in model_ids
        ],
    }


# -- logprobs -------------------------------------------------------------------------------------


def token_bytes(tokenizer: Tokenizer, token_id: int) -> bytes:
    """The bytes ``token_id`` adds to the output text.

    A token alone may decode without its leading space (SentencePiece's Strip decoder) or to
    U+FFFD (part of a UTF-8 character), so: byte-fallback tokens are their byte; other tokens
    are decoded after an anchor token and the anchor's text cut off; byte-level BPE pieces of a
    character are mapped back through the GPT-2 byte alphabet."""
    piece = tokenizer.id_to_token(token_id)
    if piece is None:
        return b""
    if token_id in tokenizer.byte_token_ids:
        return bytes([int(piece[3:5], 16)])
    if token_id in tokenizer.special_token_ids:
        return piece.encode()
    anchor = min(tokenizer.special_token_ids, default=None)
    if anchor is None:
        text = tokenizer.decode([token_id], skip_special_tokens=False)
    else:
        prefix = tokenizer.decode([anchor], skip_special_tokens=False)
        text = tokenizer.decode([anchor, token_id], skip_special_tokens=False)
        text = text.removeprefix(prefix)
    if "\ufffd" in text and "\ufffd" not in piece and all(ch in _UNICODE_TO_BYTE for ch in piece):
        return bytes(_UNICODE_TO_BYTE[ch] for ch in piece)
    return text.encode()


def token_string(raw: bytes) -> str:
    """A token's text for the ``token`` fields: its UTF-8 text, or ``bytes:\\xe6\\x97`` for
    part of a character (OpenAI's form)."""
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def completion_fields(
    tokenizer: Tokenizer,
    report: PromptReport,
    prompt: Prompt | None,
    text: str,
    token_ids: Sequence[int],
    logprobs: Sequence[TokenLogprobs] | None,
) -> dict[str, Any]:
    """A completions choice's ``text``, ``logprobs`` (None unless asked) and, when asked,
    ``prompt_logprobs``, with ``prompt`` leading them as ``report`` asks: for the whole choice,
    or a stream's first chunk (``logprobs`` of the tokens it holds)."""
    fields: dict[str, Any] = {"text": text, "logprobs": None}
    ids: Sequence[int] = token_ids
    shown: Sequence[TokenLogprobs | None] | None = logprobs
    if prompt is not None and report.echo:
        fields["text"] = prompt.text + text
        if logprobs is not None:
            ids, shown = [*prompt.token_ids, *token_ids], [*(prompt.logprobs or ()), *logprobs]
    if shown is not None:
        fields["logprobs"] = completion_logprobs(tokenizer, ids, shown, num_top=report.logprobs)
    if prompt is not None and report.prompt_logprobs is not None:
        fields["prompt_logprobs"] = prompt_logprobs(
            tokenizer, prompt.token_ids, prompt.logprobs or (), report.prompt_logprobs
        )
    return fields


def completion_logprobs(
    tokenizer: Tokenizer,
    token_ids: Sequence[int],
    logprobs: Sequence[TokenLogprobs | None],
    *,
    text_offset: int = 0,
    num_top: int | None = None,
) -> dict[str, Any]:
    """Completions' ``{tokens, token_logprobs, top_logprobs, text_offset}``.

    ``top_logprobs`` also holds the sampled token (OpenAI returns up to logprobs + 1), of the
    ``num_top`` most likely (default: as many as computed). A None entry (an echoed prompt's
    first token) has null ``token_logprobs`` and ``top_logprobs``. ``text_offset`` is where the
    first token starts in the choice's text; a stream passes the length of the text it has sent
    so far."""
    tokens: list[str] = []
    offsets: list[int] = []
    values: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    for tid, lp in zip(token_ids, logprobs, strict=True):
        token = token_string(token_bytes(tokenizer, tid))
        offsets.append(text_offset)
        text_offset += len(token)
        tokens.append(token)
        if lp is None:
            values.append(None)
            tops.append(None)
            continue
        top = {token_string(token_bytes(tokenizer, t)): _finite(v) for t, v in lp.top[:num_top]}
        top.setdefault(token, _finite(lp.logprob))
        values.append(_finite(lp.logprob))
        tops.append(top)
    return {
        "tokens": tokens,
        "token_logprobs": values,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def prompt_logprobs(
    tokenizer: Tokenizer,
    token_ids: Sequence[int],
    logprobs: Sequence[TokenLogprobs | None],
    num_top: int,
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs``: per prompt token, None for the first (nothing predicts it),
    else ``{token id: {"logprob", "rank", "decoded_token"}}`` (ids as JSON keys are strings):
    the prompt token first, with its rank among all tokens, then its position's ``num_top`` most
    likely, ranks 1.. (the prompt token among them keeps its one entry)."""
    out: list[dict[str, dict[str, Any]] | None] = []
    for tid, lp in zip(token_ids, logprobs, strict=True):
        if lp is None:
            out.append(None)
            continue
        ranked = [(tid, lp.logprob, lp.rank)]
        ranked += [(t, v, rank) for rank, (t, v) in enumerate(lp.top[:num_top], 1)]
        out.append(
            {
                str(t): {
                    "logprob": _finite(v),
                    "rank": rank,
                    "decoded_token": token_string(token_bytes(tokenizer, t)),
                }
                for t, v, rank in ranked
            }
        )
    return out


def chat_logprobs(
    tokenizer: Tokenizer, token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs]
) -> dict[str, Any]:
    """Chat's ``{content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}``."""
    content = []
    for tid, lp in zip(token_ids, logprobs, strict=True):
        entry = _chat_token(tokenizer, tid, lp.logprob)
        entry["top_logprobs"] = [_chat_token(tokenizer, t, v) for t, v in lp.top]
        content.append(entry)
    return {"content": content}


def _chat_token(tokenizer: Tokenizer, token_id: int, logprob: float) -> dict[str, Any]:
    raw = token_bytes(tokenizer, token_id)
    return {"token": token_string(raw), "logprob": _finite(logprob), "bytes": list(raw)}


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else _MIN_LOGPROB


def _gpt2_byte_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte: printable Latin-1 as itself, the
    rest shifted to U+0100 onward in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in printable}
    shifted = (b for b in range(256) if b not in set(printable))
    for i, b in enumerate(shifted):
        table[chr(0x100 + i)] = b
    return table


_UNICODE_TO_BYTE = _gpt2_byte_alphabet()


# -- server-sent events ---------------------------------------------------------------------------

SSE_DONE = b"data: [DONE]\n\n"


def sse(obj: Mapping[str, Any]) -> bytes:
    """One server-sent event: ``data: {json}\\n\\n`` (compact, UTF-8, no NaN)."""
    data = json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return b"data: " + data.encode() + b"\n\n"
