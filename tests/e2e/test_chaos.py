"""``tandem chaos run smoke`` against the shipped local topology, as a user runs it: the CLI
joins the running cluster (``--address``), sends the plan's load through the official
``openai`` client, kills a decode worker mid-decode and a prefill worker mid-transfer,
corrupts a KV chunk and races a cancel with a kill; every check must pass and the report must
say what happened. The Prometheus counters the report's plots come from moved with it."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import ray
from helpers import report_rows, run_plan

from chaos.inject import Injector, Worker
from chaos.load import InThread, Sender, requests_of
from chaos.probe import wait_all_up
from chaos.reference import expected, reference_engine
from chaos.sabotage import CHECK, Kind
from chaos.verdict import mismatch
from contracts.actors import WorkerClient
from contracts.roles import NAMESPACE
from tandem.deployment import DEMO_TOPOLOGY
from tandem.launch import model_dir_of
from tandem.testbed import Host
from tandem.topology import load_topology

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def url(serve_app: Callable[[Path], str]) -> str:
    """Tandem on the shipped local topology, for this module's plans."""
    return serve_app(DEMO_TOPOLOGY)


@pytest.fixture(scope="module")
def smoke(url: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_plan("smoke", url, tmp_path_factory.mktemp("chaos"))


def why_it_failed(stderr: str) -> str:
    """What a failed run says: the stalls of its own loop it named (chaos.watchdog: the CI's
    23 s stall had no cause on record), then its last lines."""
    held = [part for part in stderr.split("[chaos ") if "event loop is held" in part]
    return "".join(held)[-6000:] + stderr[-3000:]


def test_the_smoke_plan_passes_every_check(smoke: dict[str, Any]) -> None:
    assert smoke["rc"] == 0, why_it_failed(smoke["stderr"])
    report = smoke["report"]
    assert report["verdict"] is True
    names = [c["name"] for c in report["checks"]]
    assert names[:12] == [
        "no request hung",
        "outputs equal the reference",
        "every error is typed",
        "pools and leases back to baseline",
        "one terminal record per attempt on each worker",
        "non-targeted requests succeed",
        "no worker marked FAILED without a fault",
        "failed requests, touched or not",
        "faults detected in time",
        "KV held for a dead peer",
        "every fault was done",
        "the load left on schedule",
    ]
    assert all(c["passed"] for c in report["checks"]), report["checks"]
    counts = report["counts"]
    assert counts["requests"] == 183 and counts.get("hung", 0) == 0 and counts["mismatched"] == 0
    assert counts["ok"] + counts.get("cancelled", 0) + counts.get("error", 0) == 183
    assert counts["tokens"] > 1000


def test_the_report_has_each_fault_with_its_detection(smoke: dict[str, Any]) -> None:
    faults = smoke["report"]["faults"]
    assert [f["kind"] for f in faults] == ["kill_worker", "kill_worker", "kv_fault", "cancel_race"]
    assert faults[0]["workers"][0].startswith("decode-")
    assert faults[1]["workers"][0].startswith("prefill-")
    assert faults[0]["detail"] == "mid_decode" and faults[1]["detail"] == "mid_transfer"
    for kill in (faults[0], faults[1], faults[3]):
        assert kill["detect_s"] is not None and 0 <= kill["detect_s"] < 1.0, kill
    assert faults[0]["touched"] >= 1  # the stream decoding there when it died
    md = smoke["markdown"]
    assert md.startswith("# Chaos run `smoke`: PASS")
    assert "| kill_worker | decode-" in md and "![timeline](timeline.png)" in md
    assert smoke["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "verdict: PASS" in smoke["stderr"] and "sent " in smoke["stderr"]  # progress lines


def test_the_prometheus_counters_moved_with_the_faults(smoke: dict[str, Any]) -> None:
    failures, integrity, migrations, retries = (
        a - b for a, b in zip(smoke["after"], smoke["before"], strict=True)
    )
    assert failures >= 3  # three kills
    assert integrity >= 1  # the corrupt chunk
    assert migrations >= 1  # the mid-decode kill's stream
    # The mid-transfer kill's and the corrupt chunk's requests start new attempts too: retries
    # if no token had reached the client yet, else migrations (the KV sender may lag the
    # prefill's first token), so only the sum is fixed.
    assert retries + migrations >= 3


def test_a_host_fault_waits_until_a_request_runs_on_the_host(smoke: dict[str, Any]) -> None:
    """``busy_s``: a host fault strikes once the router counts a request on one of the host's
    workers, so it hits streams in flight (here: hosts standing for both domains, no bed)."""
    topology = load_topology(DEMO_TOPOLOGY)
    workers = [
        Worker(w.name, w.role, w.domain, WorkerClient(ray.get_actor(w.name, namespace=NAMESPACE)))
        for w in topology.workers()
    ]
    hosts = [Host("h-a", "10.213.0.2", "a"), Host("h-b", "10.213.0.3", "b")]
    injector = Injector(workers, seed=0)
    assert asyncio.run(injector.until_busy(hosts, 0.0)) == ""  # no wait asked for
    assert asyncio.run(injector.until_busy(hosts, 0.5)) == ", nothing ran there in 0.5 s"
    body = {"prompt": "one two three " * 20, "max_tokens": 400}
    load = InThread(Sender(smoke["url"], topology.model.name), requests_of([body]))
    try:
        said = asyncio.run(injector.until_busy(hosts, 30.0))
    finally:
        load.join(timeout_s=120)
    assert said.endswith(" busy") and said.removeprefix(", ").split()[0] in {
        w.name for w in workers
    }, said


def test_a_paused_and_starved_router_fails_no_request_and_blames_no_worker(
    url: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """P16 (`router-pause`): the router SIGSTOPped for 10 s, then stopped 0.8 s of every second
    for 10 s, while Poisson arrivals keep coming. Before the router knew its own pauses, it
    woke to every heartbeat late, marked healthy workers FAILED and failed 35 of 181 requests."""
    run = run_plan("router-pause", url, tmp_path_factory.mktemp("pause"))
    assert run["rc"] == 0, run["stderr"][-4000:]
    report = run["report"]
    assert all(c["passed"] for c in report["checks"]), report["checks"]
    faults = report["faults"]
    assert [f["kind"] for f in faults] == ["hang_router", "slow_router"]
    assert faults[0]["lasted_s"] >= 10.0 and faults[1]["lasted_s"] >= 10.0
    assert faults[0]["touched"] >= 10  # open-loop: requests kept arriving while it was stopped
    counts = report["counts"]
    assert counts.get("error", 0) == 0 and counts.get("hung", 0) == 0
    assert counts["ok"] == counts["requests"] and counts["mismatched"] == 0
    marks = [h for h in report["health"] if h["event"] == "failed" and h["t"] >= 0]
    assert not marks, marks  # (the smoke plan's kills before this run are in the log too)
    assert (run["after"][0] - run["before"][0]) == 0  # tandem_worker_failures_detected_total


def test_structured_outputs_under_faults_equal_the_reference_and_match_their_grammar(
    url: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The shipped `structured` plan (issue 27 point 5) in CI: JSON-schema, regex, choice and
    tool-call requests beside free text, under a decode kill mid-decode, a prefill kill
    mid-transfer, a corrupt KV chunk and a hang. A moved request replays its grammar: every
    output equals the reference's, and each that ended by itself matches its grammar."""
    run = run_plan("structured", url, tmp_path_factory.mktemp("structured"))
    assert run["rc"] == 0, why_it_failed(run["stderr"])
    report = run["report"]
    assert all(c["passed"] for c in report["checks"]), report["checks"]
    [grammar] = [
        c for c in report["checks"] if c["name"] == "structured outputs match their grammar"
    ]
    assert grammar["measured"].startswith("0 invalid; ") and "json_schema" in grammar["measured"]
    assert report["counts"]["mismatched"] == 0 and report["counts"].get("hung", 0) == 0
    assert {f["kind"] for f in report["faults"]} >= {"kill_worker", "kv_fault", "hang_worker"}


@pytest.fixture(scope="module")
def self_test(url: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The harness's self-test: every kind of sabotage planted in one run of ``self-test``."""
    return run_plan("self-test", url, tmp_path_factory.mktemp("sabotage"), "--sabotage", "all")


def test_the_self_test_plan_passes_without_sabotage(
    url: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """What the sabotaged run fails is the sabotage's doing: the same plan alone passes."""
    run = run_plan("self-test", url, tmp_path_factory.mktemp("plain"))
    assert run["rc"] == 0, run["stderr"][-4000:]
    assert all(c["passed"] for c in run["report"]["checks"]), run["report"]["checks"]
    assert run["report"]["sabotage"] == []


# What the spoiled request's row says, per stream kind (the first difference from the reference).
MISMATCH = {
    Kind.TOKEN: r"tokens differ from token \d+",
    Kind.LOGPROB: r"(token|top)_logprobs differ from token \d+",
    Kind.DROP: r"(\d+ tokens, the reference has \d+|tokens differ from token \d+)",
    Kind.DUPLICATE: r"(\d+ tokens, the reference has \d+|tokens differ from token \d+)",
}


@pytest.mark.parametrize("kind", list(Kind))
def test_the_verdict_catches_each_planted_violation(self_test: dict[str, Any], kind: Kind) -> None:
    """Each sabotage fired on an attempt, and the check it breaks failed pointing at it; the
    command's exit status says every one was caught (1 if the verdict missed one)."""
    assert self_test["rc"] == 0, self_test["stderr"][-4000:]
    report = self_test["report"]
    assert report["verdict"] is False
    [planted] = [p for p in report["sabotage"] if p["kind"] == kind]
    assert planted["attempt"] is not None and planted["caught"] is True, planted
    [check] = [c for c in report["checks"] if c["name"] == CHECK[kind]]
    assert check["passed"] is False, check
    rows = {r["response_id"]: r for r in report_rows(self_test)}
    response = planted["attempt"].rsplit("@", 1)[0]
    if kind in MISMATCH:
        assert re.fullmatch(f"choice 0: {MISMATCH[kind]}", rows[response]["mismatch"]), planted
    elif kind is Kind.HANG:
        assert rows[response]["status"] == "hung" and rows[response]["tokens"] >= 1
    elif kind is Kind.FAIL:
        row = rows[response]  # known even when it failed before a token (X-Tandem-Request-Id)
        assert row["status"] == "error" and not row["touched"], row
        assert "max_attempts reached after 3 attempt(s)" in planted["how"]
    elif kind is Kind.LEAK:
        assert planted["worker"] in check["measured"] and "KVInvariantError" in planted["how"]
    else:
        assert planted["attempt"] in check["measured"]


def test_a_sabotaged_run_fails_only_the_checks_its_sabotage_breaks(
    self_test: dict[str, Any],
) -> None:
    """No other check fails (a held stream, a failed request or a leak is not a false alarm,
    an untyped error, or a record the ingress miscounted); exactly the planted requests are
    bad."""
    report = self_test["report"]
    broken = set(CHECK.values())
    assert [c["name"] for c in report["checks"] if not c["passed"]] == [
        c["name"] for c in report["checks"] if c["name"] in broken
    ]
    planted = {p["kind"]: p["attempt"].rsplit("@", 1)[0] for p in report["sabotage"]}
    rows = report_rows(self_test)
    spoiled = {planted[k] for k in MISMATCH}
    assert {r["response_id"] for r in rows if r["mismatch"]} == spoiled
    assert [r["response_id"] for r in rows if r["status"] == "hung"] == [planted[Kind.HANG]]
    assert report["counts"].get("error") == 1 and report["counts"]["requests"] == len(rows)


def test_with_the_default_retry_budget_both_decode_workers_lost_fail_no_request(url: str) -> None:
    """P9 on ``local.yaml`` as shipped (retry budget at its default): both decode workers
    killed at once, Ray restarting them within ``unavailable_wait_s``. A stream with tokens
    migrates, a request without one waits for a decode worker: every request completes, none
    is refused, each equal to the engine's answer (token ids and top-5 logprobs, bf16)."""
    topology = load_topology(DEMO_TOPOLOGY)
    bodies = [
        {
            "prompt": f"both decode workers lost {i}: " + "word " * (4 * i),
            "max_tokens": 32,
            "temperature": 0.0,
            "logprobs": 5,
            "return_tokens_as_token_ids": True,
        }
        for i in range(24)
    ]
    wait_all_up(url)
    load = InThread(Sender(url, topology.model.name, 120.0), requests_of(bodies), 6)
    time.sleep(1.5)
    for name in ("decode-0", "decode-1"):
        ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=False)
    until = time.time() + 180
    while len(load.outcomes()) < len(bodies):  # (join stops a closed loop's clients)
        assert time.time() < until, "the clients never sent every request"
        time.sleep(0.5)
    outcomes = load.join(timeout_s=240)
    wait_all_up(url)
    engine = reference_engine(topology, model_dir_of(topology))
    answers = expected(engine, [(b, None) for b in bodies])
    assert [(o.status, o.http_status, o.error) for o in outcomes] == [("ok", None, None)] * 24
    assert [mismatch(o, answers[o.index]) for o in outcomes] == [None] * 24


def test_a_run_refuses_a_cluster_its_reference_was_not_built_from(
    url: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """``--address`` with another topology than the cluster's: the reference would be another
    model's or engine's, so the run refuses before any load (one line, exit 2)."""
    other = tmp_path_factory.mktemp("other") / "other.yaml"
    other.write_text(DEMO_TOPOLOGY.read_text() + "heartbeat_timeout_s: 9\n")
    assert load_topology(other).heartbeat_timeout_s == 9
    run = subprocess.run(
        [
            str(Path(sys.executable).with_name("tandem")),
            *("chaos", "run", "self-test", "--url", url, "--topology", str(other)),
            *("--address", ray.get_runtime_context().gcs_address),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=os.environ.copy(),
    )
    assert run.returncode == 2, run.stderr[-2000:]
    [line] = [x for x in run.stderr.splitlines() if x.startswith("tandem: error:")]
    assert "runs another topology or model (key " in line and "give its --topology" in line
    assert "requests over" not in run.stderr  # refused before any load was sent
