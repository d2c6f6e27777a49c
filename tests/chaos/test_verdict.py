"""The chaos run's rules over plain records: what counts as a mismatch, which requests a
fault touched, detection, recovery and stranded KV."""

from __future__ import annotations

import math

import pytest

from chaos.inject import FaultEvent
from chaos.load import ChoiceOut, Outcome
from chaos.reference import Expected
from chaos.verdict import (
    RECOVERY_WINDOW_S,
    Attempt,
    Check,
    FaultRow,
    detection_s,
    differs_from_transformers,
    endings,
    false_alarms,
    invalid_output,
    mismatch,
    on_schedule,
    recovery_s,
    stranded,
    structured_check,
    timeline,
    touched_by,
)

WANT = Expected(
    text="a bc d",
    tokens=["a", " bc", " d"],
    token_logprobs=[-0.5, -1.25, -0.125],
    top_logprobs=[{"a": -0.5}, {" bc": -1.25}, {" d": -0.125}],
    finish_reason="length",
)


def got(n: int, status: str = "ok", **changes: object) -> Outcome:
    choice = ChoiceOut(
        text="".join(WANT.tokens[:n]),
        tokens=WANT.tokens[:n],
        token_logprobs=WANT.token_logprobs[:n],
        top_logprobs=WANT.top_logprobs[:n],
        finish_reason="length" if status == "ok" else None,
    )
    for name, value in changes.items():
        setattr(choice, name, value)
    return Outcome(0, scheduled=0.0, status=status, choices={0: choice})


def test_a_complete_answer_must_equal_the_reference() -> None:
    assert mismatch(got(3), [WANT]) is None
    assert mismatch(got(2), [WANT]) == "choice 0: 2 tokens, the reference has 3"
    duplicated = got(3, tokens=["a", " bc", " bc"], text="a bc bc")
    assert mismatch(duplicated, [WANT]) == "choice 0: tokens differ from token 2"
    assert mismatch(got(3, token_logprobs=[-0.5, -1.2500001, -0.125]), [WANT]) == (
        "choice 0: token_logprobs differ from token 1"
    )
    # Any top alternative, not only the most likely: one logprob of a lower-ranked token.
    tops = [{"a": -0.5, " b": -2.0}, {" bc": -1.25}, {" d": -0.125}]
    want_tops = Expected(**{**vars(WANT), "top_logprobs": tops})
    assert mismatch(got(3, top_logprobs=tops), [want_tops]) is None
    changed = [{"a": -0.5, " b": -2.0000005}, {" bc": -1.25}, {" d": -0.125}]
    assert mismatch(got(3, top_logprobs=changed), [want_tops]) == (
        "choice 0: top_logprobs differ from token 0"
    )
    assert mismatch(got(3, finish_reason="stop"), [WANT]) == (
        "choice 0: text or finish_reason differ"
    )
    assert mismatch(Outcome(0, 0.0, status="ok"), [WANT]) == "choice 0 missing"


@pytest.mark.parametrize("status", ["cancelled", "error", "hung"])
def test_a_cut_answer_must_be_a_prefix_of_the_reference(status: str) -> None:
    assert mismatch(got(0, status), [WANT]) is None
    assert mismatch(got(2, status), [WANT]) is None
    assert mismatch(Outcome(0, 0.0, status=status), [WANT]) is None  # nothing came
    skipped = got(2, status, tokens=["a", " d"], text="a d")
    assert mismatch(skipped, [WANT]) == "choice 0: tokens differ from token 1"
    assert mismatch(got(2, status, text="a bx"), [WANT]) == (
        "choice 0: the text received is not a prefix of the reference"
    )


def test_a_request_is_touched_by_faults_on_its_workers_or_on_everyone_while_open() -> None:
    o = Outcome(0, scheduled=9.0, sent=10.0, finished=20.0, response_id="cmpl-x")
    mine = [Attempt("cmpl-x@1", "cmpl-x", "prefill-0", "decode-1")]
    kill = FaultEvent("kill_worker", 12.0, ["decode-1"], until=15.0, number=1)
    other = FaultEvent("kill_worker", 12.0, ["decode-0"], until=15.0, number=2)
    before = FaultEvent("kill_worker", 2.0, ["decode-1"], until=9.5)  # back before it was sent
    after = FaultEvent("kill_worker", 21.0, ["prefill-0"], until=25.0, number=4)
    router = FaultEvent("kill_router", 19.0, everyone=True, number=3)
    assert touched_by(o, mine, [kill, other, before, after, router]) == [
        "kill_worker#1",
        "kill_router#3",
    ]
    unknown = Outcome(1, scheduled=9.0, sent=10.0, finished=11.0)  # failed before an id
    assert touched_by(unknown, [], [FaultEvent("kill_worker", 10.5, ["decode-0"], number=7)]) == [
        "kill_worker#7"
    ]
    assert touched_by(unknown, [], [other]) == []
    # Refused with its id (the ingress's X-Tandem-Request-Id) but never routed: still unknown routing.
    unrouted = Outcome(2, scheduled=9.0, sent=10.0, finished=11.0, response_id="cmpl-y")
    assert touched_by(unrouted, [], [FaultEvent("kill_worker", 10.5, ["decode-0"], number=8)]) == [
        "kill_worker#8"
    ]


