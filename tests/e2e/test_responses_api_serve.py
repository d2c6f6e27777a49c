"""The Responses API (docs/design.md#responses-api) and vLLM's /tokenize and /detokenize, on the
real model (SmolLM2-135M-Instruct, bf16) with the official ``openai`` client: ``responses.create``
plain, streamed (its typed events ending with the very response the unstreamed request gets),
with a function tool and with a JSON-schema format; state it does not keep is a 400 saying so."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest
import requests

pytestmark = pytest.mark.e2e
MODEL = "smollm2"
WEATHER: Any = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}
CAPITAL = {
    "type": "object",
    "properties": {"country": {"type": "string"}, "capital": {"type": "string"}},
    "required": ["country", "capital"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def url(smollm2_pd_url: str) -> str:
    return smollm2_pd_url


@pytest.fixture(scope="module")
def client(url: str) -> Iterator[openai.OpenAI]:
    yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)


def without_drawn(obj: Any) -> Any:
    """``obj`` without what a response draws afresh each time: the ids (its own, its items',
    its calls') and its creation time."""
    if isinstance(obj, dict):
        drawn = ("id", "call_id", "created_at")
        return {k: without_drawn(v) for k, v in obj.items() if k not in drawn}
    if isinstance(obj, list):
        return [without_drawn(v) for v in obj]
    return obj


def test_a_plain_response_answers_the_question(client: openai.OpenAI) -> None:
    reply = client.responses.create(
        model=MODEL,
        instructions="Answer in one short sentence.",
        input="What is the capital of France?",
        temperature=0,
        max_output_tokens=32,
    )
    assert reply.status == "completed" and reply.id.startswith("resp_")
    assert [item.type for item in reply.output] == ["message"]
    assert "Paris" in reply.output_text
    assert reply.usage is not None and reply.usage.output_tokens > 0
    assert reply.usage.total_tokens == reply.usage.input_tokens + reply.usage.output_tokens


def test_out_of_output_tokens_is_incomplete(client: openai.OpenAI) -> None:
    reply = client.responses.create(
        model=MODEL, input="Tell me a long story.", temperature=0, max_output_tokens=4
    )
    assert reply.status == "incomplete" and reply.incomplete_details is not None
    assert reply.incomplete_details.reason == "max_output_tokens"
    assert reply.usage is not None and reply.usage.output_tokens == 4


@pytest.mark.parametrize("kind", ["text", "tool", "json_schema"])
def test_a_stream_s_events_end_with_the_unstreamed_response(
    client: openai.OpenAI, kind: str
) -> None:
    """The typed events in order (created, in progress, each item added, its deltas, done,
    completed, numbered from 0); the deltas add up to the items; the final response is the
    one the same seeded request gets unstreamed, but for the ids each draws."""
    kw: dict[str, Any] = {
        "model": MODEL,
        "input": "What is the weather like in Paris?",
        "temperature": 1.0,
        "max_output_tokens": 48,
        "extra_body": {"seed": 5},
    }
    if kind == "tool":
        kw |= {"tools": [WEATHER], "tool_choice": "required"}
    elif kind == "json_schema":
        kw["text"] = {"format": {"type": "json_schema", "name": "capital", "schema": CAPITAL}}
    want = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response  # type: ignore[union-attr]
    assert without_drawn(final.model_dump()) == without_drawn(want.model_dump())
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert added == [item.type for item in final.output]
    if kind == "tool":
        assert added == ["function_call"] and final.output_text == "" and text == ""
        call = final.output[0]
        assert call.type == "function_call" and call.name == "get_weather"
        assert args == call.arguments
        jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    else:
        assert added == ["message"] and text == final.output_text and args == ""
    if kind == "json_schema" and final.status == "completed":
        jsonschema.validate(json.loads(final.output_text), CAPITAL)


def test_a_function_call_round_trips(client: openai.OpenAI) -> None:
    """Call -> the output sent back as a ``function_call_output`` item -> an answer in text."""
    question: Any = [{"role": "user", "content": "What is the weather like in Paris?"}]
    first = client.responses.create(
        model=MODEL, input=question, tools=[WEATHER], tool_choice="required", temperature=0
    )
    call = first.output[0]
    assert call.type == "function_call" and json.loads(call.arguments) == {"city": "Paris"}
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "18 C, sunny"}
    answer = client.responses.create(
        model=MODEL,
        input=[*question, *first.output, result],  # the items as the client got them
        tools=[WEATHER],
        temperature=0,
        max_output_tokens=40,
    )
    assert answer.output and answer.output[0].type == "message" and answer.output_text


@pytest.mark.parametrize(
    ("kw", "param", "says"),
    [
        ({"store": True}, "store", "keeps no responses"),
        ({"previous_response_id": "resp_1"}, "previous_response_id", "keeps no responses"),
        ({"reasoning": {"effort": "low"}}, "reasoning", "unknown field"),
        ({"tool_choice": "required"}, "tool_choice", "only allowed when tools are given"),
    ],
)
def test_what_is_not_kept_or_not_implemented_is_a_400(
    client: openai.OpenAI, kw: dict[str, Any], param: str, says: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, input="Hi", max_output_tokens=4, **kw)
    error = info.value.body
    assert isinstance(error, dict) and error["param"] == param and says in error["message"]


def test_tokenize_counts_what_the_server_runs_and_detokenize_reverses_it(url: str) -> None:
    question = [{"role": "user", "content": "What is the capital of France?"}]

    def post(path: str, body: dict[str, Any]) -> requests.Response:
        return requests.post(f"{url}{path}", json=body, timeout=60)

    chat = post("/tokenize", {"model": MODEL, "messages": question}).json()
    body = {"model": MODEL, "messages": question, "max_tokens": 1}
    reply = post("/v1/chat/completions", body).json()
    assert chat["count"] == reply["usage"]["prompt_tokens"] == len(chat["tokens"])
    assert chat["max_model_len"] > chat["count"]
    text = post("/detokenize", {"tokens": chat["tokens"]}).json()["prompt"]
    assert text.startswith("<|im_start|>") and text.endswith("<|im_start|>assistant\n")
    plain = post("/tokenize", {"prompt": "Paris", "return_token_strs": True}).json()
    assert plain["token_strs"] == ["Paris"] and plain["count"] == 1
    bad = post("/detokenize", {"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert post("/tokenize", {"model": "gpt-4", "prompt": "x"}).status_code == 404
