"""A chaos load's structured requests: each kind's fixed grammar is one the server takes, the
reference engine runs the very constraint the server makes of the body, and a plan's
structured kinds reach the schedule (or are refused naming the field)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import get_args

import pytest

from api.protocol import parse_completion
from api.translate import constraint_of as api_constraint
from chaos.load import schedule
from chaos.plan import Load, PlanError, Structured, load_plan
from chaos.reference import constraint_of
from chaos.structured import TOOL_GRAMMAR, structured_outputs
from engine.sampling_params import Constraint


@pytest.mark.parametrize("kind", get_args(Structured))
def test_the_reference_runs_the_constraint_the_server_makes_of_the_body(kind: Structured) -> None:
    """The body's ``structured_outputs`` read by the API (which compiles it: a 400 otherwise)
    and by the reference give one Constraint: the reference run is the same request."""
    body = {"model": "m", "prompt": "hi", "structured_outputs": structured_outputs(kind)}
    wire = json.loads(json.dumps(body))  # as the client sends it
    server = api_constraint(parse_completion(json.dumps(wire).encode()))
    assert server is not None
    assert constraint_of(wire["structured_outputs"]) == server
    assert server.kind == {"tool": "grammar"}.get(kind, kind)
    if kind == "tool":  # a required call of one of the two functions, below the API
        assert server == TOOL_GRAMMAR and '"maxItems": 1' in server.spec


def test_a_plain_body_has_no_constraint_and_a_schema_as_text_is_taken_as_is() -> None:
    assert constraint_of(None) is None
    assert constraint_of({"json": '{"type": "object"}'}) == Constraint(
        "json_schema", '{"type": "object"}'
    )
    with pytest.raises(ValueError, match="structured_outputs.xml: not json"):
        constraint_of({"xml": "<a/>"})


def test_a_plans_structured_kinds_reach_the_schedule_with_their_own_lengths() -> None:
    load = Load.model_validate(
        {
            "arrivals": {"rate": 20, "duration_s": 10},
            "prompts": {"output_tokens": [5, 7]},
            "sampling": [
                {"weight": 1},
                *(
                    {"weight": 1, "structured": k, "output_tokens": [100, 120]}
                    for k in get_args(Structured)
                ),
            ],
            "seed": 4,
        }
    )
    plan = schedule(load)
    kinds = {p.structured for p in plan}
    assert kinds == {None, *get_args(Structured)}
    for p in plan:
        if p.structured is None:
            assert "structured_outputs" not in p.body and 5 <= p.body["max_tokens"] <= 7
        else:
            assert p.body["structured_outputs"] == structured_outputs(p.structured)
            assert 100 <= p.body["max_tokens"] <= 120
    # A structured kind takes no draw of its own: the same plan in free text sends the same
    # prompts at the same times (a plan without one schedules as it did before they were).
    free = [s.model_copy(update={"structured": None}) for s in load.sampling]
    assert [(p.send_at, p.body["prompt"], p.stream) for p in plan] == [
        (p.send_at, p.body["prompt"], p.stream)
        for p in schedule(load.model_copy(update={"sampling": free}))
    ]


def test_the_structured_plan_mixes_every_kind_with_free_text_and_the_usual_faults() -> None:
    plan = load_plan("structured")
    kinds = [s.structured for s in plan.load.sampling]
    assert set(kinds) == {None, *get_args(Structured)}
    assert {f.kind for f in plan.faults} >= {"kill_worker", "kv_fault", "hang_worker"}
    assert 0 < plan.load.stream_fraction < 1


@pytest.mark.parametrize(
    ("sampling", "message"),
    [
        ("{structured: xml}", "load.sampling.0.structured: 'xml' (must be one of"),
        (
            "{structured: regex, stop: [x]}",
            "load.sampling.0: {'structured': 'regex', 'stop': ['x']} (stop: ['x'] beside "
            "structured: regex (one or the other))",
        ),
        ("{output_tokens: [9, 2]}", "output_tokens: (9, 2) must be 1 <= min <= max"),
    ],
)
def test_a_bad_structured_kind_names_the_field(tmp_path: Path, sampling: str, message: str) -> None:
    file = tmp_path / "bad.yaml"
    file.write_text(f"name: x\nload: {{sampling: [{sampling}]}}")
    with pytest.raises(PlanError) as err:
        load_plan(file)
    assert message in str(err.value)
