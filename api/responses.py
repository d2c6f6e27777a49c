"""What the edge sends back: OpenAI's response and chunk objects, logprobs objects, usage and
the server-sent events that carry a stream. Pure functions of finished choices and deltas.

**Finish reasons** are the engine's :class:`FinishReason` up to here; this module's
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
from dataclasses import dataclass
from typing import Any, Literal

from api.errors import APIError
from api.protocol import PromptReport
from api.tools import ToolCallDelta, ToolCalls
from engine.outputs import TokenDelta, TokenLogprobs
from engine.request import FinishReason
from engine.tokenizer import Tokenizer, token_bytes, token_string

# A logprob JSON cannot carry (-inf for a token the model gives no mass): vLLM's stand-in.
_MIN_LOGPROB = -9999.0
_NO_REPORT = PromptReport()  # chat, and completions that ask for nothing of their prompt

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
class Prompt:
    """One choice's prompt, for what a :class:`PromptReport` shows of it."""

    text: str  # what echo shows: the request's prompt text, or its token ids decoded
    token_ids: Sequence[int]
    logprobs: Sequence[TokenLogprobs | None] | None = None  # the engine's, when computed


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """``prompt_tokens`` counts each prompt once, whatever ``n`` (OpenAI's and vLLM's way)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_response(
    meta: ResponseMeta,
    choices: Sequence[TokenDelta],
    *,
    prompt_tokens: int,
    tokenizer: Tokenizer,
    report: PromptReport = _NO_REPORT,
    prompts: Sequence[Prompt] = (),
) -> dict[str, Any]:
    """The non-streaming ``text_completion`` object. ``choices``: each choice's deltas gathered
    into one (``TokenDelta.then``), its ``index`` the choice's; ``prompts``: by choice index,
    what ``report`` shows of each leads it."""
    return {
        **_head(meta, "text_completion"),
        "choices": [
            {
                "index": c.index,
                **completion_fields(
                    tokenizer,
                    report,
                    prompts[c.index] if prompts else None,
                    c.text,
                    c.token_ids,
                    c.logprobs,
                ),
                "finish_reason": _finish(c),
            }
            for c in sorted(choices, key=lambda c: c.index)
        ],
        "usage": usage(prompt_tokens, sum(len(c.token_ids) for c in choices)),
    }


def chat_response(
    meta: ResponseMeta,
    choices: Sequence[TokenDelta],
    *,
    prompt_tokens: int,
    tokenizer: Tokenizer,
    report: PromptReport = _NO_REPORT,
    tool_calls: bool = False,
) -> dict[str, Any]:
    """The non-streaming ``chat.completion`` object (``choices`` as in completion_response);
    ``tool_calls``: each choice's text is parsed into content and calls (api/tools.py)."""
    return {
        **_head(meta, "chat.completion"),
        "choices": [
            {
                "index": c.index,
                **_message(c, tool_calls),
                "logprobs": None
                if c.logprobs is None
                else chat_logprobs(tokenizer, c.token_ids, c.logprobs, as_ids=report.token_ids),
            }
            for c in sorted(choices, key=lambda c: c.index)
        ],
        "usage": usage(prompt_tokens, sum(len(c.token_ids) for c in choices)),
    }


def _message(choice: TokenDelta, tool_calls: bool) -> dict[str, Any]:
    """A chat choice's ``message`` and ``finish_reason``: with calls, the content before them
    (null when there is none) and ``tool_calls``."""
    reason = choice.finish_reason or FinishReason.MAX_TOKENS
    parsed = ToolCalls.of(choice.text) if tool_calls else None
    message: dict[str, Any] = {"role": "assistant", "content": choice.text}
    if parsed is not None and parsed.calls:
        message.update(content=parsed.content or None, tool_calls=parsed.calls)
    called = "tool_calls" in message
    return {"message": message, "finish_reason": chat_finish_reason(reason, called)}


def chat_finish_reason(reason: FinishReason, called: bool) -> str:
    """A chat choice's ``finish_reason``: ``tool_calls`` for one that made calls and stopped."""
    finish = openai_finish_reason(reason)
    return "tool_calls" if called and finish == "stop" else finish


