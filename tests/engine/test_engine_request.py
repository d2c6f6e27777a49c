"""The one request type (engine.request.EngineRequest) and the one delta merge
(engine.outputs.TokenDelta.then): ids are fields, keys are built from them and never parsed,
and every fold of deltas gives what the deltas one by one give."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.outputs import SamplingSnapshot, TokenDelta, TokenLogprobs
from engine.request import EngineRequest, FinishReason
from engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def test_the_key_is_built_from_the_ids_and_fresh_for_each_attempt() -> None:
    base = EngineRequest("cmpl-1", (5, 6, 7), GREEDY)
    assert base.key == "cmpl-1"  # outside a cluster: the id alone
    assert replace(base, choice=2).key == "cmpl-1/2"
    attempts = [replace(base, choice=1, attempt=n).key for n in (1, 2, 3)]
    assert attempts == ["cmpl-1/1@1", "cmpl-1/1@2", "cmpl-1/1@3"]
    assert replace(base, resume_output=(9, 9)).num_kv_tokens == 5


def test_forked_samples_report_their_request_and_index_not_a_composed_id(
    test_llama: Path,
) -> None:
    """n > 1 inside one engine: every delta names the request's key and its sample's index."""
    engine = LLMEngine.from_checkpoint(test_llama, EngineConfig(kv_cache_bytes=2**22))
    params = SamplingParams(temperature=0.9, seed=3, n=3, max_tokens=4, ignore_eos=True)
    rid = engine.add_request(engine.make_request([4, 5, 6, 7], params, request_id="r"))
    deltas = []
    while engine.has_unfinished():
        deltas += engine.step()
    assert {d.request_id for d in deltas} == {rid} == {"r"}
    assert {d.index for d in deltas} == {0, 1, 2}
    assert sum(d.finished for d in deltas) == 3
    records = sorted(r.request_id for r in engine.scheduler.records)
    assert records == ["r", "r#1", "r#2"]  # the scheduler's own ids of the samples


def test_a_request_id_may_not_hold_the_sample_separator(test_llama: Path) -> None:
    engine = LLMEngine.from_checkpoint(test_llama, EngineConfig(kv_cache_bytes=2**22))
    with pytest.raises(ValueError, match="reserved for n > 1 samples"):
        engine.add_request(engine.make_request([4, 5], GREEDY, request_id="a#1"))
    assert not engine.has_unfinished()


_tokens = st.lists(st.integers(0, 50), max_size=3)
_delta = st.builds(
    lambda ids, text, lp, snap, queue, seed, end: TokenDelta(
        "r",
        ids,
        text,
        logprobs=[TokenLogprobs(-1.0, [], 1)] * len(ids) if lp else None,
        sampler_snapshot=SamplingSnapshot(1, 0, len(ids)) if snap else None,
        queue_time_s=queue,
        seed=seed,
        finished=end,
        finish_reason=FinishReason.EOS if end else None,
    ),
    _tokens,
    st.text(max_size=3),
    st.booleans(),
    st.booleans(),
    st.none() | st.floats(0, 1),
    st.none() | st.integers(0, 9),
    st.booleans(),
)


@given(st.lists(_delta, min_size=1, max_size=6))
def test_then_is_associative_and_keeps_what_each_field_means(deltas: list[TokenDelta]) -> None:
    """However a buffer, an outbox or the edge groups deltas, the merge is the same: tokens and
    text concatenated, the end and the seed the last's, the queue time the first's, and the
    sampler state the last one that belongs to the last token (none if the last tokens came
    without one)."""
    left = deltas[0]
    for d in deltas[1:]:
        left = left.then(d)
    right = deltas[-1]
    for d in reversed(deltas[:-1]):
        right = d.then(right)
    assert left == right
    assert left.token_ids == [t for d in deltas for t in d.token_ids]
    assert left.text == "".join(d.text for d in deltas)
    assert (left.finished, left.finish_reason) == (deltas[-1].finished, deltas[-1].finish_reason)
    queue = [d.queue_time_s for d in deltas if d.queue_time_s is not None]
    assert left.queue_time_s == (queue[0] if queue else None)
    seeds = [d.seed for d in deltas if d.seed is not None]
    assert left.seed == (seeds[-1] if seeds else None)
    snapshot = None
    for d in deltas:
        if d.sampler_snapshot is not None:
            snapshot = d.sampler_snapshot
        elif d.token_ids:
            snapshot = None
    assert left.sampler_snapshot == snapshot
    if all(d.logprobs is None for d in deltas):
        assert left.logprobs is None
