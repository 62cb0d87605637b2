# cython: language_level=3
"""The AMX int4 matmul kernel (``amx_int4.h``) for :mod:`proxy.quant.amx_int4`, which checks every
argument (dtypes, shapes, contiguity, padding) before it passes the tensors' addresses here."""

from libc.stdint cimport int64_t, uint8_t, uint16_t, uintptr_t

cdef extern from "amx_int4.h" nogil:
    int sp_amx_available()
    void sp_amx_int4_matmul(const uint16_t *x, int64_t M, int64_t K, const uint8_t *codes,
                            const uint16_t *scale, const uint16_t *zero, int64_t N, int64_t group,
                            uint16_t *y, int num_threads)
    void sp_amx_int4_prompt_matmul(const uint16_t *x, int64_t M, int64_t K, const uint8_t *codes,
                                   const uint16_t *scale, const uint16_t *zero, int64_t N, int64_t group,
                                   uint16_t *y, int num_threads)
    int SP_AMX_MAX_GROUP
    int sp_int4_isa()
    void sp_int4_matmul(const uint16_t *x, int64_t M, int64_t K, const uint8_t *codes,
                        const uint16_t *scale, const uint16_t *zero, int64_t N, int64_t group,
                        uint16_t *y, int num_threads)
    void sp_avx2_int4_matmul(const uint16_t *x, int64_t M, int64_t K, const uint8_t *codes,
                             const uint16_t *scale, const uint16_t *zero, int64_t N, int64_t group,
                             uint16_t *y, int num_threads)


def available() -> bool:
    """Whether this CPU and OS run the kernel (AMX-BF16 and AVX-512 BW, tile data granted)."""
    return sp_amx_available() != 0


MAX_GROUP = SP_AMX_MAX_GROUP


def isa() -> int:
    """The variant ``int4_matmul`` runs here: 2 AMX (``amx_int4.h``), 1 AVX2 (``avx2_int4.h``), 0 none."""
    return sp_int4_isa()


def int4_matmul(uintptr_t x, int64_t m, int64_t k, uintptr_t codes, uintptr_t scale, uintptr_t zero,
                int64_t n, int64_t group, uintptr_t out, int num_threads) -> None:
    """As :func:`amx_int4_matmul`, on this CPU's variant (:func:`isa`). Unchecked: call it through
    ``proxy.quant.amx_int4.amx_int4_mm``."""
    with nogil:
        sp_int4_matmul(<const uint16_t *>x, m, k, <const uint8_t *>codes, <const uint16_t *>scale,
                       <const uint16_t *>zero, n, group, <uint16_t *>out, num_threads)


def avx2_int4_matmul(uintptr_t x, int64_t m, int64_t k, uintptr_t codes, uintptr_t scale, uintptr_t zero,
                     int64_t n, int64_t group, uintptr_t out, int num_threads) -> None:
    """As :func:`amx_int4_matmul`, through the AVX2 variant (``avx2_int4.h``) on any CPU with AVX2 and
    FMA (tests compare it on AMX machines too). Unchecked."""
    with nogil:
        sp_avx2_int4_matmul(<const uint16_t *>x, m, k, <const uint8_t *>codes, <const uint16_t *>scale,
                            <const uint16_t *>zero, n, group, <uint16_t *>out, num_threads)


def amx_int4_matmul(uintptr_t x, int64_t m, int64_t k, uintptr_t codes, uintptr_t scale, uintptr_t zero,
                    int64_t n, int64_t group, uintptr_t out, int num_threads) -> None:
    """``out[m, n] = x[m, k] @ W.T`` (bf16 ``x`` and ``out``, the header's weight layout); the GIL is
    released. Unchecked: call it through ``proxy.quant.amx_int4.amx_int4_mm``."""
    with nogil:
        sp_amx_int4_matmul(<const uint16_t *>x, m, k, <const uint8_t *>codes, <const uint16_t *>scale,
                           <const uint16_t *>zero, n, group, <uint16_t *>out, num_threads)


def amx_int4_prompt_matmul(uintptr_t x, int64_t m, int64_t k, uintptr_t codes, uintptr_t scale, uintptr_t zero,
                           int64_t n, int64_t group, uintptr_t out, int num_threads) -> None:
    """As :func:`amx_int4_matmul`, through the prompt-row kernel (the header's
    ``sp_amx_int4_prompt_matmul``). Unchecked: call it through
    ``proxy.quant.amx_int4.amx_int4_prompt_mm``."""
    with nogil:
        sp_amx_int4_prompt_matmul(<const uint16_t *>x, m, k, <const uint8_t *>codes, <const uint16_t *>scale,
                                  <const uint16_t *>zero, n, group, <uint16_t *>out, num_threads)