def test_timeline_bins_tokens_errors_and_ttft_from_the_scheduled_send() -> None:
    a = Outcome(0, scheduled=100.0, first_token=100.5, finished=101.5, status="ok")
    a.token_times = [(100.5, 1), (101.2, 3)]
    b = Outcome(1, scheduled=101.0, first_token=101.9, finished=102.5, status="error")
    b.token_times = [(101.9, 2)]
    bins = timeline([a, b], start=100.0, end=103.0)
    assert [x.tokens_per_s for x in bins] == [1.0, 5.0, 0.0]
    assert [x.errors for x in bins] == [0, 0, 1]
    assert [x.requests for x in bins] == [1, 1, 0]
    assert bins[0].ttft_p99 == 0.5 and bins[1].ttft_p50 == pytest.approx(0.9)
    assert math.isnan(bins[2].ttft_p50)  # no first token in that second


def steady_stream(rate_until: float, dip: tuple[float, float]) -> list[Outcome]:
    """A request every 0.1 s with 10 tokens and TTFT 0.1 s, none first-tokened in ``dip``."""
    out = []
    for i in range(int(rate_until * 10)):
        t = i / 10
        if dip[0] <= t < dip[1]:
            continue
        o = Outcome(i, scheduled=t - 0.1, first_token=t, finished=t, status="ok")
        o.token_times = [(t, 10)]
        out.append(o)
    return out


def test_recovery_is_when_a_window_is_back_within_ten_percent() -> None:
    outcomes = steady_stream(60.0, dip=(20.0, 23.0))
    steady, back = recovery_s(outcomes, fault_at=20.0, not_before=0.0, load_end=60.0)
    assert steady.tokens_per_s == pytest.approx(100.0) and steady.ttft_p99 == pytest.approx(0.1)
    # The first 5 s window from the fault with >= 90 tok/s starts at 22.5 s (2.5 s of the 3 s
    # dip behind it would leave 50 tok/s; at 22.5: 0.5 s missing -> 90 tok/s).
    assert back == pytest.approx(2.5)
    never = steady_stream(60.0, dip=(20.0, 60.0))
    assert recovery_s(never, 20.0, 0.0, 60.0)[1] is None
    assert RECOVERY_WINDOW_S == 5.0


def test_detection_is_the_first_failed_mark_of_the_faults_worker_after_it() -> None:
    event = FaultEvent("kill_worker", 100.0, ["decode-0"])
    health = [
        {"worker": "decode-0", "event": "failed", "why": "old", "at": 50.0},
        {"worker": "decode-1", "event": "failed", "why": "x", "at": 100.2},
        {"worker": "decode-0", "event": "up", "why": "", "at": 100.3},
        {"worker": "decode-0", "event": "failed", "why": "died", "at": 100.4},
        {"worker": "decode-0", "event": "failed", "why": "again", "at": 101.0},
    ]
    assert detection_s(event, health) == pytest.approx(0.4)
    early = [{"worker": "decode-0", "event": "failed", "why": "exited", "at": 99.98}]
    assert detection_s(event, early) == 0.0  # within the death watch's polling
    assert detection_s(FaultEvent("kill_worker", 100.0, ["prefill-0"]), health) is None
    # Killed while the router was down (100-103): timed from the router's return.
    router = FaultEvent("kill_router", 99.0, everyone=True, until=103.0)
    marked = [{"worker": "decode-0", "event": "failed", "why": "silent", "at": 105.5}]
    assert detection_s(event, marked, [router]) == pytest.approx(2.5)
    assert detection_s(event, marked, [FaultEvent("kill_router", 90.0, until=95.0)]) == 5.5
    # The router killed just after the worker: it may have died before marking it.
    late_router = FaultEvent("kill_router", 100.5, everyone=True, until=103.0)
    assert detection_s(event, marked, [late_router]) == pytest.approx(2.5)


