"""LLMEngine: scheduler + model runner + sampler + detokenizer, driven one tick at a time.

This is the offline API (``generate``) and the synchronous core that the async interface and the
workers drive (``add_request`` / ``step`` / ``abort``). It is not thread-safe: one thread steps it.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from engine import detokenizer, metrics
from engine.admission import RequestRejected
from engine.batch import ScheduledChunk
from engine.config import EngineConfig, ModelConfig
from engine.detokenizer import TextStream
from engine.kv_cache_manager import KVCacheManager
from engine.loader import load_checkpoint
from engine.model_runner import ModelRunner
from engine.outputs import SamplingSnapshot, TokenDelta, TokenLogprobs
from engine.request import (
    EngineRequest,
    FinishReason,
    Request,
    RequestStatus,
    SpecStats,
    TerminalRecord,
)
from engine.sampler import Sampler, SamplingState, token_logprobs
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.speculative import DraftRows, NgramIndex, Speculator, draft_rows
from engine.structured import Grammars
from engine.tokenizer import Tokenizer


@dataclass
class CompletionOutput:
    """A finished sequence, as ``generate`` returns it."""

    request_id: str
    index: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    record: TerminalRecord
    logprobs: list[TokenLogprobs] | None
    seed: int  # asked for, or drawn at arrival: with it the same request draws these tokens again
    timing: dict[str, Any] = field(default_factory=dict)
    # Prefill-only requests: the sampler state after the last token, for the decode worker.
    sampler_snapshot: SamplingSnapshot | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # as in TokenDelta


@dataclass
class _Sequence:
    """Engine-side companions of one scheduled sequence."""

    request: Request
    index: int
    sampling: SamplingState
    detok: TextStream  # also holds the text emitted so far
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    # Filled position by position as its prefill chunks run (prompt logprobs asked).
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    snapshots: bool = False  # attach the sampler state to every output
    ngrams: NgramIndex | None = None  # its context's n-grams, once it speculates


class LLMEngine:
    """One model on one device. See README for the step picture."""

    def __init__(
        self,
        runner: ModelRunner,
        tokenizer: Tokenizer,
        config: EngineConfig,
        model_id: str,
    ) -> None:
        self.config = config
        self.model_config: ModelConfig = runner.model_config
        self.runner = runner
        self.tokenizer = tokenizer
        detokenizer.prepare(tokenizer)  # the token table: not on the first request's time
        # The context limit: the config's, within the model's positions and what the KV pool
        # can hold for one sequence (so a lone request can always run to its limit).
        self.max_model_len = min(
            config.max_model_len or self.model_config.max_position_embeddings,
            self.model_config.max_position_embeddings,
            runner.num_blocks * config.block_size,
        )
        self.kv = KVCacheManager(
            runner.num_blocks,
            config.block_size,
            num_host_blocks=runner.num_host_blocks,
            enable_prefix_caching=config.enable_prefix_caching,
            model_id=model_id,
        )
        self.scheduler = Scheduler(config, self.kv, self.max_model_len)
        self.sampler = Sampler(self.model_config.vocab_size)
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids) | tokenizer.eos_token_ids
        self.grammars = Grammars(tokenizer, self.model_config)  # structured outputs
        self._seqs: dict[str, _Sequence] = {}
        self._finished: list[CompletionOutput] = []
        self._ids = itertools.count()
        self.speculation = SpecStats()  # every request's drafts, summed
        self.speculator = None if config.speculative is None else Speculator(config.speculative)
        if self.speculator is not None:
            self.scheduler.drafter = self._draft

    @classmethod
    def from_checkpoint(
        cls, path: str | Path, config: EngineConfig | None = None, model_id: str | None = None
    ) -> LLMEngine:
        """Load a local HF checkpoint dir (weights, tokenizer) and size the KV cache.
        ``model_id`` keys the prefix cache (a cluster passes its model name, so every worker
        and the router hash alike); default: the resolved directory."""
        config = config or EngineConfig()
        device = config.resolve_device()
        ckpt = load_checkpoint(path, dtype=config.dtype, device=device)
        tokenizer = Tokenizer(path)
        runner = ModelRunner(ckpt, config, device)
        return cls(runner, tokenizer, config, model_id=model_id or str(Path(path).resolve()))

    # -- requests ------------------------------------------------------------------------------

    def make_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        **fields: Any,
    ) -> EngineRequest:
        """An :class:`EngineRequest` for ``prompt`` (text is tokenised here; no special tokens
        added), under ``request_id`` (default: a fresh ``req-N``); ``fields``: the other
        EngineRequest fields. For the offline API, benchmarks and tests."""
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if "resume_output" in fields:
            fields["resume_output"] = tuple(fields["resume_output"])
        return EngineRequest(rid, tuple(token_ids), params, **fields)

    def add_request(self, request: EngineRequest) -> str:
        """Validate and admit one request; returns its key. Raises RequestRejected or
        ValueError. See :class:`EngineRequest` for the hand-off fields."""
        if request.prefill_only and request.params.n > 1:
            raise ValueError("prefill_only requests take n=1 (the router fans out n > 1)")
        req = self._new_request(request)
        req.prefill_only = request.prefill_only
        # Before admission: a snapshot that does not fit the output raises with nothing changed.
        snapshot = request.sampler_snapshot
        sampling = None if snapshot is None else self._restored(req, snapshot)
        result = self.scheduler.add_request(req)
        if result.status == RequestStatus.REJECTED:
            raise RequestRejected(f"request {req.request_id}: {result.reason}")
        self._track(req, index=0, sampling=sampling, snapshots=request.snapshots)
        return req.request_id

    def add_imported(self, request: EngineRequest) -> list[int]:
        """Disaggregated decode side: admit a request whose KV for every known token (the
        prompt, plus ``resume_output`` when migrated) is being computed by a prefill worker.
        Returns the block ids to write that KV into, in position order; the request waits in
        WAITING_FOR_KV until :meth:`finish_import` brings the token the prefill sampled and
        the sampler state after it (``request.sampler_snapshot`` is not read here).
        Raises RequestRejected past a hard limit, NoRoom (nothing changed) when no slot,
        reservation or blocks are free right now."""
        if request.params.n > 1:
            raise ValueError("imported requests take n=1")
        req = self._new_request(request)
        result = self.scheduler.add_imported(req, req.num_tokens)
        if result.status == RequestStatus.REJECTED:
            raise RequestRejected(f"request {req.request_id}: {result.reason}")
        self._track(req, index=0, snapshots=request.snapshots)
        return self.kv.block_table(req.request_id)

    def finish_import(
        self,
        request_id: str,
        *,
        next_token: int | None = None,
        sampler_snapshot: SamplingSnapshot | None = None,
        error: str | None = None,
    ) -> None:
        """The imported KV is written and verified: append ``next_token`` (what the prefill
        sampled after it), take over its sampler state and decode. With an ``error`` the
        request ends FAILED and its blocks are reclaimed at the next step. A request that
        already ended (cancel, deadline) is left as it is."""
        seq = self._seqs.get(request_id)
        if seq is None or seq.request.is_finished:
            return
        req = seq.request
        if error is not None or next_token is None:
            reason = error or "import finished without a token"
            self.scheduler.finish_request(request_id, FinishReason.ERROR, error=reason)
            return
        req.output_token_ids.append(self._checked_ids([next_token], "imported")[0])
        if sampler_snapshot is not None:
            seq.sampling = self._restored(req, sampler_snapshot)
        self.scheduler.kv_ready(request_id)
        # Its text went out from the prefill side; the stream only needs to see it.
        if seq.detok.step(next_token).stop_matched is not None:
            self.scheduler.finish_request(request_id, FinishReason.STOP_STRING)
        req.num_emitted = seq.detok.num_emitted

    def sampler_snapshot(self, request_id: str) -> SamplingSnapshot:
        """The live request's sampler state after its latest token (what a migration carries)."""
        return self._seqs[request_id].sampling.snapshot()

    def release_kv(self, request_id: str) -> bool:
        """End the lease on a handed-off request's blocks; False if already released."""
        if request_id not in self.kv.leased_ids:
            return False
        return self.kv.free(request_id)

    def _checked_ids(self, token_ids: Sequence[int], what: str) -> list[int]:
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in token_ids):
            raise ValueError(f"{what} token id outside the vocabulary (size {vocab})")
        return list(token_ids)

    def _new_request(self, request: EngineRequest) -> Request:
        """The engine's Request for ``request``, its token ids checked against the vocabulary
        and its prompt and resumed output in place. Raises ValueError."""
        if not request.prompt_token_ids:
            raise ValueError("empty prompt")
        params = request.params
        params.validate_vocab(self.model_config.vocab_size)
        if params.constraint is not None:
            self.grammars.compile(params.constraint)  # InvalidConstraint (a ValueError)
        rid = request.key
        if "#" in rid:
            raise ValueError(f"request id {rid!r}: '#' is reserved for n > 1 samples")
        if rid in self._seqs or rid in self.kv.leased_ids:
            raise ValueError(f"duplicate request id {rid!r}")
        arrival = request.arrival_time
        req = Request(
            request_id=rid,
            prompt_token_ids=self._checked_ids(request.prompt_token_ids, "prompt"),
            sampling_params=params,
            arrival_time=arrival if arrival is not None else time.time(),
            priority=request.priority,
            deadline=request.deadline,
            cache_salt=request.cache_salt,
            eos_token_ids=self.eos_token_ids,
        )
        req.output_token_ids = self._checked_ids(request.resume_output, "resumed")
        return req

    def _restored(self, req: Request, snapshot: SamplingSnapshot) -> SamplingState:
        """The sampler state ``snapshot`` holds, for ``req`` as it stands (ValueError when the
        snapshot was taken at another output length). The request records the snapshot's seed
        and choice: they, not a seed drawn here, are what its tokens were drawn from."""
        state = SamplingState.restore(
            snapshot,
            req.sampling_params,
            req.prompt_token_ids,
            req.output_token_ids,
            req.eos_token_ids,
            self.grammars,
        )
        req.sampling_params = replace(
            req.sampling_params, seed=snapshot.seed, choice=snapshot.choice
        )
        return state

    def _track(
        self,
        req: Request,
        index: int,
        sampling: SamplingState | None = None,
        snapshots: bool = False,
    ) -> None:
        """Start following an admitted request; ``sampling`` defaults to a fresh state."""
        params = req.sampling_params
        if sampling is None:
            sampling = SamplingState.for_request(req, index, self.grammars)
        seq = _Sequence(
            request=req,
            index=index,
            sampling=sampling,
            detok=TextStream(self.tokenizer, params.stop, params.include_stop_str_in_output),
            snapshots=snapshots,
        )
        # Output carried over from another worker: its text went out there; prime the stream
        # so stop strings spanning the boundary still match.
        for token in req.output_token_ids:
            seq.detok.step(token)
        req.num_emitted = seq.detok.num_emitted
        self._seqs[req.request_id] = seq

    def abort(self, request_id: str) -> None:
        """Cancel a request (client went away); its KV is reclaimed at the next tick."""
        if request_id in self._seqs:
            self.scheduler.abort(request_id)

    def fail_all(self, error: str) -> list[TokenDelta]:
        """Worker failure or shutdown (docs/design.md#cleanup): every live sequence ends FAILED,
        through the one reclaim routine, without running the model again."""
        for rid in list(self._seqs):
            self.scheduler.finish_request(rid, FinishReason.ERROR, error=error)
        return [self._finish(rid) for rid in list(self._seqs)]

    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    # -- the tick -----------------------------------------------------------------------------

    def step(self) -> list[TokenDelta]:
        """Schedule, run the forward, sample, detokenise; returns this step's deltas."""
        out = self.scheduler.schedule()
        outputs: list[TokenDelta] = []
        if out.chunks:
            self.runner.share_spare_threads(len(self._seqs))
            logits = self._take_prompt_logprobs(out.chunks, self.runner.execute(out))
            logits, drafts = draft_rows(out.chunks, logits)
            sampled = self._sample(out.sampled_ids, logits)
            emitted = [self._emit(r) for r in self.scheduler.update_from_output(out, sampled)]
            if drafts:
                emitted = _merged(emitted + self._verify(drafts))
            outputs += emitted
        # Requests that ended without a token this step (abort, deadline, stop-string cut).
        ended = [rid for rid, seq in self._seqs.items() if seq.request.is_finished]
        outputs += [self._finish(rid) for rid in ended]
        return [o for o in outputs if o.token_ids or o.text or o.finished]

    def _take_prompt_logprobs(
        self, chunks: list[ScheduledChunk], logits: torch.Tensor
    ) -> torch.Tensor:
        """Record the prompt logprobs the runner's extra rows hold (the chunks with
        ``all_logits``); returns the sampling rows alone (with a chunk's drafts' rows after
        its own), in ``sampled_ids`` order."""
        if not any(c.all_logits for c in chunks):
            return logits
        keep: list[int] = []
        row = 0
        for c in chunks:
            n = c.num_logit_rows
            if c.all_logits:
                self._record_prompt_logprobs(c, logits[row : row + n - c.sample])
                keep += [row + n - 1] if c.sample else []
            else:
                keep += range(row, row + n)
            row += n
        return logits[torch.tensor(keep, dtype=torch.long, device=logits.device)]

    def _record_prompt_logprobs(self, chunk: ScheduledChunk, logits: torch.Tensor) -> None:
        """The logits at position p score prompt token p + 1. Recorded by position, so a
        chunk recomputed after a preemption rewrites what it wrote before."""
        seq = self._seqs[chunk.request_id]
        prompt = seq.request.prompt_token_ids
        if seq.prompt_logprobs is None:
            seq.prompt_logprobs = [None] * len(prompt)
        first = chunk.start_pos + 1
        scored = prompt[first : first + logits.shape[0]]
        if scored:
            k = seq.request.sampling_params.prompt_logprobs or 0
            found = token_logprobs(logits, scored, [k] * len(scored))
            seq.prompt_logprobs[first : first + len(scored)] = found

    def _sample(self, rids: list[str], logits: Tensor) -> dict[str, int]:
        rows: list[int] = []
        states: list[SamplingState] = []
        ids: list[str] = []
        for row, rid in enumerate(rids):
            seq = self._seqs[rid]
            req = seq.request
            if req.sampling_params.n > 1 and seq.index == 0 and not req.output_token_ids:
                # n > 1: the prompt was prefilled once; fork the samples now (they share its
                # blocks, copy-on-write on the partial tail) and draw each from this row.
                for i, child in enumerate(self.scheduler.fork(rid, req.sampling_params.n - 1), 1):
                    self._track(child, index=i)
                    self._seqs[child.request_id].prompt_logprobs = seq.prompt_logprobs
                    rows.append(row)
                    states.append(self._seqs[child.request_id].sampling)
                    ids.append(child.request_id)
            rows.append(row)
            states.append(seq.sampling)
            ids.append(rid)
        if len(rows) != logits.shape[0] or rows != list(range(len(rows))):
            logits = logits[torch.tensor(rows, device=logits.device)]
        result = self.sampler(logits, states)
        for rid, lp in zip(ids, result.logprobs, strict=True):
            if lp is not None:
                self._seqs[rid].logprobs.append(lp)
        return dict(zip(ids, result.token_ids, strict=True))

    # -- speculation (docs/design.md#speculative-decoding) ---------------------------------------

    def _draft(self, req: Request, most: int) -> list[int]:
        """The scheduler's draft source."""
        assert self.speculator is not None  # the scheduler asks only when speculation is on
        seq = self._seqs[req.request_id]
        seq.ngrams = seq.ngrams or self.speculator.index()
        return self.speculator.draft(req, seq.ngrams, seq.sampling.grammar, most)

    def _verify(self, rows: DraftRows) -> list[TokenDelta]:
        """Verify the step's drafts (commit through the scheduler, each token emitted), count
        them, and give back the KV of the rejected ones."""
        assert self.speculator is not None
        outputs: list[TokenDelta] = []

        def commit(rid: str, token: int) -> bool:
            if not self.scheduler.accept_draft(rid, token):
                return False
            outputs.append(self._emit(self._seqs[rid].request))
            return True

        accepted = self.speculator.verify(rows, self._takes, self._sample, commit)
        for rid, (drafts, _) in rows.items():
            self._seqs[rid].request.speculation.add(len(drafts), accepted[rid])
            self.speculation.add(len(drafts), accepted[rid])
            self.scheduler.end_verification(rid)
        return outputs

    def _takes(self, rid: str, draft: int) -> bool:
        """Whether ``rid`` decodes on and its last token is ``draft``."""
        req = self._seqs[rid].request
        return req.status is RequestStatus.DECODING and req.output_token_ids[-1] == draft

    def _emit(self, req: Request) -> TokenDelta:
        seq = self._seqs[req.request_id]
        token = req.output_token_ids[-1]
        now = time.time()
        queue_time = None
        if req.times.first_token is None:
            req.times.first_token = now
            queue_time = metrics.queue_time(req.times)
        delta = seq.detok.step(token)
        if delta.stop_matched is not None and not req.is_finished:
            self.scheduler.finish_request(req.request_id, FinishReason.STOP_STRING)
        self._record_emits(seq, seq.detok.num_emitted, now)
        lp = seq.logprobs[-1:] if req.sampling_params.logprobs is not None else None
        snap = seq.sampling.snapshot() if seq.snapshots else None
        return TokenDelta(
            req.parent_id or req.request_id,
            [token],
            delta.text,
            index=seq.index,
            logprobs=lp,
            prompt_logprobs=seq.prompt_logprobs if len(req.output_token_ids) == 1 else None,
            sampler_snapshot=snap,
            queue_time_s=queue_time,
        )

    def _record_emits(self, seq: _Sequence, num_emitted: int, now: float) -> None:
        """One emit stamp per token whose text reached the client (docs/design.md#metrics)."""
        req = seq.request
        while req.num_emitted < num_emitted:
            req.times.emits.append(now)
            req.num_emitted += 1

    def _finish(self, rid: str) -> TokenDelta:
        seq = self._seqs.pop(rid)
        req = seq.request
        now = time.time()
        # Held-back text is released only when the request ends for its client: a hand-off's
        # decode worker holds the same text back and releases it in its place.
        done = (
            req.status is RequestStatus.FINISHED
            and req.finish_reason is not FinishReason.HANDED_OFF
        )
        tail = seq.detok.finish() if done else ""
        self._record_emits(seq, seq.detok.num_emitted, now)
        record = self.scheduler.reclaim(rid)
        record = record or req.record
        assert record is not None, f"{rid}: terminal without a record"
        reason = req.finish_reason or FinishReason.ERROR
        self._finished.append(_completion(seq, record, reason))
        snap = seq.sampling.snapshot() if req.prefill_only or seq.snapshots else None
        return TokenDelta(
            req.parent_id or rid,
            [],
            tail,
            index=seq.index,
            finished=True,
            finish_reason=reason,
            error=req.error,
            sampler_snapshot=snap,
            seed=seq.sampling.seed,
        )

    # -- offline API ---------------------------------------------------------------------------

    def finished_outputs(self) -> list[CompletionOutput]:
        """Take the outputs of sequences finished since the last call."""
        done, self._finished = self._finished, []
        return done

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams],
    ) -> list[list[CompletionOutput]]:
        """Batch-generate; returns, per prompt, its n completions ordered by index."""
        plist = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        pairs = zip(prompts, plist, strict=True)
        ids = [self.add_request(self.make_request(p, sp)) for p, sp in pairs]
        while self.has_unfinished():
            self.step()
        by_request: dict[str, list[CompletionOutput]] = {rid: [] for rid in ids}
        for c in self.finished_outputs():
            by_request[c.request_id].append(c)
        return [sorted(by_request[rid], key=lambda c: c.index) for rid in ids]

    def stream(self, prompt: str | Sequence[int], params: SamplingParams) -> Iterator[TokenDelta]:
        """Generate for one prompt, yielding deltas as they are produced."""
        rid = self.add_request(self.make_request(prompt, params))
        while self.has_unfinished():
            for o in self.step():
                if o.request_id == rid:
                    yield o


