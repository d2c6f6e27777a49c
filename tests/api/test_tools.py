"""Tool calling's pieces without a cluster (docs/design.md#tool-calling): the parser that reads
a choice's text as content and calls (streamed in any split, it adds up to the unstreamed
answer), the grammar of ``required`` and named choices, the request's validation, and the
ChatML tool template SmolLM2 gets."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import llguidance
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from api.errors import APIError
from api.protocol import parse_chat
from api.tools import CALL_BEGIN, ToolCallParser, ToolCalls, tool_call_grammar
from api.translate import chat_prompt, constraint_of
from engine.chat_templates import CHATML_TOOLS, tools_template
from engine.structured import compile_grammar
from engine.tokenizer import Tokenizer

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
TIME = {"name": "get_time", "parameters": {"type": "object", "properties": {}}}


def gathered(parser: ToolCallParser, pieces: list[str]) -> tuple[str, list[tuple[str, str]]]:
    """What a stream of ``pieces`` sends, put together: content, and (name, arguments) per call
    -- checking each call is announced (id and name) before any piece of its arguments."""
    content, calls = "", []
    ids = set()
    results = [parser.feed(p) for p in pieces] + [parser.finish()]
    for text, deltas in results:
        content += text
        for d in deltas:
            if d.id is not None:
                assert d.index == len(calls) and d.arguments == "" and d.id not in ids
                ids.add(d.id)
                calls.append([d.name, ""])
            else:
                assert d.index < len(calls)
                calls[d.index][1] += d.arguments
    return content, [(n, a) for n, a in calls]


def whole(text: str) -> tuple[str, list[tuple[str, str]]]:
    parsed = ToolCalls.of(text)
    return parsed.content, [
        (c["function"]["name"], c["function"]["arguments"]) for c in parsed.calls
    ]


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        ("Paris is sunny.", "Paris is sunny.", []),
        (  # SmolLM2's trained form: a list, with the model's own spacing
            '<tool_call>[\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n]</tool_call>',
            "",
            [("get_weather", '{"city": "Paris"}')],
        ),
        (  # Qwen's: an object per tag; text before the first tag is content
            'Let me look.\n<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n'
            '<tool_call>{"name": "b", "arguments": {"s": "}]</tool_call>"}}</tool_call>',
            "Let me look.\n",
            [("a", "{}"), ("b", '{"s": "}]</tool_call>"}')],
        ),
        (  # arguments before the name, "parameters" for "arguments", no arguments at all
            '<tool_call>[{"parameters": {"x": [1, 2]}, "name": "f"}, {"name": "g"}]</tool_call>',
            "",
            [("f", '{"x": [1, 2]}'), ("g", "{}")],
        ),
        ('<tool_call>[{"name": "f", "arguments": {"x": 1', "", [("f", '{"x": 1')]),  # cut off
        (
            "an empty list: <tool_call>[]</tool_call>",
            "an empty list: <tool_call>[]</tool_call>",
            [],
        ),
        ('never a call <tool_call>[{"nam', 'never a call <tool_call>[{"nam', []),
        ("a tag's start at the end <tool_ca", "a tag's start at the end <tool_ca", []),
    ],
)
def test_text_reads_as_content_and_calls(
    text: str, content: str, calls: list[tuple[str, str]]
) -> None:
    assert whole(text) == (content, calls)
    assert gathered(ToolCallParser(), list(text)) == (content, calls)  # a character at a time


_CALL_TEXTS = st.sampled_from(
    [
        'Sure.\n<tool_call>[{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}, '
        '{"name": "get_time", "arguments": {}}]</tool_call>',
        '<tool_call>{"name": "x", "arguments": {"q": "a \\" quote, a } brace"}}</tool_call>',
        "no call <tool no call",
        '<tool_call>[{"arguments": {"k": null}, "name": "late"}]</tool_call>',
        'text <tool_call>[{"name": "f", "arguments": {"deep": {"a": [{"b": []}]}}}',
    ]
)


@settings(max_examples=200, deadline=None)
@given(text=_CALL_TEXTS, cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=12))
def test_a_stream_split_anywhere_adds_up_to_the_whole_answer(text: str, cuts: list[int]) -> None:
    points = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    pieces = [text[a:b] for a, b in zip(points, points[1:], strict=False)]
    assert gathered(ToolCallParser(), pieces) == whole(text)


def test_content_is_never_sent_past_the_start_of_a_call() -> None:
    parser = ToolCallParser()
    assert parser.feed("It is <tool") == ("It is ", [])  # may begin a tag: held back
    content, calls = parser.feed('_call>[{"name": "f", "arg')
    assert content == "" and [(d.name, d.arguments) for d in calls] == [("f", "")]
    _, calls = parser.feed('uments": {"a": 1')
    assert [(d.id, d.arguments) for d in calls] == [(None, '{"a": 1')]  # arguments as they grow
    _, calls = parser.feed("}}]</tool_call>")
    assert [d.arguments for d in calls] == ["}"]
    assert parser.finish() == ("", [])


# -- the grammar of required and named choices ----------------------------------------------------


def matches(grammar: str, tokenizer: llguidance.LLTokenizer, text: str) -> bool:
    matcher = llguidance.LLMatcher(tokenizer, grammar)
    ok = matcher.consume_tokens(tokenizer.tokenize_str(text)) and not matcher.is_error()
    return ok and matcher.is_accepting()


@pytest.fixture(scope="module")
def lltok(smollm2: Path) -> llguidance.LLTokenizer:
    tok = Tokenizer(smollm2)
    return llguidance.LLTokenizer(tok.json, n_vocab=tok.vocab_size, eos_token=2)


@pytest.mark.parametrize(
    ("functions", "parallel", "text", "ok"),
    [
        ([WEATHER, TIME], True, '[{"name": "get_weather", "arguments": {"city": "Rome"}}]', True),
        (
            [WEATHER, TIME],
            True,
            '[{"name": "get_time", "arguments": {}}, {"name": "get_weather", '
            '"arguments": {"city": "A", "days": 2}}]',
            True,
        ),
        (
            [WEATHER, TIME],
            False,
            '[{"name": "get_time", "arguments": {}}, {"name": "get_time", "arguments": {}}]',
            False,
        ),  # parallel_tool_calls: false
        ([WEATHER, TIME], True, "[]", False),  # required: at least one call
        ([WEATHER], True, '[{"name": "get_weather", "arguments": "Paris"}]', False),  # vllm's
        ([WEATHER], True, '[{"name": "get_weather", "arguments": {"city": 3}}]', False),
        ([WEATHER], True, '[{"name": "get_weather", "arguments": {"days": 2}}]', False),
        ([WEATHER], True, '[{"name": "get_time", "arguments": {}}]', False),  # not the named
        ([TIME], True, '[{"name": "get_time", "arguments": {}}]', True),
    ],
)
def test_the_grammar_admits_exactly_calls_that_match_the_schemas(
    lltok: llguidance.LLTokenizer,
    functions: list[dict[str, Any]],
    parallel: bool,
    text: str,
    ok: bool,
) -> None:
    grammar = compile_grammar(tool_call_grammar(functions, parallel), lltok)
    assert matches(grammar, lltok, f"{CALL_BEGIN}{text}</tool_call>") is ok


@pytest.mark.parametrize(
    ("parallel", "text", "ok"),
    [
        (True, "Paris is sunny, no call needed.", True),
        (
            True,
            'Let me check. <tool_call>[{"name": "get_weather", "arguments": {"city": "Oslo"}}]'
            "</tool_call> Done.",
            True,
        ),
        (
            True,
            'x <tool_call>[{"name": "get_weather", "arguments": {"town": "Oslo"}}]</tool_call>',
            False,
        ),  # once the tag is written, the schema holds
        (
            True,
            '<tool_call>[{"name": "get_time", "arguments": {}}]</tool_call>'
            '<tool_call>[{"name": "get_time", "arguments": {}}]</tool_call>',
            True,
        ),
        (
            False,
            '<tool_call>[{"name": "get_time", "arguments": {}}]</tool_call>'
            '<tool_call>[{"name": "get_time", "arguments": {}}]</tool_call>',
            True,
        ),  # text after
        (
            False,
            '<tool_call>[{"name": "get_time", "arguments": {}}, '
            '{"name": "get_time", "arguments": {}}]</tool_call>',
            False,
        ),
    ],
)
def test_the_auto_grammar_leaves_text_free_and_holds_each_call(
    lltok: llguidance.LLTokenizer, parallel: bool, text: str, ok: bool
) -> None:
    grammar = compile_grammar(tool_call_grammar([WEATHER, TIME], parallel, forced=False), lltok)
    assert matches(grammar, lltok, text) is ok


# -- the request ------------------------------------------------------------------------------------


def body(**fields: Any) -> bytes:
    base: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    return json.dumps(base | fields).encode()


def tools(*functions: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"type": "function", "function": f} for f in functions]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),  # no tools
        (
            {
                "tools": tools(WEATHER),
                "tool_choice": {"type": "function", "function": {"name": "x"}},
            },
            "tool_choice",
        ),
        ({"tools": tools(WEATHER, WEATHER)}, "tools"),
        (
            {
                "tools": tools(WEATHER),
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "tool_choice",
        ),
        ({"tools": tools(WEATHER), "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": tools({"name": "bad name"})}, "tools.0.function.name"),
        ({"messages": [{"role": "tool", "content": "18 C"}]}, "messages.0.tool_call_id"),
        ({"messages": [{"role": "user", "content": None}]}, "messages.0.content"),
        (
            {"messages": [{"role": "user", "content": "x", "tool_calls": []}]},
            "messages.0.tool_calls",
        ),
    ],
)
def test_tool_fields_that_do_not_fit_are_400s_naming_the_field(
    fields: dict[str, Any], param: str
) -> None:
    with pytest.raises(APIError) as err:
        parse_chat(body(**fields))
    assert (err.value.status, err.value.param) == (400, param)


def test_a_parameters_schema_the_grammar_engine_refuses_is_a_400_naming_the_tool() -> None:
    bad = {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "nope"}}}}
    req = parse_chat(body(tools=tools(TIME, bad)))  # even with auto: bad input
    with pytest.raises(APIError) as err:
        constraint_of(req)
    assert (err.value.status, err.value.param) == (400, "tools.1.function.parameters")


def test_tool_choice_picks_the_grammar() -> None:
    def constraint(**fields: Any) -> Any:
        return constraint_of(parse_chat(body(tools=tools(WEATHER, TIME), **fields)))

    assert constraint() is None  # auto: the model decides, its text parsed
    assert constraint(tool_choice="none") is None
    strict = tools(WEATHER | {"strict": True}, TIME)
    auto = constraint_of(parse_chat(body(tools=strict)))  # OpenAI's strict: the schema holds
    loose_time = TIME | {"parameters": None}  # a tool that is not strict: any object
    assert auto == tool_call_grammar([WEATHER, loose_time], True, forced=False)
    assert constraint(tool_choice="required") == tool_call_grammar([WEATHER, TIME], True)
    named = {"type": "function", "function": {"name": "get_time"}}
    assert constraint(tool_choice=named, parallel_tool_calls=False) == tool_call_grammar(
        [TIME], False
    )


# -- the template ----------------------------------------------------------------------------------


def test_smollm2_gets_the_chatml_tool_template_and_a_round_trip_renders(smollm2: Path) -> None:
    tok = Tokenizer(smollm2)
    assert tok.chat_template is not None and "tools" not in tok.chat_template
    assert tools_template(tok.chat_template) == CHATML_TOOLS
    assert tools_template("{{ tools }}") == "{{ tools }}"  # a template that knows tools
    assert tools_template("[INST] {{ m }}") is None
    req = parse_chat(
        body(
            messages=[
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Weather in Paris?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
            ],
            tools=tools(WEATHER),
        )
    )
    text = tok.decode(chat_prompt(req, tok), skip_special_tokens=False)
    functions = json.dumps([WEATHER], ensure_ascii=False)
    assert text.startswith("<|im_start|>system\nBe brief.\n\nYou can call the functions")
    assert f"<tools>{functions}</tools>\n" in text
    assert text.endswith(
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>[{"name": "get_weather", "arguments": '
        '{"city": "Paris"}}]</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n18 C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    none = parse_chat(body(tools=tools(WEATHER), tool_choice="none"))
    assert "<tools>" not in tok.decode(chat_prompt(none, tok), skip_special_tokens=False)


def test_arguments_that_are_not_json_are_a_400(smollm2: Path) -> None:
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}
    req = parse_chat(body(messages=[{"role": "assistant", "content": None, "tool_calls": [call]}]))
    with pytest.raises(APIError) as err:
        chat_prompt(req, Tokenizer(smollm2))
    assert err.value.param == "messages.0.tool_calls.0.function.arguments"
