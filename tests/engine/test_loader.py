"""Checkpoint loading: config fields, dtypes, shards, tied embeddings and the errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.config import SUPPORTED_ARCHITECTURES
from engine.loader import CheckpointError, load_checkpoint, required_tensor_names


def copy_ckpt(src: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(src, tmp_path / "ckpt"))


def edit_json(file: Path, **changes: Any) -> None:
    data = json.loads(file.read_text())
    data.update(changes)
    file.write_text(json.dumps(data))


def test_fp32_auto_reads_every_config_field(test_llama: Path) -> None:
    ckpt = load_checkpoint(test_llama)
    c = ckpt.config
    assert ckpt.path == test_llama
    assert c.architecture == "LlamaForCausalLM"
    assert (c.vocab_size, c.hidden_size, c.intermediate_size) == (2048, 64, 192)
    assert (c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (
        2,
        4,
        2,
        16,
    )
    assert (c.max_position_embeddings, c.rms_norm_eps, c.rope_theta) == (4096, 1e-6, 10000.0)
    assert c.rope_scaling is None and c.sliding_window is None
    assert not c.attention_bias and not c.mlp_bias
    assert c.tie_word_embeddings and "lm_head.weight" not in ckpt.weights
    assert c.dtype == torch.float32
    gen = json.loads((test_llama / "generation_config.json").read_text())
    assert c.eos_token_ids == tuple(sorted(gen["eos_token_id"])) and len(c.eos_token_ids) == 2
    assert c.bos_token_id == gen["bos_token_id"]
    on_disk = load_file(str(test_llama / "model.safetensors"))
    assert ckpt.weights.keys() == on_disk.keys()
    assert set(required_tensor_names(c)) == set(on_disk)
    for name, t in on_disk.items():
        assert torch.equal(ckpt.weights[name], t), name


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_config_agrees_with_transformers(arch: str, demo_ckpt_factory: Any) -> None:
    import transformers

    path = demo_ckpt_factory("test", arch)
    ours = load_checkpoint(path).config
    ref = transformers.AutoConfig.from_pretrained(path)
    assert ours.architecture == ref.architectures[0]
    for field in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "max_position_embeddings",
        "rms_norm_eps",
        "tie_word_embeddings",
    ):
        assert getattr(ours, field) == getattr(ref, field), field
    ref_head_dim = getattr(ref, "head_dim", None) or ref.hidden_size // ref.num_attention_heads
    assert ours.head_dim == ref_head_dim
    assert ours.rope_theta == ref.rope_parameters["rope_theta"]
    assert ours.attention_bias == (arch == "qwen2")
    assert ("model.layers.0.self_attn.q_proj.bias" in load_checkpoint(path).weights) == (
        arch == "qwen2"
    )


def test_qwen2_rope_theta_and_mistral_window(demo_ckpt_factory: Any) -> None:
    assert load_checkpoint(demo_ckpt_factory("test", "qwen2")).config.rope_theta == 1e6
    windowed = load_checkpoint(demo_ckpt_factory("test", "mistral", sliding_window=24))
    assert windowed.config.sliding_window == 24
    assert load_checkpoint(demo_ckpt_factory("test", "mistral")).config.sliding_window is None


def test_llama3_rope_scaling_is_read(demo_ckpt_factory: Any) -> None:
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    c = load_checkpoint(demo_ckpt_factory("test", "llama", rope_scaling=scaling)).config
    assert c.rope_scaling is not None
    assert {k: c.rope_scaling[k] for k in scaling} == scaling
    assert c.rope_theta == 10000.0


def test_explicit_dtype_casts(test_llama: Path, demo_ckpt_factory: Any) -> None:
    fp32 = load_checkpoint(test_llama)
    bf16 = load_checkpoint(test_llama, dtype="bfloat16")
    assert bf16.config.dtype == torch.bfloat16
    for name, t in fp32.weights.items():
        assert bf16.weights[name].dtype == torch.bfloat16
        assert torch.equal(bf16.weights[name], t.to(torch.bfloat16)), name
    stored_bf16 = demo_ckpt_factory("test", "llama", dtype="bfloat16")
    auto = load_checkpoint(stored_bf16)
    assert auto.config.dtype == torch.bfloat16
    assert all(t.dtype == torch.bfloat16 for t in auto.weights.values())
    up = load_checkpoint(stored_bf16, dtype="float32")
    assert up.config.dtype == torch.float32
    assert torch.equal(up.weights["model.norm.weight"], auto.weights["model.norm.weight"].float())


def test_float16_needs_cuda(test_llama: Path) -> None:
    with pytest.raises(CheckpointError, match="float16 is only supported on CUDA"):
        load_checkpoint(test_llama, dtype="float16", device="cpu")
    with pytest.raises(CheckpointError, match="float64"):
        load_checkpoint(test_llama, dtype="float64")


def test_sharded_checkpoint_equals_single_file(test_llama: Path, demo_ckpt_factory: Any) -> None:
    sharded = demo_ckpt_factory("test", "llama", max_shard_size="100KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not (sharded / "model.safetensors").exists()
    ours, single = load_checkpoint(sharded).weights, load_checkpoint(test_llama).weights
    assert ours.keys() == single.keys()
    for name in single:
        assert torch.equal(ours[name], single[name]), name


def test_untied_checkpoint_has_lm_head(tiny_llama: Path) -> None:
    ckpt = load_checkpoint(tiny_llama)
    assert not ckpt.config.tie_word_embeddings
    head = ckpt.weights["lm_head.weight"]
    assert head.shape == (8192, 256)
    assert not torch.equal(head, ckpt.weights["model.embed_tokens.weight"])


def test_unsupported_architecture_names_it_and_the_supported(
    test_llama: Path, tmp_path: Path
) -> None:
    path = copy_ckpt(test_llama, tmp_path)
    edit_json(path / "config.json", architectures=["GPT2LMHeadModel"])
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(path)
    assert "GPT2LMHeadModel" in str(e.value)
    assert all(a in str(e.value) for a in SUPPORTED_ARCHITECTURES)


@pytest.mark.parametrize("missing", ["config.json", "model.safetensors"])
def test_missing_file_is_named(missing: str, test_llama: Path, tmp_path: Path) -> None:
    path = copy_ckpt(test_llama, tmp_path)
    (path / missing).unlink()
    with pytest.raises(CheckpointError, match=missing):
        load_checkpoint(path)


def test_missing_shard_is_named(demo_ckpt_factory: Any, tmp_path: Path) -> None:
    path = copy_ckpt(demo_ckpt_factory("test", "llama", max_shard_size="100KB"), tmp_path)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    (path / shard).unlink()
    with pytest.raises(CheckpointError, match=shard):
        load_checkpoint(path)


@pytest.mark.parametrize(
    "tensor", ["model.layers.1.mlp.down_proj.weight", "lm_head.weight", "model.norm.weight"]
)
def test_missing_tensor_is_named(tensor: str, tiny_llama: Path, tmp_path: Path) -> None:
    path = copy_ckpt(tiny_llama, tmp_path)
    weights = load_file(str(path / "model.safetensors"))
    del weights[tensor]
    save_file(weights, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=tensor.replace(".", r"\.")):
        load_checkpoint(path)


def test_eos_from_generation_config_int_or_list(test_llama: Path, tmp_path: Path) -> None:
    path = copy_ckpt(test_llama, tmp_path)
    edit_json(path / "generation_config.json", eos_token_id=7)
    assert load_checkpoint(path).config.eos_token_ids == (7,)
    edit_json(path / "generation_config.json", eos_token_id=[9, 4])
    assert load_checkpoint(path).config.eos_token_ids == (4, 9)
    (path / "generation_config.json").unlink()
    edit_json(path / "config.json", eos_token_id=3)
    assert load_checkpoint(path).config.eos_token_ids == (3,)


def test_unsupported_rope_type_and_activation(test_llama: Path, tmp_path: Path) -> None:
    path = copy_ckpt(test_llama, tmp_path)
    edit_json(path / "config.json", rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(CheckpointError, match="yarn"):
        load_checkpoint(path)
    edit_json(path / "config.json", rope_scaling=None, hidden_act="gelu")
    with pytest.raises(CheckpointError, match="gelu"):
        load_checkpoint(path)
