"""``tandem serve``: start (or join) Ray, deploy the Serve application, serve until Ctrl-C."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from tandem.bootstrap import init_ray, loopback_env
from tandem.topology import load_topology

HTTP_READY_TIMEOUT_S = 600.0


def direct_ingress_env(port: int) -> dict[str, str]:
    """The environment that makes a Ray started with it answer HTTP on ``port`` from the
    ingress replica itself (Ray Serve's direct ingress) instead of through Serve's proxy actor.

    Behind the proxy every request and every streamed chunk takes one more process hop (replica
    -> proxy), and the replica hands its ASGI messages to an unbounded queue, so a slow reader's
    chunks pile up in the proxy. Served by the replica, the ASGI ``send`` is uvicorn's own,
    which waits while the socket's write buffer is full: backpressure reaches the request, and
    the hop is gone (measured: docs/benchmarks.md). Ray reads these when its
    processes start, so they must be in the environment before ``ray.init``. Serve still starts
    its proxy, on whatever port ``serve.start`` gives it.
    """
    return {
        "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
        # The range the replica's port is taken from: exactly ``port``.
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(port),
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(port + 1),
        # The ASGI app runs on the replica's event loop, so ``send`` is uvicorn's.
        "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
        # No external load balancer to deregister from: stopping need not wait 30 s.
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0",
        # Nor a proxy that may still route to a released port (Serve holds a released port
        # out of use for 150 s for its HAProxy): the next replica takes ``port`` at once.
        "RAY_SERVE_PORT_QUARANTINE_S": "0",
    }


# Where a port is picked for the HTTP endpoint (``port`` 0): below Linux's ephemeral range
# (32768-60999), from which Ray's own components (GCS, raylet, runtime-env and dashboard agents)
# take theirs when they start -- a port picked there before Ray starts can be taken by Ray
# before the ingress binds it (seen in CI: the runtime-env agent on the ingress's port) -- and
# above Ray's worker ports (10002-19999).
PICK_PORTS = range(20000, 32768)


def free_port(host: str, port: int = 0) -> int:
    """``port`` if it is free to listen on at ``host`` (0: a free one from PICK_PORTS); else a
    ValueError naming the address, before anything starts. Checked as the server binds it
    (``SO_REUSEADDR``): connections of a server stopped a moment ago, in TIME_WAIT, do not make
    the port busy; a live listener does."""
    if port == 0:
        for candidate in random.sample(PICK_PORTS, 64):
            with contextlib.suppress(ValueError):
                return free_port(host, candidate)
        raise ValueError(f"no free port to listen on at {host} in {PICK_PORTS}")
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise ValueError(f"cannot listen on {host}:{port}: {e.strerror}") from e
        return int(s.getsockname()[1])


def wait_port_free(host: str, port: int, timeout_s: float) -> None:
    """Until ``port`` is free to listen on (:func:`free_port`'s test: a server stopped a moment
    ago may still be listening); TimeoutError after ``timeout_s``."""
    until = time.time() + timeout_s
    while True:
        try:
            free_port(host, port)
            return
        except ValueError as e:
            if time.time() > until:
                raise TimeoutError(f"{e} after {timeout_s:.0f} s") from e
        time.sleep(0.1)


def deploy(
    topology: Path,
    model: Path | None,
    host: str,
    port: int,
    address: str | None,
    engine: dict[str, Any] | None = None,
) -> str:
    """Deploy the application; returns the base URL. A Ray this starts serves HTTP from the
    ingress replica (:func:`direct_ingress_env`) when there is one replica; a cluster joined
    at ``address``, a Ray already running in this process, or several replicas are served by
    Serve's proxy on ``port``."""
    import ray
    from ray import serve

    from tandem.deployment import app_builder

    proxy_port = port
    replicas = load_topology(topology).serve.num_replicas
    if address:
        init_ray(address)  # the cluster's own Serve settings apply
    elif not ray.is_initialized() and replicas > 1:  # one port for many replicas: the proxy's
        init_ray()
    elif not ray.is_initialized():
        os.environ.update(direct_ingress_env(port))
        init_ray()
        proxy_port = free_port(host)  # ``port`` is the replica's
    serve.start(http_options={"host": host, "port": proxy_port})
    args = {
        "topology": str(topology),
        "model": str(model) if model else None,
        "engine": engine,
    }
    serve.run(app_builder(args), name="tandem", route_prefix="/", blocking=False)
    return f"http://{host}:{port}"


def wait_until_ready(
    url: str, timeout_s: float = HTTP_READY_TIMEOUT_S, stop: threading.Event | None = None
) -> bool:
    """Until ``/health`` answers 200 (the cluster's workers have loaded and reported): True;
    False if ``stop`` was set first."""
    import urllib.error
    import urllib.request

    deadline = time.time() + timeout_s
    stop = stop or threading.Event()
    while not stop.is_set():  # set while deploying: no "serving" line, straight to shutdown
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as reply:
                if reply.status == 200:
                    return True
        except (urllib.error.URLError, OSError):
            pass
        if time.time() > deadline:
            raise TimeoutError(f"{url}/health did not answer 200 within {timeout_s:.0f} s")
        stop.wait(0.5)  # a poll interval, cut short by ``stop``
    return False


def serve_forever(
    topology: Path,
    model: Path | None,
    host: str,
    port: int,
    address: str | None,
    engine: dict[str, Any] | None = None,
) -> int:
    """Serve until Ctrl-C; ``engine``: settings over every pool's engine settings."""
    loopback_env()
    import ray
    from ray import serve

    from tandem.launch import model_dir_of, stop_cluster

    started = time.time()
    spec = load_topology(topology)  # fails fast on a bad file, before Ray starts
    port = free_port(host, port)  # and on a port in use; --port 0 picks one
    spec = spec.with_model_path(model) if model else spec
    spec = spec.with_engine(engine) if engine else spec  # a bad setting fails here, early
    if not address:
        # A built-in model or a GGUF file's checkpoint is built here, once per machine, before
        # Ray starts: its progress shows, and a missing download or an unsupported file is one
        # line (on a cluster, the ingress's node builds it).
        model_dir_of(spec)
    name = spec.model.name
    # From here on Ctrl-C (or SIGTERM) means: finish starting what was started, then shut down.
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print(f"tandem: starting {topology} (model: {model or 'from the topology'})", file=sys.stderr)
    try:
        url = deploy(topology, model, host, port, address, engine)
        if wait_until_ready(url, stop=stop):
            print(f"tandem: serving the OpenAI API at {url}/v1 ({time.time() - started:.1f} s)")
            body = f'{{"model": "{name}", "prompt": "Once upon a time", "max_tokens": 16}}'
            print(f"  curl {url}/v1/completions -H 'Content-Type: application/json' -d '{body}'")
            print("  Ctrl-C stops it.", flush=True)
            stop.wait()
    finally:
        print("tandem: shutting down", file=sys.stderr)
        serve.shutdown()
        if ray.is_initialized():  # the cluster outlives its ingress: remove it too
            stop_cluster(spec)
        ray.shutdown()
    return 0
