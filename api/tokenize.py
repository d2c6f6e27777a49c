"""vLLM's ``POST /tokenize`` and ``POST /detokenize``: the served model's tokenizer and chat
template over HTTP, so a client counts a prompt's tokens (or renders a conversation) exactly as
the server will, without loading the tokenizer itself. No I/O, no cluster."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from api.errors import bad_request
from api.protocol import ChatMessage, CrossFieldError, StrictModel, ToolDefinition, parse_body
from api.translate import check_model
from engine.tokenizer import Tokenizer, token_bytes, token_string


class TokenizeRequest(StrictModel):
    """A text (``prompt``) or a conversation (``messages``, through the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    tools: list[ToolDefinition] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool | None = Field(
        default=None, description="the BOS and such; default: for a prompt, not for messages"
    )
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise CrossFieldError("prompt", "give prompt or messages, one of them")
        return self


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[int]


def tokenize(body: bytes, tokenizer: Tokenizer, model: str, max_model_len: int) -> dict[str, Any]:
    """``{count, max_model_len, tokens, token_strs}`` (vLLM's shape).

    Raises: APIError (400 naming the field; 404 for another model)."""
    req = parse_body(TokenizeRequest, body)
    if req.model is not None:
        check_model(req.model, [model])
    try:
        if req.messages is not None:
            messages = [m.model_dump(exclude_none=True) for m in req.messages]
            tools = [t.model_dump(exclude_none=True) for t in req.tools or ()]
            text = tokenizer.apply_chat_template(messages, req.add_generation_prompt, tools)
            ids = tokenizer.encode(text, add_special_tokens=bool(req.add_special_tokens))
        else:
            assert req.prompt is not None
            add = True if req.add_special_tokens is None else req.add_special_tokens
            ids = tokenizer.encode(req.prompt, add_special_tokens=add)
    except ValueError as exc:
        raise bad_request("messages" if req.messages else "prompt", str(exc)) from None
    strs = [token_string(token_bytes(tokenizer, t)) for t in ids] if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}


def detokenize(body: bytes, tokenizer: Tokenizer, model: str) -> dict[str, Any]:
    """``{prompt}``: the tokens' text. Raises: APIError (400 for an id outside the vocabulary)."""
    req = parse_body(DetokenizeRequest, body)
    if req.model is not None:
        check_model(req.model, [model])
    for tid in req.tokens:
        if not 0 <= tid < tokenizer.vocab_size:
            raise bad_request(
                "tokens", f"token id {tid} is outside the vocabulary (size {tokenizer.vocab_size})"
            )
    return {"prompt": tokenizer.decode(req.tokens, skip_special_tokens=False)}
