"""The sampler's exact arithmetic, value by value (mutation testing found these unpinned): a
token's logprob, rank and top list with ties; the written-out log-softmax; the fixed-order row
sums and their fallback; the draw at the top of a CDF with trailing zeros; and a constrained row
beside a free one (its grammar masks only its row, never the caller's logits, and its logprobs
stay those of the raw distribution)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import kernels
from engine.loader import read_model_config
from engine.request import Request
from engine.sampler import (
    Sampler,
    SamplingState,
    _draw,
    _tempered_probs,
    log_softmax,
    row_sum,
    token_logprobs,
    top_p_mask,
)
from engine.sampling_params import Constraint, SamplingParams
from engine.structured import Grammars, GrammarState
from engine.tokenizer import Tokenizer


def t(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def test_rank_counts_more_likely_tokens_and_equal_ones_of_lower_id() -> None:
    """Rank = 1 + the tokens strictly more likely + the equally likely ones of lower id, so it
    agrees with the top list, whose ties run in id order; each row its own top length."""
    logits = t(
        [
            [1.0, 3.0, 3.0, 0.0, 3.0],  # token 2 ties with 1 (lower id) and 4 (higher)
            [0.0, 0.0, 0.0, 0.0, 5.0],  # token 0 behind token 4 only
            [0.0, 1.0, -1.0, -1.0, -1.0],  # token 1 the likeliest; token 0 lower and less likely
            [2.0, 2.0, 2.0, 2.0, 2.0],  # all tied: the top list in id order
        ]
    )
    out = token_logprobs(logits, [2, 0, 1, 3], [4, 0, 2, 5])
    logp = log_softmax(logits)
    assert [o.rank for o in out] == [2, 2, 1, 4]
    assert [o.logprob for o in out] == [
        logp[0, 2].item(),
        logp[1, 0].item(),
        *logp[2:, [1, 3]].diagonal().tolist(),
    ]
    assert [[i for i, _ in o.top] for o in out] == [[1, 2, 4, 0], [], [1, 0], [0, 1, 2, 3, 4]]
    assert [v for _, v in out[0].top] == [logp[0, i].item() for i in (1, 2, 4, 0)]
    assert token_logprobs(torch.empty(0, 5), [], []) == []


def test_log_softmax_is_each_rows_own_and_matches_torch() -> None:
    """Each row is shifted by its own max: rows a thousand apart (a global shift would
    underflow the lower row to -inf) give torch's values to float32 precision."""
    g = torch.Generator().manual_seed(0)
    logits = torch.cat([torch.randn(2, 300, generator=g), 1000 + torch.randn(2, 300, generator=g)])
    ours = log_softmax(logits)
    assert torch.isfinite(ours).all()
    torch.testing.assert_close(
        ours, torch.log_softmax(logits, -1), rtol=0, atol=1e-4
    )  # float32 near 1000
    torch.testing.assert_close(ours.exp().sum(-1), torch.ones(4), rtol=0, atol=1e-4)


