"""The machine a figure was measured on, named as every benchmark's JSON and table name it: the
CPU model and the vector extensions that decide which kernels run (AVX2 only, or AVX-512 with
BF16 / AMX: the numerics layouts and PyTorch's kernels differ between them)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

_FEATURES = (("avx512f", "AVX-512"), ("avx512_bf16", "BF16"), ("amx_tile", "AMX"))


def cpu_name(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """E.g. ``AMD EPYC 7B13 (AVX2)`` or ``Intel(R) Xeon(R) Processor (AVX-512, BF16, AMX)``."""
    try:
        lines = cpuinfo.read_text().splitlines()
    except OSError:
        return "?"
    model = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "?")
    flags = next((ln.split(":", 1)[1].split() for ln in lines if ln.startswith("flags")), [])
    found = [name for flag, name in _FEATURES if flag in flags]
    return f"{model} ({', '.join(found or ['AVX2' if 'avx2' in flags else 'no AVX2'])})"


def abba(sides: Sequence[T], round_index: int) -> list[T]:
    """The order the sides run in round ``round_index``: A B B A, then B A A B, ... -- a drift
    of the shared machine over a round weighs on every side alike."""
    order = list(sides) if round_index % 2 == 0 else list(sides)[::-1]
    return order + order[::-1]
