/* y[M, N] = x[M, K] @ (codes[N, K] * scales[N, K / 32])^T in fp32, for GGUF Q8_0 weights on x86-64 CPUs
 * with AVX2 and FMA (proxy/quant/int8_linear.py says why and what was measured).
 *
 * Per output feature n and row m the sum runs over K in one fixed order: eight fp32 lanes, each
 * accumulating with fused multiply-adds the products x[m, k] * w[n, k] of the k in its lane,
 * group by group, where w[n, k] = codes[n, k] * scales[n, k / 32] (exact in fp32: an 8-bit code
 * times an fp16-valued scale); the lanes are then added pairwise (4+4, 2+2, 1+1). That order does
 * not depend on M, on which rows share a call or on the thread count (threads split N), so a row's
 * result is the same bits in any batch.
 */
#ifndef STREAMPROXY_Q8_MATMUL_H
#define STREAMPROXY_Q8_MATMUL_H

#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define SP_Q8_X86 1
#define SP_AVX2 __attribute__((target("avx2,fma")))
#else
#define SP_Q8_X86 0
#endif

#define SP_Q8_GROUP 32
#define SP_Q8_ROW_TILE 8

/* 1 when this CPU runs the kernel (AVX2 and FMA), else 0. */
static int sp_q8_available(void) {
#if SP_Q8_X86
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
    return 0;
#endif
}

#if SP_Q8_X86
static inline SP_AVX2 float sp_hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

static inline SP_AVX2 __m256 sp_load_q8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* rows [0, MB) of x (row stride K) against one weight row; MB a compile-time constant after inlining */
static inline SP_AVX2 __attribute__((always_inline)) void sp_q8_tile(
    const int MB, const float *x, int64_t K, const int8_t *q, const float *d, int64_t ldy, float *y) {
    __m256 acc[SP_Q8_ROW_TILE];
    for (int r = 0; r < MB; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < K / SP_Q8_GROUP; g++) {
        const __m256 s = _mm256_set1_ps(d[g]);
        const int8_t *qg = q + g * SP_Q8_GROUP;
        const __m256 w0 = _mm256_mul_ps(sp_load_q8(qg), s);
        const __m256 w1 = _mm256_mul_ps(sp_load_q8(qg + 8), s);
        const __m256 w2 = _mm256_mul_ps(sp_load_q8(qg + 16), s);
        const __m256 w3 = _mm256_mul_ps(sp_load_q8(qg + 24), s);
        const float *xg = x + g * SP_Q8_GROUP;
        for (int r = 0; r < MB; r++) {
            const float *xr = xg + r * K;
            __m256 a = acc[r];
            a = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xr), a);
            a = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr + 8), a);
            a = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xr + 16), a);
            a = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xr + 24), a);
            acc[r] = a;
        }
    }
    for (int r = 0; r < MB; r++) y[r * ldy] = sp_hsum8(acc[r]);
}

/* The whole product; K % 32 == 0, all arrays contiguous, x and y fp32, scales fp32 [N, K / 32].
 * Threads (OpenMP, num_threads) take contiguous ranges of N. */
static SP_AVX2 void sp_q8_matmul(const float *x, int64_t M, int64_t K, const int8_t *codes,
                                 const float *scales, int64_t N, float *y, int num_threads) {
    const int64_t G = K / SP_Q8_GROUP;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const int8_t *q = codes + n * K;
        const float *d = scales + n * G;
        int64_t m = 0;
        for (; m + SP_Q8_ROW_TILE <= M; m += SP_Q8_ROW_TILE)
            sp_q8_tile(SP_Q8_ROW_TILE, x + m * K, K, q, d, N, y + m * N + n);
        switch (M - m) {
        case 7: sp_q8_tile(7, x + m * K, K, q, d, N, y + m * N + n); break;
        case 6: sp_q8_tile(6, x + m * K, K, q, d, N, y + m * N + n); break;
        case 5: sp_q8_tile(5, x + m * K, K, q, d, N, y + m * N + n); break;
        case 4: sp_q8_tile(4, x + m * K, K, q, d, N, y + m * N + n); break;
        case 3: sp_q8_tile(3, x + m * K, K, q, d, N, y + m * N + n); break;
        case 2: sp_q8_tile(2, x + m * K, K, q, d, N, y + m * N + n); break;
        case 1: sp_q8_tile(1, x + m * K, K, q, d, N, y + m * N + n); break;
        default: break;
        }
    }
}
#else
static void sp_q8_matmul(const float *x, int64_t M, int64_t K, const int8_t *codes,
                         const float *scales, int64_t N, float *y, int num_threads) {
    (void)x; (void)M; (void)K; (void)codes; (void)scales; (void)N; (void)y; (void)num_threads;
}
#endif

#endif
