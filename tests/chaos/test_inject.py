"""Which workers and hosts a chaos fault hits (no cluster needed to choose)."""

from __future__ import annotations

from pathlib import Path

import pytest

from chaos.inject import InjectError, Injector, Worker
from chaos.plan import Target
from contracts.roles import Role
from tandem.testbed import Host, Testbed

WORKERS = [
    Worker("prefill-0", Role.PREFILL, "a", None),
    Worker("prefill-1", Role.PREFILL, "b", None),
    Worker("decode-0", Role.DECODE, "b", None),
    Worker("decode-1", Role.DECODE, "c", None),
]
BED = Testbed(
    [
        Host("tdm-h0", "10.213.0.1", "a"),
        Host("tdm-h1", "10.213.0.2", "b"),
        Host("tdm-h2", "10.213.0.3", "c"),
    ],
    "10.213.0.254",
    Path("/nonexistent"),
    Path("/nonexistent"),
)


def test_a_target_names_a_worker_or_draws_one_that_matches_from_the_seed() -> None:
    inj = Injector(WORKERS, seed=1)
    drawn = [inj.pick(Target(role=Role.PREFILL)).name for _ in range(40)]
    assert set(drawn) == {"prefill-0", "prefill-1"}
    again = Injector(WORKERS, seed=1)
    assert [again.pick(Target(role=Role.PREFILL)).name for _ in range(40)] == drawn
    assert inj.pick(Target(name="decode-1")).name == "decode-1"
    assert inj.pick(Target(role=Role.DECODE, domain="b")).name == "decode-0"
    assert {inj.pick(Target(), roles=[Role.DECODE]).name for _ in range(20)} == {
        "decode-0",
        "decode-1",
    }
    with pytest.raises(InjectError, match="no worker named 'decode-7'"):
        inj.pick(Target(name="decode-7"))
    with pytest.raises(InjectError, match="no worker matches"):
        inj.pick(Target(role=Role.COLOCATED))


def test_host_faults_pick_bed_hosts_never_the_head_and_name_their_workers() -> None:
    with pytest.raises(InjectError, match="need a test bed"):
        Injector(WORKERS, seed=0).hosts(2)
    inj = Injector(WORKERS, seed=0, bed=BED)
    assert inj.hosts(2) == [BED.hosts[2]]
    assert inj.hosts(domain="b") == [BED.hosts[1]]
    assert inj._on(inj.hosts(domain="b")) == ["decode-0", "prefill-1"]
    with pytest.raises(InjectError, match="tdm-h0 is the head"):
        inj.hosts(domain="a")
    with pytest.raises(InjectError, match="no bed host 5"):
        inj.hosts(5)
