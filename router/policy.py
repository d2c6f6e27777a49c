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

Before these: a later choice of an n > 1 request names the decode replica that holds its first
choice's prompt KV (``share_decode``); while that replica is eligible it prefills there, locally,
on the cached prompt (local_prefill; in a colocated pool, that replica), whatever its cost.

Cost (lowest wins), with ``load = queue_depth + num_running + promised_seqs`` (requests ahead
of this one, counting those the router granted that the worker has not reported yet)::

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

Unhealthy workers, excluded workers or domains, and workers without room for the request
(a free batch slot and the KV blocks its engine would reserve: :func:`needed_blocks`) are never
chosen -- except that an excluded domain (a retry steering away from where a worker died)
holds only while some worker outside it is healthy: when every other one is FAILED as well,
the domain's workers that are back serve rather than nothing. (A dead worker itself is not
excluded by name: the router keeps it out while FAILED, and back, it is a new process.) A
pool left empty raises ``NoReplicaAvailable``, whose reasons say whether waiting can help
(``FULL``, ``UNHEALTHY``) or not (exclusions). Costs within ``TIE_EPSILON`` are equal; ties
break by name.
"""

from __future__ import annotations

from collections.abc import Sequence

from contracts.roles import Role
from contracts.routing import (
    Decision,
    Mode,
    NoReplicaAvailable,
    RouteRequest,
    Score,
    WorkerState,
)
from engine.admission import reservation_tokens
from router.config import RouterConfig, RouterWeights
from router.prefix_index import PrefixIndex

TIE_EPSILON = 1e-9  # costs this close are a tie (float sums of the same terms in another order)
FULL = "full"  # no free batch slot or too few KV blocks for the request: it may wait
UNHEALTHY = "unhealthy"  # FAILED or not reported yet: it may come back
WAITABLE = frozenset({FULL, UNHEALTHY})


def choose(
    request: RouteRequest,
    workers: Sequence[WorkerState],
    index: PrefixIndex,
    config: RouterConfig,
) -> Decision:
    """Pick the replicas for ``request`` (module docstring: modes, cost, guards)."""
    by_role: dict[Role, list[WorkerState]] = {role: [] for role in Role}
    for worker in workers:
        by_role[worker.role].append(worker)
    hits = index.match_all(request.prompt_hashes)
    skipped: dict[str, str] = {}

    if not by_role[Role.PREFILL] and not by_role[Role.DECODE] and by_role[Role.COLOCATED]:
        pool = _eligible(Role.COLOCATED, by_role[Role.COLOCATED], request, skipped)
        scores = _prompt_scores(_shared(pool, request) or pool, hits, request, config)
        chosen = _pick(scores)
        return _one_replica(request, Mode.COLOCATED, chosen, scores, skipped)

    decoders = _eligible(Role.DECODE, by_role[Role.DECODE], request, skipped)
    if shared := _shared(decoders, request):  # a later choice of n > 1: where its prompt is
        scores = _prompt_scores(shared, hits, request, config)
        return _one_replica(request, Mode.LOCAL_PREFILL, scores[0], scores, skipped)
    if _may_prefill_locally(decoders, hits, request, config):
        local = _prompt_scores(decoders, hits, request, config)
        fits = [s for s in local if s.uncached_tokens <= config.local_prefill_max_tokens]
        if fits:
            chosen = _pick(fits, hot_domains=_hot_domains(local))
            return _one_replica(request, Mode.LOCAL_PREFILL, chosen, local, skipped)

    prefillers = _paired(
        _eligible(Role.PREFILL, by_role[Role.PREFILL], request, skipped), decoders, request, skipped
    )
    prefill_scores = _prompt_scores(prefillers, hits, request, config)
    prefill = _pick(prefill_scores)
    numerics = next(p.info.numerics for p in prefillers if p.name == prefill.name)
    decoders = [d for d in decoders if d.info.numerics == numerics]
    decode_scores = _decode_scores(decoders, prefill.domain, config.weights)
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
    # Excluded domains steer a retry away from where a worker just died while a healthy
    # worker elsewhere exists; with none (the others FAILED too), the domain serves again.
    steer = any(
        w.healthy
        and w.name not in request.exclude_workers
        and w.domain not in request.exclude_domains
        for w in pool
    )
    for worker in pool:
        if not worker.healthy:
            reasons[worker.name] = UNHEALTHY
        elif worker.name in request.exclude_workers:
            reasons[worker.name] = "excluded"
        elif request.numerics and worker.info.numerics != request.numerics:
            reasons[worker.name] = f"numerics {worker.info.numerics}, not the stream's"
        elif steer and worker.domain in request.exclude_domains:
            reasons[worker.name] = f"in excluded domain {worker.domain}"
        elif not has_room(worker, request, prefill_only=role is Role.PREFILL):
            reasons[worker.name] = FULL
        else:
            eligible.append(worker)
    skipped.update(reasons)
    if not eligible:
        raise NoReplicaAvailable(role.value, request.request_id, reasons)
    return eligible


def _shared(pool: list[WorkerState], request: RouteRequest) -> list[WorkerState]:
    """The eligible worker holding the prompt of the request's first choice (n > 1), if any."""
    return [w for w in pool if w.name == request.share_decode]


