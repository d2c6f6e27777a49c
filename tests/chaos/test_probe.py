"""The endpoint probes against a stand-in endpoint on loopback: Prometheus samples by name and
labels, the workers' states, the three pollers, and a refused connection as the load generator
records it."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from chaos.load import send_one
from chaos.probe import SLOW_COMPLETION_S, Poller, metric, wait_all_up, worker_states

pytestmark = pytest.mark.e2e  # HTTP on loopback

METRICS = """\
# TYPE tandem_worker_up gauge
tandem_worker_up{worker="decode-0"} 1.0
tandem_worker_up{worker="decode-1"} 0.0
tandem_requests_total{status="finished",tenant="a"} 3.0
tandem_requests_total{status="cancelled",tenant="a"} 2.0
tandem_requests_created{status="finished",tenant="a"} 1.7e9
tandem_retry_budget_tokens 0.0
"""
STATES = {"decode-0": "up", "decode-1": "failed"}
# How the stand-in answers the pollers: /health's status, and how long a completion takes.
POLLED = {"health": 200, "completion_s": 0.0}
REFUSED = b'{"error": {"message": "no replica", "type": "x", "param": null, "code": "failed"}}'


class Endpoint(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # /v1/completions: a 1-token answer, after POLLED's delay
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if b'"refuse"' in body:  # as Tandem's ingress fails a request before its first token
            self._answer(503, REFUSED, {"X-Tandem-Request-Id": "cmpl-refused"})
            return
        time.sleep(POLLED["completion_s"])
        self._answer(200, b"{}")

    def do_GET(self) -> None:
        if self.path == "/health":
            self._answer(int(POLLED["health"]), b"{}")
            return
        if self.path == "/metrics":
            body = METRICS.encode()
        else:
            workers = [{"name": n, "state": s} for n, s in STATES.items()]
            body = json.dumps({"workers": workers}).encode()
        self._answer(200, body)

    def _answer(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture
def url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Endpoint)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


def test_metric_is_every_sample_of_the_name_whose_labels_include_those_asked(url: str) -> None:
    assert metric(url, "tandem_requests_total") == [3.0, 2.0]
    assert metric(url, "tandem_requests_total", status="cancelled") == [2.0]
    assert metric(url, "tandem_worker_up", worker="decode-1") == [0.0]
    assert metric(url, "tandem_worker_up", worker="decode-7") == []  # not exported
    assert metric(url, "tandem_retry_budget_tokens") == [0.0]
    assert metric(url, "tandem_requests") == []  # a name is matched whole


def test_wait_all_up_names_the_states_it_saw_when_they_stay_down(url: str) -> None:
    assert worker_states(url) == STATES
    with pytest.raises(TimeoutError, match="'decode-1': 'failed'"):
        wait_all_up(url, timeout_s=0.5)
    STATES["decode-1"] = "up"
    try:
        wait_all_up(url, timeout_s=5.0)
    finally:
        STATES["decode-1"] = "failed"


def test_a_refused_connection_is_an_untyped_error_marked_refused() -> None:
    with socket.socket() as s:  # a loopback port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    o = send_one(f"http://127.0.0.1:{port}", "m", {"prompt": "p", "max_tokens": 1}, 10.0)
    assert (o.status, o.refused, o.http_status, o.error_type) == ("error", True, None, None)


def test_a_request_refused_before_its_first_token_keeps_the_id_the_header_names(url: str) -> None:
    """An error's body has no id; the ingress's X-Tandem-Request-Id ties the failure to its attempts."""
    o = send_one(url, "m", {"prompt": "refuse", "max_tokens": 1}, 10.0)
    assert (o.status, o.http_status, o.error_type) == ("error", 503, "failed")
    assert o.response_id == "cmpl-refused"


def test_each_poller_counts_what_its_path_answered_and_times_the_outage(url: str) -> None:
    """Good answers first; then /health 503 and completions slower than SLOW_COMPLETION_S
    (a router outage the /v1/models poller cannot see); then all good again."""
    poller = Poller(url, "m")
    time.sleep(0.5)
    bad_from = time.time()
    POLLED.update(health=503, completion_s=SLOW_COMPLETION_S + 0.3)
    time.sleep(1.5)
    POLLED.update(health=200, completion_s=0.0)
    bad_to = time.time()
    time.sleep(2.5)  # (a slow completion sent before bad_to ends up to 1.3 s after it)
    polls = poller.stop()
    models, health, completion = (polls[path] for path in Poller.PATHS)
    assert (models.refused, models.server_errors, models.bad()) == (0, 0, 0)
    assert models.answered >= 20 and models.outage_s() == 0.0
    assert health.refused == 0 and 8 <= health.server_errors == health.bad() <= 16
    assert bad_to - bad_from - 0.3 < health.outage_s() < bad_to - bad_from + 0.3
    assert completion.slow == completion.bad() in (1, 2) and completion.server_errors == 0
    assert SLOW_COMPLETION_S < completion.outage_s(bad_from) < 2 * (SLOW_COMPLETION_S + 0.5)
    assert all(completion.good[-5:]) and completion.outage_s(bad_to + 1.6) == 0.0
