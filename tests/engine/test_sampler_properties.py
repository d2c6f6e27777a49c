"""Property tests of the sampler's filters (docs/design.md#sampling-order): exact supports against
a rational-arithmetic reference, shift invariance, nestedness, min-p monotonicity, greedy
tie-break, and batch independence of a seeded request.

Inputs live on grids (integer weights and logits, thresholds j/20, power-of-two temperatures) so
that every comparison is exact or clear of float rounding: the properties hold bit for bit.
"""

from __future__ import annotations

from fractions import Fraction

import torch
from helpers import (
    greedy_token,
    min_p_filter,
    temperature_probs,
    top_k_filter,
    top_p_filter,
    typical_filter,
)
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from engine.sampler import (
    Sampler,
    SamplingState,
)
from engine.sampling_params import SamplingParams

SETTINGS = settings(max_examples=150, deadline=None, derandomize=True)

weights = st.lists(st.integers(0, 100), min_size=1, max_size=12).filter(lambda w: sum(w) > 0)
int_logits = st.lists(st.integers(-8, 8), min_size=1, max_size=12)
twentieths = st.integers(1, 20).map(lambda j: Fraction(j, 20))
temperatures = st.sampled_from([0.25, 0.5, 1.0, 2.0, 4.0, 8.0])


def support(q: torch.Tensor) -> set[int]:
    return {i for i, v in enumerate(q.tolist()) if v > 0}


def probs_of(w: list[int]) -> torch.Tensor:
    return torch.tensor(w, dtype=torch.float64) / sum(w)


def by_rank(w: list[int]) -> list[int]:
    return sorted(range(len(w)), key=lambda i: (-w[i], i))


def ref_top_k(w: list[int], k: int) -> set[int]:
    return {i for i in by_rank(w)[:k] if w[i] > 0}


def ref_top_p(w: list[int], p: Fraction) -> set[int]:
    kept, mass = set(), 0
    for i in by_rank(w):
        kept.add(i)
        mass += w[i]
        if mass >= p * sum(w):
            break
    return {i for i in kept if w[i] > 0}


def ref_min_p(w: list[int], alpha: Fraction) -> set[int]:
    return {i for i, x in enumerate(w) if x > 0 and x >= alpha * max(w)}


def assert_renormalised(q: torch.Tensor, p: torch.Tensor, kept: set[int]) -> None:
    """Sums to 1, zero outside ``kept``, and proportional to ``p`` inside it."""
    assert support(q) == kept
    assert abs(float(q.sum()) - 1.0) < 1e-12
    mass = float(p[sorted(kept)].sum())
    for i in kept:
        assert abs(float(q[i]) - float(p[i]) / mass) < 1e-12


@SETTINGS
@given(weights, st.data())
def test_filters_match_exact_reference(w: list[int], data: st.DataObject) -> None:
    p = probs_of(w)
    k = data.draw(st.integers(1, len(w)))
    assert_renormalised(top_k_filter(p, k), p, ref_top_k(w, k))
    top = data.draw(twentieths)
    assert_renormalised(top_p_filter(p, float(top)), p, ref_top_p(w, top))
    alpha = data.draw(st.integers(0, 20).map(lambda j: Fraction(j, 20)))
    assume(all(x != alpha * max(w) for x in w) or alpha in (0, 1))  # off the float boundary
    assert_renormalised(min_p_filter(p, float(alpha)), p, ref_min_p(w, alpha))


@SETTINGS
@given(weights, twentieths)
def test_typical_is_a_renormalised_subset(w: list[int], mass: Fraction) -> None:
    p = probs_of(w)
    q = typical_filter(p, float(mass))
    kept = support(q)
    positive = {i for i, x in enumerate(w) if x > 0}
    assert kept and kept <= positive
    assert float(p[sorted(kept)].sum()) >= float(mass) - 1e-6  # it reaches the target mass
    assert_renormalised(q, p, kept)
    if mass == 1:
        assert kept == positive