def test_a_failed_mark_no_fault_explains_is_a_false_alarm() -> None:
    """A worker marked FAILED before any fault hit it, or that no fault hit at all, was blamed
    for something else (the router's own pause, a load); a fault's own marks are not."""
    events = [FaultEvent("kill_worker", 100.0, ["decode-0"]), FaultEvent("hang_router", 10.0)]
    health = [
        {"worker": "prefill-0", "event": "failed", "why": "silent for 10.1 s", "at": 20.0},
        {"worker": "decode-0", "event": "failed", "why": "silent for 10.1 s", "at": 20.1},
        {"worker": "decode-0", "event": "up", "why": "", "at": 21.0},
        {"worker": "decode-0", "event": "failed", "why": "its process exited", "at": 100.04},
        {"worker": "decode-0", "event": "failed", "why": "restarted", "at": 104.0},
    ]
    assert false_alarms(events, health) == [
        "prefill-0 (silent for 10.1 s)",
        "decode-0 (silent for 10.1 s)",
    ]
    assert false_alarms(events, health[3:]) == []


def record(
    rid: str, status: str, arrival: float, finished: float, tokens: int
) -> dict[str, object]:
    return {
        "request_id": rid,
        "status": status,
        "arrival": arrival,
        "finished": finished,
        "num_prompt_tokens": tokens,
        "num_generated": 0,
    }


def test_stranded_kv_is_held_by_survivors_for_attempts_whose_peer_was_killed() -> None:
    kill = FaultEvent("kill_worker", 10.0, ["prefill-0"])
    attempts = {
        "a@1": Attempt("a@1", "a", "prefill-0", "decode-0"),  # its sender died: held 0.5 s after
        "b@1": Attempt("b@1", "b", "prefill-0", "decode-1"),  # finished anyway: not stranded
        "c@1": Attempt("c@1", "c", "prefill-1", "decode-0"),  # another peer
        "d@1": Attempt("d@1", "d", "prefill-0", "decode-0"),  # arrived after the kill
    }
    records = {
        "decode-0": [
            record("a@1", "failed", 9.0, 10.5, 40),  # 40 tokens: 3 blocks of 16
            record("c@1", "failed", 9.0, 12.0, 16),
            record("d@1", "failed", 10.1, 13.0, 16),
        ],
        "decode-1": [record("b@1", "finished", 9.0, 11.0, 16)],
        "prefill-0": [record("a@1", "failed", 9.0, 10.0, 40)],  # the dead one's own
    }
    s = stranded([kill], attempts, records, block_size=16)
    assert (s.attempts, s.blocks) == (1, 3)
    assert s.block_seconds == pytest.approx(1.5) and s.worst_s == pytest.approx(0.5)
    assert s.per_block_s == pytest.approx(0.5)


def test_a_greedy_request_must_equal_transformers_or_be_cut_with_a_prefix() -> None:
    names = ["a", " bc", " d"]
    assert differs_from_transformers(got(3), names) is None
    assert differs_from_transformers(got(2), names) == (
        "2 tokens, transformers 3; first difference at None"
    )
    assert differs_from_transformers(got(3, tokens=["a", " x", " d"]), names) == (
        "3 tokens, transformers 3; first difference at 1"
    )
    assert differs_from_transformers(got(2, "error"), names) is None  # cut: a prefix
    assert differs_from_transformers(got(2, "hung", tokens=["a", " d"]), names) == (
        "the tokens received are not a prefix of transformers'"
    )


def test_a_load_sent_late_fails_the_schedule_check_naming_the_stall() -> None:
    """A client whose loop stalled sent the plan's load late (CI: a 23 s stall displaced every
    fault; the run blamed a fault 'nothing reached' instead)."""
    assert on_schedule(0.02, 0.0, 5.0) == Check(
        "the load left on schedule", True, "latest send 0.02 s after its time", "<= 5 s"
    )
    late = on_schedule(23.4, 22.9, 5.0)
    assert not late.passed
    assert late.measured == "latest send 23.40 s after its time; this client stalled 22.9 s"
    assert on_schedule(5.0, 0.0, 5.0).passed and not on_schedule(5.01, 0.0, 5.0).passed


