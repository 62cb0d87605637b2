# cython: language_level=3
"""The Q8_0 matmul kernel (``q8_matmul.h``) for :mod:`proxy.quant.int8_linear`, which checks every
argument (dtypes, shapes, contiguity) before it passes the tensors' addresses here."""

from libc.stdint cimport int8_t, int64_t, uintptr_t

cdef extern from "q8_matmul.h" nogil:
    int sp_q8_available()
    int sp_q8_best_isa()
    void sp_q8_matmul(const float *x, int64_t M, int64_t K, const int8_t *codes,
                      const float *scales, const float *zeros, int64_t group, int64_t N, float *y,
                      int num_threads, int isa)
    void sp_q8_matmul_split(const float *x, int64_t M, int64_t K, const int8_t *codes, const int8_t *sub,
                            const float *block, int64_t N, float *y, int num_threads, int isa)
    int SP_Q8_AVX2
    int SP_Q8_AVX512

GROUP_SIZE = 32
#: the kernel's instruction sets by name (``isa`` of :func:`q8_matmul`)
ISAS = {"avx2": SP_Q8_AVX2, "avx512": SP_Q8_AVX512}


def available() -> bool:
    """Whether this CPU runs the kernel (AVX2 and FMA on x86-64)."""
    return sp_q8_available() != 0


def supported_isas() -> list:
    """The names in :data:`ISAS` this CPU runs, best last (empty where :func:`available` is False)."""
    best = sp_q8_best_isa()
    return [name for name, isa in ISAS.items() if 0 < isa <= best]


def q8_matmul(uintptr_t x, int64_t m, int64_t k, uintptr_t codes, uintptr_t scales, uintptr_t zeros,
              int64_t group, int64_t n, uintptr_t out, int num_threads, int isa) -> None:
    """``out[m, n] = x[m, k] @ (codes[n, k] * scales[n, k / group] + zeros[n, k / group]).T``
    (``group`` 32 or 16; ``zeros`` 0: none), addresses of contiguous fp32 ``x`` / ``scales`` /
    ``zeros`` / ``out`` and int8 ``codes``, with instruction
    set ``isa`` (a value of :data:`ISAS` in :func:`supported_isas`); the GIL is released.
    Unchecked: call it through
    ``proxy.quant.int8_linear.q8_matmul``."""
    with nogil:
        sp_q8_matmul(<const float *>x, m, k, <const int8_t *>codes, <const float *>scales,
                     <const float *>zeros, group, n, <float *>out, num_threads, isa)


def q8_matmul_split(uintptr_t x, int64_t m, int64_t k, uintptr_t codes, uintptr_t sub, uintptr_t block,
                    int64_t n, uintptr_t out, int num_threads, int isa) -> None:
    """``out[m, n] = x[m, k] @ (codes[n, k] * block[n, k / 256] * sub[n, k / 16]).T`` (the header's
    ``sp_q8_matmul_split``): addresses of contiguous fp32 ``x`` / ``block`` / ``out`` and int8 ``codes``
    / ``sub``; the GIL is released. Unchecked: call it through
    ``proxy.quant.split_scales.q8_matmul_split``."""
    with nogil:
        sp_q8_matmul_split(<const float *>x, m, k, <const int8_t *>codes, <const int8_t *>sub,
                           <const float *>block, n, <float *>out, num_threads, isa)
