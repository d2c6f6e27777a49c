"""Speculative decoding (docs/design.md#speculative-decoding) is exact: with drafts verified, a
request's tokens, logprobs, text and finish are the same bits as without speculation, greedy and
seeded, under every sampling feature, with any mix of right and wrong drafts, under KV pressure,
and when a migrated request resumes mid-stream. Rejected drafts leave no KV behind.

Random-weight models rarely repeat their context, so most tests draft from an oracle: the
reference run's own continuation, each token corrupted with some probability -- drafts that are
accepted for a while and then rejected, at every place a verification can stop."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.config import EngineConfig, SpeculativeConfig
from engine.engine import CompletionOutput, LLMEngine
from engine.request import Request, SpecStats, fork_id
from engine.sampling_params import SamplingParams
from engine.speculative import NgramIndex, drafts_worth

SPEC = SpeculativeConfig(k=5, max_batch=64)
VOCAB = 2048  # test_llama's

PARAMS = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=3),
    "seeded": SamplingParams(
        temperature=0.9, top_p=0.9, top_k=50, seed=11, max_tokens=40, ignore_eos=True, logprobs=2
    ),
    "penalties": SamplingParams(
        temperature=0.7,
        seed=3,
        repetition_penalty=1.3,
        frequency_penalty=0.4,
        presence_penalty=0.3,
        logit_bias={17: 2.0},
        max_tokens=40,
        ignore_eos=True,
        logprobs=1,
    ),
    "bans": SamplingParams(
        temperature=0.0,
        no_repeat_ngram_size=2,
        bad_words_ids=((5, 9), (33,)),
        min_tokens=6,
        max_tokens=40,
    ),
    "stops": SamplingParams(
        temperature=1.0, seed=8, stop=("e",), stop_token_ids=(1, 2, 3), max_tokens=40
    ),
    "short": SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
    "two": SamplingParams(n=2, temperature=1.0, seed=9, max_tokens=30, ignore_eos=True, logprobs=1),
}


def engine_for(path: Path, speculative: SpeculativeConfig | None, **kw: object) -> LLMEngine:
    base: dict[str, object] = {"dtype": "bfloat16", "kv_cache_bytes": 2**24}
    return LLMEngine.from_checkpoint(
        path, EngineConfig(**{**base, **kw, "speculative": speculative})
    )  # type: ignore[arg-type]


def key(out: CompletionOutput) -> tuple[object, ...]:
    logprobs = [(lp.logprob, tuple(lp.top), lp.rank) for lp in out.logprobs or []]
    return (tuple(out.token_ids), out.text, out.finish_reason, tuple(logprobs))


def run(
    engine: LLMEngine, jobs: dict[str, tuple[list[int], SamplingParams]]
) -> dict[str, CompletionOutput]:
    for rid, (prompt, params) in jobs.items():
        engine.add_request(engine.make_request(prompt, params, request_id=rid))
    while engine.has_unfinished():
        engine.step()
    # Keyed as the engine keys each sample (n > 1: the parent is sample 0, then <id>#<index>).
    return {
        fork_id(o.request_id, o.index) if o.index else o.request_id: o
        for o in engine.finished_outputs()
    }


def oracle(
    reference: dict[str, CompletionOutput], rng: random.Random, wrong: float
) -> Callable[[Request, int], list[int]]:
    """Drafts that are the reference's continuation, each token replaced by a random one with
    probability ``wrong``; 1 to 6 of them (never more than the scheduler allows)."""

    def draft(req: Request, most: int) -> list[int]:
        done = len(req.output_token_ids)
        truth = reference[req.request_id].token_ids[done : done + min(most, rng.randint(1, 6))]
        return [t if rng.random() >= wrong else rng.randrange(VOCAB) for t in truth]

    return draft


def jobs_for(seed: int, count: int) -> dict[str, tuple[list[int], SamplingParams]]:
    rng = random.Random(seed)
    kinds = list(PARAMS)
    return {
        f"r{i}": (
            [rng.randrange(8, VOCAB) for _ in range(rng.randint(3, 60))],
            PARAMS[kinds[i % len(kinds)]],
        )
        for i in range(count)
    }


@pytest.mark.parametrize("wrong", [0.0, 0.15, 0.5])
def test_speculation_with_right_and_wrong_drafts_gives_the_same_bits(
    bf16_llama: Path, wrong: float
) -> None:
    jobs = jobs_for(seed=int(wrong * 100), count=18)
    reference = run(engine_for(bf16_llama, None), jobs)
    engine = engine_for(bf16_llama, SPEC, max_num_batched_tokens=64)
    engine.scheduler.drafter = oracle(reference, random.Random(1), wrong)
    got = run(engine, jobs)
    assert {r: key(o) for r, o in got.items()} == {r: key(o) for r, o in reference.items()}
    stats = engine.speculation
    assert stats.num_accepted > 50 and stats.num_steps > 20
    if wrong == 0.0:
        # Every draft is right, so only a stop (a token limit, a stop string) can cut one off.
        assert stats.num_accepted > 0.8 * stats.num_drafted
    else:
        assert stats.num_accepted < stats.num_drafted
    per_request = [o.record.speculation for o in got.values() if o.record.speculation]
    assert sum(s.num_accepted for s in per_request) == stats.num_accepted
    assert sum(s.num_drafted for s in per_request) == stats.num_drafted
    engine.kv.check_idle()  # rejected drafts' blocks went back


def test_speculation_under_kv_pressure_gives_the_same_bits(bf16_llama: Path) -> None:
    """A pool so small that drafts often find no free block (they are dropped, never preempting
    anyone) and requests are preempted and recomputed."""
    jobs = jobs_for(seed=7, count=10)
    small = {"kv_cache_bytes": 2**17, "block_size": 4, "max_num_seqs": 8}
    reference = run(engine_for(bf16_llama, None, **small), jobs)
    engine = engine_for(bf16_llama, SPEC, **small)
    engine.scheduler.drafter = oracle(reference, random.Random(2), 0.2)
    got = run(engine, jobs)
    assert {r: key(o) for r, o in got.items()} == {r: key(o) for r, o in reference.items()}
    assert engine.speculation.num_accepted > 20
    assert any(o.record.speculation for o in got.values())
    engine.kv.check_idle()


def test_a_resumed_request_speculates_on_to_the_same_bits(bf16_llama: Path) -> None:
    """A migration mid-speculation: drafts live only inside a step, so an attempt resumed from
    the tokens its client has (the seed carried) speculates on and ends as the uninterrupted
    run did, wherever the cut falls."""
    params = PARAMS["seeded"]
    prompt = [(29 * i + 5) % VOCAB for i in range(50)]
    [[full]] = engine_for(bf16_llama, None).generate([prompt], params)
    for cut in (1, 9, 22):
        engine = engine_for(bf16_llama, SPEC)
        engine.scheduler.drafter = oracle({"resumed": full}, random.Random(cut), 0.1)
        resumed = full.token_ids[:cut]
        request = engine.make_request(prompt, params, request_id="resumed", resume_output=resumed)
        engine.add_request(request)
        while engine.has_unfinished():
            engine.step()
        [out] = engine.finished_outputs()
        assert out.token_ids == full.token_ids, cut
        assert out.logprobs is not None and full.logprobs is not None
        assert out.logprobs == full.logprobs[cut:], cut
        assert engine.speculation.num_accepted > 3, cut


def test_the_engines_own_drafter_finds_repeated_text(bf16_llama: Path) -> None:
    """A prompt that repeats a span, decoded greedily: the n-gram drafts are taken from the
    context, some are accepted, and the output is still the reference's."""
    span = [(53 * i + 7) % VOCAB for i in range(12)]
    prompt = span * 4
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, logprobs=1)
    [[reference]] = engine_for(bf16_llama, None).generate([prompt], params)
    engine = engine_for(bf16_llama, SpeculativeConfig(k=4, min_n=1))
    [[out]] = engine.generate([prompt], params)
    assert key(out) == key(reference)
    assert engine.speculation.num_steps > 0
    assert out.record.speculation == engine.speculation


