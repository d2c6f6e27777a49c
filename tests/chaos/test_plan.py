"""Chaos plans: every shipped plan validates, errors name the file and the field, and the
schedule a plan makes is the same every time."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from chaos.load import schedule
from chaos.plan import (
    PLANS_DIR,
    ChaosPlan,
    KillWorker,
    Load,
    PlanError,
    load_plan,
    shipped_plans,
)
from tandem.cli import main


def test_every_shipped_plan_validates_and_is_listed(capsys: pytest.CaptureFixture[str]) -> None:
    names = [name for name, _ in shipped_plans()]
    assert {"smoke", "decode-loss", "prefill-loss", "transport-faults", "router-restart"} <= set(
        names
    )
    assert {"abort-storm", "churn-soak"} <= set(names)
    assert main(["chaos", "plans"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in listed] == names
    assert all(len(line.split(maxsplit=1)) == 2 for line in listed)  # each has its line


def test_a_shipped_plan_loads_by_name() -> None:
    plan = load_plan("smoke")
    assert plan == load_plan(PLANS_DIR / "smoke.yaml")
    assert plan.name == "smoke"
    kinds = [f.kind for f in plan.faults]
    assert kinds == ["kill_worker", "kill_worker", "kv_fault", "cancel_race"]
    roles = {f.target.role for f in plan.faults if isinstance(f, KillWorker)}
    assert {str(r) for r in roles} == {"prefill", "decode"}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("name: x\nload: {arrivals: {rate: -1}}", "load.arrivals.rate: -1 (must be > 0.0)"),
        ("name: x\nfaults: [{kind: explode, at_s: 1}]", "faults.0"),
        ("name: x\nfaults: [{kind: kill_worker}]", "faults.0.kill_worker.at_s: missing"),
        (
            "name: x\nfaults: [{kind: kill_worker, at_s: 1, phase: lunch}]",
            "faults.0.kill_worker.phase: 'lunch'",
        ),
        ("name: x\nload: {prompts: {words: [9, 3]}}", "words: (9, 3) must be 1 <= min <= max"),
        ("name: x\nchecks: {max_hung: 0, max_hang: 1}", "checks.max_hang: 1 (unknown key)"),
        (
            "name: x\nfaults: [{kind: kill_host, at_s: 1, host: 1}]",
            "kill_host needs `testbed: true`",
        ),
        ("name: x\nload: {arrivals: {process: trace}}", "process: trace needs a trace file"),
        ("name: x\nname: y", "duplicate key 'name'"),
        ("- just a list", "must be a mapping of sections"),
    ],
)
def test_a_bad_plan_names_the_file_and_the_field(tmp_path: Path, text: str, message: str) -> None:
    file = tmp_path / "bad.yaml"
    file.write_text(text)
    with pytest.raises(PlanError) as err:
        load_plan(file)
    assert str(err.value).startswith(f"{file}: ")
    assert message in str(err.value)


def test_a_missing_plan_is_a_clear_cli_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["chaos", "run", "no-such-plan"]) == 2
    assert "no-such-plan: cannot read plan file" in capsys.readouterr().err


def test_the_schedule_is_the_plans_and_the_same_every_time() -> None:
    load = Load.model_validate(
        {
            "arrivals": {"rate": 20, "duration_s": 30},
            "prompts": {"words": [4, 6], "output_tokens": [5, 7], "shared_prefix_groups": 2},
            "sampling": [{"weight": 1}, {"weight": 1, "temperature": 0.5, "seed": True}],
            "stream_fraction": 0.5,
            "cancel": {"fraction": 0.5, "after_tokens": [2, 3]},
            "seed": 9,
        }
    )
    a, b = schedule(load), schedule(load)
    assert [(p.send_at, p.body, p.stream, p.cancel_after) for p in a] == [
        (p.send_at, p.body, p.stream, p.cancel_after) for p in b
    ]
    assert 450 < len(a) < 750  # ~20/s for 30 s
    assert all(0 < p.send_at <= 30 for p in a)
    assert [p.send_at for p in a] == sorted(p.send_at for p in a)
    assert all(5 <= p.body["max_tokens"] <= 7 and p.body["logprobs"] == 5 for p in a)
    assert all(p.body["return_tokens_as_token_ids"] is True for p in a)  # compared by id
    seeded = [p for p in a if p.body["temperature"] > 0]
    assert seeded and all("seed" in p.body for p in seeded)
    assert not any("seed" in p.body for p in a if p.body["temperature"] == 0)
    # Two shared prefixes of 24 words lead every prompt.
    assert len({" ".join(p.body["prompt"].split()[:24]) for p in a}) == 2
    assert all(p.cancel_after is None for p in a if not p.stream)
    assert {p.cancel_after for p in a} == {None, 2, 3}
    assert schedule(load.model_copy(update={"seed": 10}))[0].body != a[0].body


def test_a_trace_replays_its_times_with_lengths_in_range(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    rows = [(0, 100, 5), (500, 9000, 900), (1500, 50, 1), (4000, 10, 10)]
    trace.write_text(
        "".join(
            json.dumps({"timestamp": t, "input_length": i, "output_length": o}) + "\n"
            for t, i, o in rows
        )
    )
    plan = ChaosPlan.model_validate(
        {
            "name": "t",
            "load": {
                "arrivals": {"process": "trace", "trace": str(trace), "duration_s": 2},
                "prompts": {"words": [2, 40], "output_tokens": [4, 64]},
            },
        }
    )
    out = schedule(plan.load)
    assert [p.send_at for p in out] == [0.0, 0.5, 1.5]  # 4.0 s is past duration_s
    assert [len(p.body["prompt"].split()) for p in out] == [2, 40, 2]
    assert [p.body["max_tokens"] for p in out] == [5, 64, 4]


def test_a_closed_loop_plans_only_the_order_of_its_requests() -> None:
    load = Load.model_validate(
        {"arrivals": {"process": "closed", "concurrency": 4, "max_requests": 50}, "seed": 3}
    )
    out = schedule(load)
    assert len(out) == 50 and {p.send_at for p in out} == {0.0}
    assert [p.index for p in out] == list(range(50))


def test_bed_plans_need_a_bed_and_never_target_the_head(tmp_path: Path) -> None:
    names = {name: plan for name, plan in shipped_plans()}
    assert all(names[n].testbed for n in ("host-loss", "partition", "domain-loss"))
    assert not any(
        p.testbed for n, p in names.items() if n not in ("host-loss", "partition", "domain-loss")
    )
    head = tmp_path / "head.yaml"
    head.write_text("name: x\ntestbed: true\nfaults: [{kind: kill_host, at_s: 1, host: 0}]")
    with pytest.raises(PlanError, match=r"faults.0.kill_host.host: 0 \(must be >= 1\)"):
        load_plan(head)


def test_a_bed_plan_without_a_bed_is_a_clear_cli_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["chaos", "run", "partition"]) == 2
    assert "plan 'partition' needs a test bed: add --testbed N" in capsys.readouterr().err


def test_sabotage_on_a_plan_with_faults_is_a_clear_cli_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A plan fault would restart the worker a sabotage is armed on: refused before any Ray
    call, naming the plan to use; a bad kind is named too."""
    assert main(["chaos", "run", "decode-loss", "--sabotage", "token"]) == 2
    err = capsys.readouterr().err
    assert "--sabotage needs a plan without faults (plan 'decode-loss' has" in err
    assert "use the self-test plan" in err
    assert main(["chaos", "run", "self-test", "--sabotage", "tokens"]) == 2
    assert "--sabotage 'tokens': not a kind" in capsys.readouterr().err


