"""The OpenAI wire schema: every field's range and type, a 400 naming the field (its dotted
path) for anything the request models reject, and the error object every refusal carries."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from helpers import MSGS, chat_body, completion_body

from api.errors import APIError
from api.protocol import parse_chat, parse_completion

# -- validation: every field's range, status 400 with the field named ----------------------------

SHARED_BAD: list[tuple[str, Any]] = [
    ("model", 5),
    ("max_tokens", 0),
    ("max_tokens", 1.5),
    ("temperature", -0.01),
    ("temperature", 2.01),
    ("temperature", "1"),
    ("temperature", True),
    ("top_p", 0),
    ("top_p", 1.01),
    ("n", 0),
    ("n", 17),
    ("n", True),
    ("stream", "yes"),
    ("stop", ["a", "b", "c", "d", "e"]),
    ("stop", ""),
    ("stop", ["ok", ""]),
    ("stop", 7),
    ("stop", ["a", 7]),
    ("seed", 2**63),
    ("seed", -(2**63) - 1),
    ("seed", 1.0),
    ("presence_penalty", -2.01),
    ("presence_penalty", 2.01),
    ("frequency_penalty", -2.01),
    ("frequency_penalty", 2.01),
    ("logit_bias", {"5": 100.5}),
    ("logit_bias", {"5": -101}),
    ("logit_bias", {"five": 1}),
    ("logit_bias", {"-5": 1}),
    ("logit_bias", {"5": "1"}),
    ("logit_bias", [5]),
    ("user", 5),
    ("top_k", -2),
    ("min_p", -0.1),
    ("min_p", 1.1),
    ("typical_p", 0),
    ("typical_p", 1.1),
    ("repetition_penalty", 0),
    ("repetition_penalty", -1),
    ("min_tokens", -1),
    ("ignore_eos", 1),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", [1.5]),
    ("stop_token_ids", 3),
    ("include_stop_str_in_output", "true"),
    ("temprature", 0.5),  # unknown field: a typo is an error, not a silent default
    ("best_of", 2),  # an OpenAI field this server does not implement
]


@pytest.mark.parametrize(("field", "value"), SHARED_BAD)
@pytest.mark.parametrize("parse", [parse_completion, parse_chat])
def test_shared_fields_out_of_range(parse: Callable[[bytes], Any], field: str, value: Any) -> None:
    body = completion_body if parse is parse_completion else chat_body
    with pytest.raises(APIError) as e:
        parse(body(**{field: value}))
    assert (e.value.status, e.value.type) == (400, "invalid_request_error")
    assert e.value.param is not None and e.value.param.split(".")[0] == field  # "stop.1"
    assert e.value.param in e.value.message


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"prompt": []}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": ["a", ""]}, "prompt"),
        ({"prompt": [[]]}, "prompt"),
        ({"prompt": [[1, 2], []]}, "prompt"),
        ({"prompt": [1, -2]}, "prompt"),
        ({"prompt": [1, True]}, "prompt"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"prompt": ["a", [1]]}, "prompt"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": None}, "prompt"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
        ({"echo": 1}, "echo"),
        ({"echo": False, "max_tokens": 0}, "max_tokens"),  # 0 only scores an echoed prompt
        ({"echo": True, "max_tokens": -1}, "max_tokens"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt_logprobs": True}, "prompt_logprobs"),
        ({"prompt_logprobs": "2"}, "prompt_logprobs"),
        ({"max_completion_tokens": 5}, "max_completion_tokens"),  # chat only
        ({"stream_options": {"include_usage": True}}, "stream_options"),  # needs stream
        ({"stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
        (
            {"stream": True, "stream_options": {"include_obfuscation": True}},
            "stream_options.include_obfuscation",
        ),
    ],
)
def test_completion_fields_out_of_range(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as e:
        parse_completion(completion_body(**fields))
    assert (e.value.status, e.value.param) == (400, param)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"role": "function", "content": "x"}]}, "messages.0.role"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.tool_call_id"),
        ({"messages": [MSGS[0], {"content": "x"}]}, "messages.1.role"),
        ({"messages": [{"role": "user"}]}, "messages.0.content"),
        ({"messages": [{"role": "user", "content": None}]}, "messages.0.content"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages.0.content",
        ),
        ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages.0.content"),
        (
            {"messages": [{"role": "user", "content": "x", "tool_calls": []}]},
            "messages.0.tool_calls",
        ),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"logprobs": 1}, "logprobs"),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"top_logprobs": -1, "logprobs": True}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs
        ({"prompt": "x"}, "prompt"),  # completions only
        ({"echo": True}, "echo"),  # completions only
        ({"prompt_logprobs": 1}, "prompt_logprobs"),  # completions only
        ({"tools": []}, "tools"),
    ],
)
def test_chat_fields_out_of_range(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as e:
        parse_chat(chat_body(**fields))
    assert (e.value.status, e.value.param) == (400, param)


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (b"{", "not valid JSON"),
        (b"", "the body is empty"),
        (b"\xff\xfe", "not valid JSON"),
        (b'{"model": "demo", "prompt": "\\ud800"}', "not valid JSON"),  # a lone surrogate
        (b"[1, 2]", "must be a JSON object"),
        (b'"text"', "must be a JSON object"),
        (b'{"prompt": "hi"}', "'model' is required"),
        (b'{"model": "demo", "prompt": "hi", "temperature": NaN}', "temperature"),
    ],
)
def test_malformed_bodies(body: bytes, needle: str) -> None:
    with pytest.raises(APIError) as e:
        parse_completion(body)
    assert e.value.status == 400 and needle in e.value.message


def test_error_body_is_openais_error_object() -> None:
    with pytest.raises(APIError) as e:
        parse_completion(completion_body(n=17))
    assert e.value.body() == {
        "error": {
            "message": "invalid value for 'n' (17): Input should be less than or equal to 16",
            "type": "invalid_request_error",
            "param": "n",
            "code": None,
        }
    }
    assert APIError(429, "slow down").type == "rate_limit_error"
    assert APIError(503, "draining", type="overloaded").type == "overloaded"
