"""Structured outputs through the cluster (docs/design.md#structured-outputs), on the real model
(SmolLM2-135M-Instruct, bf16) with the official ``openai`` client: ``chat.completions.parse``
with a pydantic model, vLLM's ``structured_outputs`` (regex, choice, grammar), bad schemas as
400s naming the field -- and, across a decode worker killed mid-JSON and a prefill worker
killed mid-transfer, the same tokens and logprobs as the fault-free run, for a JSON-schema
request and a ``required`` tool call (docs/design.md#tool-calling) alike: the prefill worker
masks the first token, and the worker that continues replays the grammar from the tokens
already out."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import openai
import pydantic
import pytest
import ray
from helpers import clear_faults, moves

from contracts.faults import Fault, FaultAction, FaultPlan, FaultPoint
from contracts.roles import NAMESPACE

pytestmark = pytest.mark.e2e
MODEL = "smollm2"
TOPOLOGY = """
model: {{path: {path}, name: smollm2}}
domains: [a, b]
pools:
  prefill: {{replicas: 2, num_cpus: 0.5, engine: {engine}}}
  decode: {{replicas: 2, num_cpus: 0.5, engine: {engine}}}
transport: grpc
router: {{local_prefill_max_tokens: 0}}
heartbeat_interval_s: 0.2
heartbeat_timeout_s: 5.0
"""
ENGINE = {"kv_cache_bytes": 2**25, "max_num_seqs": 8, "num_threads": 1}
WORKERS = ("prefill-0", "prefill-1", "decode-0", "decode-1")


class Person(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    name: str = pydantic.Field(max_length=20)
    age: int = pydantic.Field(ge=0, le=150)
    city: Literal["Paris", "Rome", "Oslo"]


@pytest.fixture(scope="module")
def client(
    serve_app: Any, smollm2: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[openai.OpenAI]:
    topology = tmp_path_factory.mktemp("structured") / "topology.yaml"
    topology.write_text(TOPOLOGY.format(path=smollm2, engine=ENGINE))
    url = serve_app(topology)
    yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)


def ask(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}]


def test_parse_with_a_pydantic_model_gives_a_valid_object(client: openai.OpenAI) -> None:
    reply = client.chat.completions.parse(
        model=MODEL,
        messages=ask("Describe a person as JSON."),
        response_format=Person,
        temperature=0,
        max_tokens=96,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Person)


def test_vllms_structured_outputs_hold_on_both_endpoints(client: openai.OpenAI) -> None:
    """A regex, a choice and a Lark grammar, each matched, ending by itself (``stop``)."""
    cases = [
        ({"regex": r"[0-9]{3}-[0-9]{4}"}, lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{4}", t)),
        ({"choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
        ({"grammar": 'start: "x" yz yz\nyz: "y" | "z"'}, lambda t: re.fullmatch("x[yz]{2}", t)),
    ]
    for spec, matches in cases:
        chat = client.chat.completions.create(
            model=MODEL,
            messages=ask("Answer."),
            temperature=1.0,
            seed=4,
            max_tokens=32,
            extra_body={"structured_outputs": spec},
        )
        text = client.completions.create(
            model=MODEL,
            prompt="Answer:",
            temperature=1.0,
            seed=4,
            max_tokens=32,
            extra_body={"structured_outputs": spec},
        )
        for choice, got in (
            (chat.choices[0], chat.choices[0].message.content),
            (text.choices[0], text.choices[0].text),
        ):
            assert choice.finish_reason == "stop" and got is not None and matches(got), (spec, got)


@pytest.mark.parametrize(
    ("extra", "param", "says"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "objekt"}},
                }
            },
            "response_format.json_schema.schema",
            "invalid json_schema",
        ),
        ({"structured_outputs": {"regex": "(abc"}}, "structured_outputs.regex", "unclosed group"),
        (
            {"structured_outputs": {"grammar": "start: nowhere"}},
            "structured_outputs.grammar",
            "nowhere",
        ),
        (
            {"structured_outputs": {"regex": "a", "choice": ["a"]}},
            "structured_outputs",
            "exactly one of json, regex, choice, grammar",
        ),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "structured_outputs",
            "not both",
        ),
    ],
)
def test_a_schema_or_grammar_that_cannot_be_used_is_a_400_naming_it(
    client: openai.OpenAI, extra: dict[str, Any], param: str, says: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL, messages=ask("Hi"), max_tokens=4, extra_body=extra
        )
    error = info.value.body
    assert isinstance(error, dict) and error["param"] == param and says in error["message"]


def faults_on(workers: tuple[str, ...], fault: Fault) -> None:
    for name in workers:
        actor = ray.get_actor(name, namespace=NAMESPACE)
        ray.get(actor.set_faults.remote(FaultPlan([fault])), timeout=60)


Reply = tuple[list[int], list[Any], str]


def person(client: openai.OpenAI) -> Reply:
    """A seeded, sampled JSON-schema request: its token ids (``token_id:N`` logprob names),
    its logprobs (each with its top 3) and its text."""
    reply = sampled(
        client,
        ask("Describe a person as JSON."),
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": Person.model_json_schema()},
        },
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content is not None
    Person.model_validate(json.loads(choice.message.content))
    return (*tokens(reply), choice.message.content)


def tool_call(client: openai.OpenAI) -> Reply:
    """A seeded, sampled ``required`` tool call: as ``person``, its arguments as its text."""
    tool = {"name": "describe", "parameters": Person.model_json_schema()}
    reply = sampled(
        client,
        ask("Describe a person."),
        tools=[{"type": "function", "function": tool}],
        tool_choice="required",
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    arguments = choice.message.tool_calls[0].function.arguments
    Person.model_validate(json.loads(arguments))
    return (*tokens(reply), arguments)


def sampled(client: openai.OpenAI, messages: Any, **kw: Any) -> Any:
    return client.chat.completions.create(
        model=MODEL,
        messages=messages,
        temperature=1.0,
        seed=21,
        max_tokens=96,
        logprobs=True,
        top_logprobs=3,
        extra_body={"return_tokens_as_token_ids": True},
        **kw,
    )


def tokens(reply: Any) -> tuple[list[int], list[Any]]:
    """A reply's token ids (``token_id:N`` logprob names) and logprobs (each with its top 3)."""
    content = reply.choices[0].logprobs.content
    ids = [int(t.token.removeprefix("token_id:")) for t in content]
    return ids, [(t.logprob, [(a.token, a.logprob) for a in t.top_logprobs]) for t in content]


