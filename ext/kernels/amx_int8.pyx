# cython: language_level=3
"""The AMX int8 matmul kernel (``amx_int8.h``) for :mod:`proxy.quant.amx_int8`, whose op checks every
argument (dtypes, shapes, contiguity) before it passes the tensors' addresses here."""

from libc.stdint cimport int8_t, int64_t, uint16_t, uintptr_t

cdef extern from "amx_int8.h" nogil:
    int sp_amx_available()
    void sp_amx_int8_matmul(const uint16_t *x, int64_t M, int64_t K, const int8_t *codes, const float *scales,
                            const int8_t *sub, int64_t group, int six_bit, int64_t N, float *y,
                            int num_threads)
    void sp_amx_int8_prompt_matmul(const uint16_t *x, int64_t M, int64_t K, const int8_t *codes,
                                   const float *scales, const int8_t *sub, int64_t group, int64_t N, float *y,
                                   int num_threads)


def available() -> bool:
    """Whether this CPU and OS run the kernel (AMX-BF16 and AVX-512 BW, tile data granted)."""
    return sp_amx_available() != 0


def amx_int8_matmul(uintptr_t x, int64_t m, int64_t k, uintptr_t codes, uintptr_t scales, uintptr_t sub,
                    int64_t group, bint six_bit, int64_t n, uintptr_t out, int num_threads) -> None:
    """``out[m, n] = x[m, k] @ W.T`` (bf16 ``x``, fp32 ``out``, the header's weight layouts; ``sub`` 0:
    the scales are not split); the GIL is released. Unchecked: call it through
    ``proxy.quant.amx_int8.amx_int8_mm``."""
    with nogil:
        sp_amx_int8_matmul(<const uint16_t *>x, m, k, <const int8_t *>codes, <const float *>scales,
                           <const int8_t *>sub, group, six_bit, n, <float *>out, num_threads)


def amx_int8_prompt_matmul(uintptr_t x, int64_t m, int64_t k, uintptr_t codes, uintptr_t scales, uintptr_t sub,
                           int64_t group, int64_t n, uintptr_t out, int num_threads) -> None:
    """As :func:`amx_int8_matmul`, through the prompt-row kernel (the header's
    ``sp_amx_int8_prompt_matmul``). Unchecked: call it through
    ``proxy.quant.amx_int8.amx_int8_prompt_mm``."""
    with nogil:
        sp_amx_int8_prompt_matmul(<const uint16_t *>x, m, k, <const int8_t *>codes, <const float *>scales,
                                  <const int8_t *>sub, group, n, <float *>out, num_threads)
