"""The API's edges through the real Serve deployment (1 prefill + 1 decode worker): unknown
paths and wrong methods, the Content-Type rule, the bound on a request's choices, and a
schemathesis run driven by the served OpenAPI document that must meet no server error and only
OpenAI error objects."""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import requests
import schemathesis
from helpers import integral
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core import NOT_SET
from schemathesis.specs.openapi.checks import response_schema_conformance

from api.errors import ErrorResponse

pytestmark = pytest.mark.e2e
MODEL = "test-llama"
MAX_CHOICES = 4
ENGINE = {"kv_cache_bytes": 4 * 2**20, "max_num_seqs": 8, "max_num_batched_tokens": 256}
TOPOLOGY = """
model: {{path: {path}, name: test-llama}}
domains: [a, b]
pools:
  prefill: {{replicas: 1, num_cpus: 0.5, engine: {engine}}}
  decode: {{replicas: 1, num_cpus: 0.5, engine: {engine}}}
transport: grpc
router: {{local_prefill_max_tokens: 0}}
heartbeat_interval_s: 0.2
heartbeat_timeout_s: 5.0
serve:
  gate: {{max_choices: {max_choices}}}
"""


@pytest.fixture(scope="module")
def server(
    serve_app: Callable[[Path], str], test_llama: Path, tmp_path_factory: pytest.TempPathFactory
) -> str:
    """The ingress replica's own URL (direct ingress, as ``tandem serve`` runs it)."""
    topology = tmp_path_factory.mktemp("edges") / "topology.yaml"
    text = TOPOLOGY.format(path=test_llama, engine=ENGINE, max_choices=MAX_CHOICES)
    topology.write_text(text)
    return serve_app(topology)


@pytest.fixture(scope="module", params=["direct", "proxy"])
def url(request: pytest.FixtureRequest, server: str, serve_app: Any) -> str:
    """The replica's own port, and Serve's proxy in front of the same application."""
    if request.param == "direct":
        return server
    return f"http://127.0.0.1:{serve_app.proxy_port}"


def error(message: str, type: str, code: str | None, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def completion(url: str, body: Any, headers: dict[str, str] | None = None) -> requests.Response:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"} if headers is None else headers
    return requests.post(f"{url}/v1/completions", data=data, headers=headers, timeout=60)


# -- routing -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [("GET", "/v1/completions", "POST"), ("POST", "/v1/models", "GET"), ("PUT", "/health", "GET")],
)
def test_a_wrong_method_is_a_405_error_object(url: str, method: str, path: str, allow: str) -> None:
    r = requests.request(method, f"{url}{path}", timeout=30)
    assert r.status_code == 405
    assert r.headers["Allow"] == allow
    msg = f"method not allowed: {method} {path} (allowed: {allow})"
    assert r.json() == error(msg, "invalid_request_error", "method_not_allowed")


@pytest.mark.parametrize(("method", "path"), [("GET", "/nope"), ("POST", "/v1/completions/")])
def test_an_unknown_path_is_a_404_error_object(url: str, method: str, path: str) -> None:
    r = requests.request(method, f"{url}{path}", timeout=30, allow_redirects=False)
    assert r.status_code == 404
    assert r.json() == error(f"no endpoint at {method} {path}", "not_found_error", "unknown_url")


# -- Content-Type ---------------------------------------------------------------------------------


def test_a_non_json_content_type_is_a_415(server: str) -> None:
    ok = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    r = completion(server, ok, headers={"Content-Type": "text/plain"})
    assert r.status_code == 415
    msg = "Content-Type 'text/plain' is not supported: send the body as application/json"
    assert r.json() == error(msg, "invalid_request_error", "unsupported_media_type", "Content-Type")
    form = requests.post(f"{server}/v1/completions", data=ok, timeout=60)  # form-encoded
    assert form.status_code == 415
    assert form.json()["error"]["message"] == (
        "Content-Type 'application/x-www-form-urlencoded' is not supported: send the body as "
        "application/json"
    )


def test_a_json_body_without_content_type_is_read(server: str) -> None:
    ok = {"model": MODEL, "prompt": "x", "max_tokens": 2, "ignore_eos": True}
    r = completion(server, ok, headers={})
    assert "Content-Type" not in r.request.headers
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2
    bad = completion(server, b'{"model": "test-llama",', headers={})
    assert bad.status_code == 400
    msg = "the body is not valid JSON: EOF while parsing a value at line 1 column 23"
    assert bad.json() == error(msg, "invalid_request_error", None)


def test_a_timeout_past_a_day_is_a_400(server: str) -> None:
    """Not a deadline an engine's wait would overflow on (a fuzzer's 1e308 did, as a 503)."""
    ok = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    r = completion(server, ok, headers={"X-Request-Timeout": "1e300"})
    assert r.status_code == 400
    msg = "X-Request-Timeout: 1e+300 s is longer than this server's limit of 86400 s"
    assert r.json() == error(msg, "invalid_request_error", "invalid_timeout", "X-Request-Timeout")
    r = completion(server, {**ok, "timeout": 1e300})
    assert r.status_code == 400
    msg = "invalid value for 'timeout' (1e+300): Input should be less than or equal to 86400"
    assert r.json() == error(msg, "invalid_request_error", None, "timeout")


