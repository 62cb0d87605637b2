/* y[M, N] = x[M, K] @ (codes[N, K] * scales[N, K / group] + zeros[N, K / group])^T in fp32, group 32
 * (GGUF Q8_0, Q5_0, IQ4_NL, IQ4_XS; with zeros Q5_1, Q5_K) or 16 (Q6_K), zeros optional, on x86-64 CPUs
 * with AVX2 and FMA, or AVX-512 F (proxy/quant/int8_linear.py says why and what was measured).
 *
 * Per output feature n and row m the sum runs over K in one fixed order: L fp32 lanes (8 with AVX2,
 * 16 with AVX-512), each accumulating with fused multiply-adds the products x[m, k] * w[n, k] of the
 * k in its lane, 32 inputs at a time, where w[n, k] = fma(codes[n, k], scales[n, k / group], zero) with
 * zero = zeros[n, k / group] or +0 (the product is exact in fp32: the code's and the scale's significant
 * bits add up to at most 24 for every GGUF type served, e.g. Q8_0 8 + 11, IQ4_XS 7 + 17, Q6_K 6 + 18, so
 * w is the exact sum rounded once, as gguf computes it); the lanes are then added pairwise (AVX2:
 * 4+4, 2+2, 1+1; AVX-512: _mm512_reduce_add_ps). That order does not depend on M, on which rows share
 * a call or on the thread count (threads split N), so a row's result is the same bits in any batch. The two
 * instruction sets sum in other orders: a process uses one (sp_q8_best_isa, unless told otherwise).
 */
#ifndef STREAMPROXY_Q8_MATMUL_H
#define STREAMPROXY_Q8_MATMUL_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define SP_Q8_X86 1
#define SP_AVX2 __attribute__((target("avx2,fma")))
#define SP_AVX512 __attribute__((target("avx512f")))
#else
#define SP_Q8_X86 0
#endif

#define SP_Q8_GROUP 32 /* inputs a step of the loop covers: one group of 32, or two of 16 */
#define SP_Q8_ROW_TILE 8
/* rows of x an AVX-512 pass over a weight row takes (at most 16); 8 measured faster than 16 at 16
 * rows (docs/bench/2026-12-06-1.7b-step-profile.md) */
#ifndef SP_Q8_ROW_TILE_512
#define SP_Q8_ROW_TILE_512 8
#endif
#define SP_Q8_SPLIT 256 /* inputs a block scale of split group-16 scales covers (Q6_K's super-block) */
/* how far ahead (bytes) the codes are prefetched in calls of at most SP_Q8_FEW_ROWS rows (0: not at
 * all); a thread reads its weight rows in order, so the codes are one stream. Measured: one row,
 * 1 thread, 1.7B's int8 layers 59.8 -> 44.9 ms (docs/bench/2026-12-06-1.7b-step-profile.md). The AVX2
 * one-row loops over 4 weight rows (sp_q8_row_x4, sp_q8_row_x4_split) prefetch 4 rows on instead
 * (SP_Q8_ROW_STEP): for them the value only turns prefetching on or off. */
#ifndef SP_Q8_PREFETCH
#define SP_Q8_PREFETCH 1024
#endif
#define SP_Q8_FEW_ROWS 4
/* AVX-512 calls of more rows run over blocks of SP_Q8_NB weight rows and chunks of SP_Q8_KCHUNK
 * inputs, so that the chunk of x (16 rows x 256 x 4 bytes = 16 KiB) stays in L1 for the block's
 * rows instead of streaming from L2 once a weight row */
#define SP_Q8_NB 8
#define SP_Q8_KCHUNK 256
/* the shortest K that takes the blocked loop (with K = 2048, 16 rows of x fit in L2 and the blocked
 * loop measured slower; with K = 8192 it measured 12-25% faster at 8 and 16 rows) */
#define SP_Q8_BLOCKED_K 4096

/* instruction sets of the kernel */
#define SP_Q8_NONE 0
#define SP_Q8_AVX2 1
#define SP_Q8_AVX512 2

/* 1 when this CPU runs the kernel (AVX2 and FMA), else 0. */
static int sp_q8_available(void) {
#if SP_Q8_X86
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
    return 0;
#endif
}

