"""Router core: the prefix index against a brute-force model, and the replica choice."""

from __future__ import annotations

import json
import pickle
import random

import pytest
from helpers import worker_state
from hypothesis import given
from hypothesis import strategies as st

from contracts.roles import Role
from contracts.routing import Mode, NoReplicaAvailable, RouteRequest, Score, WorkerState
from engine.kv_cache_manager import prefix_hashes
from engine.kv_events import KVEvent, KVEventKind
from router.config import RouterConfig, RouterWeights
from router.policy import choose
from router.prefix_index import PrefixIndex

BS = 16
WORKERS = ("w0", "w1", "w2")
HASHES = st.integers(0, 11)  # a small universe: chains and holdings overlap often

# -- prefix index ---------------------------------------------------------------------------------

op: st.SearchStrategy[tuple[str, str, list[int]]] = st.one_of(
    st.tuples(st.just("stored"), st.sampled_from(WORKERS), st.lists(HASHES, max_size=6)),
    st.tuples(st.just("removed"), st.sampled_from(WORKERS), st.lists(HASHES, max_size=6)),
    st.tuples(st.just("cleared"), st.sampled_from(WORKERS), st.just([])),
    st.tuples(st.just("drop"), st.sampled_from(WORKERS), st.just([])),
)


def brute_match(held: set[int], chain: list[int]) -> int:
    n = 0
    while n < len(chain) and chain[n] in held:
        n += 1
    return n


@given(
    ops=st.lists(op, max_size=40),
    chains=st.lists(st.lists(HASHES, max_size=8), min_size=1, max_size=6),
)
def test_index_matches_brute_force(
    ops: list[tuple[str, str, list[int]]], chains: list[list[int]]
) -> None:
    index = PrefixIndex()
    model: dict[str, set[int]] = {w: set() for w in WORKERS}
    for kind, worker, hashes in ops:
        if kind == "drop":
            index.drop_worker(worker)
            model[worker].clear()
        else:
            index.apply(worker, [KVEvent(KVEventKind(kind), tuple(hashes))])
            if kind == "stored":
                model[worker] |= set(hashes)
            elif kind == "removed":
                model[worker] -= set(hashes)
            else:
                model[worker].clear()
    for chain in chains:
        expected = {w: brute_match(model[w], chain) for w in WORKERS}
        assert {w: index.match(w, chain) for w in WORKERS} == expected
        assert index.match_all(chain) == {w: n for w, n in expected.items() if n > 0}
    assert index.num_entries == sum(len(h) for h in model.values())
    assert index.num_hashes == len(set().union(*model.values()))


def test_events_apply_in_order_within_one_report() -> None:
    index = PrefixIndex()
    stored, removed = KVEvent(KVEventKind.STORED, (1, 2, 3)), KVEvent(KVEventKind.REMOVED, (2,))
    index.apply("w0", [stored, removed])
    assert index.match("w0", [1, 2, 3]) == 1
    index.apply("w1", [removed, stored])
    assert index.match("w1", [1, 2, 3]) == 3
    index.apply("w1", [KVEvent(KVEventKind.CLEARED), KVEvent(KVEventKind.STORED, (1,))])
    assert index.match_all([1, 2, 3]) == {"w0": 1, "w1": 1}


def test_other_salt_matches_nothing() -> None:
    tokens = list(range(100, 164))
    index = PrefixIndex()
    chain_a = prefix_hashes(tokens, BS, "tenant-a", "m")
    index.apply("w0", [KVEvent(KVEventKind.STORED, tuple(chain_a))])
    assert index.match("w0", chain_a) == 4
    chain_b = prefix_hashes(tokens, BS, "tenant-b", "m")
    assert index.match("w0", chain_b) == 0
    assert index.match_all(chain_b) == {}
    assert index.match_all(prefix_hashes(tokens, BS, "tenant-a", "other-model")) == {}


def test_restarted_worker_entries_vanish() -> None:
    index = PrefixIndex()
    a = prefix_hashes(list(range(64)), BS, "", "m")
    b = prefix_hashes(list(range(64, 128)), BS, "", "m")
    index.apply("w1", [KVEvent(KVEventKind.STORED, tuple(b))])
    baseline = (index.num_entries, index.num_hashes)
    index.apply("w0", [KVEvent(KVEventKind.STORED, tuple(a + b[:2]))])
    assert index.match_all(b) == {"w0": 2, "w1": 4}
    index.drop_worker("w0")  # restarted: a new incarnation reports from scratch
    assert index.match("w0", a) == 0
    assert index.match_all(a) == {}
    assert index.match_all(b) == {"w1": 4}
    assert (index.num_entries, index.num_hashes) == baseline


