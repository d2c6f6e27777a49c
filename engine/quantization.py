"""int8 weights (W8A8, docs/design.md#quantization): each linear layer's weight quantized once at
load, symmetric per output channel, ``w[n, k] ~ q[n, k] * scale[n]`` with ``q`` in [-127, 127];
the activations are quantized per token and group of :data:`GROUP` k when the layer runs
(engine/csrc/int8_linear.cpp), each group's products summed in int32 and the groups in fp32 in
one order -- so the output does not depend on the batch, the thread count or the instruction
set."""

from __future__ import annotations

import torch

Tensor = torch.Tensor
GROUP = 64  # k per activation scale (the kernel's kGroup)


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """Each row of ``x`` ``[R, K]`` as int8 ``q`` and its fp32 ``scale`` ``[R]`` =
    ``max|row| / 127``: ``q = round-half-even(x * (127 / max|row|))`` (a zero row: all 0, scale
    0) -- the kernel's formula for activations, element by element in fp32."""
    xf = x.float()
    amax = xf.abs().amax(dim=1)
    # Divisions tensor by tensor: PyTorch turns a division by (or of) a Python number into a
    # multiplication by its reciprocal, which rounds differently from the kernel's division.
    full = torch.full_like(amax, 127.0)
    scale = amax / full
    inv = torch.where(amax > 0, full / torch.where(amax > 0, amax, full), 0.0)
    q = torch.round(xf * inv[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def quantize_groups(x: Tensor, group: int = GROUP) -> tuple[Tensor, Tensor]:
    """Each row of ``x`` ``[R, K]`` quantized as :func:`quantize_rows` does a row, group of
    ``group`` columns by group: int8 ``q`` ``[R, K]`` and fp32 scales ``[R, ceil(K / group)]``."""
    parts = [quantize_rows(x[:, k : k + group]) for k in range(0, x.shape[1], group)]
    return torch.cat([q for q, _ in parts], 1), torch.stack([s for _, s in parts], 1)