/* the best instruction set this CPU runs the kernel with: SP_Q8_AVX512, SP_Q8_AVX2 or SP_Q8_NONE */
static inline int sp_q8_best_isa(void) {
#if SP_Q8_X86
    if (!sp_q8_available()) return SP_Q8_NONE;
    return __builtin_cpu_supports("avx512f") ? SP_Q8_AVX512 : SP_Q8_AVX2;
#else
    return SP_Q8_NONE;
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

/* Split group-16 scales (sp_q8_matmul_split): the scale of inputs [16 j, 16 j + 16) of a weight row is
 * block[j / 16] * sub[j], one block scale per SP_Q8_SPLIT inputs. At the first 32-input step of a block
 * the block's 16 scales are computed into split, 8 at a time (the fp32 product is exact where the
 * caller checked it equals the scale it stands for; a scalar loop here was most of a one-row call's
 * time in cache: docs/bench/2026-12-07-q8-one-row.md); returns the two scales of step g. */
static inline __attribute__((always_inline, target("avx2"))) const float *sp_q8_split_scales(
    const int8_t *sub, const float *block, int64_t g, float *split) {
    const int64_t per = SP_Q8_SPLIT / SP_Q8_GROUP; /* 32-input steps a block */
    if (g % per == 0) {
        const __m128i sv = _mm_loadu_si128((const __m128i *)(sub + g * 2));
        const __m256 b = _mm256_set1_ps(block[g / per]);
        _mm256_storeu_ps(split, _mm256_mul_ps(b, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sv))));
        _mm256_storeu_ps(split + 8, _mm256_mul_ps(b, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sv, 8)))));
    }
    return split + (g % per) * 2;
}

/* rows [0, MB) of x (row stride K) against one weight row; MB a compile-time constant after inlining;
 * gs: scales per 32 inputs (1: group 32; 2: group 16, the first scale for inputs 0-15, the second 16-31) */
