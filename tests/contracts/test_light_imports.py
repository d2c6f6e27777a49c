"""The router and the ingress stay light: importing them loads no torch (a restarted router
or ingress would otherwise spend most of its restart importing it). Checked in a fresh
interpreter, as a restarted actor imports them."""

from __future__ import annotations

import subprocess
import sys

import pytest

# What the router actor and the Serve ingress import when Ray starts them.
LIGHT = ["router.actor", "tandem.deployment", "api.app", "cluster.coordinator"]


@pytest.mark.parametrize("module", LIGHT)
def test_importing_loads_no_torch(module: str) -> None:
    code = f"import sys, {module}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", f"{module} imports torch"


def test_the_check_sees_torch_where_it_is_imported() -> None:
    """The same check on a worker module says True: it can fail."""
    code = "import sys, cluster.worker; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"


def test_the_bootstrap_imports_no_ray() -> None:
    """Ray reads its loopback setting when it is imported: tandem.bootstrap (which sets it)
    must be importable before ray is (a test run importing ray first listened on eth0)."""
    code = "import sys, tandem.bootstrap; print('ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.e2e
def test_the_test_cluster_listens_on_loopback(ray_session: None) -> None:
    import ray

    assert {node["NodeManagerAddress"] for node in ray.nodes()} == {"127.0.0.1"}
