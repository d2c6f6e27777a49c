"""The allocator settings that keep transfer buffers resident (kv_transfer/memory.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

# A transfer's pattern: a layer's worth of 1 MiB buffers is live at once, then all are freed
# (gathered layers, messages); repeated 20 times. Prints the minor page faults that took, with
# or without the settings applied first.
PROBE = """
import resource, sys
from kv_transfer.memory import keep_transfer_buffers_resident
if sys.argv[1] == "on":
    assert keep_transfer_buffers_resident()
def transfer():
    live = [b"x" * (1 << 20) for _ in range(12)]  # written, so every page is touched
    del live
transfer()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    transfer()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults(mode: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True
    )
    return int(out.stdout)


@pytest.mark.e2e  # starts a gRPC server
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc allocator settings")
def test_freed_transfer_buffers_are_reused_without_page_faults() -> None:
    pages_per_transfer = (12 << 20) // 4096
    assert faults("off") >= 10 * pages_per_transfer  # glibc default: faulted in anew each time
    assert faults("on") < pages_per_transfer // 10  # reused: no fault after the first time
