"""What a live Tandem's HTTP endpoint says about itself, read as an operator would: its
Prometheus samples (``GET /metrics``) and its workers' states (``GET /v1/cluster``). The chaos
harness, the benchmarks and the e2e tests read it through these, with the standard library."""

from __future__ import annotations

import json
import time
import urllib.request
from typing import Any


def metric(url: str, name: str, **labels: str) -> list[float]:
    """The values of ``name``'s samples whose labels include ``labels``; [] when none is
    exported (a gauge removed, a labelled counter never incremented). Raises OSError when
    the endpoint does not answer."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    wanted = [f'{k}="{v}"' for k, v in labels.items()]
    return [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith((name + "{", name + " ")) and all(w in line for w in wanted)
    ]


def worker_states(url: str) -> dict[str, str]:
    """Each worker's state as the router sees it (up, failed, ...), by name."""
    with urllib.request.urlopen(f"{url}/v1/cluster", timeout=10) as reply:
        view: dict[str, Any] = json.load(reply)
    return {w["name"]: w["state"] for w in view["workers"]}


def wait_all_up(url: str, timeout_s: float = 120.0) -> None:
    """Until the router has every worker up; raises TimeoutError naming the states it saw."""
    until = time.time() + timeout_s
    states: dict[str, str] | str = "no answer"
    while time.time() < until:
        try:
            states = worker_states(url)
        except OSError as exc:
            states = repr(exc)
        if isinstance(states, dict) and set(states.values()) == {"up"}:
            return
        time.sleep(0.2)
    raise TimeoutError(f"the workers were not all up within {timeout_s:.0f} s: {states}")
