"""Engine limits sized from the machine (docs/design.md#sizing): what a pool's ``engine``
section leaves out is derived from the memory Ray gives each of its workers.

- **Memory per worker**: the pool's ``memory_bytes``, or an equal share of the Ray cluster's
  ``memory`` resource among all the topology's workers. Ray reserves it for the worker.
- **KV cache**: ``kv_memory_fraction`` of that memory once the model's weights are taken out
  (the rest is for activations, the host swap space, Python and the transport's buffers), but
  never more than the batch slots can fill (a full-context sequence in every slot).
- **Batch slots** (``max_num_seqs``) are not sized from memory: admission reserves each
  request's KV (engine/admission.py), so the cache, not the slot count, keeps requests within
  it, and slots only bound the step's batch (the engine's default, 64 unless given). Counting
  slots as full-context sequences, as this module once did, left SmolLM2's workers 10 slots
  for requests that need 1/30 of a context each (docs/benchmarks.md#sizing-slots).

A pool that sets ``kv_cache_bytes`` is left as it is.
"""

from __future__ import annotations

from engine.config import EngineConfig, ModelConfig


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
    """``engine`` with its KV cache sized for a worker with ``memory_bytes`` (module
    docstring). Raises ValueError when that memory holds the weights but no KV block."""
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
    return engine.model_copy(
        update={"kv_cache_bytes": min(kv_bytes, engine.max_num_seqs * context_bytes)}
    )
