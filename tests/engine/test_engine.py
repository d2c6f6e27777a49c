"""End-to-end exactness of the whole engine (scheduler + KV manager + runner + sampler) against
``transformers`` ``generate`` on seeded checkpoints of the three architectures (fp32, greedy).

Cases of the engine issue, point 3: (a) alone, (b) one continuous batch with staggered arrivals,
(c) chunked prefill at chunk sizes that split blocks, (d) partial and full prefix-cache hits,
(e) preemption by recompute and by swap. Every test ends with the KV leak check.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import assert_engine_clean

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.outputs import TokenDelta
from engine.request import FinishReason, RequestStatus
from engine.sampling_params import SamplingParams

PROMPT_LENS = (1, 5, 16, 17, 40, 100, 211, 320)  # 1 to 300+, on and off block boundaries
OUT = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=OUT, ignore_eos=True)
ARCHS = ("llama", "qwen2", "mistral")


def make_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(8, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module", params=ARCHS)
def arch_case(request, demo_ckpt_factory) -> tuple[Path, list[list[int]], list[list[int]]]:
    """(checkpoint, prompts, transformers greedy continuations)."""
    path = demo_ckpt_factory("test", request.param)
    model = hf_model(path)
    prompts = make_prompts(model.config.vocab_size)
    return path, prompts, [hf_greedy(model, p) for p in prompts]


def hf_model(path: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # ignore_eos, as the engine runs
    model.generation_config.pad_token_id = 0
    return model


def hf_greedy(model, prompt: list[int], n: int = OUT) -> list[int]:
    """transformers generate, greedy, exactly n new tokens."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n)
    ref = out[0, len(prompt) :].tolist()
    assert len(ref) == n
    return ref


def engine_for(path: Path, **kw) -> LLMEngine:
    base = dict(dtype="float32", block_size=16, kv_cache_bytes=4 * 2**20, swap_space_bytes=2**20)
    return LLMEngine.from_checkpoint(path, EngineConfig(**{**base, **kw}))


def run_staggered(
    engine: LLMEngine, prompts: list[list[int]], every: int, params: SamplingParams = GREEDY
) -> dict[str, list[int]]:
    """Add one prompt every `every` steps (others keep decoding; 0 adds all at once), run to
    completion."""
    rids: list[str] = []
    pending = list(prompts)
    step = 0
    while pending or engine.has_unfinished():
        while pending and (every == 0 or step % every == 0):
            rids.append(engine.add_request(engine.make_request(pending.pop(0), params)))
            if every:
                break
        engine.step()
        step += 1
    done = {c.request_id: c.token_ids for c in engine.finished_outputs()}
    return {rid: done[rid] for rid in rids}


def test_alone(arch_case) -> None:
    path, prompts, refs = arch_case
    engine = engine_for(path, enable_prefix_caching=False)
    for p, ref in zip(prompts, refs, strict=True):
        [[out]] = engine.generate([p], GREEDY)
        assert out.token_ids == ref
        assert out.finish_reason is FinishReason.MAX_TOKENS
    assert_engine_clean(engine)


def test_continuous_batch_staggered(arch_case) -> None:
    path, prompts, refs = arch_case
    engine = engine_for(path)
    outs = run_staggered(engine, prompts, every=2)
    assert list(outs.values()) == refs
    assert_engine_clean(engine)


@pytest.mark.parametrize("budget", [7, 23])
def test_chunked_prefill_splitting_blocks(arch_case, budget: int) -> None:
    path, prompts, refs = arch_case
    engine = engine_for(path, max_num_batched_tokens=budget, enable_chunked_prefill=True)
    seen_split = []
    orig = engine.runner.execute

    def spy(out):
        seen_split.extend(
            c.start_pos % 16 != 0 or (c.start_pos + len(c.token_ids)) % 16 != 0
            for c in out.chunks
            if len(c.token_ids) > 1
        )
        return orig(out)

    engine.runner.execute = spy  # type: ignore[method-assign]
    outs = run_staggered(engine, prompts, every=3)
    assert list(outs.values()) == refs
    assert any(seen_split), "no prefill chunk split a block"
    assert_engine_clean(engine)


