"""The load generator of the chaos harness, the benchmarks and the e2e tests: OpenAI completion
requests sent by the official ``openai`` client as a user's program would (open loop at planned
times, or closed loop: clients sending back to back), each one's outcome recorded. A chaos run's
requests are a fixed schedule drawn from the plan's seed, so two runs of a plan send the same
requests at the same offsets.

A stream's tokens are counted from its ``logprobs`` (every chaos request asks for the top
``TOP_LOGPROBS`` and for tokens named by id, ``return_tokens_as_token_ids``; other callers ask
for ``logprobs: 0`` to count them): however the server grouped them into events, and in a chaos
run they -- ids, logprobs and every top alternative -- are what is compared with the reference
engine (a changed, duplicated or missing token shows there).
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import openai

from chaos.plan import Load, Structured
from chaos.structured import structured_outputs

# Prompts are made of these, so they tokenize like English text.
TOP_LOGPROBS = 5  # the alternatives every chaos request asks for, all compared with the reference

WORDS = (
    "the of and to in is was for on that with as by at from his her they which this be are "
    "have not or one had an were but all there can their been has when who more if no out so "
    "said what up its about into than them only some could time these two may first then do "
    "any like my now over such our man me even most made after also did many before must "
    "through back years where much your way well down should because each just those people "
    "how too little state good very make world still own see men work long get here between "
    "both life being under never day same another know while last might us great old year off "
    "come since against go came right used take three river cloud garden engine signal window "
    "harbor lantern meadow pencil rocket silver thunder violet winter yellow zebra anchor "
    "bridge candle desert forest glacier island jungle kettle ladder mirror needle orchard"
).split()


@dataclass
class Planned:
    """One request of the schedule."""

    index: int
    send_at: float  # seconds after the run's start
    body: dict[str, Any]  # the completion request's fields (model added at send time)
    api_key: str = "none"
    stream: bool = True
    cancel_after: int | None = None  # the client hangs up after this many tokens
    structured: Structured | None = None  # the grammar its output is held to (chaos.structured)


@dataclass
class ChoiceOut:
    text: str = ""
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class Outcome:
    """What one request came to, from the client's side."""

    index: int
    scheduled: float  # absolute (time.time()) send time of the schedule
    sent: float | None = None
    first_token: float | None = None
    finished: float | None = None
    # ok: complete; cancelled: the client hung up (as planned, or in an abort storm);
    # error: a status or an error event (typed when the body named a type/code); hung: still
    # open at its bound (the runner gave up on it)
    status: str = "pending"
    http_status: int | None = None  # an error status the server answered with
    retry_after: str | None = None  # that answer's Retry-After header
    refused: bool = False  # the connection was refused: the request reached no server
    error_type: str | None = None  # the OpenAI error object's type or code; None: untyped
    error: str | None = None
    response_id: str | None = None
    seed: int | None = None  # the seed the server reports it drew from
    choices: dict[int, ChoiceOut] = field(default_factory=dict)
    token_times: list[tuple[float, int]] = field(default_factory=list)  # (time, tokens)
    storm: bool = False  # dropped by an abort storm or a cancel race

    @property
    def num_tokens(self) -> int:
        return sum(len(c.tokens) for c in self.choices.values())

    @property
    def text(self) -> str:
        """The first choice's text (all of an ``n: 1`` request's answer)."""
        return self.choices[0].text if 0 in self.choices else ""