def test_the_fp32_plan_runs_on_its_float32_topology_and_refuses_another() -> None:
    """Its greedy outputs are checked against transformers, exact only in float32: it names
    its topology (the CLI's default for it), and a run on a bf16 one refuses before any Ray
    call."""
    from chaos.run import ChaosRun
    from tandem.deployment import DEMO_TOPOLOGY
    from tandem.topology import load_topology

    plan = load_plan("fp32")
    assert plan.checks.transformers_greedy and plan.topology == "local-fp32"
    fp32 = load_topology(DEMO_TOPOLOGY.with_name(f"{plan.topology}.yaml"))
    assert fp32.model.dtype == "float32"
    with pytest.raises(ValueError, match="exact only in float32.*this one: auto"):
        ChaosRun(plan, load_topology(DEMO_TOPOLOGY), "http://127.0.0.1:9", print)


def test_a_load_only_plan_fails_on_any_lease_expired_transfer_aborted_retry_or_migration() -> None:
    """`long-prompts` (no fault): the ingress's counters must not move but its records."""
    from chaos.load import Outcome, schedule
    from chaos.run import TOTALS, _optional_checks

    plan = load_plan("long-prompts")
    assert plan.checks.load_only and plan.checks.max_failed == 0 and not plan.faults
    planned = schedule(plan.load)[:2]
    outcomes = [Outcome(p.index, 0.0, sent=1.0, status="ok") for p in planned]
    before = dict.fromkeys(TOTALS, 10.0)

    def checks(**moved: float) -> list[tuple[str, bool, str]]:
        after = {k: v + 2.0 * (k == "requests") + moved.get(k, 0.0) for k, v in before.items()}
        out = _optional_checks(plan.checks, planned, outcomes, [], [], (before, after))
        return [(c.name, c.passed, c.measured) for c in out]

    load = "load alone: no lease expired, transfer aborted, retry or migration"
    assert checks()[1] == (
        load,
        True,
        "leases_expired 0, transfers_aborted 0, retries 0, migrations 0 (imports parked: 0, "
        "decode reservations waited: 0)",
    )
    for name in ("leases_expired", "transfers_aborted", "retries", "migrations"):
        assert checks(**{name: 1.0})[1][:2] == (load, False)
    assert checks(imports_parked=3.0, reservations_waited=5.0)[1][1:] == (  # waits: reported
        True,
        "leases_expired 0, transfers_aborted 0, retries 0, migrations 0 (imports parked: 3, "
        "decode reservations waited: 5)",
    )
    assert checks(requests=1.0)[0][1] is False  # a client record too many