def test_prefix_cache_partial_and_full_hits(arch_case) -> None:
    path, prompts, refs = arch_case
    engine = engine_for(path)
    long_p, long_ref = prompts[-1], refs[-1]  # 320 tokens = 20 full blocks
    [[first]] = engine.generate([long_p], GREEDY)
    assert first.token_ids == long_ref
    # Full hit: every prompt token is cached; the last one is still computed for its logits.
    computed: list[int] = []
    orig = engine.runner.execute

    def spy(out):
        computed.extend(
            len(c.token_ids) for c in out.chunks if c.start_pos > 0 and len(c.token_ids) > 1
        )
        computed.extend(16 - (c.start_pos % 16) for c in out.chunks if c.start_pos == 304)
        return orig(out)

    engine.runner.execute = spy  # type: ignore[method-assign]
    [[again]] = engine.generate([long_p], GREEDY)
    assert again.token_ids == long_ref
    assert computed and computed[0] <= 16, computed  # at most the last block recomputed
    # Partial hit: a prompt sharing the first 211-token prompt's full blocks, then diverging.
    partial = prompts[6][:200] + prompts[5][:30]
    engine.generate([prompts[6]], GREEDY)
    hits_before = engine.kv.stats()
    [[out]] = engine.generate([partial], GREEDY)
    assert out.token_ids == hf_greedy(hf_model(path), partial)
    assert hits_before.cached_blocks > 0
    assert_engine_clean(engine)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_outputs_exact(arch_case, mode: str) -> None:
    path, prompts, refs = arch_case
    # 185 blocks of 4 tokens: the prompts need 1+2+4+5+10+25+53+80 = 180 (all are admitted at
    # once, as admission reserves the prompt only); their outputs grow that to 201: someone is
    # preempted.
    block_bytes = 4 * kv_bytes_per_token(path)
    engine = engine_for(
        path,
        block_size=4,
        kv_cache_bytes=185 * block_bytes,
        swap_space_bytes=256 * block_bytes,
        preemption_mode=mode,
        admission_output_tokens=0,
    )
    preempted: list[str] = []
    swaps: list[tuple[int, int]] = []
    orig = engine.runner.execute

    def spy(out):
        preempted.extend(out.preempted_ids)
        swaps.extend(out.swap_out)
        return orig(out)

    engine.runner.execute = spy  # type: ignore[method-assign]
    outs = run_staggered(engine, prompts, every=0)
    assert list(outs.values()) == refs
    assert preempted, "nothing was preempted"
    assert bool(swaps) == (mode == "swap")
    assert_engine_clean(engine)


def kv_bytes_per_token(path: Path) -> int:
    from engine.loader import load_checkpoint

    return load_checkpoint(path, dtype="float32").config.kv_bytes_per_token()


# -- sampling through the engine (llama only) ---------------------------------------------------


@pytest.fixture(scope="module")
def llama(demo_ckpt_factory) -> Path:
    return demo_ckpt_factory("test", "llama")


def run_one(engine: LLMEngine, prompt: list[int], params: SamplingParams, **kw) -> list[TokenDelta]:
    """Run one request (``add_request`` keywords in ``kw``) to its end; its outputs."""
    rid = engine.add_request(engine.make_request(prompt, params, **kw))
    outs: list[TokenDelta] = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == rid]
    return outs


def test_seeded_request_same_alone_batched_and_resumed(llama: Path) -> None:
    """A seeded request draws the same tokens alone, among other requests, and resumed after k
    tokens on a fresh engine: from the snapshot taken there (which alone carries the seed to a
    request that names none), or from its seed alone -- there is no RNG state to carry."""
    params = SamplingParams(
        temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=12, ignore_eos=True
    )
    prompts = make_prompts(2048, seed=3)
    engine = engine_for(llama)
    [[alone]] = engine.generate([prompts[2]], params)
    assert len(set(alone.token_ids)) > 3 and alone.seed == 1234
    others = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    mixed = engine.generate(
        prompts[:2] + [prompts[2]] + prompts[3:], [others, others, params] + [others] * 5
    )
    assert mixed[2][0].token_ids == alone.token_ids
    k = 5
    snap = run_one(engine, prompts[2], params, snapshots=True)[k - 1].sampler_snapshot
    assert snap is not None and snap.num_output_tokens == k
    assert_engine_clean(engine)

    fresh = engine_for(llama)
    for resumed_params, snapshot in ((replace(params, seed=None), snap), (params, None)):
        outs = run_one(
            fresh,
            prompts[2],
            resumed_params,
            resume_output=alone.token_ids[:k],
            sampler_snapshot=snapshot,
        )
        assert [t for o in outs for t in o.token_ids] == alone.token_ids[k:]
        assert outs[-1].finished and outs[-1].seed == 1234
    assert_engine_clean(fresh)


def test_choices_of_a_seeded_request_differ_by_their_index(llama: Path) -> None:
    """Sample j of an n=2 request draws choice j of the one seed: the two differ, and each is
    what an n=1 request with ``choice=j`` draws (how the HTTP edge runs choice j)."""
    prompt = make_prompts(2048, seed=4)[3]
    params = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    engine = engine_for(llama)
    [outs] = engine.generate([prompt], params)
    assert outs[0].token_ids != outs[1].token_ids
    assert outs[0].seed == outs[1].seed == 7
    one = replace(params, n=1)
    split = engine.generate([prompt, prompt], [one, replace(one, choice=1)])
    assert [c.token_ids for [c] in split] == [o.token_ids for o in outs]
    assert_engine_clean(engine)


def test_an_unseeded_request_records_the_seed_that_reproduces_it(llama: Path) -> None:
    """A request without a seed draws one at arrival (its choices share it) and reports it;
    sending that seed back draws the same tokens. Another unseeded request draws another."""
    prompt = make_prompts(2048, seed=6)[3]
    params = SamplingParams(n=2, temperature=1.0, max_tokens=12, ignore_eos=True)
    engine = engine_for(llama)
    [outs] = engine.generate([prompt], params)
    seed = outs[0].seed
    assert outs[1].seed == seed and outs[0].token_ids != outs[1].token_ids
    [again] = engine.generate([prompt], replace(params, seed=seed))
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]
    [other] = engine.generate([prompt], params)
    assert other[0].seed != seed
    assert run_one(engine, prompt, replace(params, n=1))[-1].seed is not None
    assert_engine_clean(engine)