@pytest.mark.parametrize(
    ("workers", "fault"),
    [
        (
            ("decode-0", "decode-1"),
            Fault(FaultPoint.DECODE_TOKENS, FaultAction.CRASH, at=9, attempt=1),
        ),
        (
            ("prefill-0", "prefill-1"),
            Fault(FaultPoint.TRANSFER_CHUNK, FaultAction.CRASH, at=12, attempt=1),
        ),
    ],
    ids=["decode-killed-mid-json", "prefill-killed-mid-transfer"],
)
@pytest.mark.parametrize("request_of", [person, tool_call], ids=["json-schema", "tool-call"])
def test_a_constrained_request_survives_a_worker_killed_exactly(
    client: openai.OpenAI,
    workers: tuple[str, ...],
    fault: Fault,
    request_of: Callable[[openai.OpenAI], Reply],
) -> None:
    """The fault-free run, then the same request with the worker that serves it killed (the
    stream moved once: a migration, or a retry before the first token): the same token ids,
    logprobs (top 3 included) and text, bit for bit; the JSON still valid."""
    url = str(client.base_url).removesuffix("/v1/")
    want = request_of(client)
    before = moves(url)
    faults_on(workers, fault)
    try:
        got = request_of(client)
    finally:
        clear_faults(WORKERS)
    assert moves(url) == before + 1
    assert got == want
