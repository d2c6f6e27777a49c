"""A request body's translation into what the cluster runs (a :class:`Job`): the prompts
(the chat template, token ids checked against the vocabulary), one sampling parameters per
choice with its seed, and the checks against the served model (its name, its context, the
choices a request may ask for). No I/O.

- **One SamplingParams per choice**: the cluster serves n=1 per request, so
  ``sampling_params`` returns ``n=1`` and the app runs ``len(prompts) * req.n`` requests,
  choice ``prompt_i * n + j`` with ``choice_params(params, j)``: the request's seed (drawn
  here when the client gives none, and reported as the responses' top-level ``seed``) and
  choice index j, the key the engine itself gives sample j of an n > 1 request, so a seeded
  n=2 request draws the same texts through the cluster as through one engine.
- **Scoring a prompt** (completions): ``echo`` and vLLM's ``prompt_logprobs``
  (:class:`~api.protocol.PromptReport`). The engine computes the prompt's logprobs in its
  prefill, the same way it computes a generated token's, so a token scored in a prompt has the
  bits it had when it was sampled. ``max_tokens: 0`` (only with ``echo``) scores the prompt
  alone: the engine still samples one token (it always does), which the app drops.
"""

from __future__ import annotations

import json
import math
import secrets
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from api.errors import APIError, bad_request
from api.protocol import (
    MAX_TIMEOUT_S,
    ChatCompletionRequest,
    CompletionRequest,
    JSONObjectFormat,
    JSONSchemaResponseFormat,
    NamedToolChoice,
    PromptReport,
    check_content_type,
    parse_chat,
    parse_completion,
)
from api.responses import ResponseMeta
from api.responses_api import ResponsesRequest, chat_request, new_response_id, parse_responses
from api.tools import tool_call_grammar
from engine.sampling_params import Constraint, InvalidSamplingParams, SamplingParams
from engine.structured import InvalidConstraint, compile_grammar
from engine.tokenizer import Tokenizer

# A client may ask for a shorter timeout than the topology's deadline (seconds, a float).
TIMEOUT_HEADER = "X-Request-Timeout"
Kind = Literal["completion", "chat", "responses"]
_NO_REPORT = PromptReport()  # chat, and completions that ask for nothing of their prompt


def new_request_id(kind: Kind) -> str:
    """A response's ``id`` (``cmpl-...`` / ``chatcmpl-...`` / ``resp_...``), which its log
    lines carry too."""
    if kind == "responses":
        return new_response_id()
    prefix = "chatcmpl" if kind == "chat" else "cmpl"
    return f"{prefix}-{uuid.uuid4().hex}"


@dataclass(frozen=True)
class Job:
    """A parsed, admitted request: its choices' prompts and parameters."""

    meta: ResponseMeta
    chat: bool
    prompts: list[list[int]]  # one per choice (prompt i's choices are i*n .. i*n + n - 1)
    params: list[SamplingParams]  # one per choice
    prompt_tokens: int  # each prompt counted once, whatever n
    stream: bool
    include_usage: bool
    logprobs: bool
    tenant: str
    deadline: float | None
    arrival: float
    priority: int
    # Completions: what each choice reports of its prompt, and the text echo shows of it.
    report: PromptReport = _NO_REPORT
    prompt_texts: list[str] = field(default_factory=list)  # one per choice, with echo
    score_only: bool = False  # max_tokens 0 (echo): drop the one token the engine samples
    tool_calls: bool = False  # chat with tools: the text is parsed into tool calls
    responses: ResponsesRequest | None = None  # /v1/responses: the request as the client sent it


