/* y[M, N] (fp32) = x[M, K] (bf16) @ W^T for int8 weights W[n, k] = codes[n, k] * scale[n, k / group],
 * group 32 (GGUF Q8_0, IQ4_NL, IQ4_XS, Q5_0) or 16 (Q6_K, its scales optionally split as Q6_K stores
 * them: scale = block[n, k / 256] * sub[n, k / 16]), on x86-64 CPUs with AMX-BF16 (the checks of
 * amx_int4.h); proxy/quant/amx_int8.py says why and what was measured.
 *
 * The weights are the A tiles (16 output features x 32 inputs), the activations the B tiles (the
 * tile's inputs in VNNI pairs x columns of x's rows), so the codes are read as the layer holds them,
 * row-major int8 [N, K] (shared with a tied embedding). Per block of 16 features the codes of a chunk
 * of SP_A8_KCHUNK inputs are widened, exactly, to bf16 (every int8 is a bf16), then for each 32-input
 * tile TDPBF16PS multiplies them into a zeroed fp32 C tile: with group 32, P[n, m] = sum over the tile
 * of code[n, k] * x[m, k]; with group 16 the B tile holds each row twice, column 2 m + h with the other
 * half's inputs zero, so P[n, 2 m + h] is the sum over group h of the tile (each product exact, the
 * zero ones +-0; AMX's own summation order). Then, tile after tile,
 *     acc[n, c] = fma(P[n, c], scale[n, group of column c], acc[n, c])
 * (the split scale formed as block * sub in fp32, exact where the caller checked it equals the scale),
 * and y[m, n] = acc[n, m] (group 16: acc[n, 2 m] + acc[n, 2 m + 1], the even groups' sum plus the odd
 * groups'). For an input that is one unit vector this is code * scale, the weight, exactly. Every row
 * of every call takes the same columns' arrangement, and AMX computes each C element alone from one A
 * row and one B column, so a row's result does not depend on the other rows of the call, on M or on
 * the thread count (threads split the output blocks): the same bits in any batch.
 *
 * Layouts: codes int8 [N, K]; scales fp32 [N / 16][K / group][16] (each block's 16 features side by
 * side), or split: block fp32 [N / 16][K / 256][16] and sub int8 [N / 16][K / 16][16].
 */
#ifndef STREAMPROXY_AMX_INT8_H
#define STREAMPROXY_AMX_INT8_H

#include "amx_int4.h"

#ifndef SP_A8_KCHUNK
#define SP_A8_KCHUNK 256 /* inputs decoded a chunk (16 features x 256 bf16 = 8 KiB of A tiles) */
#endif
#define SP_A8_SPLIT 256  /* inputs a block scale of split group-16 scales covers */
/* how far ahead (bytes) of a chunk each feature row's codes are prefetched */
#ifndef SP_A8_PREFETCH
#define SP_A8_PREFETCH 512
#endif

#if SP_AMX_X86
/* tmm0 / tmm3: A (16 features x 32 inputs bf16), tmm1 / tmm4: B (16 input pairs x cols), tmm2 / tmm5: C */
static inline SP_AMX void sp_a8_configure(int cols) {
    sp_tile_config cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.palette_id = 1;
    for (int set = 0; set < 6; set += 3) {
        cfg.rows[set] = 16; cfg.colsb[set] = 64;
        cfg.rows[set + 1] = 16; cfg.colsb[set + 1] = (uint16_t)(4 * cols);
        cfg.rows[set + 2] = 16; cfg.colsb[set + 2] = (uint16_t)(4 * cols);
    }
    _tile_loadconfig(&cfg);
}

/* 32 int8 codes as 32 bf16 (exact): widened to fp32, whose low 16 bits are zero for |code| <= 256,
 * then the high halves gathered */
static inline SP_AMX __m512i sp_a8_decode32(const int8_t *p, __m512i odd) {
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 16))));
    return _mm512_permutex2var_epi16(_mm512_castps_si512(lo), odd, _mm512_castps_si512(hi));
}

