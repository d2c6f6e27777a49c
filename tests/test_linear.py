"""The GEMM paths of engine.model.Linear: each computes a bf16 GEMM as fp32 accumulation rounded
to bf16, and a bf16 weight on CPU never takes torch's emulated bf16 GEMM."""

from __future__ import annotations

import pytest
import torch

from engine.model import _MKLDNN_BF16, WIDEN_MIN_ROWS, Linear, LinearMode, default_linear_mode


def test_default_mode_avoids_emulated_bf16_gemm() -> None:
    bf16 = torch.zeros(8, 8, dtype=torch.bfloat16)
    assert default_linear_mode(bf16) == ("packed" if _MKLDNN_BF16 else "widen")
    assert default_linear_mode(bf16.float()) == "plain"


MODES: list[LinearMode] = ["widen", "plain"] + (["packed"] if _MKLDNN_BF16 else [])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("rows", [1, 4, 5, 64])
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
    w, b = torch.ones(4, 4, dtype=torch.bfloat16), torch.ones(4, dtype=torch.bfloat16)
    lin = Linear(w, b, "widen")
    assert lin.wide is not None and lin.wide.dtype == torch.float32
    assert lin.wide_bias is not None and lin.wide_bias.dtype == torch.float32
    # Which copy a call reads: poison the bf16 one.
    w.fill_(float("nan"))
    assert lin(torch.ones(WIDEN_MIN_ROWS, 4, dtype=torch.bfloat16)).isnan().all()
    assert torch.equal(
        lin(torch.ones(WIDEN_MIN_ROWS + 1, 4, dtype=torch.bfloat16)),
        torch.full((WIDEN_MIN_ROWS + 1, 4), 5.0, dtype=torch.bfloat16),
    )