@dataclass(frozen=True)
class Translator:
    """Turns a body into a :class:`Job` for the model one ingress replica serves."""

    tokenizer: Tokenizer
    model_name: str
    max_model_len: int
    vocab_size: int
    max_choices: int
    request_timeout_s: float | None  # the topology's deadline (retry.deadline_s), if any

    def job(
        self,
        request_id: str,
        body: bytes,
        kind: Kind,
        tenant: str,
        arrival: float,
        headers: Mapping[str, str],
    ) -> Job:
        """Raises: APIError (4xx) naming the field, header or limit that refuses the request."""
        check_content_type(headers.get("content-type"))
        report, texts = _NO_REPORT, []
        responses = parse_responses(body) if kind == "responses" else None
        if kind != "completion":
            req: Any = parse_chat(body) if responses is None else chat_request(responses)
            check_model(req.model, [self.model_name])
            check_choices(1, req.n, self.max_choices)
            prompts = [chat_prompt(req, self.tokenizer)]
            report = PromptReport(token_ids=req.return_tokens_as_token_ids)
        else:
            req = parse_completion(body)
            check_model(req.model, [self.model_name])
            check_choices(len(req.prompt), req.n, self.max_choices)
            prompts = completion_prompts(req, self.tokenizer)
            report = req.prompt_report
            if report.echo:
                texts = echo_texts(req, prompts, self.tokenizer)
        timeout_s = self.timeout(headers.get(TIMEOUT_HEADER), req.timeout)
        base = self._base_params(req, prompts)
        choice_prompts, params = [], []
        for p in prompts:
            for i in range(req.n):
                choice_prompts.append(p)
                params.append(choice_params(base, i))
        return Job(
            meta=ResponseMeta(request_id, req.model, int(arrival), seed=base.seed),
            chat=kind != "completion",
            prompts=choice_prompts,
            params=params,
            prompt_tokens=sum(len(p) for p in prompts),
            stream=bool(req.stream),
            include_usage=req.include_usage,
            logprobs=base.logprobs is not None,
            tenant=tenant,
            deadline=None if timeout_s is None else arrival + timeout_s,
            arrival=arrival,
            priority=req.priority,
            report=report,
            prompt_texts=[t for t in texts for _ in range(req.n)],
            score_only=report.echo and req.max_tokens == 0,
            tool_calls=kind != "completion" and req.tool_mode != "none",
            responses=responses,
        )

    def _base_params(
        self, req: CompletionRequest | ChatCompletionRequest, prompts: list[list[int]]
    ) -> SamplingParams:
        """The parameters every choice shares, with the seed they all draw from.

        Raises: APIError(400, code context_length_exceeded) for a prompt and ``max_tokens``
        over the model's context."""
        longest = max(len(p) for p in prompts)
        default_max = max(self.max_model_len - longest, 1)
        base = sampling_params(req, vocab_size=self.vocab_size, default_max_tokens=default_max)
        if base.seed is None:  # drawn once here: every choice and every retry shares it
            base = replace(base, seed=secrets.randbits(63))
        for p in prompts:
            if len(p) + base.max_tokens > self.max_model_len:
                raise APIError(
                    400,
                    f"this model's maximum context length is {self.max_model_len} tokens; the "
                    f"request asks for {len(p)} prompt + {base.max_tokens} output tokens",
                    param="max_tokens" if len(p) < self.max_model_len else "prompt",
                    code="context_length_exceeded",
                )
        return base

    def timeout(self, header: str | None, field: float | None) -> float | None:
        """The request's timeout in seconds (None: no deadline): the topology's default
        (``retry.deadline_s``; none unless set), which the ``X-Request-Timeout`` header or
        the body's ``timeout`` may shorten, never lengthen (the shorter of the two wins), nor
        set past ``protocol.MAX_TIMEOUT_S``."""
        limit = self.request_timeout_s
        asked: dict[str, float] = {} if field is None else {"timeout": field}
        if header is not None:
            try:
                value = float(header)
            except ValueError:
                value = math.nan
            if not 0 < value < math.inf:
                raise APIError(
                    400,
                    f"{TIMEOUT_HEADER}: {header!r} is not a positive number of seconds",
                    param=TIMEOUT_HEADER,
                    code="invalid_timeout",
                )
            asked[TIMEOUT_HEADER] = value
        cap = min(math.inf if limit is None else limit, MAX_TIMEOUT_S)
        for param, value in asked.items():
            if value > cap:
                raise APIError(
                    400,
                    f"{param}: {value:g} s is longer than this server's limit of {cap:g} s",
                    param=param,
                    code="invalid_timeout",
                )
        return min(asked.values(), default=limit)


# -- checks against the served model --------------------------------------------------------------


def check_model(model: str, served: Sequence[str]) -> None:
    """Raises: APIError(404, code model_not_found) unless ``model`` is one of ``served``."""
    if model not in served:
        raise APIError(
            404,
            f"the model {model!r} does not exist; this server serves {list(served)}",
            param="model",
            code="model_not_found",
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


# -- the engine's parameters and prompts --------------------------------------------------------


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
        raise bad_request(
            "min_tokens", f"min_tokens={req.min_tokens} exceeds max_tokens={max_tokens}"
        )
    if req.top_k > vocab_size:
        raise bad_request(
            "top_k", f"top_k={req.top_k} is larger than the vocabulary ({vocab_size})"
        )
    logit_bias = {int(k): v for k, v in (req.logit_bias or {}).items()}
    for name, ids in (("logit_bias", logit_bias), ("stop_token_ids", req.stop_token_ids or [])):
        for tid in ids:
            if tid >= vocab_size:
                raise bad_request(
                    name, f"token id {tid} is outside the vocabulary (size {vocab_size})"
                )
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
            constraint=constraint_of(req),
        )
    except InvalidSamplingParams as exc:  # e.g. default_max_tokens < 1: no room left
        raise bad_request(exc.field, str(exc)) from None