# -- policy ---------------------------------------------------------------------------------------


def worker(name: str, domain: str = "a", load: int = 0, **kw: object) -> WorkerState:
    role = Role(name.rsplit("-", 1)[0])
    return worker_state(name, role, domain, queue_depth=load, block_size=BS, **kw)


def request(tokens: list[int], rid: str = "r", **kw: object) -> RouteRequest:
    return RouteRequest(rid, prefix_hashes(tokens, BS, "", "m"), len(tokens), **kw)  # type: ignore[arg-type]


def store(index: PrefixIndex, name: str, tokens: list[int]) -> None:
    index.apply(name, [KVEvent(KVEventKind.STORED, tuple(prefix_hashes(tokens, BS, "", "m")))])


NO_LOCAL = RouterConfig(local_prefill_max_tokens=0)
PROMPT = list(range(1000, 1161))  # 161 tokens: 10 full blocks + 1


def test_equal_loads_pick_the_replica_with_hits() -> None:
    index = PrefixIndex()
    store(index, "prefill-1", PROMPT)
    workers = [worker("prefill-0"), worker("prefill-1"), worker("decode-0")]
    decision = choose(request(PROMPT), workers, index, NO_LOCAL)
    assert (decision.mode, decision.prefill, decision.decode) == (
        Mode.DISAGGREGATED,
        "prefill-1",
        "decode-0",
    )
    assert (decision.hit_blocks, decision.uncached_tokens) == (10, 1)


def test_fully_cached_aligned_prompt_still_computes_its_last_block() -> None:
    index = PrefixIndex()
    tokens = PROMPT[:160]  # 10 full blocks, all cached: the engine recomputes the last one
    store(index, "prefill-0", tokens)
    decision = choose(request(tokens), [worker("prefill-0"), worker("decode-0")], index, NO_LOCAL)
    assert (decision.hit_blocks, decision.uncached_tokens) == (10, BS)


def test_herding_guard_moves_load_off_the_hit_replica() -> None:
    weights = RouterConfig(
        weights=RouterWeights(queue_depth=1.0, uncached_prefill_tokens=0.1),
        herding_guard=2,
        local_prefill_max_tokens=0,
    )
    index = PrefixIndex()
    store(index, "prefill-0", PROMPT)
    others = [worker("prefill-1"), worker("decode-0")]

    # At the guard (load 2 above the least loaded): credit holds; 2 + 0.1*1 beats 0.1*161.
    at_guard = choose(request(PROMPT), [worker("prefill-0", load=2), *others], index, weights)
    assert at_guard.prefill == "prefill-0"
    # One above: no credit, so it loses on load alone.
    over = choose(request(PROMPT), [worker("prefill-0", load=3), *others], index, weights)
    assert over.prefill == "prefill-1"
    hit = next(s for s in over.scores if s.name == "prefill-0")
    assert (hit.herded, hit.hit_blocks, hit.credited_blocks, hit.uncached_tokens) == (
        True,
        10,
        0,
        161,
    )


def test_ties_break_by_name_whatever_the_order() -> None:
    workers = [worker(f"prefill-{i}") for i in range(4)] + [worker(f"decode-{i}") for i in range(4)]
    for seed in range(5):
        random.Random(seed).shuffle(workers)
        decision = choose(request(PROMPT), workers, PrefixIndex(), NO_LOCAL)
        assert (decision.prefill, decision.decode) == ("prefill-0", "decode-0")


def test_hot_prefix_in_one_domain_spreads_on_a_tie() -> None:
    # w_uncached 0.125 (exact in binary): prefill-0 (domain a, 1 hit block of a 17-token prompt,
    # load 2) costs 2 + 0.125 = 2.125; prefill-1 (domain b, no hits, idle) 0.125 * 17 = 2.125.
    weights = RouterConfig(
        weights=RouterWeights(uncached_prefill_tokens=0.125), local_prefill_max_tokens=0
    )
    tokens = PROMPT[:17]
    index = PrefixIndex()
    store(index, "prefill-0", tokens)
    decode = worker("decode-0", "c")
    tied = [worker("prefill-0", "a", load=2), worker("prefill-1", "b"), decode]
    assert choose(request(tokens), tied, index, weights).prefill == "prefill-1"
    # Same tie, but no other domain to spread to: by name.
    same_domain = [worker("prefill-0", "a", load=2), worker("prefill-1", "a"), decode]
    assert choose(request(tokens), same_domain, index, weights).prefill == "prefill-0"
    # The prefix already lives in two domains: by name.
    store(index, "prefill-2", tokens)
    two_domains = [*tied, worker("prefill-2", "b", load=2)]
    assert choose(request(tokens), two_domains, index, weights).prefill == "prefill-0"


