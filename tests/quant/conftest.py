"""Fixtures of the quantized-kernel tests."""

from __future__ import annotations

import pytest

from proxy.quant import int8_linear


@pytest.fixture(params=["avx2", "avx512"])
def isa(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    """Each of the kernel's instruction sets this CPU runs, the process's own restored after."""
    if request.param not in int8_linear.supported_isas():
        pytest.skip(f"this CPU does not run the kernel's {request.param} path")
    before = int8_linear.KERNEL_ISA
    int8_linear.set_kernel_isa(request.param)
    yield request.param
    int8_linear.KERNEL_ISA = before