def test_every_answer_names_its_response_in_x_request_id(url: str) -> None:
    """The response's id in a header on every answer -- an error's body has none, and a client
    quotes it to find the request in the logs -- through the replica and through Serve's proxy."""
    ok = {"model": MODEL, "prompt": "x", "max_tokens": 2, "ignore_eos": True}
    r = completion(url, ok)
    assert r.status_code == 200 and r.headers["X-Tandem-Request-Id"] == r.json()["id"]
    with requests.post(
        f"{url}/v1/completions", json={**ok, "stream": True}, stream=True, timeout=60
    ) as s:
        first = next(line for line in s.iter_lines() if line.startswith(b"data: "))
        assert s.headers["X-Tandem-Request-Id"] == json.loads(first[len(b"data: ") :])["id"]
    bad = completion(url, {**ok, "n": 5})
    assert bad.status_code == 400
    assert re.fullmatch(r"cmpl-[0-9a-f]{32}", bad.headers["X-Tandem-Request-Id"])
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 5}
    r = requests.post(f"{url}/v1/chat/completions", json=chat, timeout=60)
    assert r.status_code == 400
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{32}", r.headers["X-Tandem-Request-Id"])
    ids = {
        r.headers["X-Tandem-Request-Id"],
        bad.headers["X-Tandem-Request-Id"],
        s.headers["X-Tandem-Request-Id"],
    }
    assert len(ids) == 3  # one per answer


# -- the bound on choices -------------------------------------------------------------------------


@pytest.mark.parametrize(("prompts", "n", "param"), [(5, 1, "prompt"), (2, 3, "n")])
def test_choices_over_the_bound_are_a_400(server: str, prompts: int, n: int, param: str) -> None:
    body = {"model": MODEL, "prompt": ["x"] * prompts, "n": n, "max_tokens": 1}
    r = completion(server, body)
    assert r.status_code == 400
    msg = (
        f"the request asks for {prompts * n} choices ({prompts} prompt(s) x n={n}); "
        f"this server runs at most {MAX_CHOICES} per request (max_choices)"
    )
    assert r.json() == error(msg, "invalid_request_error", "too_many_choices", param)


def test_chat_n_over_the_bound_is_a_400(server: str) -> None:
    body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 5}
    r = requests.post(f"{server}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "n"
    assert r.json()["error"]["code"] == "too_many_choices"


def test_choices_up_to_the_bound_are_served(server: str) -> None:
    body = {"model": MODEL, "prompt": ["a", "b"], "n": 2, "max_tokens": 2, "ignore_eos": True}
    r = completion(server, body)
    assert r.status_code == 200, r.text
    assert [c["index"] for c in r.json()["choices"]] == [0, 1, 2, 3]


# -- schema-driven requests ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def document(server: str) -> dict[str, Any]:
    r = requests.get(f"{server}/openapi.json", timeout=30)
    assert r.status_code == 200
    return dict(r.json())


def bounded(document: dict[str, Any]) -> dict[str, Any]:
    """The document with bounds that only keep a run of valid requests short: generations of
    a few tokens (without max_tokens a request may run to the end of the context) for the
    served model, and no deadline shorter than the run (a nanosecond ``timeout`` rightly ends
    in 504). The topology's max_choices bounds the choices per request."""
    doc = copy.deepcopy(document)
    schemas = doc["components"]["schemas"]
    for name, limit in [
        ("CompletionRequest", "max_tokens"),
        ("ChatCompletionRequest", "max_completion_tokens"),  # it wins over max_tokens
    ]:
        fields = schemas[name]["properties"]
        fields["model"] = {"const": MODEL}
        fields[limit] = {"type": "integer", "minimum": 1, "maximum": 4}
        fields["timeout"] = {"type": "number", "minimum": 30, "maximum": 60}
        schemas[name]["required"].append(limit)
    return doc


def openai_error_object(ctx: Any, response: Any, case: Any) -> None:
    """Every 4xx and 5xx body is exactly OpenAI's error object."""
    if response.status_code >= 400:
        ErrorResponse.model_validate_json(response.content)


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_schema_driven_requests_meet_no_server_error(
    server: str, document: dict[str, Any], mode: GenerationMode
) -> None:
    """Valid requests (by the bounded document) to every operation; invalid ones (by the
    served document, unchanged) to the two that take a body."""
    if mode is GenerationMode.POSITIVE:
        operations: Any = schemathesis.openapi.from_dict(bounded(document))
    else:
        operations = schemathesis.openapi.from_dict(document).include(method="POST")
    statuses: list[int] = []

    @settings(
        max_examples=100, deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        case = data.draw(operations.as_strategy(generation_mode=mode))
        if mode is GenerationMode.POSITIVE and case.body is not NOT_SET:  # reach generation
            case.body = integral(case.body)
        response = case.call(base_url=server, timeout=60)
        statuses.append(response.status_code)
        case.validate_response(
            response,
            checks=[not_a_server_error, response_schema_conformance, openai_error_object],
        )

    run()
    assert statuses and max(statuses) < 500
    if mode is GenerationMode.POSITIVE:
        assert 200 in statuses  # real generations ran, not only refusals
