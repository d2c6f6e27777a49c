"""Every native kernel builds wherever one does: a kernel that fails to compile on some CPU
(an intrinsic outside its target attribute) would otherwise fall back to PyTorch silently, and
its tests, which skip without a toolchain, would skip with it."""

from __future__ import annotations

import pytest

from engine import kernels


def test_every_kernel_builds_where_a_toolchain_does() -> None:
    built = kernels.build_all()
    if not any(built.values()):
        pytest.skip("no C++ toolchain (or TANDEM_NATIVE_KERNELS=0): PyTorch paths only")
    assert [name for name, ok in built.items() if not ok] == []
