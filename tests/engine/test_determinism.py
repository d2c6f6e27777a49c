"""Batch-invariant numerics (issue 16): a request's tokens, logprobs and KV are the same bits
whatever shares its batch, however its prompt is chunked, cached or preempted, at any thread
count -- in bf16, on random checkpoints and on a real trained model (SmolLM2-135M-Instruct).

Three levels: the GEMM kernel (rows independent of M), the model runner (a sequence's KV and
logits identical in one prefill, in chunks and token by token, among other sequences), and the
engine (one target request alone vs under random load; SGLang's three test modes).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from helpers import assert_engine_clean
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import kernels
from engine.batch import ScheduledChunk, SchedulerOutput
from engine.config import EngineConfig
from engine.engine import CompletionOutput, LLMEngine
from engine.loader import load_checkpoint
from engine.model_runner import DeterminismUnavailable, ModelRunner, check_deterministic
from engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=3)
SEEDED = SamplingParams(
    temperature=0.9, top_p=0.95, seed=5, max_tokens=16, ignore_eos=True, logprobs=3
)
BOTH = pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])


@contextmanager
def threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# -- the GEMM ------------------------------------------------------------------------------------


LAYOUTS = kernels.invariant_layouts()


@settings(max_examples=40, deadline=None)
@given(
    m=st.integers(1, 80),
    n=st.integers(1, 200),
    k=st.sampled_from([16, 17, 64, 100, 576]),
    dtype=st.sampled_from([torch.bfloat16, torch.float32]),
    layout=st.sampled_from(LAYOUTS),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_invariant_linear_rows_do_not_depend_on_the_batch(
    m: int, n: int, k: int, dtype: torch.dtype, layout: str, bias: bool, seed: int
) -> None:
    """Row i of x W^T is the same bits computed alone, at any offset of any batch, at 1 or 2
    threads -- and close to the fp64 product (it is a GEMM). Every layout this CPU runs (AMX
    tiles, AVX512-BF16 pairs, AVX2 columns): tiles pad rows to 16 and k to 32, so m and k
    cross those bounds."""
    layout = layout if dtype == torch.bfloat16 else "columns"
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    x = torch.randn(m, k, generator=g).to(dtype)
    packed = kernels.pack_linear(w, layout)
    full = kernels.invariant_linear(x, packed, n, b, layout)
    ref = x.double() @ w.double().T + (0 if b is None else b.double())
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(full.double(), ref, rtol=tol, atol=tol * k**0.5)
    i = seed % m
    with threads(1):
        alone = kernels.invariant_linear(x[i : i + 1], packed, n, b, layout)
    assert torch.equal(alone[0], full[i])
    j = (seed // 7) % m
    lo, hi = min(i, j), max(i, j) + 1
    assert torch.equal(kernels.invariant_linear(x[lo:hi], packed, n, b, layout), full[lo:hi])


@pytest.mark.parametrize("layout", ["tiles", "pairs"])
def test_the_bf16_layouts_refuse_fp32(layout: str) -> None:
    with pytest.raises(RuntimeError, match=f"the {layout} layout needs bf16"):
        kernels.pack_linear(torch.zeros(4, 4), layout)


def test_an_unknown_layout_is_refused() -> None:
    with pytest.raises(RuntimeError, match="unknown layout 'amx'"):
        kernels.pack_linear(torch.zeros(4, 4), "amx")


def test_x_and_the_weight_of_two_dtypes_are_refused() -> None:
    packed = kernels.pack_linear(torch.zeros(4, 16), "columns")
    with pytest.raises(RuntimeError, match="share a dtype"):
        kernels.invariant_linear(
            torch.zeros(2, 16, dtype=torch.bfloat16), packed, 4, None, "columns"
        )


@pytest.mark.skipif("tiles" not in LAYOUTS, reason="needs an AMX-BF16 CPU")
def test_tile_rows_are_the_same_bits_wherever_the_row_sits() -> None:
    """What the tiles layout rests on: a row's AMX result is the same bits in any of a tile's
    16 rows, in a partial last tile, and next to any other rows -- every row of a 37-row batch
    against the same row computed alone (padded with 15 zero rows) and inside 16 random rows."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(96, 128, generator=g).bfloat16()
    x = torch.randn(37, 128, generator=g).bfloat16()
    packed = kernels.pack_linear(w, "tiles")
    full = kernels.invariant_linear(x, packed, 96, None, "tiles")
    for i in range(37):
        alone = kernels.invariant_linear(x[i : i + 1], packed, 96, None, "tiles")
        others = torch.randn(16, 128, generator=g).bfloat16()
        others[i % 16] = x[i]
        mixed = kernels.invariant_linear(others, packed, 96, None, "tiles")
        assert torch.equal(alone[0], full[i]) and torch.equal(mixed[i % 16], full[i])