def _merged(deltas: list[TokenDelta]) -> list[TokenDelta]:
    """One delta per sequence: a verification commits several tokens in one step."""
    merged: dict[tuple[str, int], TokenDelta] = {}
    for d in deltas:
        key = (d.request_id, d.index)
        merged[key] = merged[key].then(d) if key in merged else d
    return list(merged.values())


def _completion(seq: _Sequence, record: TerminalRecord, reason: FinishReason) -> CompletionOutput:
    """A finished sequence as the offline API returns it."""
    req = seq.request
    return CompletionOutput(
        request_id=req.parent_id or req.request_id,
        index=seq.index,
        prompt_token_ids=req.prompt_token_ids,
        token_ids=list(req.output_token_ids[: seq.detok.num_committed]),
        text=seq.detok.text,
        finish_reason=reason,
        record=record,
        logprobs=seq.logprobs if req.sampling_params.logprobs is not None else None,
        seed=seq.sampling.seed,
        sampler_snapshot=seq.sampling.snapshot() if req.prefill_only else None,
        prompt_logprobs=seq.prompt_logprobs,
        timing={
            "ttft_s": metrics.ttft(req.times),
            "tpot_s": metrics.tpot(req.times),
            "e2e_s": metrics.e2e(req.times),
            "itl_s": metrics.itls(req.times),
        },
    )
