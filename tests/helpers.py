"""Assertions shared by the engine-level tests."""

from __future__ import annotations

from engine.engine import LLMEngine


def assert_engine_clean(engine: LLMEngine) -> None:
    """The leak check (docs/design.md#p1, #p8): every pool back to baseline, nothing live, and
    exactly one terminal record per request."""
    engine.kv.check_idle()
    assert not engine.has_unfinished()
    ids = [r.request_id for r in engine.scheduler.records]
    assert len(ids) == len(set(ids))
