"""Attention over a paged KV cache, for one flattened varlen batch.

The cache layout is engine/kv_layout.py's; one layer's K (or V) is
``[num_blocks, block_size, kv_heads, head_dim]``, and the token at position p of a sequence
sits in flat slot ``table[p // block_size] * block_size + p % block_size`` (the slot mapping of
engine/batch.py).

A block is one contiguous run of memory, so gathering a sequence's blocks is a row
``index_select`` (the fast path), and the result viewed as ``[kv_heads, ctx, head_dim]`` is a
strided tensor SDPA reads without another copy.

Rows of the batch are ordered decode-first: rows ``[0, num_decode)`` are single-token chunks
(decodes, or a fully cached prompt's last token); each prefill chunk follows as one run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine import kernels
from engine.kv_layout import int8_rows

Tensor = torch.Tensor


@dataclass
class PrefillSeq:
    """One multi-token chunk: query rows ``[row, row + num_tokens)``."""

    row: int
    num_tokens: int
    fresh: bool  # no earlier KV and no window cut: attend to this chunk's own K/V, plain causal
    blocks: Tensor  # [n] long: blocks holding the attended context, in position order
    ctx_len: int  # leading gathered slots that hold attended-or-masked context
    mask: Tensor | None  # [num_tokens, ctx_len] bool, True = attend; None when fresh


@dataclass
class AttentionMetadata:
    """Per-step indexing shared by every layer (built once by the model runner)."""

    slot_mapping: Tensor  # [T] long: where each token's new K/V is written
    num_decode: int
    decode_blocks: Tensor  # [num_decode, max_blocks] long, padded with block 0
    decode_mask: Tensor  # [num_decode, 1, 1, max_blocks * block_size] bool, True = attend
    # [2, num_decode * max_blocks, block_size, kv_heads, d]: reused gather target. A fresh
    # multi-MB tensor per layer costs page faults that rival the copy itself on CPU.
    decode_workspace: Tensor
    prefills: list[PrefillSeq]
    # [2, num_decode] long: table positions [start, end) each decode attends to. Set only when
    # the compiled CPU kernel (engine/kernels.py) runs the decodes instead of SDPA.
    decode_bounds: Tensor | None = None


def write_kv(layer_cache: Tensor, kv: Tensor, slots: Tensor) -> None:
    """Store ``kv`` ``[T, 2 * kv_heads, d]`` (K heads then V heads) at ``slots`` of one layer's
    ``[2, num_blocks, block_size, kv_heads, row]`` cache, K and V in one indexed copy (an int8
    cache's rows quantized first, engine/kv_layout.py)."""
    _, _, _, heads, row = layer_cache.shape
    ext = kernels.layer_ops(kv)
    if layer_cache.dtype == torch.int8:
        kv = int8_rows(kv)
    if ext is not None:  # a copy per token (index_copy_ cost 75 us a layer at 64 tokens)
        ext.write_kv(layer_cache, kv, slots)
        return
    src = kv.view(-1, 2, heads, row).transpose(0, 1)
    layer_cache.view(2, -1, heads, row).index_copy_(1, slots, src)


def _gather(cache: Tensor, blocks: Tensor) -> Tensor:
    """``[len(blocks) * block_size, kv_heads, d]``: the blocks' slots in table order."""
    _, _, heads, d = cache.shape
    return cache.index_select(0, blocks).view(-1, heads, d)


def decode_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata, scale: float
) -> Tensor:
    """Single-query attention for ``q`` ``[B, heads, d]``; returns ``[B, heads * d]``.

    Each sequence's K/V is gathered through its block table into a padded
    ``[B, kv_heads, L, d]`` view and all sequences go through ONE masked SDPA call: per-sequence
    SDPA calls with one query token cost most of a CPU decode step, and bf16 matmuls here
    would round the scores (SDPA keeps them in fp32, as transformers does). The GQA group is
    folded into the query-length dim (as transformers does for masked single-token decode):
    each K/V head is then read once for its whole group.
    """
    if meta.decode_bounds is not None:
        starts, ends = meta.decode_bounds
        return kernels.paged_decode_attention(
            q, k_cache, v_cache, meta.decode_blocks, starts, ends, scale
        )
    b, heads, d = q.shape
    kv_heads = k_cache.shape[2]
    flat = meta.decode_blocks.flatten()
    ws = meta.decode_workspace
    k = torch.index_select(k_cache, 0, flat, out=ws[0]).view(b, -1, kv_heads, d).transpose(1, 2)
    v = torch.index_select(v_cache, 0, flat, out=ws[1]).view(b, -1, kv_heads, d).transpose(1, 2)
    grouped = q.view(b, kv_heads, heads // kv_heads, d)
    out = F.scaled_dot_product_attention(grouped, k, v, attn_mask=meta.decode_mask, scale=scale)
    return out.reshape(b, heads * d)


def prefill_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    seq: PrefillSeq,
    scale: float,
) -> Tensor:
    """Causal attention of one chunk. ``q`` ``[n, heads, d]``; ``k``/``v`` ``[n, kv_heads, d]``
    are this chunk's fresh K/V (already in the cache). Returns ``[n, heads * d]``."""
    n, heads, d = q.shape
    if seq.fresh:
        keys, values = k, v
    else:
        keys = _gather(k_cache, seq.blocks)[: seq.ctx_len]
        values = _gather(v_cache, seq.blocks)[: seq.ctx_len]
    # 4-D inputs: with 3-D ones CPU SDPA takes another kernel and bf16 drifts from HF's.
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        keys.transpose(0, 1)[None],
        values.transpose(0, 1)[None],
        attn_mask=seq.mask,
        is_causal=seq.fresh,
        scale=scale,
        enable_gqa=heads != keys.shape[1],
    )
    return out[0].transpose(0, 1).reshape(n, heads * d)
