"""The portable float math (engine/csrc/portable_math.cpp): exp and log are their IEEE-754 ops
as written -- replayed here op for op in numpy float32, each op rounded once, they give the
kernel's bits exactly, so no CPU, vector width or compiler fusion can change them -- and each
function is as accurate as PyTorch's; the sampler and RoPE use them on CPU.

A kernel built with FMA contraction (``-ffp-contract=fast``, the other kernels' flag) fails the
replay on an FMA CPU: the contracted multiply-adds round once where the replay rounds twice."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from numpy.typing import NDArray

from engine import kernels, model, sampler

F32 = np.float32
INF = float("inf")

pytestmark = pytest.mark.skipif(
    kernels.load("portable_math") is None, reason="no C++ toolchain: PyTorch's math only"
)


def pow2(n: NDArray[np.int32]) -> NDArray[np.float32]:
    return ((n + 127).astype(np.uint32) << 23).view(np.float32)


def exp_replay(x: NDArray[np.float32]) -> NDArray[np.float32]:
    """exp_one, op for op."""
    nan = np.isnan(x)
    xc = np.where(nan, F32(0), np.clip(x, F32(-104), F32(89))).astype(F32)
    shift = F32(12582912.0)
    k = ((xc * F32(1.44269504088896341)) + shift) - shift
    r = xc - k * F32(0.693359375)
    r = r - k * F32(-2.12194440e-4)
    p = np.full_like(r, F32(1.9875691500e-4))
    for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        p = p * r + F32(c)
    p = p * (r * r) + r
    p = p + F32(1.0)
    n = k.astype(np.int32)
    half = np.sign(n) * (np.abs(n) // 2)  # C++'s n / 2 truncates
    with np.errstate(over="ignore"):
        y = (p * pow2(half)) * pow2(n - half)
    return np.where(nan, x, y)


def log_replay(x: NDArray[np.float32]) -> NDArray[np.float32]:
    """log_one, op for op."""
    with np.errstate(invalid="ignore", over="ignore"):
        sub = x < F32(1.17549435e-38)
        u = np.where(sub, x * F32(8388608.0), x).astype(F32).view(np.uint32)
        scaled = ((u >> 23) & 0xFF).astype(np.int32) - 126 - np.where(sub, 23, 0)
        m0 = ((u & np.uint32(0x807FFFFF)) | np.uint32(0x3F000000)).view(np.float32)
        low = m0 < F32(0.707106781186547524)
        m = np.where(low, m0 + m0, m0) - F32(1.0)
        fe = (scaled - low.astype(np.int32)).astype(F32)
        z = m * m
        y = np.full_like(m, F32(7.0376836292e-2))
        for c in (
            -1.1514610310e-1,
            1.1676998740e-1,
            -1.2420140846e-1,
            1.4249322787e-1,
            -1.6668057665e-1,
            2.0000714765e-1,
            -2.4999993993e-1,
            3.3333331174e-1,
        ):
            y = y * m + F32(c)
        y = (y * m) * z
        y = y + fe * F32(-2.12194440e-4)
        y = y + F32(-0.5) * z
        v = (m + y) + fe * F32(0.693359375)
        special = np.where(x == 0, F32(-INF), np.where(x == INF, F32(INF), F32(np.nan)))
        return np.where((x > 0) & (x < INF), v, special)


def floats(n: int, seed: int) -> torch.Tensor:
    """``n`` float32s from every binade (random bit patterns, NaNs and all), then the edges."""
    bits = np.random.default_rng(seed).integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    edges = [0.0, -0.0, INF, -INF, math.nan, 1.0, -1.0, 88.72, 89.0, 89.5, -87.3, -103.9, -104.0]
    edges += [-104.5, 1e-45, 1.1754942e-38, 1.17549435e-38, 0.70710677, 0.7071068, 3.4e38]
    return torch.cat([torch.from_numpy(bits.view(np.float32)), torch.tensor(edges)])


def same_bits(a: torch.Tensor, b: NDArray[np.float32]) -> bool:
    """Equal bit for bit, any NaN equal to any NaN."""
    x, y = a.numpy(), b.astype(F32)
    both_nan = np.isnan(x) & np.isnan(y)
    return bool(((x.view(np.uint32) == y.view(np.uint32)) | both_nan).all())


@pytest.mark.parametrize("seed", range(3))
def test_exp_is_its_ieee_ops_as_written(seed: int) -> None:
    x = floats(200_000, seed)
    g = torch.Generator().manual_seed(seed)
    x = torch.cat([x, torch.rand(300_000, generator=g) * 205 - 110])  # where exp is not 0 or inf
    out = kernels.portable_exp(x)
    assert out is not None and same_bits(out, exp_replay(x.numpy()))


@pytest.mark.parametrize("seed", range(3))
def test_log_is_its_ieee_ops_as_written(seed: int) -> None:
    x = floats(300_000, seed)
    out = kernels.portable_log(x)
    assert out is not None and same_bits(out, log_replay(x.numpy()))


def ulps(ours: torch.Tensor | None, exact: torch.Tensor) -> float:
    """Largest error in units of the float32 spacing at the exact value."""
    assert ours is not None
    spacing = torch.from_numpy(np.spacing(exact.float().abs().numpy())).double()
    return float(((ours.double() - exact).abs() / spacing).max())


def test_each_function_is_as_accurate_as_torchs() -> None:
    """Against float64: exp and log within 2 float32 ulps (PyTorch's: about 1), cos and sin
    within half an ulp and a hair (computed in double, rounded once)."""
    g = torch.Generator().manual_seed(0)
    x = torch.linspace(-87, 88, 1_000_001)
    assert ulps(kernels.portable_exp(x), x.double().exp()) <= 2.0
    y = torch.rand(1_000_000, generator=g) * 1e4 + 1e-6
    y = torch.cat([y, torch.rand(100_000, generator=g) * 1e-38])  # subnormals
    assert ulps(kernels.portable_log(y), y.double().log()) <= 2.0
    a = (torch.rand(1_000_000, generator=g) - 0.5) * 2**21  # RoPE's range: |x| < 2^20
    cos_sin = kernels.portable_cos_sin(a)
    assert cos_sin is not None
    assert ulps(cos_sin[0], a.double().cos()) <= 0.5001
    assert ulps(cos_sin[1], a.double().sin()) <= 0.5001
    assert cos_sin[0].shape == a.shape


def test_the_special_values() -> None:
    special = torch.tensor([math.nan, INF, -INF, 0.0, 1.0, 89.0, -104.5, -103.0])
    out = kernels.portable_exp(special)
    assert out is not None and out[0].isnan() and out[1:4].tolist() == [INF, 0.0, 1.0]
    assert out[4].item() == pytest.approx(math.e, rel=2**-23)
    assert out[5:].tolist() == [INF, 0.0, 2**-149]  # exp(-103) = 0.86 of the least subnormal
    logs = kernels.portable_log(torch.tensor([math.nan, -1.0, 0.0, -0.0, INF, 1.0, 1e-45]))
    assert logs is not None and logs[:2].isnan().all()
    assert logs[2:6].tolist() == [-INF, -INF, INF, 0.0]
    assert logs[6].item() == pytest.approx(math.log(2**-149), rel=1e-6)  # the least subnormal
    trig = kernels.portable_cos_sin(torch.tensor([0.0, math.nan, INF]))
    assert trig is not None and trig[0][0] == 1.0 and trig[1][0] == 0.0
    assert trig[0][1:].isnan().all() and trig[1][1:].isnan().all()


def test_the_sampler_and_rope_use_them_on_cpu_float32(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each takes the kernel for float32 on CPU, torch's op for anything else; RoPE's tables
    are the kernel's cos and sin, both halves, in the model's dtype."""
    calls: list[str] = []
    real = {n: getattr(kernels, n) for n in ("portable_exp", "portable_log", "portable_cos_sin")}

    def spy(name: str) -> Callable[[torch.Tensor], Any]:
        def call(x: torch.Tensor) -> Any:
            calls.append(name)
            return real[name](x)

        return call

    for name in real:
        monkeypatch.setattr(kernels, name, spy(name))
    x = torch.randn(3, 50, generator=torch.Generator().manual_seed(3))
    assert torch.equal(sampler.exp(x), real["portable_exp"](x))
    assert torch.equal(sampler.log(x.abs()), real["portable_log"](x.abs()))
    assert calls == ["portable_exp", "portable_log"]
    assert torch.equal(sampler.exp(x.double()), x.double().exp()) and len(calls) == 2
    assert torch.equal(sampler.log(x.double().abs()), x.double().abs().log()) and len(calls) == 2
    angles = torch.rand(7, 4, generator=torch.Generator().manual_seed(4)) * 1000
    cos, sin = model.rope_cos_sin(angles, torch.bfloat16)
    assert calls[-1] == "portable_cos_sin" and cos.shape == sin.shape == (7, 1, 8)
    ours = real["portable_cos_sin"](angles)
    assert torch.equal(cos[:, 0], torch.cat([ours[0], ours[0]], -1).bfloat16())
    assert torch.equal(sin[:, 0], torch.cat([ours[1], ours[1]], -1).bfloat16())


def test_an_elements_bits_do_not_depend_on_where_it_sits() -> None:
    """Vector body or scalar tail, aligned or not, alone or among thousands (threads split the
    long ones): the same bits for each element."""
    g = torch.Generator().manual_seed(5)
    x = torch.cat([floats(40_000, 7), torch.rand(40_000, generator=g) * 200 - 100])
    for f in (kernels.portable_exp, kernels.portable_log, kernels.portable_cos_sin):
        whole = f(x)
        assert whole is not None
        expected = torch.stack(list(whole)) if isinstance(whole, tuple) else whole
        for offset in (1, 3, 8, 13):
            buf = torch.empty(len(x) + offset)
            buf[offset:] = x
            moved = f(buf[offset:])
            assert moved is not None
            got = torch.stack(list(moved)) if isinstance(moved, tuple) else moved
            assert same_bits(got, expected.numpy())
        for i in range(0, len(x), 997):
            alone = f(x[i : i + 1])
            assert alone is not None
            got = torch.stack(list(alone)) if isinstance(alone, tuple) else alone
            assert same_bits(got, expected[..., i : i + 1].numpy())