@given(
    domains=st.lists(st.sampled_from("abc"), min_size=4, max_size=8),
    healthy=st.lists(st.booleans(), min_size=8, max_size=8),
    hit_worker=st.integers(0, 7),
)
def test_decode_avoids_the_prefill_domain_when_it_can(
    domains: list[str], healthy: list[bool], hit_worker: int
) -> None:
    half = len(domains) // 2
    workers = [
        worker(f"{'prefill' if i < half else 'decode'}-{i}", d, healthy=healthy[i])
        for i, d in enumerate(domains)
    ]
    index = PrefixIndex()
    store(index, workers[hit_worker % len(workers)].name, PROMPT)
    try:
        decision = choose(request(PROMPT), workers, index, NO_LOCAL)
    except NoReplicaAvailable:
        assert not any(w.healthy for w in workers[:half]) or not any(
            w.healthy for w in workers[half:]
        )
        return
    prefill_domain = next(w.domain for w in workers if w.name == decision.prefill)
    others = {w.domain for w in workers[half:] if w.healthy} - {prefill_domain}
    decode_domain = next(w.domain for w in workers if w.name == decision.decode)
    assert (decode_domain != prefill_domain) == bool(others)


def test_domain_spread_is_a_weighed_penalty() -> None:
    # decode-1 (other domain) has one more request than decode-0: 1.0 > w_spread 0.5.
    workers = [worker("prefill-0", "a"), worker("decode-0", "a"), worker("decode-1", "b", load=1)]
    assert choose(request(PROMPT), workers, PrefixIndex(), NO_LOCAL).decode == "decode-0"
    spread = RouterConfig(weights=RouterWeights(domain_spread=2.0), local_prefill_max_tokens=0)
    decision = choose(request(PROMPT), workers, PrefixIndex(), spread)
    assert decision.decode == "decode-1"
    terms = {s.name: s.spread for s in decision.scores if s.role is Role.DECODE}
    assert terms == {"decode-0": 2.0, "decode-1": 0.0}


@given(
    loads=st.lists(st.integers(0, 20), min_size=8, max_size=8),
    domains=st.lists(st.sampled_from("abcd"), min_size=8, max_size=8),
    healthy=st.lists(st.booleans(), min_size=8, max_size=8),
    exclude_domains=st.frozensets(st.sampled_from("abcd"), max_size=3),
    exclude_workers=st.frozensets(st.integers(0, 7), max_size=3),
    num_tokens=st.integers(1, 161),
    local_max=st.sampled_from([0, 64]),
)
def test_unhealthy_and_excluded_are_never_chosen_nor_excluded_domains_while_avoidable(
    loads: list[int],
    domains: list[str],
    healthy: list[bool],
    exclude_domains: frozenset[str],
    exclude_workers: frozenset[int],
    num_tokens: int,
    local_max: int,
) -> None:
    workers = [
        worker(f"{'prefill' if i < 4 else 'decode'}-{i}", domains[i], loads[i], healthy=healthy[i])
        for i in range(8)
    ]
    index = PrefixIndex()
    store(index, "prefill-0", PROMPT)
    store(index, "decode-5", PROMPT)
    excluded = {f"{'prefill' if i < 4 else 'decode'}-{i}" for i in exclude_workers}
    route = request(
        PROMPT[:num_tokens], exclude_workers=frozenset(excluded), exclude_domains=exclude_domains
    )
    ok: set[str] = set()
    for role in (
        "prefill",
        "decode",
    ):  # per pool: a domain is avoided while one elsewhere is healthy
        allowed = [w for w in workers if w.role.value == role and w.healthy]
        allowed = [w for w in allowed if w.name not in excluded]
        outside = [w for w in allowed if w.domain not in exclude_domains]
        ok |= {w.name for w in (outside or allowed)}
    try:
        decision = choose(route, workers, index, RouterConfig(local_prefill_max_tokens=local_max))
    except NoReplicaAvailable as exc:
        pool = [w.name for w in workers if w.role.value == exc.pool]
        assert not ok & set(pool)
        assert set(exc.reasons) == set(pool)
        return
    chosen = {decision.prefill, decision.decode} - {None}
    assert chosen <= ok
    assert {s.name for s in decision.scores} <= ok
    assert set(decision.skipped).isdisjoint(ok)


