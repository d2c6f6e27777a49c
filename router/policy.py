"""Cache-aware choice of the replicas that serve one request: a pure function, no Ray.

Modes (checked in this order):

- **colocated**: the worker list has no prefill or decode workers, only colocated ones; one
  colocated replica prefills and decodes, scored like a prefill replica.
- **local_prefill**: some eligible decode replica would have at most
  ``local_prefill_max_tokens`` prompt tokens left to compute (after its own cache credit):
  shipping KV for so little work costs more than computing it, so the cheapest such decode
  replica prefills too (scored like a prefill replica). 0 means never (see below: at least one
  token is always computed).
- **disaggregated**: the cheapest prefill replica, then the cheapest decode replica given the
  prefill's failure domain.

Cost (lowest wins), with ``load = queue_depth + num_running`` (requests ahead of this one)::

    prefill (and local_prefill, colocated):
        w_queue * load  +  w_uncached * uncached_tokens  +  w_kv * kv_usage
    decode (disaggregated):
        w_queue * load  +  w_kv * kv_usage  +  w_spread * [decode domain == prefill domain]

    uncached_tokens = num_prompt_tokens - credited_blocks * block_size
    credited_blocks = min(hit_blocks, (num_prompt_tokens - 1) // block_size)   (0 if herded)

Normalisation: one unit of cost is one request ahead in the queue. Uncached work is counted in
tokens, not blocks, so ``w_uncached`` (default 0.01: 100 prompt tokens to compute weigh as much
as one request ahead) does not change meaning with the block size; ``kv_usage`` is a fraction in
[0, 1], so ``w_kv`` (default 4) is what a full cache costs, steering away from replicas close to
preempting. The cap on credited blocks mirrors the engine (``get_computed_blocks``): the last
prompt token is always recomputed because its logits give the first token, so a block-aligned
prompt that is fully cached still costs one block.

Herding guard: a replica whose load exceeds the least-loaded eligible replica of its pool by
more than ``herding_guard`` gets no cache credit, so a hot prefix cannot pile every request on
the replica that holds it; the others then win on load and cache the prefix themselves.

Failure domains: the decode replica pays ``w_spread`` when it shares the prefill replica's
domain, so a request's pair tends to straddle two domains (a soft preference: a much less loaded
decode replica in the same domain still wins). Hot-prefix spread: when the eligible replicas
holding the prompt's first block all sit in one domain, a replica in another domain wins a tie
on cost, so the prefix gets a copy that survives losing that domain.

Unhealthy workers and excluded workers or domains are never chosen; a pool left empty raises
``NoReplicaAvailable``. Costs within ``TIE_EPSILON`` are equal; ties break by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, NamedTuple

from cluster.roles import Role
from router.prefix_index import PrefixIndex

TIE_EPSILON = 1e-9  # costs this close are a tie (float sums of the same terms in another order)


class Mode(StrEnum):
    DISAGGREGATED = "disaggregated"
    LOCAL_PREFILL = "local_prefill"
    COLOCATED = "colocated"


class NoReplicaAvailable(RuntimeError):
    """No replica of ``pool`` may serve the request; ``reasons`` says why for each worker of
    the pool (empty when the pool has no workers at all)."""

    def __init__(self, pool: str, request_id: str, reasons: dict[str, str]) -> None:
        why = ", ".join(f"{name} {reason}" for name, reason in sorted(reasons.items()))
        super().__init__(
            f"no {pool} replica for request {request_id!r}: {why or 'the pool has no workers'}"
        )
        self.pool = pool
        self.request_id = request_id
        self.reasons = reasons

    def __reduce__(self) -> tuple[Any, ...]:  # crosses Ray actor boundaries
        return (type(self), (self.pool, self.request_id, self.reasons))


@dataclass(slots=True)
class WorkerState:
    """What the router knows of one worker, from its last report (the actor updates it in
    place; ``choose`` only reads it). Checked when built, not on every update."""

    name: str
    role: Role
    domain: str
    healthy: bool = True
    queue_depth: int = 0  # admitted, not yet running
    num_running: int = 0
    kv_usage: float = 0.0  # in-use KV blocks / total, in [0, 1]
    prefix_hit_ratio: float = 0.0  # reported, for metrics (the cost uses the exact index)
    block_size: int = 16  # tokens per KV block (EngineConfig's default)

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"{self.name}: block_size={self.block_size}: must be >= 1")
        if self.queue_depth < 0 or self.num_running < 0:
            raise ValueError(
                f"{self.name}: queue_depth={self.queue_depth}, num_running={self.num_running}: "
                "must be >= 0"
            )
        if not 0.0 <= self.kv_usage <= 1.0:
            raise ValueError(f"{self.name}: kv_usage={self.kv_usage}: must be in [0, 1]")


@dataclass(frozen=True, slots=True)
class RouterWeights:
    """The cost terms' weights and the two thresholds (defaults: the topology's)."""

    queue_depth: float = 1.0  # per request ahead (queued + running)
    uncached_prefill_tokens: float = 0.01  # per prompt token to compute
    kv_usage: float = 4.0  # per unit of KV fraction in use
    domain_spread: float = 0.5  # decode in the prefill's failure domain
    herding_guard: int = 8  # load above the pool's least loaded that forfeits cache credit
    local_prefill_max_tokens: int = 64  # prefill on the decode worker up to this many tokens

    def __post_init__(self) -> None:
        for name in (
            "queue_depth",
            "uncached_prefill_tokens",
            "kv_usage",
            "domain_spread",
            "herding_guard",
            "local_prefill_max_tokens",
        ):
            value = getattr(self, name)
            if value < 0:
                raise ValueError(f"RouterWeights.{name}={value}: must be >= 0")


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """One routing question. The exclusions carry a retry's history: never the worker or the
    failure domain that just failed it."""

    request_id: str
    prompt_hashes: Sequence[int]  # engine.kv_cache_manager.prefix_hashes of the prompt
    num_prompt_tokens: int
    exclude_workers: frozenset[str] = frozenset()
    exclude_domains: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if self.num_prompt_tokens < 1:
            raise ValueError(
                f"request {self.request_id!r}: num_prompt_tokens={self.num_prompt_tokens}: "
                "must be >= 1"
            )


class Score(NamedTuple):
    """One candidate's cost, term by term (``total`` is their sum). Cache fields are 0 for a
    disaggregated decode candidate, which computes none of the prompt. A tuple: ``choose``
    builds one per candidate per request, and a frozen dataclass costs ~10x more to build."""

    name: str
    role: Role
    domain: str
    load: int
    hit_blocks: int  # leading prompt blocks the index says it holds
    credited_blocks: int  # what the cost counted: capped, 0 if herded
    herded: bool
    uncached_tokens: int
    queue: float
    uncached: float
    kv: float
    spread: float
    total: float

    def as_dict(self) -> dict[str, Any]:
        return {**self._asdict(), "role": self.role.value}


@dataclass(frozen=True, slots=True)
class Decision:
    """The replicas for one request. ``prefill`` is None when ``decode`` computes the prompt
    itself (local_prefill, colocated)."""

    request_id: str
    mode: Mode
    prefill: str | None
    decode: str
    hit_blocks: int  # of the replica that computes the prompt
    uncached_tokens: int  # what that replica computes
    scores: tuple[Score, ...]  # every candidate considered: by stage, in the workers' order
    skipped: dict[str, str] = field(default_factory=dict)  # worker -> why it was not eligible

    def log_line(self) -> dict[str, Any]:
        """One JSON-able record: the choice and every candidate's terms."""
        return {
            "request_id": self.request_id,
            "mode": self.mode.value,
            "prefill": self.prefill,
            "decode": self.decode,
            "hit_blocks": self.hit_blocks,
            "uncached_tokens": self.uncached_tokens,
            "candidates": [score.as_dict() for score in self.scores],
            "skipped": dict(self.skipped),
        }


