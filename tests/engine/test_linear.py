"""The GEMM paths of engine.model.Linear: each computes a bf16 GEMM as fp32 accumulation rounded
to bf16, and a bf16 weight on CPU never takes torch's emulated bf16 GEMM."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from engine import kernels
from engine.model import (
    _MKLDNN_BF16,
    SKINNY_ROWS,
    WIDEN_MIN_ROWS,
    Linear,
    LinearMode,
    default_linear_mode,
)

HAVE_SKINNY = kernels.load("skinny_linear") is not None


def test_default_mode_avoids_emulated_bf16_gemm() -> None:
    bf16 = torch.zeros(8, 8, dtype=torch.bfloat16)
    assert default_linear_mode(bf16) == ("packed" if _MKLDNN_BF16 else "widen")
    assert default_linear_mode(bf16.float()) == "plain"


MODES: list[LinearMode] = ["widen", "plain"] + (["packed"] if _MKLDNN_BF16 else [])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 8, 12, 13, 64])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_paths_match_fp64_reference(mode: LinearMode, rows: int, with_bias: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 80, generator=g).to(torch.bfloat16)
    b = torch.randn(96, generator=g).to(torch.bfloat16) if with_bias else None
    x = torch.randn(rows, 80, generator=g).to(torch.bfloat16)
    lin = Linear(w, b, mode)
    assert lin.mode == mode
    y = lin(x)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, 96)
    ref = x.double() @ w.double().T + (b.double() if b is not None else 0)
    # fp32 accumulation then one bf16 rounding: within one bf16 ulp (2^-7 relative) of exact.
    err = (y.double() - ref).abs()
    assert (err <= ref.abs() * 2**-7 + 1e-3).all(), err.max()


def test_widen_reads_fp32_for_batches_and_bf16_for_few_rows() -> None:
    w, b = torch.ones(4, 16, dtype=torch.bfloat16), torch.ones(4, dtype=torch.bfloat16)
    lin = Linear(w, b, "widen")
    assert lin.wide is not None and lin.wide.dtype == torch.float32
    assert lin.wide_bias is not None and lin.wide_bias.dtype == torch.float32
    assert lin.skinny == HAVE_SKINNY
    few = SKINNY_ROWS if HAVE_SKINNY else WIDEN_MIN_ROWS
    assert lin.few_rows == few
    # Which copy a call reads: poison the bf16 one.
    w.fill_(float("nan"))
    assert lin(torch.ones(few, 16, dtype=torch.bfloat16)).isnan().all()
    assert torch.equal(
        lin(torch.ones(few + 1, 16, dtype=torch.bfloat16)),
        torch.full((few + 1, 4), 17.0, dtype=torch.bfloat16),
    )


@pytest.mark.skipif(not HAVE_SKINNY, reason="the C++ extension cannot be built here")
def test_few_rows_take_the_native_kernel_when_it_builds() -> None:
    w = torch.randn(8, 32).to(torch.bfloat16)
    assert Linear(w, None, "widen").skinny
    assert not Linear(w[:, :24].contiguous(), None, "widen").skinny  # K not a multiple of 16
    assert not Linear(w, None, "plain").skinny


@pytest.mark.skipif(not HAVE_SKINNY, reason="the C++ extension cannot be built here")
@pytest.mark.parametrize("rows", [1, 2, 4, 5, 7, 8, 9, 16])
def test_skinny_kernel_is_fp32_accumulation_rounded_once(rows: int) -> None:
    """Exactly the fp32 product rounded to bf16 except where summation order tips a rounding:
    then one bf16 ulp at most. Also a strided x and every row group (1-4 rows at a time)."""
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(300, 256, generator=g).to(torch.bfloat16)
    b = torch.randn(300, generator=g).to(torch.bfloat16)
    x = torch.randn(rows, 512, generator=g).to(torch.bfloat16)[:, ::2]
    y = kernels.skinny_linear(x.contiguous(), w, b)
    ref = (x.double() @ w.double().T + b.double()).float()
    exact = ref.to(torch.bfloat16)
    off = y != exact
    assert off.float().mean() < 0.01
    ulp = exact.float().abs() * 2**-7
    assert ((y.float() - ref).abs() <= ulp + 1e-6).all()


@pytest.mark.skipif(not HAVE_SKINNY, reason="the C++ extension cannot be built here")
def test_skinny_kernel_rejects_bad_shapes_by_name() -> None:
    w = torch.zeros(4, 32, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="rows"):
        kernels.skinny_linear(
            torch.zeros(kernels.SKINNY_MAX_ROWS + 1, 32, dtype=torch.bfloat16), w, None
        )
    with pytest.raises(RuntimeError, match="multiple of 16"):
        kernels.skinny_linear(
            torch.zeros(1, 24, dtype=torch.bfloat16), w[:, :24].contiguous(), None
        )
    with pytest.raises(RuntimeError, match="columns"):
        kernels.skinny_linear(torch.zeros(1, 16, dtype=torch.bfloat16), w, None)
    with pytest.raises(RuntimeError, match="bf16"):
        kernels.skinny_linear(torch.zeros(1, 32), w, None)
    with pytest.raises(RuntimeError, match="bf16 bias"):
        kernels.skinny_linear(torch.zeros(1, 32, dtype=torch.bfloat16), w, torch.zeros(4))
    with pytest.raises(RuntimeError, match="bias has 3 elements"):
        bias = torch.zeros(3, dtype=torch.bfloat16)
        kernels.skinny_linear(torch.zeros(1, 32, dtype=torch.bfloat16), w, bias)


def test_native_kernels_can_be_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(kernels.DISABLE_ENV, "0")
    kernels.load.cache_clear()
    try:
        assert kernels.load("skinny_linear") is None
        assert not Linear(torch.zeros(4, 16, dtype=torch.bfloat16), None, "widen").skinny
        with pytest.raises(ValueError, match="unknown kernel"):
            kernels.load("nope")
    finally:
        kernels.load.cache_clear()


def test_kernels_build_in_this_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Builds are cached per environment (two venvs sharing torch's default dir rebuilt each
    other's kernels on every start); TORCH_EXTENSIONS_DIR still wins when set."""
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    assert kernels.build_dir("skinny_linear") == Path(sys.prefix) / "tandem-kernels/skinny_linear"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert kernels.build_dir("skinny_linear") == tmp_path / "skinny_linear"
    assert (tmp_path / "skinny_linear").is_dir()
