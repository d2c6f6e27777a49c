"""The model runner: owns the paged KV cache (device + host swap space) and runs one step.

The cache is laid out as engine/kv_layout.py describes (``self.kv_layout``); the host copy has
the same layout with ``num_host_blocks`` blocks (pinned on CUDA).
"""

from __future__ import annotations

import logging
import math
import mmap
from collections.abc import Callable

import numpy as np
import torch

from engine import kernels
from engine.attention import AttentionMetadata, PrefillSeq
from engine.batch import ScheduledChunk, SchedulerOutput
from engine.config import EngineConfig
from engine.kv_layout import KVLayout
from engine.loader import LoadedCheckpoint
from engine.model import DecoderModel

log = logging.getLogger(__name__)

# Spare threads (engine/csrc/spare_threads.h) help only an engine that holds at most this many
# requests. A fuller engine's decode batches are many rows, where a helper that gets a core for
# a moment and loses it mid-chunk makes the step wait: served 64 @ inf lost 3-5% with every batch
# shared, and is level with this limit (docs/benchmarks.md#spare-threads).
SPARE_MAX_REQUESTS = 8

Tensor = torch.Tensor


class DeterminismUnavailable(RuntimeError):
    """``deterministic: true`` on a setup without batch-invariant kernels (CUDA, no compiler,
    SDPA attention): the engine refuses to start rather than serve non-reproducible output."""


def check_deterministic(config: EngineConfig, device: torch.device) -> None:
    """Raise :class:`DeterminismUnavailable` (saying why and what to set) unless every kernel
    of the invariant path runs here."""
    if not config.deterministic:
        return
    fix = "set engine deterministic: false to run without reproducibility guarantees"
    if device.type != "cpu":
        raise DeterminismUnavailable(
            f"deterministic numerics are implemented for CPU, not {device.type}; {fix}"
        )
    if config.attention_backend == "sdpa":
        raise DeterminismUnavailable(
            f"attention_backend sdpa is not batch-invariant (its reduction order depends on "
            f"the query count); use auto or cpu_kernel, or {fix}"
        )
    missing = [
        name
        for name in ("invariant_linear", "paged_decode_attention")
        if kernels.load(name) is None
    ]
    if missing:
        raise DeterminismUnavailable(
            f"the compiled CPU kernels {', '.join(missing)} are unavailable (no C++ compiler or "
            f"OpenMP, or {kernels.DISABLE_ENV}=0; see the log); {fix}"
        )


def check_quantization(config: EngineConfig, device: torch.device) -> None:
    """Raise ValueError (saying why) where ``config.quantization`` cannot run: int8 weights run
    the compiled CPU kernel only."""
    if config.quantization != "int8":
        return
    if device.type != "cpu":
        raise ValueError(f"quantization int8 runs on CPU, not {device.type}")
    if kernels.load("int8_linear") is None:
        raise ValueError(
            "quantization int8 needs the compiled int8_linear kernel (no C++ compiler or OpenMP, "
            f"or {kernels.DISABLE_ENV}=0; see the log)"
        )


def start_spare_threads(config: EngineConfig, device: torch.device) -> bool:
    """Give this process's few-row GEMMs ``config.spare_threads`` helpers (0: none; one pool per
    process, so the newest engine's count holds; engine/csrc/spare_threads.h); whether any run.
    A hint: where the native kernels do not run (CUDA, no compiler) it is logged and nothing
    else changes."""
    if device.type == "cpu" and kernels.load("spare_threads") is not None:
        kernels.set_spare_threads(config.spare_threads)
        return config.spare_threads > 0
    if config.spare_threads:
        log.info("spare_threads=%d ignored: native CPU kernels only", config.spare_threads)
    return False


def check_kv_cache_dtype(config: EngineConfig, device: torch.device) -> None:
    """Raise ValueError (saying why) where an int8 KV cache cannot run: only the compiled CPU
    attention kernel reads it."""
    if config.kv_cache_dtype != "int8":
        return
    if device.type != "cpu":
        raise ValueError(f"kv_cache_dtype int8 runs on CPU, not {device.type}")
    if config.attention_backend == "sdpa":
        raise ValueError("kv_cache_dtype int8 is read by the CPU attention kernel, not sdpa")
    if kernels.load("paged_decode_attention") is None:
        raise ValueError(
            "kv_cache_dtype int8 needs the compiled paged_decode_attention kernel (no C++ "
            f"compiler or OpenMP, or {kernels.DISABLE_ENV}=0; see the log)"
        )