/* the same for codes in [-32, 31] (Q6_K's), by a 64-entry table indexed by the code's low 6 bits */
static inline SP_AMX __m512i sp_a8_decode32_6(const int8_t *p, __m512i lut_lo, __m512i lut_hi) {
    const __m512i c = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_permutex2var_epi16(lut_lo, c, lut_hi);
}

/* one 32-input tile's product: A at a (64-byte rows), B at b (cols * 4-byte rows), into C stored at
 * cdst */
#define SP_A8_TILE(A, B, C, a, b, cols, cdst, cstride) \
    do {                                               \
        _tile_zero(C);                                 \
        _tile_loadd(A, (a), 64);                       \
        _tile_loadd(B, (b), 4 * (cols));               \
        _tile_dpbf16ps(C, A, B);                       \
        _tile_stored(C, (cdst), (cstride));            \
    } while (0)

/* The whole product (arguments as sp_amx_int8_matmul; xp: x in B-tile order, [chunks][K / 32][16][cols]:
 * group 32: column m of a chunk of 16 rows holds row m's input pairs; group 16: columns 2 m + h of a
 * chunk of 8 rows hold row m's pairs of the tile's half h (inputs 16 h .. 16 h + 15), the other half's
 * pairs zero, so that one tile product gives both groups' sums, P[n, 2 m + h]). */
