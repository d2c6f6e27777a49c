"""The one Ray bootstrap: how ``tandem serve``, ``start_cluster``'s callers, the tests and the
benchmarks start (or join) Ray.

A local Ray listens on loopback only and runs without token auth (both must be in the
environment before ``ray`` is imported: :func:`loopback_env`), with logical CPUs so fractional
actors never wait for a core, and a small object store. Nothing here imports ``ray`` at module
level, so callers can set the environment first.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping

from contracts.roles import NAMESPACE

# Ray reads these when it is imported and when its processes start.
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"}
OBJECT_STORE_BYTES = 256 * 2**20


def loopback_env() -> None:
    """Set the loopback / no-auth environment unless the caller chose otherwise."""
    for name, value in LOOPBACK_ENV.items():
        os.environ.setdefault(name, value)


def init_ray(
    address: str | None = None,
    *,
    num_cpus: int = 8,
    temp_dir: str | None = None,
    env: Mapping[str, str] | None = None,
) -> None:
    """Join the Ray cluster at ``address`` (its own settings apply), or start a local one;
    nothing if Ray is already initialised in this process. ``env``: set only while the local
    Ray's processes start (e.g. ``tandem.serve.direct_ingress_env``), so later subprocesses of
    the caller do not inherit it."""
    loopback_env()
    import ray

    if ray.is_initialized():
        return
    if address:  # its workers' logs stay in its session dir (not this terminal's output)
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False)
        return
    with _environment(env or {}):
        ray.init(
            num_cpus=num_cpus,  # logical CPUs: fractional actors must never wait for a core
            include_dashboard=False,
            log_to_driver=False,
            object_store_memory=OBJECT_STORE_BYTES,
            namespace=NAMESPACE,
            _temp_dir=temp_dir,
        )


@contextlib.contextmanager
def _environment(values: Mapping[str, str]) -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
