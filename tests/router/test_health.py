"""The router's failure detector tells its own pauses from a worker's silence, and marks a
silent worker FAILED only when a direct probe agrees (router/health.py, contracts/pause.py, P16)."""

from __future__ import annotations

import asyncio
import time

import pytest
from test_admission import WORKERS, info, load

from contracts.pause import PauseClock
from contracts.roles import Role
from router.actor import RouterActor
from router.config import RouterConfig
from router.health import FIRST_LOOK_POLL_S, Judgement, SilenceWatch


class StillClock:
    """A PauseClock's answer, set by the test: the router last resumed at ``awake``."""

    def __init__(self, awake: float) -> None:
        self.awake = awake

    def awake_since(self) -> float:
        return self.awake


def test_a_pause_of_the_clock_is_a_late_wake_and_busy_noise_is_not() -> None:
    """The loop blocked 0.8 s (as a SIGSTOP or a GC pause blocks it) is a pause, noticed even
    before the clock's own tick runs; blocked 0.1 s is noise."""

    async def body() -> None:
        clock = PauseClock(tick_s=0.02, pause_s=0.3)
        clock.start()
        await asyncio.sleep(0.05)
        started = clock.awake_since()
        time.sleep(0.1)
        assert clock.awake_since() == started and clock.pauses == 0
        await asyncio.sleep(0.05)
        time.sleep(0.8)
        resumed = time.monotonic()
        assert clock.awake_since() >= resumed - 0.01  # before any tick ran
        assert clock.pauses == 1 and 0.7 < clock.longest_s < 1.0
        await asyncio.sleep(0.1)
        assert clock.pauses == 1  # the tick that ran late counts the same pause once

    asyncio.run(body())


def test_silence_is_probed_at_half_the_timeout_and_failed_only_with_the_probe_unanswered() -> None:
    clock = StillClock(awake=0.0)
    watch = SilenceWatch(timeout_s=4.0, clock=clock)  # type: ignore[arg-type]
    watch.last_seen["w"] = 10.0
    assert watch.judge("w", 11.9) is Judgement.FINE
    assert watch.judge("w", 12.1) is Judgement.PROBE  # half the timeout: ask it
    assert watch.probes["w"] == 12.1
    assert watch.judge("w", 12.2) is Judgement.FINE  # one probe, not one per tick
    assert watch.judge("w", 14.05) is Judgement.FAIL  # timeout, probe out for 1.95 s
    watch.heard("w")  # a late report, or the probe's answer, clears it
    assert "w" not in watch.probes
    assert watch.judge("never", 99.0) is Judgement.FINE  # never heard: not judged


def test_a_pause_restarts_every_silence_and_voids_the_probes_sent_before_it() -> None:
    """The router paused from 11.5 to 20.0: a worker last heard at 10.0 is silent for the
    router's awake time since 20.0 only; its probe from before the pause does not count (its
    answer may be queued behind the pause), a new one goes out."""
    clock = StillClock(awake=0.0)
    watch = SilenceWatch(timeout_s=2.0, clock=clock)  # type: ignore[arg-type]
    watch.last_seen["w"] = 10.0
    assert watch.judge("w", 11.1) is Judgement.PROBE
    clock.awake = 20.0  # resumed
    assert watch.silence_s("w", 20.5) == 0.5
    assert watch.judge("w", 20.5) is Judgement.FINE  # without the clock: silent 10.5 s, FAIL
    assert watch.judge("w", 21.1) is Judgement.PROBE  # a probe sent after the pause
    assert watch.judge("w", 22.0) is Judgement.FINE  # silent 2.0 s: not past the timeout
    assert watch.judge("w", 22.2) is Judgement.FAIL


def test_the_probe_wait_is_never_cut_short_by_a_late_first_probe() -> None:
    """A probe sent late (the monitor ran late) gets its minimum wait before a FAIL."""
    watch = SilenceWatch(timeout_s=4.0, clock=StillClock(awake=0.0))  # type: ignore[arg-type]
    watch.last_seen["w"] = 0.0
    assert watch.judge("w", 4.3) is Judgement.PROBE
    assert watch.judge("w", 4.6) is Judgement.FINE  # 0.3 s < PROBE_MIN_WAIT_S
    assert watch.judge("w", 4.81) is Judgement.FAIL


