"""The docs/design.md#request-states request state machine in engine/request.py: allowed edges
work, the rest raise."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.request import (
    ALLOWED_TRANSITIONS,
    FinishReason,
    IllegalTransition,
    RecordLog,
    Request,
    RequestStatus,
    SpecStats,
)
from engine.sampling_params import SamplingParams

S = RequestStatus
TERMINAL: set[RequestStatus] = {S.FINISHED, S.CANCELLED, S.TIMED_OUT, S.FAILED, S.REJECTED}
ABORTS: set[RequestStatus] = {S.CANCELLED, S.TIMED_OUT, S.FAILED}


def make(status: RequestStatus = S.QUEUED) -> Request:
    req = Request("r", [1, 2, 3], SamplingParams(), arrival_time=0.0)
    req.status = status  # test setup only: place the request directly in a state
    return req


ALLOWED = [(src, dst) for src, dsts in ALLOWED_TRANSITIONS.items() for dst in dsts]
DISALLOWED = [
    (src, dst)
    for src, dst in itertools.product(RequestStatus, RequestStatus)
    if dst not in ALLOWED_TRANSITIONS[src]
]


def test_table_covers_every_status() -> None:
    assert set(ALLOWED_TRANSITIONS) == set(RequestStatus)
    assert len(ALLOWED) == 53
    assert len(ALLOWED) + len(DISALLOWED) == len(RequestStatus) ** 2


@pytest.mark.parametrize(("src", "dst"), ALLOWED, ids=lambda s: s.name)
def test_every_allowed_transition_succeeds(src: RequestStatus, dst: RequestStatus) -> None:
    req = make(src)
    req.transition(dst)
    assert req.status is dst


@pytest.mark.parametrize(("src", "dst"), DISALLOWED, ids=lambda s: s.name)
def test_every_disallowed_transition_raises_and_changes_nothing(
    src: RequestStatus, dst: RequestStatus
) -> None:
    req = make(src)
    with pytest.raises(IllegalTransition, match=f"{src.name} -> {dst.name}"):
        req.transition(dst)
    assert req.status is src


@pytest.mark.parametrize(
    ("src", "dst"),
    [
        (S.QUEUED, S.PREFILLING),  # must be picked by a tick (RUNNABLE) first
        (S.QUEUED, S.FINISHED),  # nothing was generated
        (S.DECODING, S.PREFILLING),  # flat counting: a decode never goes back to prefill
        (S.RUNNABLE, S.DECODING),
        (S.PREEMPTED, S.DECODING),  # resumes through RUNNABLE
        (S.SWAPPED, S.PREFILLING),
        (S.PREFILLING, S.REJECTED),  # rejection only happens at admission
        (S.DECODING, S.QUEUED),
    ],
    ids=lambda s: s.name,
)
def test_named_illegal_edges(src: RequestStatus, dst: RequestStatus) -> None:
    with pytest.raises(IllegalTransition):
        make(src).transition(dst)


@pytest.mark.parametrize("status", sorted(TERMINAL, key=str), ids=str)
def test_terminal_states_have_no_exits(status: RequestStatus) -> None:
    assert status.is_terminal
    assert ALLOWED_TRANSITIONS[status] == frozenset()
    for dst in RequestStatus:
        with pytest.raises(IllegalTransition):
            make(status).transition(dst)


def test_terminal_predicate_is_exactly_the_five_end_states() -> None:
    assert {s for s in RequestStatus if s.is_terminal} == TERMINAL
    assert make(S.CANCELLED).is_finished and not make(S.DECODING).is_finished


def test_every_live_state_can_be_aborted_and_only_some_can_finish() -> None:
    for status in set(RequestStatus) - TERMINAL:
        assert ABORTS <= ALLOWED_TRANSITIONS[status], status
    can_finish = {s for s in RequestStatus if S.FINISHED in ALLOWED_TRANSITIONS[s]}
    assert can_finish == {S.PREFILLING, S.DECODING, S.BACKPRESSURED}
    can_reject = {s for s in RequestStatus if S.REJECTED in ALLOWED_TRANSITIONS[s]}
    assert can_reject == {S.QUEUED, S.DEGRADED}


def test_finish_reason_maps_to_status() -> None:
    expected = {
        FinishReason.EOS: S.FINISHED,
        FinishReason.STOP_TOKEN: S.FINISHED,
        FinishReason.STOP_STRING: S.FINISHED,
        FinishReason.MAX_TOKENS: S.FINISHED,
        FinishReason.CONTEXT_LIMIT: S.FINISHED,
        FinishReason.CANCELLED: S.CANCELLED,
        FinishReason.DEADLINE: S.TIMED_OUT,
        FinishReason.ERROR: S.FAILED,
        FinishReason.REJECTED: S.REJECTED,
        FinishReason.HANDED_OFF: S.FINISHED,
    }
    assert {r: r.status for r in FinishReason} == expected


def test_happy_path_with_preemption_and_backpressure() -> None:
    req = make()
    path = [S.RUNNABLE, S.PREFILLING, S.PREFILLING, S.DECODING, S.BACKPRESSURED, S.DECODING]
    path += [S.PREEMPTED, S.RUNNABLE, S.PREFILLING, S.DECODING, S.SWAPPED, S.RUNNABLE]
    path += [S.PREFILLING, S.DECODING, S.FINISHED]
    for status in path:
        req.transition(status)
    assert req.status is S.FINISHED


def test_empty_prompt_is_refused() -> None:
    with pytest.raises(ValueError, match="empty prompt"):
        Request("e", [], SamplingParams())


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=10**6), max_size=30))
def test_random_walks_along_allowed_edges_never_raise(choices: list[int]) -> None:
    """Any walk that follows the table is accepted; once terminal, the walk is stuck."""
    req = make()
    for choice in choices:
        exits = sorted(ALLOWED_TRANSITIONS[req.status], key=lambda s: s.name)
        if not exits:
            assert req.status.is_terminal
            break
        req.transition(exits[choice % len(exits)])
    assert req.status.is_terminal == (not ALLOWED_TRANSITIONS[req.status])


def test_the_record_log_keeps_the_latest_and_counts_every_one() -> None:
    log: RecordLog[int] = RecordLog(keep=3)
    for i in range(5):
        log.append(i)
    assert list(log) == [2, 3, 4] and len(log) == 3 and log.total == 5
    assert log.since(3) == [3, 4] and log.since(0) == [2, 3, 4] and log.since(5) == []
    assert log[-1] == 4 and log[-2:] == [3, 4] and list(reversed(log)) == [4, 3, 2]


def test_the_record_log_keeps_ten_thousand_by_default() -> None:
    """Without ``keep`` a record log is bounded at RECORDS_KEPT (10,000) records."""
    log: RecordLog[int] = RecordLog()
    for i in range(10_001):
        log.append(i)
    assert len(log) == 10_000 and log.total == 10_001 and log[0] == 1


def test_request_times_start_at_its_arrival() -> None:
    """A request's times record its arrival stamp (TTFT and queue metrics start there)."""
    req = Request("a", [1], SamplingParams(), arrival_time=12.5)
    assert req.times.arrival == 12.5 and req.times.queued is None