def test_local_prefill_threshold_is_inclusive() -> None:
    weights = RouterConfig(local_prefill_max_tokens=32)
    workers = [worker("prefill-0"), worker("decode-0"), worker("decode-1")]
    at = choose(request(PROMPT[:32]), workers, PrefixIndex(), weights)
    assert (at.mode, at.prefill, at.decode, at.uncached_tokens) == (
        Mode.LOCAL_PREFILL,
        None,
        "decode-0",
        32,
    )
    over = choose(request(PROMPT[:33]), workers, PrefixIndex(), weights)
    assert (over.mode, over.prefill, over.decode) == (Mode.DISAGGREGATED, "prefill-0", "decode-0")


def test_local_prefill_counts_the_decode_workers_own_cache() -> None:
    tokens = PROMPT[:65]
    index = PrefixIndex()
    store(index, "decode-1", tokens[:32])  # 2 blocks: 65 - 32 = 33 tokens left on decode-1
    workers = [worker("prefill-0"), worker("decode-0"), worker("decode-1")]
    over = choose(request(tokens), workers, index, RouterConfig(local_prefill_max_tokens=32))
    assert over.mode is Mode.DISAGGREGATED
    at = choose(request(tokens), workers, index, RouterConfig(local_prefill_max_tokens=33))
    assert (at.mode, at.decode, at.hit_blocks, at.uncached_tokens) == (
        Mode.LOCAL_PREFILL,
        "decode-1",
        2,
        33,
    )


def test_local_prefill_needs_no_prefill_replica() -> None:
    workers = [worker("prefill-0", healthy=False), worker("decode-0")]
    decision = choose(request(PROMPT[:8]), workers, PrefixIndex(), RouterConfig())
    assert (decision.mode, decision.decode) == (Mode.LOCAL_PREFILL, "decode-0")
    with pytest.raises(NoReplicaAvailable, match="no prefill replica .* prefill-0 unhealthy"):
        choose(request(PROMPT), workers, PrefixIndex(), RouterConfig())


def test_a_later_choice_prefills_on_the_decode_worker_holding_its_prompt() -> None:
    """n > 1: a later choice goes where its first choice's prompt KV is (local prefill on the
    cached blocks), however long the prompt and whoever is cheaper; while that worker is not
    eligible (FAILED, excluded, full) it is routed as any request."""
    index = PrefixIndex()
    store(index, "decode-1", PROMPT)
    workers = [worker("prefill-0"), worker("decode-0"), worker("decode-1", load=5)]
    shared = request(PROMPT, share_decode="decode-1")
    at = choose(shared, workers, index, NO_LOCAL)
    assert (at.mode, at.prefill, at.decode, at.hit_blocks, at.uncached_tokens) == (
        Mode.LOCAL_PREFILL,
        None,
        "decode-1",
        10,
        1,
    )
    assert [s.name for s in at.scores] == ["decode-1"]
    alone = (Mode.DISAGGREGATED, "prefill-0", "decode-0")
    plain = choose(request(PROMPT), workers, index, NO_LOCAL)
    assert (plain.mode, plain.prefill, plain.decode) == alone
    for gone in (
        [worker("prefill-0"), worker("decode-0"), worker("decode-1", healthy=False)],
        [worker("prefill-0"), worker("decode-0"), worker("decode-1", max_num_seqs=0)],
    ):
        moved = choose(shared, gone, index, NO_LOCAL)
        assert (moved.mode, moved.prefill, moved.decode) == alone
    excluded = request(PROMPT, share_decode="decode-1", exclude_workers=frozenset({"decode-1"}))
    moved = choose(excluded, workers, index, NO_LOCAL)
    assert (moved.mode, moved.prefill, moved.decode) == alone
    pool = [worker("colocated-0"), worker("colocated-1", load=5)]
    colocated = choose(request(PROMPT, share_decode="colocated-1"), pool, index, NO_LOCAL)
    assert (colocated.mode, colocated.decode) == (Mode.COLOCATED, "colocated-1")
    assert choose(request(PROMPT), pool, index, NO_LOCAL).decode == "colocated-0"


