"""An int8 KV cache (``kv_cache_dtype: int8``, docs/design.md#int8-kv): each token's head stored
as int8 values and one fp32 scale, taken when the token's KV is written. The kernel reads it in
place (against a float64 reference on the dequantized rows); a token's bytes depend on that token
alone, so the engine keeps the deterministic-serving guarantees (chunking, load, prefix hits,
preemption); the sizing counts the smaller rows; it is its own numerics class."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_determinism import BOTH, Runner, alone, engine_for, key, preempted_run, under_load
from test_kernels import BLOCK, NUM_BLOCKS, reference

from engine import kernels
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.kv_layout import INT8_SCALE_BYTES, KVLayout, LayoutMismatch, int8_rows
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(
    kernels.load("paged_decode_attention") is None,
    reason="the C++ extension cannot be built here (no compiler/OpenMP)",
)

INT8 = {"kv_cache_dtype": "int8"}


def dequantized(rows: torch.Tensor) -> torch.Tensor:
    """int8 cache rows ``[..., d + 4]`` as the float64 values they stand for."""
    d = rows.shape[-1] - INT8_SCALE_BYTES
    scale = rows[..., d:].contiguous().view(torch.float32)
    return rows[..., :d].double() * scale.double()


# -- the rows --------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 9),
    d=st.sampled_from([16, 40, 64]),
    magnitude=st.sampled_from([1e-3, 1.0, 300.0]),
    seed=st.integers(0, 2**16),
)
def test_a_row_is_its_values_over_its_own_scale(
    rows: int, d: int, magnitude: float, seed: int
) -> None:
    """scale = max|x| / 127 in fp32, q = round(x / scale) in [-127, 127]: within half a step of
    x, the largest magnitude exactly +-127; a row's bytes do not depend on the rows beside it; a
    zero row is zeros with scale 0."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, d, generator=g) * magnitude).to(torch.bfloat16)
    x[0] = 0
    out = int8_rows(x)
    assert out.dtype == torch.int8 and out.shape == (rows, d + INT8_SCALE_BYTES)
    scale = out[:, d:].contiguous().view(torch.float32)[:, 0]
    amax = x.float().abs().amax(1)
    assert torch.equal(scale, amax / torch.full_like(amax, 127.0))
    assert out[0].eq(0).all()
    step = scale.double()[:, None]  # fp32 rounding of x * (127 / max) adds ~1e-7 of x
    assert (dequantized(out) - x.double()).abs().le(step * (0.5 + 1e-5)).all()
    top = x.float().abs().argmax(1)[1:]
    assert out[1:, :d].gather(1, top[:, None]).abs().eq(127).all()
    for i in range(rows):
        assert torch.equal(int8_rows(x[i : i + 1])[0], out[i])


# -- the kernel ------------------------------------------------------------------------------------


