"""The sampler: one token per row of a [B, V] logits tensor (docs/design.md#sampling).

Pipeline (docs/design.md#sampling-order), each step skipped for rows that leave it disabled:

    hard constraints -> penalties -> temperature -> top-k -> top-p -> min-p -> typical -> draw

Steps 1–2 live in :mod:`engine.logits_processors`, a request's grammar (structured outputs,
:mod:`engine.structured`) first among the hard constraints. ``temperature == 0`` is its own greedy branch
(argmax, lowest token id wins a tie) and never divides by zero. Each truncation filter
renormalises what it keeps, so the next filter sees a distribution (top-k then top-p differs from
top-p then top-k, docs/design.md#sampling-order).

Randomness is counter-based (docs/design.md#sampling-seeds): the token at output position i of
choice c of a request with seed s is drawn by inverse CDF with ``uniform(s, c, i)``, a pure
function. So a request draws the same tokens whatever shares its batch, and a retried or migrated
sequence draws what the fault-free run drew from its seed, choice and output length alone: there
is no generator state to carry.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import xxhash
from torch import Tensor

from engine import kernels
from engine.logits_processors import TokenHistory, needs_processing, process_logits
from engine.outputs import SamplingSnapshot, TokenLogprobs
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.structured import Grammars, GrammarState, allowed_tokens, token_bitmask

# Cumulative mass within this of the target counts as reaching it, so that float rounding of an
# exact boundary (0.3 + 0.33 vs typical_p = 0.63) cannot pull in one more token.
_MASS_TOL = 1e-6
# top_p's first candidates per row (top_p_mask): a peaked row's mass is there; and how much
# more it takes each time they fall short (4 and 8 measured alike, 16 slower).
_TOP_P_FIRST_K = 64
_TOP_P_WIDEN = 4

MaskFn = Callable[[Tensor, Sequence[float]], Tensor]


# -- truncation filters, batched: probs [B, V] with rows summing to 1 -> keep mask [B, V] --------


def top_k_mask(probs: Tensor, k: Sequence[float]) -> Tensor:
    """Keep the k most probable tokens of each row; ties at the k-th place go to smaller ids."""
    vocab = probs.shape[-1]
    ks = torch.tensor(k, device=probs.device).long().clamp(1, vocab)
    kth = probs.topk(int(ks.max())).values.gather(-1, (ks - 1)[:, None])
    above = probs > kth
    tied = probs == kth
    room = ks[:, None] - above.sum(-1, keepdim=True)
    return above | (tied & (tied.cumsum(-1) <= room))


def top_p_mask(probs: Tensor, p: Sequence[float]) -> Tensor:
    """Keep the smallest most-probable-first prefix (ties by id) whose mass reaches p; the
    token that crosses p is kept (p = [.4, .3, .2, .1], p0 = .65 -> {0, 1}).

    A stable sort of the vocabulary per row was most of a sampled step; instead each row's
    likeliest candidates are ordered (:func:`_likeliest_prefix`), 64 of them, four times more
    (or as many as the shortfall proves needed) each time their mass falls short of the
    target: the same bits as the full sort, which only a near-flat distribution still comes
    to. Candidates of up to a quarter of the vocabulary cost less than the full sort, half of
    it more (64 rows, AMD EPYC: 22.6 / 44.9 ms against 28.2 at 8,192 tokens; 160 / 316 against
    203 at 49,152)."""
    target = _targets(probs, p)
    keep = (target >= 1.0).expand_as(probs).clone()  # mass 1 keeps every token
    pending = (target[:, 0] < 1.0).nonzero().flatten()
    k = _TOP_P_FIRST_K
    while len(pending) and k <= probs.shape[-1] // 4:
        reached, mask, need = _likeliest_prefix(probs[pending], target[pending], k)
        keep[pending[reached]] = mask[reached]
        pending, need = pending[~reached], need[~reached]
        # Skip the rounds that cannot reach: a row needs at least ``need`` candidates (so a
        # flat row goes to the full sort after one round, not four).
        k *= _TOP_P_WIDEN
        while len(pending) and k < float(need.max()):
            k *= _TOP_P_WIDEN
    if len(pending):
        sorted_probs, order = probs[pending].sort(dim=-1, descending=True, stable=True)
        keep[pending] = _prefix_mask(sorted_probs, order, target[pending])
    return keep


def _likeliest_prefix(probs: Tensor, target: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`_prefix_mask` over each row's candidates -- its ``k`` likeliest tokens, ties with
    the k-th included, ordered by probability then id as the full stable sort orders them, so
    their double cumsum is the same additions as that sort's prefix -- and, per row, whether
    the candidates' mass reached the target: there no later token is kept either (a later
    token's preceding mass is at least theirs), and the mask is the full sort's. Third, a
    lower bound on the candidates a row short of its target needs: every later token is at
    most as likely as the k-th, so the missing mass takes at least (missing / p_k) of them."""
    top, top_ids = probs.topk(k + 1, dim=-1)  # k < vocab (top_p_mask's loop)
    # Where the (k+1)-th is below the k-th, the candidates are topk's k: ordered as the full
    # sort orders them (ids ascending, then a stable sort by probability), with no pass over
    # the vocabulary. Rows with a tie across the edge (or fewer than k tokens above 0) take
    # every token at least the k-th, found in the whole row below.
    clean = top[:, k] < top[:, k - 1]
    if bool(clean.all()):
        ids = top_ids[:, :k].sort(dim=-1).values
        sorted_probs, perm = probs.gather(-1, ids).sort(dim=-1, descending=True, stable=True)
        keep_sorted, reached = _prefix_keep(sorted_probs, target)
        mask = torch.zeros_like(probs, dtype=torch.bool)
        mask.scatter_(-1, ids.gather(-1, perm), keep_sorted)
        return reached, mask, _need(sorted_probs, target, top[:, k - 1], k)
    kth = top[:, k - 1 : k]
    rows, ids = (probs >= kth).nonzero(as_tuple=True)  # row-major: ids ascending in a row
    counts = torch.bincount(rows, minlength=probs.shape[0])
    slot = torch.arange(len(rows), device=probs.device) - (counts.cumsum(0) - counts)[rows]
    # Padded with 0, which sorts after every candidate (all > 0 unless the row has fewer than
    # k tokens above 0, and then every token of it is a candidate: no padding in that row).
    cand = probs.new_zeros(probs.shape[0], int(counts.max()))
    cand[rows, slot] = probs[rows, ids]
    sorted_probs, perm = cand.sort(dim=-1, descending=True, stable=True)
    keep_sorted, reached = _prefix_keep(sorted_probs, target)
    keep = torch.zeros_like(keep_sorted).scatter(-1, perm, keep_sorted)  # candidates' order
    mask = torch.zeros_like(probs, dtype=torch.bool)
    mask[rows, ids] = keep[rows, slot]
    return reached, mask, _need(sorted_probs, target, top[:, k - 1], k)


