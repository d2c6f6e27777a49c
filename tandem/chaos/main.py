"""``tandem chaos run`` and ``tandem chaos plans``: where the cluster comes from (started
here from a topology, or a running one joined at ``--address``), the run, the report, the
exit status."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

from tandem.chaos.plan import ChaosPlan, load_plan, shipped_plans
from tandem.chaos.report import write_report
from tandem.chaos.verdict import Summary
from tandem.topology import load_topology


def say(line: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)


def run_against(plan: ChaosPlan, topology_file: Path, url: str, out: Path) -> Summary:
    """Run ``plan`` against the Tandem at ``url`` (this process already joined to its Ray
    cluster), write the report into ``out``."""
    from tandem.chaos.run import ChaosRun

    topology = load_topology(topology_file)
    summary = asyncio.run(ChaosRun(plan, topology, url, say).run())
    for path in write_report(summary, out):
        say(f"wrote {path}")
    return summary


def run_command(
    plan_file: str, topology_file: Path, address: str | None, url: str | None, out: Path | None
) -> int:
    """The CLI: 0 when every check passed, 1 when one failed."""
    plan = load_plan(plan_file)
    if plan.testbed:
        raise ValueError(f"plan {plan.name!r} needs a test bed: run it from `make test-bed`")
    out = out or Path("chaos-reports") / f"{plan.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    import ray
    from ray import serve

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
        summary = run_against(plan, topology_file, url, out)
    finally:
        if started:
            serve.shutdown()
            stop_cluster(topology)
            ray.shutdown()
    for check in summary.checks:
        say(f"{'pass' if check.passed else 'FAIL'}  {check.name}: {check.measured}")
    say(f"verdict: {'PASS' if summary.verdict else 'FAIL'}  ({out / 'report.md'})")
    return 0 if summary.verdict else 1


def plans_command() -> int:
    for name, plan in shipped_plans():
        where = " (test bed)" if plan.testbed else ""
        print(f"{name:16s} {plan.description.splitlines()[0] if plan.description else ''}{where}")
    return 0
