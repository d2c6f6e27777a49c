"""Phase-2 admission (docs/design.md#admission, #admission-phase-2): hard limits and KV
reservations, accounting only.

A reservation is the KV a request may grow into without forcing a preemption; no physical
block moves until a scheduler tick picks the request. The scheduler owns the requests and
their queues; this module owns the two admission rules: may it ever run, and how much it
reserves.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import EngineConfig
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus


class RequestRejected(RuntimeError):
    """Phase-2 admission refused the request (the message says which limit)."""


class NoRoom(RequestRejected):
    """An imported request found no batch slot, reservation or blocks free *now*; nothing was
    admitted, so it may be offered again once a request ends (it is not a hard limit)."""


def reservation_tokens(
    num_prompt_tokens: int,
    num_tokens: int,
    predicted_output: int,
    max_model_len: int,
    pool_tokens: int,
) -> int:
    """The KV a request reserves at admission (docs/design.md#admission-phase-2): its prompt
    plus the output it is predicted to make, at least one token more than it has now, within
    the context limit and the pool. One formula for an engine's admission and for the router's
    ledger of what each worker has promised (router/admission.py), so the two always agree."""
    wanted = max(num_prompt_tokens + predicted_output, num_tokens + 1)
    return min(wanted, max_model_len, pool_tokens)


@dataclass(frozen=True)
class AdmissionResult:
    """Phase-2 admission outcome: QUEUED, DEGRADED, WAITING_FOR_KV (an imported request) or
    REJECTED, and why when not plain QUEUED."""

    status: RequestStatus
    reason: str | None = None


class Admission:
    """Hard limits and reservations of one scheduler."""

    def __init__(self, config: EngineConfig, kv: KVCacheManager, max_model_len: int) -> None:
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self._holders: set[str] = set()  # ids holding a reservation

    def hard_limit(self, req: Request) -> str | None:
        """Why ``req`` can never run here (the reason names the limit), or None."""
        n = req.num_tokens  # the prompt, plus the output so far of a migrated request
        if n > self.max_model_len:
            return f"prompt has {n} tokens, more than max_model_len={self.max_model_len}"
        need = self.kv.blocks_for(n)
        if need > self.kv.pool.num_blocks:
            return f"prompt needs {need} KV blocks but the pool has only {self.kv.pool.num_blocks}"
        whole = min(n + req.sampling_params.max_tokens, self.max_model_len)
        budget = self.config.max_num_batched_tokens
        if not self.config.enable_chunked_prefill and whole > budget:
            # Without chunking a (re)computed sequence must fit one step's token budget.
            return (
                f"sequence may reach {whole} tokens but max_num_batched_tokens={budget} "
                "and chunked prefill is off"
            )
        return None

    def target_tokens(self, req: Request) -> int:
        """Tokens to reserve (:func:`reservation_tokens`). A prefill-only request makes one
        token here; any other is predicted to make ``admission_output_tokens``, or all of
        its ``max_tokens`` when that is unset."""
        out = self.config.admission_output_tokens
        if req.prefill_only:
            predicted = 1
        else:
            predicted = req.sampling_params.max_tokens if out is None else out
        return reservation_tokens(
            req.num_prompt_tokens,
            req.num_tokens,
            predicted,
            self.max_model_len,
            self.kv.pool.num_blocks * self.kv.block_size,
        )

    def no_fit(self, req: Request) -> str:
        return (
            f"KV reservation of {self.target_tokens(req)} tokens does not fit "
            f"({self.kv.reservable_tokens()} tokens reservable)"
        )

    def reserve(self, req: Request, allow_degrade: bool = True) -> int | None:
        """Reserve KV for ``req``; returns the tokens reserved, or None if nothing fits.

        The degrade policy settles for the largest reservation that fits, >= prompt + 1,
        and marks a QUEUED request DEGRADED.
        """
        rid = req.request_id
        target = self.target_tokens(req)
        reserved: int | None = target if self.kv.reserve(rid, target) else None
        degrade = allow_degrade and self.config.admission_policy == "degrade"
        if reserved is None and degrade:
            fit = min(self.kv.reservable_tokens(), target)
            if fit >= min(req.num_tokens + 1, target) and self.kv.reserve(rid, fit):
                reserved = fit
                if req.status is RequestStatus.QUEUED:
                    req.transition(RequestStatus.DEGRADED)
        if reserved is not None:
            self._holders.add(rid)
        return reserved

    def holds(self, request_id: str) -> bool:
        return request_id in self._holders

    def forget(self, request_id: str) -> None:
        """``kv.free`` dropped the request's reservation (reclaim, recompute preemption)."""
        self._holders.discard(request_id)
