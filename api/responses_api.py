"""OpenAI's Responses API (``POST /v1/responses``), stateless (docs/design.md#responses-api).

A Responses request is a chat request in other clothes, so it becomes one
(:func:`chat_request`): ``instructions`` the system message, the ``input`` items the messages
(a ``function_call`` item an assistant message's tool call, a ``function_call_output`` a
``tool`` message), ``text.format`` the ``response_format``, the flat function tools the chat
API's nested ones. It then runs as a chat job does -- tools, grammars, retries and migration
alike -- and only the answer's shape differs: a ``response`` object whose ``output`` holds a
``message`` item (the text) and a ``function_call`` item per call, or, streamed, its typed events.

Nothing is kept: ``store: true`` and ``previous_response_id`` are 400s saying so (a client keeps
the conversation and sends it whole, as with chat).

:class:`ResponseEvents` builds both answers: a stream feeds it each delta and sends the events it
returns; a whole answer feeds it the text once and takes the final ``response``. So the
``response.completed`` event of a stream is the object the same text answers unstreamed.
"""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from api.errors import APIError, bad_request
from api.protocol import ChatCompletionRequest, CrossFieldError, StrictModel, parse_body
from api.responses import openai_finish_reason
from api.tools import ToolCallDelta, ToolCallParser
from engine.request import FinishReason

# -- the request ----------------------------------------------------------------------------------


class TextPart(StrictModel):
    """A message's text: ``input_text`` from the client, ``output_text`` from an earlier
    response sent back (its ``annotations`` and ``logprobs`` ignored)."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class MessageItem(StrictModel):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextPart]
    id: str | None = None  # an earlier response's item, sent back
    status: str | None = None


class FunctionCallItem(StrictModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str = Field(description="the arguments, as the JSON text of an object")
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(StrictModel):
    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None


def _item_kind(item: Any) -> str:
    """An item's ``type``; a message may leave it out (``{"role": ..., "content": ...}``)."""
    return item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", "")


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(_item_kind),
]


class FunctionTool(StrictModel):
    """The Responses API's function tool: the chat API's ``function`` object, flat."""

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(StrictModel):
    type: Literal["function"]
    name: str


class JSONSchemaTextFormat(StrictModel):
    model_config = StrictModel.model_config | {"populate_by_name": True}
    type: Literal["json_schema"]
    name: str
    json_schema: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


class FreeTextFormat(StrictModel):
    type: Literal["text", "json_object"]


class TextConfig(StrictModel):
    format: Annotated[
        Annotated[FreeTextFormat, Tag("free")] | Annotated[JSONSchemaTextFormat, Tag("schema")],
        Discriminator(lambda f: "schema" if _item_kind(f) == "json_schema" else "free"),
    ] = FreeTextFormat(type="text")


def _text_or_items(schema: dict[str, Any]) -> None:
    """``input``'s schema: what its validator takes, a text or a non-empty list of items."""
    items = {**schema, "minItems": 1}
    schema.clear()
    schema["anyOf"] = [{"type": "string", "minLength": 1}, items]


class ResponsesRequest(StrictModel):
    """``POST /v1/responses``: what Tandem implements of it (anything else is a 400 naming it)."""

    model: str
    input: list[InputItem] = Field(
        description="a user message's text, or the conversation's items",
        json_schema_extra=_text_or_items,
    )
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, description="vLLM's: the sampling seed")
    stream: bool = False
    store: bool | None = Field(default=None, description="false: nothing is kept (true: a 400)")
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _items(cls, value: Any) -> Any:
        """A string is one user message; an empty input is none."""
        if not value:
            raise ValueError("must be a non-empty string or list of items")
        return [{"role": "user", "content": value}] if isinstance(value, str) else value

    @model_validator(mode="after")
    def _stateless(self) -> ResponsesRequest:
        if self.store:
            raise CrossFieldError("store", "this server keeps no responses: false or absent")
        if self.previous_response_id is not None:
            raise CrossFieldError(
                "previous_response_id",
                "this server keeps no responses to continue: send the conversation in input",
            )
        return self


def parse_responses(body: bytes) -> ResponsesRequest:
    """Raises: APIError(400) naming the field for anything the model rejects."""
    return parse_body(ResponsesRequest, body)


def chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request ``req`` is (see the module docstring).

    Raises: APIError(400) for a conversation chat cannot hold (e.g. a function call whose
    arguments are not JSON: named by the chat field, under ``input``)."""
    body: dict[str, Any] = {"model": req.model, "messages": _messages(req), "stream": req.stream}
    if req.tools:
        body["tools"] = [
            {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
            for t in req.tools
        ]
    if isinstance(req.tool_choice, NamedFunction):
        body["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice.name}}
    elif req.tool_choice is not None:
        body["tool_choice"] = req.tool_choice
    fmt = req.text.format if req.text else None
    if isinstance(fmt, JSONSchemaTextFormat):
        schema = fmt.model_dump(exclude={"type"}, exclude_none=True, by_alias=True)
        body["response_format"] = {"type": "json_schema", "json_schema": schema}
    elif fmt is not None and fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    fields = {
        "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "seed": req.seed,
        "parallel_tool_calls": req.parallel_tool_calls,
        "user": req.user,
    }
    body |= {k: v for k, v in fields.items() if v is not None}
    try:
        return parse_body(ChatCompletionRequest, json.dumps(body).encode())
    except APIError as exc:  # named by the chat field: renamed to the Responses field it came from
        head, _, _ = (exc.param or "").partition(".")
        param = _FIELDS_OF_CHAT.get(head, head or None)
        raise bad_request(param, exc.message.replace(repr(exc.param), repr(param))) from None


# The Responses field each chat field comes from (the others have the same name).
_FIELDS_OF_CHAT = {
    "messages": "input",
    "response_format": "text.format",
    "max_completion_tokens": "max_output_tokens",
}


def _messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if req.instructions is not None:
        messages.append({"role": "system", "content": req.instructions})
    items = (
        [MessageItem(role="user", content=req.input)] if isinstance(req.input, str) else req.input
    )
    for item in items:
        if isinstance(item, MessageItem):
            text = item.content
            if not isinstance(text, str):
                text = "".join(part.text for part in text)
            role = "system" if item.role == "developer" else item.role
            messages.append({"role": role, "content": text})
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)  # one turn's parallel calls
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    return messages


# -- the answer -----------------------------------------------------------------------------------


def new_response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


class ResponseEvents:
    """One response, built from its text as it grows: the events of a stream, and the
    ``response`` object they end with (see the module docstring)."""

    def __init__(
        self, req: ResponsesRequest, response_id: str, created: int, tool_calls: bool
    ) -> None:
        self.req = req
        self.id = response_id
        self.created = created
        self.parser = ToolCallParser() if tool_calls else None
        self.output: list[dict[str, Any]] = []  # the items so far
        self.message: dict[str, Any] | None = None  # the open message item
        self.calls: dict[int, dict[str, Any]] = {}  # call index -> its item
        self.sequence = 0

    def start(self) -> list[dict[str, Any]]:
        """A stream's first events: the response created, in progress."""
        body = self.response("in_progress", None)
        return [
            self._event("response.created", response=body),
            self._event("response.in_progress", response=body),
        ]

    def feed(self, text: str) -> list[dict[str, Any]]:
        """The events of ``text``, the next piece of the output."""
        if self.parser is None:
            return self._text(text)
        content, calls = self.parser.feed(text)
        return self._text(content) + self._calls(calls)

    def finish(
        self, reason: FinishReason, input_tokens: int, output_tokens: int
    ) -> list[dict[str, Any]]:
        """The last events: held-back text or calls, every item done, then the response
        completed (or incomplete: out of ``max_output_tokens``)."""
        events = []
        if self.parser is not None:
            content, calls = self.parser.finish()
            events += self._text(content) + self._calls(calls)
        if not self.output:  # a response always holds its message, empty or not
            events += self._text("", force=True)
        events += self._close_message() + self._close_call()
        status = "incomplete" if openai_finish_reason(reason) == "length" else "completed"
        usage = {
            "input_tokens": input_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens,
        }
        body = self.response(status, usage)
        events.append(self._event(f"response.{status}", response=body))
        return events

    def response(self, status: str, usage: dict[str, Any] | None) -> dict[str, Any]:
        """The ``response`` object as it stands."""
        req = self.req
        fmt = req.text.format if req.text else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": req.model,
            "output": _copy(self.output),
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            "error": None,
            "instructions": req.instructions,
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or ()],
            "tool_choice": (
                req.tool_choice.model_dump()
                if isinstance(req.tool_choice, NamedFunction)
                else req.tool_choice or "auto"
            ),
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "max_output_tokens": req.max_output_tokens,
            "text": {"format": (fmt or FreeTextFormat(type="text")).model_dump(by_alias=True)},
            "store": False,
            "previous_response_id": None,
            "metadata": req.metadata or {},
            "usage": usage,
        }

    # -- the items -------------------------------------------------------------------------------

    def _text(self, text: str, force: bool = False) -> list[dict[str, Any]]:
        if not text and not force:
            return []
        events = []
        if self.message is None:
            self.message = {
                "type": "message",
                "id": f"msg_{uuid.uuid4().hex}",
                "status": "in_progress",
                "role": "assistant",
                "content": [],
            }
            events.append(self._item_added(self.message))
            part = {"type": "output_text", "text": "", "annotations": []}
            self.message["content"].append(part)
            events.append(self._part_event("response.content_part.added", part=dict(part)))
        part = self.message["content"][0]
        part["text"] += text
        if text:
            events.append(self._part_event("response.output_text.delta", delta=text))
        return events

    def _close_message(self) -> list[dict[str, Any]]:
        if self.message is None or self.message["status"] == "completed":
            return []
        part = self.message["content"][0]
        self.message["status"] = "completed"
        return [
            self._part_event("response.output_text.done", text=part["text"]),
            self._part_event("response.content_part.done", part=dict(part)),
            self._item_done(self.message),
        ]

    def _calls(self, deltas: list[ToolCallDelta]) -> list[dict[str, Any]]:
        events = []
        for d in deltas:
            if d.id is not None:  # what came before it is complete
                events += self._close_message() + self._close_call()
                item: dict[str, Any] = {
                    "type": "function_call",
                    "id": f"fc_{uuid.uuid4().hex}",
                    "call_id": d.id,
                    "name": d.name,
                    "arguments": "",
                    "status": "in_progress",
                }
                self.calls[d.index] = item
                events.append(self._item_added(item))
            item = self.calls[d.index]
            if d.arguments:
                item["arguments"] += d.arguments
                events.append(
                    self._event(
                        "response.function_call_arguments.delta",
                        item_id=item["id"],
                        output_index=self.output.index(item),
                        delta=d.arguments,
                    )
                )
        return events

    def _close_call(self) -> list[dict[str, Any]]:
        """The last call's arguments and item done, if it is still open."""
        if not self.calls or (item := self.calls[len(self.calls) - 1])["status"] == "completed":
            return []
        item["status"] = "completed"
        done = self._event(
            "response.function_call_arguments.done",
            item_id=item["id"],
            output_index=self.output.index(item),
            arguments=item["arguments"],
        )
        return [done, self._item_done(item)]

    def _item_added(self, item: dict[str, Any]) -> dict[str, Any]:
        self.output.append(item)
        return self._event(
            "response.output_item.added", output_index=len(self.output) - 1, item=_copy(item)
        )

    def _item_done(self, item: dict[str, Any]) -> dict[str, Any]:
        index = self.output.index(item)
        return self._event("response.output_item.done", output_index=index, item=_copy(item))

    def _part_event(self, kind: str, **fields: Any) -> dict[str, Any]:
        assert self.message is not None
        where = {"item_id": self.message["id"], "output_index": self.output.index(self.message)}
        return self._event(kind, **where, content_index=0, **fields)

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event


def _copy(items: Any) -> Any:
    """Items as they stand (later events change the live ones)."""
    return json.loads(json.dumps(items))


def event_sse(event: dict[str, Any]) -> bytes:
    """One typed server-sent event: ``event: <type>`` and its JSON."""
    data = json.dumps(event, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return f"event: {event['type']}\ndata: {data}\n\n".encode()


def error_event(error: APIError, sequence: int) -> dict[str, Any]:
    """A stream's ``error`` event: what went wrong after the response had started."""
    return {
        "type": "error",
        "sequence_number": sequence,
        "code": error.code,
        "message": error.message,
        "param": error.param,
    }
