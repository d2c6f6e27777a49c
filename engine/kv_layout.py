"""The KV cache's layout: the one description of how the engine stores KV, which the model
runner allocates, the attention reads and a KV transfer ships block for block.

All layers' K and V live in one tensor, so a block copy or swap is one indexing op::

    kv_cache[layer, 0 = K | 1 = V, block, offset_in_block, kv_head, row]

A block is ``block_size`` consecutive token positions of one sequence (its block table maps
position // block_size to a block id). One layer of a set of blocks, as a transfer carries it,
is ``kv_cache[layer][:, block_ids]``: shape ``[2, n_blocks, block_size, kv_heads, row]``, a
row being ``head_dim`` values (int8: and a scale, below). Two caches can exchange blocks iff
their :class:`KVLayout` is equal.

An int8 cache (``kv_cache_dtype: int8``, docs/design.md#int8-kv) stores each token's head as
``head_dim`` int8 values followed by the 4 bytes of their fp32 scale, so its last dim is
``head_dim + 4`` and a block still carries everything needed to read it: block copies, swaps,
prefix hits and transfers move it as is. The scale is the head's largest magnitude / 127, taken
when the token's KV is written, so a token's bytes depend on that token alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.quantization import quantize_rows

if TYPE_CHECKING:
    from engine.config import ModelConfig

Tensor = torch.Tensor

# Cache dtypes, by the name a KV transfer uses on the wire.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int8": torch.int8,
}
# Bytes after each int8 row: its fp32 scale.
INT8_SCALE_BYTES = 4
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class LayoutMismatch(ValueError):
    """Two KV layouts (or a payload and a cache) differ; the message names the field."""


@dataclass(frozen=True)
class KVLayout:
    """The per-block geometry of a paged cache; two caches can exchange blocks iff equal."""

    num_layers: int
    block_size: int
    kv_heads: int
    head_dim: int
    dtype: str

    def __post_init__(self) -> None:
        for f in ("num_layers", "block_size", "kv_heads", "head_dim"):
            v = getattr(self, f)
            if type(v) is not int or v < 1:
                raise ValueError(f"KVLayout.{f} must be a positive int, got {v!r}")
        if type(self.dtype) is not str or self.dtype not in DTYPES:
            raise ValueError(f"KVLayout.dtype {self.dtype!r} is not one of {sorted(DTYPES)}")

    @classmethod
    def from_cache(cls, kv_cache: Tensor) -> KVLayout:
        """The layout of an engine cache ``[layers, 2, blocks, block_size, kv_heads, head_dim]``."""
        if kv_cache.dim() != 6 or kv_cache.shape[1] != 2:
            raise ValueError(
                f"kv_cache shape {tuple(kv_cache.shape)} is not "
                "[layers, 2, blocks, block_size, kv_heads, head_dim]"
            )
        if kv_cache.dtype not in _DTYPE_NAMES:
            raise ValueError(f"kv_cache dtype {kv_cache.dtype} is not one of {sorted(DTYPES)}")
        layers, _, _, block_size, heads, row = kv_cache.shape
        dtype = _DTYPE_NAMES[kv_cache.dtype]
        head_dim = row - INT8_SCALE_BYTES if dtype == "int8" else row
        return cls(layers, block_size, heads, head_dim, dtype)

    @classmethod
    def for_model(cls, model: ModelConfig, block_size: int, kv_cache_dtype: str) -> KVLayout:
        """The layout of ``model``'s cache: its compute dtype, or int8 (``kv_cache_dtype``)."""
        dtype = "int8" if kv_cache_dtype == "int8" else _DTYPE_NAMES[model.dtype]
        kv_heads, head_dim = model.num_key_value_heads, model.head_dim
        return cls(model.num_hidden_layers, block_size, kv_heads, head_dim, dtype)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def row_width(self) -> int:
        """Elements of one token's head: ``head_dim``, plus the scale's bytes when int8."""
        return self.head_dim + (INT8_SCALE_BYTES if self.dtype == "int8" else 0)

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block's K (or V) in one layer."""
        itemsize = torch.empty(0, dtype=self.torch_dtype).element_size()
        return self.block_size * self.kv_heads * self.row_width * itemsize

    @property
    def bytes_per_token(self) -> int:
        """Cache bytes one token takes, K and V of every layer (what the sizing divides by)."""
        return 2 * self.num_layers * self.block_nbytes // self.block_size

    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """The engine cache's shape for ``num_blocks`` blocks."""
        return (self.num_layers, *self.payload_shape(num_blocks))

    def payload_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (2, num_blocks, self.block_size, self.kv_heads, self.row_width)

    def layer_nbytes(self, num_blocks: int) -> int:
        return 2 * num_blocks * self.block_nbytes

    def check_compatible(self, other: KVLayout) -> None:
        """Raise :class:`LayoutMismatch` naming the first field that differs."""
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if mine != theirs:
                raise LayoutMismatch(f"KV layout field {f.name}: {mine!r} here, {theirs!r} peer")