class ModelRunner:
    """Executes :class:`SchedulerOutput` steps; the scheduler owns which blocks mean what."""

    def __init__(self, ckpt: LoadedCheckpoint, config: EngineConfig, device: torch.device) -> None:
        mc = ckpt.config
        if config.dtype != "auto" and getattr(torch, config.dtype) != mc.dtype:
            raise ValueError(f"engine dtype {config.dtype} but checkpoint loaded as {mc.dtype}")
        self.model_config = mc
        self.device = device
        self.block_size = config.block_size
        self.kv_layout = KVLayout.for_model(mc, config.block_size, config.kv_cache_dtype)
        block_bytes = self.kv_layout.bytes_per_token * config.block_size
        self.num_blocks = config.kv_cache_bytes // block_bytes
        if self.num_blocks < 1:
            raise ValueError(
                f"kv_cache_bytes={config.kv_cache_bytes} holds no block of {block_bytes} bytes"
            )
        self.num_host_blocks = config.swap_space_bytes // block_bytes
        check_deterministic(config, device)
        check_quantization(config, device)
        check_kv_cache_dtype(config, device)
        self.spare_threads = start_spare_threads(config, device)
        self.deterministic = config.deterministic
        self.model = DecoderModel(
            mc,
            ckpt.weights,
            device,
            deterministic=self.deterministic,
            layout=config.invariant_layout,
            quantization=config.quantization,
        )
        # Zeros, not empty: decode reads padding slots (masked out, weight 0), and 0 * NaN from
        # uninitialised memory would still poison the output.
        layout = self.kv_layout
        self.kv_cache = _zeros(layout.cache_shape(self.num_blocks), layout.torch_dtype, device)
        host_shape = layout.cache_shape(self.num_host_blocks)
        if device.type == "cuda":
            self.host_cache = torch.zeros(host_shape, dtype=layout.torch_dtype, pin_memory=True)
        else:
            self.host_cache = _zeros(host_shape, layout.torch_dtype, device)
        self._workspace = torch.empty(self._workspace_shape(0), dtype=mc.dtype, device=device)
        # Called with (layer index, the step's SchedulerOutput) once that layer's K/V of the
        # step is written: a prefill worker streams a layer while later layers compute.
        self.layer_hook: Callable[[int, SchedulerOutput], None] | None = None
        # Every row a query of the paged kernel: for the invariant numerics, and for an int8
        # cache, which only the kernel reads.
        self.paged_rows = self.deterministic or layout.dtype == "int8"
        self.decode_kernel = self.paged_rows or (
            config.attention_backend != "sdpa"
            and device.type == "cpu"
            and kernels.load("paged_decode_attention") is not None
        )

    @property
    def numerics(self) -> str:
        """The engine's numerics class (docs/design.md#numerics-classes): the model's, and
        ``/kv-int8`` with an int8 cache, whose bits differ (and whose blocks do not fit)."""
        kv = "/kv-int8" if self.kv_layout.dtype == "int8" else ""
        return self.model.numerics + kv

    def _workspace_shape(self, num_blocks: int) -> tuple[int, ...]:
        return self.kv_layout.payload_shape(num_blocks)

    def _decode_workspace(self, num_blocks: int) -> Tensor:
        """K/V gather target for ``num_blocks`` blocks; grows (never shrinks) so steady-state
        decode steps allocate nothing."""
        if self._workspace.shape[1] < num_blocks:
            grown = max(num_blocks, self._workspace.shape[1] * 3 // 2)
            self._workspace = torch.empty(
                self._workspace_shape(grown), dtype=self._workspace.dtype, device=self.device
            )
        return self._workspace[:, :num_blocks]

    def share_spare_threads(self, live_requests: int) -> None:
        """Before a step: the spare threads help it only while the engine holds at most
        :data:`SPARE_MAX_REQUESTS` requests (running or waiting)."""
        if self.spare_threads:
            kernels.set_spare_sharing(live_requests <= SPARE_MAX_REQUESTS)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> Tensor:
        """Apply the step's swaps and block copies, then run its chunks.

        Returns:
            float32 logits ``[sum of the chunks' num_logit_rows, vocab]``, chunk by chunk.
        """
        if out.swap_out:
            dev, host = self._pairs(out.swap_out)
            self.host_cache.index_copy_(
                2, host, self.kv_cache.index_select(2, dev.to(self.device)).cpu()
            )
        if out.swap_in:
            host, dev = self._pairs(out.swap_in)
            blocks = self.host_cache.index_select(2, host).to(self.device)
            self.kv_cache.index_copy_(2, dev.to(self.device), blocks)
        if out.copy_blocks:
            src, dst = (ids.to(self.device) for ids in self._pairs(out.copy_blocks))
            self.kv_cache.index_copy_(2, dst, self.kv_cache.index_select(2, src))
        if not out.chunks:
            vocab = self.model_config.vocab_size
            return torch.empty(0, vocab, dtype=torch.float32, device=self.device)
        input_ids, positions, meta, sample_rows = self._prepare(out.chunks)
        hook = self.layer_hook
        on_layer = None if hook is None else lambda layer: hook(layer, out)
        return self.model.forward(input_ids, positions, meta, self.kv_cache, sample_rows, on_layer)

    @staticmethod
    def _pairs(pairs: list[tuple[int, int]]) -> tuple[Tensor, Tensor]:
        ids = torch.tensor(pairs, dtype=torch.long)
        return ids[:, 0], ids[:, 1]

    def _prepare(
        self, chunks: list[ScheduledChunk]
    ) -> tuple[Tensor, Tensor, AttentionMetadata, Tensor]:
        """Flatten the chunks decode-first and build the indexing every layer shares.

        All index lists are joined into one flat list and converted once (through numpy: a
        Python list converts several times faster that way) and moved to the device once."""
        bs, dev = self.block_size, self.device
        self._check(chunks)
        decodes = [c for c in chunks if len(c.token_ids) == 1]
        prefills = [c for c in chunks if len(c.token_ids) > 1]
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        for c in decodes:
            p = c.start_pos
            pos.append(p)
            slots.append(c.block_table[p // bs] * bs + p % bs)
            ids += c.token_ids
        seqs: list[PrefillSeq] = []
        for c in prefills:
            seqs.append(self._prefill_seq(c, row=len(ids)))
            span = range(c.start_pos, c.start_pos + len(c.token_ids))
            pos += span
            slots += [c.block_table[p // bs] * bs + p % bs for p in span]
            ids += c.token_ids
        sample_rows = self._sample_rows(chunks, decodes, prefills, seqs)
        if self.paged_rows:
            return self._prepare_invariant(decodes + prefills, ids, pos, slots, sample_rows)
        firsts = self._first_blocks([c.start_pos for c in decodes])
        tables, width = self._decode_tables(decodes, firsts)

        flat = ids + pos + slots + sample_rows + firsts + tables
        sizes = [len(ids), len(pos), len(slots), len(sample_rows), len(firsts), len(tables)]
        host = torch.from_numpy(np.array(flat, dtype=np.int64))
        _, host_pos, _, _, host_firsts, _ = host.split(sizes)
        visible = self._decode_mask(host_pos[: len(decodes)], host_firsts, width)
        input_ids, positions, slot_mapping, rows, _, blocks = host.to(dev).split(sizes)
        bounds = None
        if self.decode_kernel:
            bounds = self._decode_bounds(host_pos[: len(decodes)], host_firsts)
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            num_decode=len(decodes),
            decode_blocks=blocks.view(len(decodes), width),
            decode_mask=visible[:, None, None, :].to(dev),
            decode_workspace=self._decode_workspace(0 if self.decode_kernel else len(tables)),
            prefills=seqs,
            decode_bounds=bounds,
        )
        return input_ids, positions, meta, rows

    @staticmethod
    def _sample_rows(
        chunks: list[ScheduledChunk],
        decodes: list[ScheduledChunk],
        prefills: list[ScheduledChunk],
        seqs: list[PrefillSeq],
    ) -> list[int]:
        """The rows whose logits the forward returns, in ``chunks`` order: each chunk's last
        ``num_logit_rows`` rows. Decodes are rows 0.., the prefills (``seqs``) follow."""
        if not prefills:  # a pure decode step: row i is chunk i, and has one logit row at most
            return [row for row, c in enumerate(chunks) if c.num_logit_rows]
        last_row = {id(c): row for row, c in enumerate(decodes)}
        for c, seq in zip(prefills, seqs, strict=True):
            last_row[id(c)] = seq.row + seq.num_tokens - 1
        return [
            row
            for c in chunks
            for row in range(last_row[id(c)] + 1 - c.num_logit_rows, last_row[id(c)] + 1)
        ]

    def _prepare_invariant(
        self,
        chunks: list[ScheduledChunk],
        ids: list[int],
        pos: list[int],
        slots: list[int],
        sample_rows: list[int],
    ) -> tuple[Tensor, Tensor, AttentionMetadata, Tensor]:
        """Every row, prefill or decode, is one query of the paged kernel over its own
        positions ``[first, p]`` of a block table that starts at position 0: the query at
        position p reduces over the same keys, in the same splits, in a prefill chunk of any
        size and in a decode step, so its output is the same bits (issue 16)."""
        bs, window = self.block_size, self.model_config.sliding_window
        # Each chunk's table up to its last position, padded with block 0 to one width (one
        # conversion for the batch), then one row per token.
        used = [-(-(c.start_pos + len(c.token_ids)) // bs) for c in chunks]
        width = max(used)
        padded = [c.block_table[:n] + [0] * (width - n) for c, n in zip(chunks, used, strict=True)]
        tables = np.array(padded, dtype=np.int64)
        if len(chunks) != len(ids):
            tables = tables.repeat([len(c.token_ids) for c in chunks], axis=0)
        host_pos = np.array(pos, dtype=np.int64)
        ends = host_pos + 1
        starts = np.zeros_like(ends) if window is None else np.maximum(ends - window, 0)
        flat = torch.from_numpy(np.array(ids + pos + slots + sample_rows, dtype=np.int64))
        input_ids, positions, slot_mapping, rows = flat.to(self.device).split(
            [len(ids), len(pos), len(slots), len(sample_rows)]
        )
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            num_decode=len(ids),
            decode_blocks=torch.from_numpy(tables),
            decode_mask=torch.empty(0, dtype=torch.bool),
            decode_workspace=self._decode_workspace(0),
            prefills=[],
            decode_bounds=torch.from_numpy(np.stack((starts, ends))),
        )
        return input_ids, positions, meta, rows

    def _first_blocks(self, positions: list[int]) -> list[int]:
        """Earliest block a query at each position ``p`` attends to (later than 0 only under a
        sliding window, whose query sees keys ``p - window < k <= p``)."""
        window = self.model_config.sliding_window
        if window is None:
            return [0] * len(positions)
        return [max(0, p - window + 1) // self.block_size for p in positions]

    def _decode_tables(
        self, decodes: list[ScheduledChunk], firsts: list[int]
    ) -> tuple[list[int], int]:
        """Block tables ``[B, W]`` flattened row-major (block 0 as filler), and W."""
        bs = self.block_size
        tables = [
            c.block_table[f : c.start_pos // bs + 1] for c, f in zip(decodes, firsts, strict=True)
        ]
        width = max((len(t) for t in tables), default=0)
        flat: list[int] = []
        for t in tables:
            flat += t
            flat += [0] * (width - len(t))
        return flat, width

    def _decode_mask(self, q_pos: Tensor, firsts: Tensor, width: int) -> Tensor:
        """The decode key mask ``[B, W * bs]``: True where a query at ``q_pos`` attends."""
        bs, window = self.block_size, self.model_config.sliding_window
        q_pos = q_pos[:, None]
        k_pos = firsts[:, None] * bs + torch.arange(width * bs)
        visible = k_pos <= q_pos
        if window is not None:
            visible &= q_pos - k_pos < window
        return visible

    def _decode_bounds(self, q_pos: Tensor, firsts: Tensor) -> Tensor:
        """``[2, B]``: the table positions ``[start, end)`` each decode query attends to (the
        true entries of its :meth:`_decode_mask` row, which are always one run)."""
        origin = firsts * self.block_size
        start = torch.zeros_like(q_pos)
        window = self.model_config.sliding_window
        if window is not None:
            start = (q_pos - window + 1).clamp(min=0) - origin
        return torch.stack((start, q_pos + 1 - origin))

    def _prefill_seq(self, c: ScheduledChunk, row: int) -> PrefillSeq:
        n, start, bs = len(c.token_ids), c.start_pos, self.block_size
        window = self.model_config.sliding_window
        (first,) = self._first_blocks([start])
        fresh = start == 0 and (window is None or n <= window)
        mask = None
        if not fresh:
            q_pos = torch.arange(start, start + n)[:, None]
            k_pos = torch.arange(first * bs, start + n)[None, :]
            mask = k_pos <= q_pos
            if window is not None:
                mask &= q_pos - k_pos < window
            mask = mask.to(self.device)
        return PrefillSeq(
            row=row,
            num_tokens=n,
            fresh=fresh,
            blocks=torch.tensor(
                c.block_table[first : (start + n - 1) // bs + 1],
                dtype=torch.long,
                device=self.device,
            ),
            ctx_len=start + n - first * bs,
            mask=mask,
        )

    def _check(self, chunks: list[ScheduledChunk]) -> None:
        """Every chunk has tokens, and a block table that covers them with ids in the pool."""
        bs, num_blocks = self.block_size, self.num_blocks
        for c in chunks:
            table = c.block_table
            end = c.start_pos + len(c.token_ids)
            if not c.token_ids or len(table) * bs < end:
                raise ValueError(
                    f"request {c.request_id}: block table of {len(table)} blocks "
                    f"does not cover positions [0, {end})"
                )
            if min(table) < 0 or max(table) >= num_blocks:
                raise ValueError(f"request {c.request_id}: block id outside [0, {num_blocks})")


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """A zero tensor. On a CPU, an anonymous memory mapping: the kernel hands out zero pages
    as they are first written, so a KV cache sized from the machine's memory costs memory only
    for the blocks requests have used (``torch.zeros`` writes every page at start)."""
    if device.type != "cpu" or 0 in shape:
        return torch.zeros(shape, dtype=dtype, device=device)
    numel = math.prod(shape)
    nbytes = numel * torch.tensor([], dtype=dtype).element_size()
    mapping = mmap.mmap(-1, nbytes)  # the tensor keeps it alive
    return torch.frombuffer(mapping, dtype=dtype, count=numel).view(shape)
