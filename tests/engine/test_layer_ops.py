"""The decoder layer's small ops in one pass each (engine/csrc/layer_ops.cpp): RMSNorm after the
residual add, SiLU(gate) * up, RoPE, the K/V write.

Their bits must not depend on the CPU, the batch or the thread count (docs/design.md
#numerics-classes): each is replayed here op for op in float32 / float64 (elementwise IEEE
operations round the same on any CPU; the one reduction, RMSNorm's mean square, in its fixed
order), and the kernel must give exactly those bits. A build that fused a multiply-add, or a sum
in another order, fails the replay."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engine import kernels
from engine import model as decoder

Tensor = torch.Tensor
DTYPES = [torch.float32, torch.bfloat16]
EPS = 1e-6


@pytest.fixture(scope="module")
def ext():  # type: ignore[no-untyped-def]
    ext = kernels.load("layer_ops")
    if ext is None:
        pytest.skip("no C++ toolchain: the PyTorch path only")
    return ext


def rand(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def rounded(x: Tensor, dtype: torch.dtype) -> Tensor:
    """float32 ``x`` rounded to ``dtype`` and back: one op's rounding."""
    return x.to(dtype).float()


def replay_inv_rms(row: np.ndarray) -> np.float32:
    """1 / sqrt(mean(x^2) + eps) as the kernel defines it, in float32: each square rounded,
    element i into accumulator i % 16 (whole groups of 16, each summed in sequence), the rest
    into a tail, lane k + w added into lane k for w = 8, 4, 2, 1, then the tail."""
    sq = row.astype(np.float32) * row.astype(np.float32)
    body = len(sq) // 16 * 16
    acc = [
        np.cumsum(sq[k:body:16], dtype=np.float32)[-1] if body else np.float32(0) for k in range(16)
    ]
    tail = np.cumsum(sq[body:], dtype=np.float32)[-1] if body < len(sq) else np.float32(0)
    width = 8
    while width:
        acc = [acc[k] + acc[k + width] for k in range(width)]
        width //= 2
    mean = (acc[0] + tail) / np.float32(len(row))
    return np.float32(1) / np.sqrt(mean + np.float32(EPS))


def replay_rms_norm(h: Tensor, w: Tensor) -> Tensor:
    x = h.float()
    scales = torch.tensor([replay_inv_rms(r) for r in x.numpy()], dtype=torch.float32)
    return (w.float() * rounded(x * scales[:, None], h.dtype)).to(h.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [576, 768, 61])
