"""Every kind of plan fault has its injection, and the registry refuses one that does not."""

from __future__ import annotations

import pytest

from chaos.injections import INJECTIONS, Registry
from chaos.plan import fault_kinds


def test_every_plan_fault_kind_has_an_injection() -> None:
    assert INJECTIONS.kinds == set(fault_kinds())
    INJECTIONS.check_complete()
    assert all(callable(INJECTIONS[kind]) for kind in fault_kinds())


async def _inject(*_: object) -> None:
    return None


def test_the_registry_refuses_a_kind_without_an_injection() -> None:
    registry = Registry(["kill_worker", "new_kind"])
    registry.register("kill_worker")(_inject)
    with pytest.raises(TypeError, match="without an injection: new_kind"):
        registry.check_complete()
    registry.register("new_kind")(_inject)
    registry.check_complete()


def test_the_registry_refuses_an_injection_for_no_kind_or_a_second_one() -> None:
    registry = Registry(["kill_worker"])
    with pytest.raises(TypeError, match="no plan fault has kind 'kill_wroker'"):
        registry.register("kill_wroker")(_inject)
    registry.register("kill_worker")(_inject)
    with pytest.raises(TypeError, match="'kill_worker' has two injections"):
        registry.register("kill_worker")(_inject)