def int8_rows(x: Tensor) -> Tensor:
    """``x`` ``[..., head_dim]`` as int8 cache rows ``[..., head_dim + 4]``: each row quantized
    symmetric by its own largest magnitude (engine/quantization.py's formula), its fp32 scale's
    bytes appended."""
    d = x.shape[-1]
    q, scale = quantize_rows(x.reshape(-1, d))
    rows = torch.cat((q, scale[:, None].view(torch.int8)), 1)
    return rows.view(*x.shape[:-1], d + INT8_SCALE_BYTES)


def extract_layer(kv_cache: Tensor, layer: int, block_ids: Sequence[int] | Tensor) -> Tensor:
    """``kv_cache[layer][:, block_ids]`` as a fresh contiguous tensor (one gather copy)."""
    if kv_cache.device.type == "cpu":
        ids = np.asarray(block_ids, dtype=np.int64)
        out = np.take(_block_rows(kv_cache, layer), ids, axis=1)
        flat = torch.from_numpy(out.reshape(-1))  # 1-D: reinterpretable even when empty
        return flat.view(kv_cache.dtype).view(2, len(ids), *kv_cache.shape[3:])
    ids_t = torch.as_tensor(block_ids, dtype=torch.long, device=kv_cache.device)
    return kv_cache[layer].index_select(1, ids_t)


def write_layer(
    kv_cache: Tensor, layer: int, block_ids: Sequence[int] | Tensor, payload: Tensor
) -> None:
    """Write a layer payload into ``block_ids`` of ``kv_cache`` (one scatter copy)."""
    n = len(block_ids)
    want = (2, n, *kv_cache.shape[3:])
    if tuple(payload.shape) != want or payload.dtype != kv_cache.dtype:
        raise LayoutMismatch(
            f"layer {layer} payload {tuple(payload.shape)} {payload.dtype} does not fit "
            f"{n} blocks of a {kv_cache.dtype} cache (want {want})"
        )
    if kv_cache.device.type == "cpu":
        rows = _block_rows(kv_cache, layer)
        rows[:, np.asarray(block_ids, dtype=np.int64)] = byte_view(payload).reshape(
            2, n, rows.shape[2]
        )
        return
    ids = torch.as_tensor(block_ids, dtype=torch.long, device=kv_cache.device)
    kv_cache[layer].index_copy_(1, ids, payload.to(kv_cache.device, non_blocking=True))


def _block_rows(kv_cache: Tensor, layer: int) -> np.ndarray:
    """``kv_cache[layer]`` as a ``[2, blocks, block bytes]`` uint8 array sharing its memory.

    On CPU the block gathers and scatters go through numpy: it moves each block as one memcpy,
    where torch's index_select / index_copy_ walk it element by element (measured 2.5x slower
    on the ``small`` layout, one thread)."""
    return kv_cache[layer].view(torch.uint8).numpy().reshape(2, kv_cache.shape[2], -1)


def byte_view(t: Tensor) -> np.ndarray:
    """The bytes of a (CPU-copied if needed) tensor as a flat uint8 array, without converting
    values: bf16 has no numpy dtype, and going through float would change the bits."""
    return t.detach().cpu().contiguous().view(torch.uint8).reshape(-1).numpy()