static SP_AMX void sp_a8_run(const uint32_t *xp, int64_t M, int64_t K, const int8_t *codes,
                             const float *scales, const int8_t *sub, int64_t group, int six_bit, int64_t N,
                             float *y, int num_threads) {
    const int paired = group == 16, per = paired ? 8 : 16;
    const int rows = M < per ? (int)M : per, cols = paired ? 2 * rows : rows;
    const int64_t mchunks = (M + per - 1) / per, blocks = N / 16, T = K / 32;
    const int single = M == 1;                 /* C's 16 features (x 2 halves) as one or two vectors */
    const int64_t cstride = single ? 4 * cols : 64;
    uint16_t lut_v[64], odd_v[32];
    for (int i = 0; i < 64; i++) {
        float v = (float)(i < 32 ? i : i - 64);
        uint32_t u;
        memcpy(&u, &v, 4);
        lut_v[i] = (uint16_t)(u >> 16);
    }
    for (int i = 0; i < 32; i++) odd_v[i] = (uint16_t)(2 * i + 1);
    const __m512i lut_lo = _mm512_loadu_si512((const void *)lut_v);
    const __m512i lut_hi = _mm512_loadu_si512((const void *)(lut_v + 32));
    const __m512i odd = _mm512_loadu_si512((const void *)odd_v);
    int32_t ilo_v[16], ihi_v[16];
    for (int i = 0; i < 16; i++) {
        ilo_v[i] = i / 2 + 16 * (i % 2);
        ihi_v[i] = 8 + i / 2 + 16 * (i % 2);
    }
    const __m512i ilo = _mm512_loadu_si512((const void *)ilo_v), ihi = _mm512_loadu_si512((const void *)ihi_v);
#pragma omp parallel num_threads(num_threads)
    {
        const int64_t ctiles = SP_A8_KCHUNK / 32;
        uint16_t *abuf = (uint16_t *)aligned_alloc(64, 1024 * (size_t)ctiles);
        float *cbuf = (float *)aligned_alloc(64, 1024 * (size_t)ctiles);
        float *svec = (float *)aligned_alloc(64, 128 * (size_t)ctiles);
        float *acc = (float *)aligned_alloc(64, 1024 * (size_t)mchunks);
        if (abuf && cbuf && svec && acc) {
            sp_a8_configure(cols);
#pragma omp for schedule(static)
            for (int64_t b = 0; b < blocks; b++) {
                memset(acc, 0, 1024 * (size_t)mchunks);
                for (int64_t t0 = 0; t0 < T; t0 += ctiles) {
                    const int64_t nt = t0 + ctiles < T ? ctiles : T - t0;
                    for (int n = 0; n < 16; n++) {
                        const int8_t *row = codes + (b * 16 + n) * K + 32 * t0;
                        /* past the row's end: the same feature row of the next block (this thread's
                         * next, with static scheduling) */
                        for (int64_t l = 0, k = 32 * t0 + SP_A8_PREFETCH; l < 32 * ctiles; l += 64) {
                            const int64_t at = k + l < K ? (b * 16 + n) * K + k + l : ((b + 1) * 16 + n) * K + k + l - K;
                            if (at < N * K) _mm_prefetch((const char *)(codes + at), _MM_HINT_T0);
                        }
                        for (int64_t t = 0; t < nt; t++) {
                            const __m512i v = six_bit ? sp_a8_decode32_6(row + 32 * t, lut_lo, lut_hi)
                                                      : sp_a8_decode32(row + 32 * t, odd);
                            _mm512_store_si512((__m512i *)(abuf + 512 * t + 32 * n), v);
                        }
                    }
                    /* the groups' scales of each tile, 16 features side by side; group 16: the tile's
                     * two groups interleaved per feature ([n][h], as C's columns 2 m + h) */
                    for (int64_t t = 0; t < nt; t++) {
                        if (!paired) {
                            _mm512_store_ps(svec + 32 * t, _mm512_loadu_ps(scales + (b * T + t0 + t) * 16));
                            continue;
                        }
                        __m512 s[2];
                        for (int h = 0; h < 2; h++) {
                            const int64_t j = 2 * (t0 + t) + h; /* the group of 16 */
                            if (sub) {
                                const __m512 d = _mm512_loadu_ps(scales + (b * (K / SP_A8_SPLIT) + j / 16) * 16);
                                const __m128i q = _mm_loadu_si128((const __m128i *)(sub + (b * (K / 16) + j) * 16));
                                s[h] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)));
                            } else {
                                s[h] = _mm512_loadu_ps(scales + (b * (K / 16) + j) * 16);
                            }
                        }
                        _mm512_store_ps(svec + 32 * t, _mm512_permutex2var_ps(s[0], ilo, s[1]));
                        _mm512_store_ps(svec + 32 * t + 16, _mm512_permutex2var_ps(s[0], ihi, s[1]));
                    }
                    for (int64_t mc = 0; mc < mchunks; mc++) {
                        const uint32_t *xm = xp + (mc * T + t0) * 16 * cols;
                        int64_t t = 0;
                        for (; t + 1 < nt; t += 2) {
                            SP_A8_TILE(0, 1, 2, abuf + 512 * t, xm + t * 16 * cols, cols, cbuf + 256 * t, cstride);
                            SP_A8_TILE(3, 4, 5, abuf + 512 * (t + 1), xm + (t + 1) * 16 * cols, cols,
                                       cbuf + 256 * (t + 1), cstride);
                        }
                        if (t < nt) SP_A8_TILE(0, 1, 2, abuf + 512 * t, xm + t * 16 * cols, cols, cbuf + 256 * t, cstride);
                        float *am = acc + 256 * mc;
                        if (single) {
                            __m512 v0 = _mm512_load_ps(am), v1 = _mm512_load_ps(am + 16);
                            for (t = 0; t < nt; t++) {
                                const float *c = cbuf + 256 * t, *sv = svec + 32 * t;
                                v0 = _mm512_fmadd_ps(_mm512_load_ps(c), _mm512_load_ps(sv), v0);
                                if (paired) v1 = _mm512_fmadd_ps(_mm512_load_ps(c + 16), _mm512_load_ps(sv + 16), v1);
                            }
                            _mm512_store_ps(am, v0);
                            _mm512_store_ps(am + 16, v1);
                        } else {
                            __m512 v[16];
                            for (int n = 0; n < 16; n++) v[n] = _mm512_load_ps(am + 16 * n);
                            for (t = 0; t < nt; t++) {
                                const float *c = cbuf + 256 * t, *sv = svec + 32 * t;
                                if (paired) {
                                    for (int n = 0; n < 16; n++) {
                                        const __m512 sn = _mm512_castpd_ps(_mm512_set1_pd(((const double *)sv)[n]));
                                        v[n] = _mm512_fmadd_ps(_mm512_load_ps(c + 16 * n), sn, v[n]);
                                    }
                                } else {
                                    for (int n = 0; n < 16; n++)
                                        v[n] = _mm512_fmadd_ps(_mm512_load_ps(c + 16 * n), _mm512_set1_ps(sv[n]), v[n]);
                                }
                            }
                            for (int n = 0; n < 16; n++) _mm512_store_ps(am + 16 * n, v[n]);
                        }
                    }
                }
                /* y[m, n]: one lane, or the sum of the two groups' lanes (h = 0, then 1) */
                if (single) {
                    for (int n = 0; n < 16; n++) y[b * 16 + n] = paired ? acc[2 * n] + acc[2 * n + 1] : acc[n];
                } else {
                    for (int64_t m = 0; m < M; m++) {
                        const float *am = acc + 256 * (m / per);
                        const int64_t l = m % per;
                        for (int n = 0; n < 16; n++)
                            y[m * N + b * 16 + n] = paired ? am[16 * n + 2 * l] + am[16 * n + 2 * l + 1] : am[16 * n + l];
                    }
                }
            }
            _tile_release();
        }
        free(abuf);
        free(cbuf);
        free(svec);
        free(acc);
    }
}
#endif