def constraint_of(req: CompletionRequest | ChatCompletionRequest) -> Constraint | None:
    """The grammar ``response_format`` or ``structured_outputs`` asks the output to match,
    checked here, so a schema, regex or grammar the engine cannot use is a 400 naming it
    (docs/design.md#structured-outputs)."""
    if isinstance(req, ChatCompletionRequest) and req.tools:
        tools = tool_constraint(req)
        if tools is not None:
            return tools
    fmt, so = req.response_format, req.structured_outputs
    if isinstance(fmt, JSONObjectFormat):
        return Constraint.json_object()  # always valid
    if isinstance(fmt, JSONSchemaResponseFormat):
        field = "response_format.json_schema.schema"
        constraint = Constraint("json_schema", json.dumps(fmt.json_schema.json_schema))
    elif so is None:
        return None
    elif so.json_schema is not None:
        field = "structured_outputs.json"
        spec = so.json_schema
        constraint = Constraint("json_schema", spec if isinstance(spec, str) else json.dumps(spec))
    elif so.regex is not None:
        field, constraint = "structured_outputs.regex", Constraint("regex", so.regex)
    elif so.choice is not None:
        field, constraint = "structured_outputs.choice", Constraint.choice(so.choice)
    else:
        assert so.grammar is not None  # StructuredOutputs holds exactly one
        field, constraint = "structured_outputs.grammar", Constraint("grammar", so.grammar)
    try:
        compile_grammar(constraint)
    except InvalidConstraint as exc:
        raise bad_request(field, str(exc)) from None
    return constraint


def tool_constraint(req: ChatCompletionRequest) -> Constraint | None:
    """The grammar of a ``required`` or named tool choice, or of ``auto`` with a ``strict``
    tool (None for ``none``, and ``auto`` without), after checking every tool's ``parameters``
    schema: one the grammar engine cannot use is a 400 naming it
    (docs/design.md#tool-calling)."""
    tools = req.tools or []
    functions = [t.function.model_dump(exclude_none=True) for t in tools]
    for i, f in enumerate(functions):
        if "parameters" in f:
            try:
                compile_grammar(Constraint("json_schema", json.dumps(f["parameters"])))
            except InvalidConstraint as exc:
                raise bad_request(f"tools.{i}.function.parameters", str(exc)) from None
    parallel = req.parallel_tool_calls is not False
    mode = req.tool_mode
    if mode == "named":
        assert isinstance(req.tool_choice, NamedToolChoice)
        named = [f for f in functions if f["name"] == req.tool_choice.function.name]
        return tool_call_grammar(named, parallel)
    if mode == "required":
        return tool_call_grammar(functions, parallel)
    if mode == "auto" and any(t.function.strict for t in tools):
        # OpenAI's strict: a strict function's calls match its schema; the others' any object
        held = [
            f if t.function.strict else f | {"parameters": None}
            for t, f in zip(tools, functions, strict=True)
        ]
        return tool_call_grammar(held, parallel, forced=False)
    return None


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
            raise bad_request("prompt", f"prompt {i} encodes to no tokens")
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
    assistant's turn opened (``add_generation_prompt``), the tools offered unless
    ``tool_choice`` is ``none``.

    Raises: APIError(400, param "messages") if the template refuses the conversation (or the
    model has no template)."""
    messages = [m.model_dump(exclude_none=True) for m in req.messages]
    for i, message in enumerate(messages):  # a template reads arguments as JSON, not text
        if "tool_calls" in message:
            message.setdefault("content", None)
        for j, call in enumerate(message.get("tool_calls", ())):
            function = call["function"]
            try:
                function["arguments"] = json.loads(function["arguments"])
            except json.JSONDecodeError as exc:
                param = f"messages.{i}.tool_calls.{j}.function.arguments"
                raise bad_request(param, f"{param!r} is not JSON: {exc}") from None
    tools = None
    if req.tools and req.tool_mode != "none":
        tools = [t.model_dump(exclude_none=True) for t in req.tools]
    try:
        ids = tokenizer.encode_chat(messages, add_generation_prompt=True, tools=tools)
    except ValueError as exc:
        raise bad_request("messages", str(exc)) from None
    _check_vocab(ids, tokenizer.vocab_size, "messages")
    return ids


def _encode(tokenizer: Tokenizer, text: str, param: str) -> list[int]:
    try:
        return tokenizer.encode(text)
    except ValueError as exc:
        raise bad_request(param, str(exc)) from None


def _check_vocab(ids: Sequence[int], vocab_size: int, param: str) -> None:
    for tid in ids:
        if not 0 <= tid < vocab_size:
            raise bad_request(
                param, f"token id {tid} is outside the vocabulary (size {vocab_size})"
            )
