r"""What the coordinator, the router and the workers send each other (pickled by Ray), besides
the engine's own types they carry as they are: an attempt is an ``EngineRequest`` (its
``attempt`` field numbers the tries, so its key is fresh for each) and its tokens come back as
``TokenDelta``\s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from contracts.roles import Role
from engine.outputs import TokenDelta


@dataclass(frozen=True)
class KVSource:
    """Where a decode worker pulls an attempt's KV from (over the transport the decode worker
    was started with: the topology's, one for the whole cluster)."""

    worker: str
    address: str  # host:port of the prefill worker's KV transfer server


# What a worker's token stream to one coordinator carries (``WorkerAPI.subscribe``): for each
# attempt (by its key) with news since the last message, its tokens (merged into one delta)
# and, if the attempt failed there, the exception last.
Delivery = tuple[str, list[TokenDelta | Exception]]


@dataclass(frozen=True)
class WorkerInfo:
    """What a worker tells the router and the coordinator once it is up (checked when built)."""

    name: str
    role: Role
    domain: str
    kv_address: str | None  # prefill workers serve KV; None for the others
    block_size: int
    incarnation: str  # changes on every (re)start: a router drops state of an old one
    max_model_len: int = 0  # prompt + output tokens this worker's engine takes
    vocab_size: int = 0
    # The engine's admission limits, which the router's ledger keeps within (router/admission)
    max_num_seqs: int = 1  # batch slots
    num_kv_blocks: int = 0  # blocks in the KV pool
    admission_output_tokens: int | None = None  # predicted output reserved; None: max_tokens
    # Which bits its engine computes (engine.model.DecoderModel.numerics): the router pairs a
    # prefill with a decode worker, and migrates a stream, only within one class ("": unknown).
    numerics: str = ""
    # The CPU kernels PyTorch runs there (torch.backends.cpu.get_cpu_capability(): AVX2,
    # AVX512, ...): not part of the class -- the invariant layouts give the same bits under each
    # (docs/design.md#numerics-classes) -- but what an operator mixing CPU families looks at.
    cpu_capability: str = ""

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"{self.name}: block_size={self.block_size}: must be >= 1")


@dataclass(frozen=True)
class WorkerLoad:
    """What a worker reports of its load, each time it changes (checked when built)."""

    name: str
    incarnation: str
    queue_depth: int  # requests admitted but not running
    num_running: int
    kv_usage: float  # in-use blocks / total, in [0, 1]
    prefix_hit_ratio: float = 0.0  # prompt tokens found in the prefix cache / looked up
    claimed_blocks: int = 0  # KV blocks reserved or held by its requests (leases included)
    leases_expired: int = 0  # KV leases this process let expire unclaimed (prefill workers)
    imports_parked: int = 0  # KV imports that waited here for room (decode workers): a wait
    # Decode reservations (made before their prefill) that waited here for room: a wait with
    # no KV leased anywhere.
    reservations_waited: int = 0
    # Speculative decoding on this process, ever (docs/design.md#speculative-decoding):
    # verifications with drafts, draft tokens verified, draft tokens accepted.
    speculation: tuple[int, int, int] = (0, 0, 0)
    # Attempt ids its engine admitted since the last report: the router's ledger stops
    # counting them as promised-but-unseen (they are in queue_depth/num_running/claimed now).
    admitted: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.queue_depth < 0 or self.num_running < 0:
            raise ValueError(
                f"{self.name}: queue_depth={self.queue_depth}, num_running={self.num_running}: "
                "must be >= 0"
            )
        if not 0.0 <= self.kv_usage <= 1.0:
            raise ValueError(f"{self.name}: kv_usage={self.kv_usage}: must be in [0, 1]")


@dataclass(frozen=True)
class TransferRecord:
    """One KV pull a decode worker completed (benchmarks, the ingress's transfer metrics)."""

    seq: int  # 1, 2, ... per worker incarnation: ``transfer_records(after=seq)`` resumes here
    attempt_id: str
    transport: str
    num_bytes: int
    started: float  # time.time() when the pull began (right after admission here)
    finished: float  # when the last layer was written and verified


class KVPullFailed(RuntimeError):
    """A decode worker could not pull an attempt's KV; ``worker`` is the prefill worker it
    came from (to blame for the retry), ``dead`` whether that worker is gone, ``kind`` how the
    transfer failed (``tandem_transport_failures_total``: integrity, truncated, timeout, ...)."""

    def __init__(self, message: str, worker: str, dead: bool, kind: str = "other") -> None:
        super().__init__(message)
        self.worker = worker
        self.dead = dead
        self.kind = kind

    def __reduce__(self) -> tuple[Any, ...]:  # crosses Ray actor boundaries
        return (KVPullFailed, (self.args[0], self.worker, self.dead, self.kind))
