"""Native CPU kernels, compiled on first use with ``torch.utils.cpp_extension.load_inline``.

Builds land in the environment's own directory (``<sys.prefix>/tandem-kernels/<name>``, or
``$TORCH_EXTENSIONS_DIR/<name>`` when that is set), so only the first process pays the compile
(~40 s each; ``make setup`` builds them, see :func:`build_all`). Not torch's shared default
(``~/.cache/torch_extensions``): two environments' builds differ in their include paths, and
sharing one directory made each rebuild the other's (a 2-minute ``tandem serve`` cold start).
Where no compiler (or no OpenMP) exists, or ``TANDEM_NATIVE_KERNELS=0``, :func:`load` returns
None, logs why once, and callers keep the pure-PyTorch path. Every function runs without the GIL,
as torch's own ops do (:func:`_bindings`).

* ``paged_decode_attention`` -- decode attention read in place through the block tables, with
  torch's CPU flash-attention numerics in bf16 (the default on CPU, ``attention_backend``).
* ``invariant_linear`` -- the batch-invariant GEMM (each output reduced over K in one fixed
  order whatever the row count): the default linear path (``engine.model.Linear``).
* ``skinny_linear`` -- bf16-weight GEMM of a few rows at memory bandwidth, for CPUs without
  native bf16 GEMM (used by ``engine.model.Linear`` whenever it builds).
* ``portable_math`` -- the float math whose bits must not depend on the CPU: the sampler's
  row sums (one fixed order on any thread count), exp and log, and RoPE's cos and sin (PyTorch's
  go to MKL, which picks its code by CPU vendor): ``engine.sampler``, ``engine.model``; and the
  sampler's whole temperature + top_p draw, one row at a time in cache (``sample_top_p``).
* ``layer_ops`` -- the decoder layer's small ops in one pass each, their bits the same on every
  CPU: RMSNorm after the residual add, SiLU(gate) * up, RoPE, the K/V write (``engine.model``,
  ``engine.attention``).
* ``token_bitmask`` -- a grammar's token bitmask applied to the logits as it is, without
  unpacking it (structured outputs: ``engine.structured.ban_disallowed``).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import sys
from pathlib import Path
from types import ModuleType

import torch

Tensor = torch.Tensor

log = logging.getLogger(__name__)

_CSRC = Path(__file__).resolve().parent / "csrc"
# ISO C++ mode turns FMA contraction off (the plain-loop fallback wants it); math-errno off keeps
# the fallback's std::exp free of errno stores.
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=fast", "-fno-math-errno"]
# Each: csrc/<name>.cpp exporting these functions.
KERNELS: dict[str, tuple[str, ...]] = {
    "paged_decode_attention": ("paged_decode_attention", "attach_spare_pool"),
    "skinny_linear": ("skinny_linear",),
    "invariant_linear": (
        "invariant_linear",
        "pack_linear",
        "invariant_layouts",
        "attach_spare_pool",
    ),
    "token_bitmask": ("apply_token_bitmask",),
    "portable_math": ("row_sum", "portable_exp", "portable_log", "cos_sin", "sample_top_p"),
    "layer_ops": ("rms_norm", "silu_mul", "rotary_", "write_kv"),
    "int8_linear": (
        "int8_linear",
        "pack_int8",
        "int8_path",
        "int8_path_supported",
        "attach_spare_pool",
    ),
    "spare_threads": (
        "set_spare_threads",
        "set_spare_sharing",
        "spare_stats",
        "spare_pool_address",
    ),
}
# Shared sources (csrc/<header>) put ahead of a kernel's own text, so that editing one rebuilds
# every kernel that uses it (load_inline keys its build on the source text).
KERNEL_HEADERS: dict[str, tuple[str, ...]] = {
    "paged_decode_attention": ("spare_threads.h",),
    "invariant_linear": ("amx.h", "spare_threads.h"),
    "int8_linear": ("amx.h", "spare_threads.h"),
    "spare_threads": ("spare_threads.h",),
    "portable_math": ("portable_exp.h",),
    "layer_ops": ("portable_exp.h",),
}
# Flags after _FLAGS for one kernel: portable_math's and layer_ops' bits are their IEEE ops as
# written.
_AS_WRITTEN = ("-ffp-contract=off", "-fno-trapping-math")
KERNEL_FLAGS: dict[str, tuple[str, ...]] = {
    "portable_math": _AS_WRITTEN,
    "layer_ops": (*_AS_WRITTEN, "-mprefer-vector-width=512"),
}
# Most rows skinny_linear takes (its kMaxRows); past it the GEMM is compute-bound.
SKINNY_MAX_ROWS = 16
DISABLE_ENV = "TANDEM_NATIVE_KERNELS"
STAMP_FILE = "sources.sha256"  # beside a build: what it was built from (_load_built)


@functools.cache
def load(name: str) -> ModuleType | None:
    """The compiled extension ``name`` (one of :data:`KERNELS`), or None when it cannot be built
    here or native kernels are switched off (reason logged once)."""
    if name not in KERNELS:
        raise ValueError(f"unknown kernel {name!r}; known: {', '.join(KERNELS)}")
    if os.environ.get(DISABLE_ENV, "1") == "0":
        log.info("native CPU kernels switched off (%s=0): %s uses PyTorch", DISABLE_ENV, name)
        return None
    try:
        ext = _load_built(name) or _build(name)
        if "attach_spare_pool" in KERNELS[name]:  # one pool of spare threads per process
            pool = load("spare_threads")
            ext.attach_spare_pool(0 if pool is None else pool.spare_pool_address())
        return ext
    except Exception as exc:  # no compiler, no OpenMP, no headers: all mean "use PyTorch"
        log.warning("CPU kernel %s unavailable, using PyTorch: %s", name, exc)
        return None


def _sources(name: str) -> list[str]:
    return [
        *((_CSRC / header).read_text() for header in KERNEL_HEADERS.get(name, ())),
        (_CSRC / f"{name}.cpp").read_text(),
        _bindings(name),
    ]


def _bindings(name: str) -> str:
    """The module's Python bindings: every function runs without the GIL, as torch's own ops do,
    so a worker's other threads (the event loop streaming its tokens) run beside a step's kernels
    instead of waiting for each to return (load_inline's ``functions=`` bindings keep the GIL)."""
    defs = "".join(
        f'  m.def("{fn}", &{fn}, py::call_guard<py::gil_scoped_release>());\n'
        for fn in KERNELS[name]
    )
    return f"PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {{\n{defs}}}\n"


def _stamp(name: str) -> str:
    """What a build of ``name`` was made from: its sources, flags and torch."""
    text = "\0".join([*_sources(name), *_FLAGS, *KERNEL_FLAGS.get(name, ()), torch.__version__])
    return hashlib.sha256(text.encode()).hexdigest()


def _load_built(name: str) -> ModuleType | None:
    """The extension built from these very sources, imported as it is; None if there is none.

    Without this every process went through ``load_inline``, which holds a lock file in the
    build directory while it checks the build: a worker killed in that second (the chaos plans
    kill workers) left the lock behind, and every later process that loaded the kernel waited
    on it forever (CI hung on ``token_bitmask`` twice)."""
    path = build_dir(name) / f"tandem_{name}.so"
    stamp = build_dir(name) / STAMP_FILE
    if not (path.exists() and stamp.exists() and stamp.read_text() == _stamp(name)):
        return None
    spec = importlib.util.spec_from_file_location(f"tandem_{name}", path)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build(name: str) -> ModuleType:
    """Compile ``name`` (``load_inline``: a no-op when its build is current), then stamp it."""
    from torch.utils.cpp_extension import load_inline

    ext: ModuleType = load_inline(
        name=f"tandem_{name}",
        build_directory=str(build_dir(name)),
        cpp_sources=_sources(name),
        extra_cflags=[*_FLAGS, *KERNEL_FLAGS.get(name, ())],
        extra_ldflags=["-fopenmp"],
    )
    (build_dir(name) / STAMP_FILE).write_text(_stamp(name))
    return ext


def build_dir(name: str) -> Path:
    """Where kernel ``name`` is built and cached (created if missing)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(sys.prefix, "tandem-kernels")
    path = Path(root) / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def build_all() -> dict[str, bool]:
    """Compile every kernel now (setup runs this, so no serving process pays the compile)."""
    return {name: load(name) is not None for name in KERNELS}


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
    ext = load("paged_decode_attention")
    if ext is None:
        raise RuntimeError("the paged decode-attention extension is not available")
    out: Tensor = ext.paged_decode_attention(q, k_cache, v_cache, tables, starts, ends, scale)
    return out


def _invariant() -> ModuleType:
    ext = load("invariant_linear")
    if ext is None:
        raise RuntimeError("the invariant-linear extension is not available")
    return ext


def invariant_layouts() -> list[str]:
    """The :func:`invariant_linear` layouts this CPU runs, fastest first: ``tiles`` (AMX-BF16),
    ``pairs`` (AVX512-BF16), ``columns`` (everywhere). Each gives its own bits."""
    return list(_invariant().invariant_layouts())


def pack_linear(weight: Tensor, layout: str) -> Tensor:
    """``weight`` ``[N, K]`` (float32 or bfloat16, CPU) packed for :func:`invariant_linear` in
    ``layout`` (one of :func:`invariant_layouts`; ``tiles`` and ``pairs`` take bf16 only)."""
    packed: Tensor = _invariant().pack_linear(weight, layout)
    return packed


def invariant_linear(x: Tensor, packed: Tensor, n: int, bias: Tensor | None, layout: str) -> Tensor:
    """``x W^T + b`` with ``W`` ``[n, K]`` packed by :func:`pack_linear` (``layout`` as packed,
    of ``x``'s dtype); ``x`` ``[M, K]``, the output in its dtype. Each output element is reduced
    over K in one order whatever M is."""
    out: Tensor = _invariant().invariant_linear(x, packed, n, bias, layout)
    return out


def skinny_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``x W^T + b`` for bf16 ``x`` ``[M, K]`` (1 <= M <= :data:`SKINNY_MAX_ROWS`) and bf16
    ``weight`` ``[N, K]`` (K a multiple of 16): fp32 accumulation, one rounding to bf16."""
    ext = load("skinny_linear")
    if ext is None:
        raise RuntimeError("the skinny-linear extension is not available")
    out: Tensor = ext.skinny_linear(x, weight, bias)
    return out


def apply_token_bitmask(logits: Tensor, bitmask: Tensor, rows: Tensor) -> bool:
    """Set to -inf, in place, each logit of row ``rows[i]`` of float32 ``logits`` ``[B, V]``
    whose bit in int32 ``bitmask[i]`` is 0. False (nothing done) where the kernel is not
    available."""
    ext = load("token_bitmask")
    if ext is None:
        return False
    ext.apply_token_bitmask(logits, bitmask, rows)
    return True


def row_sum(x: Tensor) -> Tensor | None:
    """Each row of float32 ``x`` ``[R, V]`` summed in one fixed order, ``[R, 1]``; None where the
    kernel is not available."""
    ext = load("portable_math")
    if ext is None:
        return None
    out: Tensor = ext.row_sum(x.contiguous())
    return out


def sample_top_p(z: Tensor, temperatures: Tensor, top_p: Tensor, uniforms: Tensor) -> Tensor | None:
    """One token per row of float32 CPU ``z`` ``[R, V]``: the sampler's tempered softmax, top_p
    mask (rows with top_p < 1), renormalisation and inverse-CDF draw, as its torch path computes
    them, in one pass per row (engine/csrc/portable_math.cpp). -1 for a row holding NaN or +inf
    or only -inf; None where the kernel is not available."""
    ext = load("portable_math")
    if ext is None:
        return None
    out: Tensor = ext.sample_top_p(z.contiguous(), temperatures, top_p, uniforms)
    return out


def portable_exp(x: Tensor) -> Tensor | None:
    """exp of float32 CPU ``x``, the same bits on every CPU; None where the kernel is not
    available (engine/csrc/portable_math.cpp)."""
    ext = load("portable_math")
    if ext is None:
        return None
    out: Tensor = ext.portable_exp(x.contiguous())
    return out


def portable_log(x: Tensor) -> Tensor | None:
    """log of float32 CPU ``x``, as :func:`portable_exp`."""
    ext = load("portable_math")
    if ext is None:
        return None
    out: Tensor = ext.portable_log(x.contiguous())
    return out


def portable_cos_sin(x: Tensor) -> tuple[Tensor, Tensor] | None:
    """cos and sin of float32 CPU ``x`` (accurate for ``|x| < 2**20``), as :func:`portable_exp`."""
    ext = load("portable_math")
    if ext is None:
        return None
    both: Tensor = ext.cos_sin(x.contiguous())
    return both[0], both[1]


def layer_ops(x: Tensor) -> ModuleType | None:
    """The ``layer_ops`` extension where it serves ``x`` (a CPU float32 or bfloat16 tensor), else
    None: the caller computes in PyTorch."""
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
        return None
    return load("layer_ops")


# The int8 GEMM's ways through one packed weight (engine/csrc/int8_linear.cpp), fastest first.
INT8_PATHS = ("amx", "vnni512", "avx2", "scalar")


def _int8() -> ModuleType:
    ext = load("int8_linear")
    if ext is None:
        raise RuntimeError("the int8-linear extension is not available")
    return ext


def _spare() -> ModuleType:
    ext = load("spare_threads")
    if ext is None:
        raise RuntimeError("the spare-threads extension is not available")
    return ext


def int8_paths() -> list[str]:
    """The int8 GEMM paths this CPU runs (every one gives the same bits)."""
    ext = _int8()
    return [p for p in INT8_PATHS if ext.int8_path_supported(p)]


def pack_int8(qweight: Tensor) -> tuple[Tensor, Tensor]:
    """int8 ``qweight`` ``[N, K]`` packed for :func:`int8_linear`, and 128 x each row's sum per
    group of 64 k (int32 ``[groups, N]``: the AVX512-VNNI path's offset, taken off again)."""
    packed, comp = _int8().pack_int8(qweight)
    return packed, comp


def int8_linear(
    x: Tensor,
    packed: Tensor,
    comp: Tensor,
    w_scale: Tensor,
    n: int,
    bias: Tensor | None,
    path: str = "auto",
) -> Tensor:
    """``x W^T + b`` with ``W`` = int8 rows (:func:`pack_int8`) times ``w_scale`` ``[n]`` and
    ``x`` ``[M, K]`` quantized to int8 on the fly per row and group of 64 k; int32 sums per group,
    fp32 across groups, the output in x's dtype. ``path``: "auto" (the fastest here) or one of
    :func:`int8_paths`."""
    out: Tensor = _int8().int8_linear(x, packed, comp, w_scale, n, bias, path)
    return out


def set_spare_threads(n: int, *, delay_us: int = 0) -> None:
    """Give :func:`int8_linear`'s few-row calls ``n`` spare threads (0: none, the default): helpers
    at the lowest priority that compute part of the output columns only while a core is otherwise
    idle (engine/csrc/spare_threads.h). The bits do not change. ``delay_us`` (tests): each helper
    sleeps that long after taking a chunk, as if it lost its core."""
    if n < 0 or delay_us < 0:
        raise ValueError(f"spare threads: n={n} and delay_us={delay_us} must be >= 0")
    _spare().set_spare_threads(n, delay_us)


def set_spare_sharing(on: bool) -> None:
    """Let the GEMMs share chunks with the spare threads (the default) or not (they compute alone
    and the helpers sleep): the engine's switch, off while it holds many requests."""
    _spare().set_spare_sharing(on)


def spare_stats() -> tuple[int, int, int]:
    """(spare threads, chunks they computed, chunks the caller took back from a stalled one)."""
    helpers, helped, taken_back = _spare().spare_stats()
    return helpers, helped, taken_back


if __name__ == "__main__":  # python -m engine.kernels: build them (setup does)
    logging.basicConfig(level=logging.INFO)
    for kernel, ok in build_all().items():
        print(f"kernel {kernel}: {'built' if ok else 'unavailable (PyTorch path)'}")