def schedule(load: Load) -> list[Planned]:
    """The plan's requests in send order (deterministic in ``load.seed``)."""
    rng = random.Random(load.seed)
    p = load.prompts
    prefixes = [_words(rng, p.shared_prefix_words) for _ in range(p.shared_prefix_groups)]
    times, lengths = _arrivals(load, rng)
    weights = [s.weight for s in load.sampling]
    out = []
    for i, send_at in enumerate(times):
        kind = rng.choices(load.sampling, weights)[0]
        words, max_tokens = lengths[i] if lengths else (None, None)
        words = words or rng.randint(*p.words)
        text = _words(rng, words)
        if prefixes:
            text = f"{rng.choice(prefixes)} {text}"
        body: dict[str, Any] = {
            "prompt": text,
            "max_tokens": max_tokens or rng.randint(*(kind.output_tokens or p.output_tokens)),
            "temperature": kind.temperature,
            "top_p": kind.top_p,
            "logprobs": TOP_LOGPROBS,
            "return_tokens_as_token_ids": True,  # compared by id with the reference
            "n": kind.n,
        }
        if kind.seed:
            body["seed"] = rng.randrange(2**31)
        if kind.stop:
            body["stop"] = list(kind.stop)
        if kind.structured:
            body["structured_outputs"] = structured_outputs(kind.structured)
        stream = rng.random() < load.stream_fraction
        cancel = stream and rng.random() < load.cancel.fraction
        out.append(
            Planned(
                index=i,
                send_at=send_at,
                body=body,
                api_key=f"tenant-{rng.randrange(p.tenants)}",
                stream=stream,
                cancel_after=rng.randint(*load.cancel.after_tokens) if cancel else None,
                structured=kind.structured,
            )
        )
    return out


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _arrivals(load: Load, rng: random.Random) -> tuple[list[float], list[tuple[int, int]]]:
    """Send offsets, and per request (words, max_tokens) when a trace gives them."""
    a = load.arrivals
    if a.process == "trace":
        assert a.trace is not None
        times: list[float] = []
        lengths: list[tuple[int, int]] = []
        p = load.prompts
        with a.trace.open() as f:
            for line in f:
                row = json.loads(line)
                at = row["timestamp"] / 1000.0 / a.trace_speedup
                if at > a.duration_s or len(times) >= a.max_requests:
                    break
                times.append(at)
                # Real prompts (thousands of tokens) scaled into the plan's range.
                words = min(max(p.words[0], row["input_length"] // 100), p.words[1])
                out = min(max(p.output_tokens[0], row["output_length"]), p.output_tokens[1])
                lengths.append((words, out))
        return times, lengths
    if a.process == "closed":  # sent as clients free up: the order is all that is planned
        return [0.0] * a.max_requests, []
    times, t = [], 0.0
    while len(times) < a.max_requests:
        if a.process == "poisson":
            t += rng.expovariate(a.rate)
        else:  # gamma with mean 1 / rate
            t += rng.gammavariate(a.burstiness, 1.0 / (a.rate * a.burstiness))
        if t > a.duration_s:
            break
        times.append(t)
    return times, []


class Sender:
    """Sends requests against ``url`` and keeps every request's Outcome. Open streams can be
    dropped from outside (:meth:`drop`): an abort storm, a cancel race."""

    def __init__(
        self, url: str, model: str, hang_bound_s: float = 120.0, deadline_s: float | None = None
    ):
        self.url = url
        self.model = model
        self.hang_bound_s = hang_bound_s
        self.deadline_s = deadline_s
        self.outcomes: dict[int, Outcome] = {}
        self.open: dict[int, asyncio.Task[None]] = {}  # streams with at least one token
        self.max_dispatch_delay_s = 0.0
        self.stopping = False  # closed loops send nothing more (set from any thread)
        self._clients: dict[str, openai.AsyncOpenAI] = {}

    def client(self, api_key: str) -> openai.AsyncOpenAI:
        if api_key not in self._clients:
            headers = {"X-Request-Timeout": str(self.deadline_s)} if self.deadline_s else None
            # Plain HTTP has no certificate to verify, and loading the CA bundle costs ~50 ms of
            # CPU per client (send_one makes one per request): enough to slow a restarting
            # replica on a small machine.
            plain = self.url.startswith("http://")
            self._clients[api_key] = openai.AsyncOpenAI(
                base_url=f"{self.url}/v1",
                api_key=api_key,
                max_retries=0,  # the harness judges the server; a retrying client hides it
                timeout=openai.Timeout(self.hang_bound_s + (self.deadline_s or 0.0)),
                default_headers=headers,
                http_client=openai.DefaultAsyncHttpxClient(verify=False) if plain else None,
            )
        return self._clients[api_key]

    async def run(self, plan: list[Planned], start: float) -> None:
        """Send every request at its time (``start`` + offset); return when all ended."""
        tasks = []
        for item in plan:
            await asyncio.sleep(max(0.0, start + item.send_at - time.time()))
            self.max_dispatch_delay_s = max(
                self.max_dispatch_delay_s, time.time() - (start + item.send_at)
            )
            outcome = Outcome(item.index, scheduled=start + item.send_at)
            self.outcomes[item.index] = outcome
            tasks.append(asyncio.create_task(self._bounded(item, outcome)))
        await asyncio.gather(*tasks)

    async def run_closed(
        self, plan: Iterable[Planned], start: float, clients: int, duration_s: float
    ) -> None:
        """``clients`` loops, each sending the plan's next request as soon as its last one
        ended (0.1 s after a refused connection, as a client tries again), until
        ``duration_s`` after ``start`` or :attr:`stopping`; return when all ended."""
        queue = iter(plan)

        async def client() -> None:
            while time.time() < start + duration_s and not self.stopping:
                item = next(queue, None)
                if item is None:
                    return
                outcome = Outcome(item.index, scheduled=time.time())
                self.outcomes[item.index] = outcome
                await self._bounded(item, outcome)
                if outcome.refused:
                    await asyncio.sleep(0.1)

        await asyncio.sleep(max(0.0, start - time.time()))
        await asyncio.gather(*(client() for _ in range(clients)))

    def drop(self, indexes: list[int]) -> None:
        """The clients of these open streams hang up now."""
        for i in indexes:
            task = self.open.get(i)
            if task is not None:
                self.outcomes[i].storm = True
                task.cancel()

    async def _bounded(self, item: Planned, outcome: Outcome) -> None:
        bound = self.hang_bound_s + (self.deadline_s or 0.0)
        task = asyncio.create_task(self._send(item, outcome))
        done, _ = await asyncio.wait([task], timeout=bound)
        if not done:
            outcome.status = "hung"
            outcome.error = f"still open {bound:.0f} s after it was sent"
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            outcome.status = "hung"  # the cancellation above may have marked it otherwise

    async def _send(self, item: Planned, outcome: Outcome) -> None:
        client = self.client(item.api_key)
        # Fields the client does not declare (ignore_eos, ...) go as extra body fields.
        body = {k: v for k, v in item.body.items() if k != "prompt"}
        outcome.sent = time.time()
        try:
            if item.stream:
                await self._stream(client, item, body, outcome)
            else:
                reply = await client.completions.create(
                    model=self.model, prompt=item.body["prompt"], extra_body=body
                )
                outcome.response_id, outcome.seed = reply.id, _seed(reply)
                for choice in reply.choices:
                    _take(outcome, choice.index, choice.text, choice.logprobs, choice.finish_reason)
                outcome.first_token = outcome.finished = time.time()
                outcome.token_times.append((outcome.finished, outcome.num_tokens))
                outcome.status = "ok"
        except asyncio.CancelledError:
            outcome.status = "cancelled"
        except openai.APIStatusError as exc:
            outcome.status, outcome.http_status = "error", exc.status_code
            outcome.retry_after = exc.response.headers.get("retry-after")
            # An error's body has no id; the ingress's header names the response (and so its
            # attempts) of a request that failed before its first token.
            outcome.response_id = exc.response.headers.get("x-tandem-request-id")
            outcome.error_type = _error_type(exc.body)
            outcome.error = str(exc)[:300]
        except openai.APIError as exc:  # an error event in a stream, or a broken connection
            outcome.status = "error"
            outcome.refused = _refused(exc)
            outcome.error_type = _error_type(exc.body)
            outcome.error = f"{type(exc).__name__}: {exc}"[:300]
        finally:
            outcome.finished = outcome.finished or time.time()
            self.open.pop(item.index, None)

    async def _stream(
        self, client: openai.AsyncOpenAI, item: Planned, body: dict[str, Any], outcome: Outcome
    ) -> None:
        stream = await client.completions.create(
            model=self.model, prompt=item.body["prompt"], stream=True, extra_body=body
        )
        async with stream:
            async for chunk in stream:
                outcome.response_id, outcome.seed = chunk.id, _seed(chunk)
                before = outcome.num_tokens
                for choice in chunk.choices:
                    _take(outcome, choice.index, choice.text, choice.logprobs, choice.finish_reason)
                got = outcome.num_tokens - before
                if got:
                    now = time.time()
                    outcome.first_token = outcome.first_token or now
                    outcome.token_times.append((now, got))
                    task = asyncio.current_task()
                    assert task is not None
                    self.open[item.index] = task
                if item.cancel_after is not None and outcome.num_tokens >= item.cancel_after:
                    outcome.status = "cancelled"
                    return
        outcome.status = "ok"
        outcome.finished = time.time()


def requests_of(bodies: Iterable[dict[str, Any]], stream: bool = True) -> Iterator[Planned]:
    """Plain requests, each to be sent as soon as possible (open loop: all at once; closed
    loop: as a client frees up)."""
    for i, body in enumerate(bodies):
        yield Planned(i, 0.0, body, stream=stream)


class InThread:
    """A Sender's load on an event loop in a thread of its own, for synchronous callers (the
    benchmarks, the e2e tests): open loop (``clients`` None: each request at its ``send_at``)
    or ``clients`` closed-loop clients for at most ``duration_s``."""

    def __init__(
        self,
        sender: Sender,
        plan: Iterable[Planned],
        clients: int | None = None,
        duration_s: float = 24 * 3600.0,
    ) -> None:
        self.sender = sender
        if clients is None:
            work = sender.run(list(plan), time.time())
        else:
            work = sender.run_closed(plan, time.time(), clients, duration_s)
        self.thread = threading.Thread(target=asyncio.run, args=(work,), daemon=True)
        self.thread.start()

    def outcomes(self) -> list[Outcome]:
        """Every request sent so far (some may still be open), in plan order."""
        return [o for _, o in sorted(self.sender.outcomes.copy().items())]

    def join(self, timeout_s: float = 300.0) -> list[Outcome]:
        """Stop a closed loop's clients, wait for the requests still open; every outcome."""
        self.sender.stopping = True
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            raise TimeoutError(f"requests still open {timeout_s:.0f} s after the load ended")
        return self.outcomes()


def send_one(url: str, model: str, body: dict[str, Any], timeout_s: float = 120.0) -> Outcome:
    """One streaming request, sent now; its Outcome when it ended."""
    [outcome] = InThread(Sender(url, model, timeout_s), requests_of([body])).join(timeout_s + 10)
    return outcome


def _take(outcome: Outcome, index: int, text: str, logprobs: Any, finish: str | None) -> None:
    choice = outcome.choices.setdefault(index, ChoiceOut())
    choice.text += text
    if logprobs is not None:
        choice.tokens += logprobs.tokens or []
        choice.token_logprobs += logprobs.token_logprobs or []
        choice.top_logprobs += logprobs.top_logprobs or []
    choice.finish_reason = finish or choice.finish_reason


def _seed(reply: Any) -> int | None:
    seed = (reply.model_extra or {}).get("seed")
    return int(seed) if seed is not None else None


def _error_type(body: object) -> str | None:
    """The OpenAI error object's code or type, if the server sent one."""
    if isinstance(body, dict):
        error = body.get("error", body)
        if isinstance(error, dict):
            return error.get("code") or error.get("type")
    return None


def _refused(exc: BaseException | None) -> bool:
    """Whether ``exc`` came of a refused connection (somewhere down its chain of causes)."""
    while exc is not None:
        if isinstance(exc, ConnectionRefusedError):
            return True
        exc = exc.__cause__ or exc.__context__
    return False