def _finish(choice: TokenDelta) -> str:
    """A finished choice's ``finish_reason``; one that came without any ran out of tokens."""
    return openai_finish_reason(choice.finish_reason or FinishReason.MAX_TOKENS)


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
    tool_calls: Sequence[ToolCallDelta] = (),
    called: bool = False,
) -> dict[str, Any]:
    """One ``chat.completion.chunk``. A choice's stream is: a first chunk with ``role=True``
    (delta ``{"role": "assistant", "content": ""}``), chunks of content and of tool calls,
    then a chunk with only the ``finish_reason`` (the engine's; ``called``: the choice made
    calls) and an empty delta, as OpenAI sends it."""
    delta: dict[str, Any] = {}
    if role:
        delta = {"role": "assistant", "content": content or ""}
    elif content is not None:
        delta = {"content": content}
    if tool_calls:
        delta["tool_calls"] = [d.chunk() for d in tool_calls]
    return {
        **_head(meta, "chat.completion.chunk"),
        "choices": [
            {
                "index": index,
                "delta": delta,
                "logprobs": logprobs,
                "finish_reason": None
                if finish_reason is None
                else chat_finish_reason(finish_reason, called),
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
        fields["logprobs"] = completion_logprobs(
            tokenizer, ids, shown, num_top=report.logprobs, as_ids=report.token_ids
        )
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
    as_ids: bool = False,
) -> dict[str, Any]:
    """Completions' ``{tokens, token_logprobs, top_logprobs, text_offset}``.

    ``top_logprobs`` also holds the sampled token (OpenAI returns up to logprobs + 1), of the
    ``num_top`` most likely (default: as many as computed). A None entry (an echoed prompt's
    first token) has null ``token_logprobs`` and ``top_logprobs``. ``text_offset`` is where the
    first token starts in the choice's text; a stream passes the length of the text it has sent
    so far. ``as_ids``: tokens are named ``token_id:N`` (return_tokens_as_token_ids); offsets
    still count their text."""
    tokens: list[str] = []
    offsets: list[int] = []
    values: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    for tid, lp in zip(token_ids, logprobs, strict=True):
        text = token_string(token_bytes(tokenizer, tid))
        token = token_name(tokenizer, tid, as_ids)
        offsets.append(text_offset)
        text_offset += len(text)
        tokens.append(token)
        if lp is None:
            values.append(None)
            tops.append(None)
            continue
        top = {token_name(tokenizer, t, as_ids): _finite(v) for t, v in lp.top[:num_top]}
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
    tokenizer: Tokenizer,
    token_ids: Sequence[int],
    logprobs: Sequence[TokenLogprobs],
    as_ids: bool = False,
) -> dict[str, Any]:
    """Chat's ``{content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}``
    (``as_ids``: each ``token`` named ``token_id:N``; ``bytes`` stay the token's)."""
    content = []
    for tid, lp in zip(token_ids, logprobs, strict=True):
        entry = _chat_token(tokenizer, tid, lp.logprob, as_ids)
        entry["top_logprobs"] = [_chat_token(tokenizer, t, v, as_ids) for t, v in lp.top]
        content.append(entry)
    return {"content": content}


def _chat_token(
    tokenizer: Tokenizer, token_id: int, logprob: float, as_ids: bool
) -> dict[str, Any]:
    raw = token_bytes(tokenizer, token_id)
    name = token_name(tokenizer, token_id, as_ids)
    return {"token": name, "logprob": _finite(logprob), "bytes": list(raw)}


def token_name(tokenizer: Tokenizer, token_id: int, as_ids: bool) -> str:
    """How logprobs name a token: its text, or ``token_id:N`` (vLLM's
    ``return_tokens_as_token_ids``)."""
    return f"token_id:{token_id}" if as_ids else token_string(token_bytes(tokenizer, token_id))


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else _MIN_LOGPROB


# -- server-sent events ---------------------------------------------------------------------------

SSE_DONE = b"data: [DONE]\n\n"


def sse(obj: Mapping[str, Any]) -> bytes:
    """One server-sent event: ``data: {json}\\n\\n`` (compact, UTF-8, no NaN)."""
    data = json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return b"data: " + data.encode() + b"\n\n"