def choose(
    request: RouteRequest,
    workers: Sequence[WorkerState],
    index: PrefixIndex,
    weights: RouterWeights,
) -> Decision:
    """Pick the replicas for ``request`` (module docstring: modes, cost, guards)."""
    by_role: dict[Role, list[WorkerState]] = {role: [] for role in Role}
    for worker in workers:
        by_role[worker.role].append(worker)
    hits = index.match_all(request.prompt_hashes)
    skipped: dict[str, str] = {}

    if not by_role[Role.PREFILL] and not by_role[Role.DECODE] and by_role[Role.COLOCATED]:
        pool = _eligible(Role.COLOCATED, by_role[Role.COLOCATED], request, skipped)
        scores = _prompt_scores(pool, hits, request, weights)
        chosen = _pick(scores)
        return _one_replica(request, Mode.COLOCATED, chosen, scores, skipped)

    decoders = _eligible(Role.DECODE, by_role[Role.DECODE], request, skipped)
    if _may_prefill_locally(decoders, hits, request, weights):
        local = _prompt_scores(decoders, hits, request, weights)
        fits = [s for s in local if s.uncached_tokens <= weights.local_prefill_max_tokens]
        if fits:
            chosen = _pick(fits, hot_domains=_hot_domains(local))
            return _one_replica(request, Mode.LOCAL_PREFILL, chosen, local, skipped)

    prefillers = _eligible(Role.PREFILL, by_role[Role.PREFILL], request, skipped)
    prefill_scores = _prompt_scores(prefillers, hits, request, weights)
    prefill = _pick(prefill_scores)
    decode_scores = _decode_scores(decoders, prefill.domain, weights)
    decode = _pick(decode_scores, hot_domains=set())
    return Decision(
        request_id=request.request_id,
        mode=Mode.DISAGGREGATED,
        prefill=prefill.name,
        decode=decode.name,
        hit_blocks=prefill.hit_blocks,
        uncached_tokens=prefill.uncached_tokens,
        scores=(*prefill_scores, *decode_scores),
        skipped=skipped,
    )


