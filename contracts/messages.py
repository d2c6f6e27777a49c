"""What the coordinator, the router and the workers send each other (pickled by Ray).

One client request is served by one or more *attempts*: each has a fresh id
``<request id>@<n>``, so a worker never confuses a retry with the attempt it replaces, and a
late message of a dead attempt matches nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from contracts.roles import Role
from engine.request import FinishReason
from engine.sampler import SamplingSnapshot, TokenLogprobs
from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class RequestSpec:
    """A client request as the cluster sees it (already tokenised)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str = ""  # the tenant: prefix-cache hits only within one salt (P10)
    deadline: float | None = None  # absolute time.time() covering every attempt
    arrival_time: float = 0.0
    priority: int = 0  # in the cluster's admission queue: lower goes first (as vLLM's)


@dataclass(frozen=True)
class Attempt:
    """One try at a request. ``resume_output``: tokens the client already has (a migration
    recomputes them with the prompt); ``sampler_snapshot``: the sampler state after them."""

    request: RequestSpec
    number: int
    resume_output: list[int] = field(default_factory=list)
    sampler_snapshot: SamplingSnapshot | None = None

    @property
    def attempt_id(self) -> str:
        return f"{self.request.request_id}@{self.number}"

    @property
    def num_kv_tokens(self) -> int:
        """Positions whose KV a prefill computes: the prompt plus the resumed output."""
        return len(self.request.prompt_token_ids) + len(self.resume_output)


@dataclass(frozen=True)
class KVSource:
    """Where a decode worker pulls an attempt's KV from (over the transport the decode worker
    was started with: the topology's, one for the whole cluster)."""

    worker: str
    address: str  # host:port of the prefill worker's KV transfer server


@dataclass(frozen=True)
class TokenBatch:
    """Tokens one worker produced for one attempt since its last batch, and their text as the
    worker's engine detokenised it (the only detokenisation a request gets: an engine that
    continues a request primes its detokenizer with the tokens before, so text continues
    exactly across a hand-off or a migration)."""

    token_ids: list[int]
    text: str = ""
    finished: bool = False
    # Once finished: the engine's reason (HANDED_OFF from a prefill worker that leased the KV)
    finish_reason: FinishReason | None = None
    sampler_snapshot: SamplingSnapshot | None = None  # after the last token, when tracked
    error: str | None = None  # with FinishReason.ERROR: what failed there (for logs)
    logprobs: list[TokenLogprobs] | None = None  # one per token, when the request asked
    queue_time_s: float | None = None  # in the batch with the attempt's first token
    # In the batch with the attempt's first token, when asked (engine StreamOutput's).
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    def then(self, newer: TokenBatch) -> TokenBatch:
        """This batch and the ``newer`` one after it, as one."""
        both_none = self.logprobs is None and newer.logprobs is None
        # The sampler state after the newer tokens; unknown if they came without one.
        known = newer.sampler_snapshot is not None or newer.token_ids
        return TokenBatch(
            token_ids=self.token_ids + newer.token_ids,
            text=self.text + newer.text,
            finished=newer.finished,
            finish_reason=newer.finish_reason,
            sampler_snapshot=newer.sampler_snapshot if known else self.sampler_snapshot,
            error=newer.error,
            logprobs=None if both_none else (self.logprobs or []) + (newer.logprobs or []),
            queue_time_s=self.queue_time_s if self.queue_time_s is not None else newer.queue_time_s,
            prompt_logprobs=self.prompt_logprobs or newer.prompt_logprobs,
        )


# What a worker's token stream to one coordinator carries (``WorkerAPI.subscribe``): for each
# attempt with news since the last message, its tokens (merged into one batch) and, if the
# attempt failed there, the exception last.
Delivery = tuple[str, list["TokenBatch | Exception"]]


@dataclass(frozen=True)
class WorkerInfo:
    """What a worker tells the router and the coordinator once it is up."""

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


@dataclass(frozen=True)
class WorkerLoad:
    name: str
    incarnation: str
    queue_depth: int  # requests admitted but not running
    num_running: int
    kv_usage: float  # in-use blocks / total, in [0, 1]
    prefix_hit_ratio: float = 0.0  # prompt tokens found in the prefix cache / looked up
    claimed_blocks: int = 0  # KV blocks reserved or held by its requests (leases included)
    leases_expired: int = 0  # KV leases this process let expire unclaimed (prefill workers)
    # Attempt ids its engine admitted since the last report: the router's ledger stops
    # counting them as promised-but-unseen (they are in queue_depth/num_running/claimed now).
    admitted: tuple[str, ...] = ()


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
