"""``tandem chaos run fp32``: the shipped exactness plan on ``local-fp32.yaml`` (the plan's own
topology), a decode worker killed mid-decode and a prefill worker mid-transfer; every request
equals Tandem's reference engine, and every greedy one -- the migrated ones too -- equals
transformers' greedy generation with its own tokenizer, a reference sharing no code with
Tandem."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import run_plan

from tandem.deployment import DEFAULT_TOPOLOGY

pytestmark = pytest.mark.e2e


def test_the_fp32_plan_equals_transformers_through_a_kill_of_each_role(
    serve_app: Callable[[Path], str], tmp_path_factory: pytest.TempPathFactory
) -> None:
    url = serve_app(DEFAULT_TOPOLOGY.with_name("local-fp32.yaml"))
    run = run_plan("fp32", url, tmp_path_factory.mktemp("fp32"))
    assert run["rc"] == 0, run["stderr"][-4000:]
    report = run["report"]
    assert all(c["passed"] for c in report["checks"]), report["checks"]
    [check] = [
        c for c in report["checks"] if c["name"] == "greedy outputs equal transformers' (float32)"
    ]
    judged = int(check["measured"].split(" of ")[1].split()[0])
    assert check["measured"].startswith("0 of ") and judged >= 20, check
    assert [f["kind"] for f in report["faults"]] == ["kill_worker", "kill_worker"]
    assert report["counts"]["touched"] >= 1 and report["counts"]["mismatched"] == 0
