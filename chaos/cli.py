"""``tandem chaos``'s arguments, added to the ``tandem`` CLI through the ``tandem.commands``
entry point (pyproject.toml): ``tandem`` sits below ``chaos`` in the stack and never imports it
(docs/design.md#layers). Light: the run's modules are imported when a command runs."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def add_command(sub: Any) -> None:
    """Add ``chaos run`` and ``chaos plans`` to the ``tandem`` CLI's subparsers ``sub``."""
    ch = sub.add_parser("chaos", help="run a fault plan against Tandem under load; report")
    ch_sub = ch.add_subparsers(dest="chaos_command", required=True)
    ch_run = ch_sub.add_parser("run", help="run PLAN (a file, or a shipped plan's name)")
    ch_run.add_argument("plan")
    ch_run.add_argument(
        "--topology",
        default=None,
        help="the cluster's topology YAML (default: the plan's, else local-demo.yaml)",
    )
    ch_run.add_argument(
        "--address", default=None, help="a running cluster's Ray address (default: start one)"
    )
    ch_run.add_argument("--url", default=None, help="its HTTP endpoint (with --address)")
    ch_run.add_argument("--out", default=None, help="report directory (default: chaos-reports/)")
    ch_run.add_argument(
        "--testbed",
        type=int,
        default=None,
        metavar="N",
        help="on a test bed of N hosts started for the run (root; default topology testbed.yaml)",
    )
    ch_run.add_argument(
        "--sabotage",
        default=None,
        metavar="KIND[,KIND]",
        help="a self-test of the harness: plant these violations (token, logprob, drop, "
        "duplicate, leak, lost_record, double_record, hang, fail; or all) in the cluster; "
        "exit 0 when the verdict caught each one",
    )
    ch_run.add_argument("--on-bed", action="store_true", help=argparse.SUPPRESS)
    ch_run.set_defaults(func=run)
    ch_plans = ch_sub.add_parser("plans", help="the shipped plans, a line each")
    ch_plans.set_defaults(func=plans)


def run(a: argparse.Namespace) -> int:
    from chaos.main import run_command

    topology = (
        Path(a.topology) if a.topology else None
    )  # the plan's, local-demo.yaml or testbed.yaml
    out = Path(a.out) if a.out else None
    return run_command(a.plan, topology, a.address, a.url, out, a.testbed, a.on_bed, a.sabotage)


def plans(a: argparse.Namespace) -> int:
    from chaos.main import plans_command

    return plans_command()
