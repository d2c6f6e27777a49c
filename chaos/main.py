"""``tandem chaos run`` and ``tandem chaos plans``: where the cluster comes from (started
here from a topology, or a running one joined at ``--address``), the run, the report, the
exit status."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from chaos.plan import ChaosPlan, load_plan, shipped_plans
from chaos.report import write_report
from chaos.sabotage import Kind, parse
from chaos.verdict import Summary
from chaos.watchdog import LoopWatchdog
from tandem.deployment import DEMO_TOPOLOGY
from tandem.topology import load_topology


def say(line: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)


def run_against(
    plan: ChaosPlan,
    topology_file: Path,
    url: str,
    out: Path,
    bed: Any = None,
    sabotage: list[Kind] | None = None,
) -> Summary:
    """Run ``plan`` against the Tandem at ``url`` (this process already joined to its Ray
    cluster), write the report into ``out``. ``bed``: the test bed it runs on (host faults);
    ``sabotage``: the violations a self-test plants (chaos.sabotage)."""
    from chaos.run import ChaosRun

    topology = load_topology(topology_file)
    run = ChaosRun(plan, topology, url, say, bed, sabotage)

    async def watched() -> Summary:
        async with LoopWatchdog(say):  # a late run names the call that held its loop
            return await run.run()

    summary = asyncio.run(watched())
    for path in write_report(summary, out):
        say(f"wrote {path}")
    return summary


def run_command(
    plan_file: str,
    topology_file: Path | None,
    address: str | None,
    url: str | None,
    out: Path | None,
    testbed_nodes: int | None = None,
    on_bed: bool = False,
    sabotage: str | None = None,
) -> int:
    """The CLI: 0 when every check passed, 1 when one failed. A self-test (``sabotage``): 0
    when the verdict caught each planted violation, 1 when it missed one."""
    kinds = parse(sabotage) if sabotage else None
    plan = load_plan(plan_file)
    if topology_file is None:
        default = DEMO_TOPOLOGY.with_name("testbed.yaml") if testbed_nodes else DEMO_TOPOLOGY
        topology_file = default.with_name(f"{plan.topology}.yaml") if plan.topology else default
    out = out or Path("chaos-reports") / f"{plan.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    if testbed_nodes is not None and kinds:
        raise ValueError("--sabotage runs on a local cluster or one at --address, not --testbed")
    if kinds and plan.faults:
        # A fault beside a sabotage would restart the worker it is armed on, or touch the request
        # it spoils, so a miss could not be told from the fault's doing (chaos.sabotage.arm).
        raise ValueError(
            f"--sabotage needs a plan without faults (plan {plan.name!r} has "
            f"{len(plan.faults)}): use the self-test plan"
        )
    if testbed_nodes is not None:
        return run_on_bed(plan_file, testbed_nodes, topology_file, out)
    if plan.testbed and not on_bed:
        raise ValueError(f"plan {plan.name!r} needs a test bed: add --testbed N (root)")
    import ray
    from ray import serve

    from tandem import testbed
    from tandem.bootstrap import init_ray
    from tandem.launch import stop_cluster
    from tandem.serve import deploy, free_port, wait_until_ready

    topology = load_topology(topology_file)
    started = address is None
    if started:
        say(f"starting Tandem from {topology_file}")
        url = deploy(topology_file, None, "127.0.0.1", free_port("127.0.0.1"), None)
    else:
        init_ray(address)
        url = url or "http://127.0.0.1:8000"
    try:
        wait_until_ready(url)
        say(f"running plan {plan.name} against {url}")
        bed = testbed.load() if on_bed else None
        summary = run_against(plan, topology_file, url, out, bed, kinds)
    finally:
        if started:
            serve.shutdown()
            stop_cluster(topology)
            ray.shutdown()
    for check in summary.checks:
        say(f"{'pass' if check.passed else 'FAIL'}  {check.name}: {check.measured}")
    say(f"verdict: {'PASS' if summary.verdict else 'FAIL'}  ({out / 'report.md'})")
    if kinds:
        for p in summary.sabotage:
            say(f"{'caught' if p['caught'] else 'MISSED'}  sabotage {p['kind']}: {p['how']}")
        caught = all(p["caught"] for p in summary.sabotage) and not summary.verdict
        say(f"self-test: {'every planted violation was caught' if caught else 'FAIL'}")
        return 0 if caught else 1
    return 0 if summary.verdict else 1


def run_on_bed(plan_file: str, nodes: int, topology_file: Path, out: Path) -> int:
    """``--testbed N``: a bed of N hosts (at least one per failure domain of the topology, the
    domains in turn), ``ray up`` its cluster file on it, ``tandem serve`` on its head; then this command again as a driver on the head host
    (``--on-bed``: it can do host faults); then everything down again."""
    from tandem import testbed

    topology = load_topology(topology_file)
    if nodes < len(topology.domains):
        raise ValueError(
            f"--testbed {nodes}: the topology's domains {topology.domains} need a host each"
        )
    say(f"starting a test bed of {nodes} hosts (domains in turn), ray up, tandem serve")
    bed = testbed.up(nodes, topology.domains)
    try:
        testbed.ray_up(bed.cluster_file)
        serving = testbed.serve_on_head(bed, topology_file.resolve())
        try:
            head = bed.hosts[0]
            command = [
                *("ip", "netns", "exec", head.name),
                str(Path(sys.executable).with_name("tandem")),
                *("chaos", "run", plan_file, "--on-bed", "--url", testbed.url(bed)),
                *("--address", f"{head.address}:{testbed.RAY_PORT}"),
                *("--topology", str(topology_file.resolve()), "--out", str(out.resolve())),
            ]
            env = {
                **os.environ,
                "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1",  # Ray on the host's address
                testbed.ROOT_NETNS_ENV: f"/proc/{os.getpid()}/ns/net",  # partitions, kills
            }
            return subprocess.run(command, env=env, cwd=testbed.CHECKOUT).returncode
        finally:
            testbed.stop_serving(bed, serving)
            testbed.ray_down(bed.cluster_file)
    finally:
        testbed.down()


def plans_command() -> int:
    for name, plan in shipped_plans():
        where = " (test bed)" if plan.testbed else ""
        print(f"{name:16s} {plan.description.splitlines()[0] if plan.description else ''}{where}")
    return 0