static inline SP_AVX2 __attribute__((always_inline)) void sp_q8_tile(
    const int MB, const float *x, int64_t K, const int8_t *q, const float *d, const float *z, const int gs,
    const int8_t *sub, int64_t ldy, float *y) {
    __m256 acc[SP_Q8_ROW_TILE];
    float split[SP_Q8_SPLIT / 16];
    for (int r = 0; r < MB; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < K / SP_Q8_GROUP; g++) {
        const float *dg = d + g * gs;
        if (sub) {
            dg = sp_q8_split_scales(sub, d, g, split);
        }
        const __m256 s = _mm256_set1_ps(dg[0]);
        const __m256 s1 = _mm256_set1_ps(dg[gs - 1]);
        const __m256 z0 = z ? _mm256_set1_ps(z[g * gs]) : _mm256_setzero_ps();
        const __m256 z1 = z ? _mm256_set1_ps(z[g * gs + gs - 1]) : _mm256_setzero_ps();
        const int8_t *qg = q + g * SP_Q8_GROUP;
        if (SP_Q8_PREFETCH && MB <= SP_Q8_FEW_ROWS && !(g & 1))
            _mm_prefetch((const char *)qg + SP_Q8_PREFETCH, _MM_HINT_T0);
        const __m256 w0 = _mm256_fmadd_ps(sp_load_q8(qg), s, z0);
        const __m256 w1 = _mm256_fmadd_ps(sp_load_q8(qg + 8), s, z0);
        const __m256 w2 = _mm256_fmadd_ps(sp_load_q8(qg + 16), s1, z1);
        const __m256 w3 = _mm256_fmadd_ps(sp_load_q8(qg + 24), s1, z1);
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

/* One 32-input step of one weight row in sp_q8_row_x4 / sp_q8_row_x4_split: sp_q8_tile's operations for
 * one row of x (x0..x3 its 32 inputs, s / s1 the step's two scales, v the row's accumulator). Prefetches
 * the codes at the same place 4 weight rows on (the next call's rows): a thread reads 4 rows at once,
 * 4 streams that the hardware prefetchers follow too late (measured:
 * docs/bench/2026-12-07-q8-one-row.md); on even steps only (`even`), 64 bytes apart. */
#define SP_Q8_ROW_STEP(qg, s, s1, v, prefetch_at, even)                                                      \
    do {                                                                                                     \
        if (SP_Q8_PREFETCH && (even)) _mm_prefetch((const char *)(prefetch_at), _MM_HINT_T0);                 \
        (v) = _mm256_fmadd_ps(_mm256_fmadd_ps(sp_load_q8(qg), (s), zf), x0, (v));                            \
        (v) = _mm256_fmadd_ps(_mm256_fmadd_ps(sp_load_q8((qg) + 8), (s), zf), x1, (v));                      \
        (v) = _mm256_fmadd_ps(_mm256_fmadd_ps(sp_load_q8((qg) + 16), (s1), zf), x2, (v));                    \
        (v) = _mm256_fmadd_ps(_mm256_fmadd_ps(sp_load_q8((qg) + 24), (s1), zf), x3, (v));                    \
    } while (0)

/* sp_q8_tile for one row of x and 4 consecutive weight rows (row j at q + j * K, its scales at
 * d + j * G, outputs y[j]; no zeros, no split scales): the same operations in the same order per
 * weight row, so the same bits. A weight row's sum is one chain of dependent multiply-adds (4 a group:
 * 16 cycles of latency for 32 weights); 4 chains in flight keep the FMA units busy. */
static inline SP_AVX2 void sp_q8_row_x4(const float *x, int64_t K, const int8_t *q, int64_t G, const float *d,
                                        const int gs, float *y) {
    const __m256 zf = _mm256_setzero_ps(); /* sp_q8_tile's zero without zeros: fma(code, s, +0) */
    __m256 a0 = zf, a1 = zf, a2 = zf, a3 = zf;
    for (int64_t g = 0; g < K / SP_Q8_GROUP; g++) {
        const float *xg = x + g * SP_Q8_GROUP;
        const __m256 x0 = _mm256_loadu_ps(xg), x1 = _mm256_loadu_ps(xg + 8);
        const __m256 x2 = _mm256_loadu_ps(xg + 16), x3 = _mm256_loadu_ps(xg + 24);
        const int8_t *qg = q + g * SP_Q8_GROUP;
        const float *dg = d + g * gs;
#define SP_Q8_ROW(j, v)                                                                                     \
    SP_Q8_ROW_STEP(qg + (j) * K, _mm256_set1_ps(dg[(j) * G]), _mm256_set1_ps(dg[(j) * G + gs - 1]), v,       \
                   qg + (4 + (j)) * K, !(g & 1))
        SP_Q8_ROW(0, a0); SP_Q8_ROW(1, a1); SP_Q8_ROW(2, a2); SP_Q8_ROW(3, a3);
#undef SP_Q8_ROW
    }
    y[0] = sp_hsum8(a0); y[1] = sp_hsum8(a1); y[2] = sp_hsum8(a2); y[3] = sp_hsum8(a3);
}

/* sp_q8_row_x4 with split group-16 scales (Q6_K; block scales at blk + j * (K / SP_Q8_SPLIT), sub-scales
 * at sub + j * (K / 16) for weight row j; K % SP_Q8_SPLIT == 0, as sp_q8_matmul_split checks): each
 * block's 16 scales of the 4 rows (sp_q8_split_scales), then its 8 steps (one scale check a block, not
 * one a row and step: measured 4-5% faster than sp_q8_row_x4 taking split scales). */
static inline SP_AVX2 void sp_q8_row_x4_split(const float *x, int64_t K, const int8_t *q, const float *blk,
                                              const int8_t *sub, float *y) {
    const __m256 zf = _mm256_setzero_ps();
    __m256 a0 = zf, a1 = zf, a2 = zf, a3 = zf;
    float split[4][SP_Q8_SPLIT / 16];
    const int64_t B = K / SP_Q8_SPLIT;
    for (int64_t b = 0; b < B; b++) {
        for (int j = 0; j < 4; j++)
            sp_q8_split_scales(sub + j * (K / 16), blk + j * B, b * (SP_Q8_SPLIT / SP_Q8_GROUP), split[j]);
        for (int i = 0; i < SP_Q8_SPLIT / SP_Q8_GROUP; i++) {
            const int64_t g = b * (SP_Q8_SPLIT / SP_Q8_GROUP) + i;
            const float *xg = x + g * SP_Q8_GROUP;
            const __m256 x0 = _mm256_loadu_ps(xg), x1 = _mm256_loadu_ps(xg + 8);
            const __m256 x2 = _mm256_loadu_ps(xg + 16), x3 = _mm256_loadu_ps(xg + 24);
            const int8_t *qg = q + g * SP_Q8_GROUP;
#define SP_Q8_ROW(j, v)                                                                                 \
    SP_Q8_ROW_STEP(qg + (j) * K, _mm256_broadcast_ss(&split[j][2 * i]),                                   \
                   _mm256_broadcast_ss(&split[j][2 * i + 1]),                                               \
                   v, qg + (4 + (j)) * K, !(i & 1))
            SP_Q8_ROW(0, a0); SP_Q8_ROW(1, a1); SP_Q8_ROW(2, a2); SP_Q8_ROW(3, a3);
#undef SP_Q8_ROW
        }
    }
    y[0] = sp_hsum8(a0); y[1] = sp_hsum8(a1); y[2] = sp_hsum8(a2); y[3] = sp_hsum8(a3);
}
#undef SP_Q8_ROW_STEP

/* The whole product with AVX2 (arguments as sp_q8_matmul). */
static SP_AVX2 void sp_q8_matmul_avx2(const float *x, int64_t M, int64_t K, const int8_t *codes,
                                      const float *scales, const float *zeros, const int gs,
                                      const int8_t *subs, int64_t N, float *y, int num_threads) {
    const int64_t G = subs ? K / SP_Q8_SPLIT : K / SP_Q8_GROUP * gs;
    if (M == 1 && !zeros) { /* 4 weight rows at a time (sp_q8_row_x4[_split]), the last N % 4 alone */
#pragma omp parallel for num_threads(num_threads) schedule(static)
        for (int64_t c = 0; c < (N + 3) / 4; c++) {
            const int64_t n = 4 * c;
            if (n + 4 <= N && subs) {
                sp_q8_row_x4_split(x, K, codes + n * K, scales + n * G, subs + n * (K / 16), y + n);
                continue;
            }
            if (n + 4 <= N) {
                sp_q8_row_x4(x, K, codes + n * K, G, scales + n * G, gs, y + n);
                continue;
            }
            for (int64_t j = n; j < N; j++)
                sp_q8_tile(1, x, K, codes + j * K, scales + j * G, 0, gs, subs ? subs + j * (K / 16) : 0, N, y + j);
        }
        return;
    }
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const int8_t *q = codes + n * K;
        const float *d = scales + n * G;
        const float *z = zeros ? zeros + n * G : 0;
        const int8_t *sub = subs ? subs + n * (K / 16) : 0;
        int64_t m = 0;
        for (; m + SP_Q8_ROW_TILE <= M; m += SP_Q8_ROW_TILE)
            sp_q8_tile(SP_Q8_ROW_TILE, x + m * K, K, q, d, z, gs, sub, N, y + m * N + n);
        switch (M - m) {
        case 7: sp_q8_tile(7, x + m * K, K, q, d, z, gs, sub, N, y + m * N + n); break;
        case 6: sp_q8_tile(6, x + m * K, K, q, d, z, gs, sub, N, y + m * N + n); break;
        case 5: sp_q8_tile(5, x + m * K, K, q, d, z, gs, sub, N, y + m * N + n); break;
        case 4: sp_q8_tile(4, x + m * K, K, q, d, z, gs, sub, N, y + m * N + n); break;
        case 3: sp_q8_tile(3, x + m * K, K, q, d, z, gs, sub, N, y + m * N + n); break;
        case 2: sp_q8_tile(2, x + m * K, K, q, d, z, gs, sub, N, y + m * N + n); break;
        case 1: sp_q8_tile(1, x + m * K, K, q, d, z, gs, sub, N, y + m * N + n); break;
        default: break;
        }
    }
}

static inline SP_AVX512 __m512 sp_load_q8_512(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

/* as sp_q8_tile, 16 lanes; MB <= 16 (calls take tiles of SP_Q8_ROW_TILE_512 rows) */
static inline SP_AVX512 __attribute__((always_inline)) void sp_q8_tile512(
    const int MB, const float *x, int64_t K, int64_t ldx, const int8_t *q, const float *d, const float *z,
    const int gs, const int8_t *sub, int64_t ldy, float *y) {
    __m512 acc[16];
    float split[SP_Q8_SPLIT / 16];
    for (int r = 0; r < MB; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < K / SP_Q8_GROUP; g++) {
        const int8_t *qg = q + g * SP_Q8_GROUP;
        if (SP_Q8_PREFETCH && MB <= SP_Q8_FEW_ROWS && !(g & 1))
            _mm_prefetch((const char *)qg + SP_Q8_PREFETCH, _MM_HINT_T0);
        const float *dg = d + g * gs;
        if (sub) {
            dg = sp_q8_split_scales(sub, d, g, split);
        }
        const __m512 z0 = z ? _mm512_set1_ps(z[g * gs]) : _mm512_setzero_ps();
        const __m512 z1 = z ? _mm512_set1_ps(z[g * gs + gs - 1]) : _mm512_setzero_ps();
        const __m512 w0 = _mm512_fmadd_ps(sp_load_q8_512(qg), _mm512_set1_ps(dg[0]), z0);
        const __m512 w1 = _mm512_fmadd_ps(sp_load_q8_512(qg + 16), _mm512_set1_ps(dg[gs - 1]), z1);
        const float *xg = x + g * SP_Q8_GROUP;
        for (int r = 0; r < MB; r++) {
            const float *xr = xg + r * ldx;
            __m512 a = acc[r];
            a = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xr), a);
            a = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xr + 16), a);
            acc[r] = a;
        }
    }
    for (int r = 0; r < MB; r++) y[r * ldy] = _mm512_reduce_add_ps(acc[r]);
}

