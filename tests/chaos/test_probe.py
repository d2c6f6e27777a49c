"""The endpoint probes against a stand-in endpoint on loopback: Prometheus samples by name and
labels, the workers' states, and a refused connection as the load generator records it."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from chaos.load import send_one
from chaos.probe import metric, wait_all_up, worker_states

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


class Endpoint(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path == "/metrics":
            body = METRICS.encode()
        else:
            workers = [{"name": n, "state": s} for n, s in STATES.items()]
            body = json.dumps({"workers": workers}).encode()
        self.send_response(200)
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