# -- the model runner: KV and logits, whatever wrote them -----------------------------------------


class Runner:
    """A ModelRunner driven by hand-built steps: sequence ``name`` owns blocks handed out in
    order, so the same tokens computed different ways land in different blocks to compare."""

    def __init__(self, path: Path, **kw: object) -> None:
        ckpt = load_checkpoint(path, dtype="bfloat16")
        config = EngineConfig(dtype="bfloat16", block_size=16, kv_cache_bytes=2**22, **kw)  # type: ignore[arg-type]
        self.runner = ModelRunner(ckpt, config, torch.device("cpu"))
        self.tables: dict[str, list[int]] = {}
        self.next_block = 0

    def table(self, name: str, num_tokens: int) -> list[int]:
        table = self.tables.setdefault(name, [])
        while len(table) * 16 < num_tokens:
            table.append(self.next_block)
            self.next_block += 1
        return table

    def step(self, chunks: list[tuple[str, list[int], int]]) -> dict[str, torch.Tensor]:
        """Run (name, tokens, start) chunks in one step; the logits of each chunk's last row."""
        scheduled = [
            ScheduledChunk(name, tokens, start, self.table(name, start + len(tokens)), True)
            for name, tokens, start in chunks
        ]
        logits = self.runner.execute(SchedulerOutput(chunks=scheduled))
        return {c.request_id: row for c, row in zip(scheduled, logits, strict=True)}

    def kv(self, name: str, num_tokens: int) -> torch.Tensor:
        """``[layers, 2, num_tokens, kv_heads, d]``: the sequence's KV, positions in order."""
        blocks = torch.tensor(self.tables[name], dtype=torch.long)
        cache = self.runner.kv_cache.index_select(2, blocks)
        return cache.flatten(2, 3)[:, :, :num_tokens]


@settings(max_examples=12, deadline=None)
@given(data=st.data())
def test_kv_and_logits_are_the_same_bits_however_computed(bf16_llama: Path, data) -> None:
    """One prefill, random chunks among other sequences' chunks and decodes, and token by token
    (decode steps, q_len 1) write the same KV bits and give the same last-token logits."""
    rng = random.Random(data.draw(st.integers(0, 2**16)))
    length = data.draw(st.integers(2, 140))
    tokens = [rng.randrange(8, 2048) for _ in range(length)]
    run = Runner(bf16_llama, max_num_batched_tokens=4096)

    def noise(step: int) -> list[tuple[str, list[int], int]]:
        """Other sequences in the step: a fresh prompt of random length, or nothing."""
        if rng.random() < 0.3:
            return []
        size = rng.randrange(1, 60)
        return [(f"other{step}", [rng.randrange(8, 2048) for _ in range(size)], 0)]

    whole = run.step([("whole", tokens, 0)])["whole"]
    start, step = 0, 0
    while start < length:
        size = min(length - start, rng.choice([1, 1, 3, 16, 17, 40]))
        chunked = run.step([*noise(step), ("chunked", tokens[start : start + size], start)])
        start, step = start + size, step + 1
    for pos in range(length):
        stepwise = run.step([("stepwise", tokens[pos : pos + 1], pos), *noise(1000 + pos)])
    assert torch.equal(chunked["chunked"], whole)
    assert torch.equal(stepwise["stepwise"], whole)
    reference = run.kv("whole", length)
    assert torch.equal(run.kv("chunked", length), reference)
    assert torch.equal(run.kv("stepwise", length), reference)


def test_the_thread_count_changes_no_bit(bf16_llama: Path) -> None:
    tokens = list(range(50, 150))
    results = []
    for n in (1, 2):
        with threads(n):
            run = Runner(bf16_llama)
            results.append((run.step([("a", tokens, 0)])["a"], run.kv("a", len(tokens))))
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])


# -- the engine: one target request under every condition -----------------------------------------


