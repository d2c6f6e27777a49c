"""Read a Hugging Face checkpoint directory into a :class:`ModelConfig` and a tensor dict.

Only what Tandem's own forward needs: ``config.json``, the safetensors weights (one file, or
shards listed in ``model.safetensors.index.json``) and the EOS ids of ``generation_config.json``.
transformers is never imported here (it costs seconds to import).
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tqdm import tqdm

from engine.config import SUPPORTED_ARCHITECTURES, ModelConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_ROPE_TYPES = ("default", "linear", "llama3")


class CheckpointError(ValueError):
    """The checkpoint cannot be served; the message names the file, tensor or field at fault."""


@dataclass
class LoadedCheckpoint:
    """A checkpoint read into memory: tensors keep their Hugging Face names."""

    config: ModelConfig
    weights: dict[str, torch.Tensor]
    path: Path


def load_checkpoint(
    path: str | Path, dtype: str = "auto", device: torch.device | str = "cpu"
) -> LoadedCheckpoint:
    """Load ``path`` onto ``device``, cast to ``dtype`` ("auto" keeps the checkpoint's).

    Raises:
        CheckpointError: a missing file or tensor, an unsupported architecture, rope type or
            activation, or float16 asked for on a CPU.
    """
    root = Path(path)
    device = torch.device(device)
    raw = _read_json(root / "config.json")
    target = _resolve_dtype(raw, dtype, device)
    config = _model_config(raw, _eos_ids(root, raw), target)
    weights = _read_weights(root, target, device)
    for name in required_tensor_names(config):
        if name not in weights:
            raise CheckpointError(f"{root}: tensor {name!r} is missing from the checkpoint")
    return LoadedCheckpoint(config=config, weights=weights, path=root)


def read_model_config(path: str | Path, dtype: str = "auto") -> tuple[ModelConfig, int]:
    """The checkpoint's shape (as ``load_checkpoint`` reads it, on a CPU) and the bytes its
    weights take once cast to ``dtype``, without loading them: what sizing a worker's KV
    cache needs."""
    root = Path(path)
    raw = _read_json(root / "config.json")
    target = _resolve_dtype(raw, dtype, torch.device("cpu"))
    config = _model_config(raw, _eos_ids(root, raw), target)
    element = torch.tensor([], dtype=target).element_size()
    numel = 0
    for file in _weight_files(root):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                numel += math.prod(f.get_slice(name).get_shape())
    return config, numel * element


def required_tensor_names(config: ModelConfig) -> list[str]:
    """The Hugging Face tensor names the forward reads, in load order."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    # Qwen2 biases q/k/v only; Llama's attention_bias covers o_proj too.
    o_bias = config.attention_bias and config.architecture != "Qwen2ForCausalLM"
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            names.append(f"{p}self_attn.{proj}.weight")
            if config.attention_bias and (proj != "o_proj" or o_bias):
                names.append(f"{p}self_attn.{proj}.bias")
        for proj in ("gate_proj", "up_proj", "down_proj"):
            names.append(f"{p}mlp.{proj}.weight")
            if config.mlp_bias:
                names.append(f"{p}mlp.{proj}.bias")
    return names


def _read_json(file: Path) -> dict[str, Any]:
    if not file.is_file():
        raise CheckpointError(f"{file} not found")
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{file}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{file}: expected a JSON object")
    return data


def _resolve_dtype(raw: dict[str, Any], dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        # transformers 5 writes "dtype"; older checkpoints "torch_dtype".
        name = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    else:
        name = dtype
    if name not in _DTYPES:
        raise CheckpointError(f"dtype {name!r} is not supported (choose from {list(_DTYPES)})")
    if name == "float16" and device.type != "cuda":
        raise CheckpointError(
            "float16 is only supported on CUDA; on CPU pass dtype='bfloat16' or 'float32'"
        )
    return _DTYPES[name]


def _eos_ids(root: Path, raw: dict[str, Any]) -> tuple[int, ...]:
    gen_file = root / "generation_config.json"
    eos = raw.get("eos_token_id")
    if gen_file.is_file():
        eos = _read_json(gen_file).get("eos_token_id", eos)
    if eos is None:
        return ()
    return tuple(sorted({int(e) for e in eos})) if isinstance(eos, list) else (int(eos),)


def _rope(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either the old or the transformers 5 ``rope_parameters`` form."""
    params = dict(raw.get("rope_parameters") or {})
    theta = float(raw.get("rope_theta") or params.pop("rope_theta", None) or 10000.0)
    params.pop("rope_theta", None)
    scaling = raw.get("rope_scaling") or params or None
    if scaling is not None:
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type not in _ROPE_TYPES:
            raise CheckpointError(
                f"rope_type {rope_type!r} is not supported (choose from {_ROPE_TYPES})"
            )
        scaling = None if rope_type == "default" else {**scaling, "rope_type": rope_type}
    return theta, scaling


def _sliding_window(raw: dict[str, Any], arch: str) -> int | None:
    window = raw.get("sliding_window")
    if arch == "LlamaForCausalLM" or window is None:
        return None
    if arch == "Qwen2ForCausalLM":
        if not raw.get("use_sliding_window", False):
            return None
        # Qwen2 windows only the layers from max_window_layers on, but the forward supports
        # one window for all layers (or none).
        first = int(raw.get("max_window_layers", 28))
        if first >= int(raw["num_hidden_layers"]):
            return None
        if first > 0:
            raise CheckpointError("Qwen2 sliding window on a subset of layers is not supported")
    return int(window)


def _model_config(raw: dict[str, Any], eos: tuple[int, ...], dtype: torch.dtype) -> ModelConfig:
    archs = raw.get("architectures") or []
    arch = archs[0] if archs else "<none>"
    if arch not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(
            f"architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    if raw.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"hidden_act {raw['hidden_act']!r} is not supported (only 'silu')")
    try:
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        theta, scaling = _rope(raw)
        return ModelConfig(
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            attention_bias=arch == "Qwen2ForCausalLM" or bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            sliding_window=_sliding_window(raw, arch),
            dtype=dtype,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos,
        )
    except KeyError as e:
        raise CheckpointError(f"config.json: field {e.args[0]!r} is missing") from e


def _weight_files(root: Path) -> list[Path]:
    index = root / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(_read_json(index).get("weight_map", {}).values()))
        if not shards:
            raise CheckpointError(f"{index}: empty weight_map")
        files = [root / s for s in shards]
    else:
        files = [root / "model.safetensors"]
    for f in files:
        if not f.is_file():
            raise CheckpointError(f"{f} not found")
    return files


def _read_weights(root: Path, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = {}
    files = _weight_files(root)
    for file in tqdm(files, desc="loading shards", unit="shard", file=sys.stderr, leave=False):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                if t.is_floating_point():
                    t = t.to(dtype)
                weights[name] = t.to(device)
    return weights
