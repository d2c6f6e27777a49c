"""The API's edges without a cluster: what no route answers (404 / 405 as OpenAI error objects),
the Content-Type rule (415), the bound on a request's choices, what a malformed body's 400
says, and the OpenAPI document against the parser it describes.

Routing errors and the document are the real application's (``tandem.deployment.app``, driven
in memory with Starlette's TestClient): they are answered before any route's handler runs, so
no Serve replica is needed. Through a real deployment: tests/e2e/test_api_edges_serve.py."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest
import schemathesis
from helpers import integral
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from starlette.testclient import TestClient

from api.errors import APIError, ErrorResponse
from api.gate import GateConfig
from api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    check_content_type,
    parse_chat,
    parse_completion,
)
from api.responses_api import parse_responses
from api.translate import check_choices
from tandem.deployment import app

MSGS = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def client() -> TestClient:
    return TestClient(app)


@pytest.fixture(scope="module")
def document(client: TestClient) -> dict[str, Any]:
    r = client.get("/openapi.json")
    assert r.status_code == 200
    return dict(r.json())


def error(message: str, type: str, code: str | None, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# -- routing -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [
        ("GET", "/v1/completions", "POST"),
        ("PUT", "/v1/chat/completions", "POST"),
        ("POST", "/v1/models", "GET"),
        ("DELETE", "/health", "GET"),
    ],
)
def test_a_wrong_method_is_a_405_error_object(
    client: TestClient, method: str, path: str, allow: str
) -> None:
    r = client.request(method, path)
    assert r.status_code == 405
    assert r.headers["allow"] == allow
    assert r.headers["content-type"] == "application/json"
    msg = f"method not allowed: {method} {path} (allowed: {allow})"
    assert r.json() == error(msg, "invalid_request_error", "method_not_allowed")


@pytest.mark.parametrize(
    ("method", "path"),
    [("GET", "/nope"), ("POST", "/v1/completion"), ("POST", "/v1/completions/"), ("GET", "/")],
)
def test_an_unknown_path_is_a_404_error_object(client: TestClient, method: str, path: str) -> None:
    r = client.request(method, path, follow_redirects=False)
    assert r.status_code == 404
    assert "allow" not in r.headers
    assert r.json() == error(f"no endpoint at {method} {path}", "not_found_error", "unknown_url")


# -- the OpenAPI document ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "model"),
    [("/v1/completions", CompletionRequest), ("/v1/chat/completions", ChatCompletionRequest)],
)
def test_the_document_declares_bodies_and_error_objects(
    document: dict[str, Any], path: str, model: type
) -> None:
    post = document["paths"][path]["post"]
    name = model.__name__
    assert post["requestBody"] == {
        "required": True,
        "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}},
    }
    assert set(post["responses"]) == {"200", "4XX", "5XX"}
    assert set(post["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    for status in ("4XX", "5XX"):
        schema = post["responses"][status]["content"]["application/json"]["schema"]
        assert schema == {"$ref": "#/components/schemas/ErrorResponse"}
    schemas = document["components"]["schemas"]
    assert schemas[name]["additionalProperties"] is False
    assert {"ErrorResponse", "ErrorInfo", "StreamOptions", "ChatMessage"} <= set(schemas)


def validator(document: dict[str, Any], name: str) -> jsonschema.Draft202012Validator:
    """A JSON Schema validator of component ``name`` with the document's components in reach."""
    schema = {"$ref": f"#/components/schemas/{name}", "components": document["components"]}
    return jsonschema.Draft202012Validator(schema)


@pytest.mark.parametrize(
    "prompt", ["hi", ["a", "b"], [1, 2, 3], [[1, 2], [3]], ["x"], [[0]]], ids=repr
)
def test_every_prompt_form_the_parser_takes_is_in_the_schema(
    document: dict[str, Any], prompt: Any
) -> None:
    body = {"model": "m", "prompt": prompt, "stop": "\n"}
    assert validator(document, "CompletionRequest").is_valid(body)
    parse_completion(json.dumps(body).encode())


