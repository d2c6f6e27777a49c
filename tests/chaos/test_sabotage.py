"""The harness's self-test (``--sabotage``): what each planted violation does to a stream, that
a worker plants at most one per attempt, where each kind is armed, and when the verdict counts
one as caught. The e2e test (tests/e2e/test_chaos.py) plants them in a live cluster."""

from __future__ import annotations

import pytest

from chaos.inject import FaultEvent
from chaos.load import Outcome
from chaos.plan import Checks
from chaos.sabotage import CHECK, Kind, Planted, arm, decoders, judge, parse
from chaos.verdict import Attempt, terminal_records
from cluster.sabotage import LOGPROB_SHIFT, spoil
from contracts.faults import SABOTAGE, Fault, FaultAction, FaultPlan, FaultPoint
from contracts.roles import Role
from engine.outputs import TokenDelta, TokenLogprobs

LPS = [TokenLogprobs(-0.5, [(7, -0.5), (9, -1.5)], 1), TokenLogprobs(-2.0, [(3, -1.0)], 2)]
DELTA = TokenDelta("r", [7, 8], text="ab", logprobs=LPS)


def test_each_stream_sabotage_changes_exactly_what_it_names() -> None:
    assert spoil(DELTA, FaultAction.SPOIL_TOKEN, 10).token_ids == [8, 8]
    assert spoil(DELTA, FaultAction.SPOIL_TOKEN, 8).token_ids == [0, 8]  # wraps in the vocab
    dropped = spoil(DELTA, FaultAction.DROP_TOKEN, 10)
    assert (dropped.token_ids, dropped.logprobs) == ([8], LPS[1:])
    repeated = spoil(DELTA, FaultAction.REPEAT, 10)
    assert (repeated.token_ids, repeated.logprobs) == ([7, 7, 8], [LPS[0], *LPS])
    spoiled = spoil(DELTA, FaultAction.SPOIL_LOGPROB, 10)
    assert spoiled.token_ids == DELTA.token_ids and spoiled.logprobs is not None
    # the last alternative of the first token's top-k: not the sampled token, whose logprob stays
    assert spoiled.logprobs[0] == TokenLogprobs(-0.5, [(7, -0.5), (9, -1.5 - LOGPROB_SHIFT)], 1)
    assert spoiled.logprobs[1:] == LPS[1:]
    alone = TokenDelta("r", [3], logprobs=[TokenLogprobs(-1.0, [(3, -1.0)], 1)])
    only = spoil(alone, FaultAction.SPOIL_LOGPROB, 10).logprobs
    assert only == [TokenLogprobs(-1.0 - LOGPROB_SHIFT, [(3, -1.0 - LOGPROB_SHIFT)], 1)]
    for action in (FaultAction.HOLD, FaultAction.LEAK_BLOCK, FaultAction.LOSE_RECORD):
        assert spoil(DELTA, action, 10) == DELTA  # done by the worker, not to the delta
    assert spoil(DELTA, FaultAction.SPOIL_TOKEN, 10).text == DELTA.text


def test_a_worker_spoils_an_attempt_once_and_only_where_it_names_it() -> None:
    plan = FaultPlan(
        [
            Fault(FaultPoint.DECODE_TOKENS, FaultAction.SPOIL_TOKEN, at=1),
            Fault(FaultPoint.DECODE_TOKENS, FaultAction.REPEAT, at=1),
            Fault(FaultPoint.DECODE_TOKENS, FaultAction.RAISE, at=5, attempt=2),
        ]
    )
    assert plan.take(FaultPoint.DECODE_TOKENS, 1, 3, None) is None  # a delta without tokens
    first = plan.take(FaultPoint.DECODE_TOKENS, 1, 3, "a")
    assert first is not None and (first.action, first.hit) == (FaultAction.SPOIL_TOKEN, "a")
    assert plan.take(FaultPoint.DECODE_TOKENS, 1, 4, "a") is None  # "a" is spoiled already
    second = plan.take(FaultPoint.DECODE_TOKENS, 1, 4, "b")
    assert second is not None and (second.action, second.hit) == (FaultAction.REPEAT, "b")
    # not a sabotage: fires on a spoiled attempt too, on its attempt number only
    assert plan.take(FaultPoint.DECODE_TOKENS, 1, 9, "a") is None
    third = plan.take(FaultPoint.DECODE_TOKENS, 2, 9, "a")
    assert third is not None and third.action is FaultAction.RAISE
    assert FaultAction.RAISE not in SABOTAGE and FaultAction.SPOIL_TOKEN in SABOTAGE


def test_sabotage_kinds_parse_and_each_names_a_check() -> None:
    assert parse("all") == list(Kind)
    assert parse("token, hang,token") == [Kind.TOKEN, Kind.HANG]
    with pytest.raises(ValueError, match="'tokn': not a kind"):
        parse("tokn")
    assert set(CHECK) == set(Kind)


