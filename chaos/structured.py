"""The structured requests of a chaos load (docs/design.md#chaos): one fixed grammar per kind
a plan may ask for (``Sampling.structured``), the ``structured_outputs`` field that sends it,
and the check that an output which ended by itself matches it.

- ``json_schema``: SCHEMA, six fields -- a bounded string, an enum, an integer range, a
  bounded array of bounded strings, a boolean, a patterned string -- all required, nothing
  else allowed, so every output ends.
- ``regex``: REGEX, a date (YYYY-MM-DD).
- ``choice``: CHOICES, four words.
- ``tool``: a forced call (``tool_choice: required``, one call) of one of FUNCTIONS. Below the
  API a tool call is a Lark grammar (``api.tools.tool_call_grammar``), so a completion sends
  that grammar (``structured_outputs.grammar``) and its text is read with the chat API's own
  parser (``api.tools.ToolCalls``).

An output is checked against what was asked here, never against the server's reading of it:
jsonschema for the schema and each call's arguments, ``re.fullmatch`` for the regex,
membership for the choice.
"""

from __future__ import annotations

import json
import re
from typing import Any

from api.tools import ToolCalls, tool_call_grammar
from chaos.plan import Structured

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "kind": {"enum": ["river", "cloud", "garden", "engine"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "active": {"type": "boolean"},
        "code": {"type": "string", "pattern": "^[a-z]{2}-[0-9]{3}$"},
    },
    "required": ["name", "kind", "count", "tags", "active", "code"],
    "additionalProperties": False,
}
# [0-9], not \d: the same digits to the grammar engine and to Python's re (whose \d is Unicode's)
REGEX = "(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
CHOICES = ["red", "green", "blue", "violet"]
FUNCTIONS: list[dict[str, Any]] = [
    {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 16},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
    {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": 0, "maximum": 999},
                "b": {"type": "integer", "minimum": 0, "maximum": 999},
            },
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
]
PARALLEL_CALLS = False  # one call: an output of calls ends (a list of them need not)
TOOL_GRAMMAR = tool_call_grammar(FUNCTIONS, PARALLEL_CALLS)  # tool_choice: required


def structured_outputs(kind: Structured) -> dict[str, Any]:
    """The request body's ``structured_outputs`` field (vLLM's) that asks for ``kind``."""
    if kind == "json_schema":
        return {"json": SCHEMA}
    if kind == "regex":
        return {"regex": REGEX}
    if kind == "choice":
        return {"choice": list(CHOICES)}
    return {"grammar": TOOL_GRAMMAR.spec}


def why_invalid(kind: Structured, text: str) -> str | None:
    """Why ``text``, a whole output, does not match ``kind``'s grammar (None: it does)."""
    if kind == "json_schema":
        return _json_invalid(text, SCHEMA)
    if kind == "regex":
        return None if re.fullmatch(REGEX, text) else f"{text[:60]!r} does not match the regex"
    if kind == "choice":
        return None if text in CHOICES else f"{text[:60]!r} is not one of {CHOICES}"
    return _calls_invalid(text)


def _calls_invalid(text: str) -> str | None:
    parsed = ToolCalls.of(text)
    if parsed.content:
        return f"text outside the tool calls: {parsed.content[:60]!r}"
    if not parsed.calls or (len(parsed.calls) > 1 and not PARALLEL_CALLS):
        return f"{len(parsed.calls)} tool calls, want 1"
    schemas = {f["name"]: f["parameters"] for f in FUNCTIONS}
    for i, call in enumerate(parsed.calls):
        name = call["function"]["name"]
        if name not in schemas:
            return f"call {i}: no function {name!r}"
        why = _json_invalid(call["function"]["arguments"], schemas[name])
        if why is not None:
            return f"call {i} ({name}) arguments: {why}"
    return None


def _json_invalid(text: str, schema: dict[str, Any]) -> str | None:
    import jsonschema  # ~0.2 s to import; only a run's verdict needs it

    try:
        value = json.loads(text, object_pairs_hook=_no_repeated_keys)
    except ValueError as exc:  # JSONDecodeError, or a key given twice
        return f"not JSON: {exc}"
    error = jsonschema.exceptions.best_match(
        jsonschema.Draft202012Validator(schema).iter_errors(value)
    )
    if error is not None:
        at = "/".join(str(p) for p in error.absolute_path)
        return f"breaks the schema at /{at}: {error.message[:120]}"
    return None


def _no_repeated_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    repeated = sorted({k for k in keys if keys.count(k) > 1})
    if repeated:
        raise ValueError(f"keys given twice: {repeated}")
    return dict(pairs)