def key(out: CompletionOutput) -> tuple[object, ...]:
    """Everything that must not move: the tokens and every logprob, exactly."""
    assert out.logprobs is not None
    return (tuple(out.token_ids), tuple((lp.logprob, tuple(lp.top)) for lp in out.logprobs))


def engine_for(path: Path, **kw: object) -> LLMEngine:
    base: dict[str, object] = {"dtype": "bfloat16", "kv_cache_bytes": 2**24, "max_num_seqs": 64}
    return LLMEngine.from_checkpoint(path, EngineConfig(**{**base, **kw}))  # type: ignore[arg-type]


def alone(path: Path, target: list[int], params: SamplingParams) -> tuple[object, ...]:
    [[out]] = engine_for(path, enable_prefix_caching=False).generate([target], params)
    return key(out)


def under_load(
    engine: LLMEngine, target: list[int], params: SamplingParams, rng: random.Random
) -> tuple[object, ...]:
    """The target among 1-64 other requests of random lengths arriving at random steps."""
    others = [
        [rng.randrange(8, 2000) for _ in range(rng.randrange(1, 200))]
        for _ in range(rng.randrange(1, 65))
    ]
    start_at, step, target_id = rng.randrange(0, 5), 0, None
    while others or engine.has_unfinished() or target_id is None:
        if step == start_at:
            target_id = engine.add_request(engine.make_request(target, params))
        while others and rng.random() < 0.6:
            other = SamplingParams(
                temperature=rng.choice([0.0, 1.0]), max_tokens=rng.randrange(1, 40), ignore_eos=True
            )
            engine.add_request(engine.make_request(others.pop(), other))
        engine.step()
        step += 1
    done = {o.request_id: o for o in engine.finished_outputs()}
    assert_engine_clean(engine)
    return key(done[target_id])


@BOTH
@pytest.mark.parametrize("budget", [16, 64, 512])
def test_target_is_bitwise_the_same_under_random_load(
    bf16_llama: Path, params: SamplingParams, budget: int
) -> None:
    """Batches of 1-64 others arriving at random steps, chunk sizes 16-512 (the step's token
    budget cuts the prompts)."""
    target = [(37 * i + 11) % 2000 + 8 for i in range(90)]
    reference = alone(bf16_llama, target, params)
    engine = engine_for(bf16_llama, max_num_batched_tokens=budget)
    rng = random.Random(budget)
    for _ in range(4):
        assert under_load(engine, target, params, rng) == reference


