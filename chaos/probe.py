"""What a live Tandem's HTTP endpoint says about itself, read as an operator would: its
Prometheus samples (``GET /metrics``), its workers' states (``GET /v1/cluster``) and, polled
every 100 ms, whether it answers (:class:`Poller`). The chaos harness, the benchmarks and the
e2e tests read it through these, with the standard library."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
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


# -- pollers ---------------------------------------------------------------------------------

SLOW_COMPLETION_S = 1.0  # a 1-token completion later than this is an outage its client saw


@dataclass
class Polls:
    """One path's polls, in order: when each was sent and whether it was good."""

    sent: list[float] = field(default_factory=list)
    good: list[bool] = field(default_factory=list)
    refused: int = 0  # no HTTP answer: connection refused, reset, timed out
    server_errors: int = 0  # 5xx (and a completion's 4xx: the poll itself is valid)
    slow: int = 0  # answered well, but after SLOW_COMPLETION_S (completions)

    def add(self, sent: float, good: bool) -> None:
        self.sent.append(sent)
        self.good.append(good)

    @property
    def answered(self) -> int:
        return len(self.sent) - self.refused

    def outage_s(self, since: float = 0.0) -> float:
        """Seconds from ``since`` covered by bad polls, each from its send to the next one's
        (the last one's: to now); a bad poll sent before ``since`` counts from then."""
        ends = [*self.sent[1:], time.time()]
        return sum(
            max(0.0, end - max(sent, since))
            for sent, end, good in zip(self.sent, ends, self.good, strict=True)
            if not good
        )

    def bad(self, since: float = 0.0) -> int:
        return sum(not g for s, g in zip(self.sent, self.good, strict=True) if s >= since)


class Poller:
    """Three pollers of an endpoint, each every ``period_s`` in its own thread until
    :meth:`stop`: ``GET /v1/models`` (the ingress alone answers it), ``GET /health`` (the
    ingress's view of the router and its workers: 503 when nothing can serve) and a 1-token
    greedy completion (through the router to a worker and back). A poll is bad when nothing
    answered it or it got a 5xx; a completion also when it is not a 200 within
    ``SLOW_COMPLETION_S`` -- one waiting behind a router restart is an outage its client sees,
    which ``/v1/models`` cannot show."""

    PATHS = ("models", "health", "completion")

    def __init__(self, url: str, model: str, period_s: float = 0.1) -> None:
        self.url, self.model, self.period_s = url, model, period_s
        self.polls = {path: Polls() for path in self.PATHS}
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._poll, args=(path,), daemon=True) for path in self.PATHS
        ]
        for thread in self._threads:
            thread.start()

    def _request(self, path: str) -> urllib.request.Request:
        if path == "completion":
            body = {"model": self.model, "prompt": "poll", "max_tokens": 1, "temperature": 0}
            return urllib.request.Request(
                f"{self.url}/v1/completions",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )
        return urllib.request.Request(f"{self.url}/{'v1/models' if path == 'models' else path}")

    def _poll(self, path: str) -> None:
        polls = self.polls[path]
        while not self._stop.wait(self.period_s):
            sent = time.time()
            try:
                with urllib.request.urlopen(self._request(path), timeout=60) as reply:
                    status = reply.status
            except urllib.error.HTTPError as exc:
                status = exc.code
            except OSError:
                polls.refused += 1
                polls.add(sent, False)
                continue
            slow = path == "completion" and status == 200 and time.time() - sent > SLOW_COMPLETION_S
            error = status >= 500 or (path == "completion" and status != 200)
            polls.server_errors += error
            polls.slow += slow
            polls.add(sent, not (error or slow))

    def stop(self) -> dict[str, Polls]:
        """Stop polling (the polls in flight end first); each path's polls."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=90)
        return self.polls