def _paired(
    prefillers: list[WorkerState],
    decoders: list[WorkerState],
    request: RouteRequest,
    skipped: dict[str, str],
) -> list[WorkerState]:
    """The prefill workers some eligible decode worker computes the same bits as (their KV
    and first token continue there: docs/design.md#numerics-classes); the others go to
    ``skipped``. Raises NoReplicaAvailable when none is left."""
    classes = {d.info.numerics for d in decoders}
    paired = [p for p in prefillers if p.info.numerics in classes]
    reasons = {
        p.name: f"no decode worker of its numerics {p.info.numerics}"
        for p in prefillers
        if p.info.numerics not in classes
    }
    skipped.update(reasons)
    if not paired:
        raise NoReplicaAvailable(Role.PREFILL.value, request.request_id, reasons)
    return paired


def needed_blocks(worker: WorkerState, request: RouteRequest, prefill_only: bool) -> int:
    """The KV blocks ``worker``'s engine reserves when it admits ``request``: the engine's
    own formula (engine.admission.reservation_tokens) with the worker's limits. A prefill
    worker makes one token; any other the predicted output."""
    n = request.num_prompt_tokens
    if prefill_only:
        predicted = 1
    elif worker.info.admission_output_tokens is not None:
        predicted = worker.info.admission_output_tokens
    else:
        predicted = request.max_tokens
    pool_tokens = worker.info.num_kv_blocks * worker.info.block_size
    tokens = reservation_tokens(
        n - request.num_resumed_tokens, n, predicted, worker.info.max_model_len, pool_tokens
    )
    return -(-tokens // worker.info.block_size)


def has_room(worker: WorkerState, request: RouteRequest, prefill_only: bool) -> bool:
    """A free batch slot and the blocks for ``request``, counting what is promised already."""
    return worker.free_seqs >= 1 and worker.free_blocks >= needed_blocks(
        worker, request, prefill_only
    )


def _may_prefill_locally(
    decoders: list[WorkerState], hits: dict[str, int], request: RouteRequest, c: RouterConfig
) -> bool:
    """Whether some decode replica could have few enough tokens left, counting full cache
    credit (the guard only takes credit away): skips scoring the decode pool twice for the
    long prompts that cannot go local."""
    n = request.num_prompt_tokens
    for worker in decoders:
        credited = min(hits.get(worker.name, 0), (n - 1) // worker.info.block_size)
        if n - credited * worker.info.block_size <= c.local_prefill_max_tokens:
            return True
    return False


def _prompt_scores(
    pool: list[WorkerState], hits: dict[str, int], request: RouteRequest, c: RouterConfig
) -> list[Score]:
    """Scores of replicas that compute the prompt: load, uncached tokens, KV use."""
    w = c.weights
    loads = [worker.load for worker in pool]
    floor = min(loads)
    n = request.num_prompt_tokens
    scores = []
    for worker, load in zip(pool, loads, strict=True):
        hit = hits.get(worker.name, 0)
        herded = hit > 0 and load - floor > c.herding_guard
        credited = 0 if herded else min(hit, (n - 1) // worker.info.block_size)
        uncached_tokens = n - credited * worker.info.block_size
        queue = w.queue_depth * load
        uncached = w.uncached_prefill_tokens * uncached_tokens
        kv = w.kv_usage * worker.report.kv_usage
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
        load = worker.load
        queue = w.queue_depth * load
        kv = w.kv_usage * worker.report.kv_usage
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