def test_colocated_topology_picks_one_replica() -> None:
    index = PrefixIndex()
    store(index, "colocated-1", PROMPT)
    workers = [worker("colocated-0"), worker("colocated-1"), worker("colocated-2", healthy=False)]
    decision = choose(request(PROMPT), workers, index, RouterConfig())
    assert (decision.mode, decision.prefill, decision.decode) == (
        Mode.COLOCATED,
        None,
        "colocated-1",
    )
    assert decision.skipped == {"colocated-2": "unhealthy"}


def test_all_dead_raises_naming_pool_and_reasons() -> None:
    workers = [
        worker("prefill-0", "a", healthy=False),
        worker("prefill-1", "b"),
        worker("decode-0", "a", healthy=False),
        worker("decode-1", "b"),
        worker("decode-2", "c", max_num_seqs=0),  # healthy, outside the exclusions, full
    ]
    with pytest.raises(NoReplicaAvailable) as info:
        choose(request(PROMPT, exclude_domains=frozenset("b")), workers, PrefixIndex(), NO_LOCAL)
    exc = info.value
    assert (exc.pool, exc.request_id) == ("decode", "r")
    assert exc.reasons == {
        "decode-0": "unhealthy",
        "decode-1": "in excluded domain b",
        "decode-2": "full",
    }
    assert str(exc) == (
        "no decode replica for request 'r': decode-0 unhealthy, decode-1 in excluded domain b, "
        "decode-2 full"
    )
    copy = pickle.loads(pickle.dumps(exc))  # it crosses a Ray actor boundary
    assert (str(copy), copy.pool, copy.reasons) == (str(exc), exc.pool, exc.reasons)
    with pytest.raises(NoReplicaAvailable, match="the pool has no workers"):
        choose(request(PROMPT), [], PrefixIndex(), NO_LOCAL)


def test_log_line_is_json_with_every_term() -> None:
    index = PrefixIndex()
    store(index, "prefill-1", PROMPT)
    workers = [
        worker("prefill-0", "a", load=1, kv_usage=0.5),
        worker("prefill-1", "b", num_running=2),
        worker("prefill-2", "b", healthy=False),
        worker("decode-0", "b", kv_usage=0.25),
    ]
    line = json.loads(json.dumps(choose(request(PROMPT), workers, index, NO_LOCAL).log_line()))
    assert {k: line[k] for k in ("request_id", "mode", "prefill", "decode", "hit_blocks")} == {
        "request_id": "r",
        "mode": "disaggregated",
        "prefill": "prefill-1",
        "decode": "decode-0",
        "hit_blocks": 10,
    }
    assert line["skipped"] == {"prefill-2": "unhealthy"}
    by_name = {c["name"]: c for c in line["candidates"]}
    assert list(by_name) == ["prefill-0", "prefill-1", "decode-0"]
    for c in by_name.values():
        assert c["total"] == pytest.approx(c["queue"] + c["uncached"] + c["kv"] + c["spread"])
    assert (by_name["prefill-0"]["queue"], by_name["prefill-0"]["kv"]) == (1.0, 2.0)
    assert (by_name["prefill-1"]["load"], by_name["prefill-1"]["uncached_tokens"]) == (2, 1)
    assert (by_name["decode-0"]["spread"], by_name["decode-0"]["kv"]) == (0.5, 1.0)


@pytest.mark.parametrize(
    ("field", "value"),
    [("kv_usage", 1.5), ("queue_depth", -1), ("block_size", 0)],
)
def test_bad_worker_report_names_field_and_value(field: str, value: float) -> None:
    kw: dict[str, object] = {"kv_usage": 0.0, "queue_depth": 0, "block_size": BS, field: value}
    with pytest.raises(ValueError, match=f"{field}={value}"):
        worker_state("prefill-0", Role.PREFILL, "a", **kw)  # the report's fields are checked


def test_bad_weights_and_requests_name_field_and_value() -> None:
    with pytest.raises(ValueError, match=r"herding_guard\n.*greater than or equal to 0"):
        RouterConfig(herding_guard=-1)
    with pytest.raises(ValueError, match=r"kv_usage\n.*greater than or equal to 0"):
        RouterWeights(kv_usage=-1.0)
    with pytest.raises(ValueError, match="num_prompt_tokens=0"):
        RouteRequest("r", [], 0)


# -- pinned by mutation testing (make mutation) ---------------------------------------------------