@BOTH
def test_prefix_hits_of_every_block_aligned_length(
    bf16_llama: Path, params: SamplingParams
) -> None:
    """The target after a cached prefix of 1, 2, ... blocks (its own tail computed on top)."""
    target = [(53 * i + 5) % 2000 + 8 for i in range(100)]
    reference = alone(bf16_llama, target, params)
    for blocks in range(1, len(target) // 16 + 1):
        engine = engine_for(bf16_llama)
        engine.generate([target[: blocks * 16]], SamplingParams(max_tokens=1))
        hits = engine.kv.stats().prefix_hit_tokens
        [[out]] = engine.generate([target], params)
        assert engine.kv.stats().prefix_hit_tokens - hits == blocks * 16
        assert key(out) == reference, blocks
        assert_engine_clean(engine)


@BOTH
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_changes_no_bit(bf16_llama: Path, params: SamplingParams, mode: str) -> None:
    """A cache too small for the batch: requests are preempted (recompute or swap) and come
    back; every one equals its run alone."""
    prompts = [[(29 * i + 3 * j) % 2000 + 8 for i in range(40 + 13 * j)] for j in range(8)]
    refs = [alone(bf16_llama, p, params) for p in prompts]
    assert preempted_run(bf16_llama, prompts, params, mode) == refs


def preempted_run(
    path: Path, prompts: list[list[int]], params: SamplingParams, mode: str, **kw: object
) -> list[tuple[object, ...]]:
    """``prompts`` in an engine whose cache holds 40 blocks (and the host 64): asserts that
    something was preempted (``mode``: recompute or swap); each request's :func:`key`."""
    config = load_checkpoint(path, dtype="bfloat16").config
    block_bytes = 16 * config.kv_bytes_per_token(str(kw.get("kv_cache_dtype", "auto")))
    engine = engine_for(
        path,
        kv_cache_bytes=40 * block_bytes,
        swap_space_bytes=64 * block_bytes,
        preemption_mode=mode,
        admission_output_tokens=0,
        **kw,
    )
    preempted: list[str] = []
    execute = engine.runner.execute

    def spy(out: SchedulerOutput) -> torch.Tensor:
        preempted.extend(out.preempted_ids)
        return execute(out)

    engine.runner.execute = spy  # type: ignore[method-assign]
    outs = engine.generate(prompts, params)
    assert preempted, "nothing was preempted"
    assert_engine_clean(engine)
    return [key(o) for [o] in outs]


# -- SGLang's three determinism modes, on CPU ------------------------------------------------------


RUNS = 50


def test_sglang_modes_one_unique_output_each(bf16_llama: Path) -> None:
    """One prompt 50 times (concurrent copies), mixed prompts at random concurrency 50 times,
    shared-prefix prompts 50 times: each prompt has one unique output (tokens and logprobs)."""
    rng = random.Random(0)
    prompts = [[rng.randrange(8, 2000) for _ in range(rng.randrange(5, 120))] for _ in range(6)]
    prefix = [rng.randrange(8, 2000) for _ in range(48)]
    shared = [prefix + [rng.randrange(8, 2000) for _ in range(n)] for n in (1, 7, 16, 30)]
    engine = engine_for(bf16_llama, max_num_batched_tokens=128)
    seen: dict[tuple[float, ...], set[tuple[object, ...]]] = {}
    modes = {
        "single": lambda: [prompts[0]] * rng.randrange(1, 8),
        "mixed": lambda: rng.sample(prompts, rng.randrange(1, len(prompts) + 1)),
        "prefix": lambda: rng.sample(shared, rng.randrange(1, len(shared) + 1)),
    }
    for make in modes.values():
        for _ in range(RUNS):
            batch = make()
            params = rng.choice([GREEDY, SEEDED])
            ids = [engine.add_request(engine.make_request(p, params)) for p in batch]
            while engine.has_unfinished():
                engine.step()
            done = {o.request_id: o for o in engine.finished_outputs()}
            for p, rid in zip(batch, ids, strict=True):
                seen.setdefault((params.temperature, *p), set()).add(key(done[rid]))
    assert all(len(outputs) == 1 for outputs in seen.values())
    assert len(seen) >= len(prompts) + len(shared)
    assert_engine_clean(engine)


# -- a real trained model -------------------------------------------------------------------------


@BOTH
def test_smollm2_target_is_bitwise_the_same_under_load(
    smollm2: Path, params: SamplingParams
) -> None:
    target = list(range(300, 380))
    reference = alone(smollm2, target, params)
    engine = engine_for(smollm2, max_num_batched_tokens=64)
    rng = random.Random(1)
    for _ in range(2):
        assert under_load(engine, target, params, rng) == reference


# -- refusing what cannot be invariant --------------------------------------------------------------


def test_the_engine_refuses_non_invariant_settings(bf16_llama: Path) -> None:
    with pytest.raises(DeterminismUnavailable, match="sdpa is not batch-invariant"):
        engine_for(bf16_llama, attention_backend="sdpa")
    # Spelled out, the same setting runs.
    engine_for(bf16_llama, attention_backend="sdpa", deterministic=False)


@pytest.mark.parametrize("device", ["cuda", "meta"])
def test_another_device_is_refused_unless_told(device: str) -> None:
    """The invariant kernels are CPU kernels: on CUDA (or anything else) the check refuses,
    naming the device and the setting; told ``deterministic: false`` it lets it run."""
    with pytest.raises(DeterminismUnavailable, match=f"implemented for CPU, not {device};"):
        check_deterministic(EngineConfig(), torch.device(device))
    check_deterministic(EngineConfig(deterministic=False), torch.device(device))
    check_deterministic(EngineConfig(), torch.device("cpu"))


def test_without_the_compiled_kernels_the_engine_refuses_unless_told(
    bf16_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(kernels.DISABLE_ENV, "0")
    kernels.load.cache_clear()
    try:
        with pytest.raises(
            DeterminismUnavailable, match="invariant_linear, paged_decode_attention"
        ):
            engine_for(bf16_llama)
        [[out]] = engine_for(bf16_llama, deterministic=False).generate([[5, 6, 7]], GREEDY)
        assert len(out.token_ids) == GREEDY.max_tokens
    finally:
        kernels.load.cache_clear()