/* x[M, K] (bf16) copied in the B-tile order of sp_a8_run for ``group`` (chunks of 16 rows, or of 8
 * rows with each row's tile halves in two columns for group 16; zero rows past M), or NULL where it
 * cannot be allocated; the caller frees it */
static uint32_t *sp_a8_pack_x(const uint16_t *x, int64_t M, int64_t K, int64_t group) {
    const int64_t per = group == 16 ? 8 : 16, rows = M < per ? M : per, cols = group == 16 ? 2 * rows : rows;
    const int64_t mchunks = (M + per - 1) / per, pairs = K / 2;
    uint32_t *xp = (uint32_t *)aligned_alloc(64, (size_t)(4 * mchunks * pairs * cols + 64));
    if (!xp) return NULL;
    const uint32_t *x32 = (const uint32_t *)x;
    for (int64_t mc = 0; mc < mchunks; mc++)
        for (int64_t p = 0; p < pairs; p++)
            for (int64_t j = 0; j < cols; j++) {
                const int64_t m = mc * per + (group == 16 ? j / 2 : j);
                const int keep = m < M && (group == 32 || (p % 16) / 8 == j % 2);
                xp[(mc * pairs + p) * cols + j] = keep ? x32[m * pairs + p] : 0;
            }
    return xp;
}

/* y[M, N] (fp32) = x[M, K] (bf16) @ W^T in the layouts above; K % 32 == 0, N % 16 == 0, group 16 or 32
 * (split scales: group 16 and K % 256 == 0); six_bit: every code is in [-32, 31] (a faster widening,
 * the same values). Threads (OpenMP, num_threads) take contiguous ranges of the N / 16 output blocks.
 * x is read from a copy in B-tile order (sp_a8_run; one row of group 32 as it is), rows padded with zero
 * rows to whole chunks (their outputs not stored). Computes
 * nothing where sp_amx_available() is 0, the arguments do not fit, or the copy cannot be allocated. */
