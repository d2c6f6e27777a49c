"""Helpers shared by test modules: the engine-level assertions, schema-driven API bodies."""

from __future__ import annotations

from typing import Any

from engine.engine import LLMEngine


def assert_engine_clean(engine: LLMEngine) -> None:
    """The leak check (docs/design.md#p1, #p8): every pool back to baseline, nothing live, and
    exactly one terminal record per request."""
    engine.kv.check_idle()
    assert not engine.has_unfinished()
    ids = [r.request_id for r in engine.scheduler.records]
    assert len(ids) == len(set(ids))


def integral(value: Any) -> Any:
    """``value`` with integer-valued floats written as integers: JSON Schema's ``integer``
    (which schema-driven generators follow) includes 1.0; the API's parser, strict, takes only
    1 and answers 1.0 with a 400."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [integral(v) for v in value]
    if isinstance(value, dict):
        return {k: integral(v) for k, v in value.items()}
    return value
