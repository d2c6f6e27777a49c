"""docs/design.md#metrics metric definitions, and the stamps the engine records for them."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from engine import metrics
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.request import RequestTimes
from engine.sampling_params import SamplingParams


def test_definitions_on_known_stamps() -> None:
    t = RequestTimes(arrival=10.0, emits=[10.5, 10.7, 10.7, 11.3])
    assert metrics.ttft(t) == pytest.approx(0.5)
    assert metrics.itls(t) == pytest.approx([0.2, 0.0, 0.6])
    assert metrics.tpot(t) == pytest.approx(0.8 / 3)  # (last - first) / (N_out - 1)
    # The identity of docs/design.md#metrics: last emit - arrival == TTFT + sum(ITL), exactly.
    assert metrics.e2e(t) == pytest.approx(metrics.ttft(t) + sum(metrics.itls(t)))  # type: ignore[operator]


def test_undefined_cases() -> None:
    assert metrics.ttft(RequestTimes(arrival=1.0)) is None
    assert metrics.tpot(RequestTimes(arrival=1.0, emits=[2.0])) is None  # N_out < 2
    assert metrics.itls(RequestTimes(arrival=1.0, emits=[2.0])) == []


def test_queue_time_is_queued_to_first_scheduled() -> None:
    assert metrics.queue_time(RequestTimes(arrival=1.0, queued=1.5, first_scheduled=2.25)) == 0.75
    assert metrics.queue_time(RequestTimes(arrival=1.0, queued=1.5)) is None  # never scheduled
    assert metrics.queue_time(RequestTimes(arrival=1.0)) is None


def test_first_stream_output_carries_the_queue_time(test_llama: Path) -> None:
    """Two requests, one batch slot: the second waits a whole request in the queue, and its
    first output says how long (the workers forward this to the client record)."""
    engine = LLMEngine.from_checkpoint(
        test_llama, EngineConfig(dtype="float32", kv_cache_bytes=2**22, max_num_seqs=1)
    )
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    first = engine.add_request(engine.make_request([5, 6, 7], params))
    second = engine.add_request(engine.make_request([8, 9, 10], params))
    outs: dict[str, list] = {first: [], second: []}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id].append(o)
    records = {r.request_id: r for r in engine.scheduler.records}
    for rid in (first, second):
        assert outs[rid][0].token_ids  # the first output has the first token
        assert outs[rid][0].queue_time_s == records[rid].queue_time_s is not None
        assert all(o.queue_time_s is None for o in outs[rid][1:])
    # The second waited in the queue until the first had finished all its steps.
    q1, q2 = outs[first][0].queue_time_s, outs[second][0].queue_time_s
    assert q1 is not None and q2 is not None
    assert q2 > q1 and q2 >= records[first].finished - records[second].arrival - 0.05


def test_percentile_and_goodput_are_distinct() -> None:
    assert metrics.percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.0
    assert metrics.percentile([3.0, 1.0, 2.0, 4.0], 100) == 4.0
    assert math.isnan(metrics.percentile([], 99))
    fast = RequestTimes(arrival=0.0, emits=[0.1, 0.2, 0.3])
    slow = RequestTimes(arrival=0.0, emits=[2.0, 2.1])
    g = metrics.goodput([fast, slow, fast, fast], wall_s=2.0, ttft_slo=0.5, tpot_slo=0.2)
    assert g.attainment == 0.75  # a ratio
    assert g.requests_per_s == 1.5  # a rate: 3 requests meeting the SLO / 2 s


def test_engine_stamps_every_phase(test_llama: Path) -> None:
    engine = LLMEngine.from_checkpoint(
        test_llama, EngineConfig(dtype="float32", kv_cache_bytes=2**22)
    )
    [[out]] = engine.generate(
        [[5, 6, 7, 8, 9]], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    )
    rec = out.record
    seq_times = engine.scheduler.records[0]
    assert rec is seq_times
    # One emit stamp per emitted token, in order, after arrival; finish after the last emit.
    timing = out.timing
    assert rec.num_emitted == rec.num_committed == rec.num_generated == 6
    assert rec.first_token is not None and rec.arrival <= rec.first_token <= rec.finished
    assert timing["ttft_s"] > 0 and len(timing["itl_s"]) == 5
    assert timing["e2e_s"] == pytest.approx(timing["ttft_s"] + sum(timing["itl_s"]))
    assert timing["tpot_s"] == pytest.approx(sum(timing["itl_s"]) / 5)


def test_stop_string_holdback_delays_the_emit_stamp(test_llama: Path) -> None:
    """Tokens held back by a possible stop string are stamped when released, not when sampled:
    a held token and the one that releases it share one emit stamp (an ITL of exactly 0)."""
    engine = LLMEngine.from_checkpoint(
        test_llama, EngineConfig(dtype="float32", kv_cache_bytes=2**22)
    )
    prompt = [5, 6, 7, 8, 9]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    pieces = [o.text for o in engine.stream(prompt, params)]
    [free] = engine.finished_outputs()
    # A stop string starting with the last character of the 2nd token's text, never completed.
    stop = pieces[1][-1] + "\x00never"
    held = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=(stop,))
    emitted = [o.text for o in engine.stream(prompt, held)]
    [out] = engine.finished_outputs()
    assert "".join(emitted) == free.text == out.text
    assert out.record.num_emitted == 12
    zeros = out.timing["itl_s"].count(0.0)  # (the detokenizer itself may hold a byte token)
    assert zeros > free.timing["itl_s"].count(0.0)