def test_each_kind_is_armed_on_the_workers_that_stream_in_turn() -> None:
    names = decoders(
        [("prefill-0", Role.PREFILL), ("decode-0", Role.DECODE), ("decode-1", Role.DECODE)]
    )
    assert names == ["decode-0", "decode-1"]
    checks = Checks(hang_bound_s=15, settle_s=10)
    planted = arm([Kind.TOKEN, Kind.HANG, Kind.LEAK, Kind.FAIL], names, checks, 3)
    assert [(p.kind, p.worker) for p in planted] == [
        (Kind.TOKEN, "decode-0"),
        (Kind.HANG, "decode-1"),
        (Kind.LEAK, "decode-0"),
        (Kind.FAIL, "decode-1"),
    ]
    token, hang, leak, fail = planted
    assert token.faults == [
        ("decode-0", Fault(FaultPoint.DECODE_TOKENS, FaultAction.SPOIL_TOKEN, at=3))
    ]
    assert hang.faults[0][1].seconds == 15 + 30  # held past the hang bound
    assert leak.faults[0][1].seconds == 10 + 20  # held past the settle time
    # every attempt of one request fails: its first on decode-1, the later ones anywhere
    assert [(w, f.action, f.attempt) for w, f in fail.faults] == [
        ("decode-1", FaultAction.RAISE, 1),
        ("decode-0", FaultAction.RAISE, 2),
        ("decode-1", FaultAction.RAISE, 2),
        ("decode-0", FaultAction.RAISE, 3),
        ("decode-1", FaultAction.RAISE, 3),
    ]


def row(index: int, status: str = "ok", mismatch: str | None = None, **more: object) -> dict:
    return {
        "index": index,
        "status": status,
        "mismatch": mismatch,
        "touched": [],
        "error": None,
        **more,
    }


def test_a_sabotage_is_caught_only_when_its_check_failed_pointing_at_it() -> None:
    def caught(kind: Kind, passed: bool, rows: dict, **where: object) -> bool:
        p = Planted(kind, "decode-0", [], attempt="a1")
        checks = {CHECK[kind]: passed}
        judge(
            [p],
            checks,
            rows,
            where.get("leaks", {}),
            where.get("missing", []),
            where.get("repeated", []),
        )  # type: ignore[arg-type]
        return p.caught

    spoiled = {"a1": row(4, mismatch="choice 0: tokens differ from token 2")}
    assert caught(Kind.TOKEN, False, spoiled)
    assert not caught(Kind.TOKEN, True, spoiled)  # the check passed: not caught
    assert not caught(Kind.TOKEN, False, {"a1": row(4)})  # failed, but not for this request
    assert caught(Kind.HANG, False, {"a1": row(4, "hung")})
    assert not caught(Kind.HANG, False, {"a1": row(4, "ok")})
    assert caught(Kind.FAIL, False, {"a1": row(4, "error")})
    assert not caught(Kind.FAIL, False, {"a1": row(4, "error", touched=["kill_worker#1"])})
    assert caught(Kind.LEAK, False, {}, leaks={"decode-0": "KVInvariantError"})
    assert not caught(Kind.LEAK, False, {}, leaks={"decode-1": "KVInvariantError"})
    assert caught(Kind.LOST_RECORD, False, {}, missing=["a1"])
    assert not caught(Kind.LOST_RECORD, False, {}, repeated=["a1"])
    assert caught(Kind.DOUBLE_RECORD, False, {}, repeated=["a1"])
    never = Planted(Kind.TOKEN, "decode-0", [])
    judge([never], {CHECK[Kind.TOKEN]: False}, {}, {}, [], [])
    assert not never.caught and never.how == "never fired: no request reached it"


def test_every_attempt_of_an_untouched_request_has_one_record_on_each_worker() -> None:
    sent = Outcome(0, scheduled=10.0, sent=10.0, status="ok")
    disagg = Attempt("a1", "r1", "prefill-0", "decode-0")
    local = Attempt("a2", "r2", None, "decode-1")
    records = {
        "prefill-0": [{"request_id": "a1"}],
        "decode-0": [{"request_id": "a1"}],
        "decode-1": [{"request_id": "a2"}, {"request_id": "a2"}],
    }
    ran = [(sent, [disagg], False), (sent, [local], False)]
    assert terminal_records(ran, records, []) == ([], ["a2"])
    records["prefill-0"] = []
    assert terminal_records(ran, records, []) == (["a1"], ["a2"])
    # touched by a fault: not judged; a worker killed since the request was sent: its
    # records died with it
    assert terminal_records([(sent, [disagg], True)], records, []) == ([], ["a2"])
    kill = FaultEvent("kill_worker", at=30.0, workers=["prefill-0"])
    assert terminal_records(ran[:1], records, [kill]) == ([], ["a2"])
    early = FaultEvent("kill_worker", at=5.0, workers=["prefill-0"])
    assert terminal_records(ran[:1], records, [early]) == (["a1"], ["a2"])
