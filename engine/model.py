"""Tandem's decoder forward (Llama / Qwen2 / Mistral) over a flattened varlen batch.

One call runs every scheduled token of every sequence: linear layers see all T tokens at
once, attention reads K/V through the block tables (engine/attention.py). Numerics follow
transformers so bf16 matches it: RMSNorm in fp32 then cast, rotary tables in fp32 cast to the
compute dtype, softmax in fp32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention import AttentionMetadata, decode_attention, prefill_attention, write_kv
from engine.config import ModelConfig

Tensor = torch.Tensor


@dataclass
class LayerWeights:
    """One decoder layer, with q/k/v and gate/up fused so each is a single GEMM."""

    input_norm: Tensor
    qkv: Tensor
    qkv_bias: Tensor | None
    o: Tensor
    o_bias: Tensor | None
    post_norm: Tensor
    gate_up: Tensor
    gate_up_bias: Tensor | None
    down: Tensor
    down_bias: Tensor | None


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


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``x`` ``[T, heads, d]``; ``cos``/``sin`` ``[T, 1, d]`` (HF's rotate-half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class DecoderModel:
    """Weights on ``device`` plus the forward; holds no per-request state."""

    def __init__(self, config: ModelConfig, weights: dict[str, Tensor], device: torch.device):
        self.config = config
        self.device = device
        c = config

        def get(name: str) -> Tensor:
            return weights[name].to(device=device, dtype=c.dtype)

        def opt(name: str) -> Tensor | None:
            return get(name) if name in weights else None

        def fuse(*names: str) -> Tensor | None:
            parts = [opt(n) for n in names]
            if any(p is None for p in parts):
                return None
            return torch.cat([p for p in parts if p is not None]).contiguous()

        self.embed = get("model.embed_tokens.weight")
        self.norm = get("model.norm.weight")
        self.lm_head = self.embed if c.tie_word_embeddings else get("lm_head.weight")
        self.layers: list[LayerWeights] = []
        for i in range(c.num_hidden_layers):
            a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
            qkv = fuse(a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight")
            gate_up = fuse(m + "gate_proj.weight", m + "up_proj.weight")
            assert qkv is not None and gate_up is not None  # the loader checked the names
            self.layers.append(
                LayerWeights(
                    input_norm=get(f"model.layers.{i}.input_layernorm.weight"),
                    qkv=qkv,
                    qkv_bias=fuse(a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"),
                    o=get(a + "o_proj.weight"),
                    o_bias=opt(a + "o_proj.bias"),
                    post_norm=get(f"model.layers.{i}.post_attention_layernorm.weight"),
                    gate_up=gate_up,
                    gate_up_bias=fuse(m + "gate_proj.bias", m + "up_proj.bias"),
                    down=get(m + "down_proj.weight"),
                    down_bias=opt(m + "down_proj.bias"),
                )
            )
        self.inv_freq = rope_inv_freq(c).to(device)
        self.scale = c.head_dim**-0.5

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        meta: AttentionMetadata,
        kv_cache: Tensor,
        sample_rows: Tensor,
    ) -> Tensor:
        """Run all T tokens through the decoder, writing their K/V into ``kv_cache``.

        Args:
            input_ids, positions: ``[T]`` long, rows ordered as ``meta`` describes.
            kv_cache: ``[layers, 2, num_blocks, block_size, kv_heads, head_dim]``.
            sample_rows: ``[S]`` long, rows whose next-token logits are wanted.
        Returns:
            ``[S, vocab]`` float32 logits.
        """
        c = self.config
        t = input_ids.shape[0]
        q_size = c.num_attention_heads * c.head_dim
        kv_size = c.num_key_value_heads * c.head_dim
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        cos, sin = emb.cos().to(c.dtype), emb.sin().to(c.dtype)

        h = F.embedding(input_ids, self.embed)
        for layer, w in enumerate(self.layers):
            x = rms_norm(h, w.input_norm, c.rms_norm_eps)
            qkv = F.linear(x, w.qkv, w.qkv_bias)
            q = qkv[:, :q_size].view(t, c.num_attention_heads, c.head_dim)
            k = qkv[:, q_size : q_size + kv_size].view(t, c.num_key_value_heads, c.head_dim)
            v = qkv[:, q_size + kv_size :].view(t, c.num_key_value_heads, c.head_dim)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            k_cache, v_cache = kv_cache[layer, 0], kv_cache[layer, 1]
            write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
            h = h + F.linear(self._attention(q, k, v, k_cache, v_cache, meta), w.o, w.o_bias)
            x = rms_norm(h, w.post_norm, c.rms_norm_eps)
            gate, up = F.linear(x, w.gate_up, w.gate_up_bias).chunk(2, dim=-1)
            h = h + F.linear(F.silu(gate) * up, w.down, w.down_bias)
        x = rms_norm(h.index_select(0, sample_rows), self.norm, c.rms_norm_eps)
        return F.linear(x, self.lm_head).float()

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
