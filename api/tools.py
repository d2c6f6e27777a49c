"""Tool calling on chat (docs/design.md#tool-calling): the grammar that holds a ``required`` or
named ``tool_choice`` to the functions' schemas, and the parser that turns the model's text into
OpenAI's ``tool_calls``.

The model writes its calls as tagged JSON: ``<tool_call>``, then one call object
``{"name": ..., "arguments": {...}}`` or a JSON list of them, then ``</tool_call>`` (Qwen2.5's
format is an object per tag, SmolLM2 was trained on a list; the parser takes both, and any
number of tagged blocks). Text before the first tag is the message's ``content``.

**One parser for both modes.** :class:`ToolCallParser` reads a choice's text as it grows: a
stream feeds it each delta and sends what it returns; a non-streamed answer feeds it the whole
text once. Its state is a function of the text so far, so the calls a stream sends add up to
the calls the same text answers without streaming, ``arguments`` being the raw JSON text the
model wrote for them (a stream sends it in pieces as it grows, with no partial-JSON guessing).
A call is announced (its ``id`` and ``name``, ``arguments: ""``) once its name is complete.
Text after the first tag that never makes a call (the model broke off, or wrote no JSON) is
content after all: held back while it might become one, sent when the choice ends.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.sampling_params import Constraint
from engine.structured import JSON_STYLE

CALL_BEGIN, CALL_END = "<tool_call>", "</tool_call>"
_ARGUMENT_KEYS = ("arguments", "parameters")  # some models write the latter
_JSON = json.JSONDecoder()
_NO_ARGUMENTS = {"type": "object"}  # a function that declares no parameters


def tool_call_grammar(
    functions: Sequence[dict[str, Any]], parallel: bool, forced: bool = True
) -> Constraint:
    """The Lark grammar of tool calls: tagged JSON lists of calls, each naming one of
    ``functions`` with arguments that match its ``parameters`` schema; at most one call unless
    ``parallel``. ``forced`` (a ``required`` or named choice): the output is one such list and
    nothing else, ended by EOS after the closing tag. Not forced (``auto`` with a ``strict``
    tool): free text, in which each ``<tool_call>`` the model writes opens such a list (a lazy
    lexeme: the grammar engine holds the text only from the tag on)."""
    calls = {
        "anyOf": [
            {
                "type": "object",
                "properties": {
                    "name": {"const": f["name"]},
                    "arguments": f.get("parameters") or _NO_ARGUMENTS,
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for f in functions
        ]
    }
    schema: dict[str, Any] = {"type": "array", "items": calls, "minItems": 1}
    schema["x-guidance"] = JSON_STYLE  # one line, as the template shows the calls
    if not parallel:
        schema["maxItems"] = 1
    begin, end = json.dumps(CALL_BEGIN), json.dumps(CALL_END)
    calls_rule = f"calls: %json {json.dumps(schema)}\n"
    if forced:
        return Constraint("grammar", f"start: {begin} calls {end}\n{calls_rule}")
    lark = (
        "%llguidance {}\n"
        f"start: call{'*' if parallel else '?'} TEXT\n"
        f"call_begin[lazy]: TEXT {begin}\n"
        f"call: call_begin calls {end}\n"
        "TEXT: /(.|\\n)*/\n"
    )
    return Constraint("grammar", lark + calls_rule)


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of call ``index``: its first carries ``id`` and ``name`` (``arguments`` ""),
    later ones a piece of ``arguments``."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def chunk(self) -> dict[str, Any]:
        """OpenAI's ``delta.tool_calls[]`` entry for this piece."""
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {
            "index": self.index,
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class ParsedCall:
    """A call as far as the text shows it: the name once complete, where its ``arguments``
    value starts in the text and, once complete, where it ends."""

    name: str | None = None
    args_start: int | None = None
    args_end: int | None = None


@dataclass
class _Sent:
    id: str
    name: str
    arguments: int = 0  # characters of arguments sent


@dataclass
class ToolCallParser:
    """One choice's text read as content and tool calls (see the module docstring)."""

    text: str = ""
    content_sent: int = 0
    calls: list[_Sent] = field(default_factory=list)

    def feed(self, delta: str) -> tuple[str, list[ToolCallDelta]]:
        """What ``delta`` adds: a piece of content and pieces of calls."""
        self.text += delta
        begin = self.text.find(CALL_BEGIN)
        if begin < 0:  # all content, but a tail that may begin a tag waits
            return self._content(len(self.text) - _tag_prefix(self.text)), []
        return self._content(begin), self._calls(begin, final=False)

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """What the end of the text releases: held-back content, or the last pieces of calls
        (a call with no arguments gets ``{}``)."""
        begin = self.text.find(CALL_BEGIN)
        calls = [] if begin < 0 else self._calls(begin, final=True)
        if not self.calls:  # no call after all: the whole text is content
            return self._content(len(self.text)), []
        return self._content(begin), calls

    def _content(self, upto: int) -> str:
        piece = self.text[self.content_sent : upto]
        self.content_sent = max(self.content_sent, upto)
        return piece

    def _calls(self, begin: int, final: bool) -> list[ToolCallDelta]:
        out = []
        for index, call in enumerate(scan_calls(self.text, begin)):
            if call.name is None:
                break  # a later call cannot be announced before this one
            if index == len(self.calls):
                self.calls.append(_Sent(f"call_{uuid.uuid4().hex[:24]}", call.name))
                out.append(ToolCallDelta(index, "", self.calls[index].id, call.name))
            sent = self.calls[index]
            if call.args_start is None:
                if final:
                    out.append(ToolCallDelta(index, "{}"))
                continue
            end = len(self.text) if call.args_end is None else call.args_end
            piece = self.text[call.args_start + sent.arguments : end]
            if piece:
                sent.arguments += len(piece)
                out.append(ToolCallDelta(index, piece))
        return out


def scan_calls(text: str, begin: int) -> list[ParsedCall]:
    """The calls of the tagged blocks from ``begin`` on, as far as ``text`` goes: the last may
    be incomplete; reading stops at anything that is not a block."""
    calls: list[ParsedCall] = []
    i = begin
    while text.startswith(CALL_BEGIN, i := _skip_ws(text, i)):
        i = _skip_ws(text, i + len(CALL_BEGIN))
        if text.startswith("[", i):
            i += 1
            while (i := _skip_ws(text, i)) < len(text) and text[i] != "]":
                if text[i] == ",":
                    i += 1
                    continue
                if text[i] != "{":
                    return calls
                i, done = _call(text, i, calls)
                if not done:
                    return calls
            i += 1
        elif text.startswith("{", i):
            i, done = _call(text, i, calls)
            if not done:
                return calls
        else:
            return calls
        i = _skip_ws(text, i)
        if not text.startswith(CALL_END, i):
            return calls
        i += len(CALL_END)
    return calls


def _call(text: str, i: int, calls: list[ParsedCall]) -> tuple[int, bool]:
    """Read the call object at ``text[i] == "{"`` into a new entry of ``calls``: the index
    after it, and whether it is complete."""
    call = ParsedCall()
    calls.append(call)
    i += 1
    while (i := _skip_ws(text, i)) < len(text):
        if text[i] == "}":
            return i + 1, True
        if text[i] == ",":
            i += 1
            continue
        try:
            key, i = _JSON.raw_decode(text, i)
        except json.JSONDecodeError:
            return i, False
        i = _skip_ws(text, i)
        if not text.startswith(":", i):
            return i, False
        start = _skip_ws(text, i + 1)
        try:
            value, i = _JSON.raw_decode(text, start)
        except json.JSONDecodeError:  # incomplete (or not JSON): arguments grow to the end
            if key in _ARGUMENT_KEYS and start < len(text) and call.args_start is None:
                call.args_start = start
            return len(text), False
        if key == "name" and isinstance(value, str):
            call.name = value
        elif key in _ARGUMENT_KEYS and call.args_start is None:
            call.args_start, call.args_end = start, i
    return i, False


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def _tag_prefix(text: str) -> int:
    """The length of the longest tail of ``text`` that begins ``<tool_call>``."""
    for n in range(min(len(CALL_BEGIN) - 1, len(text)), 0, -1):
        if CALL_BEGIN.startswith(text[-n:]):
            return n
    return 0


@dataclass(frozen=True)
class ToolCalls:
    """A finished choice's calls, gathered from its parser's deltas: OpenAI's
    ``message.tool_calls`` and the content before them."""

    content: str
    calls: list[dict[str, Any]]

    @classmethod
    def of(cls, text: str) -> ToolCalls:
        parser = ToolCallParser()
        content, deltas = parser.feed(text)
        more, last = parser.finish()
        calls: list[dict[str, Any]] = []
        for d in [*deltas, *last]:
            if d.id is not None:
                calls.append({"id": d.id, "type": "function", "function": {"name": d.name}})
                calls[-1]["function"]["arguments"] = ""
            calls[d.index]["function"]["arguments"] += d.arguments
        return cls(content + more, calls)
