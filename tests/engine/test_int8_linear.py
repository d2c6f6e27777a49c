"""The int8 GEMM (W8A8, engine/csrc/int8_linear.cpp): every path this CPU runs gives exactly
the bits of the formula written out in PyTorch -- activations quantized per row and group of 64
k, weights per output channel, each group's products summed exactly, the groups met by one
fused multiply-add each in order, the weight scale last -- so the output is the same whatever
the path, the batch around a row, or the thread count."""

from __future__ import annotations

import pytest
import torch

from engine import kernels
from engine.quantization import GROUP, quantize_groups, quantize_rows

pytestmark = pytest.mark.skipif(
    kernels.load("int8_linear") is None, reason="no C++ toolchain: the int8 kernel cannot build"
)


def reference(
    x: torch.Tensor, q_w: torch.Tensor, s_w: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """The formula in PyTorch: per group an exact integer sum (float64 holds it), folded into
    fp32 by fma(float(dot), s_x, acc) -- computed in float64, where the product is exact and
    the one rounding to float32 matches fma's but in a double-rounding case (~2^-29 odds) --
    then acc * s_w (+ bias), rounded to x's dtype."""
    q_x, s_x = quantize_groups(x)
    acc = torch.zeros(x.shape[0], q_w.shape[0], dtype=torch.float32)
    for g in range(s_x.shape[1]):
        cols = slice(g * GROUP, (g + 1) * GROUP)
        dot = (q_x[:, cols].double() @ q_w[:, cols].double().T).float()
        acc = (dot.double() * s_x[:, g : g + 1].double() + acc.double()).float()
    y = acc * s_w[None, :]
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def case(m: int, k: int, n: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * 3).to(dtype)
    x[0, : k // 3] = 0  # a row partly zero; below, a whole zero row
    if m > 2:
        x[2] = 0
    weight = torch.randn(n, k, generator=g) / k**0.5
    q_w, s_w = quantize_rows(weight)
    bias = torch.randn(n, generator=g)
    return x, q_w, s_w, bias


@pytest.mark.parametrize("path", kernels.INT8_PATHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    ("m", "k", "n"),
    [(1, 64, 64), (3, 70, 130), (13, 576, 200), (6, 1536, 64), (37, 128, 130)],  # amx: 16-row tiles
)
def test_each_path_gives_the_formulas_bits(
    path: str, dtype: torch.dtype, m: int, k: int, n: int
) -> None:
    if path not in kernels.int8_paths():
        pytest.skip(f"this CPU does not run the {path} path")
    x, q_w, s_w, bias = case(m, k, n, dtype, seed=m * k + n)
    packed, sums = kernels.pack_int8(q_w)
    groups = [q_w[:, g : g + GROUP].int().sum(1) * 128 for g in range(0, k, GROUP)]
    assert torch.equal(sums, torch.stack(groups))
    for b in (bias, None):
        got = kernels.int8_linear(x, packed, sums, s_w, n, b, path)
        assert got.dtype == dtype and got.shape == (m, n)
        assert torch.equal(got, reference(x, q_w, s_w, b)), path


@pytest.mark.parametrize("path", kernels.INT8_PATHS)
def test_activations_quantize_ties_bounds_and_tiny_values_as_the_formula(path: str) -> None:
    """The activations' quantizer (vectorized on AVX-512, whole groups) on what random values
    rarely hit: x * 127 / amax exactly halfway (1.5 -> 2, 2.5 -> 2, -0.5 -> -0: half to even),
    the group's own +-amax (+-127), -0, a subnormal group (127 / amax overflows to inf) and a
    zero group -- each row's output the formula's bits."""
    if path not in kernels.int8_paths():
        pytest.skip(f"this CPU does not run the {path} path")
    k = 4 * GROUP
    x = torch.zeros(3, k)
    halves = torch.arange(-63.5, 61.0, 1.0)  # 125 values; with amax 127 each is a tie
    x[0, :GROUP] = torch.cat((halves[: GROUP - 1], torch.tensor([127.0])))
    x[0, GROUP : 2 * GROUP] = torch.cat((halves[GROUP - 1 :], torch.tensor([-127.0, -0.0])))
    x[1, :GROUP] = torch.linspace(-1, 1, GROUP) * 1e-40  # subnormal
    x[1, GROUP : 2 * GROUP] = torch.linspace(-3, 5, GROUP)
    x[2, 2 * GROUP :] = torch.randn(2 * GROUP, generator=torch.Generator().manual_seed(5))
    w = torch.randn(96, k, generator=torch.Generator().manual_seed(6))
    q_w, s_w = quantize_rows(w)
    packed, sums = kernels.pack_int8(q_w)
    got = kernels.int8_linear(x, packed, sums, s_w, 96, None, path)
    assert torch.equal(got, reference(x, q_w, s_w, None))


def test_a_rows_bits_do_not_depend_on_its_batch_or_the_thread_count() -> None:
    x, q_w, s_w, bias = case(37, 576, 1536, torch.bfloat16, seed=7)
    packed, sums = kernels.pack_int8(q_w)
    whole = kernels.int8_linear(x, packed, sums, s_w, 1536, bias)
    for row in (0, 5, 36):
        alone = kernels.int8_linear(x[row : row + 1], packed, sums, s_w, 1536, bias)
        assert torch.equal(alone[0], whole[row])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(kernels.int8_linear(x, packed, sums, s_w, 1536, bias), whole)
    finally:
        torch.set_num_threads(threads)


def test_the_auto_path_is_the_fastest_this_cpu_runs_and_others_are_refused() -> None:
    ext = kernels.load("int8_linear")
    assert ext is not None
    assert ext.int8_path("auto") == kernels.int8_paths()[0]
    assert "scalar" in kernels.int8_paths()
    x, q_w, s_w, _ = case(2, 64, 64, torch.float32, seed=1)
    packed, sums = kernels.pack_int8(q_w)
    with pytest.raises(Exception, match="unknown path"):
        kernels.int8_linear(x, packed, sums, s_w, 64, None, "avx1024")
    with pytest.raises(RuntimeError, match="packed size mismatch"):
        kernels.int8_linear(x, packed[:-4], sums, s_w, 64, None)


def test_a_weight_of_minus_128_is_refused_at_packing() -> None:
    """The avx2 path negates weights where x is negative (vpsignb), and -128 has no int8
    negation: packing refuses it by name rather than serving wrong dots."""
    q_w = torch.zeros(64, 64, dtype=torch.int8)
    q_w[5, 7] = -128
    with pytest.raises(RuntimeError, match=r"\[-127, 127\]"):
        kernels.pack_int8(q_w)
    q_w[5, 7] = -127
    kernels.pack_int8(q_w)
