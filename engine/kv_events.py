"""KV cache events an engine publishes so a router can keep an exact prefix index.

A block hash already chains its parent, the tenant salt and the model id
(``engine.kv_cache_manager.hash_block``), so "worker W holds hash h" is all a router needs: the
longest prefix W can serve a prompt from is the run of the prompt's ``prefix_hashes`` that W
holds, from the first block on.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class KVEventKind(StrEnum):
    STORED = "stored"  # full blocks entered the prefix cache
    REMOVED = "removed"  # cached blocks were evicted (their KV is gone)
    CLEARED = "cleared"  # everything is gone (restart, reset): drop all of the worker's hashes


@dataclass(frozen=True)
class KVEvent:
    kind: KVEventKind
    block_hashes: tuple[int, ...] = ()