def propose_ngram(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The definition, by brute force: the ``k`` tokens after the latest earlier occurrence of
    the longest suffix of ``tokens`` (``max_n`` .. ``min_n`` long) that occurred before."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[len(tokens) - n :]
        for i in range(len(tokens) - n - 1, -1, -1):
            if tokens[i : i + n] == suffix:
                return tokens[i + n : i + n + k]
    return []


def index_of(tokens: list[int], min_n: int, max_n: int) -> NgramIndex:
    index = NgramIndex(min_n, max_n)
    index.sync(tokens, [])
    return index


def test_the_ngram_index_takes_the_longest_latest_match() -> None:
    #          0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [1, 2, 3, 9, 1, 2, 4, 5, 7, 2, 1, 2]
    # Suffix (1, 2) occurred at 0 and 4: the latest (4) is followed by 4, 5, 7.
    assert index_of(tokens, 1, 2).propose(3) == [4, 5, 7]
    # Longest first: (2, 1, 2) never occurred, (1, 2) did.
    assert index_of(tokens, 1, 3).propose(2) == [4, 5]
    assert index_of(tokens, 3, 3).propose(2) == []  # only n = 3 allowed: no match
    # A match near the end proposes only what follows it.
    assert index_of([5, 6, 5, 6], 2, 2).propose(4) == [5, 6]
    assert index_of([5, 6, 7, 8], 1, 3).propose(4) == []
    assert index_of([5], 1, 3).propose(4) == []


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 4), min_size=1, max_size=60),
    cuts=st.lists(st.integers(0, 60), max_size=6),
    bounds=st.tuples(st.integers(1, 4), st.integers(0, 3)),
    k=st.integers(1, 8),
)
def test_the_ngram_index_grown_in_any_steps_proposes_the_definitions_drafts(
    tokens: list[int], cuts: list[int], bounds: tuple[int, int], k: int
) -> None:
    min_n, max_n = bounds[0], bounds[0] + bounds[1]
    prompt_len = min(cuts[0], len(tokens)) if cuts else len(tokens)
    prompt, output = tokens[:prompt_len], tokens[prompt_len:]
    index = NgramIndex(min_n, max_n)
    for end in sorted({*(c for c in cuts if c <= len(output)), len(output)}):
        index.sync(prompt, output[:end])
        context = prompt + output[:end]
        assert index.propose(k) == propose_ngram(context, k, min_n, max_n)


