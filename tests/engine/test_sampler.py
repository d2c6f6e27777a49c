"""The sampler (docs/design.md#sampling, #sampling-order): exact supports, processors,
counter-based randomness (#sampling-seeds), snapshot/restore, and logprobs."""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Sequence

import pytest
import torch
import xxhash
from helpers import (
    greedy_token,
    min_p_filter,
    temperature_probs,
    top_k_filter,
    top_p_filter,
    typical_filter,
)

from engine.logits_processors import TokenHistory, process_logits
from engine.request import Request
from engine.sampler import (
    MaskFn,
    Sampler,
    SamplingSnapshot,
    SamplingState,
    _draw,
    log_softmax,
    min_p_mask,
    top_k_mask,
    top_p_mask,
    typical_mask,
    uniform,
)
from engine.sampling_params import SamplingParams


def t(values: Sequence[float] | Sequence[Sequence[float]]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def support(q: torch.Tensor) -> set[int]:
    return {i for i, v in enumerate(q.tolist()) if v > 0}


def state(
    params: SamplingParams,
    prompt: Sequence[int] = (0,),
    output: list[int] | None = None,
    eos_token_ids: frozenset[int] = frozenset(),
) -> SamplingState:
    seed = params.seed if params.seed is not None else 0
    history = [] if output is None else output
    return SamplingState.create(params, prompt, history, seed=seed, eos_token_ids=eos_token_ids)


def processed(logits: list[float], st: SamplingState) -> list[float]:
    """Steps 1–2 alone on one row."""
    raw = t(logits)[None]
    z = raw.clone()
    process_logits(z, raw, [st.params], [st.history], [st.eos_token_ids])
    return z[0].tolist()


# -- docs/design.md#sampling-order greedy and temperature
# --------------------------------------------------------------


def test_greedy_lowest_index_wins_a_tie() -> None:
    assert greedy_token(t([1.0, 3.0, 3.0, 2.0])) == 1
    logits = t([[1.0, 3.0, 3.0, 2.0], [5.0, 0.0, 5.0, 5.0]])
    states = [state(SamplingParams(temperature=0.0)) for _ in range(2)]
    assert Sampler(4)(logits, states).token_ids == [1, 0]


@pytest.mark.parametrize("temperature", [0.0, -0.5])
def test_temperature_probs_rejects_non_positive_t(temperature: float) -> None:
    with pytest.raises(ValueError, match="T > 0"):
        temperature_probs(t([1.0, 2.0]), temperature)


def test_tiny_temperature_limit_one_hot_when_unique() -> None:
    probs = temperature_probs(t([1.0, 2.5, 2.0, -1.0]), 1e-3)
    assert probs.tolist() == [0.0, 1.0, 0.0, 0.0]


def test_tiny_temperature_limit_splits_ties_evenly() -> None:
    probs = temperature_probs(t([2.0, 0.0, 2.0, 2.0, 1.99]), 1e-5)
    assert probs[[0, 2, 3]].tolist() == pytest.approx([1 / 3] * 3, abs=1e-6)
    assert probs[[1, 4]].tolist() == [0.0, 0.0]
    # Half as many tied maxima: each gets 1/2, not a proportional or one-sided split.
    assert temperature_probs(t([3.0, 3.0, 0.0]), 1e-4).tolist() == [0.5, 0.5, 0.0]


# -- docs/design.md#sampling-order truncation filters: exact supports
# --------------------------------------------------


def test_top_k_support_size_is_exactly_k_with_id_tie_break() -> None:
    probs = t([0.1, 0.2, 0.2, 0.2, 0.3])
    assert support(top_k_filter(probs, 1)) == {4}
    assert support(top_k_filter(probs, 2)) == {4, 1}
    assert support(top_k_filter(probs, 3)) == {4, 1, 2}
    assert support(top_k_filter(probs, 4)) == {4, 1, 2, 3}
    assert top_k_filter(probs, 2).tolist() == pytest.approx([0, 0.4, 0, 0, 0.6])
    with pytest.raises(ValueError, match="k >= 1"):
        top_k_filter(probs, 0)


def test_top_p_keeps_the_boundary_token() -> None:
    p_ex = t([0.4, 0.3, 0.2, 0.1])
    assert support(top_p_filter(p_ex, 0.65)) == {0, 1}  # cumulative 0.7 >= 0.65
    assert support(top_p_filter(p_ex, 0.7)) == {0, 1}  # reaching p exactly is enough
    assert support(top_p_filter(p_ex, 0.71)) == {0, 1, 2}
    assert support(top_p_filter(p_ex, 0.3)) == {0}  # the first token alone crosses p
    assert top_p_filter(p_ex, 0.65).tolist() == pytest.approx([4 / 7, 3 / 7, 0, 0])


def test_min_p_keeps_the_max_and_grows_as_alpha_falls() -> None:
    probs = t([0.05, 0.5, 0.2, 0.15, 0.1])
    assert support(min_p_filter(probs, 1.0)) == {1}
    assert support(min_p_filter(t([0.5, 0.25, 0.25]), 0.5)) == {0, 1, 2}  # p_i == alpha max
    sizes = [len(support(min_p_filter(probs, a))) for a in (1.0, 0.5, 0.35, 0.25, 0.15, 0.05)]
    assert sizes == [1, 1, 2, 3, 4, 5]


def test_min_p_support_grows_with_temperature() -> None:
    logits = t([3.0, 2.0, 1.0, 0.0, -1.0, -2.0])
    sizes = [
        len(support(min_p_filter(temperature_probs(logits, temp), 0.3)))
        for temp in (0.2, 0.5, 1.0, 2.0, 5.0)
    ]
    assert sizes == sorted(sizes) and sizes[0] < sizes[-1]
    assert sizes == [1, 1, 2, 3, 6]  # z_i >= z_max + T log 0.3, log 0.3 = -1.204


def test_typical_excludes_the_most_probable_token() -> None:
    probs = t([0.02, 0.35, 0.33, 0.30])
    # H = 1.173; |-log p - H| = 2.74, 0.123, 0.064, 0.031: tokens 3 then 2 reach 0.63.
    assert support(typical_filter(probs, 0.63)) == {2, 3}
    assert support(typical_filter(probs, 0.64)) == {1, 2, 3}
    assert typical_filter(probs, 0.63).tolist() == pytest.approx([0, 0, 0.33 / 0.63, 0.30 / 0.63])


def test_shift_invariance_of_supports() -> None:
    logits = t([1.5, -0.25, 3.0, 2.0, 0.5, 3.0])
    for shift in (-40.0, 7.0, 100.0):
        base, moved = temperature_probs(logits, 1.0), temperature_probs(logits + shift, 1.0)
        assert support(top_k_filter(moved, 3)) == support(top_k_filter(base, 3))
        assert support(top_p_filter(moved, 0.8)) == support(top_p_filter(base, 0.8))
        assert support(min_p_filter(moved, 0.2)) == support(min_p_filter(base, 0.2))


def test_d02_filter_order_does_not_commute() -> None:
    probs = t([0.5, 0.25, 0.15, 0.1])
    support_a = support(top_p_filter(top_k_filter(probs, 3), 0.8))  # 0.556 + 0.278 >= 0.8
    support_b = support(top_k_filter(top_p_filter(probs, 0.8), 3))  # 0.5 + 0.25 + 0.15 >= 0.8
    assert (support_a, support_b) == ({0, 1}, {0, 1, 2})


def test_batched_masks_match_the_one_row_functions() -> None:
    gen = torch.Generator().manual_seed(3)
    probs = torch.softmax(torch.randn(6, 50, generator=gen) * 2, dim=-1)
    cases: list[tuple[MaskFn, Callable[[torch.Tensor, float], torch.Tensor], list[float]]] = [
        (top_k_mask, lambda q, v: top_k_filter(q, int(v)), [1, 3, 7, 50, 12, 2]),
        (top_p_mask, top_p_filter, [0.1, 0.5, 0.9, 1.0, 0.75, 0.3]),
        (min_p_mask, min_p_filter, [0.0, 0.05, 0.3, 1.0, 0.1, 0.5]),
        (typical_mask, typical_filter, [0.2, 0.5, 0.9, 1.0, 0.95, 0.6]),
    ]
    for mask, one_row, values in cases:
        keep = mask(probs, values)
        for row, value in enumerate(values):
            kept = set(keep[row].nonzero().flatten().tolist())
            assert support(one_row(probs[row], value)) == kept


# -- steps 1–2: hard constraints and penalties --------------------------------------------------


def test_repetition_penalty_is_sign_aware_over_prompt_and_output() -> None:
    st = state(SamplingParams(repetition_penalty=2.0), prompt=[0, 3], output=[1])
    assert processed([2.0, -2.0, 1.0, -1.0, 0.5], st) == [1.0, -4.0, 1.0, -2.0, 0.5]


@pytest.mark.parametrize("r", [5e-324, 3e38])
def test_an_extreme_repetition_penalty_keeps_logits_finite_and_masked_tokens_masked(
    r: float,
) -> None:
    """Any r > 0 is valid: z/r and z*r saturate at float32's range instead of reaching +-inf
    (an infinite logit made the softmax NaN, and top_p's candidates empty: a failed step)."""
    most = torch.finfo(torch.float32).max
    st = state(SamplingParams(repetition_penalty=r, allowed_token_ids=(0, 1, 3, 4)), [0, 1, 2], [3])
    z = processed([2.0, -2.0, 1.0, 0.5, 0.25], st)
    assert z[2] == -math.inf and z[4] == 0.25  # masked stays masked; unseen untouched
    if r < 1.0:  # seen positive logits saturate at the top (a tie), negative ones reach -0
        assert (z[0], z[1], z[3]) == (most, 0.0, most)
    else:  # seen negative logits saturate at the bottom, positive ones shrink
        assert z[1] == -most and 0.0 < z[3] < z[0] < 1e-37


def test_saturated_logits_tie_and_top_p_keeps_the_smaller_id() -> None:
    """The request schemathesis found (repetition_penalty=5e-324, top_p=5e-324): tokens 0, 3
    saturate to a tie with token 2 (every seen positive logit), sampling draws from exactly those
    three, and top_p keeps token 0 alone."""
    logits = t([[2.0, -2.0, 1.0, 0.5, 0.25]])
    drawn = set()
    for seed in range(24):
        for top_p, want in ((5e-324, {0}), (1.0, {0, 2, 3})):
            params = SamplingParams(repetition_penalty=5e-324, top_p=top_p, seed=seed)
            [token] = Sampler(5)(logits, [state(params, [0, 1, 2], [3])]).token_ids
            assert token in want
            drawn.add(token)
    assert drawn == {0, 2, 3}


def test_frequency_and_presence_count_output_only() -> None:
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    st = state(params, prompt=[0, 0, 3], output=[1, 1, 2, 1])
    assert processed([1.0, 1.0, 1.0, 1.0], st) == [1.0, 1.0 - 1.5 - 0.25, 1.0 - 0.5 - 0.25, 1.0]


def test_penalties_change_the_greedy_choice() -> None:
    logits = t([[3.0, 2.9, 0.0]] * 2)
    plain = state(SamplingParams(temperature=0.0), output=[0])
    penalised = state(SamplingParams(temperature=0.0, presence_penalty=0.2), output=[0])
    assert Sampler(3)(logits, [plain, penalised]).token_ids == [0, 1]


def test_logit_bias_is_added() -> None:
    st = state(SamplingParams(logit_bias={2: 5.0, 0: -1.5}))
    assert processed([1.0, 2.0, 0.0], st) == [-0.5, 2.0, 5.0]


def test_allowed_token_ids_mask_everything_else() -> None:
    st = state(SamplingParams(allowed_token_ids=(1, 3)))
    inf = -math.inf
    assert processed([4.0, 1.0, 2.0, 0.5], st) == [inf, 1.0, inf, 0.5]
    states = [state(SamplingParams(temperature=0.0, allowed_token_ids=(1, 3)))]
    assert Sampler(4)(t([[4.0, 1.0, 2.0, 0.5]]), states).token_ids == [1]


def test_bad_words_mask_only_the_completing_token() -> None:
    output: list[int] = [7]
    params = SamplingParams(bad_words_ids=((3, 4), (5,), (1, 2, 6)))
    st = state(params, prompt=[3], output=output)
    inf = -math.inf
    # A prompt ending in 3 does not count: only the generated suffix completes a bad word.
    assert processed([0.0] * 8, st) == [0.0, 0.0, 0.0, 0.0, 0.0, inf, 0.0, 0.0]
    output.append(3)
    assert processed([0.0] * 8, st) == [0.0, 0.0, 0.0, 0.0, inf, inf, 0.0, 0.0]
    output[:] = [1, 2]
    assert processed([0.0] * 8, st) == [0.0, 0.0, 0.0, 0.0, 0.0, inf, inf, 0.0]


def naive_ngram_bans(tokens: list[int], n: int) -> set[int]:
    """HF's no_repeat_ngram rule, recomputed from scratch."""
    if len(tokens) + 1 < n:
        return set()
    prefix = tuple(tokens[len(tokens) - (n - 1) :]) if n > 1 else ()
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    return {g[-1] for g in grams if g[:-1] == prefix}


def test_no_repeat_ngram_matches_hf_rule_incrementally() -> None:
    gen = torch.Generator().manual_seed(0)
    for n in (1, 2, 3):
        prompt = torch.randint(0, 4, (6,), generator=gen).tolist()
        output: list[int] = []
        hist = TokenHistory(prompt, output, ngram_size=n)
        for _ in range(12):
            assert hist.ngram_bans() == naive_ngram_bans(prompt + output, n)
            output.append(int(torch.randint(0, 4, (), generator=gen)))
        del output[3:]  # a rollback rebuilds the index
        assert hist.ngram_bans() == naive_ngram_bans(prompt + output, n)
    hist = TokenHistory([1, 2, 3, 1], [], ngram_size=2)
    assert hist.ngram_bans() == {2}
    st = state(SamplingParams(no_repeat_ngram_size=2), prompt=[1, 2, 3, 1])
    assert processed([0.0] * 4, st) == [0.0, 0.0, -math.inf, 0.0]


def test_min_tokens_masks_eos_and_stop_tokens_until_reached() -> None:
    output: list[int] = []
    params = SamplingParams(min_tokens=2, max_tokens=8, stop_token_ids=(1,))
    st = state(params, output=output, eos_token_ids=frozenset({0}))
    inf = -math.inf
    assert processed([0.0] * 3, st) == [inf, inf, 0.0]
    output.append(2)
    assert processed([0.0] * 3, st) == [inf, inf, 0.0]
    output.append(2)
    assert processed([0.0] * 3, st) == [0.0, 0.0, 0.0]
    ignore = SamplingParams(min_tokens=2, max_tokens=8, stop_token_ids=(1,), ignore_eos=True)
    assert processed([0.0] * 3, state(ignore, eos_token_ids=frozenset({0}))) == [0.0, inf, 0.0]


def test_contradictory_constraints_fall_back_to_raw_logits() -> None:
    """A static contradiction is refused by SamplingParams; one that arises while generating
    (here: the only allowed token would repeat a 1-gram) samples from the raw logits."""
    params = SamplingParams(temperature=0.0, allowed_token_ids=(2,), no_repeat_ngram_size=1)
    out = Sampler(3)(t([[0.0, 1.0, 0.5]]), [state(params, output=[2])])
    assert out.token_ids == [1]


# -- step 8: counter-based randomness -----------------------------------------------------------


def test_uniform_is_a_pure_function_of_seed_choice_and_position() -> None:
    """Same key, same value; each of seed, choice and position changes it; values in [0, 1)."""
    key = (1234, 1, 7)
    assert uniform(*key) == uniform(*key)
    neighbours = [(1235, 1, 7), (1234, 0, 7), (1234, 1, 8), (-1234, 1, 7)]
    assert all(uniform(*k) != uniform(*key) for k in neighbours)
    draws = [uniform(s, c, i) for s in (0, -1, 2**63 - 1) for c in range(4) for i in range(834)]
    assert all(0.0 <= u < 1.0 for u in draws)
    assert len(set(draws)) == len(draws)


def test_uniform_draws_are_uniform() -> None:
    """10k draws along one sequence's positions: mean 1/2 and variance 1/12 within ~5 standard
    errors, and every tenth of [0, 1) holds its share (1000 +- 5 sd of 30)."""
    draws = torch.tensor([uniform(42, 0, i) for i in range(10_000)], dtype=torch.float64)
    assert abs(float(draws.mean()) - 0.5) < 0.015
    assert abs(float(draws.var()) - 1 / 12) < 0.006
    counts = torch.bincount((draws * 10).long(), minlength=10)
    assert int(counts.min()) > 850 and int(counts.max()) < 1150


def test_uniform_key_is_stable() -> None:
    """The key's byte encoding is fixed (every worker, every version draws alike): the top 53
    bits of xxh64 over (seed, choice, position) as little-endian int64s."""
    digest = xxhash.xxh64_intdigest(struct.pack("<qqq", -5, 2, 9))
    assert uniform(-5, 2, 9) == (digest >> 11) / 2**53


def run_steps(
    sampler: Sampler, rows: list[torch.Tensor], states: list[SamplingState], steps: int
) -> list[list[int]]:
    """Sample ``steps`` tokens per state, appending each to the state's output list."""
    logits = torch.stack(rows)
    for _ in range(steps):
        out = sampler(logits, states)
        for st, tok in zip(states, out.token_ids, strict=True):
            st.history.output.append(tok)  # type: ignore[attr-defined]
    return [list(st.history.output) for st in states]


def seeded_state() -> SamplingState:
    params = SamplingParams(temperature=1.3, top_k=20, seed=1234, repetition_penalty=1.2)
    return SamplingState.create(params, [5, 6], [], seed=1234)


def test_seeded_request_draws_the_same_tokens_alone_or_batched() -> None:
    gen = torch.Generator().manual_seed(9)
    row = torch.randn(64, generator=gen)
    others = [torch.randn(64, generator=gen) for _ in range(3)]
    sampler = Sampler(64)
    (alone,) = run_steps(sampler, [row], [seeded_state()], 12)
    assert len(set(alone)) > 3  # genuinely random, not a constant

    def other_states() -> list[SamplingState]:
        return [
            SamplingState.create(SamplingParams(temperature=0.0), [1], [], seed=0),
            SamplingState.create(SamplingParams(top_p=0.5, seed=7), [1], [], seed=7),
            SamplingState.create(SamplingParams(min_p=0.1, top_k=5), [1], [], seed=8),
        ]

    for position in (0, 2, 3):
        states = other_states()
        states.insert(position, seeded_state())
        rows = list(others)
        rows.insert(position, row)
        assert run_steps(sampler, rows, states, 12)[position] == alone


def test_snapshot_restore_continues_the_identical_stream() -> None:
    row = torch.randn(32, generator=torch.Generator().manual_seed(4))
    sampler = Sampler(32)
    original = seeded_state()
    run_steps(sampler, [row], [original], 5)
    snap = original.snapshot()
    expected = run_steps(sampler, [row], [original], 8)[0][5:]

    assert snap == SamplingSnapshot(1234, 0, 5)  # the key and the length: no RNG bytes
    wire = SamplingSnapshot(snap.seed, snap.choice, snap.num_output_tokens)
    output = list(original.history.output[:5])
    restored = SamplingState.restore(wire, original.params, [5, 6], output)
    assert run_steps(sampler, [row], [restored], 8)[0][5:] == expected
    with pytest.raises(ValueError, match="5 output tokens"):
        SamplingState.restore(wire, original.params, [5, 6], output)


def test_a_state_rebuilt_from_its_key_and_tokens_continues_the_stream() -> None:
    """No state but (seed, choice) and the tokens: a fresh state over the first k tokens draws
    what the uninterrupted one drew after them."""
    row = torch.randn(32, generator=torch.Generator().manual_seed(6))
    sampler = Sampler(32)
    (full,) = run_steps(sampler, [row], [seeded_state()], 10)
    params = seeded_state().params
    for k in (1, 4, 9):
        fresh = SamplingState.create(params, [5, 6], full[:k], seed=1234)
        assert run_steps(sampler, [row], [fresh], 10 - k)[0] == full


def test_for_request_keys_each_sample_by_the_requests_seed_and_its_choice() -> None:
    req = Request("r1", [1, 2], SamplingParams(seed=11, choice=2), eos_token_ids=frozenset({2}))
    st = SamplingState.for_request(req, sample_index=1)
    assert (st.seed, st.choice, st.eos_token_ids) == (11, 3, {2})
    assert st.params is req.sampling_params and st.history.prompt is req.prompt_token_ids
    req.output_token_ids.append(9)
    assert st.history.output == [9]  # the state reads the request's live output list


def test_an_unseeded_request_draws_and_records_its_seed_at_arrival() -> None:
    """Each unseeded request gets its own random seed, once; its params then carry it."""
    params = SamplingParams(no_repeat_ngram_size=2)
    a, b = Request("a", [1], params), Request("b", [1], params)
    assert params.seed is None and a.seed != b.seed
    assert a.sampling_params == SamplingParams(no_repeat_ngram_size=2, seed=a.seed)
    assert SamplingState.for_request(a).seed == a.seed
    assert SamplingState.for_request(Request("c", [1], SamplingParams(seed=0))).seed == 0


def test_choices_of_one_seed_draw_different_streams() -> None:
    """Two choices of one seeded request differ by the choice index in the key: over 64 equally
    likely tokens, 16 equal draws in a row would be a 2^-96 accident."""
    row = torch.zeros(64)
    params = SamplingParams(seed=5)
    states = [SamplingState.create(params, [1], [], seed=5, choice=c) for c in (0, 1)]
    first, second = run_steps(Sampler(64), [row, row], states, 16)
    assert first != second


def test_draw_uses_inverse_cdf_of_the_filtered_distribution() -> None:
    """The batched path equals the 1-D functions plus the inverse CDF at the row's uniform."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 40, generator=gen) * 2
    params = [
        SamplingParams(temperature=0.7, top_k=10, top_p=0.8),
        SamplingParams(temperature=1.5, min_p=0.2),
        SamplingParams(temperature=1.0, typical_p=0.7, top_k=30),
        SamplingParams(temperature=0.9),
    ]
    for step in range(10):
        states = [
            SamplingState.create(p, [0], [], seed=100 * step + i) for i, p in enumerate(params)
        ]
        got = Sampler(40)(logits, states).token_ids
        for i, p in enumerate(params):
            q = temperature_probs(logits[i], p.temperature)
            q = top_k_filter(q, p.top_k) if p.top_k else q
            q = top_p_filter(q, p.top_p)
            q = min_p_filter(q, p.min_p)
            q = typical_filter(q, p.typical_p)
            u = uniform(100 * step + i, 0, 0)
            cdf = q.cumsum(-1)
            assert got[i] == int(torch.searchsorted(cdf, u * cdf[-1], right=True))


def test_empirical_frequencies_match_the_filtered_distribution() -> None:
    logits = t([2.0, 1.0, 0.5, 1.5, -1.0, 0.0])
    params = SamplingParams(temperature=0.8, top_k=4, top_p=0.95)
    expected = top_p_filter(top_k_filter(temperature_probs(logits, 0.8), 4), 0.95)
    assert support(expected) == {0, 1, 2, 3}
    draws = 20_000
    states = [SamplingState.create(params, [0], [], seed=i) for i in range(draws)]
    tokens = Sampler(6)(logits.expand(draws, 6), states).token_ids
    freq = torch.bincount(torch.tensor(tokens), minlength=6).double() / draws
    assert freq[4] == 0 and freq[5] == 0
    # 4.5 standard errors of the largest-variance bin (p ~ 0.4): sqrt(.24 / 20000) = 0.0035.
    assert float((freq - expected.double()).abs().max()) < 0.016


# -- logprobs ------------------------------------------------------------------------------------


def test_logprobs_are_of_the_raw_distribution() -> None:
    logits = t([[1.0, 3.0, 2.0, 3.0, -1.0], [0.0, 1.0, 2.0, 3.0, 4.0]])
    params = [
        SamplingParams(temperature=0.0, logprobs=3, repetition_penalty=3.0),
        SamplingParams(temperature=0.5, top_k=2, seed=3),
    ]
    states = [state(params[0], prompt=[1]), state(params[1])]
    out = Sampler(5)(logits, states)
    assert out.token_ids[0] == 3  # the penalty moved the greedy choice off token 1
    raw = log_softmax(logits[0]).tolist()
    entry = out.logprobs[0]
    assert entry is not None and out.logprobs[1] is None
    assert entry.logprob == raw[3]
    assert entry.top == [(1, raw[1]), (3, raw[3]), (2, raw[2])]  # tie 1 vs 3: lower id first
    only_chosen = state(SamplingParams(temperature=0.0, logprobs=0))
    entry = Sampler(5)(logits[1:], [only_chosen]).logprobs[0]
    assert (
        entry is not None and entry.top == [] and entry.logprob == log_softmax(logits[1])[4].item()
    )


def test_shape_mismatch_is_rejected() -> None:
    with pytest.raises(ValueError, match="logits shape"):
        Sampler(4)(torch.zeros(2, 5), [state(SamplingParams()), state(SamplingParams())])


# -- pinned by mutation testing (make mutation) --------------------------------------------------


def test_restore_keeps_the_eos_ids() -> None:
    """A restored state keeps its EOS ids, so min_tokens still masks EOS after a migration."""
    params = SamplingParams(min_tokens=3, seed=5)
    original = SamplingState.create(params, [1], [], seed=5, eos_token_ids=frozenset({2}))
    output = [0]
    restored = SamplingState.restore(
        SamplingSnapshot(original.seed, original.choice, 1),
        params,
        [1],
        output,
        eos_token_ids=frozenset({2}),
    )
    assert restored.eos_token_ids == {2} and restored.history.output is output
    # EOS (id 2) has by far the largest logit, but only one of three tokens is out
    out = Sampler(4)(t([[0.0, 0.0, 50.0, 0.0]]), [restored])
    assert out.token_ids[0] != 2


def test_typical_ignores_zero_probability_tokens_in_the_entropy() -> None:
    """Zero-probability tokens (say, cut by top-k) add nothing to the entropy typical-p uses."""
    q = typical_filter(t([0.5, 0.3, 0.2, 0.0]), 0.5)
    # H = 1.0297; |-log p - H| orders the tokens 0.3, 0.5, 0.2: the first two reach 0.5
    assert q.tolist() == pytest.approx([0.625, 0.375, 0.0, 0.0])


def test_temperature_is_applied_against_each_rows_own_max() -> None:
    """Rows of very different scale in one batch each keep a finite, correct distribution."""
    logits = t([[0.0, 30.0, -30.0], [500.0, 530.0, 470.0]])
    params = SamplingParams(temperature=1.0, seed=1)
    states = [SamplingState.create(params, [0], [], seed=s) for s in (1, 2)]
    # token 1 holds all but ~1e-13 of both rows' mass
    assert Sampler(3)(logits, states).token_ids == [1, 1]


def test_logprobs_top_lists_have_each_rows_own_length() -> None:
    """In one batch each row gets exactly its own number of top logprobs (0 included)."""
    logits = t([[0.0, 1.0, 2.0, 3.0], [3.0, 2.0, 1.0, 0.0], [1.0, 0.0, 3.0, 2.0]])
    states = [state(SamplingParams(temperature=0.0, logprobs=n)) for n in (0, 1, 3)]
    out = Sampler(4)(logits, states)
    assert out.token_ids == [3, 0, 2]
    raw = [log_softmax(row).tolist() for row in logits]
    entries = out.logprobs
    assert all(e is not None for e in entries)
    assert [e.logprob for e in entries if e is not None] == [raw[0][3], raw[1][0], raw[2][2]]
    assert [e.top for e in entries if e is not None] == [
        [],
        [(0, raw[1][0])],
        [(2, raw[2][2]), (3, raw[2][3]), (0, raw[2][0])],
    ]


def test_top_k_larger_than_the_vocabulary_keeps_everything() -> None:
    """top_k_filter with k above the vocabulary size is the identity (k is clamped)."""
    p = t([0.1, 0.2, 0.3, 0.4])
    assert top_k_filter(p, 10).tolist() == pytest.approx(p.tolist())
    assert top_k_mask(p[None], [10]).tolist() == [[True, True, True, True]]


def test_draw_on_a_cdf_boundary_takes_the_next_positive_token() -> None:
    """A uniform landing exactly on a CDF step selects the token after it, never a zero one."""
    u = 0.7255
    u32 = float(torch.tensor(u, dtype=torch.float32))
    probs = torch.tensor([[u32, 0.0, 1.0 - u32]], dtype=torch.float32)
    assert float(probs.cumsum(-1)[0, -1]) == 1.0  # so u * total is exactly cdf[0]
    assert _draw(probs, [u]).tolist() == [2]
    # an unnormalised row: the uniform is scaled by the row's total mass
    heavy = torch.tensor([[2.0, 2.0]])  # 4 * 0.7255 = 2.9 lies in token 1's step [2, 4)
    assert _draw(heavy, [u]).tolist() == [1]


def test_one_row_filters_normalise_their_input_first() -> None:
    """The 1-D filters treat an unnormalised row as the distribution it is proportional to."""
    raw = t([1.0, 1.0, 2.0])
    assert top_p_filter(raw, 0.6).tolist() == pytest.approx([1 / 3, 0.0, 2 / 3])
    assert top_p_filter(raw, 0.6).tolist() == top_p_filter(raw / 4, 0.6).tolist()


def test_mass_one_keeps_every_token() -> None:
    """top-p / typical-p of exactly 1 keep even tokens past 1 - 1e-6 of cumulative mass."""
    p = t([0.9999995, 5e-7])
    assert support(top_p_filter(p, 1.0)) == {0, 1}
    assert support(typical_filter(p, 1.0)) == {0, 1}
