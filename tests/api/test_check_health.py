"""Serve's replica health check (docs/design.md#control-plane): ``Ingress.check_health`` fails
only when the replica is broken -- its router gone for good, or its own router handle lost --
never while the router restarts (Serve would replace a working replica, its streams with it).

The router is a stub of the one call the check makes across the process boundary
(``router.key()``), raising what Ray raises: ``ActorUnavailableError`` while a
``max_restarts=-1`` actor restarts, ``ActorDiedError`` once it is gone for good; a router that
does not answer (paused, or Ray holding the call) runs into the check's timeout.
"""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace
from typing import Any

import pytest
from ray.exceptions import ActorDiedError, ActorUnavailableError

import api.operator_plane
from api.app import Service
from api.gate import GateConfig, IngressGate
from api.metrics import Metrics
from contracts.actors import RouterClient
from tandem.deployment import Ingress


class Router:
    """The router actor as the replica reaches it: ``key()`` raises ``error``, or never
    answers when there is none."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error

    async def key(self) -> str:
        if self.error is not None:
            raise self.error
        await asyncio.Event().wait()  # no answer: the check's timeout ends the wait
        return "never"


def check_health(router: Any) -> None:
    """Serve's call: ``Ingress.check_health`` on a replica whose router is ``router`` (its
    constructor, which attaches to a running cluster, is left out)."""
    service = Service(
        None,  # type: ignore[arg-type]  # the check asks no coordinator
        router,
        None,  # type: ignore[arg-type]  # nor a tokenizer
        "demo",
        512,
        2048,
        IngressGate(GateConfig()),
        Metrics(),
        None,
    )
    ingress = Ingress.func_or_class  # type: ignore[attr-defined]  # the class under @serve
    asyncio.run(ingress.check_health(SimpleNamespace(service=service)))


@pytest.mark.parametrize(
    "router",
    [Router(ActorUnavailableError("The actor is restarting", None)), Router()],
    ids=["unavailable", "not-answering"],
)
def test_check_health_passes_while_the_router_restarts(
    router: Router, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(api.operator_plane, "ROUTER_CALL_TIMEOUT_S", 0.05)
    with caplog.at_level(logging.INFO, logger="tandem.api"):
        check_health(router)  # no error: Serve keeps the replica
    assert "health check: the router is restarting" in caplog.messages


def test_check_health_fails_when_the_router_is_gone_or_the_replica_is_broken() -> None:
    died = ActorDiedError()  # max_restarts spent, or killed with no_restart: gone for good
    with pytest.raises(ActorDiedError) as gone:
        check_health(Router(died))
    assert gone.value is died  # Serve gets Ray's own error and replaces the replica

    # The replica's own state broken (its router handle lost): not taken for a restart.
    with pytest.raises(AttributeError, match="'NoneType' object has no attribute 'key'"):
        check_health(RouterClient(None))