#define SP_Q8_T512(MB) sp_q8_tile512((MB), x + m * ldx, K, ldx, q, d, z, gs, sub, N, y + m * N + n)

/* sp_q8_tile512's loop over the 32-input steps [g0, g1) only, the rows' accumulators taken from and
 * left in acc (the same operations in the same order per accumulator as one pass over K) */
static inline SP_AVX512 __attribute__((always_inline)) void sp_q8_chunk512(
    const int MB, const float *x, int64_t ldx, int64_t g0, int64_t g1, const int8_t *q, const float *d,
    const float *z, const int gs, const int8_t *sub, __m512 *acc_mem) {
    __m512 acc[16];
    float split[SP_Q8_SPLIT / 16];
    for (int r = 0; r < MB; r++) acc[r] = acc_mem[r];
    for (int64_t g = g0; g < g1; g++) {
        const int8_t *qg = q + g * SP_Q8_GROUP;
        const float *dg = d + g * gs;
        if (sub) {
            dg = sp_q8_split_scales(sub, d, g, split);
        }
        const __m512 z0 = z ? _mm512_set1_ps(z[g * gs]) : _mm512_setzero_ps();
        const __m512 z1 = z ? _mm512_set1_ps(z[g * gs + gs - 1]) : _mm512_setzero_ps();
        const __m512 w0 = _mm512_fmadd_ps(sp_load_q8_512(qg), _mm512_set1_ps(dg[0]), z0);
        const __m512 w1 = _mm512_fmadd_ps(sp_load_q8_512(qg + 16), _mm512_set1_ps(dg[gs - 1]), z1);
        const float *xg = x + g * SP_Q8_GROUP;
        for (int r = 0; r < MB; r++) {
            const float *xr = xg + r * ldx;
            __m512 a = acc[r];
            a = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xr), a);
            a = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xr + 16), a);
            acc[r] = a;
        }
    }
    for (int r = 0; r < MB; r++) acc_mem[r] = acc[r];
}