def test_n_samples_share_prompt_blocks(llama: Path) -> None:
    prompt = make_prompts(2048, seed=5)[4]  # 40 tokens: 2 full blocks + a partial tail of 8
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    engine = engine_for(llama, enable_prefix_caching=False)
    copies: list[tuple[int, int]] = []
    peak = [0]
    orig = engine.runner.execute

    def spy(out):
        copies.extend(out.copy_blocks)
        peak[0] = max(peak[0], engine.kv.stats().in_use_blocks)
        return orig(out)

    engine.runner.execute = spy  # type: ignore[method-assign]
    [outs] = engine.generate([prompt], params)
    assert [o.index for o in outs] == [0, 1, 2]
    assert all(len(o.token_ids) == 12 for o in outs)
    assert len({tuple(o.token_ids) for o in outs}) > 1  # independent RNG streams
    # docs/design.md#prefix-caching: M ≈ M_prompt_shared + n * M_generated. Prompt 40 + 12
    # generated = 52 tokens: shared full blocks 2, each sample's tail block(s): positions
    # 32..51 -> 2 blocks each.
    assert peak[0] == 2 + 3 * 2, peak[0]
    assert len(copies) == 2  # two children copy the shared partial tail on first append
    assert_engine_clean(engine)


def test_stop_string_and_records(llama: Path) -> None:
    engine = engine_for(llama)
    prompt = make_prompts(2048, seed=9)[3]
    [[free]] = engine.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    )
    assert len(free.text) > 6
    stop = free.text[3:6]
    [[cut]] = engine.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=(stop,))
    )
    assert cut.finish_reason is FinishReason.STOP_STRING
    assert cut.text == free.text[: free.text.index(stop)]
    assert cut.record.status == RequestStatus.FINISHED
    assert cut.record.num_committed <= cut.record.num_generated
    assert len(engine.scheduler.records) == 2
    assert_engine_clean(engine)


def test_abort_and_deadline_reclaim(llama: Path) -> None:
    import time

    engine = engine_for(llama)
    prompts = make_prompts(2048, seed=11)
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    a = engine.add_request(engine.make_request(prompts[5], long))
    b = engine.add_request(engine.make_request(prompts[6], long, deadline=time.time() + 0.05))
    for _ in range(3):
        engine.step()
    engine.abort(a)
    time.sleep(0.06)
    while engine.has_unfinished():
        engine.step()
    recs = {r.request_id: r for r in engine.scheduler.records}
    assert recs[a].status == RequestStatus.CANCELLED
    assert recs[b].status == RequestStatus.TIMED_OUT
    assert_engine_clean(engine)


def test_logprobs_through_the_engine(llama: Path) -> None:
    """Top-N logprobs per token reach the output (exact values: tests/engine/test_sampler.py)."""
    engine = engine_for(llama)
    prompt = make_prompts(2048, seed=13)[2]
    [[out]] = engine.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=3)
    )
    assert out.logprobs is not None and len(out.logprobs) == 4
    for tok, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert lp.top[0][0] == tok  # greedy: the sampled token is the most likely
        assert len(lp.top) == 3
        assert lp.logprob == pytest.approx(lp.top[0][1])
    assert_engine_clean(engine)


def test_a_misaligned_sampler_snapshot_is_refused_before_admission(llama: Path) -> None:
    """A migrated request whose snapshot was taken at another output length raises ValueError
    and leaves nothing behind: the engine keeps stepping (a request admitted and then dropped
    killed the next step with a KeyError) and serves the retry exactly."""
    engine = engine_for(llama)
    prompt = make_prompts(2048, seed=12)[0]
    params = SamplingParams(temperature=0.8, seed=7, max_tokens=6, ignore_eos=True)
    [[full]] = engine.generate([prompt], params)
    first = engine.add_request(engine.make_request(prompt, params, snapshots=True))
    outs = []
    while not outs:
        outs = [o for o in engine.step() if o.request_id == first]
    snap = outs[0].sampler_snapshot  # taken after 1 output token
    assert snap is not None and outs[0].token_ids == full.token_ids[:1]
    engine.abort(first)
    while engine.has_unfinished():
        engine.step()
    with pytest.raises(ValueError, match="snapshot taken at 1 output tokens"):
        engine.add_request(
            engine.make_request(
                prompt, params, resume_output=full.token_ids[:2], sampler_snapshot=snap
            )
        )
    assert not engine.has_unfinished()
    assert_engine_clean(engine)
    rid = engine.add_request(
        engine.make_request(prompt, params, resume_output=full.token_ids[:1], sampler_snapshot=snap)
    )
    tokens = list(full.token_ids[:1])
    while engine.has_unfinished():
        tokens += [t for o in engine.step() if o.request_id == rid for t in o.token_ids]
    assert tokens == full.token_ids
    assert_engine_clean(engine)
