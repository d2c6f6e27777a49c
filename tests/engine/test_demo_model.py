"""Seeded demo checkpoints: shapes, determinism, shards, dtypes, and that transformers loads them."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from engine.demo_model import write_demo_checkpoint
from engine.tokenizer import Tokenizer

# Digests of the `test` llama float32 weights (names + raw bytes, sorted by name) and of its
# tokenizer.json. They pin "same args, same bytes on every machine"; a change here means every
# checkpoint built elsewhere changes too.
GOLDEN_TENSORS = "15522d9e778a80c2d31204faa201f9d516ebdfbe25b44b144b3811b8b7f205d8"
GOLDEN_TOKENIZER = "3b3f2f2611cda79fae511ccbd281f1a8ebf623996761a930673799b300001668"

DemoCkptFactory = Callable[..., Path]
FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
}


def config_of(ckpt: Path) -> dict[str, Any]:
    return json.loads((ckpt / "config.json").read_text())


def tensors_of(ckpt: Path) -> dict[str, torch.Tensor]:
    index = ckpt / "model.safetensors.index.json"
    if not index.exists():
        return load_file(ckpt / "model.safetensors")
    shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    return {k: v for shard in shards for k, v in load_file(ckpt / shard).items()}


def tensor_digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].numpy().tobytes())
    return h.hexdigest()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_test_size_shapes(demo_ckpt_factory: DemoCkptFactory, arch: str) -> None:
    ckpt = demo_ckpt_factory("test", arch)
    assert {p.name for p in ckpt.iterdir()} == FILES
    cfg = config_of(ckpt)
    arch_name = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}.get(arch)
    assert cfg["architectures"] == [arch_name or "MistralForCausalLM"]
    shape = {k: cfg[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads")}
    assert shape == {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
    assert (cfg["num_key_value_heads"], cfg["vocab_size"], cfg["dtype"]) == (2, 2048, "float32")
    assert cfg["tie_word_embeddings"] is True
    assert cfg["rope_theta"] == (1e6 if arch == "qwen2" else 1e4)
    assert cfg["rope_scaling"] is None and cfg["eos_token_id"] == [2, 6]
    assert json.loads((ckpt / "generation_config.json").read_text())["eos_token_id"] == [2, 6]
    assert Tokenizer(ckpt).vocab_size == 2048

    tensors = tensors_of(ckpt)
    assert "lm_head.weight" not in tensors  # tied to the embedding
    biases = {n for n in tensors if n.endswith("bias")}
    if arch == "qwen2":
        assert biases == {
            f"model.layers.{i}.self_attn.{p}_proj.bias" for i in (0, 1) for p in "qkv"
        }
        # Random, not zero, so a runner that drops them gives different logits.
        assert all(tensors[b].abs().min() > 0 for b in biases)
    else:
        assert biases == set()
    if arch == "mistral":
        assert cfg["sliding_window"] is None
    norm = tensors["model.norm.weight"]
    assert not torch.equal(norm, torch.ones_like(norm))


def test_tiny_shape(tiny_llama: Path) -> None:
    cfg = config_of(tiny_llama)
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"]) == (256, 4, 704)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (8, 4)
    assert cfg["vocab_size"] == Tokenizer(tiny_llama).vocab_size == 8192
    assert cfg["tie_word_embeddings"] is False
    tensors = tensors_of(tiny_llama)
    assert not torch.equal(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"])


def test_small_is_about_90m_params(tmp_path: Path) -> None:
    ckpt = write_demo_checkpoint(tmp_path, size="small")
    cfg = config_of(ckpt)
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"]) == (
        768,
        12,
        12,
    )
    assert (cfg["num_key_value_heads"], cfg["vocab_size"], cfg["dtype"]) == (4, 8192, "bfloat16")
    tensors = tensors_of(ckpt)
    assert sum(t.numel() for t in tensors.values()) == 88_099_584
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}


def test_same_args_same_bytes(test_llama: Path, tmp_path: Path) -> None:
    again = write_demo_checkpoint(tmp_path, size="test", architecture="llama", dtype="float32")
    assert tensor_digest(tensors_of(test_llama)) == tensor_digest(tensors_of(again))
    assert tensor_digest(tensors_of(again)) == GOLDEN_TENSORS
    tok_bytes = (again / "tokenizer.json").read_bytes()
    assert tok_bytes == (test_llama / "tokenizer.json").read_bytes()
    assert hashlib.sha256(tok_bytes).hexdigest() == GOLDEN_TOKENIZER


def test_other_seed_changes_every_tensor(test_llama: Path, tmp_path: Path) -> None:
    other = tensors_of(write_demo_checkpoint(tmp_path, size="test", dtype="float32", seed=1))
    base = tensors_of(test_llama)
    assert other.keys() == base.keys()
    assert not any(torch.equal(other[k], base[k]) for k in base)


def test_bfloat16_is_the_float32_init_cast(
    demo_ckpt_factory: DemoCkptFactory, test_qwen2: Path
) -> None:
    bf16 = tensors_of(demo_ckpt_factory("test", "qwen2", dtype="bfloat16"))
    fp32 = tensors_of(test_qwen2)
    assert all(torch.equal(bf16[k], fp32[k].to(torch.bfloat16)) for k in fp32)


def test_shards_hold_the_same_tensors(demo_ckpt_factory: DemoCkptFactory, test_llama: Path) -> None:
    sharded = demo_ckpt_factory("test", "llama", max_shard_size="200KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) >= 3 and all((sharded / s).is_file() for s in shards)
    assert not (sharded / "model.safetensors").exists()
    tensors, whole = tensors_of(sharded), tensors_of(test_llama)
    assert set(index["weight_map"]) == whole.keys()
    assert all(torch.equal(tensors[k], whole[k]) for k in whole)


def test_rope_scaling_and_sliding_window(demo_ckpt_factory: DemoCkptFactory) -> None:
    import transformers

    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 1024,
    }
    ckpt = demo_ckpt_factory("test", "llama", rope_scaling=scaling)
    cfg = config_of(ckpt)
    assert cfg["rope_scaling"] == scaling and cfg["rope_theta"] == 1e4
    assert cfg["rope_parameters"] == {**scaling, "rope_theta": 1e4}
    loaded = transformers.AutoConfig.from_pretrained(ckpt)
    assert loaded.rope_parameters["rope_type"] == "llama3"
    assert loaded.rope_parameters["factor"] == 8.0

    windowed = demo_ckpt_factory("test", "mistral", sliding_window=16)
    assert config_of(windowed)["sliding_window"] == 16
    assert transformers.AutoConfig.from_pretrained(windowed).sliding_window == 16
    with pytest.raises(ValueError, match="sliding_window"):
        write_demo_checkpoint(ckpt.parent / "never", size="test", sliding_window=16)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_transformers_runs_it_and_greedy_is_not_degenerate(
    demo_ckpt_factory: DemoCkptFactory, arch: str
) -> None:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(demo_ckpt_factory("test", arch))
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    ids = torch.from_numpy(np.random.default_rng(0).integers(0, 2048, size=(4, 64)))
    with torch.no_grad():
        logits = model(ids).logits
        out = model.generate(
            ids[:, :8], attention_mask=torch.ones(4, 8, dtype=torch.long),
            max_new_tokens=32, do_sample=False,
        )  # fmt: skip
    top2 = logits.topk(2, dim=-1).values
    rel_gap = (top2[..., 0] - top2[..., 1]) / top2[..., 0].abs()
    # Greedy ties would make exactness tests flaky; a collapsed output would make them blind.
    assert (rel_gap < 1e-3).float().mean() < 0.05
    assert all(len(set(row[8:].tolist())) >= 16 for row in out)
