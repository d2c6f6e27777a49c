"""The Responses API without a cluster (docs/design.md#responses-api): a request is the chat
request it names, and its events -- fed the text in any split -- end with the response the
whole text makes."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from api.errors import APIError
from api.responses_api import ResponseEvents, chat_request, parse_responses
from engine.request import FinishReason

TOOL = {"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": True}


def request(**fields: Any) -> Any:
    return parse_responses(json.dumps({"model": "m", "input": "hi"} | fields).encode())


def test_a_request_is_the_chat_request_it_names() -> None:
    req = request(
        instructions="Be brief.",
        input=[
            {"role": "developer", "content": "Use tools."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "A"}]},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "f", "arguments": '{"x": 1}'},
            {"type": "function_call_output", "call_id": "c1", "output": "one"},
            {"type": "function_call_output", "call_id": "c2", "output": "two"},
            {
                "type": "message",
                "role": "assistant",
                "id": "msg_1",
                "status": "completed",
                "content": [{"type": "output_text", "text": "Done.", "annotations": []}],
            },
        ],
        tools=[TOOL],
        tool_choice={"type": "function", "name": "f"},
        parallel_tool_calls=False,
        max_output_tokens=7,
        temperature=0.5,
        top_p=0.9,
        seed=3,
    )
    chat = chat_request(req)
    calls = [
        {"id": c, "type": "function", "function": {"name": "f", "arguments": a}}
        for c, a in (("c1", "{}"), ("c2", '{"x": 1}'))
    ]
    assert [m.model_dump(exclude_none=True) for m in chat.messages] == [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "A"},
        {"role": "assistant", "tool_calls": calls},  # one turn's calls in one message
        {"role": "tool", "content": "one", "tool_call_id": "c1"},
        {"role": "tool", "content": "two", "tool_call_id": "c2"},
        {"role": "assistant", "content": "Done."},
    ]
    assert [t.model_dump(exclude_none=True) for t in chat.tools or ()] == [
        {
            "type": "function",
            "function": {"name": "f", "parameters": {"type": "object"}, "strict": True},
        }
    ]
    assert chat.tool_mode == "named" and chat.parallel_tool_calls is False
    assert (chat.max_completion_tokens, chat.temperature, chat.top_p, chat.seed) == (7, 0.5, 0.9, 3)


def test_a_text_format_is_the_response_format() -> None:
    schema = {"type": "json_schema", "name": "s", "schema": {"type": "object"}, "strict": True}
    chat = chat_request(request(text={"format": schema}))
    assert chat.response_format is not None
    assert chat.response_format.model_dump(by_alias=True, exclude_none=True) == {
        "type": "json_schema",
        "json_schema": {"name": "s", "schema": {"type": "object"}, "strict": True},
    }
    json_object = chat_request(request(text={"format": {"type": "json_object"}}))
    assert json_object.response_format is not None
    assert json_object.response_format.model_dump() == {"type": "json_object"}
    assert chat_request(request(text={"format": {"type": "text"}})).response_format is None


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"store": True}, "store"),
        ({"previous_response_id": "resp_x"}, "previous_response_id"),
        ({"input": []}, "input"),
        ({"input": [{"type": "image", "url": "x"}]}, "input.0"),
        ({"truncation": "auto"}, "truncation"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
    ],
)
def test_what_the_server_does_not_keep_or_take_is_a_400_naming_it(
    fields: dict[str, Any], param: str
) -> None:
    with pytest.raises(APIError) as err:
        request(**fields)
    assert (err.value.status, err.value.param) == (400, param)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {
                "input": [{"type": "function_call_output", "call_id": "c", "output": ""}],
                "tools": [TOOL, TOOL],
            },
            "tools",
        ),
        (
            {
                "text": {"format": {"type": "json_object"}},
                "tools": [TOOL],
                "tool_choice": "required",
            },
            "tool_choice",
        ),
    ],
)
def test_a_chat_rule_it_breaks_names_the_responses_field(
    fields: dict[str, Any], param: str
) -> None:
    with pytest.raises(APIError) as err:
        chat_request(request(**fields))
    assert (err.value.status, err.value.param) == (400, param)
    assert f"'{param}'" in err.value.message or "'" not in err.value.message


def events_of(pieces: list[str], reason: FinishReason, tools: bool) -> list[dict[str, Any]]:
    events = ResponseEvents(request(), "resp_1", 0, tool_calls=tools)
    out = events.start()
    for piece in pieces:
        out += events.feed(piece)
    return out + events.finish(reason, 5, 9)


def stable(events: list[dict[str, Any]]) -> Any:
    """The events with the ids items draw replaced by their order of first appearance."""
    text = json.dumps(events)
    drawn = sorted(set(_ids(events)), key=text.index)
    for n, value in enumerate(drawn):
        text = text.replace(value, f"id{n}")
    return json.loads(text)


def _ids(obj: Any) -> list[str]:
    if isinstance(obj, dict):
        own = [v for k, v in obj.items() if k in ("id", "call_id", "item_id") and v != "resp_1"]
        return own + [i for v in obj.values() for i in _ids(v)]
    if isinstance(obj, list):
        return [i for v in obj for i in _ids(v)]
    return []


def test_text_then_a_call_makes_a_message_item_then_a_function_call_item() -> None:
    text = 'Checking.<tool_call>[{"name": "f", "arguments": {"a": 1}}]</tool_call>'
    assert text[48:56] == '{"a": 1}'  # cut in the middle of the arguments
    events = events_of([text[:5], text[5:50], text[50:]], FinishReason.EOS, tools=True)
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",  # the message
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",  # the call: name known, arguments ""
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]["response"]
    assert final["status"] == "completed" and final["incomplete_details"] is None
    message, call = final["output"]
    assert message["content"] == [{"type": "output_text", "text": "Checking.", "annotations": []}]
    assert (call["name"], call["arguments"], call["status"]) == ("f", '{"a": 1}', "completed")
    assert final["usage"]["input_tokens"] == 5 and final["usage"]["output_tokens"] == 9
    assert final["usage"]["total_tokens"] == 14


def test_out_of_tokens_is_incomplete_and_no_text_still_makes_a_message() -> None:
    events = events_of([], FinishReason.MAX_TOKENS, tools=False)
    final = events[-1]
    assert final["type"] == "response.incomplete"
    assert final["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [i["type"] for i in final["response"]["output"]] == ["message"]


@settings(max_examples=100, deadline=None)
@given(
    text=st.sampled_from(
        [
            "Plain text, no call.",
            'Sure <tool_call>[{"name": "f", "arguments": {"x": [1, 2]}}, '
            '{"name": "g", "arguments": {}}]</tool_call>',
            "<tool_call>broken",
        ]
    ),
    cuts=st.lists(st.integers(min_value=0, max_value=120), max_size=8),
)
def test_events_in_any_split_end_with_the_response_of_the_whole_text(
    text: str, cuts: list[int]
) -> None:
    points = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    pieces = [text[a:b] for a, b in zip(points, points[1:], strict=False)]
    split = events_of(pieces, FinishReason.EOS, tools=True)
    whole = events_of([text], FinishReason.EOS, tools=True)
    assert stable(split[-1]["response"]) == stable(whole[-1]["response"])
