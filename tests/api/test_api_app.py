"""The request path's last resort: a bug anywhere on it (here a tokenizer that raises) is an
OpenAI error object of type ``internal_error`` naming the request, logged with its traceback
under the same id, never Starlette's plain-text 500; the request's gate slot is returned."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import AsyncIterator
from typing import Any

import pytest
from starlette.testclient import TestClient

from api.app import Service
from api.edge import OpenAIApp
from api.gate import DEFAULT_TENANT, GateConfig, IngressGate
from api.metrics import Metrics
from engine.outputs import TokenDelta, TokenLogprobs
from engine.request import FinishReason


class BrokenTokenizer:
    """A tokenizer with a bug: every call raises (token id prompts need none to get in)."""

    vocab_size = 2048

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(f"tokenizer bug in {name}")


class OneDelta:
    """A coordinator whose every choice gets one final token, with its logprob."""

    def generate(self, spec: Any, share: Any = None) -> AsyncIterator[TokenDelta]:
        return Run()


class Run:
    record = None  # what a finished choice's timing reads; None: nothing to observe

    def __init__(self) -> None:
        lp = TokenLogprobs(-1.0, [], 1)
        self._left = [
            TokenDelta("r", [5], "x", finished=True, finish_reason=FinishReason.EOS, logprobs=[lp])
        ]

    def __aiter__(self) -> Run:
        return self

    async def __anext__(self) -> TokenDelta:
        if not self._left:
            raise StopAsyncIteration
        return self._left.pop()

    async def aclose(self) -> None:
        self._left = []


@pytest.fixture
def service() -> Service:
    return Service(
        OneDelta(),  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]  # the request path never asks the router
        BrokenTokenizer(),  # type: ignore[arg-type]
        "demo",
        512,
        BrokenTokenizer.vocab_size,
        IngressGate(GateConfig()),
        Metrics(),
        None,
    )


@pytest.fixture
def client(service: Service) -> TestClient:
    app = OpenAIApp()
    app.post("/v1/completions")(service.completions)
    return TestClient(app)


def logged_ids(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The request ids of the internal errors logged with a traceback."""
    return [
        r.getMessage().split(":")[0]
        for r in caplog.records
        if "internal error" in r.getMessage() and r.exc_info is not None
    ]


def test_a_bug_before_the_first_token_is_a_500_error_object(
    client: TestClient, service: Service, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR, logger="tandem.api"):
        r = client.post("/v1/completions", json={"model": "demo", "prompt": "hi"})
    assert r.status_code == 500 and r.headers["content-type"] == "application/json"
    error = r.json()["error"]
    match = re.fullmatch(
        r"internal error: RuntimeError \(request (cmpl-[0-9a-f]+)\)", error["message"]
    )
    assert match is not None, error["message"]
    assert (error["type"], error["param"], error["code"]) == ("internal_error", None, None)
    assert logged_ids(caplog) == [match.group(1)]
    assert service.gate.in_flight(DEFAULT_TENANT) == 0


class BrokenCoordinator:
    def generate(self, spec: Any, share: Any = None) -> AsyncIterator[TokenDelta]:
        raise RuntimeError("no run")


def test_a_coordinator_that_fails_to_start_a_choice_is_a_500_not_a_hang(
    client: TestClient, service: Service
) -> None:
    """A bug raised by ``Coordinator.generate`` itself (before any token) ends the request."""
    service.choices.coordinator = BrokenCoordinator()  # type: ignore[assignment]
    body = {"model": "demo", "prompt": [5, 6], "n": 2}
    r = client.post("/v1/completions", json=body, timeout=30)
    assert r.status_code == 500
    assert r.json()["error"]["message"].startswith("internal error: RuntimeError (request cmpl-")
    assert service.gate.in_flight(DEFAULT_TENANT) == 0


def test_a_bug_mid_stream_is_an_error_event(
    client: TestClient, service: Service, caplog: pytest.LogCaptureFixture
) -> None:
    """The headers went out with the first token: the error travels as an event before [DONE]."""
    body = {"model": "demo", "prompt": [5, 6], "stream": True, "logprobs": 1}
    with caplog.at_level(logging.ERROR, logger="tandem.api"):
        r = client.post("/v1/completions", json=body)
    assert r.status_code == 200
    events = [line.removeprefix("data: ") for line in r.text.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    (error,) = [json.loads(e)["error"] for e in events[:-1]]
    assert error["type"] == "internal_error"
    assert error["message"].startswith("internal error: RuntimeError (request cmpl-")
    assert logged_ids(caplog) == [error["message"].split("request ")[1].rstrip(")")]
    assert service.gate.in_flight(DEFAULT_TENANT) == 0


def test_a_bug_in_any_route_is_a_500_error_object(caplog: pytest.LogCaptureFixture) -> None:
    """Starlette's last resort answers with the error object too (and re-raises to the server,
    which a TestClient that does not raise lets pass)."""
    app = OpenAIApp()

    @app.get("/boom")
    async def boom() -> None:
        raise KeyError("x")

    with caplog.at_level(logging.ERROR, logger="tandem.api"):
        r = TestClient(app, raise_server_exceptions=False).get("/boom")
    assert r.status_code == 500
    assert r.json() == {
        "error": {
            "message": "internal error: KeyError (request GET /boom)",
            "type": "internal_error",
            "param": None,
            "code": None,
        }
    }
    assert logged_ids(caplog) == ["GET /boom"]