def _eligible(
    role: Role, pool: Sequence[WorkerState], request: RouteRequest, skipped: dict[str, str]
) -> list[WorkerState]:
    """The pool's healthy, non-excluded workers; the others go to ``skipped`` with a reason.
    Raises NoReplicaAvailable when none is left."""
    eligible: list[WorkerState] = []
    reasons: dict[str, str] = {}
    for worker in pool:
        if not worker.healthy:
            reasons[worker.name] = "unhealthy"
        elif worker.name in request.exclude_workers:
            reasons[worker.name] = "excluded"
        elif worker.domain in request.exclude_domains:
            reasons[worker.name] = f"in excluded domain {worker.domain}"
        else:
            eligible.append(worker)
    skipped.update(reasons)
    if not eligible:
        raise NoReplicaAvailable(role.value, request.request_id, reasons)
    return eligible


def _may_prefill_locally(
    decoders: list[WorkerState], hits: dict[str, int], request: RouteRequest, w: RouterWeights
) -> bool:
    """Whether some decode replica could have few enough tokens left, counting full cache
    credit (the guard only takes credit away): skips scoring the decode pool twice for the
    long prompts that cannot go local."""
    n = request.num_prompt_tokens
    for worker in decoders:
        credited = min(hits.get(worker.name, 0), (n - 1) // worker.block_size)
        if n - credited * worker.block_size <= w.local_prefill_max_tokens:
            return True
    return False


def _prompt_scores(
    pool: list[WorkerState], hits: dict[str, int], request: RouteRequest, w: RouterWeights
) -> list[Score]:
    """Scores of replicas that compute the prompt: load, uncached tokens, KV use."""
    loads = [worker.queue_depth + worker.num_running for worker in pool]
    floor = min(loads)
    n = request.num_prompt_tokens
    scores = []
    for worker, load in zip(pool, loads, strict=True):
        hit = hits.get(worker.name, 0)
        herded = hit > 0 and load - floor > w.herding_guard
        credited = 0 if herded else min(hit, (n - 1) // worker.block_size)
        uncached_tokens = n - credited * worker.block_size
        queue = w.queue_depth * load
        uncached = w.uncached_prefill_tokens * uncached_tokens
        kv = w.kv_usage * worker.kv_usage
        total = queue + uncached + kv
        scores.append(
            Score(
                name=worker.name,
                role=worker.role,
                domain=worker.domain,
                load=load,
                hit_blocks=hit,
                credited_blocks=credited,
                herded=herded,
                uncached_tokens=uncached_tokens,
                queue=queue,
                uncached=uncached,
                kv=kv,
                spread=0.0,
                total=total,
            )
        )
    return scores


def _decode_scores(pool: list[WorkerState], prefill_domain: str, w: RouterWeights) -> list[Score]:
    """Scores of decode replicas for a disaggregated pair: load, KV use, shared domain."""
    scores = []
    for worker in pool:
        load = worker.queue_depth + worker.num_running
        queue = w.queue_depth * load
        kv = w.kv_usage * worker.kv_usage
        spread = w.domain_spread if worker.domain == prefill_domain else 0.0
        total = queue + kv + spread
        scores.append(
            Score(
                name=worker.name,
                role=worker.role,
                domain=worker.domain,
                load=load,
                hit_blocks=0,
                credited_blocks=0,
                herded=False,
                uncached_tokens=0,
                queue=queue,
                uncached=0.0,
                kv=kv,
                spread=spread,
                total=total,
            )
        )
    return scores


def _hot_domains(scores: Sequence[Score]) -> set[str]:
    """Domains of the candidates that hold the prompt's first block."""
    return {s.domain for s in scores if s.hit_blocks > 0}


def _pick(scores: Sequence[Score], hot_domains: set[str] | None = None) -> Score:
    """Lowest total; among ties, one outside a lone hot domain first, then by name."""
    hot = _hot_domains(scores) if hot_domains is None else hot_domains
    best = min(s.total for s in scores)
    tied = [s for s in scores if s.total - best <= TIE_EPSILON]
    if len(hot) == 1:
        return min(tied, key=lambda s: (s.domain in hot, s.name))
    return min(tied, key=lambda s: s.name)


def _one_replica(
    request: RouteRequest,
    mode: Mode,
    chosen: Score,
    scores: Sequence[Score],
    skipped: dict[str, str],
) -> Decision:
    return Decision(
        request_id=request.request_id,
        mode=mode,
        prefill=None,
        decode=chosen.name,
        hit_blocks=chosen.hit_blocks,
        uncached_tokens=chosen.uncached_tokens,
        scores=tuple(scores),
        skipped=skipped,
    )