/* the AVX-512 product of more than SP_Q8_FEW_ROWS rows (arguments as sp_q8_matmul_avx512): per block
 * of SP_Q8_NB weight rows and tile of up to 16 rows of x, chunk by chunk of K, each weight row of the
 * block in turn; the sums are sp_q8_tile512's, bit for bit (each accumulator sees its products in
 * the same order) */
static SP_AVX512 void sp_q8_matmul_avx512_blocked(const float *x, int64_t M, int64_t K, int64_t ldx,
                                                  const int8_t *codes,
                                                  const float *scales, const float *zeros, const int gs,
                                                  const int8_t *subs, int64_t N, float *y, int num_threads) {
    const int64_t G = subs ? K / SP_Q8_SPLIT : K / SP_Q8_GROUP * gs;
    const int64_t blocks = (N + SP_Q8_NB - 1) / SP_Q8_NB, steps = K / SP_Q8_GROUP;
    const int64_t chunk = SP_Q8_KCHUNK / SP_Q8_GROUP;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t n0 = b * SP_Q8_NB, n1 = n0 + SP_Q8_NB < N ? n0 + SP_Q8_NB : N;
        __m512 acc[SP_Q8_NB][16];
        for (int64_t m = 0; m < M; m += SP_Q8_ROW_TILE_512) {
            const int mb = M - m < SP_Q8_ROW_TILE_512 ? (int)(M - m) : SP_Q8_ROW_TILE_512;
            const float *xm = x + m * ldx;
            for (int64_t i = 0; i < n1 - n0; i++)
                for (int r = 0; r < mb; r++) acc[i][r] = _mm512_setzero_ps();
            for (int64_t g0 = 0; g0 < steps; g0 += chunk) {
                const int64_t g1 = g0 + chunk < steps ? g0 + chunk : steps;
                for (int64_t n = n0; n < n1; n++) {
                    const int8_t *q = codes + n * K;
                    const float *d = scales + n * G;
                    const float *z = zeros ? zeros + n * G : 0;
                    const int8_t *sub = subs ? subs + n * (K / 16) : 0;
                    __m512 *am = acc[n - n0];
                    switch (mb) {
#define SP_Q8_C512(MB) case MB: sp_q8_chunk512(MB, xm, ldx, g0, g1, q, d, z, gs, sub, am); break
                    SP_Q8_C512(16); SP_Q8_C512(15); SP_Q8_C512(14); SP_Q8_C512(13); SP_Q8_C512(12);
                    SP_Q8_C512(11); SP_Q8_C512(10); SP_Q8_C512(9); SP_Q8_C512(8); SP_Q8_C512(7);
                    SP_Q8_C512(6); SP_Q8_C512(5); SP_Q8_C512(4); SP_Q8_C512(3); SP_Q8_C512(2);
                    SP_Q8_C512(1);
#undef SP_Q8_C512
                    default: break;
                    }
                }
            }
            for (int64_t n = n0; n < n1; n++)
                for (int r = 0; r < mb; r++) y[(m + r) * N + n] = _mm512_reduce_add_ps(acc[n - n0][r]);
        }
    }
}

