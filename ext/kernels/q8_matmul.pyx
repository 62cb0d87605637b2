# cython: language_level=3
"""The Q8_0 matmul kernel (``q8_matmul.h``) for :mod:`proxy.quant.int8_linear`, which checks every
argument (dtypes, shapes, contiguity) before it passes the tensors' addresses here."""

from libc.stdint cimport int8_t, int64_t, uintptr_t

cdef extern from "q8_matmul.h" nogil:
    int sp_q8_available()
    void sp_q8_matmul(const float *x, int64_t M, int64_t K, const int8_t *codes,
                      const float *scales, int64_t N, float *y, int num_threads)

GROUP_SIZE = 32


def available() -> bool:
    """Whether this CPU runs the kernel (AVX2 and FMA on x86-64)."""
    return sp_q8_available() != 0


def q8_matmul(uintptr_t x, int64_t m, int64_t k, uintptr_t codes, uintptr_t scales, int64_t n,
              uintptr_t out, int num_threads) -> None:
    """``out[m, n] = x[m, k] @ (codes[n, k] * scales[n, k / 32]).T``, addresses of contiguous fp32
    ``x`` / ``scales`` / ``out`` and int8 ``codes``; the GIL is released. Unchecked: call it through
    ``proxy.quant.int8_linear.q8_matmul``."""
    with nogil:
        sp_q8_matmul(<const float *>x, m, k, <const int8_t *>codes, <const float *>scales, n,
                     <float *>out, num_threads)