def test_removed_by_one_worker_keeps_the_hash_for_the_others() -> None:
    """A REMOVED event from one worker leaves the hash held by every other worker."""
    index = PrefixIndex()
    chain = prefix_hashes(list(range(64)), BS, "", "m")
    for name in ("w0", "w1", "w2"):
        index.apply(name, [KVEvent(KVEventKind.STORED, tuple(chain))])
    index.apply("w1", [KVEvent(KVEventKind.REMOVED, (chain[1],))])
    assert index.match_all(chain) == {"w0": 4, "w1": 1, "w2": 4}
    assert (index.num_entries, index.num_hashes) == (11, 4)
    index.apply("w0", [KVEvent(KVEventKind.REMOVED, (chain[1],))])
    assert index.match_all(chain) == {"w0": 1, "w1": 1, "w2": 4}
    assert (index.num_entries, index.num_hashes) == (10, 4)
    index.apply("w2", [KVEvent(KVEventKind.REMOVED, (chain[1],))])  # the last holder
    assert index.match_all(chain) == {"w0": 1, "w1": 1, "w2": 1}
    assert (index.num_entries, index.num_hashes) == (9, 3)
    index.apply("w2", [KVEvent(KVEventKind.REMOVED, (chain[1],))])  # not held: a no-op
    assert (index.num_entries, index.num_hashes) == (9, 3)


def test_removing_a_workers_last_hash_forgets_the_worker() -> None:
    """A worker whose every hash was REMOVED holds nothing; drop_worker is then a no-op."""
    index = PrefixIndex()
    index.apply("w0", [KVEvent(KVEventKind.STORED, (5, 6))])
    index.apply("w1", [KVEvent(KVEventKind.STORED, (5,))])
    index.apply("w0", [KVEvent(KVEventKind.REMOVED, (5, 6))])
    assert index.match("w0", [5]) == 0 and index.match_all([5, 6]) == {"w1": 1}
    index.drop_worker("w0")
    assert (index.num_entries, index.num_hashes) == (1, 1)
    index.apply("w0", [KVEvent(KVEventKind.STORED, ())])  # an empty report stores nothing
    assert index.match_all([5]) == {"w1": 1} and index.num_entries == 1


def test_drop_worker_keeps_hashes_other_workers_hold() -> None:
    """drop_worker (death, CLEARED) forgets one worker only, even for shared hashes."""
    index = PrefixIndex()
    index.apply("w0", [KVEvent(KVEventKind.STORED, (1, 2, 3))])
    index.apply("w1", [KVEvent(KVEventKind.STORED, (1, 2))])
    index.apply("w2", [KVEvent(KVEventKind.STORED, (1,))])
    index.apply("w1", [KVEvent(KVEventKind.CLEARED)])
    assert index.match_all([1, 2, 3]) == {"w0": 3, "w2": 1}
    assert (index.num_entries, index.num_hashes) == (4, 3)
    index.drop_worker("w0")
    assert index.match_all([1, 2, 3]) == {"w2": 1}
    assert (index.num_entries, index.num_hashes) == (1, 1)


def test_decode_scores_have_every_term() -> None:
    """A decode candidate's load is queued + running; it carries no cache terms."""
    workers = [
        worker("prefill-0", "a"),
        worker("decode-0", "a", load=1, num_running=3, kv_usage=0.5),
        worker("decode-1", "b", load=2, num_running=1, kv_usage=0.25),
    ]
    weights = RouterConfig(
        weights=RouterWeights(queue_depth=2.0, kv_usage=4.0, domain_spread=0.5),
        local_prefill_max_tokens=0,
    )
    decision = choose(request(PROMPT), workers, PrefixIndex(), weights)
    assert [s for s in decision.scores if s.role is Role.DECODE] == [
        Score("decode-0", Role.DECODE, "a", 4, 0, 0, False, 0, 8.0, 0.0, 2.0, 0.5, 10.5),
        Score("decode-1", Role.DECODE, "b", 3, 0, 0, False, 0, 6.0, 0.0, 1.0, 0.0, 7.0),
    ]
    assert decision.mode is Mode.DISAGGREGATED and decision.decode == "decode-1"