static void sp_amx_int8_matmul(const uint16_t *x, int64_t M, int64_t K, const int8_t *codes, const float *scales,
                               const int8_t *sub, int64_t group, int six_bit, int64_t N, float *y,
                               int num_threads) {
#if SP_AMX_X86
    if (!sp_amx_available() || M <= 0 || K % 32 || N % 16 || (group != 16 && group != 32) ||
        (sub && (group != 16 || K % SP_A8_SPLIT)))
        return;
    if (M == 1 && group == 32) { /* x's pairs are already the B tiles' one column */
        sp_a8_run((const uint32_t *)x, M, K, codes, scales, sub, group, six_bit, N, y, num_threads);
        return;
    }
    uint32_t *xp = sp_a8_pack_x(x, M, K, group);
    if (!xp) return;
    sp_a8_run(xp, M, K, codes, scales, sub, group, six_bit, N, y, num_threads);
    free(xp);
#else
    (void)x; (void)M; (void)K; (void)codes; (void)scales; (void)sub; (void)group; (void)six_bit; (void)N; (void)y;
    (void)num_threads;
#endif
}

#if SP_AMX_X86
/* tmm0 / tmm1: A (two output blocks' 16 features x 32 inputs), tmm2 / tmm3: B (two chunks of x's
 * rows, 16 input pairs x cols), tmm4-7: C (2 x 2) */
static inline SP_AMX void sp_a8_configure_2x2(int cols) {
    sp_tile_config cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = (uint16_t)(t < 2 ? 64 : 4 * cols);
    }
    _tile_loadconfig(&cfg);
}

/* one block's A tiles for the whole K (T tiles of 16 features x 32 inputs, 1 KiB each, at at):
 * w = bf16(code * scale) rounded to nearest even, the scale of the input's group (split: block * sub,
 * in fp32) */
static inline SP_AMX void sp_a8_decode_block_scaled(const int8_t *codes, int64_t K, const float *scales,
                                                    const int8_t *sub, int64_t group, int64_t T,
                                                    uint16_t *at) {
    for (int64_t t = 0; t < T; t++) {
        for (int n = 0; n < 16; n++) {
            const int8_t *p = codes + n * K + 32 * t;
            float s[2];
            for (int h = 0; h < 2; h++) {
                const int64_t j = group == 16 ? 2 * t + h : t; /* the input's group */
                s[h] = sub ? scales[(j * 16 / SP_A8_SPLIT) * 16 + n] * (float)sub[j * 16 + n]
                           : scales[j * 16 + n];
            }
            const __m512 lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p))),
                                            _mm512_set1_ps(s[0]));
            const __m512 hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 16)))),
                                            _mm512_set1_ps(group == 16 ? s[1] : s[0]));
            uint16_t *row = at + 512 * t + 32 * n;
            _mm256_store_si256((__m256i *)row, sp_ps_to_bf16x16(lo));
            _mm256_store_si256((__m256i *)(row + 16), sp_ps_to_bf16x16(hi));
        }
    }
}

/* The prompt-row product (sp_amx_int8_prompt_matmul; xp: x in the group-32 B-tile order of sp_a8_run,
 * chunks of 16 rows): per pair of output blocks, their A tiles decoded once for the whole K
 * (sp_a8_decode_block_scaled), then each pair of row chunks multiplied over the whole K into four C
 * tiles (fp32, K in order), y[m, n] = C[n, m]. */
