"""Structured outputs hold for any schema, regex or choice (docs/design.md#structured-outputs): a
property test over JSON schemas drawn from a small generator (nesting, enums, bounded integers,
strings and arrays, ``additionalProperties: false``), regexes built from pieces, and choices --
run as one sampled batch on the real model (SmolLM2-135M-Instruct, bf16), every output ends by
itself (``stop``) and matches."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.request import FinishReason
from engine.sampling_params import Constraint, SamplingParams

NAMES = ("id", "name", "tags", "size", "ok", "kind", "items", "note")
WORDS = ("red", "green", "blue", "north", "south", "alpha", "beta", "x y")

leaves = st.one_of(
    st.integers(1, 12).map(lambda n: {"type": "string", "maxLength": n}),
    st.tuples(st.integers(-50, 50), st.integers(0, 100)).map(
        lambda ab: {"type": "integer", "minimum": ab[0], "maximum": ab[0] + ab[1]}
    ),
    st.lists(st.sampled_from(WORDS), min_size=1, max_size=4, unique=True).map(
        lambda ws: {"enum": ws}
    ),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
)


def containers(children: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    objects = st.dictionaries(st.sampled_from(NAMES), children, min_size=1, max_size=4).flatmap(
        lambda props: st.lists(st.sampled_from(sorted(props)), unique=True).map(
            lambda required: {
                "type": "object",
                "properties": props,
                "required": required,
                "additionalProperties": False,
            }
        )
    )
    arrays = st.tuples(children, st.integers(0, 2), st.integers(0, 2)).map(
        lambda t: {"type": "array", "items": t[0], "minItems": t[1], "maxItems": t[1] + t[2]}
    )
    return st.one_of(objects, arrays)


schemas = st.recursive(leaves, containers, max_leaves=6).filter(
    lambda s: s.get("type") in ("object", "array")
)
regexes = st.lists(
    st.sampled_from(["[a-z]{1,4}", "[0-9]{2}", "(cat|dog)", "-", "[A-F]?", "x{1,3}"]),
    min_size=1,
    max_size=4,
).map("".join)
choices = st.lists(st.sampled_from(WORDS), min_size=2, max_size=5, unique=True)


@pytest.fixture(scope="module")
def engine(smollm2: Path) -> LLMEngine:
    return LLMEngine.from_checkpoint(smollm2, EngineConfig(kv_cache_bytes=2**26, max_num_seqs=16))


@settings(
    max_examples=3,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    drawn_schemas=st.lists(schemas, min_size=6, max_size=6),
    drawn_regexes=st.lists(regexes, min_size=3, max_size=3),
    drawn_choices=st.lists(choices, min_size=2, max_size=2),
    seed=st.integers(0, 2**31 - 1),
)
def test_every_constrained_output_ends_and_matches(
    engine: LLMEngine,
    drawn_schemas: list[dict[str, Any]],
    drawn_regexes: list[str],
    drawn_choices: list[list[str]],
    seed: int,
) -> None:
    constraints = [Constraint("json_schema", json.dumps(s)) for s in drawn_schemas]
    constraints += [Constraint("regex", r) for r in drawn_regexes]
    constraints += [Constraint.choice(c) for c in drawn_choices]
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": "Answer in JSON."}])
    params = [
        SamplingParams(temperature=1.0, seed=seed + i, max_tokens=400, constraint=c)
        for i, c in enumerate(constraints)
    ]
    outputs = [out for [out] in engine.generate([prompt] * len(params), params)]
    for out, constraint in zip(outputs, constraints, strict=True):
        assert out.finish_reason is FinishReason.EOS, (constraint, out.text)
        if constraint.kind == "json_schema":
            jsonschema.validate(json.loads(out.text), json.loads(constraint.spec))
        elif constraint.kind == "regex":
            assert re.fullmatch(constraint.spec, out.text), (constraint.spec, out.text)
        else:
            assert out.text in json.loads(constraint.spec)