def _need(sorted_probs: Tensor, target: Tensor, kth: Tensor, k: int) -> Tensor:
    """:func:`_likeliest_prefix`'s bound (float64; infinite where the k-th is 0), used only to
    choose the next k: the mask never depends on it."""
    missing = (target[:, 0] - sorted_probs.double().sum(-1)).clamp(min=0)
    return k + missing / kth.double()


def min_p_mask(probs: Tensor, alpha: Sequence[float]) -> Tensor:
    """Keep p_i >= alpha * max p (i.e. z_i >= z_max + T log alpha): the max always stays."""
    scale = torch.tensor(alpha, dtype=probs.dtype, device=probs.device)[:, None]
    return probs >= scale * probs.amax(-1, keepdim=True)


def typical_mask(probs: Tensor, mass: Sequence[float]) -> Tensor:
    """Typical sampling: order tokens by |-log p_i - H| ascending (ties by id) and keep the
    smallest prefix reaching ``mass``; this may drop the most probable token
    (docs/design.md#sampling-order)."""
    logp = log(probs)
    entropy = -row_sum(torch.where(probs > 0, probs * logp, 0))
    distance = (-logp - entropy).abs()  # +inf for zero-probability tokens: they sort last
    _, order = distance.sort(dim=-1, stable=True)
    target = _targets(probs, mass)
    keep = _prefix_mask(probs.gather(-1, order), order, target)
    return keep | (target >= 1.0)  # mass 1 keeps every token