@SETTINGS
@given(int_logits, st.integers(-64, 64), temperatures, st.data())
def test_supports_are_shift_invariant(
    z: list[int], shift: int, temp: float, data: st.DataObject
) -> None:
    base = temperature_probs(torch.tensor(z, dtype=torch.float32), temp)
    moved = temperature_probs(torch.tensor(z, dtype=torch.float32) + shift, temp)
    k = data.draw(st.integers(1, len(z)))
    top, alpha, mass = (float(data.draw(twentieths)) for _ in range(3))
    assert support(top_k_filter(moved, k)) == support(top_k_filter(base, k))
    assert support(top_p_filter(moved, top)) == support(top_p_filter(base, top))
    assert support(min_p_filter(moved, alpha)) == support(min_p_filter(base, alpha))
    assert support(typical_filter(moved, mass)) == support(typical_filter(base, mass))


@SETTINGS
@given(int_logits, temperatures, st.data())
def test_supports_are_nested(z: list[int], temp: float, data: st.DataObject) -> None:
    p = temperature_probs(torch.tensor(z, dtype=torch.float32), temp)
    k1, k2 = sorted(data.draw(st.integers(1, len(z))) for _ in range(2))
    assert support(top_k_filter(p, k1)) <= support(top_k_filter(p, k2))
    assert len(support(top_k_filter(p, k1))) == min(k1, len(support(p)))
    p1, p2 = sorted(float(data.draw(twentieths)) for _ in range(2))
    assert support(top_p_filter(p, p1)) <= support(top_p_filter(p, p2))
    a_low, a_high = sorted(float(data.draw(twentieths)) for _ in range(2))
    assert support(min_p_filter(p, a_high)) <= support(min_p_filter(p, a_low))


@SETTINGS
@given(int_logits, st.integers(1, 19), temperatures, temperatures)
def test_min_p_support_grows_with_temperature(z: list[int], j: int, t1: float, t2: float) -> None:
    alpha = j / 20  # < 1: with alpha = 1 only the maxima ever stay
    low, high = sorted((t1, t2))
    logits = torch.tensor(z, dtype=torch.float32)
    cold = support(min_p_filter(temperature_probs(logits, low), alpha))
    hot = support(min_p_filter(temperature_probs(logits, high), alpha))
    assert cold <= hot
    assert {i for i, v in enumerate(z) if v == max(z)} <= cold  # the max always stays


@SETTINGS
@given(st.lists(int_logits.filter(lambda z: len(z) == 6), min_size=1, max_size=5))
def test_greedy_is_argmax_with_lowest_index(rows: list[list[int]]) -> None:
    expected = [row.index(max(row)) for row in rows]
    assert [greedy_token(torch.tensor(row, dtype=torch.float32)) for row in rows] == expected
    states = [SamplingState.create(SamplingParams(temperature=0.0), [0], [], seed=0) for _ in rows]
    assert Sampler(6)(torch.tensor(rows, dtype=torch.float32), states).token_ids == expected


other_params = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.5, 1.0]),
    top_k=st.sampled_from([0, 3]),
    top_p=st.sampled_from([1.0, 0.6]),
    min_p=st.sampled_from([0.0, 0.2]),
    typical_p=st.sampled_from([1.0, 0.8]),
    repetition_penalty=st.sampled_from([1.0, 1.3]),
    seed=st.integers(0, 99),
)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(st.lists(other_params, max_size=4), st.data())
def test_seeded_request_ignores_its_batch(
    others: list[SamplingParams], data: st.DataObject
) -> None:
    vocab, steps = 16, 6
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(len(others) + 1, vocab, generator=gen)
    params = SamplingParams(temperature=1.2, top_p=0.9, seed=77, frequency_penalty=0.5)
    position = data.draw(st.integers(0, len(others)))
    all_params = [*others[:position], params, *others[position:]]
    row = logits[0]
    rows = torch.cat((logits[1 : position + 1], row[None], logits[position + 1 :]))

    def run(batch: torch.Tensor, param_list: list[SamplingParams], pos: int) -> list[int]:
        outputs: list[list[int]] = [[] for _ in param_list]
        states = [
            SamplingState.create(p, [1, 2], out, seed=p.seed or 0)
            for p, out in zip(param_list, outputs, strict=True)
        ]
        for _ in range(steps):
            toks = Sampler(vocab)(batch, states).token_ids
            for out, tok in zip(outputs, toks, strict=True):
                out.append(tok)
        return outputs[pos]

    assert run(rows, all_params, position) == run(row[None], [params], 0)
