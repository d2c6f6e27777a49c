"""Numerics classes (docs/design.md#numerics-classes): what decides an engine's bits is named,
the router keeps every request within one class (tests/router/test_router.py), and the
portable layout gives the same bits on every CPU family.

Two checks of the last: the portable layout's greedy run and a digest of the sampler's every
float against those recorded on another machine (``data/portable_numerics.json``), and both
under each ATen CPU capability this CPU has (an AVX-512 machine runs PyTorch's AVX2 kernels too,
with ``ATEN_CPU_CAPABILITY=avx2``). PyTorch's ``softmax`` and ``log_softmax`` differed in the
last bit between the two (they sum in the kernel's vector width); the sampler writes them out
in ops that do not (engine/sampler.py::log_softmax), its sums in one fixed order whatever the
thread count too (engine/sampler.py::row_sum). A capability is not a CPU: PyTorch's exp and log
call MKL, which picks its code by CPU vendor, and a file recorded on an AVX-512 Xeon (the same
there under ``avx2``) missed on an AVX2 EPYC in one logprob; exp, log, cos and sin are now the
portable kernel's (engine/csrc/portable_math.cpp, tests/engine/test_portable_math.py)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from numerics_bits import bits, engine, sampler_digest

from engine import kernels
from engine.config import EngineConfig
from engine.engine import LLMEngine

GOLDEN = Path(__file__).parent / "data" / "portable_numerics.json"
SCRIPT = Path(__file__).parent / "numerics_bits.py"
ROOT = Path(__file__).parents[2]


def capabilities() -> list[str]:
    """The ATen CPU capabilities this CPU runs: AVX2 (every CPU Tandem supports) and, where the
    CPU has it, AVX-512."""
    best = torch.backends.cpu.get_cpu_capability()
    return ["avx2", "avx512"] if best.startswith("AVX512") else ["avx2"]


def under(capability: str, *args: str) -> str:
    """``numerics_bits.py args`` run with PyTorch's kernels for ``capability``; its output."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability, "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr
    return run.stdout.strip().splitlines()[-1]


def checkpoint_digest(path: Path) -> str:
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


def test_the_class_names_the_dtype_and_the_layout_that_decide_the_bits(bf16_llama: Path) -> None:
    here = kernels.invariant_layouts()  # fastest first: tiles (AMX), pairs, columns
    assert engine(bf16_llama, "auto").runner.model.numerics == f"bfloat16/invariant/{here[0]}"
    for layout in here:
        assert engine(bf16_llama, layout).runner.model.numerics == f"bfloat16/invariant/{layout}"
    loose = EngineConfig(dtype="bfloat16", kv_cache_bytes=4 * 2**20, deterministic=False)
    assert LLMEngine.from_checkpoint(bf16_llama, loose).runner.model.numerics == "fastest"


def test_a_layout_this_cpu_lacks_is_refused_at_start(
    bf16_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As on an AVX2-only CPU asked for AMX tiles: a named error listing what does run."""
    monkeypatch.setattr(kernels, "invariant_layouts", lambda: ["columns"])
    with pytest.raises(
        ValueError, match="invariant_layout 'tiles' does not run on this CPU; it runs columns"
    ):
        engine(bf16_llama, "tiles")


def test_the_portable_layout_gives_the_recorded_bits_on_this_cpu(bf16_llama: Path) -> None:
    """The checkpoint first (a different one here would explain any difference), then every
    token id and logprob bit of the portable layout."""
    golden = json.loads(GOLDEN.read_text())
    assert checkpoint_digest(bf16_llama) == golden["checkpoint_sha256"]
    assert bits(bf16_llama, "columns") == golden["bits"]


@pytest.mark.parametrize("capability", capabilities())
def test_the_portable_layout_gives_the_recorded_bits_under_each_capability(
    bf16_llama: Path, capability: str
) -> None:
    golden: dict[str, Any] = json.loads(GOLDEN.read_text())
    assert json.loads(under(capability, "model", str(bf16_llama))) == golden["bits"]


def test_the_sampler_computes_the_recorded_bits_on_this_cpu() -> None:
    """Every float the sampler computes, against a digest recorded on another machine: the
    capabilities below are one CPU's, and PyTorch's exp and log call MKL, whose code follows
    the CPU vendor where no capability setting reaches (engine/csrc/portable_math.cpp)."""
    assert sampler_digest() == json.loads(GOLDEN.read_text())["sampler_sha256"]


@pytest.mark.parametrize("capability", capabilities())
def test_the_sampler_computes_the_same_bits_under_each_capability(capability: str) -> None:
    """Every probability the draw reads, every logprob: what this process computes."""
    assert under(capability, "sampler") == sampler_digest()


def test_the_sampler_computes_the_same_bits_whatever_the_thread_count() -> None:
    """``torch.sum`` splits a long row across threads when there are few rows (one sequence
    over a 49,152-token vocabulary): the sampler's sums do not (engine/sampler.py::row_sum)."""
    before = torch.get_num_threads()
    try:
        digests = set()
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            digests.add(sampler_digest())
    finally:
        torch.set_num_threads(before)
    assert len(digests) == 1