def test_rejected_drafts_give_their_blocks_back(bf16_llama: Path) -> None:
    """Twelve drafts, the first one wrong: the verification writes KV over three more blocks
    (block size 4), and after the step the request holds only the blocks its tokens need."""
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    prompt = [(31 * i + 3) % VOCAB for i in range(10)]
    [[reference]] = engine_for(bf16_llama, None).generate([prompt], params)
    engine = engine_for(bf16_llama, SPEC, block_size=4)
    truth = reference.token_ids

    def wrong(req: Request, most: int) -> list[int]:
        return [(truth[len(req.output_token_ids)] + 1) % VOCAB] * min(most, 12)

    engine.scheduler.drafter = wrong
    rid = engine.add_request(engine.make_request(prompt, params))
    grew = False
    while engine.has_unfinished():
        engine.step()
        req = engine.scheduler.get_request(rid)
        if req is not None and not req.is_finished:
            grew |= engine.speculation.num_drafted > 0
            assert engine.kv.num_held_blocks(rid) == engine.kv.blocks_for(req.num_tokens)
            assert engine.kv.stats().logical_slots == req.num_computed_tokens
            engine.kv.check()
    assert grew and engine.speculation.num_accepted == 0
    [out] = engine.finished_outputs()
    assert out.token_ids == truth


@pytest.mark.parametrize(
    ("drafted", "accepted", "k", "expected"),
    [
        (0, 0, 8, 2),  # 1/2 before any draft: 1/2, 1/4 >= 0.2 > 1/8
        (8, 8, 8, 8),  # 0.9: 0.9^8 = 0.43, capped at k
        (8, 8, 4, 4),
        (38, 38, 16, 16),  # 0.975^16 = 0.67
        (10, 0, 8, 0),  # 1/12 < 0.2: no draft pays for itself
        (6, 2, 8, 1),  # 3/8: 0.375 >= 0.2 > 0.14
    ],
)
def test_drafts_worth_takes_the_longest_run_likely_enough_to_be_accepted(
    drafted: int, accepted: int, k: int, expected: int
) -> None:
    stats = SpecStats(num_steps=1, num_drafted=drafted, num_accepted=accepted)
    assert drafts_worth(stats, k, threshold=0.2) == expected


def test_a_request_whose_drafts_keep_failing_stops_drafting(bf16_llama: Path) -> None:
    engine = engine_for(bf16_llama, SpeculativeConfig(k=4, min_n=1))
    prompt = [(53 * i + 7) % VOCAB for i in range(12)] * 3
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    rid = engine.add_request(engine.make_request(prompt, params))
    req = engine.scheduler.get_request(rid)
    assert req is not None
    assert engine._draft(req, 8) == prompt[:2]  # the prompt repeats; 2 drafts before any verdict
    req.speculation = SpecStats(num_steps=5, num_drafted=10, num_accepted=0)
    assert engine._draft(req, 8) == []
    req.speculation = SpecStats(num_steps=5, num_drafted=10, num_accepted=10)
    assert len(engine._draft(req, 8)) == 4  # 11/12: all of k


def test_a_request_paused_mid_step_takes_no_draft_and_resumes_to_the_same_bits(
    bf16_llama: Path,
) -> None:
    """The client falls behind while a verification is in flight (the drafter pauses it): the
    step commits the one token a plain step would, no draft, and once resumed the request ends
    as the reference did."""
    params = PARAMS["greedy"]
    prompt = [(31 * i + 3) % VOCAB for i in range(20)]
    [[reference]] = engine_for(bf16_llama, None).generate([prompt], params)
    engine = engine_for(bf16_llama, SPEC)
    truth = oracle({"paused": reference}, random.Random(5), 0.0)
    paused: list[int] = []

    def pause_once(req: Request, most: int) -> list[int]:
        if len(req.output_token_ids) >= 4 and not paused:
            paused.append(len(req.output_token_ids))
            engine.scheduler.set_backpressured(req.request_id, True)
        return truth(req, most)

    engine.scheduler.drafter = pause_once
    engine.add_request(engine.make_request(prompt, params, request_id="paused"))
    for _ in range(10):
        engine.step()
        if paused:
            break
    req = engine.scheduler.get_request("paused")
    assert paused and req is not None
    assert len(req.output_token_ids) == paused[0] + 1  # one token, no draft
    assert req.num_computed_tokens == req.num_tokens - 1
    engine.step()
    assert len(req.output_token_ids) == paused[0] + 1  # paused: not scheduled
    engine.scheduler.set_backpressured("paused", False)
    while engine.has_unfinished():
        engine.step()
    [out] = engine.finished_outputs()
    assert key(out) == key(reference)
    engine.kv.check_idle()
