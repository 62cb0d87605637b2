/* y[M, N] = x[M, K] @ W^T for int4 weights W[n, k] = (code[n, k] - 8) * scale[n, g] + zero[n, g]
 * (g = k / group_size), bf16 activations and outputs, on x86-64 CPUs with AVX2 and FMA and without AMX:
 * amx_int4.h's weights (the same tiles, scales and zeros) computed with 8-lane fp32 fused multiply-adds;
 * proxy/quant/amx_int4.py says why and what was measured.
 *
 * Per output feature n, row m and group g (fp32, x widened from bf16 exactly):
 *     P' = x[m, k0] * code[n, k0] for the group's first input k0, then P' = fma(x[m, k], code[n, k], P')
 *           for each next input k of the group, in order, each product computed as
 *           (x[m, k] * 2^-b) * (code[n, k] * 2^b) with b the bit of k's nibble in its word (below; 0 for
 *           bits 0 and 28): the same exact product unless x[m, k] * 2^-b is subnormal (|x| < 2^-102);
 *     P = fma(S[m, g], -8, P'), S[m, g] the group's sum of x[m, k] (8 lanes, each summing its inputs in
 *           order, then the lanes (0..3) + (4..7), then (0, 1) + (2, 3), then 0 + 1);
 *     acc = fma(P, scale[n, g], acc); acc = fma(S[m, g], zero[n, g], acc), group after group from +0;
 *     y = bf16(acc) (round to nearest even).
 * Each product of a bf16 value and a code in 0..15 (times a power of two) is exact in fp32. For a
 * unit-vector input P' = code and P = code - 8 exactly, so this is bf16((code - 8) * scale + zero), the
 * dense copy's weight (as amx_int4.h). The order does not depend on M, on the other rows or on the thread
 * count (threads split the output blocks), so a row's result is the same bits in any batch; it is not
 * amx_int4.h's order (its TDPBF16PS sums a tile in its own way): a process uses one of the two
 * (sp_int4_matmul in amx_int4.h).
 *
 * Decoding: in amx_int4.h's layout the 32-bit word n of a tile's 64-byte chunk q holds feature n's codes
 * of inputs 8q .. 8q + 7, input 8q + 2i + p in the nibble at bit b = 4i + 16p. One AND with 15 << b and a
 * conversion give code * 2^b for 8 features (a shift right by 28 and a conversion for b = 28), with x
 * scaled by 2^-b once a call: two operations a weight vector, no shift (measured against shifting each
 * nibble into place: docs/bench/2026-12-06-avx2-int4.md).
 */
#ifndef STREAMPROXY_AVX2_INT4_H
#define STREAMPROXY_AVX2_INT4_H

#include <stdint.h>
#include <stdlib.h>

#include "q8_matmul.h" /* sp_q8_available (AVX2 and FMA), sp_hsum8 (the lane order above) */

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define SP_I4_AVX2_X86 1
#define SP_I4_AVX2 __attribute__((target("avx2,fma")))
#else
#define SP_I4_AVX2_X86 0
#endif

#if SP_I4_AVX2_X86
/* the most rows of x a run takes (sp_avx2_int4_matmul: x's fp32 copy stays small) */
#define SP_I4_AVX2_CALL_ROWS 256
/* how far ahead (bytes) a call of at most 2 rows prefetches the codes (a thread reads its blocks' tiles
 * in order: one stream) */
#ifndef SP_I4_AVX2_PREFETCH
#define SP_I4_AVX2_PREFETCH 1024
#endif

static inline SP_I4_AVX2 __m256 sp_i4_bf16x8_to_ps(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* 8 fp32 values rounded to nearest even to bf16 (no NaN among them) */
static inline SP_I4_AVX2 __m128i sp_i4_ps_to_bf16x8(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i bias = _mm256_add_epi32(_mm256_set1_epi32(0x7fff), _mm256_and_si256(_mm256_srli_epi32(u, 16),
                                                                                      _mm256_set1_epi32(1)));
    const __m256i h = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(h, h), 0x08));
}

/* code * 2^bit of the nibble at bit `bit` of each 32-bit word of w, as fp32 (bit 28: code, shifted down) */
#define SP_I4_CODES(w, bit) \
    _mm256_cvtepi32_ps((bit) == 28 ? _mm256_srli_epi32((w), 28) : _mm256_and_si256((w), _mm256_set1_epi32(15 << (bit))))

/* Rows [0, R) of x (fp32, rows K apart) times NB consecutive blocks of 16 output features, halves
 * [h0, h0 + NH) of each (8 features each), over all G groups: the header's sums, stored as bf16 into y
 * (rows N apart). R * NB * NH <= 8 (constants once inlined: the sums stay in registers). */