def _targets(probs: Tensor, mass: Sequence[float]) -> Tensor:
    """Each row's target mass, ``[B, 1]`` float64."""
    return torch.tensor(mass, dtype=torch.float64, device=probs.device)[:, None]


def _prefix_keep(sorted_probs: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    """Keep sorted positions whose preceding cumulative mass is still below ``target``; and
    whether all of them together reach it."""
    total = sorted_probs.double().cumsum(-1)
    keep = total - sorted_probs < target - _MASS_TOL
    keep[:, 0] = True  # the first token alone may already reach the target
    return keep, ~(total[:, -1] < target[:, 0] - _MASS_TOL)


def _prefix_mask(sorted_probs: Tensor, order: Tensor, target: Tensor) -> Tensor:
    """:func:`_prefix_keep`'s positions, back in vocabulary order."""
    keep, _ = _prefix_keep(sorted_probs, target)
    return torch.zeros_like(keep).scatter(-1, order, keep)


def _renormalise(probs: Tensor, keep: Tensor) -> Tensor:
    kept = torch.where(keep, probs, 0)
    return kept / row_sum(kept)


def _tempered_probs(logits: Tensor, temperatures: Sequence[float]) -> Tensor:
    """softmax(z / T) per row, T > 0; subtracting the row max first keeps tiny T finite.
    Written out rather than ``torch.softmax``, whose CPU kernel sums in its vector width and so
    differs in the last bit between AVX2 and AVX-512 (:func:`log_softmax`)."""
    temps = torch.tensor(temperatures, dtype=logits.dtype, device=logits.device)[:, None]
    weights = exp((logits - logits.amax(-1, keepdim=True)) / temps)
    return weights / row_sum(weights)


def log_softmax(logits: Tensor) -> Tensor:
    """``logits - logsumexp(logits)`` per row: the same bits on every CPU family and thread
    count, so a stream moved between an AVX2 and an AVX-512 worker of the portable numerics
    class keeps its logprobs (docs/design.md#numerics-classes). ``torch.log_softmax``'s CPU
    kernel sums in its vector width (8 floats on AVX2, 16 on AVX-512) and the two differ in the
    last bit; :func:`exp`, :func:`log` and :func:`row_sum` do not."""
    top = logits.amax(-1, keepdim=True)
    return logits - (top + log(row_sum(exp(logits - top))))


def row_sum(x: Tensor) -> Tensor:
    """Each row's sum, ``[B, 1]``; on CPU in one fixed order (engine/csrc/portable_math.cpp).
    ``torch.sum`` splits a row longer than its 32,768-element grain across threads when there
    are few rows (a decode step of one sequence over a 49,152-token vocabulary), so its bits
    follow the thread count, and its vector width the CPU."""
    if _portable(x):
        summed = kernels.row_sum(x.reshape(-1, x.shape[-1]))
        if summed is not None:
            return summed.reshape(*x.shape[:-1], 1)
    return x.sum(-1, keepdim=True)


def exp(x: Tensor) -> Tensor:
    """``x.exp()``, on CPU the same bits on every CPU: torch's calls MKL, whose code (and last
    bits) follow the CPU it finds (engine/csrc/portable_math.cpp)."""
    out = kernels.portable_exp(x) if _portable(x) else None
    return x.exp() if out is None else out


def log(x: Tensor) -> Tensor:
    """``x.log()``, as :func:`exp`."""
    out = kernels.portable_log(x) if _portable(x) else None
    return x.log() if out is None else out


def _portable(x: Tensor) -> bool:
    """Whether the portable kernels take ``x``: float32 on CPU (elsewhere torch's ops)."""
    return x.device.type == "cpu" and x.dtype == torch.float32


# -- per-sequence state ---------------------------------------------------------------------------


def uniform(seed: int, choice: int, position: int) -> float:
    """The uniform in [0, 1) that draws the token at output ``position`` (0 = the first generated
    token) of choice ``choice`` of a request seeded ``seed``: the top 53 bits of xxh64 over the
    three as little-endian int64s.

    A pure function of its key rather than a generator's next value, so a sequence carries no RNG
    state: a retried or migrated request, resumed at any output length, draws exactly what the
    fault-free run drew, and no other sequence in its batch can shift its draws."""
    digest = xxhash.xxh64_intdigest(struct.pack("<qqq", seed, choice, position))
    return (digest >> 11) * 2.0**-53


@dataclass
class SamplingState:
    """Everything the sampler keeps for one sequence between steps; lives with the request."""

    params: SamplingParams
    history: TokenHistory
    eos_token_ids: frozenset[int]
    seed: int
    choice: int  # the key's choice index: params.choice + the sample's index among the n
    grammar: GrammarState | None = None  # the constraint's matcher, when the request has one

    @classmethod
    def create(
        cls,
        params: SamplingParams,
        prompt_token_ids: Sequence[int],
        output_token_ids: Sequence[int],
        *,
        seed: int,
        choice: int = 0,
        eos_token_ids: frozenset[int] = frozenset(),
        grammars: Grammars | None = None,
    ) -> SamplingState:
        """A fresh state; ``output_token_ids`` is the sequence's live list (read every step).
        A constrained request's grammar comes from ``grammars`` (its matcher catches up with
        the output, replaying it, at the first step)."""
        history = TokenHistory(
            prompt_token_ids, output_token_ids, ngram_size=params.no_repeat_ngram_size
        )
        grammar = None
        if params.constraint is not None:
            if grammars is None:
                raise ValueError("a constrained request needs the engine's grammars")
            grammar = grammars.state(params.constraint)
        return cls(params, history, eos_token_ids, seed, choice, grammar)

    @classmethod
    def for_request(
        cls, request: Request, sample_index: int = 0, grammars: Grammars | None = None
    ) -> SamplingState:
        """The state of sample ``sample_index`` of ``request``: its seed, its own choice."""
        params = request.sampling_params
        return cls.create(
            params,
            request.prompt_token_ids,
            request.output_token_ids,
            seed=request.seed,
            choice=params.choice + sample_index,
            eos_token_ids=request.eos_token_ids,
            grammars=grammars,
        )

    def snapshot(self) -> SamplingSnapshot:
        return SamplingSnapshot(self.seed, self.choice, len(self.history.output))

    @classmethod
    def restore(
        cls,
        snapshot: SamplingSnapshot,
        params: SamplingParams,
        prompt_token_ids: Sequence[int],
        output_token_ids: Sequence[int],
        eos_token_ids: frozenset[int] = frozenset(),
        grammars: Grammars | None = None,
    ) -> SamplingState:
        """Rebuild a state from a snapshot. Raises ValueError if the output length differs from
        the one the snapshot was taken at (the sequence would not be the one it describes)."""
        if len(output_token_ids) != snapshot.num_output_tokens:
            raise ValueError(
                f"snapshot taken at {snapshot.num_output_tokens} output tokens, "
                f"sequence has {len(output_token_ids)}"
            )
        return cls.create(
            params,
            prompt_token_ids,
            output_token_ids,
            seed=snapshot.seed,
            choice=snapshot.choice,
            eos_token_ids=eos_token_ids,
            grammars=grammars,
        )


# -- the batched sampler --------------------------------------------------------------------------


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # None where the request did not ask for logprobs


Filter = tuple[MaskFn, Callable[[SamplingParams], float], Callable[[SamplingParams, int], bool]]

# (mask, the row's value, whether the row enables it), in pipeline order
_FILTERS: tuple[Filter, ...] = (
    (top_k_mask, lambda p: p.top_k, lambda p, vocab: 0 < p.top_k < vocab),
    (top_p_mask, lambda p: p.top_p, lambda p, vocab: p.top_p < 1.0),
    (min_p_mask, lambda p: p.min_p, lambda p, vocab: p.min_p > 0.0),
    (typical_mask, lambda p: p.typical_p, lambda p, vocab: p.typical_p < 1.0),
)


class Sampler:
    """Turns one step's logits into tokens; stateless apart from the vocabulary size."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def __call__(self, logits: Tensor, states: Sequence[SamplingState]) -> SamplerOutput:
        """Sample one token per row.

        Args: ``logits`` [B, V] (any float dtype, any device); ``states`` one per row.
        Returns: the tokens and, where asked, their logprobs.
        Raises: ValueError if the shapes do not match.
        """
        if logits.shape != (len(states), self.vocab_size):
            raise ValueError(
                f"logits shape {tuple(logits.shape)} != ({len(states)}, {self.vocab_size})"
            )
        params = [s.params for s in states]
        z = logits.float()
        raw = logits  # what a row whose other hard constraints contradict falls back to
        processed = any(needs_processing(s.params, s.history, s.eos_token_ids) for s in states)
        if any(s.grammar is not None for s in states):
            z = z.clone() if z is logits else z
            _apply_grammars(z, states)
            raw = z.clone() if processed else z  # the grammar is never dropped
        if processed:
            z = z.clone() if z is logits else z
            histories = [s.history for s in states]
            process_logits(z, raw, params, histories, [s.eos_token_ids for s in states])

        greedy = [i for i, p in enumerate(params) if p.greedy]
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if not sampled:
            tokens = _argmax(z)
        elif not greedy:
            tokens = self._sample(z, states)
        else:
            tokens = torch.empty(len(states), dtype=torch.long, device=z.device)
            greedy_index = torch.tensor(greedy, device=z.device)
            sampled_index = torch.tensor(sampled, device=z.device)
            tokens[greedy_index] = _argmax(z[greedy_index])
            tokens[sampled_index] = self._sample(z[sampled_index], [states[i] for i in sampled])
        token_ids = tokens.tolist()
        return SamplerOutput(token_ids, _logprobs(logits, token_ids, params))

    def _sample(self, logits: Tensor, states: Sequence[SamplingState]) -> Tensor:
        """Temperature, truncation filters, then one inverse-CDF draw per row."""
        params = [s.params for s in states]
        uniforms = [uniform(s.seed, s.choice, len(s.history.output)) for s in states]
        if _portable(logits) and all(_top_p_only(p, self.vocab_size) for p in params):
            # The common sampled kind, in one native pass per row: the same bits as below.
            tokens = kernels.sample_top_p(
                logits,
                torch.tensor([p.temperature for p in params], dtype=torch.float32),
                torch.tensor([p.top_p for p in params], dtype=torch.float64),
                torch.tensor(uniforms, dtype=torch.float32),
            )
            if tokens is not None and not bool((tokens < 0).any()):
                return tokens
        probs = _tempered_probs(logits, [p.temperature for p in params])
        for mask, value, enabled in _FILTERS:
            rows = [i for i, p in enumerate(params) if enabled(p, self.vocab_size)]
            if len(rows) == len(params):
                probs = _renormalise(probs, mask(probs, [value(p) for p in params]))
            elif rows:
                index = torch.tensor(rows, device=probs.device)
                sub = probs[index]
                probs[index] = _renormalise(sub, mask(sub, [value(params[i]) for i in rows]))
        return _draw(probs, uniforms)


def _top_p_only(params: SamplingParams, vocab: int) -> bool:
    """Whether the row's only truncation filter, if any, is top_p."""
    return not any(
        enabled(params, vocab) for mask, _, enabled in _FILTERS if mask is not top_p_mask
    )


def _apply_grammars(logits: Tensor, states: Sequence[SamplingState]) -> None:
    """Mask, in place, every token of float32 ``logits`` [B, V] that row i's grammar does not
    allow next, its matcher first caught up with the row's output (rows without one: as is).
    The masks of all rows are computed together (``token_bitmask``) and applied at once, on CPU
    by the native kernel reading the bitmask as it is (engine/csrc/token_bitmask.cpp)."""
    rows, grammars = [], []
    for row, state in enumerate(states):
        if state.grammar is not None:
            state.grammar.sync(state.history.output)
            rows.append(row)
            grammars.append(state.grammar)
    bitmask = token_bitmask(grammars, logits.shape[1])
    if logits.device.type == "cpu" and kernels.apply_token_bitmask(
        logits, torch.from_numpy(bitmask), torch.tensor(rows)
    ):
        return
    allowed = allowed_tokens(bitmask, logits.shape[1])  # no native kernels: unpacked
    banned = ~torch.from_numpy(allowed).to(logits.device)
    if len(rows) == len(states):
        logits.masked_fill_(banned, float("-inf"))
    else:
        index = torch.tensor(rows, device=logits.device)
        logits[index] = logits[index].masked_fill(banned, float("-inf"))


def _argmax(logits: Tensor) -> Tensor:
    """Row-wise argmax of float32 ``[B, V]``, lowest id on a tie (NaN counts as the maximum).

    On CPU numpy's argmax is several times faster than torch's over a [64, 8192] batch (the
    greedy step's whole sampling cost) and has the same first-occurrence semantics."""
    if logits.device.type == "cpu":
        return torch.from_numpy(logits.detach().numpy().argmax(-1))
    return logits.argmax(-1)


def _draw(probs: Tensor, uniforms: Sequence[float]) -> Tensor:
    """Inverse CDF with one uniform per row; zero-probability tokens are never returned (the
    clamp covers u * total rounding up to total)."""
    u = torch.tensor(uniforms, dtype=probs.dtype, device=probs.device)[:, None]
    cdf = probs.cumsum(-1)
    total = cdf[:, -1:]
    index = torch.searchsorted(cdf, u * total, right=True)
    last_positive = (cdf < total).sum(-1, keepdim=True)
    return torch.minimum(index, last_positive).squeeze(-1)


def _logprobs(
    logits: Tensor, token_ids: list[int], params: Sequence[SamplingParams]
) -> list[TokenLogprobs | None]:
    out: list[TokenLogprobs | None] = [None] * len(params)
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return out
    index = torch.tensor(rows, device=logits.device)
    chosen = [token_ids[i] for i in rows]
    found = token_logprobs(logits[index], chosen, [params[i].logprobs or 0 for i in rows])
    for row, lp in zip(rows, found, strict=True):
        out[row] = lp
    return out


def _most_likely(logp: Tensor, n: int) -> tuple[list[list[int]], list[list[float]]]:
    """Each row's ``n`` most likely tokens and their logprobs, ties by lower id first: a stable
    descending sort's first ``n``, without sorting the vocabulary (two full sorts were most of a
    sampled 64-row step). The n-th largest value bounds the candidates -- every token at least
    that likely, ties included -- and only those are ordered."""
    kth = logp.topk(n, dim=-1).values[:, -1:]
    rows, ids = (logp >= kth).nonzero(as_tuple=True)  # row-major: ids ascending in a row
    # Likeliest first, ties by id (a stable sort keeps the row-major order); rows kept apart below.
    order = torch.sort(-logp[rows, ids], stable=True).indices
    out_ids: list[list[int]] = [[] for _ in range(logp.shape[0])]
    out_vals: list[list[float]] = [[] for _ in range(logp.shape[0])]
    values = logp[rows, ids][order].tolist()
    for row, token, value in zip(rows[order].tolist(), ids[order].tolist(), values, strict=True):
        if len(out_ids[row]) < n:
            out_ids[row].append(token)
            out_vals[row].append(value)
    return out_ids, out_vals


def token_logprobs(
    logits: Tensor, token_ids: Sequence[int], num_top: Sequence[int]
) -> list[TokenLogprobs]:
    """Row i's RAW logprob of ``token_ids[i]``, its rank and its ``num_top[i]`` most likely
    tokens: the one computation behind a generated token's logprobs and a prompt token's, so a
    token scored in a prefill has the bits it had when it was sampled."""
    logp = log_softmax(logits.float())
    chosen = torch.tensor(token_ids, device=logits.device, dtype=torch.long)[:, None]
    chosen_logp = logp.gather(-1, chosen)
    ids = torch.arange(logp.shape[-1], device=logits.device)
    ahead = (logp > chosen_logp) | ((logp == chosen_logp) & (ids < chosen))
    ranks = (ahead.sum(-1) + 1).tolist()
    top_n = min(max(num_top, default=0), logp.shape[-1])
    vals: list[list[float]] = [[] for _ in token_ids]
    top_ids: list[list[int]] = [[] for _ in token_ids]
    if top_n:
        top_ids, vals = _most_likely(logp, top_n)
    return [
        TokenLogprobs(lp, list(zip(top_ids[j][:n], vals[j][:n], strict=True)), rank)
        for j, (lp, n, rank) in enumerate(
            zip(chosen_logp.squeeze(-1).tolist(), num_top, ranks, strict=True)
        )
    ]
