"""One chaos run: the plan's load sent to a live Tandem while its faults are done to the
cluster, then every check (docs/design.md#chaos).

::

    baseline: every worker idle ── load (open loop) ─────────────────────┐ settle: every pool
                                   faults at their times ──> FaultEvents  │ back to baseline
    router's decisions and health log, polled ───────────────────────────┘ records, reference
                                                                              └─> Summary
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import ray

from chaos import sabotage as sab
from chaos import verdict as v
from chaos.inject import FaultEvent, InjectError, Injector, Worker
from chaos.injections import INJECTIONS
from chaos.load import Outcome, Planned, Sender, schedule
from chaos.plan import ChaosPlan, Checks, Churn, Fault
from chaos.probe import metric
from chaos.reference import Expected, expected, reference_engine, transformers_greedy
from contracts.actors import RouterClient, WorkerClient
from contracts.roles import NAMESPACE, ROUTER_NAME
from router.health import FIRST_LOOK_MIN_S
from tandem.launch import cluster_key, model_dir_of
from tandem.testbed import Testbed
from tandem.topology import Topology

Say = Callable[[str], None]


class ClusterMismatch(ValueError):
    """The cluster a run joined was not started from its topology and model."""


POLL_S = 0.5
WORKER_KILLS = ("kill_worker", "churn", "cancel_race")  # a worker actor's process killed
PROGRESS_S = 5.0  # between progress lines
WARMUP_S = 5.0  # the first seconds of load are not a steady window


class ChaosRun:
    """Runs ``plan`` against the Tandem serving ``url`` (Ray already initialised, joined to
    its cluster), started from ``topology``."""

    def __init__(
        self,
        plan: ChaosPlan,
        topology: Topology,
        url: str,
        say: Say,
        bed: Testbed | None = None,
        sabotage: list[sab.Kind] | None = None,
    ) -> None:
        if plan.checks.transformers_greedy and topology.model.dtype != "float32":
            raise ValueError(
                f"plan {plan.name!r} checks greedy outputs against transformers, exact only in "
                f"float32: run it on a float32 topology (this one: {topology.model.dtype})"
            )
        self.plan = plan
        self.topology = topology
        self.url = url
        self.say = say
        self.router = RouterClient(ray.get_actor(ROUTER_NAME, namespace=NAMESPACE))
        self.workers = [
            Worker(
                s.name, s.role, s.domain, WorkerClient(ray.get_actor(s.name, namespace=NAMESPACE))
            )
            for s in topology.workers()
        ]
        self.injector = Injector(self.workers, plan.load.seed, bed)
        self.sender = Sender(
            url, topology.model.name, plan.checks.hang_bound_s, plan.load.deadline_s
        )
        self.attempts: dict[str, v.Attempt] = {}
        self.inject_errors: list[str] = []
        self.stalled_s = 0.0  # the longest this client's event loop did not run (progress)
        self.health: list[dict[str, Any]] = []
        roles = [(w.name, w.role) for w in self.workers]
        self.planted = sab.arm(
            sabotage or [], sab.decoders(roles), plan.checks, topology.retry.max_attempts
        )

    # -- the run -------------------------------------------------------------------------------

    async def run(self) -> v.Summary:
        await self._same_cluster()
        await self._all_idle("before the run")
        await self._plant()
        totals_before = _totals(self.url)
        plan = schedule(self.plan.load)
        a = self.plan.load.arrivals
        load = f"{a.concurrency} clients" if a.process == "closed" else f"{len(plan)} requests"
        self.say(f"{load} over {a.duration_s:g} s, {len(self.plan.faults)} faults")
        start = time.time() + 1.0
        poller = asyncio.create_task(self._poll_decisions())
        progress = asyncio.create_task(self._progress(start, len(plan)))
        faults = [asyncio.create_task(self._fault(f, start)) for f in self.plan.faults]
        arrivals = self.plan.load.arrivals
        if arrivals.process == "closed":
            await self.sender.run_closed(plan, start, arrivals.concurrency, arrivals.duration_s)
            plan = [p for p in plan if p.index in self.sender.outcomes]
        else:
            await self.sender.run(plan, start)
        load_end = time.time()
        for task in faults:  # a fault still going (churn, a phase nobody reached) ends here
            if not task.done():
                task.cancel()
        await asyncio.gather(*faults, return_exceptions=True)
        self.injector.close()
        progress.cancel()
        self.say("load done; waiting for every pool to return to its baseline")
        leaks = await self._check_idle(self.plan.checks.settle_s)
        poller.cancel()
        await asyncio.gather(poller, progress, return_exceptions=True)
        await self.read_decisions()
        self.health = await _ask(self.router.health_events(), [])
        records = await self._records()
        totals_after = _totals(self.url)
        fired = await self._fired()
        self.say("computing the fault-free reference")
        outcomes = [self.sender.outcomes[p.index] for p in plan]
        answers = self._reference(plan, outcomes)
        hf = self._transformers(plan)
        if self.planted:  # a leaked block comes back, a held stream ends: leave the cluster clean
            await self._all_idle("after the sabotage (its leak returned)")
        return self._summary(
            hf,
            fired,
            plan,
            outcomes,
            answers,
            start,
            load_end,
            leaks,
            records,
            (totals_before, totals_after),
        )

    async def _fault(self, fault: Fault, start: float) -> None:
        await asyncio.sleep(max(0.0, start + fault.at_s - time.time()))
        try:
            event = await INJECTIONS[fault.kind](self, fault, start)
            if event is not None:
                self.say(f"fault: {event.kind} {' '.join(event.workers)} {event.detail}".rstrip())
        except InjectError as exc:
            self.inject_errors.append(f"{fault.kind} at {fault.at_s:g} s: {exc}")
            self.say(f"fault not done: {fault.kind}: {exc}")
        except Exception as exc:  # a bug, or the cluster refusing: the run says so
            self.inject_errors.append(f"{fault.kind} at {fault.at_s:g} s: {exc!r}")
            self.say(f"fault failed: {fault.kind}: {exc!r}")
        except asyncio.CancelledError:  # the load ended first (churn: its period did)
            if not isinstance(fault, Churn):
                why = "armed, but nothing reached it before the load ended"
                self.inject_errors.append(f"{fault.kind} at {fault.at_s:g} s: {why}")
            raise

    async def _same_cluster(self) -> None:
        """Refuse a cluster started from another topology or model than the reference is
        built from (the router's cluster key): its answers could not be judged."""
        key = cluster_key(self.topology, model_dir_of(self.topology))
        running = await _ask(self.router.key(), None, 60.0)
        if running != key:
            raise ClusterMismatch(
                f"the cluster runs another topology or model (key {running}) than the "
                f"reference would be built from (key {key}): give its --topology"
            )

    async def _plant(self) -> None:
        """Arm each sabotage of a self-test (chaos.sabotage) before the load."""
        clients = {w.name: w.client for w in self.workers}
        for p in self.planted:
            for worker, fault in p.faults:
                await clients[worker].add_faults([fault])
            self.say(f"sabotage armed: {p.kind} on {p.worker}")

    async def _fired(self) -> dict[str, list[Any]]:
        """Each worker's fired faults (where a sabotage hit), when sabotage was armed."""
        if not self.planted:
            return {}
        return {w.name: await _ask(w.client.faults_fired(), []) for w in self.workers}

    def decoding_on(self, index: int, worker: str) -> bool:
        """Whether request ``index``'s latest attempt decodes on ``worker``."""
        attempts = self._attempts_of(self.sender.outcomes[index].response_id)
        return bool(attempts) and attempts[-1].decode == worker

    async def _progress(self, start: float, total: int) -> None:
        """A line every PROGRESS_S; one that comes late says this client stalled (its event
        loop did not run: the load it should have sent meanwhile left late)."""
        while True:
            asked = time.time()
            await asyncio.sleep(PROGRESS_S)
            late = time.time() - asked - PROGRESS_S
            if late > 1.0:
                self.stalled_s = max(self.stalled_s, late)
            states = Counter(o.status for o in self.sender.outcomes.values())
            self.say(
                f"t={time.time() - start:5.1f} s  sent {len(self.sender.outcomes)}/{total}  "
                + "  ".join(f"{k} {n}" for k, n in sorted(states.items()))
                + (f"  (this client stalled {late:.1f} s)" if late > 1.0 else "")
            )

    # -- what the cluster says -----------------------------------------------------------------

    async def _poll_decisions(self) -> None:
        while True:
            await self.read_decisions()
            await asyncio.sleep(POLL_S)

    async def read_decisions(self) -> None:
        for line in await _ask(self.router.decisions(), []):
            self.attempts[line["request_id"]] = v.Attempt(
                line["request_id"], line["client_request_id"], line["prefill"], line["decode"]
            )

    def _attempts_of(self, response_id: str | None) -> list[v.Attempt]:
        if response_id is None:
            return []
        return [a for a in self.attempts.values() if a.response_id == response_id]

    async def _all_idle(self, when: str) -> None:
        leaks = await self._check_idle(60.0)
        if leaks:
            raise RuntimeError(f"the cluster is not idle {when}: {leaks}")

    async def _check_idle(self, timeout_s: float) -> dict[str, str]:
        """Each worker's leak check (nothing running, every pool at its baseline, no lease
        held), retried until ``timeout_s``; the workers that still fail it, and why."""
        until = time.time() + timeout_s
        leaks: dict[str, str] = {}
        for w in self.workers:
            while True:
                try:
                    left = max(1.0, until - time.time())
                    await asyncio.wait_for(w.client.check_idle(), timeout=left)
                    leaks.pop(w.name, None)
                    break
                except Exception as exc:
                    cause = getattr(exc, "cause", None) or exc  # a RayTaskError's: the worker's
                    leaks[w.name] = f"{type(cause).__name__}: {str(cause)[:200]}"
                    if time.time() >= until:
                        break
                    await asyncio.sleep(1.0)
        return leaks

    async def _records(self) -> dict[str, list[dict[str, Any]]]:
        out = {}
        for w in self.workers:
            rows = await _ask(w.client.records(), [])
            out[w.name] = [{**asdict(r), "status": r.status.value} for r in rows]
        return out

    def _reference(self, plan: list[Any], outcomes: list[Outcome]) -> list[list[Any]]:
        engine = reference_engine(self.topology, model_dir_of(self.topology))
        return expected(engine, [(p.body, o.seed) for p, o in zip(plan, outcomes, strict=True)])

    # -- the verdict ---------------------------------------------------------------------------

    def _summary(
        self,
        hf: list[list[str] | None],
        fired: dict[str, list[Any]],
        plan: list[Planned],
        outcomes: list[Outcome],
        answers: list[list[Expected]],
        start: float,
        load_end: float,
        leaks: dict[str, str],
        records: dict[str, list[dict[str, Any]]],
        totals: tuple[Totals | None, Totals | None],
    ) -> v.Summary:
        events = self._events(load_end)
        rows: list[dict[str, Any]] = []
        ran: list[tuple[Outcome, list[v.Attempt], bool]] = []
        for p, o, want in zip(plan, outcomes, answers, strict=True):
            attempts = self._attempts_of(o.response_id)
            why = v.mismatch(o, want) if o.status != "pending" else None
            touched = v.touched_by(o, attempts, events)
            ran.append((o, attempts, bool(touched)))
            rows.append(
                {
                    "index": o.index,
                    "status": o.status,
                    "planned_cancel": p.cancel_after is not None,
                    "storm": o.storm,
                    "http": o.http_status,
                    "error_type": o.error_type,
                    "error": o.error,
                    "response_id": o.response_id,
                    "ttft_s": None if o.first_token is None else o.first_token - o.scheduled,
                    "tokens": o.num_tokens,
                    "attempts": [[a.prefill, a.decode] for a in attempts],
                    "touched": touched,
                    "mismatch": why,
                    "structured": p.structured,
                    "invalid": v.invalid_output(o, p.structured) if p.structured else None,
                }
            )
        faults = self._fault_rows(events, outcomes, rows, start, load_end)
        strand = v.stranded(events, self.attempts, records, self._block_size())
        missing, repeated = v.terminal_records(ran, records, events)
        checks = self._checks(
            plan,
            outcomes,
            rows,
            faults,
            events,
            leaks,
            (missing, repeated),
            strand,
            totals,
            start,
        )
        if self.plan.checks.transformers_greedy:
            checks.append(self._transformers_check(outcomes, hf, rows))
        checks += v.structured_checks(plan, outcomes, rows)
        by_attempt = {
            a.attempt_id: row
            for row, (_, attempts, _) in zip(rows, ran, strict=True)
            for a in attempts
        }
        self._judge_sabotage(
            fired, {c.name: c.passed for c in checks}, by_attempt, leaks, missing, repeated
        )
        counts = dict(Counter(o.status for o in outcomes))
        judged = [r for r in rows if not r["planned_cancel"] and not r["storm"]]
        counts.update(
            requests=len(outcomes),
            touched=sum(bool(r["touched"]) for r in rows),
            planned_cancels=sum(r["planned_cancel"] for r in rows),
            storm_dropped=sum(r["storm"] for r in rows),
            mismatched=sum(r["mismatch"] is not None for r in rows),
            structured=sum(r["structured"] is not None for r in rows),
            invalid=sum(r["invalid"] is not None for r in rows),
            non_targeted=sum(not r["touched"] for r in judged),
            non_targeted_ok=sum(not r["touched"] and r["status"] == "ok" for r in judged),
            tokens=sum(o.num_tokens for o in outcomes),
        )
        bad = [r for r in rows if r["status"] in ("error", "hung") or r["mismatch"] or r["invalid"]]
        return v.Summary(
            plan=self.plan.name,
            verdict=all(ch.passed for ch in checks),
            checks=checks,
            faults=faults,
            counts=counts,
            stranded={
                "attempts": strand.attempts,
                "block_seconds": strand.block_seconds,
                "per_block_s": strand.per_block_s,
                "worst_s": strand.worst_s,
            },
            max_dispatch_delay_s=self.sender.max_dispatch_delay_s,
            timeline=v.timeline(outcomes, start, max(load_end, start + 1.0)),
            failures=bad[:50],
            requests=rows,
            health=[{**h, "t": h["at"] - start} for h in self.health],
            sabotage=[p.as_dict() for p in self.planted],
        )

    def _transformers(self, plan: list[Planned]) -> list[list[str] | None]:
        """transformers' greedy tokens per request (plan.checks.transformers_greedy), else
        none."""
        if not self.plan.checks.transformers_greedy:
            return [None] * len(plan)
        self.say("generating the greedy requests' tokens with transformers (float32)")
        return transformers_greedy(model_dir_of(self.topology), [p.body for p in plan])

    @staticmethod
    def _transformers_check(
        outcomes: list[Outcome], hf: list[list[str] | None], rows: list[dict[str, Any]]
    ) -> v.Check:
        """Each greedy request against transformers (the reason lands on its row)."""
        judged = bad = 0
        for o, names, row in zip(outcomes, hf, rows, strict=True):
            if names is None or o.status == "pending":
                continue
            judged += 1
            why = v.differs_from_transformers(o, names)
            if why is not None:
                bad += 1
                row["mismatch"] = row["mismatch"] or f"transformers: {why}"
        return v.Check(
            "greedy outputs equal transformers' (float32)",
            bad == 0 and judged > 0,
            f"{bad} of {judged} greedy requests differ",
            "0 (and some judged)",
        )

    def _judge_sabotage(
        self,
        fired: dict[str, list[Any]],
        passed: dict[str, bool],
        by_attempt: dict[str, dict[str, Any]],
        leaks: dict[str, str],
        missing: list[str],
        repeated: list[str],
    ) -> None:
        """Where each planted sabotage fired (its first fault's attempt), and whether the
        verdict caught it."""
        for p in self.planted:
            worker, armed = p.faults[0]
            hits = [
                f.hit
                for f in fired.get(worker, [])
                if (f.action, f.attempt, f.at) == (armed.action, armed.attempt, armed.at)
            ]
            p.attempt = hits[0] if hits else None
        sab.judge(self.planted, passed, by_attempt, leaks, missing, repeated)

    def _events(self, load_end: float) -> list[FaultEvent]:
        """The faults done, in order; a worker fault lasts until the router had the worker up
        again (or the load's end)."""
        events = sorted(self.injector.events, key=lambda e: e.at)
        for e in events:
            if e.workers and e.until is None:
                ups = [
                    h["at"]
                    for h in self.health
                    if h["event"] == "up" and h["worker"] in e.workers and h["at"] > e.at
                ]
                e.until = min(ups) if ups else load_end
        return events

    def _block_size(self) -> int:
        return min(p.engine.block_size for p in self.topology.pools.by_role().values())

    def _fault_rows(
        self,
        events: list[FaultEvent],
        outcomes: list[Outcome],
        rows: list[dict[str, Any]],
        start: float,
        load_end: float,
    ) -> list[v.FaultRow]:
        out = []
        for e in events:
            steady, recovered = v.recovery_s(outcomes, e.at, start + WARMUP_S, load_end)
            tag = v.fault_tag(e)
            hit = [r for r in rows if tag in r["touched"]]
            out.append(
                v.FaultRow(
                    kind=e.kind,
                    at_s=e.at - start,
                    workers=e.workers,
                    detail=e.detail,
                    detect_s=v.detection_s(e, self.health, events) if e.workers else None,
                    recovery_s=recovered,
                    steady_tokens_per_s=steady.tokens_per_s,
                    steady_ttft_p99=steady.ttft_p99,
                    touched=len(hit),
                    touched_ok=sum(r["status"] == "ok" for r in hit),
                    lasted_s=None if e.until is None else e.until - e.at,
                    router_down=bool(v.router_outages_over(e, events)),
                )
            )
        return out

    def _checks(
        self,
        plan: list[Planned],
        outcomes: list[Outcome],
        rows: list[dict[str, Any]],
        faults: list[v.FaultRow],
        events: list[FaultEvent],
        leaks: dict[str, str],
        record_faults: tuple[list[str], list[str]],
        strand: v.Stranded,
        totals: tuple[Totals | None, Totals | None],
        start: float,
    ) -> list[v.Check]:
        c = self.plan.checks
        hung = sum(r["status"] == "hung" for r in rows)
        mismatched = sum(r["mismatch"] is not None for r in rows)
        untyped = _untyped(rows)
        judged = [r for r in rows if not r["planned_cancel"] and not r["storm"]]
        clean = [r for r in judged if not r["touched"]]
        clean_ok = sum(r["status"] == "ok" for r in clean)
        success = clean_ok / len(clean) if clean else 1.0
        heartbeat = self.topology.heartbeat_timeout_s
        late = _late_detections(faults, c, heartbeat)
        worst = max((f.detect_s for f in faults if f.detect_s is not None), default=0.0)
        missing, repeated = record_faults
        blamed = v.false_alarms(events, [h for h in self.health if h["at"] >= start])
        failed = sum(r["status"] == "error" for r in judged)
        checks = [
            v.Check("no request hung", hung <= c.max_hung, f"{hung} hung", f"<= {c.max_hung}"),
            v.Check(
                "outputs equal the reference",
                mismatched <= c.max_mismatches,
                f"{mismatched} mismatched",
                f"<= {c.max_mismatches}",
            ),
            v.Check("every error is typed", not untyped, f"{untyped} untyped", "0"),
            v.Check(
                "pools and leases back to baseline",
                not leaks,
                f"{len(leaks)} workers not at baseline" + (f": {leaks}" if leaks else ""),
                f"within {c.settle_s:g} s",
            ),
            v.Check(
                "one terminal record per attempt on each worker",
                not repeated and not missing,
                f"{len(repeated)} repeated, {len(missing)} missing"
                + (f": {(repeated + missing)[:4]}" if repeated or missing else ""),
                "0",
            ),
            v.Check(
                "non-targeted requests succeed",
                success >= c.min_non_targeted_success,
                f"{clean_ok}/{len(clean)} = {success:.4f}",
                f">= {c.min_non_targeted_success}",
            ),
            v.Check(
                "no worker marked FAILED without a fault",
                not blamed,
                f"{len(blamed)} false alarms" + (f": {blamed[:4]}" if blamed else ""),
                "0",
            ),
            v.Check(
                "failed requests, touched or not",
                c.max_failed is None or failed <= c.max_failed,
                f"{failed} failed",
                "any" if c.max_failed is None else f"<= {c.max_failed}",
            ),
            v.Check(
                "faults detected in time",
                not late,
                f"worst {worst:.2f} s" + (f"; late: {late}" if late else ""),
                f"kill <= {c.max_detect_kill_s:g} s, "
                f"hang <= {heartbeat:g} + {c.max_detect_hang_margin_s:g} s; "
                f"during a router restart: a worker kill <= {c.max_detect_kill_s:g} + 1 s, "
                f"else <= {max(heartbeat, FIRST_LOOK_MIN_S):g} + "
                f"{c.max_detect_hang_margin_s:g} + 1 s",
            ),
            v.Check(
                "KV held for a dead peer",
                strand.worst_s <= c.max_stranded_s,
                f"{strand.attempts} attempts, {strand.block_seconds:.1f} block-s, "
                f"worst {strand.worst_s:.2f} s",
                f"<= {c.max_stranded_s:g} s per block",
            ),
            v.Check(
                "every fault was done",
                not self.inject_errors,
                "; ".join(self.inject_errors) or f"{len(events)} done",
                "all",
            ),
            v.on_schedule(self.sender.max_dispatch_delay_s, self.stalled_s, c.max_dispatch_delay_s),
        ]
        return checks + _optional_checks(c, plan, outcomes, faults, events, totals)


def _late_detections(faults: list[v.FaultRow], c: Checks, heartbeat_s: float) -> list[str]:
    """The faults not detected within their limit: a killed process's, or a hang's (the
    heartbeat timeout and a margin) -- and one done while the router was down, timed from the
    router's return, plus a second, as the new router's first look (router/health.py) starts at
    its first call: a killed worker's within the kill limit (the look reads Ray's actor table,
    which shows it RESTARTING), anything else by its silence (the look's length and the
    margin)."""
    hang_limit = heartbeat_s + c.max_detect_hang_margin_s
    look_limit = max(heartbeat_s, FIRST_LOOK_MIN_S) + c.max_detect_hang_margin_s + 1.0
    late = []
    for f in faults:
        limit = {"hang_worker": hang_limit, "partition_host": hang_limit}.get(
            f.kind, c.max_detect_kill_s if f.kind in v.KILLS else None
        )
        if limit is not None and f.router_down:
            restarting = f.kind in WORKER_KILLS  # Ray restarts the actor: its table says so
            limit = c.max_detect_kill_s + 1.0 if restarting else look_limit
        if limit is not None and (f.detect_s is None or f.detect_s > limit):
            late.append(f"{f.kind} {' '.join(f.workers)}: {f.detect_s}")
    return late


def _untyped(rows: list[dict[str, Any]]) -> int:
    """Errors without a type. A stream the killed ingress was serving, or a request it could
    not take, ends with the connection: nothing was left to type its error."""
    return sum(
        r["status"] == "error"
        and r["error_type"] is None
        and not any(t.startswith("kill_ingress#") for t in r["touched"])
        for r in rows
    )


def _optional_checks(
    c: Checks,
    plan: list[Planned],
    outcomes: list[Outcome],
    faults: list[v.FaultRow],
    events: list[FaultEvent],
    totals: tuple[Totals | None, Totals | None],
) -> list[v.Check]:
    """The checks a run makes only when it can: the ingress's records and, for a load-only
    plan, its lease, transfer and retry counters (unless a fault killed the ingress, and its
    counters with it); recovery (when the plan bounds it)."""
    checks = []
    before, after = totals
    ingress_killed = any(e.kind == "kill_ingress" for e in events)
    if before is not None and after is not None and not ingress_killed:
        moved = {name: after[name] - before[name] for name in TOTALS}
        sent = sum(p.body.get("n", 1) for p, o in zip(plan, outcomes, strict=True) if o.sent)
        checks.append(
            v.Check(
                "one client record per choice sent (ingress)",
                moved["requests"] == sent,
                f"{moved['requests']:.0f} records for {sent} choices",
                "equal",
            )
        )
        if c.load_only:
            waits = ("imports_parked", "reservations_waited")
            costs = {k: n for k, n in moved.items() if k not in ("requests", *waits)}
            checks.append(
                v.Check(
                    "load alone: no lease expired, transfer aborted, retry or migration",
                    not any(costs.values()),
                    ", ".join(f"{k} {n:.0f}" for k, n in costs.items())
                    + f" (imports parked: {moved['imports_parked']:.0f}, decode reservations "
                    f"waited: {moved['reservations_waited']:.0f})",
                    "all 0",
                )
            )
    if c.max_recovery_s is not None:
        times = [f.recovery_s for f in faults]
        ok = all(t is not None and t <= c.max_recovery_s for t in times)
        checks.append(v.Check("recovered in time", ok, str(times), f"<= {c.max_recovery_s:g} s"))
    return checks


async def _ask(ref: Any, default: Any, timeout_s: float = 10.0) -> Any:
    """An actor call's answer, or ``default`` when the actor does not answer in time."""
    try:
        return await asyncio.wait_for(ref, timeout=timeout_s)
    except Exception:
        return default


# The ingress's counters a run reads before and after: (name, labels) by what they count.
TOTALS: dict[str, tuple[str, dict[str, str]]] = {
    "requests": ("tandem_requests_total", {}),  # every client record
    "leases_expired": ("tandem_kv_lease_expired_total", {}),
    "transfers_aborted": ("tandem_transport_failures_total", {"kind": "aborted"}),
    "retries": ("tandem_retries_total", {}),
    "migrations": ("tandem_migrations_total", {}),
    "imports_parked": ("tandem_kv_imports_parked_total", {}),  # a wait: reported, not judged
    "reservations_waited": ("tandem_decode_reservations_waited_total", {}),  # a wait too
}
Totals = dict[str, float]


def _totals(url: str) -> Totals | None:
    """Each of TOTALS summed over its samples (None: the ingress does not answer)."""
    try:
        return {k: sum(metric(url, name, **labels)) for k, (name, labels) in TOTALS.items()}
    except OSError:
        return None