def int8_case(
    g: torch.Generator, lens: list[int], kv_heads: int, group: int, d: int, dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    """test_kernels' random case with the caches as int8 rows."""
    width = (max(lens) + BLOCK - 1) // BLOCK + 2
    shape = (NUM_BLOCKS, BLOCK, kv_heads, d)
    k_cache = int8_rows(torch.randn(shape, generator=g) * 3)
    v_cache = int8_rows(torch.randn(shape, generator=g))
    tables = torch.randint(0, NUM_BLOCKS, (len(lens), width), generator=g)
    for i, n in enumerate(lens):
        tables[i, (n + BLOCK - 1) // BLOCK :] = 0
    q = torch.randn(len(lens), kv_heads * group, d, generator=g).to(dtype)
    return q, k_cache, v_cache, tables


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("d", [16, 40, 64, 128])  # 40: not a multiple of 16, the plain loops
@pytest.mark.parametrize("group", [1, 3])
def test_the_kernel_reads_int8_rows_in_place(
    dtype: torch.dtype, tol: float, d: int, group: int
) -> None:
    g = torch.Generator().manual_seed(d * 10 + group)
    lens = [1, 2, 15, 16, 17, 100, 255, 256, 257, 511, 512, 513, 1100]
    starts = [0, 0, 0, 3, 16, 0, 0, 200, 0, 0, 100, 0, 520]  # windows, across splits
    q, k_cache, v_cache, tables = int8_case(g, lens, kv_heads=2, group=group, d=d, dtype=dtype)
    out = kernels.paged_decode_attention(
        q, k_cache, v_cache, tables, torch.tensor(starts), torch.tensor(lens), d**-0.5
    )
    assert out.dtype == dtype and out.shape == (len(lens), q.shape[1] * d)
    ref = reference(q, dequantized(k_cache), dequantized(v_cache), tables, starts, lens, d**-0.5)
    assert (out.double() - ref).abs().max().item() < tol


def test_the_kernel_refuses_int8_rows_without_their_scale() -> None:
    q = torch.zeros(1, 2, 16)
    cache = torch.zeros(4, BLOCK, 2, 16, dtype=torch.int8)  # no room for the scale
    one = torch.ones(1, dtype=torch.long)
    with pytest.raises(RuntimeError, match="an int8 cache row is head_dim \\+ 4 bytes"):
        kernels.paged_decode_attention(q, cache, cache, torch.zeros(1, 1).long(), one * 0, one, 1.0)


# -- the engine ------------------------------------------------------------------------------------


@settings(max_examples=6, deadline=None)
@given(data=st.data())
def test_int8_kv_and_logits_are_the_same_bits_however_computed(bf16_llama: Path, data) -> None:
    """One prefill, random chunks among others, and token by token: the same int8 KV bytes and
    last-token logits (test_determinism's property, on an int8 cache)."""
    rng = random.Random(data.draw(st.integers(0, 2**16)))
    length = data.draw(st.integers(2, 100))
    tokens = [rng.randrange(8, 2048) for _ in range(length)]
    run = Runner(bf16_llama, max_num_batched_tokens=4096, **INT8)
    assert run.runner.kv_cache.dtype == torch.int8
    whole = run.step([("whole", tokens, 0)])["whole"]
    start = 0
    while start < length:
        size = min(length - start, rng.choice([1, 3, 16, 17, 40]))
        other = [rng.randrange(8, 2048) for _ in range(rng.randrange(1, 30))]
        chunked = run.step(
            [(f"o{start}", other, 0), ("chunked", tokens[start : start + size], start)]
        )
        start += size
    for pos in range(length):
        stepwise = run.step([("stepwise", tokens[pos : pos + 1], pos)])
    assert torch.equal(chunked["chunked"], whole) and torch.equal(stepwise["stepwise"], whole)
    reference_kv = run.kv("whole", length)
    assert torch.equal(run.kv("chunked", length), reference_kv)
    assert torch.equal(run.kv("stepwise", length), reference_kv)
    # Each row is int8_rows of the bf16 model's KV for the same tokens: what the token wrote.
    plain = Runner(bf16_llama, max_num_batched_tokens=4096)
    plain.step([("whole", tokens, 0)])
    layers = plain.kv("whole", length)
    assert torch.equal(int8_rows(layers[0]), reference_kv[0])  # layer 0: inputs identical


@BOTH
def test_an_int8_kv_request_is_the_same_bits_under_load_and_after_prefix_hits(
    bf16_llama: Path, params: SamplingParams
) -> None:
    target = [(37 * i + 11) % 2000 + 8 for i in range(70)]
    ref = alone_int8(bf16_llama, target, params)
    assert ref != alone(bf16_llama, target, params)  # int8 KV does change the bits
    rng = random.Random(7)
    for budget in (16, 512):
        engine = engine_for(bf16_llama, max_num_batched_tokens=budget, **INT8)
        assert under_load(engine, target, params, rng) == ref
    engine = engine_for(bf16_llama, **INT8)
    for blocks in (1, 3):
        engine.generate([target[: blocks * 16]], SamplingParams(max_tokens=1))
        hits = engine.kv.stats().prefix_hit_tokens
        [[out]] = engine.generate([target], params)
        assert engine.kv.stats().prefix_hit_tokens - hits >= blocks * 16
        assert key(out) == ref


def alone_int8(path: Path, target: list[int], params: SamplingParams) -> tuple[object, ...]:
    [[out]] = engine_for(path, enable_prefix_caching=False, **INT8).generate([target], params)
    return key(out)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_int8_kv_preemption_changes_no_bit(bf16_llama: Path, mode: str) -> None:
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=16, ignore_eos=True, logprobs=2)
    prompts = [[(29 * i + 3 * j) % 2000 + 8 for i in range(40 + 13 * j)] for j in range(8)]
    refs = [alone_int8(bf16_llama, p, params) for p in prompts]
    assert preempted_run(bf16_llama, prompts, params, mode, **INT8) == refs


# -- sizing, layout, class -------------------------------------------------------------------------


def test_the_same_bytes_hold_more_int8_tokens(bf16_llama: Path) -> None:
    """head_dim d: a bf16 row is 2d bytes, an int8 one d + 4 -- for the test model's d = 16,
    32 / 20 = 1.6x the blocks; for SmolLM2's 64, 128 / 68 = 1.88x."""
    budget = 2**22
    plain = engine_for(bf16_llama, kv_cache_bytes=budget).runner
    small = engine_for(bf16_llama, kv_cache_bytes=budget, **INT8).runner
    d = plain.model_config.head_dim
    assert (plain.kv_layout.row_width, small.kv_layout.row_width) == (d, d + 4)
    assert small.num_blocks == budget // (small.kv_layout.bytes_per_token * 16)
    assert plain.num_blocks == budget // (plain.kv_layout.bytes_per_token * 16)
    assert small.kv_layout.bytes_per_token * 2 * d == plain.kv_layout.bytes_per_token * (d + 4)
    assert small.kv_cache.nbytes <= budget and small.host_cache.dtype == torch.int8


def test_int8_and_bf16_caches_do_not_exchange_blocks(bf16_llama: Path) -> None:
    plain = engine_for(bf16_llama).runner
    small = engine_for(bf16_llama, **INT8).runner
    assert small.kv_layout == KVLayout.from_cache(small.kv_cache)
    assert small.kv_layout.payload_shape(3)[-1] == plain.kv_layout.head_dim + 4
    with pytest.raises(LayoutMismatch, match="dtype: 'int8' here, 'bfloat16' peer"):
        small.kv_layout.check_compatible(plain.kv_layout)
    layout = kernels.invariant_layouts()[0]
    assert small.numerics == f"bfloat16/invariant/{layout}/kv-int8"
    assert plain.numerics == f"bfloat16/invariant/{layout}"


def test_without_the_kernel_an_int8_cache_is_refused(
    bf16_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ValueError, match="read by the CPU attention kernel, not sdpa"):
        LLMEngine.from_checkpoint(
            bf16_llama,
            EngineConfig(
                deterministic=False, attention_backend="sdpa", kv_cache_bytes=2**22, **INT8
            ),  # type: ignore[arg-type]
        )
    real = kernels.load
    monkeypatch.setattr(
        kernels, "load", lambda name: None if name == "paged_decode_attention" else real(name)
    )
    with pytest.raises(ValueError, match="needs the compiled paged_decode_attention kernel"):
        LLMEngine.from_checkpoint(
            bf16_llama,
            EngineConfig(deterministic=False, kv_cache_bytes=2**22, **INT8),  # type: ignore[arg-type]
        )


def test_without_deterministic_numerics_every_row_still_reads_the_int8_cache(
    bf16_llama: Path,
) -> None:
    """``deterministic: false`` runs prefill chunks through SDPA, which cannot read int8 rows:
    with an int8 cache every row goes to the paged kernel instead, and a chunked prompt
    completes."""
    engine = engine_for(bf16_llama, deterministic=False, max_num_batched_tokens=16, **INT8)
    assert engine.runner.paged_rows and not engine.runner.deterministic
    [[out]] = engine.generate([list(range(8, 48))], SamplingParams(max_tokens=8, ignore_eos=True))
    assert len(out.token_ids) == 8