/* The whole product with AVX-512 F (arguments as sp_q8_matmul). */
static SP_AVX512 void sp_q8_matmul_avx512(const float *x, int64_t M, int64_t K, const int8_t *codes,
                                          const float *scales, const float *zeros, const int gs,
                                          const int8_t *subs, int64_t N, float *y, int num_threads) {
    /* rows of x 4 KiB apart fall in the same L1 sets: 16 rows' lines of one step exceed its 12 ways
     * (measured: 16 rows cost 4x 8 rows at K = 2048); such x is read from a copy with rows 64 bytes
     * further apart */
    int64_t ldx = K;
    float *padded = 0;
    if (M > 1 && (K * 4) % 4096 == 0) {
        padded = (float *)malloc(sizeof(float) * (size_t)(M * (K + 16)));
        if (padded) {
            ldx = K + 16;
            for (int64_t r = 0; r < M; r++) memcpy(padded + r * ldx, x + r * K, sizeof(float) * (size_t)K);
            x = padded;
        }
    }
    if (M > SP_Q8_FEW_ROWS && K >= SP_Q8_BLOCKED_K) {
        sp_q8_matmul_avx512_blocked(x, M, K, ldx, codes, scales, zeros, gs, subs, N, y, num_threads);
        free(padded);
        return;
    }
    const int64_t G = subs ? K / SP_Q8_SPLIT : K / SP_Q8_GROUP * gs;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const int8_t *q = codes + n * K;
        const float *d = scales + n * G;
        const float *z = zeros ? zeros + n * G : 0;
        const int8_t *sub = subs ? subs + n * (K / 16) : 0;
        int64_t m = 0;
        for (; m + SP_Q8_ROW_TILE_512 <= M; m += SP_Q8_ROW_TILE_512) SP_Q8_T512(SP_Q8_ROW_TILE_512);
        switch (M - m) {
        case 15: SP_Q8_T512(15); break;
        case 14: SP_Q8_T512(14); break;
        case 13: SP_Q8_T512(13); break;
        case 12: SP_Q8_T512(12); break;
        case 11: SP_Q8_T512(11); break;
        case 10: SP_Q8_T512(10); break;
        case 9: SP_Q8_T512(9); break;
        case 8: SP_Q8_T512(8); break;
        case 7: SP_Q8_T512(7); break;
        case 6: SP_Q8_T512(6); break;
        case 5: SP_Q8_T512(5); break;
        case 4: SP_Q8_T512(4); break;
        case 3: SP_Q8_T512(3); break;
        case 2: SP_Q8_T512(2); break;
        case 1: SP_Q8_T512(1); break;
        default: break;
        }
    }
    free(padded);
}
#endif

