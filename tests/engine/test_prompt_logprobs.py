"""Prompt logprobs (``SamplingParams.prompt_logprobs``): scoring equals generating (issue 16).

The engine computes a prompt token's logprob in its prefill with the code that computes a
generated token's (``engine.sampler.token_logprobs``), and its numerics are batch-invariant, so
re-scoring prompt + output in one prefill gives every generated token the logprob decode gave
it, bit for bit -- whatever the prefill's chunking. That is the reference the values are held
to here: the engine's own sampled-token logprobs, no second implementation.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import assert_engine_clean

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.outputs import TokenDelta
from engine.sampler import log_softmax, token_logprobs
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer

K = 3  # alternatives per position


def engine_for(path: Path, **kw) -> LLMEngine:
    base = dict(block_size=16, kv_cache_bytes=16 * 2**20, deterministic=True)
    return LLMEngine.from_checkpoint(path, EngineConfig(**{**base, **kw}))


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def scored(engine: LLMEngine, tokens: list[int], k: int = K) -> list:
    """The prompt logprobs of ``tokens``, scored as a prompt (one token sampled after it)."""
    [[out]] = engine.generate([tokens], greedy(1, prompt_logprobs=k))
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(tokens)
    return out.prompt_logprobs


@pytest.fixture(scope="module")
def bf16_llama(demo_ckpt_factory) -> Path:
    return demo_ckpt_factory("test", dtype="bfloat16")


@pytest.mark.parametrize("budget", [2048, 7], ids=["one-prefill", "chunked-by-7"])
@pytest.mark.parametrize("model", ["bf16_llama", "smollm2"])
def test_rescoring_a_generation_gives_decodes_logprobs_bitwise(
    request: pytest.FixtureRequest, model: str, budget: int
) -> None:
    """Greedy generation with logprobs, then prompt + output scored in one prefill (chunked
    at 7 tokens too): every generated position's TokenLogprobs -- logprob, top-K, rank -- is
    the one decode produced, compared with ``==``. The first output token was sampled by the
    prefill, the others by decode steps."""
    path: Path = request.getfixturevalue(model)
    engine = engine_for(path, max_num_batched_tokens=budget)
    prompt = Tokenizer(path).encode("The quick brown fox jumps over the lazy dog because")
    [[gen]] = engine.generate([prompt], greedy(12, logprobs=K))
    assert gen.logprobs is not None and len(gen.logprobs) == 12
    assert all(lp.rank == 1 for lp in gen.logprobs)  # greedy: each is its row's most likely
    rescored = scored(engine, prompt + gen.token_ids)
    assert rescored[len(prompt) :] == gen.logprobs
    assert_engine_clean(engine)


def test_shape_first_entry_ranks_and_independence_from_chunking(bf16_llama: Path) -> None:
    """One entry per prompt token, None for the first; each holds its token's logprob and rank
    and the K most likely, most likely first (ranks consistent with that order); the same bits
    whether the prompt ran in one prefill, in chunks of 5, or beside other requests."""
    prompt = list(range(100, 141))  # 41 tokens: chunks of 5 cross block boundaries
    whole = scored(engine_for(bf16_llama), prompt)
    assert whole[0] is None
    for token, lp in zip(prompt[1:], whole[1:], strict=True):
        assert lp is not None and len(lp.top) == K
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True) and lp.logprob <= values[0]
        top_ids = [t for t, _ in lp.top]
        if token in top_ids:
            assert lp.rank == top_ids.index(token) + 1 and lp.logprob == lp.top[lp.rank - 1][1]
        else:
            assert lp.rank > K and lp.logprob <= values[-1]
    chunked = engine_for(bf16_llama, max_num_batched_tokens=5)
    assert scored(chunked, prompt) == whole
    others = [list(range(300, 330)), list(range(500, 509))]
    batch = chunked.generate(
        [others[0], prompt, others[1]],
        [greedy(4), greedy(1, prompt_logprobs=K), greedy(4, prompt_logprobs=0)],
    )
    assert batch[1][0].prompt_logprobs == whole
    zero = batch[2][0].prompt_logprobs
    assert zero is not None and zero[0] is None and all(lp and lp.top == [] for lp in zero[1:])
    assert batch[0][0].prompt_logprobs is None  # not asked: not computed
    assert_engine_clean(chunked)


def test_prompt_logprobs_come_with_the_first_token_of_every_sample(bf16_llama: Path) -> None:
    """Streamed: the first token's output carries them, no later one; n > 1: every sample
    reports its (one) prompt's. A one-token prompt has just the None."""
    engine = engine_for(bf16_llama)
    prompt = list(range(40, 60))
    rid = engine.add_request(engine.make_request(prompt, greedy(3, n=2, prompt_logprobs=1)))
    outs: list[TokenDelta] = []
    while engine.has_unfinished():
        outs += engine.step()
    engine.finished_outputs()
    firsts = [o for o in outs if o.prompt_logprobs is not None]
    assert sorted(o.index for o in firsts) == [0, 1]
    assert all(o.token_ids and o.request_id.startswith(rid) for o in firsts)
    assert firsts[0].prompt_logprobs == firsts[1].prompt_logprobs == scored(engine, prompt, 1)
    assert scored(engine, [7]) == [None]
    assert_engine_clean(engine)


