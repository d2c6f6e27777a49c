"""Engine limits sized from the machine (docs/design.md#sizing): what a pool's ``engine``
section leaves out is derived from the memory Ray gives each of its workers.

- **Memory per worker**: the pool's ``memory_bytes``, or an equal share of the Ray cluster's
  ``memory`` resource among all the topology's workers. Ray reserves it for the worker.
- **KV cache**: ``kv_memory_fraction`` of that memory once the model's weights are taken out
  (the rest is for activations, the host swap space, Python and the transport's buffers), but
  never more than the batch slots can fill (full-context sequences in every slot).
- **Batch slots** (``max_num_seqs``, unless given): as many full-context sequences as that KV
  cache holds, so that every slot can be filled whatever the requests ask for, within
  ``MAX_AUTO_SEQS`` (vLLM's default; on a CPU a batch past 64 only adds latency, measured).

A pool that sets ``kv_cache_bytes`` is left as it is.
"""

from __future__ import annotations

from engine.config import EngineConfig, ModelConfig

MAX_AUTO_SEQS = 256


def sizes_itself(engine: EngineConfig) -> bool:
    """Whether the pool leaves its KV cache to be sized here."""
    return "kv_cache_bytes" not in engine.model_fields_set


def sized_engine(
    engine: EngineConfig,
    memory_bytes: int,
    model: ModelConfig,
    weights_bytes: int,
    kv_memory_fraction: float,
) -> EngineConfig:
    """``engine`` with its KV cache and, unless given, its batch slots sized for a worker
    with ``memory_bytes`` (module docstring). Raises ValueError when that memory holds the
    weights but no KV block."""
    if not sizes_itself(engine):
        return engine
    kv_bytes = int(kv_memory_fraction * (memory_bytes - weights_bytes))
    block_bytes = engine.block_size * model.kv_bytes_per_token(engine.kv_cache_dtype)
    if kv_bytes < block_bytes:
        raise ValueError(
            f"{memory_bytes} bytes of memory per worker leave no KV cache once the weights "
            f"({weights_bytes} bytes) are loaded: give the pool more memory_bytes"
        )
    context = min(
        engine.max_model_len or model.max_position_embeddings, model.max_position_embeddings
    )
    context_bytes = -(-context // engine.block_size) * block_bytes
    seqs = engine.max_num_seqs
    if "max_num_seqs" not in engine.model_fields_set:
        seqs = max(1, min(MAX_AUTO_SEQS, kv_bytes // context_bytes))
    kv_bytes = min(kv_bytes, seqs * context_bytes)
    return engine.model_copy(update={"kv_cache_bytes": kv_bytes, "max_num_seqs": seqs})
