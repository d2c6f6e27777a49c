"""Tandem's decoder forward (Llama / Qwen2 / Mistral) over a flattened varlen batch.

One call runs every scheduled token of every sequence: linear layers see all T tokens at
once, attention reads K/V through the block tables (engine/attention.py). Numerics follow
transformers so bf16 matches it: RMSNorm in fp32 then cast, rotary tables in fp32 cast to the
compute dtype, softmax in fp32.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from engine import kernels
from engine.attention import AttentionMetadata, decode_attention, prefill_attention, write_kv
from engine.config import ModelConfig
from engine.quantization import quantize_rows

Tensor = torch.Tensor


_MKLDNN_FP32 = torch.backends.mkldnn.is_available() and hasattr(
    torch.ops.mkldnn, "_reorder_linear_weight"
)
_MKLDNN_BF16 = _MKLDNN_FP32 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


LinearMode = Literal["invariant", "packed", "widen", "plain", "int8"]
# "widen" GEMMs of at most this many rows read the bf16 weight (see Linear); SKINNY_ROWS where
# the native kernel serves them (the measured crossover with the fp32 GEMM on the small model:
# per decode step 8 rows 34 / 45 ms, 12 rows 50 / 57, 16 rows 65 / 66).
WIDEN_MIN_ROWS = 4
SKINNY_ROWS = 12


def default_linear_mode(weight: Tensor, deterministic: bool = False) -> LinearMode:
    """The GEMM path for a weight on this machine (see :class:`Linear`): the batch-invariant
    kernel when ``deterministic``, else the fastest one."""
    if deterministic:
        return "invariant"
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16:
        return "plain"
    return "packed" if _MKLDNN_BF16 else "widen"


def invariant_layout(requested: str) -> str:
    """The batch-invariant GEMM's layout for a bf16 weight: ``auto`` is the fastest this CPU
    runs (:func:`engine.kernels.invariant_layouts`), a named one as asked (ValueError, naming
    the ones it does run, where this CPU cannot)."""
    here = kernels.invariant_layouts()
    if requested == "auto":
        return here[0]
    if requested not in here:
        raise ValueError(
            f"invariant_layout {requested!r} does not run on this CPU; it runs {', '.join(here)}"
        )
    return requested


class Linear:
    """``y = x W^T + b``: batch-invariant, or by the fastest GEMM this machine has.

    * ``invariant`` -- the deterministic default (engine/csrc/invariant_linear.cpp): each output
      element is reduced over K in one fixed order whatever the row count, the row's place in
      the batch or the thread count, so a token's activations do not depend on what shares its
      step. CPU, float32 or bfloat16 weights, packed once in a layout (``invariant_layout``):
      bf16 AMX tiles (``tiles``) or pairs for ``vdpbf16ps`` (``pairs``) where the CPU has
      them, else 16-column panels for AVX2 FMA (``columns``, an fp32 weight's always). The
      others are the ``deterministic: false`` paths (docs/benchmarks.md#determinism).
    * ``packed`` -- bf16 where oneDNN has native bf16 matmul (AVX512-BF16 / AMX): the weight is
      prepacked once into oneDNN's blocked layout. Plain ``F.linear`` re-packs it on every
      call, which costs more than the GEMM itself at decode batch sizes (same results, bit for
      bit). Measured on the small demo model (Xeon with AMX, 2 cores, 163 MB of linear weights
      per decode step): packed 6.9-7.5 ms per step, ``torch.mv`` 8.6, ``F.linear`` 11.3.
    * ``widen`` -- bf16 without it (AVX2-only CPUs): torch emulates bf16 GEMMs at ~18 GFLOP/s
      where fp32 runs at 110-170 (measured on a 2-core EPYC), so an fp32 copy of the weight
      serves batches over ``WIDEN_MIN_ROWS`` rows: bf16 inputs widen exactly, the sum
      accumulates in fp32 and the output is rounded to bf16 -- what a native bf16 GEMM
      computes, up to summation order. A few rows are memory-bound, and there the bf16 weight
      (half the bytes) wins: small model, one decode step, bf16 / fp32 weights: 1 row 9.9 / 24
      ms, 4 rows 34 / 43, 8 rows 66 / 57. Three times the bf16 weight memory in all. Where the
      native ``skinny_linear`` kernel builds (engine/kernels.py) it serves up to
      ``SKINNY_ROWS`` rows from the bf16 weight at memory bandwidth instead of torch's
      emulated bf16 GEMM (2.2x faster at one row, 5x at four).
    * ``plain`` -- anything else (fp32, CUDA): ``F.linear``.
    * ``int8`` -- W8A8 (engine/quantization.py, engine/csrc/int8_linear.cpp): the weight
      quantized per output channel, x per token and group of 64 k, int32 sums per group met in
      one fixed order -- invariant like ``invariant``, with half the bf16 weight bytes.
    """

    def __init__(
        self,
        weight: Tensor,
        bias: Tensor | None,
        mode: LinearMode | None = None,
        layout: str = "auto",
    ):
        self.mode = mode or default_linear_mode(weight)
        self.bias = bias
        self.weight: Tensor | None = weight
        self.packed: Tensor | None = None
        self.out_features = weight.shape[0]
        # The invariant kernel's layout (an fp32 weight has only the columns one).
        self.layout = "columns"
        if self.mode == "invariant":
            if weight.dtype == torch.bfloat16:
                self.layout = invariant_layout(layout)
            self.packed = kernels.pack_linear(weight, self.layout)
            self.weight = None
        self.int8: tuple[Tensor, Tensor, Tensor] | None = None  # packed, group offsets, scales
        if self.mode == "int8":
            q, scale = quantize_rows(weight)
            self.int8 = (*kernels.pack_int8(q), scale)
            self.weight = None
        if self.mode == "packed":
            # The second argument is the expected row count; it only tunes the layout.
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 64)
            self.weight = None  # the packed copy replaces it
        self.wide: Tensor | None = None
        self.wide_bias: Tensor | None = None
        if self.mode == "widen":
            # oneDNN's prepacked fp32 weight: ~15% faster than MKL's F.linear at 64 rows.
            self.wide = (
                torch.ops.mkldnn._reorder_linear_weight(weight.float(), 64)
                if _MKLDNN_FP32
                else weight.float()
            )
            self.wide_bias = None if bias is None else bias.float()
        # Few rows: the native kernel where it builds (and K fits its 16-wide chunks).
        self.skinny = (
            self.mode == "widen"
            and weight.shape[1] % 16 == 0
            and kernels.load("skinny_linear") is not None
        )
        self.few_rows = SKINNY_ROWS if self.skinny else WIDEN_MIN_ROWS

    def __call__(self, x: Tensor) -> Tensor:
        if self.int8 is not None:
            packed, offsets, scale = self.int8
            return kernels.int8_linear(x, packed, offsets, scale, self.out_features, self.bias)
        if self.mode == "invariant":
            assert self.packed is not None
            return kernels.invariant_linear(
                x, self.packed, self.out_features, self.bias, self.layout
            )
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        if self.wide is not None and x.shape[0] > self.few_rows:
            if self.wide.is_mkldnn:
                y = torch.ops.mkldnn._linear_pointwise(
                    x.float(), self.wide, self.wide_bias, "none", [], ""
                )
            else:
                y = F.linear(x.float(), self.wide, self.wide_bias)
            return y.to(x.dtype)
        assert self.weight is not None
        if self.skinny and x.shape[0] > 0:
            return kernels.skinny_linear(x.contiguous(), self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


@dataclass
class LayerWeights:
    """One decoder layer, with q/k/v and gate/up fused so each is a single GEMM."""

    input_norm: Tensor
    qkv: Linear
    o: Linear
    post_norm: Tensor
    gate_up: Linear
    down: Linear


def rope_inv_freq(config: ModelConfig) -> Tensor:
    """Inverse rotary frequencies (fp32), with Llama 3 or linear scaling as transformers does."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    # llama3: keep high frequencies, divide low ones by factor, interpolate in between.
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(angles: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos and sin of the rotary angles ``[T, head_dim / 2]``, each ``[T, 1, head_dim]`` in
    ``dtype``. On CPU the portable kernel's (engine/csrc/portable_math.cpp): PyTorch's cos and
    sin call MKL, whose last bits follow the CPU vendor."""
    both = kernels.portable_cos_sin(angles) if angles.device.type == "cpu" else None
    cos, sin = (angles.cos(), angles.sin()) if both is None else both
    return (
        torch.cat((cos, cos), dim=-1)[:, None, :].to(dtype),
        torch.cat((sin, sin), dim=-1)[:, None, :].to(dtype),
    )


def rms_norm(h: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None) -> Tensor:
    """RMSNorm of ``h`` ``[T, H]``, after ``h += residual`` in place when one is given (the
    decoder's residual stream). On CPU one pass of engine/csrc/layer_ops.cpp: the mean square
    summed in one fixed order, the same bits on every CPU; elsewhere PyTorch's ops, in fp32."""
    ext = kernels.layer_ops(h)
    if ext is not None:
        out: Tensor = ext.rms_norm(h, weight, eps, residual)
        return out
    if residual is not None:
        h.add_(residual)
    x = h.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(h.dtype)


def silu_mul(gate_up: Tensor) -> Tensor:
    """``SiLU(gate) * up`` of ``gate_up`` ``[T, 2I]`` (gate then up), each op rounded to the
    dtype; on CPU with the portable exp (engine/csrc/layer_ops.cpp)."""
    ext = kernels.layer_ops(gate_up)
    if ext is not None:
        out: Tensor = ext.silu_mul(gate_up)
        return out
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def apply_rotary_(qkv: Tensor, heads: int, cos: Tensor, sin: Tensor) -> None:
    """Rotate the first ``heads`` heads of ``qkv`` ``[T, heads_total, d]`` in place; ``cos`` /
    ``sin`` ``[T, 1, d]``.

    HF's rotate-half convention with its bf16 rounding (each product rounded, then the sum):
    the native kernel computes PyTorch's bits in one pass."""
    ext = kernels.layer_ops(qkv)
    if ext is not None:
        ext.rotary_(qkv, heads, cos, sin)
        return
    x = qkv[:, :heads]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    torch.add(x * cos, rotated * sin, out=x)


class DecoderModel:
    """Weights on ``device`` plus the forward; holds no per-request state."""

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, Tensor],
        device: torch.device,
        deterministic: bool = False,
        layout: str = "auto",
        quantization: str = "none",
    ):
        self.config = config
        self.quantization = quantization
        self.device = device
        c = config

        def get(name: str) -> Tensor:
            return weights[name].to(device=device, dtype=c.dtype)

        def fused(names: list[str]) -> Tensor:
            # A single tensor is used as is (no copy: it may be shared with the checkpoint).
            parts = [get(n) for n in names]
            return parts[0].contiguous() if len(parts) == 1 else torch.cat(parts)

        def linear(*prefixes: str) -> Linear:
            """One Linear from the named projections, fused along the output dim."""
            biases = [p + ".bias" for p in prefixes if p + ".bias" in weights]
            bias = fused(biases) if biases and len(biases) == len(prefixes) else None
            weight = fused([p + ".weight" for p in prefixes])
            mode = "int8" if quantization == "int8" else default_linear_mode(weight, deterministic)
            return Linear(weight, bias, mode, layout)

        self.embed = get("model.embed_tokens.weight")
        self.norm = get("model.norm.weight")
        head = self.embed if c.tie_word_embeddings else get("lm_head.weight")
        self.lm_head = Linear(head, None, default_linear_mode(head, deterministic), layout)
        self.layers: list[LayerWeights] = []
        for i in range(c.num_hidden_layers):
            a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
            self.layers.append(
                LayerWeights(
                    input_norm=get(f"model.layers.{i}.input_layernorm.weight"),
                    qkv=linear(a + "q_proj", a + "k_proj", a + "v_proj"),
                    o=linear(a + "o_proj"),
                    post_norm=get(f"model.layers.{i}.post_attention_layernorm.weight"),
                    gate_up=linear(m + "gate_proj", m + "up_proj"),
                    down=linear(m + "down_proj"),
                )
            )
        self.inv_freq = rope_inv_freq(c).to(device)
        self.scale = c.head_dim**-0.5

    @property
    def numerics(self) -> str:
        """This model's numerics class (docs/design.md#numerics-classes): what decides its
        bits. Engines of one class compute the same bits for the same tokens; ``fastest``
        (not deterministic) promises nothing across engines."""
        head = self.lm_head
        if head.mode != "invariant":
            return "fastest"
        dtype = str(self.config.dtype).removeprefix("torch.")
        weights = "int8" if self.quantization == "int8" else "invariant"
        return f"{dtype}/{weights}/{head.layout}"

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        meta: AttentionMetadata,
        kv_cache: Tensor,
        sample_rows: Tensor,
        layer_hook: Callable[[int], None] | None = None,
    ) -> Tensor:
        """Run all T tokens through the decoder, writing their K/V into ``kv_cache``
        (``layer_hook(layer)`` runs as soon as a layer's K/V is written).

        Args:
            input_ids, positions: ``[T]`` long, rows ordered as ``meta`` describes.
            kv_cache: the paged cache (engine/kv_layout.py).
            sample_rows: ``[S]`` long, rows whose next-token logits are wanted.
        Returns:
            ``[S, vocab]`` float32 logits.
        """
        c = self.config
        t = input_ids.shape[0]
        heads, kv_heads = c.num_attention_heads, c.num_key_value_heads
        cos, sin = rope_cos_sin(positions.float()[:, None] * self.inv_freq[None, :], c.dtype)

        h = F.embedding(input_ids, self.embed)
        residual: Tensor | None = None  # added to h by the next norm, in the same pass
        for layer, w in enumerate(self.layers):
            x = rms_norm(h, w.input_norm, c.rms_norm_eps, residual)
            # Heads side by side: [q heads | k heads | v heads], all views of one GEMM output.
            qkv = w.qkv(x).view(t, heads + 2 * kv_heads, c.head_dim)
            apply_rotary_(qkv, heads + kv_heads, cos, sin)  # q and k in one pass
            write_kv(kv_cache[layer], qkv[:, heads:], meta.slot_mapping)
            if layer_hook is not None:
                layer_hook(layer)
            q, k, v = qkv[:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
            k_cache, v_cache = kv_cache[layer, 0], kv_cache[layer, 1]
            attended = w.o(self._attention(q, k, v, k_cache, v_cache, meta))
            x = rms_norm(h, w.post_norm, c.rms_norm_eps, attended)
            residual = w.down(silu_mul(w.gate_up(x)))
        if residual is not None:
            h.add_(residual)
        x = rms_norm(h.index_select(0, sample_rows), self.norm, c.rms_norm_eps)
        return self.lm_head(x).float()

    def _attention(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        meta: AttentionMetadata,
    ) -> Tensor:
        nd = meta.num_decode
        if not meta.prefills:
            return decode_attention(q, k_cache, v_cache, meta, self.scale)
        out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
        if nd:
            out[:nd] = decode_attention(q[:nd], k_cache, v_cache, meta, self.scale)
        for seq in meta.prefills:
            rows = slice(seq.row, seq.row + seq.num_tokens)
            out[rows] = prefill_attention(
                q[rows], k[rows], v[rows], k_cache, v_cache, seq, self.scale
            )
        return out