/* The whole product; K % 32 == 0, all arrays contiguous, x and y fp32, scales fp32 [N, K / group] with
 * group 32 or 16 (anything else computes nothing), zeros fp32 as scales or NULL (none); isa:
 * SP_Q8_AVX2 or SP_Q8_AVX512, one this CPU runs (sp_q8_best_isa; anything else computes nothing).
 * Threads (OpenMP, num_threads) take contiguous ranges of N. Group 16 sums in the same order as
 * group 32 (only the scale a product uses differs). */
static inline void sp_q8_matmul(const float *x, int64_t M, int64_t K, const int8_t *codes,
                                const float *scales, const float *zeros, int64_t group, int64_t N, float *y,
                                int num_threads, int isa) {
#if SP_Q8_X86
    if (group != 16 && group != SP_Q8_GROUP) return;
    const int gs = (int)(SP_Q8_GROUP / group);
    if (isa == SP_Q8_AVX512) sp_q8_matmul_avx512(x, M, K, codes, scales, zeros, gs, 0, N, y, num_threads);
    else if (isa == SP_Q8_AVX2) sp_q8_matmul_avx2(x, M, K, codes, scales, zeros, gs, 0, N, y, num_threads);
#else
    (void)x; (void)M; (void)K; (void)codes; (void)scales; (void)zeros; (void)group; (void)N; (void)y;
    (void)num_threads; (void)isa;
#endif
}

/* sp_q8_matmul with group 16, no zeros, and the scales split: scale[n, j] = block[n, j / 16] * sub[n, j]
 * with sub int8 [N, K / 16] and block fp32 [N, K / SP_Q8_SPLIT] (K % SP_Q8_SPLIT == 0, else nothing is
 * computed). Where every such product is exact in fp32 and equals the scale it stands for (Q6_K's
 * d * scale; the caller checks), the result is sp_q8_matmul's with those scales bit for bit, from 1.07
 * bytes a weight read instead of 1.25. */
static inline void sp_q8_matmul_split(const float *x, int64_t M, int64_t K, const int8_t *codes,
                                      const int8_t *sub, const float *block, int64_t N, float *y, int num_threads,
                                      int isa) {
#if SP_Q8_X86
    if (K % SP_Q8_SPLIT) return;
    if (isa == SP_Q8_AVX512) sp_q8_matmul_avx512(x, M, K, codes, block, 0, 2, sub, N, y, num_threads);
    else if (isa == SP_Q8_AVX2) sp_q8_matmul_avx2(x, M, K, codes, block, 0, 2, sub, N, y, num_threads);
#else
    (void)x; (void)M; (void)K; (void)codes; (void)sub; (void)block; (void)N; (void)y; (void)num_threads;
    (void)isa;
#endif
}

#endif