@pytest.mark.parametrize(
    "fields",
    [
        {"prompt": []},
        {"prompt": ""},
        {"prompt": [[]]},
        {"prompt": [-1]},
        {"prompt": "hi", "stop": ""},
        {"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]},
        {"prompt": "hi", "max_tokens": -1},
        {"prompt": "hi", "prompt_logprobs": 21},
        {"prompt": "hi", "n": 17},
        {"prompt": "hi", "temprature": 0.5},
    ],
    ids=repr,
)
def test_what_the_schema_refuses_the_parser_refuses(
    document: dict[str, Any], fields: dict[str, Any]
) -> None:
    body = {"model": "m", **fields}
    assert not validator(document, "CompletionRequest").is_valid(body)
    with pytest.raises(APIError) as e:
        parse_completion(json.dumps(body).encode())
    assert e.value.status == 400


def test_chat_content_parts_are_in_the_schema(document: dict[str, Any]) -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    body = {"model": "m", "messages": [{"role": "user", "content": parts}]}
    assert validator(document, "ChatCompletionRequest").is_valid(body)
    assert parse_chat(json.dumps(body).encode()).messages[0].content == "a\nb"
    image = [{"type": "image_url", "image_url": {"url": "x"}}]
    body = {"model": "m", "messages": [{"role": "user", "content": image}]}
    assert not validator(document, "ChatCompletionRequest").is_valid(body)


# Rules the schema does not state (one field's validity depending on another's): a body valid
# by the schema may still be refused for these, never for anything else.
# max_tokens 0: only with echo; structured_outputs: not beside a non-text response_format
_CROSS_FIELD = {
    "stream_options",
    "top_logprobs",
    "max_tokens",
    "structured_outputs",
    "tools",  # two with one name
    "tool_choice",  # naming a function not among the tools, or without tools
    "store",  # true: nothing is kept
    "previous_response_id",  # nothing to continue
}
# A message's fields that depend on its role (content null only beside tool_calls...).
_MESSAGE_CROSS_FIELD = re.compile(r"messages\.[0-9]+\.(content|tool_calls|tool_call_id)")


@pytest.fixture(scope="module")
def bodies(document: dict[str, Any]) -> dict[str, st.SearchStrategy[Any]]:
    """Each generation route's bodies, as schemathesis generates them from the document."""
    schema = schemathesis.openapi.from_dict(document)
    return {
        path: schema[path]["POST"].as_strategy().map(lambda case: case.body)
        for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses")
    }


@pytest.mark.parametrize(
    ("path", "parse"),
    [
        ("/v1/completions", parse_completion),
        ("/v1/chat/completions", parse_chat),
        ("/v1/responses", parse_responses),
    ],
)
@settings(
    max_examples=50,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_bodies_generated_from_the_schema_parse(
    bodies: dict[str, st.SearchStrategy[Any]], path: str, parse: Any, data: st.DataObject
) -> None:
    body = data.draw(bodies[path])
    try:
        parse(json.dumps(integral(body)).encode())
    except APIError as exc:
        assert exc.param is not None, exc.message
        cross_field = exc.param.split(".")[0] in _CROSS_FIELD
        assert cross_field or _MESSAGE_CROSS_FIELD.fullmatch(exc.param), exc.message


# -- Content-Type ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "content_type",
    [None, "application/json", "application/json; charset=utf-8", "Application/JSON ;x=1"],
)
def test_json_or_no_content_type_is_read(content_type: str | None) -> None:
    check_content_type(content_type)


@pytest.mark.parametrize(
    "content_type",
    ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", ""],
)
def test_another_content_type_is_a_415(content_type: str) -> None:
    with pytest.raises(APIError) as e:
        check_content_type(content_type)
    assert e.value.status == 415
    msg = f"Content-Type {content_type!r} is not supported: send the body as application/json"
    assert e.value.body() == error(
        msg, "invalid_request_error", "unsupported_media_type", "Content-Type"
    )


# -- the bound on choices -------------------------------------------------------------------------


def test_choices_up_to_the_bound_pass() -> None:
    check_choices(4, 1, 4)
    check_choices(1, 4, 4)
    check_choices(2, 2, 4)


@pytest.mark.parametrize(
    ("prompts", "n", "param"), [(5, 1, "prompt"), (2, 3, "n"), (1, 5, "n"), (5, 2, "prompt")]
)
def test_choices_over_the_bound_are_a_400(prompts: int, n: int, param: str) -> None:
    with pytest.raises(APIError) as e:
        check_choices(prompts, n, 4)
    msg = (
        f"the request asks for {prompts * n} choices ({prompts} prompt(s) x n={n}); "
        "this server runs at most 4 per request (max_choices)"
    )
    assert e.value.status == 400
    assert e.value.body() == error(msg, "invalid_request_error", "too_many_choices", param)


def test_max_choices_is_configured_and_checked() -> None:
    assert GateConfig().max_choices == 64
    assert GateConfig(max_choices=4).max_choices == 4
    with pytest.raises(ValidationError) as e:
        GateConfig(max_choices=0)
    [err] = e.value.errors()
    assert (err["loc"], err["type"]) == (("max_choices",), "greater_than_equal")


# -- what a malformed body's 400 says ------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"", "the body is empty: expected a JSON object"),
        (b" \n", "the body is empty: expected a JSON object"),
        (b"{", "the body is not valid JSON: EOF while parsing an object at line 1 column 1"),
        (
            b'{"model": "m",\n "prompt": "hi",}',
            "the body is not valid JSON: trailing comma at line 2 column 17",
        ),
        (b"[1, 2]", "the body must be a JSON object, not an array"),
        (b'"text"', "the body must be a JSON object, not a string"),
        (b"1.5", "the body must be a JSON object, not a number"),
        (b"true", "the body must be a JSON object, not a boolean"),
        (b"null", "the body must be a JSON object, not null"),
    ],
)
def test_a_malformed_body_says_what_is_wrong(body: bytes, message: str) -> None:
    with pytest.raises(APIError) as e:
        parse_completion(body)
    assert e.value.body() == error(message, "invalid_request_error", None)


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        (
            {"max_tokens": "8"},
            "max_tokens",
            "invalid value for 'max_tokens' ('8'): Input should be a valid integer",
        ),
        (
            {"stream_options": {"include_usage": 1}, "stream": True},
            "stream_options.include_usage",
            "invalid value for 'stream_options.include_usage' (1): Input should be a valid boolean",
        ),
        (
            {"logit_bias": {"5": "up"}},
            "logit_bias.5",
            "invalid value for 'logit_bias.5' ('up'): Input should be a valid number",
        ),
    ],
)
def test_a_wrong_type_names_the_field_path_and_the_type(
    fields: dict[str, Any], param: str, message: str
) -> None:
    with pytest.raises(APIError) as e:
        parse_completion(json.dumps({"model": "m", "prompt": "hi", **fields}).encode())
    assert e.value.body() == error(message, "invalid_request_error", None, param)


def test_error_bodies_are_the_documented_object() -> None:
    body = APIError(503, "draining", code="failed", retry_after_s=2.0).body()
    assert ErrorResponse.model_validate(body).model_dump() == body
    assert body == error("draining", "service_unavailable_error", "failed")
