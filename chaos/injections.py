"""Each kind of plan fault and how it is done, in one registry keyed by the plan's ``kind``.

A kind is added in two places that cannot drift apart: its model in ``chaos.plan`` (which puts
it in ``fault_kinds()``) and its injection here (``@INJECTIONS.register``). The registry is
checked when this module is imported: a kind without an injection, or an injection for no
kind, stops every chaos run (and the unit tests) before any load is sent.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any

from chaos.inject import FaultEvent, InjectError
from chaos.plan import (
    AbortStorm,
    CancelRace,
    Churn,
    HangRouter,
    HangWorker,
    HostFault,
    KillIngress,
    KillRouter,
    KillWorker,
    KVFault,
    LoseDomain,
    SlowRouter,
    SlowWorker,
    Target,
    fault_kinds,
)

if TYPE_CHECKING:
    from chaos.run import ChaosRun

# (the run, the fault, the run's start) -> the event it made; None: it records its own (churn)
Injection = Callable[["ChaosRun", Any, float], Awaitable[FaultEvent | None]]
RACE_WAIT_S = 10.0  # a cancel race waits this long for a stream on its worker
STORM_WAIT_S = 30.0  # an abort storm waits this long for its open streams


class Registry:
    """Injections by fault kind; only the given ``kinds`` may be registered, each once."""

    def __init__(self, kinds: Iterable[str]) -> None:
        self.kinds = frozenset(kinds)
        self._by_kind: dict[str, Injection] = {}

    def register(self, *kinds: str) -> Callable[[Injection], Injection]:
        def add(injection: Injection) -> Injection:
            for kind in kinds:
                if kind not in self.kinds:
                    raise TypeError(f"{injection.__name__}: no plan fault has kind {kind!r}")
                if kind in self._by_kind:
                    raise TypeError(f"{kind!r} has two injections")
                self._by_kind[kind] = injection
            return injection

        return add

    def check_complete(self) -> None:
        """Raises TypeError naming each kind that has no injection."""
        missing = sorted(self.kinds - self._by_kind.keys())
        if missing:
            raise TypeError(f"plan fault kinds without an injection: {', '.join(missing)}")

    def __getitem__(self, kind: str) -> Injection:
        return self._by_kind[kind]


INJECTIONS = Registry(fault_kinds())


@INJECTIONS.register("kill_worker")
async def kill_worker(run: ChaosRun, fault: KillWorker, start: float) -> FaultEvent:
    worker = run.injector.pick(fault.target)
    if fault.phase is None:
        return await run.injector.kill_worker(worker)
    rest = start + run.plan.load.arrivals.duration_s - time.time()
    return await run.injector.kill_at_phase(worker, fault.phase, max(rest, 5.0))


@INJECTIONS.register("hang_worker")
async def hang_worker(run: ChaosRun, fault: HangWorker, start: float) -> FaultEvent:
    return await run.injector.hang_worker(run.injector.pick(fault.target), fault.duration_s)


@INJECTIONS.register("slow_worker")
async def slow_worker(run: ChaosRun, fault: SlowWorker, start: float) -> FaultEvent:
    worker = run.injector.pick(fault.target)
    return await run.injector.slow_worker(
        worker, fault.duration_s, fault.stopped_share, fault.period_s
    )


@INJECTIONS.register("hang_router")
async def hang_router(run: ChaosRun, fault: HangRouter, start: float) -> FaultEvent:
    return await run.injector.hang_router(fault.duration_s)


@INJECTIONS.register("slow_router")
async def slow_router(run: ChaosRun, fault: SlowRouter, start: float) -> FaultEvent:
    return await run.injector.slow_router(fault.duration_s, fault.stopped_share, fault.period_s)


@INJECTIONS.register("kv_fault")
async def kv_fault(run: ChaosRun, fault: KVFault, start: float) -> FaultEvent:
    worker = run.injector.pick(fault.target)
    return await run.injector.kv_fault(worker, fault.action, fault.transfers, fault.stall_s)


@INJECTIONS.register("kill_router")
async def kill_router(run: ChaosRun, fault: KillRouter, start: float) -> FaultEvent:
    return await run.injector.kill_router()


@INJECTIONS.register("kill_ingress")
async def kill_ingress(run: ChaosRun, fault: KillIngress, start: float) -> FaultEvent:
    return await run.injector.kill_ingress(run.url)


@INJECTIONS.register("abort_storm")
async def abort_storm(run: ChaosRun, fault: AbortStorm, start: float) -> FaultEvent:
    """Drop ``fraction`` of the open streams at once (once ``min_open`` are open)."""
    sender = run.sender
    until = time.time() + STORM_WAIT_S
    while len(sender.open) < fault.min_open:
        if time.time() >= until:
            raise InjectError(f"only {len(sender.open)} streams open, {fault.min_open} wanted")
        await asyncio.sleep(0.05)
    open_now = sorted(sender.open)
    dropped = run.injector.rng.sample(open_now, math.ceil(fault.fraction * len(open_now)))
    sender.drop(dropped)
    event = FaultEvent(
        "abort_storm", time.time(), everyone=True, detail=f"{len(dropped)} of {len(open_now)}"
    )
    return run.injector.record(event)


@INJECTIONS.register("cancel_race")
async def cancel_race(run: ChaosRun, fault: CancelRace, start: float) -> FaultEvent:
    """Drop up to ``streams`` open streams decoding on the target as it is killed (waiting
    up to RACE_WAIT_S for one to be there)."""
    worker = run.injector.pick(fault.target)
    until = time.time() + RACE_WAIT_S
    while True:
        await run.read_decisions()
        on_it = [i for i in sorted(run.sender.open) if run.decoding_on(i, worker.name)]
        if on_it or time.time() >= until:
            break
        await asyncio.sleep(0.05)
    run.sender.drop(on_it[: fault.streams])
    event = await run.injector.kill_worker(worker, kind="cancel_race")
    event.detail = f"{len(on_it[: fault.streams])} streams dropped"
    return event


@INJECTIONS.register("churn")
async def churn(run: ChaosRun, fault: Churn, start: float) -> None:
    """A random worker of ``roles`` killed every ``every_s``, for ``for_s`` (or until the
    load ends and the run cancels it)."""
    until = time.time() + fault.for_s
    while time.time() < until:
        worker = run.injector.pick(Target(), roles=fault.roles)
        try:
            event = await run.injector.kill_worker(worker, kind="churn")
            run.say(f"churn: killed {worker.name}")
        except InjectError as exc:  # still restarting from the last kill
            run.inject_errors.append(f"churn: {exc}")
            continue
        await asyncio.sleep(max(0.0, event.at + fault.every_s - time.time()))


@INJECTIONS.register("kill_host")
async def kill_host(run: ChaosRun, fault: HostFault, start: float) -> FaultEvent:
    hosts = run.injector.hosts(fault.host)
    return await run.injector.kill_hosts("kill_host", hosts, fault.duration_s, fault.busy_s)


@INJECTIONS.register("partition_host")
async def partition_host(run: ChaosRun, fault: HostFault, start: float) -> FaultEvent:
    [host] = run.injector.hosts(fault.host)
    return await run.injector.partition_host(host, fault.duration_s, fault.busy_s)


@INJECTIONS.register("lose_domain")
async def lose_domain(run: ChaosRun, fault: LoseDomain, start: float) -> FaultEvent:
    hosts = run.injector.hosts(domain=fault.domain)
    return await run.injector.kill_hosts("lose_domain", hosts, fault.duration_s, fault.busy_s)


INJECTIONS.check_complete()