def test_rms_norm_computes_the_replayed_bits(ext, dtype: torch.dtype, width: int) -> None:  # type: ignore[no-untyped-def]
    """Both ways: with the residual added first (its sum rounded as PyTorch's add, bit for bit),
    and alone; widths with and without a tail past the groups of 8, values over a wide range."""
    h = rand(37, width, dtype=dtype, seed=1, scale=30.0)
    residual = rand(37, width, dtype=dtype, seed=2)
    w = rand(width, dtype=dtype, seed=3)
    added = h + residual
    out = ext.rms_norm(h, w, EPS, residual)
    assert torch.equal(h, added)  # in place, PyTorch's rounding
    assert torch.equal(out, replay_rms_norm(added, w))
    assert torch.equal(ext.rms_norm(added.clone(), w, EPS, None), out)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_computes_the_replayed_bits(ext, dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
    """SiLU with the portable exp (PyTorch's division and add), rounded, times up, rounded; over
    values where exp overflows and underflows too."""
    gate_up = rand(21, 2 * 1536, dtype=dtype, seed=4, scale=12.0)
    gate_up[0, :4] = torch.tensor([100.0, -100.0, 0.0, -0.0]).to(dtype)
    gate, up = gate_up.float().chunk(2, dim=-1)
    exp = kernels.portable_exp(-gate.contiguous())
    assert exp is not None
    silu = rounded(gate / (1.0 + exp), dtype)
    assert torch.equal(ext.silu_mul(gate_up), (silu * up).to(dtype))
    # And within rounding of PyTorch's own silu.
    torch.testing.assert_close(
        ext.silu_mul(gate_up).float(), (F.silu(gate) * up).to(dtype).float(), rtol=1e-2, atol=1e-5
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_gives_pytorchs_bits(ext, dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
    """In place on the first heads of a q|k|v row, the rest untouched: PyTorch's bits exactly
    (each product rounded, then the sum)."""
    t, heads, total, d = 13, 12, 20, 64
    qkv = rand(t, total, d, dtype=dtype, seed=5)
    angles = torch.arange(t, dtype=torch.float32)[:, None] * torch.rand(d // 2) * 3
    cos, sin = decoder.rope_cos_sin(angles, dtype)
    want = qkv.clone()
    x = want[:, :heads]
    rotated = torch.cat((-x[..., d // 2 :], x[..., : d // 2]), dim=-1)
    torch.add(x * cos, rotated * sin, out=x)
    got = qkv.clone()
    ext.rotary_(got, heads, cos, sin)
    assert torch.equal(got, want)
    assert torch.equal(got[:, heads:], qkv[:, heads:])


def test_write_kv_lands_each_token_in_its_slot(ext) -> None:  # type: ignore[no-untyped-def]
    """K heads in the K half, V heads in the V half, at each token's slot; a strided q|k|v view
    as the forward hands it; other slots untouched; a slot outside the cache refused."""
    blocks, size, heads, d = 6, 4, 2, 8
    cache = torch.zeros(2, blocks, size, heads, d, dtype=torch.bfloat16)
    qkv = rand(5, 3 + 2 * heads, d, dtype=torch.bfloat16, seed=6)
    kv = qkv[:, 3:]
    slots = torch.tensor([17, 0, 23, 5, 9])
    ext.write_kv(cache, kv, slots)
    flat = cache.view(2, -1, heads, d)
    for t, s in enumerate(slots.tolist()):
        assert torch.equal(flat[0, s], kv[t, :heads]) and torch.equal(flat[1, s], kv[t, heads:])
    untouched = sorted(set(range(blocks * size)) - set(slots.tolist()))
    assert not flat[:, untouched].any()
    with pytest.raises(RuntimeError, match="slot 24 is outside the cache's 24"):
        ext.write_kv(cache, kv[:1], torch.tensor([24]))


@pytest.mark.parametrize(
    "op",
    [
        lambda x: decoder.rms_norm(x[:, :768].contiguous(), torch.ones(768, dtype=x.dtype), EPS),
        lambda x: decoder.silu_mul(x),
    ],
    ids=["rms_norm", "silu_mul"],
)
def test_a_rows_bits_do_not_depend_on_the_batch_or_the_threads(
    ext, op: Callable[[Tensor], Tensor]
) -> None:  # type: ignore[no-untyped-def]
    """A row computed alone, in a batch of 70 (several threads' tasks) and on 1 or 3 threads."""
    x = rand(70, 1536, dtype=torch.bfloat16, seed=7, scale=4.0)
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 3):
            torch.set_num_threads(threads)
            outs.append(op(x))
            outs.append(torch.cat([op(x[i : i + 1]) for i in range(70)]))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(o, outs[0]) for o in outs)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_pytorch_path_agrees_within_rounding(
    ext, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    """Without the kernel (CUDA, float16, no compiler) engine/model.py computes the same ops in
    PyTorch: the same residual sum bit for bit, the norm and SiLU within a rounding."""
    h = rand(9, 768, dtype=dtype, seed=8, scale=3.0)
    residual = rand(9, 768, dtype=dtype, seed=9)
    w = rand(768, dtype=dtype, seed=10)
    gate_up = rand(9, 1024, dtype=dtype, seed=11, scale=3.0)
    native_h = h.clone()
    native = (decoder.rms_norm(native_h, w, EPS, residual), decoder.silu_mul(gate_up))
    monkeypatch.setattr(kernels, "layer_ops", lambda x: None)
    plain_h = h.clone()
    plain = (decoder.rms_norm(plain_h, w, EPS, residual), decoder.silu_mul(gate_up))
    assert torch.equal(native_h, plain_h)
    tol = {"rtol": 1.6e-2, "atol": 1e-5} if dtype == torch.bfloat16 else {}
    for a, b in zip(native, plain, strict=True):
        torch.testing.assert_close(a, b, **tol)


def test_float16_and_cuda_are_left_to_pytorch() -> None:
    assert kernels.layer_ops(torch.zeros(2, dtype=torch.float16)) is None
    assert kernels.layer_ops(torch.zeros(2, device="meta")) is None