static inline SP_I4_AVX2 __attribute__((always_inline)) void sp_avx2_int4_rows(
    const int R, const int NB, const int NH, const int h0, const float *xf, int64_t K, const float *sums,
    int64_t G, const uint8_t *codes, const uint16_t *sb, const uint16_t *zb, int64_t tpg, uint16_t *y, int64_t N,
    int64_t prefetch) {
    const int64_t T = G * tpg;
    __m256 acc[8], P[8];
    for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        for (int64_t tt = 0; tt < tpg; tt++) {
            const int64_t t = g * tpg + tt;
            const float *xt = xf + t * 32;
            if (prefetch) {
                for (int nb = 0; nb < NB; nb++) {
                    const char *src = (const char *)(codes + (nb * T + t) * 256) + prefetch;
                    _mm_prefetch(src, _MM_HINT_T0); _mm_prefetch(src + 64, _MM_HINT_T0);
                    _mm_prefetch(src + 128, _MM_HINT_T0); _mm_prefetch(src + 192, _MM_HINT_T0);
                }
            }
            for (int q = 0; q < 4; q++) {
                __m256i w[4];
                for (int nb = 0; nb < NB; nb++)
                    for (int h = 0; h < NH; h++)
                        w[nb * NH + h] = _mm256_loadu_si256((const __m256i *)(codes + (nb * T + t) * 256 + 64 * q + 32 * (h0 + h)));
#define SP_I4_INPUT(o)                                                                            \
    do {                                                                                          \
        for (int j = 0; j < NB * NH; j++) {                                                       \
            const __m256 c = SP_I4_CODES(w[j], 4 * ((o) >> 1) + 16 * ((o) & 1));                  \
            for (int r = 0; r < R; r++) {                                                         \
                const __m256 xv = _mm256_broadcast_ss(xt + r * K + 8 * q + (o));                  \
                P[r * NB * NH + j] = (o) == 0 && q == 0 && tt == 0 ? _mm256_mul_ps(xv, c)         \
                                     : _mm256_fmadd_ps(xv, c, P[r * NB * NH + j]);                \
            }                                                                                     \
        }                                                                                         \
    } while (0)
                SP_I4_INPUT(0); SP_I4_INPUT(1); SP_I4_INPUT(2); SP_I4_INPUT(3);
                SP_I4_INPUT(4); SP_I4_INPUT(5); SP_I4_INPUT(6); SP_I4_INPUT(7);
#undef SP_I4_INPUT
            }
        }
        for (int nb = 0; nb < NB; nb++) {
            for (int h = 0; h < NH; h++) {
                const __m256 s = sp_i4_bf16x8_to_ps(sb + (nb * G + g) * 16 + 8 * (h0 + h));
                const __m256 z = sp_i4_bf16x8_to_ps(zb + (nb * G + g) * 16 + 8 * (h0 + h));
                for (int r = 0; r < R; r++) {
                    const int i = r * NB * NH + nb * NH + h;
                    const __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(sums[r * G + g]), _mm256_set1_ps(-8.0f), P[i]);
                    acc[i] = _mm256_fmadd_ps(p, s, acc[i]);
                    acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(sums[r * G + g]), z, acc[i]);
                }
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int nb = 0; nb < NB; nb++)
            for (int h = 0; h < NH; h++)
                _mm_storeu_si128((__m128i *)(y + r * N + nb * 16 + 8 * (h0 + h)),
                                 sp_i4_ps_to_bf16x8(acc[r * NB * NH + nb * NH + h]));
}

/* The whole product (arguments as sp_avx2_int4_matmul): x widened to fp32 and its group sums once a call;
 * then per pair of output blocks: one row takes both blocks' halves at once (4 sums in flight: a sum is
 * one chain of dependent multiply-adds), 2 rows one block's two halves, more rows 8 rows and one half at
 * a time (a half's codes decoded once for 8 rows; measured against 4: docs/bench/2026-12-06-avx2-int4.md). */
static SP_I4_AVX2 void sp_avx2_int4_run(const uint16_t *x, int64_t M, int64_t K, const uint8_t *codes,
                                        const uint16_t *scale, const uint16_t *zero, int64_t N, int64_t group,
                                        uint16_t *y, int num_threads) {
    const int64_t G = K / group, T = K / 32, tpg = group / 32, blocks = N / 16;
    float *xf = (float *)aligned_alloc(64, sizeof(float) * (size_t)(M * K) + 64);
    float *sums = (float *)malloc(sizeof(float) * (size_t)(M * G));
    if (!xf || !sums) {
        free(xf);
        free(sums);
        return;
    }
    const int64_t prefetch = M <= 2 ? SP_I4_AVX2_PREFETCH : 0;
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < M * G; i++) {
            const uint16_t *xp = x + (i / G) * K + (i % G) * group;
            float *xo = xf + (i / G) * K + (i % G) * group;
            __m256 s = _mm256_setzero_ps();
            const __m256 down = _mm256_setr_ps(1.0f, 0x1p-16f, 0x1p-4f, 0x1p-20f, 0x1p-8f, 0x1p-24f, 0x1p-12f, 1.0f);
            for (int64_t j = 0; j < group; j += 8) {
                const __m256 v = sp_i4_bf16x8_to_ps(xp + j);
                _mm256_storeu_ps(xo + j, _mm256_mul_ps(v, down));
                s = _mm256_add_ps(s, v);
            }
            sums[i] = sp_hsum8(s);
        }
