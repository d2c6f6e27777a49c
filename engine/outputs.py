"""What the engine hands out: the one token-delta type, and the small records inside it.

A :class:`TokenDelta` goes from the engine's step to the socket unchanged in shape: the engine
yields it, a worker streams it to the coordinator, the coordinator passes it to the HTTP edge,
and every place that folds two of them into one calls :meth:`TokenDelta.then` (the engine's
backpressure buffer, a worker's outbox, a prefill's first token, the edge's non-streaming
answer). No torch here: the router and the ingress import this module (docs/design.md#layers).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.request import FinishReason


@dataclass(frozen=True)
class SamplingSnapshot:
    """What a migrating sequence carries so that sampling continues the identical stream: its
    key (the draws are ``uniform(seed, choice, position)``) and the output length it is at."""

    seed: int
    choice: int
    num_output_tokens: int  # output length the snapshot belongs to: restore checks it


@dataclass(frozen=True)
class TokenLogprobs:
    """Logprobs of the RAW model distribution (log_softmax of the unprocessed logits, vLLM's
    default): not changed by penalties, temperature or filters. For a generated token and for
    a prompt token alike (``engine.sampler.token_logprobs``)."""

    logprob: float  # of the token (sampled, or the prompt's)
    top: list[tuple[int, float]]  # the most likely (id, logprob), as many as asked; ties by id
    rank: int  # the token's place in that order, from 1 (it may lie beyond ``top``)


@dataclass(slots=True)
class TokenDelta:
    """New tokens of one sequence and the text now safe to show (the engine's detokenizer
    holds back a partial stop string or UTF-8 sequence). ``request_id`` is the engine's key
    of the request (``EngineRequest.key``); ``index`` which of its n samples this is.

    Read-only by convention (merge with :meth:`then`, change with ``dataclasses.replace``),
    not frozen: the engine builds one per token, and a frozen dataclass's ``__init__`` costs
    3.5 times a plain one's (5.1 vs 1.5 us with these 12 fields, AMD EPYC): 0.23 ms of a
    64-sequence step."""

    request_id: str
    token_ids: list[int]
    text: str = ""
    index: int = 0
    finished: bool = False
    finish_reason: FinishReason | None = None  # once finished
    error: str | None = None  # with FinishReason.ERROR: what failed (for logs)
    logprobs: list[TokenLogprobs] | None = None  # one per token id, when the request asked
    # With the first token, when asked: one per prompt token (None for the first, which nothing
    # predicts). Not on a resumed request's deltas: its client has them.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # The sampler state after token_ids, for requests that asked (a migration resumes from it)
    # and on the final delta of a prefill-only request (the decode worker continues from it).
    sampler_snapshot: SamplingSnapshot | None = None
    # With the first token only: seconds from entering the engine's queue to first scheduled.
    queue_time_s: float | None = None
    # On the final delta: the seed the sequence drew from (asked for, or drawn at arrival).
    seed: int | None = None

    def then(self, newer: TokenDelta) -> TokenDelta:
        """This delta and the ``newer`` one of the same sequence after it, as one: the one
        merge of the stack."""
        both_none = self.logprobs is None and newer.logprobs is None
        # The sampler state after the newer tokens: unknown if they came without one (an older
        # snapshot would describe a shorter output and misalign a migration).
        known = newer.sampler_snapshot is not None or newer.token_ids
        return TokenDelta(
            request_id=newer.request_id,
            token_ids=self.token_ids + newer.token_ids,
            text=self.text + newer.text,
            index=newer.index,
            finished=newer.finished,
            finish_reason=newer.finish_reason,
            error=newer.error,
            logprobs=None if both_none else (self.logprobs or []) + (newer.logprobs or []),
            prompt_logprobs=self.prompt_logprobs or newer.prompt_logprobs,
            sampler_snapshot=newer.sampler_snapshot if known else self.sampler_snapshot,
            queue_time_s=self.queue_time_s if self.queue_time_s is not None else newer.queue_time_s,
            seed=newer.seed if newer.seed is not None else self.seed,
        )


@dataclass(frozen=True)
class BackpressureStats:
    """Counters of the engine's backpressure loop, for tests and metrics."""

    pauses: int = 0  # times a request was put into BACKPRESSURED
    resumes: int = 0  # times one was resumed after its consumer caught up
    max_buffered: int = 0  # deepest any request buffer got (never above max_buffered_outputs)
