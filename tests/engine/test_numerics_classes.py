"""Numerics classes (docs/design.md#numerics-classes): what decides an engine's bits is named,
the router keeps every request within one class (tests/router/test_router.py), and the
portable layout gives the same bits on every CPU family -- checked here against bits recorded
on another machine (``data/portable_numerics.json``: an AVX2-only AMD EPYC). Run where the CPU
has AVX512-BF16, this compares the portable layout there with the AVX2 machine's; the
default layout there (pairs) is a different class."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from engine import kernels
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.sampling_params import SamplingParams

GOLDEN = Path(__file__).parent / "data" / "portable_numerics.json"
PROMPTS = [[5, 17, 99, 3, 250, 7, 11], list(range(40, 90))]


def engine(path: Path, layout: str) -> LLMEngine:
    config = EngineConfig(dtype="bfloat16", kv_cache_bytes=4 * 2**20, invariant_layout=layout)
    return LLMEngine.from_checkpoint(path, config)


def bits(path: Path, layout: str) -> dict[str, Any]:
    """Greedy 24 tokens of each prompt: ids, and each logprob and top-2 value as float hex."""
    e = engine(path, layout)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, logprobs=2, ignore_eos=True)
    outs = e.generate(PROMPTS, greedy)
    return {
        "numerics": e.runner.model.numerics,
        "tokens": [o.token_ids for [o] in outs],
        "logprobs": [
            [[lp.logprob.hex(), *(v.hex() for _, v in lp.top)] for lp in o.logprobs or []]
            for [o] in outs
        ],
    }


def checkpoint_digest(path: Path) -> str:
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


def test_the_class_names_the_dtype_and_the_layout_that_decide_the_bits(bf16_llama: Path) -> None:
    fast = "pairs" if kernels.bf16_pairs_supported() else "columns"
    assert engine(bf16_llama, "auto").runner.model.numerics == f"bfloat16/invariant/{fast}"
    assert engine(bf16_llama, "columns").runner.model.numerics == "bfloat16/invariant/columns"
    loose = EngineConfig(dtype="bfloat16", kv_cache_bytes=4 * 2**20, deterministic=False)
    assert LLMEngine.from_checkpoint(bf16_llama, loose).runner.model.numerics == "fastest"


def test_the_portable_layout_gives_the_recorded_bits_on_this_cpu(bf16_llama: Path) -> None:
    """The checkpoint first (a different one here would explain any difference), then every
    token id and logprob bit of the portable layout."""
    golden = json.loads(GOLDEN.read_text())
    assert checkpoint_digest(bf16_llama) == golden["checkpoint_sha256"]
    assert bits(bf16_llama, "columns") == golden["bits"]
