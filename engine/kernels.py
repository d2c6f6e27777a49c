"""Native CPU kernels, compiled on first use with ``torch.utils.cpp_extension.load_inline``.

The build lands in torch's extensions dir (``TORCH_EXTENSIONS_DIR``, default
``~/.cache/torch_extensions``) keyed by a hash of the source and flags, so only the first process
on a machine pays the compile. Where no compiler (or no OpenMP) exists, :func:`load` returns None,
logs why once, and callers keep the pure-PyTorch path.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from types import ModuleType

import torch

Tensor = torch.Tensor

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).resolve().parent / "csrc" / "paged_decode_attention.cpp"
# ISO C++ mode turns FMA contraction off (the plain-loop fallback wants it); math-errno off keeps
# the fallback's std::exp free of errno stores.
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=fast", "-fno-math-errno"]


@functools.cache
def load() -> ModuleType | None:
    """The compiled extension, or None when it cannot be built here (reason logged once)."""
    try:
        from torch.utils.cpp_extension import load_inline

        return load_inline(
            name="tandem_paged_decode_attention",
            cpp_sources=[_SOURCE.read_text()],
            functions=["paged_decode_attention"],
            extra_cflags=_FLAGS,
            extra_ldflags=["-fopenmp"],
        )
    except Exception as exc:  # no compiler, no OpenMP, no headers: all mean "use SDPA"
        log.warning("CPU decode-attention kernel unavailable, using SDPA: %s", exc)
        return None


def paged_decode_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    tables: Tensor,
    starts: Tensor,
    ends: Tensor,
    scale: float,
) -> Tensor:
    """Decode attention read in place from the paged cache; returns ``[B, heads * d]``.

    ``q`` ``[B, heads, d]``; caches ``[num_blocks, block_size, kv_heads, d]`` (q's dtype,
    float32 or bfloat16); ``tables`` ``[B, W]`` long; sequence ``b`` attends to the keys at table
    positions ``[starts[b], ends[b])`` (position ``p`` is slot ``p % block_size`` of block
    ``tables[b, p // block_size]``). Block ids are trusted: the runner validates them.
    """
    ext = load()
    if ext is None:
        raise RuntimeError("the paged decode-attention extension is not available")
    out: Tensor = ext.paged_decode_attention(q, k_cache, v_cache, tables, starts, ends, scale)
    return out