def test_row_sums_go_to_the_fixed_order_kernel_on_cpu_float32(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    x = torch.randn(3, 7, 100, generator=torch.Generator().manual_seed(1))
    called: list[tuple[int, ...]] = []
    real = kernels.row_sum

    def spy(rows: torch.Tensor) -> torch.Tensor | None:
        called.append(tuple(rows.shape))
        return real(rows)

    monkeypatch.setattr(kernels, "row_sum", spy)
    out = row_sum(x)
    assert called == [(21, 100)] and out.shape == (3, 7, 1)
    torch.testing.assert_close(out, x.sum(-1, keepdim=True), rtol=0, atol=1e-4)
    assert row_sum(x.double()).shape == (3, 7, 1) and len(called) == 1  # float64: torch's sum


def test_without_the_kernel_row_sums_are_torchs_with_the_same_shape(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(kernels, "row_sum", lambda rows: None)
    x = torch.randn(4, 50, generator=torch.Generator().manual_seed(2))
    assert torch.equal(row_sum(x), x.sum(-1, keepdim=True))


def test_a_draw_at_the_top_of_the_cdf_never_lands_on_a_trailing_zero() -> None:
    """u * total rounding up to total: searchsorted points past the last token; the draw is
    clamped to each row's last positive token (rows apart: a second row's zeros count only
    for it)."""
    probs = t([[0.25, 0.75, 0.0, 0.0], [0.5, 0.0, 0.5, 0.0]])
    assert _draw(probs, [1 - 2**-53, 1 - 2**-53]).tolist() == [1, 2]
    assert _draw(probs, [0.0, 0.4]).tolist() == [0, 0]


@pytest.fixture(scope="module")
def grammars(test_llama: Path) -> Grammars:
    """The grammar side of the test model's engine, built as the engine builds it (no model:
    mutation runs map every engine function a fixture calls to the tests using it)."""
    model_config, _ = read_model_config(test_llama)
    return Grammars(Tokenizer(test_llama), model_config)


def test_a_constrained_state_holds_its_grammar_and_needs_the_engines(grammars: Grammars) -> None:
    params = SamplingParams(seed=3, choice=1, constraint=Constraint.choice(["ab", "ba"]))
    with pytest.raises(ValueError, match="a constrained request needs the engine's grammars"):
        SamplingState.create(params, (1,), [], seed=0)
    made = SamplingState.create(params, (1,), [], seed=0, grammars=grammars)
    assert isinstance(made.grammar, GrammarState) and made.grammar.consumed == 0
    request = Request("r", [1, 2], params)
    plain = Request("p", [1, 2], SamplingParams(seed=3, choice=1))
    assert SamplingState.for_request(plain).choice == 1  # sample 0 by default
    fork = SamplingState.for_request(request, 2, grammars=grammars)
    assert (fork.choice, fork.seed) == (params.choice + 2, 3) and fork.grammar is not None
    back = SamplingState.restore(fork.snapshot(), params, [1, 2], [], grammars=grammars)
    assert (back.choice, back.seed) == (fork.choice, fork.seed) and back.grammar is not None


def test_a_constrained_row_is_masked_alone_and_its_logprobs_stay_raw(
    grammars: Grammars, test_llama: Path
) -> None:
    """Beside a free row: the free row gets its own argmax, the constrained one a token its
    grammar allows; the caller's logits are not written; both rows' logprobs are of the raw
    logits."""
    vocab = grammars.vocab_size
    tokenizer = Tokenizer(test_llama)
    params = SamplingParams(temperature=0.0, logprobs=1, constraint=Constraint.choice(["ab", "ba"]))
    free = SamplingParams(temperature=0.0, logprobs=1)
    states = [
        SamplingState.create(params, (1,), [], seed=0, grammars=grammars),
        SamplingState.create(free, (1,), [], seed=0),
    ]
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(3))
    kept = logits.clone()
    out = Sampler(vocab)(logits, states)
    assert torch.equal(logits, kept)
    allowed = {tok for tok in range(vocab) if tokenizer.decode([tok]) in ("a", "ab", "b", "ba")}
    assert out.token_ids[0] in allowed and out.token_ids[1] == int(kept[1].argmax())
    raw = log_softmax(kept)
    assert [lp.logprob for lp in out.logprobs] == [
        raw[0, out.token_ids[0]].item(),
        raw[1, out.token_ids[1]].item(),
    ]


@pytest.mark.parametrize("free_rows", [0, 1], ids=["all-constrained", "one-free"])
def test_without_the_bitmask_kernel_the_masks_give_the_same_draws(
    grammars: Grammars, monkeypatch: pytest.MonkeyPatch, free_rows: int
) -> None:
    """The kernel applies the masks on CPU (asked for exactly once per step); without it the
    unpacked masks do, with the same tokens and logprobs, whether or not every row has a
    grammar."""
    vocab = grammars.vocab_size
    constrained = SamplingParams(
        temperature=1.0, seed=2, logprobs=2, constraint=Constraint.choice(["ab", "ba", "bb"])
    )
    free = SamplingParams(temperature=1.0, seed=2, logprobs=2)

    def step() -> object:
        states = [
            SamplingState.create(constrained, (1,), [], seed=2, choice=i, grammars=grammars)
            for i in range(2)
        ] + [SamplingState.create(free, (1,), [], seed=2) for _ in range(free_rows)]
        logits = torch.randn(len(states), vocab, generator=torch.Generator().manual_seed(5))
        return Sampler(vocab)(logits, states)

    calls: list[int] = []
    real = kernels.apply_token_bitmask

    def spy(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> bool:
        calls.append(len(rows))
        return real(logits, bitmask, rows)

    monkeypatch.setattr(kernels, "apply_token_bitmask", spy)
    with_kernel = step()
    assert calls == [2]
    monkeypatch.setattr(kernels, "apply_token_bitmask", lambda *_: False)
    assert step() == with_kernel


@pytest.mark.parametrize("seed", range(20))
def test_the_top_lists_are_a_stable_sorts_first_entries(seed: int) -> None:
    """The top lists come from the candidates at least as likely as the n-th (not a sort of the
    vocabulary): the same ids and values as a stable descending sort's first n, on logits
    rounded to bf16 as a bf16 model's are (ties everywhere), for any n up to the vocabulary."""
    g = torch.Generator().manual_seed(seed)
    rows, vocab = 1 + seed % 7, [5, 37, 300][seed % 3]
    logits = (torch.randn(rows, vocab, generator=g) * (1 + seed % 4)).bfloat16().float()
    if seed % 5 == 0:
        logits[0] = 1.5  # a row of ties only
    logp = log_softmax(logits)
    values, ids = logp.sort(dim=-1, descending=True, stable=True)
    for n in sorted({1, 2, 5, vocab // 2, vocab}):
        out = token_logprobs(logits, [0] * rows, [n] * rows)
        assert [[t for t, _ in o.top] for o in out] == ids[:, :n].tolist()
        assert [[v for _, v in o.top] for o in out] == values[:, :n].tolist()


def full_sort_top_p(probs: torch.Tensor, p: list[float]) -> torch.Tensor:
    """top_p_mask's definition, written out: a stable descending sort of the whole vocabulary,
    each position kept while the mass before it is below p (the first always; p >= 1: all)."""
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
    target = torch.tensor(p, dtype=torch.float64)[:, None]
    keep = (sorted_probs.double().cumsum(-1) - sorted_probs < target - 1e-6) | (target >= 1.0)
    keep[:, 0] = True
    return torch.zeros_like(keep).scatter(-1, order, keep)


@pytest.mark.parametrize("seed", range(40))
def test_top_p_keeps_what_a_full_stable_sort_keeps(seed: int) -> None:
    """top_p orders only each row's likeliest candidates, widening them until their mass
    reaches p: the same mask as the full sort, on bf16-rounded logits (ties everywhere, some
    across the candidates' edge), peaked rows (done at 64), flat ones (the full sort), rows of
    ties only, and p from tiny to 1."""
    g = torch.Generator().manual_seed(seed)
    rows, vocab = 1 + seed % 9, [40, 300, 5000, 49152][seed % 4]
    spread = [0.3, 1.0, 4.0, 12.0][(seed // 4) % 4]
    logits = (torch.randn(rows, vocab, generator=g) * spread).bfloat16().float()
    if seed % 5 == 0:
        logits[0] = 1.5  # a row of ties only
    probs = torch.softmax(logits, -1)
    p = [[1e-9, 0.1, 0.5, 0.9, 0.95, 0.999, 1.0][(seed + i) % 7] for i in range(rows)]
    assert torch.equal(top_p_mask(probs, p), full_sort_top_p(probs, p))


def sampled_rows(seed: int) -> tuple[torch.Tensor, list[SamplingState]]:
    """Logits and states of rows the native draw takes: bf16-rounded logits (ties), a row of
    ties only, rows half -inf (a grammar's or a bias's bans), temperatures from sharp to flat,
    top_p from tiny to off, and seeds whose draws include a uniform of 0."""
    g = torch.Generator().manual_seed(seed)
    rows, vocab = 1 + seed % 9, [40, 300, 5000, 49152][seed % 4]
    spread = [0.3, 1.0, 4.0, 12.0][(seed // 4) % 4]
    logits = (torch.randn(rows, vocab, generator=g) * spread).bfloat16().float()
    if seed % 5 == 0:
        logits[0] = 1.5
    if seed % 7 == 0:
        logits[-1, : vocab // 2] = float("-inf")
    states = []
    for i in range(rows):
        params = SamplingParams(
            temperature=[0.1, 0.8, 1.0, 1.7][(seed + i) % 4],
            top_p=[1e-9, 0.1, 0.5, 0.9, 0.95, 0.999, 1.0][(seed + i) % 7],
            seed=seed * 10 + i,
        )
        states.append(SamplingState.create(params, [1], [7] * (i % 3), seed=seed * 10 + i))
    return logits, states


@pytest.mark.parametrize("seed", range(48))
def test_the_native_draw_gives_the_torch_paths_tokens(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Temperature and top_p rows are drawn by one native pass per row (``sample_top_p``): the
    same tokens as the torch path (the tempered softmax, top_p's mask, the renormalisation and
    the inverse CDF), which is what the sampler runs without the kernel."""
    logits, states = sampled_rows(seed)
    calls: list[int] = []
    real = kernels.sample_top_p

    def spy(z: torch.Tensor, *args: torch.Tensor) -> torch.Tensor | None:
        calls.append(z.shape[0])
        return real(z, *args)

    monkeypatch.setattr(kernels, "sample_top_p", spy)
    sampler = Sampler(logits.shape[1])
    native = sampler(logits, states).token_ids
    assert calls == [len(states)]
    monkeypatch.setattr(kernels, "sample_top_p", lambda *_: None)
    assert sampler(logits, states).token_ids == native


def test_rows_the_native_draw_refuses_take_the_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """A row holding NaN or +inf, or only -inf, comes back -1 from the kernel, and the whole
    batch is drawn by the torch path instead; top_k, min_p and typical rows never reach it."""
    logits, states = sampled_rows(3)
    rows = len(states)
    nan, inf, banned = logits.clone(), logits.clone(), logits.clone()
    nan[0, 1], inf[rows - 1, 2], banned[0] = float("nan"), float("inf"), float("-inf")
    knobs = torch.ones(rows), torch.full((rows,), 0.9, dtype=torch.float64), torch.zeros(rows)
    for z, row in ((nan, 0), (inf, rows - 1), (banned, 0)):
        assert kernels.sample_top_p(z, *knobs)[row].item() == -1
    sampler = Sampler(logits.shape[1])
    native = sampler(inf, states).token_ids
    monkeypatch.setattr(kernels, "sample_top_p", lambda *_: None)
    assert sampler(inf, states).token_ids == native
    calls: list[int] = []
    monkeypatch.setattr(kernels, "sample_top_p", lambda *_: calls.append(1))
    for other in ({"top_k": 5}, {"min_p": 0.1}, {"typical_p": 0.9}):
        params = SamplingParams(temperature=1.0, top_p=0.9, seed=1, **other)  # type: ignore[arg-type]
        sampler(logits[:1], [SamplingState.create(params, [1], [], seed=1)])
    assert calls == []


def test_a_native_draw_on_a_cdf_step_goes_past_it_as_searchsorted_right() -> None:
    """u * total equal to a cdf value draws the next token (torch's ``searchsorted(right=True)``),
    at u = 0 the first positive one, and near 1 never a trailing zero-probability one."""
    z = t([[0.0, 0.0, float("-inf"), float("-inf")]] * 3 + [[float("-inf"), 0.0, 0.0, 0.0]])
    us = torch.tensor([0.5, 0.0, 0.99999994, 0.0])
    knobs = torch.ones(4), torch.ones(4, dtype=torch.float64)
    native = kernels.sample_top_p(z, knobs[0], knobs[1], us)
    assert native is not None and native.tolist() == [1, 0, 1, 1]
    probs = _tempered_probs(z, [1.0] * 4)
    assert _draw(probs, us.tolist()).tolist() == native.tolist()