static SP_AMX void sp_a8_prompt_run(const uint32_t *xp, int64_t M, int64_t K, const int8_t *codes,
                                    const float *scales, const int8_t *sub, int64_t group, int64_t N,
                                    float *y, int num_threads) {
    const int rows = M < 16 ? (int)M : 16, cols = rows;
    const int64_t mchunks = (M + 15) / 16, blocks = N / 16, pairs = (blocks + 1) / 2, T = K / 32;
    const int64_t sblock = group == 16 ? (sub ? K / SP_A8_SPLIT : K / 16) : K / 32; /* scale columns */
#pragma omp parallel num_threads(num_threads)
    {
        uint16_t *abuf = (uint16_t *)aligned_alloc(64, 2 * 1024 * (size_t)T);
        float *cbuf = (float *)aligned_alloc(64, 1024);
        if (abuf && cbuf) {
            sp_a8_configure_2x2(cols);
#pragma omp for schedule(static)
            for (int64_t p = 0; p < pairs; p++) {
                const int64_t b = 2 * p;
                const int both = b + 1 < blocks;
                for (int64_t j = 0; j < 1 + both; j++)
                    sp_a8_decode_block_scaled(codes + (b + j) * 16 * K, K, scales + (b + j) * sblock * 16,
                                              sub ? sub + (b + j) * (K / 16) * 16 : NULL, group, T,
                                              abuf + j * 512 * T);
                for (int64_t mc = 0; mc < mchunks; mc += 2) {
                    const int two = mc + 1 < mchunks;
                    const uint32_t *x0 = xp + mc * T * 16 * cols, *x1 = xp + (mc + 1) * T * 16 * cols;
                    _tile_zero(4); _tile_zero(5); _tile_zero(6); _tile_zero(7);
                    for (int64_t t = 0; t < T; t++) {
                        _tile_loadd(2, x0 + t * 16 * cols, 4 * cols);
                        _tile_loadd(0, abuf + 512 * t, 64);
                        _tile_dpbf16ps(4, 0, 2);
                        if (both) {
                            _tile_loadd(1, abuf + 512 * (T + t), 64);
                            _tile_dpbf16ps(5, 1, 2);
                        }
                        if (two) {
                            _tile_loadd(3, x1 + t * 16 * cols, 4 * cols);
                            _tile_dpbf16ps(6, 0, 3);
                            if (both) _tile_dpbf16ps(7, 1, 3);
                        }
                    }
                    for (int c = 0; c < 4; c++) {
                        const int64_t bb = b + (c & 1), m0 = (mc + (c >> 1)) * 16;
                        if ((c & 1) && !both) continue;
                        if ((c >> 1) && !two) continue;
                        switch (c) {
                        case 0: _tile_stored(4, cbuf, 64); break;
                        case 1: _tile_stored(5, cbuf, 64); break;
                        case 2: _tile_stored(6, cbuf, 64); break;
                        default: _tile_stored(7, cbuf, 64); break;
                        }
                        const int64_t mend = M - m0 < 16 ? M - m0 : 16;
                        for (int64_t m = 0; m < mend; m++)
                            for (int n = 0; n < 16; n++) y[(m0 + m) * N + bb * 16 + n] = cbuf[16 * n + m];
                    }
                }
            }
            _tile_release();
        }
        free(abuf);
        free(cbuf);
    }
}
#endif

/* y[M, N] (fp32) = x[M, K] (bf16) @ W^T for a step's prompt rows: the arguments of sp_amx_int8_matmul;
 * W as bf16(code * scale) (sp_a8_decode_block_scaled), summed over the whole K in fp32 tile registers:
 * not the bits of sp_amx_int8_matmul, but a row's bits do not depend on the other rows, the row count
 * or the thread count either. x is read from a copy in B-tile order (chunks of 16 rows, zero rows past
 * M). Computes nothing where sp_amx_available() is 0, the arguments do not fit, or the copy cannot be
 * allocated. */
static void sp_amx_int8_prompt_matmul(const uint16_t *x, int64_t M, int64_t K, const int8_t *codes,
                                      const float *scales, const int8_t *sub, int64_t group, int64_t N, float *y,
                                      int num_threads) {
#if SP_AMX_X86
    if (!sp_amx_available() || M <= 0 || K % 32 || N % 16 || (group != 16 && group != 32) ||
        (sub && (group != 16 || K % SP_A8_SPLIT)))
        return;
    uint32_t *xp = sp_a8_pack_x(x, M, K, 32); /* the group-32 order: a column a row */
    if (!xp) return;
    sp_a8_prompt_run(xp, M, K, codes, scales, sub, group, N, y, num_threads);
    free(xp);
#else
    (void)x; (void)M; (void)K; (void)codes; (void)scales; (void)sub; (void)group; (void)N; (void)y; (void)num_threads;
#endif
}

#endif
