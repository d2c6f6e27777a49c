"""Faults done to a live cluster, as they happen to real ones: a process SIGKILLed (a crash),
SIGSTOPped (a hang), stopped part of the time (a starved machine), a KV sender told to spoil
chunks (``contracts.faults``), the router or the ingress replica killed, the router paused or
starved.

Signals are sent by a Ray task pinned to the node the process runs on, so the same code works on
one machine and across hosts. Each fault done is a :class:`FaultEvent`: when, to whom, and
whether it touched every request in flight (router, ingress, abort storm) or only those on its
workers.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from chaos.plan import Phase, Target
from contracts.actors import RouterClient, WorkerClient
from contracts.faults import Fault, FaultAction, FaultPlan, FaultPoint
from contracts.roles import NAMESPACE, ROUTER_NAME, Role
from contracts.routing import WorkerState
from tandem import testbed
from tandem.testbed import Host, Testbed

CALL_TIMEOUT_S = 10.0
# Where each phase's crash is armed: (worker point, the count it fires at).
PHASE_POINTS = {
    Phase.QUEUED: (FaultPoint.ACCEPTED, 1),
    Phase.MID_PREFILL: (FaultPoint.PREFILL_LAYERS, 1),
    Phase.MID_TRANSFER: (FaultPoint.TRANSFER_CHUNK, 2),
    Phase.FIRST_TOKEN: (FaultPoint.DECODE_TOKENS, 1),
    Phase.MID_DECODE: (FaultPoint.DECODE_TOKENS, 8),
}


class InjectError(RuntimeError):
    """A fault could not be done (its target cannot be found or reached)."""


@dataclass
class FaultEvent:
    kind: str
    at: float  # time.time() when it was done (a phase fault: when its process was seen dead)
    workers: list[str] = field(default_factory=list)  # the workers it hit
    everyone: bool = False  # it touched every request in flight (router, ingress, storm)
    until: float | None = None  # a fault with a duration: when it was undone
    detail: str = ""
    number: int = 0  # its place among the run's faults, in the order they were done


class NodeAgent:
    """The hands of a chaos run on one Ray node (an actor pinned there): it signals the node's
    processes and watches them die. Threaded, so a watch and a throttle run beside a kill."""

    def ready(self) -> None:
        return None

    def signal(self, pid: int, signum: int) -> float:
        """Send ``signum`` to ``pid``; when (this node's clock)."""
        os.kill(pid, signum)
        return time.time()

    def wait_gone(self, pid: int, timeout_s: float) -> float | None:
        """When ``pid`` died (polled every 5 ms; dead means gone, or a zombie its parent has
        not reaped yet); None if it lives on for ``timeout_s``."""
        until = time.monotonic() + timeout_s
        while time.monotonic() < until:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().rpartition(")")[2].split()[0] == "Z":
                        return time.time()
            except FileNotFoundError:
                return time.time()
            time.sleep(0.005)
        return None

    def throttle(self, pid: int, seconds: float, stopped_share: float, period_s: float) -> None:
        """Stop ``pid`` for ``stopped_share`` of every ``period_s``, for ``seconds``."""
        until = time.monotonic() + seconds
        try:
            while time.monotonic() < until:
                os.kill(pid, signal.SIGSTOP)
                time.sleep(period_s * stopped_share)
                os.kill(pid, signal.SIGCONT)
                time.sleep(period_s * (1 - stopped_share))
        finally:
            os.kill(pid, signal.SIGCONT)


def ray_processes(title: str, driver_pid: int) -> list[int]:
    """The worker processes of the Ray that ``driver_pid`` started (children of its raylet)
    whose command line (Ray's process title) contains ``title``: never another session's.
    For killing a local cluster's processes by what they run (``ray::RouterActor``)."""
    procs: dict[int, tuple[int, bytes]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    procs[int(entry)] = (ppid, f.read())
            except (OSError, ValueError, IndexError):
                continue
    raylets = {p for p, (pp, cmd) in procs.items() if pp == driver_pid and b"/raylet" in cmd}
    return sorted(p for p, (pp, cmd) in procs.items() if pp in raylets and title.encode() in cmd)


def _whereabouts(_: Any) -> tuple[str, int]:
    return ray.get_runtime_context().get_node_id(), os.getpid()


@dataclass
class Worker:
    name: str
    role: Role
    domain: str
    client: WorkerClient


class Injector:
    """Does the plan's faults to the cluster named in Tandem's Ray namespace."""

    def __init__(
        self,
        workers: list[Worker],
        seed: int,
        bed: Testbed | None = None,
    ) -> None:
        self.workers = {w.name: w for w in workers}
        self.bed = bed  # host faults need one (launched with its cluster_file)
        self.rng = random.Random(seed)
        self.events: list[FaultEvent] = []
        self._agents: dict[str, Any] = {}

    async def agent(self, node: str) -> Any:
        """This run's NodeAgent on ``node`` (started and ready)."""
        if node not in self._agents:
            strategy = NodeAffinitySchedulingStrategy(node_id=node, soft=False)
            options = {"num_cpus": 0, "max_concurrency": 16, "scheduling_strategy": strategy}
            self._agents[node] = ray.remote(NodeAgent).options(**options).remote()
        await asyncio.wait_for(self._agents[node].ready.remote(), CALL_TIMEOUT_S * 3)
        return self._agents[node]

    def close(self) -> None:
        for agent in self._agents.values():
            ray.kill(agent)
        self._agents.clear()

    def record(self, event: FaultEvent) -> FaultEvent:
        event.number = len(self.events)
        self.events.append(event)
        return event

    # -- targets -------------------------------------------------------------------------------

    def pick(self, target: Target, roles: list[Role] | None = None) -> Worker:
        """The worker ``target`` names, or one drawn from those it matches."""
        if target.name is not None:
            if target.name not in self.workers:
                raise InjectError(f"no worker named {target.name!r} (have {sorted(self.workers)})")
            return self.workers[target.name]
        matching = [
            w
            for w in self.workers.values()
            if (target.role is None or w.role is target.role)
            and (target.domain is None or w.domain == target.domain)
            and (roles is None or w.role in roles)
        ]
        if not matching:
            raise InjectError(f"no worker matches {target.model_dump(exclude_none=True)}")
        return self.rng.choice(sorted(matching, key=lambda w: w.name))

    @staticmethod
    async def whereabouts(handle: Any, timeout_s: float = CALL_TIMEOUT_S) -> tuple[str, int]:
        """(node id, pid) of an actor's process; it may be restarting: asked until it answers."""
        until = time.time() + timeout_s
        while True:
            try:
                ref = handle.__ray_call__.remote(_whereabouts)
                node, pid = await asyncio.wait_for(ref, timeout=max(0.1, until - time.time()))
                return str(node), int(pid)
            except Exception as exc:
                if time.time() >= until:
                    raise InjectError(f"the actor did not answer within {timeout_s} s") from exc
                await asyncio.sleep(0.2)

    async def send(self, node: str, pid: int, signum: int) -> float:
        """Signal ``pid`` on ``node``; when it was sent (the node's clock)."""
        return float(await (await self.agent(node)).signal.remote(pid, signum))

    async def _kill(self, handle: Any) -> float:
        node, pid = await self.whereabouts(handle)
        return await self.send(node, pid, signal.SIGKILL)

    # -- faults --------------------------------------------------------------------------------

    async def kill_worker(self, worker: Worker, kind: str = "kill_worker") -> FaultEvent:
        event = FaultEvent(kind, await self._kill(worker.client.handle), [worker.name])
        return self.record(event)

    async def kill_at_phase(self, worker: Worker, phase: Phase, timeout_s: float) -> FaultEvent:
        """Arm a crash at ``phase`` on ``worker``; the event's time is when its process died,
        seen by a watcher on its node that runs before the crash is armed."""
        point, count = PHASE_POINTS[phase]
        node, pid = await self.whereabouts(worker.client.handle)
        watch = (await self.agent(node)).wait_gone.remote(pid, timeout_s)
        await asyncio.sleep(0.1)  # the watch has begun (the agent was ready)
        try:
            await worker.client.set_faults(FaultPlan([Fault(point, FaultAction.CRASH, count)]))
        except ray.exceptions.RayActorError:
            pass  # it crashed before the arming call's answer left it: the watch says when
        died = await watch
        if died is None:
            await worker.client.set_faults(FaultPlan())
            raise InjectError(f"{worker.name}: no request reached {phase} in {timeout_s:.0f} s")
        return self.record(FaultEvent("kill_worker", died, [worker.name], detail=str(phase)))

    async def hang_worker(self, worker: Worker, seconds: float) -> FaultEvent:
        return await self._hang(worker.client.handle, "hang_worker", [worker.name], seconds)

    async def hang_router(self, seconds: float) -> FaultEvent:
        """SIGSTOP the router actor for ``seconds`` (a long GC pause, a frozen VM): every
        request in flight waits on it."""
        router = ray.get_actor(ROUTER_NAME, namespace=NAMESPACE)
        return await self._hang(router, "hang_router", [], seconds)

    async def _hang(self, handle: Any, kind: str, workers: list[str], seconds: float) -> FaultEvent:
        node, pid = await self.whereabouts(handle)
        await self.send(node, pid, signal.SIGSTOP)
        event = FaultEvent(kind, time.time(), workers, everyone=not workers)
        event.detail = f"{seconds:g} s"
        self.record(event)
        try:
            await asyncio.sleep(seconds)
        finally:
            await self.send(node, pid, signal.SIGCONT)
            event.until = time.time()
        return event

    async def slow_worker(
        self, worker: Worker, seconds: float, stopped_share: float, period_s: float
    ) -> FaultEvent:
        handle, names = worker.client.handle, [worker.name]
        return await self._slow(handle, "slow_worker", names, seconds, stopped_share, period_s)

    async def slow_router(
        self, seconds: float, stopped_share: float, period_s: float
    ) -> FaultEvent:
        """The router on a starved machine: stopped ``stopped_share`` of every ``period_s``."""
        router = ray.get_actor(ROUTER_NAME, namespace=NAMESPACE)
        return await self._slow(router, "slow_router", [], seconds, stopped_share, period_s)

    async def _slow(
        self,
        handle: Any,
        kind: str,
        workers: list[str],
        seconds: float,
        stopped_share: float,
        period_s: float,
    ) -> FaultEvent:
        node, pid = await self.whereabouts(handle)
        agent = await self.agent(node)
        event = FaultEvent(kind, time.time(), workers, everyone=not workers)
        event.detail = f"stopped {stopped_share:.0%} of every {period_s:g} s"
        self.record(event)
        await agent.throttle.remote(pid, seconds, stopped_share, period_s)
        event.until = time.time()
        return event

    async def kv_fault(
        self, worker: Worker, action: FaultAction, transfers: int, stall_s: float
    ) -> FaultEvent:
        """The next ``transfers`` KV streams ``worker`` sends are spoiled at their first layer;
        returns once they all were (the event lasts from arming to then)."""
        faults = [
            Fault(FaultPoint.TRANSFER_CHUNK, action, at=1, seconds=stall_s)
            for _ in range(transfers)
        ]
        await worker.client.set_faults(FaultPlan(faults))
        event = FaultEvent("kv_fault", time.time(), [worker.name], detail=f"{action} x{transfers}")
        self.record(event)
        while await worker.client.faults_pending():
            await asyncio.sleep(0.1)
        event.until = time.time()
        return event

    async def kill_router(self) -> FaultEvent:
        """SIGKILL the router actor (Ray starts another); the event lasts until it answers."""
        router = ray.get_actor(ROUTER_NAME, namespace=NAMESPACE)
        event = self.record(FaultEvent("kill_router", await self._kill(router), everyone=True))
        await self.whereabouts(router, timeout_s=120.0)
        event.until = time.time()
        return event

    async def kill_ingress(self, url: str) -> FaultEvent:
        """SIGKILL one Serve replica of Tandem's ingress (Serve starts another); the event
        lasts until ``url`` answers again."""
        replicas = [
            a
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith("SERVE_REPLICA::tandem#")
        ]
        if not replicas:
            raise InjectError("no ingress replica of the `tandem` Serve application")
        chosen = self.rng.choice(sorted(replicas, key=lambda a: str(a["name"])))
        handle = ray.get_actor(chosen["name"], namespace=chosen["namespace"])
        event = self.record(FaultEvent("kill_ingress", await self._kill(handle), everyone=True))
        await self._answers(url, timeout_s=120.0)
        event.until = time.time()  # the endpoint answers again: the outage ends
        return event

    @staticmethod
    async def _answers(url: str, timeout_s: float) -> None:
        """Until ``url``/health answers (any HTTP status: something is listening again)."""
        import urllib.error
        import urllib.request

        until = time.time() + timeout_s
        while time.time() < until:
            try:
                await asyncio.to_thread(urllib.request.urlopen, f"{url}/health", None, 2.0)
                return
            except urllib.error.HTTPError:
                return
            except OSError:
                await asyncio.sleep(0.1)
        raise InjectError(f"{url} did not answer within {timeout_s:.0f} s")

    # -- hosts (a test bed) --------------------------------------------------------------------

    def hosts(self, index: int | None = None, domain: str | None = None) -> list[Host]:
        """The bed's host ``index``, or every host of ``domain``; never the head (this run's
        driver and the cluster's GCS live there)."""
        if self.bed is None:
            raise InjectError("host faults need a test bed: tandem chaos run --testbed N")
        chosen = [
            h
            for i, h in enumerate(self.bed.hosts)
            if (index is None or i == index) and (domain is None or h.domain == domain)
        ]
        if not chosen:
            raise InjectError(f"no bed host {index if domain is None else f'in domain {domain}'}")
        if self.bed.hosts[0] in chosen:
            raise InjectError(f"{self.bed.hosts[0].name} is the head: the run lives there")
        return chosen

    def _on(self, hosts: list[Host]) -> list[str]:
        domains = {h.domain for h in hosts}
        return sorted(w.name for w in self.workers.values() if w.domain in domains)

    async def until_busy(self, hosts: list[Host], timeout_s: float) -> str:
        """Wait (at most ``timeout_s``) until the router counts a request on a worker of
        ``hosts``, running or granted; says which, or that none came."""
        if timeout_s <= 0:
            return ""
        names = set(self._on(hosts))
        router = RouterClient(ray.get_actor(ROUTER_NAME, namespace=NAMESPACE))
        until = time.monotonic() + timeout_s
        while time.monotonic() < until:
            states: list[WorkerState] = await asyncio.wait_for(
                router.worker_states(), CALL_TIMEOUT_S
            )
            busy = sorted(s.name for s in states if s.name in names and s.load > 0)
            if busy:
                return f", {' '.join(busy)} busy"
            await asyncio.sleep(0.05)
        return f", nothing ran there in {timeout_s:g} s"

    async def kill_hosts(
        self, kind: str, hosts: list[Host], seconds: float, busy_s: float = 0.0
    ) -> FaultEvent:
        """Every process of ``hosts`` SIGKILLed at once (machines dying), once busy (see
        :meth:`until_busy`); after ``seconds`` they boot again: sshd, then their Ray node
        (the cluster file's start commands)."""
        busy = await self.until_busy(hosts, busy_s)
        at = time.time()
        for host in hosts:
            await asyncio.to_thread(testbed.kill_host, host)
        names = " ".join(h.name for h in hosts)
        event = self.record(
            FaultEvent(kind, at, self._on(hosts), detail=f"{names} for {seconds:g} s{busy}")
        )
        await asyncio.sleep(seconds)
        assert self.bed is not None
        for host in hosts:
            await asyncio.to_thread(testbed.revive_host, self.bed, host)
            await asyncio.to_thread(testbed.restart_ray_node, self.bed, host)
        return event

    async def partition_host(self, host: Host, seconds: float, busy_s: float = 0.0) -> FaultEvent:
        """``host`` cut off the bed both ways for ``seconds``, once busy; its processes live on."""
        busy = await self.until_busy([host], busy_s)
        at = time.time()
        await asyncio.to_thread(testbed.partition, host)
        event = self.record(
            FaultEvent(
                "partition_host",
                at,
                self._on([host]),
                detail=f"{host.name} for {seconds:g} s{busy}",
            )
        )
        try:
            await asyncio.sleep(seconds)
        finally:
            await asyncio.to_thread(testbed.heal, host)
        return event