def test_prompt_scores_have_every_term() -> None:
    """A prefill candidate's load, cache credit, uncached tokens and cost terms are exact."""
    weights = RouterConfig(
        weights=RouterWeights(uncached_prefill_tokens=0.125), local_prefill_max_tokens=0
    )
    index = PrefixIndex()
    store(index, "prefill-1", PROMPT[:64])  # 4 blocks
    workers = [
        worker("prefill-0", "a", load=1, num_running=2, kv_usage=0.5),
        worker("prefill-1", "b", load=0, num_running=1, kv_usage=0.25),
        worker("decode-0", "a"),
    ]
    decision = choose(request(PROMPT), workers, index, weights)
    assert [s for s in decision.scores if s.role is Role.PREFILL] == [
        Score("prefill-0", Role.PREFILL, "a", 3, 0, 0, False, 161, 3.0, 20.125, 2.0, 0.0, 25.125),
        Score("prefill-1", Role.PREFILL, "b", 1, 4, 4, False, 97, 1.0, 12.125, 1.0, 0.0, 14.125),
    ]
    assert (decision.request_id, decision.prefill, decision.hit_blocks) == ("r", "prefill-1", 4)
    assert decision.uncached_tokens == 97


def test_herding_guard_counts_from_the_least_loaded_and_one_hit_block() -> None:
    """The guard compares load with the pool's least loaded; one hit block can be herded."""
    weights = RouterConfig(herding_guard=2, local_prefill_max_tokens=0)
    index = PrefixIndex()
    store(index, "prefill-0", PROMPT[:16])  # exactly one block
    floor = worker("prefill-1", load=3)

    def herded(load: int) -> dict[str, tuple[bool, int, int]]:
        workers = [worker("prefill-0", load=load), floor, worker("prefill-2", load=9)]
        decision = choose(request(PROMPT), [*workers, worker("decode-0")], index, weights)
        return {
            s.name: (s.herded, s.credited_blocks, s.uncached_tokens)
            for s in decision.scores
            if s.role is Role.PREFILL
        }

    # prefill-2 holds nothing: never herded, whatever its load
    assert herded(5) == {
        "prefill-0": (False, 1, 145),  # 5 - 3 = 2: at the guard, credit holds
        "prefill-1": (False, 0, 161),
        "prefill-2": (False, 0, 161),
    }
    assert herded(6)["prefill-0"] == (True, 0, 161)


def test_local_prefill_of_a_fully_cached_prompt_computes_one_token() -> None:
    """A cached k-block + 1 prompt leaves one token: within a 1-token local threshold."""
    index = PrefixIndex()
    store(index, "decode-1", PROMPT)  # 161 tokens = 10 blocks + 1
    workers = [worker("prefill-0"), worker("decode-0"), worker("decode-1")]
    decision = choose(request(PROMPT), workers, index, RouterConfig(local_prefill_max_tokens=1))
    assert (decision.mode, decision.prefill, decision.decode) == (
        Mode.LOCAL_PREFILL,
        None,
        "decode-1",
    )
    assert (decision.request_id, decision.hit_blocks, decision.uncached_tokens) == ("r", 10, 1)


def test_colocated_workers_are_ignored_beside_prefill_and_decode_pools() -> None:
    """Colocated mode needs a topology of only colocated workers; else they are not chosen."""
    index = PrefixIndex()
    store(index, "colocated-0", PROMPT)
    mixed = [worker("colocated-0"), worker("prefill-0"), worker("decode-0")]
    decision = choose(request(PROMPT), mixed, index, NO_LOCAL)
    assert (decision.mode, decision.prefill, decision.decode) == (
        Mode.DISAGGREGATED,
        "prefill-0",
        "decode-0",
    )
    no_prefill = [worker("colocated-0"), worker("decode-0")]
    with pytest.raises(NoReplicaAvailable, match="^no prefill replica"):
        choose(request(PROMPT), no_prefill, index, NO_LOCAL)


def test_colocated_pool_unavailable_names_the_pool() -> None:
    """With every colocated worker down, the error names the colocated pool."""
    with pytest.raises(NoReplicaAvailable) as info:
        choose(request(PROMPT), [worker("colocated-0", healthy=False)], PrefixIndex(), NO_LOCAL)
    assert (info.value.pool, info.value.reasons) == ("colocated", {"colocated-0": "unhealthy"})
    decision = choose(request(PROMPT, rid="c1"), [worker("colocated-1")], PrefixIndex(), NO_LOCAL)
    assert (decision.request_id, decision.mode, decision.decode) == (
        "c1",
        Mode.COLOCATED,
        "colocated-1",
    )