def _silent_router(answer: object) -> RouterActor:
    """Two workers, heartbeat timeout 0.2 s; decode-0's probe gets ``answer`` (a tuple to
    return, an exception to raise, None: never answers)."""
    actor = RouterActor(WORKERS, RouterConfig(), heartbeat_timeout_s=0.2, namespace="test")

    async def ask(name: str) -> tuple[str, bool]:
        if answer is None:
            await asyncio.Event().wait()
        if isinstance(answer, BaseException):
            raise answer
        return answer  # type: ignore[return-value]

    actor.probes.ask = ask
    return actor


async def _decode_silent_for(actor: RouterActor, seconds: float) -> None:
    """Both workers report once, then only prefill-0 keeps reporting."""
    for name, role, _ in WORKERS:
        await actor.report(info(name, role), load(name), [], resync=True)
    until = time.time() + seconds
    while time.time() < until:
        await actor.report(info("prefill-0", Role.PREFILL), load("prefill-0"), [], resync=False)
        await asyncio.sleep(0.02)


def test_a_silent_worker_that_answers_its_probe_is_not_failed() -> None:
    async def body() -> None:
        actor = _silent_router(("i1", True))
        await _decode_silent_for(actor, 1.0)  # five timeouts
        assert not any(s.failed for s in await actor.worker_states())
        events = [(e["worker"], e["event"]) for e in await actor.health_events()]
        assert ("decode-0", "probed") in events and ("decode-0", "failed") not in events
        assert await actor.failures_detected() == {}

    asyncio.run(asyncio.wait_for(body(), 10))


def test_a_silent_worker_is_failed_by_an_unanswered_dead_or_unresponsive_probe() -> None:
    cases = [
        (None, "heartbeat", "silent for "),
        (RuntimeError("actor died"), "probe", "a direct probe failed: RuntimeError"),
        (("i1", False), "probe", "its engine does not answer"),
        (("i2", True), "restart", "restarted"),
    ]
    for answer, how, why in cases:

        async def body(answer: object = answer, how: str = how, why: str = why) -> None:
            actor = _silent_router(answer)
            await _decode_silent_for(actor, 0.6)
            assert [s.failed for s in await actor.worker_states()] == [False, True], answer
            failed = [e for e in await actor.health_events() if e["event"] == "failed"]
            assert [e["worker"] for e in failed] == ["decode-0"]
            assert failed[0]["why"].startswith(why), failed[0]["why"]
            assert await actor.failures_detected() == {how: 1}

        asyncio.run(asyncio.wait_for(body(), 10))


def test_a_restarted_routers_first_look_fails_a_worker_ray_is_restarting_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A router restarted by Ray learns of a worker that died while it was down from Ray's
    actor table (RESTARTING) within FIRST_LOOK_POLL_S, not at the end of its first look; a
    worker that reports is never failed; one neither reporting nor restarting is failed at the
    end of the look, as before."""
    monkeypatch.setattr("router.health.FIRST_LOOK_MIN_S", 1.0)

    async def body(restarting: set[str]) -> tuple[float, str]:
        actor = RouterActor(WORKERS, RouterConfig(), heartbeat_timeout_s=0.2, namespace="test")
        start = time.monotonic()

        async def table(names: list[str]) -> set[str]:
            assert sorted(names) == ["decode-0", "prefill-0"]
            return restarting if time.monotonic() - start > 0.3 else set()

        actor.probes.restarting = table
        look = asyncio.ensure_future(actor.probes.first_look(["prefill-0", "decode-0"], None))
        seen = None  # when decode-0's FAILED mark was first there
        while not look.done():  # prefill-0 reports throughout
            await actor.report(info("prefill-0", Role.PREFILL), load("prefill-0"), [], True)
            if seen is None and any(s.failed for s in await actor.worker_states()):
                seen = time.monotonic() - start
            await asyncio.sleep(0.02)
        await look
        failed = [e for e in await actor.health_events() if e["event"] == "failed"]
        assert [e["worker"] for e in failed] == ["decode-0"]
        return seen if seen is not None else time.monotonic() - start, failed[0]["why"]

    after, why = asyncio.run(asyncio.wait_for(body({"decode-0"}), 10))
    assert 0.3 < after < 0.3 + 2 * FIRST_LOOK_POLL_S + 0.2 and why.startswith("Ray is restarting")
    after, why = asyncio.run(asyncio.wait_for(body(set()), 10))
    assert after >= 1.0 and why.startswith("neither reported nor connected")