def test_a_request_scoring_its_prompt_computes_all_of_it(bf16_llama: Path) -> None:
    """No prefix-cache hit stands in for a position whose logits it needs -- yet it writes and
    publishes its blocks like any request, and one without prompt logprobs hits them."""
    engine = engine_for(bf16_llama)
    prompt = list(range(200, 250))  # 3 full blocks and a partial one

    def hits() -> int:
        return engine.kv.stats().prefix_hit_tokens

    first = scored(engine, prompt)
    assert hits() == 0
    engine.generate([prompt], greedy(2))
    assert hits() == 48  # what the scoring request published
    again = scored(engine, prompt)
    assert hits() == 48 and again == first
    engine.generate([prompt + [9]], greedy(2))
    assert hits() == 96
    assert_engine_clean(engine)


def test_logits_rows_are_returned_chunk_by_chunk(bf16_llama: Path) -> None:
    """The runner returns a chunk's every row where prompt logprobs are asked; the engine
    samples from the last rows alone (a mixed step: decodes, a scoring prefill, a plain one)."""
    engine = engine_for(bf16_llama, max_num_batched_tokens=64)
    seen: list[tuple[int, int]] = []
    execute = engine.runner.execute

    def spy(out):
        logits = execute(out)
        seen.append((logits.shape[0], sum(c.num_logit_rows for c in out.chunks)))
        return logits

    engine.runner.execute = spy  # type: ignore[method-assign]
    engine.add_request(engine.make_request(list(range(10, 30)), greedy(6)))
    engine.step()
    engine.add_request(engine.make_request(list(range(30, 50)), greedy(3, prompt_logprobs=2)))
    engine.add_request(engine.make_request(list(range(50, 60)), greedy(3)))
    while engine.has_unfinished():
        engine.step()
    assert all(rows == want for rows, want in seen)
    assert seen[1][0] == 1 + 20 + 1  # a decode, every row of the scoring prompt, the last one
    assert_engine_clean(engine)


def test_a_rank_is_the_place_in_the_top_order() -> None:
    """Most likely first, ties to the smaller id: in the top list and in the rank alike."""
    logits = torch.tensor([[0.0, 1.0, 1.0, -1.0]] * 3)
    lps = token_logprobs(logits, [2, 1, 3], [2, 0, 1])
    assert [lp.rank for lp in lps] == [2, 1, 4]
    assert [[t for t, _ in lp.top] for lp in lps] == [[1, 2], [], [1]]
    assert lps[0].logprob == lps[0].top[1][1] == float(log_softmax(logits[0])[2])