def test_only_the_scheduler_and_its_admission_change_a_state() -> None:
    """design.md#request-states: a state changes only through ``Request.transition``, and only
    the scheduler (with its admission step) calls it -- read off the product's source, so a
    module that starts moving requests itself fails here."""
    import ast
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    calls, writes = set(), set()
    for file in repo.glob("*/**/*.py"):
        top = file.relative_to(repo).parts[0]
        if top in ("tests", ".venv") or not (repo / top / "__init__.py").exists():
            continue
        for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                if node.func.attr == "transition":
                    calls.add(file.relative_to(repo).as_posix())
            if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Attribute) and t.attr == "status" for t in targets):
                    writes.add(file.relative_to(repo).as_posix())
    assert calls == {"engine/scheduler.py", "engine/admission.py"}
    # Request.transition's own write; the others are other records' statuses (HTTP errors, the
    # gate's refusals, a chaos client's outcomes), not a request's state.
    assert writes == {"engine/request.py", "api/errors.py", "api/gate.py", "chaos/load.py"}


def test_spec_stats_add_up_and_give_seed_7s_rates() -> None:
    stats = SpecStats()
    assert (stats.acceptance_rate, stats.mean_acceptance_length) == (0.0, 1.0)  # nothing yet
    stats.add(4, 3)
    stats.add(2, 0)
    assert (stats.num_steps, stats.num_drafted, stats.num_accepted) == (2, 6, 3)
    assert stats.acceptance_rate == 0.5  # 3 of 6 drafts
    assert stats.mean_acceptance_length == 2.5  # 1 + 3 accepted / 2 verifications