def test_log_line_names_every_key() -> None:
    """The decision log line has a fixed key set, with each candidate's role as a string."""
    workers = [worker("prefill-0"), worker("decode-0")]
    line = choose(request(PROMPT), workers, PrefixIndex(), NO_LOCAL).log_line()
    assert line == {
        "request_id": "r",
        "mode": "disaggregated",
        "prefill": "prefill-0",
        "decode": "decode-0",
        "hit_blocks": 0,
        "uncached_tokens": 161,
        "candidates": [
            {
                "name": "prefill-0",
                "role": "prefill",
                "domain": "a",
                "load": 0,
                "hit_blocks": 0,
                "credited_blocks": 0,
                "herded": False,
                "uncached_tokens": 161,
                "queue": 0.0,
                "uncached": pytest.approx(1.61),
                "kv": 0.0,
                "spread": 0.0,
                "total": pytest.approx(1.61),
            },
            {
                "name": "decode-0",
                "role": "decode",
                "domain": "a",
                "load": 0,
                "hit_blocks": 0,
                "credited_blocks": 0,
                "herded": False,
                "uncached_tokens": 0,
                "queue": 0.0,
                "uncached": 0.0,
                "kv": 0.0,
                "spread": 0.5,
                "total": 0.5,
            },
        ],
        "skipped": {},
    }


def test_skipped_workers_carry_their_reason() -> None:
    """Each ineligible worker is reported with why: unhealthy, excluded, or its domain."""
    workers = [
        worker("prefill-0", "a"),
        worker("prefill-1", "a"),
        worker("prefill-2", "b", healthy=False),
        worker("prefill-3", "c"),
        worker("decode-0", "a"),
    ]
    req = request(PROMPT, exclude_workers=frozenset({"prefill-0"}), exclude_domains=frozenset("c"))
    decision = choose(req, workers, PrefixIndex(), NO_LOCAL)
    assert decision.prefill == "prefill-1"
    assert decision.skipped == {
        "prefill-0": "excluded",
        "prefill-2": "unhealthy",
        "prefill-3": "in excluded domain c",
    }


def test_worker_state_accepts_its_boundary_values() -> None:
    """block_size 1 and a completely full KV cache (kv_usage 1.0) are valid reports."""
    state = worker_state("decode-0", Role.DECODE, "a", kv_usage=1.0, block_size=1)
    assert (state.report.kv_usage, state.info.block_size) == (1.0, 1)
    worker_state("decode-1", Role.DECODE, "a", kv_usage=0.0, queue_depth=0, num_running=0)


CLASSES = ("bfloat16/invariant/pairs", "bfloat16/invariant/columns")


@given(
    classes=st.lists(st.sampled_from(CLASSES), min_size=4, max_size=8),
    healthy=st.lists(st.booleans(), min_size=8, max_size=8),
    pinned=st.sampled_from(("", *CLASSES)),
    local=st.booleans(),
)
def test_a_request_never_crosses_numerics_classes(
    classes: list[str], healthy: list[bool], pinned: str, local: bool
) -> None:
    """Workers of different numerics classes (CPU families whose kernels sum in different
    orders) never share a request: a prefill goes with a decode worker of its class, and a
    stream pinned to a class (it has tokens: a migration) goes only to that class. When no
    pair of one class exists, no replica: never a mixed pair."""
    half = len(classes) // 2
    workers = [
        worker(f"{'prefill' if i < half else 'decode'}-{i}", "a", healthy=healthy[i], numerics=c)
        for i, c in enumerate(classes)
    ]
    config = RouterConfig() if local else NO_LOCAL
    tokens = PROMPT[:40] if local else PROMPT
    of = {w.name: w.info.numerics for w in workers}
    try:
        d = choose(request(tokens, numerics=pinned), workers, PrefixIndex(), config)
    except NoReplicaAvailable:
        usable = [w for w in workers if w.healthy and (not pinned or of[w.name] == pinned)]
        decoders = {of[w.name] for w in usable if w.role is Role.DECODE}
        if local:
            assert not decoders  # a short prompt prefills on any decode worker of the class
        else:
            assert not {of[w.name] for w in usable if w.role is Role.PREFILL} & decoders
        return
    assert not pinned or of[d.decode] == pinned
    if d.prefill is not None:
        assert of[d.prefill] == of[d.decode]
        skipped = {n: why for n, why in d.skipped.items() if why.startswith("no decode worker")}
        assert all(of[n] != of[d.decode] for n in skipped)
