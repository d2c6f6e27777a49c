"""The per-step fast paths are the same rules as the general code (issue: engine overhead).

Each test pins the exact result of a shortcut against the slow form it replaces, and could
fail if the shortcut drifted: token slices vs ``all_token_ids``, numpy argmax vs torch's,
a decode inside a block vs the pool, memoised single-id decodes vs the tokenizer.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.detokenizer import IncrementalDetokenizer, TextStream
from engine.kv_cache_manager import KVCacheManager, token_slice
from engine.request import Request
from engine.sampler import Sampler, SamplingState, _argmax
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer


def req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), SamplingParams(), arrival_time=0.0)


@settings(max_examples=200, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 99), min_size=1, max_size=12),
    output=st.lists(st.integers(0, 99), max_size=12),
    a=st.integers(0, 30),
    b=st.integers(0, 30),
)
def test_token_slice_is_all_token_ids_slice(
    prompt: list[int], output: list[int], a: int, b: int
) -> None:
    r = req("r", prompt)
    r.output_token_ids.extend(output)
    start, end = min(a, b), max(a, b)
    assert token_slice(r, start, end) == r.all_token_ids[start:end]


def test_argmax_matches_torch_on_ties_nan_and_inf() -> None:
    inf, nan = float("inf"), float("nan")
    z = torch.tensor(
        [
            [1.0, 3.0, 3.0, 2.0],  # tie: the lowest id
            [nan, 1.0, nan, 5.0],  # NaN counts as the maximum, first one wins
            [-inf, -inf, -inf, -inf],
            [0.0, inf, inf, 1.0],
        ]
    )
    assert _argmax(z).tolist() == [1, 0, 0, 1]
    assert _argmax(z).tolist() == z.argmax(-1).tolist()
    g = torch.Generator().manual_seed(0)
    ints = torch.randint(-3, 3, (64, 300), generator=g).float()  # many ties per row
    assert torch.equal(_argmax(ints), ints.argmax(-1))
    assert torch.equal(_argmax(ints[:, ::3]), ints[:, ::3].argmax(-1))  # strided view


def test_greedy_batch_takes_the_lowest_tied_id_per_row() -> None:
    params = SamplingParams(temperature=0.0)
    states = [SamplingState.create(params, [1], [], seed=i) for i in range(3)]
    z = torch.zeros(3, 6)
    z[0, [2, 4]] = 1.0
    z[1, 5] = 2.0
    assert Sampler(6)(z, states).token_ids == [2, 5, 0]


def test_decode_inside_a_block_takes_nothing_and_a_boundary_takes_one_block() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    r = req("r", [1, 2, 3, 4, 5, 6])
    assert kv.allocate_slots(r, 6) == [0, 1]
    r.num_computed_tokens = 6
    kv.take_pending_copies()
    free_before = kv.pool.num_free
    for token, expected in [(7, []), (8, []), (9, [2])]:  # positions 6, 7, then 8
        r.output_token_ids.append(token)
        assert kv.allocate_slots(r, 1) == expected
        r.num_computed_tokens += 1
        kv.take_pending_copies()
    assert kv.block_table("r") == [0, 1, 2]
    assert kv.pool.num_free == free_before - 1
    # The block filled by tokens 5..8 was hashed when position 7 was scheduled.
    assert kv.pool.block_hash(1) is not None and kv.pool.block_hash(2) is None
    assert kv.stats().logical_slots == 9
    kv.free("r")
    kv.check_idle()


def test_decode_into_a_shared_tail_still_copies_on_write() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    parent = req("p", [1, 2, 3, 4, 5, 6])
    kv.allocate_slots(parent, 6)
    parent.num_computed_tokens = 6
    kv.take_pending_copies()
    kv.fork("p", "c")
    child = req("c", [1, 2, 3, 4, 5, 6])
    child.num_computed_tokens = 6
    child.output_token_ids.append(9)
    assert kv.allocate_slots(child, 1) == [2]  # the shared partial tail is replaced
    assert kv.take_pending_copies() == [(1, 2)]
    assert kv.block_table("c") == [0, 2] and kv.block_table("p") == [0, 1]
    kv.free("p")
    kv.free("c")
    kv.check_idle()


@pytest.mark.parametrize("fixture", ["demo_tok", "bl_tok"])
def test_stream_equals_full_decode_on_a_second_pass_through_the_memo(
    fixture: str, request: pytest.FixtureRequest
) -> None:
    tok: Tokenizer = request.getfixturevalue(fixture)
    ids = tok.encode("Hello wörld, 你好! naïve café") + tok.encode(" again 你好", False)
    expected = tok.decode(ids)
    for _ in range(2):  # the second pass reads every single-id decode from the memo
        stream = TextStream(tok)
        pieces = [stream.step(i).text for i in ids]
        assert "".join(pieces) + stream.finish() == expected
        detok = IncrementalDetokenizer(tok)
        assert "".join(detok.push(i) for i in ids) + detok.flush() == expected


def test_a_decode_inside_a_block_still_caches_full_blocks_an_import_left_unhashed() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    r = req("r", list(range(1, 10)))
    assert kv.allocate_slots(r, 9, cache=False) == [0, 1, 2]  # imported KV: not cached yet
    r.num_computed_tokens = 9
    assert kv.pool.block_hash(0) is None and kv.pool.block_hash(1) is None
    r.output_token_ids.append(10)
    assert kv.allocate_slots(r, 1) == []  # position 9: inside the last block
    assert kv.pool.block_hash(0) is not None and kv.pool.block_hash(1) is not None
    assert kv.pool.block_hash(2) is None
    kv.free("r")
    kv.check_idle()