#pragma omp for schedule(static)
        for (int64_t bp = 0; bp < (blocks + 1) / 2; bp++) { /* pairs of blocks */
            const int64_t b = 2 * bp;
            const int two = b + 1 < blocks;
            const uint8_t *cb = codes + b * T * 256;
            const uint16_t *sb = scale + b * G * 16, *zb = zero + b * G * 16;
            uint16_t *yb = y + b * 16;
            if (M == 1 && two) {
                sp_avx2_int4_rows(1, 2, 2, 0, xf, K, sums, G, cb, sb, zb, tpg, yb, N, prefetch);
            } else if (M <= 2) {
                for (int j = 0; j <= two; j++) {
                    if (M == 1)
                        sp_avx2_int4_rows(1, 1, 2, 0, xf, K, sums, G, cb + j * T * 256, sb + j * G * 16, zb + j * G * 16, tpg, yb + j * 16, N, prefetch);
                    else
                        sp_avx2_int4_rows(2, 1, 2, 0, xf, K, sums, G, cb + j * T * 256, sb + j * G * 16, zb + j * G * 16, tpg, yb + j * 16, N, prefetch);
                }
            } else {
                for (int j = 0; j <= two; j++) {
                    for (int64_t m0 = 0; m0 < M; m0 += 8) {
                        const float *xm = xf + m0 * K;
                        const float *sm = sums + m0 * G;
                        uint16_t *ym = yb + j * 16 + m0 * N;
                        const uint8_t *cj = cb + j * T * 256;
                        const uint16_t *sj = sb + j * G * 16, *zj = zb + j * G * 16;
                        for (int h = 0; h < 2; h++) {
                            switch (M - m0 < 8 ? M - m0 : 8) {
                            case 1: sp_avx2_int4_rows(1, 1, 1, h, xm, K, sm, G, cj, sj, zj, tpg, ym, N, 0); break;
                            case 2: sp_avx2_int4_rows(2, 1, 1, h, xm, K, sm, G, cj, sj, zj, tpg, ym, N, 0); break;
                            case 3: sp_avx2_int4_rows(3, 1, 1, h, xm, K, sm, G, cj, sj, zj, tpg, ym, N, 0); break;
                            case 4: sp_avx2_int4_rows(4, 1, 1, h, xm, K, sm, G, cj, sj, zj, tpg, ym, N, 0); break;
                            case 5: sp_avx2_int4_rows(5, 1, 1, h, xm, K, sm, G, cj, sj, zj, tpg, ym, N, 0); break;
                            case 6: sp_avx2_int4_rows(6, 1, 1, h, xm, K, sm, G, cj, sj, zj, tpg, ym, N, 0); break;
                            case 7: sp_avx2_int4_rows(7, 1, 1, h, xm, K, sm, G, cj, sj, zj, tpg, ym, N, 0); break;
                            default: sp_avx2_int4_rows(8, 1, 1, h, xm, K, sm, G, cj, sj, zj, tpg, ym, N, 0); break;
                            }
                        }
                    }
                }
            }
        }
    }
    free(xf);
    free(sums);
}
#endif

/* y[M, N] (bf16) = x[M, K] (bf16) @ W^T in amx_int4.h's weight layout; K % group == 0, group % 32 == 0,
 * N % 16 == 0, all arrays contiguous. Threads (OpenMP, num_threads) take contiguous ranges of the N / 16
 * output blocks. Computes nothing where sp_q8_available() is 0 (or x's fp32 copy cannot be
 * allocated). */
static void sp_avx2_int4_matmul(const uint16_t *x, int64_t M, int64_t K, const uint8_t *codes,
                                const uint16_t *scale, const uint16_t *zero, int64_t N, int64_t group,
                                uint16_t *y, int num_threads) {
#if SP_I4_AVX2_X86
    if (!sp_q8_available() || M <= 0) return;
    /* at most SP_I4_AVX2_CALL_ROWS rows a run: x's fp32 copy stays small for a long prompt's call (rows
     * are independent: the same bits) */
    for (int64_t m0 = 0; m0 < M; m0 += SP_I4_AVX2_CALL_ROWS)
        sp_avx2_int4_run(x + m0 * K, M - m0 < SP_I4_AVX2_CALL_ROWS ? M - m0 : SP_I4_AVX2_CALL_ROWS, K, codes, scale,
                         zero, N, group, y + m0 * N, num_threads);
#else
    (void)x; (void)M; (void)K; (void)codes; (void)scale; (void)zero; (void)N; (void)group; (void)y; (void)num_threads;
#endif
}

#endif