def test_a_fault_done_while_the_router_was_down_is_timed_against_its_own_limit() -> None:
    """Timed from the router's return: a killed worker's (Ray's actor table shows it
    RESTARTING to the new router's first look) within the kill limit plus a second; a hung one
    by its silence, within the look's length plus the margin; the same kill with the router up
    keeps the plain kill limit."""
    from chaos.plan import Checks
    from chaos.run import _late_detections
    from router.health import FIRST_LOOK_MIN_S

    c = Checks()  # kill limit 1 s, hang margin 1 s
    look = max(2.0, FIRST_LOOK_MIN_S) + c.max_detect_hang_margin_s + 1.0

    def row(kind: str, detect_s: float | None, router_down: bool) -> FaultRow:
        return FaultRow(
            kind, 5.0, ["decode-0"], "", detect_s, None, 0.0, math.nan, 0, 0, None, router_down
        )

    def late(*rows: FaultRow) -> list[str]:
        return _late_detections(list(rows), c, heartbeat_s=2.0)

    assert late(row("kill_worker", 1.9, True), row("churn", 2.0, True)) == []
    assert late(row("kill_worker", 2.1, True)) == ["kill_worker decode-0: 2.1"]
    assert late(row("kill_worker", 1.1, False)) == ["kill_worker decode-0: 1.1"]
    assert late(row("hang_worker", look, True)) == []
    assert late(row("hang_worker", look + 0.1, True)) == [f"hang_worker decode-0: {look + 0.1}"]
    assert late(row("hang_worker", 3.1, False)) == ["hang_worker decode-0: 3.1"]
    assert late(row("kill_worker", None, True)) == ["kill_worker decode-0: None"]
    assert late(row("kill_router", None, False)) == []


def answered(*texts: str, finish: str | None = "stop", status: str = "ok") -> Outcome:
    """A request whose choices wrote ``texts``, each ended with ``finish``."""
    choices = {i: ChoiceOut(text=t, finish_reason=finish) for i, t in enumerate(texts)}
    return Outcome(0, scheduled=0.0, status=status, choices=choices)


VALID_JSON = (
    '{"name": "tandem", "kind": "river", "count": 7, "tags": ["a", "bc"], "active": true, '
    '"code": "ab-123"}'
)


def test_a_structured_output_that_ended_by_itself_must_match_its_grammar() -> None:
    """Valid outputs pass; invalid JSON, a schema broken, a regex or choice missed, a tool call
    with bad arguments each name why; the second choice is judged too."""
    assert invalid_output(answered(VALID_JSON), "json_schema") is None
    assert invalid_output(answered("2024-02-29"), "regex") is None
    assert invalid_output(answered("violet"), "choice") is None
    call = '<tool_call>[{"name": "add", "arguments": {"a": 1, "b": 999}}]</tool_call>'
    assert invalid_output(answered(call), "tool") is None

    cut_json = answered(VALID_JSON[:-1])
    assert (invalid_output(cut_json, "json_schema") or "").startswith("choice 0: not JSON: ")
    assert invalid_output(answered(VALID_JSON.replace("7", "100")), "json_schema") == (
        "choice 0: breaks the schema at /count: 100 is greater than the maximum of 99"
    )
    twice = VALID_JSON.replace('"kind": "river"', '"kind": "river", "kind": "cloud"')
    assert invalid_output(answered(twice), "json_schema") == (
        "choice 0: not JSON: keys given twice: ['kind']"
    )
    assert invalid_output(answered("2024-13-01"), "regex") == (
        "choice 0: '2024-13-01' does not match the regex"
    )
    assert invalid_output(answered("violet", "purple"), "choice") == (
        "choice 1: 'purple' is not one of ['red', 'green', 'blue', 'violet']"
    )
    bad_args = call.replace('"b": 999', '"b": "999"')
    assert invalid_output(answered(bad_args), "tool") == (
        "choice 0: call 0 (add) arguments: breaks the schema at /b: '999' is not of type 'integer'"
    )
    assert invalid_output(answered("sure: " + call), "tool") == (
        "choice 0: text outside the tool calls: 'sure: '"
    )


def test_a_structured_output_cut_short_is_counted_not_judged() -> None:
    """One that ended at max_tokens, or was cancelled, is a prefix of its grammar's language:
    not judged here (mismatch holds it to the reference), but counted."""
    assert invalid_output(answered(VALID_JSON[:20], finish="length"), "json_schema") is None
    cancelled = answered("20", finish=None, status="cancelled")
    assert invalid_output(cancelled, "regex") is None
    assert endings(answered(VALID_JSON, "x", finish="length"), 2) == ["length", "length"]
    assert endings(answered("red"), 2) == ["stop", "cut"]  # choice 1 never came
    assert endings(cancelled, 1) == ["cut"]

    check = structured_check(
        [
            ("json_schema", None, ["stop"]),
            ("json_schema", None, ["length"]),
            ("regex", None, ["cut"]),
        ]
    )
    assert check == Check(
        "structured outputs match their grammar",
        True,
        "0 invalid; 1 choices judged (stop), length and cut not (json_schema 1 stop, 1 length, "
        "0 cut; regex 0 stop, 0 length, 1 cut)",
        "0 (and some judged)",
    )
    assert not structured_check([("regex", "choice 0: ...", ["stop"])]).passed
    assert not structured_check([("regex", None, ["length"])]).passed  # nothing judged
