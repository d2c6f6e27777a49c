"""Helpers shared by test modules: the engine-level assertions, schema-driven API bodies."""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any

from contracts.messages import WorkerInfo, WorkerLoad
from contracts.roles import Role
from contracts.routing import WorkerState
from engine.engine import LLMEngine

_INFO_FIELDS = {f.name for f in fields(WorkerInfo)}
_LOAD_FIELDS = {f.name for f in fields(WorkerLoad)}


def assert_engine_clean(engine: LLMEngine) -> None:
    """The leak check (docs/design.md#p1, #p8): every pool back to baseline, nothing live, and
    exactly one terminal record per request."""
    engine.kv.check_idle()
    assert not engine.has_unfinished()
    ids = [r.request_id for r in engine.scheduler.records]
    assert len(ids) == len(set(ids))


def worker_state(
    name: str, role: Role, domain: str, healthy: bool = True, **kw: Any
) -> WorkerState:
    """A router's view of a worker that has reported: ``kw`` sets fields of its info
    (``max_num_seqs``, ``block_size``, ...), of its load report (``queue_depth``,
    ``kv_usage``, ...) or of the state itself (``failed``, ``promised_seqs``, ...)."""
    state = WorkerState.unreported(name, role, domain)
    info = {k: kw.pop(k) for k in list(kw) if k in _INFO_FIELDS}
    report = {k: kw.pop(k) for k in list(kw) if k in _LOAD_FIELDS}
    return replace(
        state,
        info=replace(state.info, **info),
        report=replace(state.report, **report),
        healthy=healthy,
        **kw,
    )


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
