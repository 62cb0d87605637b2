/* y[M, N] = x[M, K] @ W^T for int4 weights W[n, k] = (code[n, k] - 8) * scale[n, g] + zero[n, g]
 * (g = k / group_size), bf16 activations, on x86-64 CPUs with AMX-BF16 (Intel Sapphire Rapids and
 * later); proxy/quant/amx_int4.py says why and what was measured.
 *
 * Per output block of 16 features and group g the kernel decodes the codes, as bf16 values code - 8
 * (exact), into one AMX B tile per 32 inputs, multiplies them with TDPBF16PS into a zeroed fp32 C
 * tile (P[m, n] = sum over the group of x[m, k] * (code[n, k] - 8)), and accumulates in fp32
 *     acc[m, n] = fma(P[m, n], scale[n, g], acc[m, n]);  acc[m, n] = fma(S[m, g], zero[n, g], acc[m, n])
 * with S[m, g] the group's sum of x[m, k] (fixed order: 16 lanes, then _mm512_reduce_add_ps), group
 * after group; y = bf16(acc) (round to nearest even). For an input that is one unit vector this is
 * bf16((code - 8) * scale + zero), the dense copy's weight, exactly. A row's sums do not depend on the
 * other rows of the call (AMX computes each C row alone), on M or on the thread count (threads split
 * the output blocks), so a row's result is the same bits in any batch.
 *
 * Weight layout (proxy/quant/amx_int4.py pack): codes [N / 16][K / 32][4][32][2] bytes; in tile
 * (b, t), bytes (q, j, h) hold in their low nibble the code of B-tile row 4q + 2h element j and in their
 * high nibble that of row 4q + 2h + 1 (the 16-bit word (q, j) holds rows 4q .. 4q + 3 of element j,
 * lowest nibble first), where B-tile row r element i is W[16 b + i / 2, 32 t + 2 r + i % 2] (AMX's
 * VNNI pairs).
 * scale and zero: bf16 [N / 16][G][16].
 */
#ifndef STREAMPROXY_AMX_INT4_H
#define STREAMPROXY_AMX_INT4_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11
#include <cpuid.h>
#include <immintrin.h>
#include <errno.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>
#define SP_AMX_X86 1
#define SP_AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl")))
#else
#define SP_AMX_X86 0
#endif

#define SP_AMX_KTILE 32  /* inputs a B tile covers (16 rows of VNNI pairs) */
#define SP_AMX_NBLOCK 16 /* output features a C tile covers */
#define SP_AMX_MTILE 16  /* activation rows an A tile covers */
#define SP_AMX_MAX_GROUP 256

#if SP_AMX_X86
#define SP_ARCH_REQ_XCOMP_PERM 0x1023
#define SP_XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} sp_tile_config;

/* Runs tile instructions in a forked child: 1 when it exits normally. A VM can advertise AMX and have
 * it granted yet fault on the first tile instruction (ggml's AMX build died of SIGILL on tilezero on
 * such a VM); the probe keeps that fault out of the server. */
static SP_AMX int sp_amx_probe(void) {
    const pid_t pid = fork();
    if (pid < 0) return 0;
    if (pid == 0) {
        sp_tile_config cfg;
        memset(&cfg, 0, sizeof(cfg));
        cfg.palette_id = 1;
        cfg.rows[0] = 16; cfg.colsb[0] = 64;
        _tile_loadconfig(&cfg);
        _tile_zero(0);
        _tile_release();
        _exit(0);
    }
    int status = 0;
    while (waitpid(pid, &status, 0) < 0) {
        if (errno != EINTR) return 0;
    }
    return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

/* 1 when this CPU and kernel run the kernel: AMX-TILE, AMX-BF16, AVX-512 F/BW/VL, the OS saves the
 * tile state (XCR0 bits 17 and 18), grants this process the tile data (arch_prctl, Linux 5.16+), and
 * a child process ran tile instructions (sp_amx_probe). Checked once a process. */
static int sp_amx_available(void) {
    static int cached = -1;
    if (cached >= 0) return cached;
    unsigned a, b, c, d;
    cached = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
    const int amx_bf16 = (d >> 22) & 1, amx_tile = (d >> 24) & 1;
    const int f = (b >> 16) & 1, bw = (b >> 30) & 1, vl = (b >> 31) & 1;
    if (!(amx_bf16 && amx_tile && f && bw && vl)) return 0;
    __get_cpuid(1, &a, &b, &c, &d);
    if (!((c >> 27) & 1)) return 0; /* OSXSAVE */
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo & (3u << 17)) != (3u << 17) || (lo & 0xe6) != 0xe6) return 0;
    if (syscall(SYS_arch_prctl, SP_ARCH_REQ_XCOMP_PERM, SP_XFEATURE_XTILEDATA) != 0) return 0;
    cached = sp_amx_probe();
    return cached;
}

/* two sets: tmm0 / tmm3: A (rows x 32 bf16), tmm1 / tmm4: B (16 x 32 bf16), tmm2 / tmm5: C (rows x 16 fp32) */
static inline SP_AMX void sp_amx_configure(int rows) {
    sp_tile_config cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.palette_id = 1;
    for (int set = 0; set < 6; set += 3) {
        cfg.rows[set] = (uint8_t)rows; cfg.colsb[set] = 64;
        cfg.rows[set + 1] = 16; cfg.colsb[set + 1] = 64;
        cfg.rows[set + 2] = (uint8_t)rows; cfg.colsb[set + 2] = 64;
    }
    _tile_loadconfig(&cfg);
}

static inline SP_AMX __m512 sp_bf16x16_to_ps(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* 16 fp32 values rounded to nearest even to bf16 (its inverse above; no NaN among them) */
static inline SP_AMX __m256i sp_ps_to_bf16x16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i bias = _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(_mm512_srli_epi32(u, 16),
                                                                                      _mm512_set1_epi32(1)));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_add_epi32(u, bias), 16));
}

/* lut[i] = bf16(i - 8) for the 16 codes, twice (small integers: exact) */
static inline SP_AMX __m512i sp_amx_code_lut(void) {
    uint16_t lut_v[32];
    for (int i = 0; i < 32; i++) {
        float v = (float)((i & 15) - 8);
        uint32_t u;
        memcpy(&u, &v, 4);
        lut_v[i] = (uint16_t)(u >> 16);
    }
    return _mm512_loadu_si512((const void *)lut_v);
}

/* the codes of one 32-input tile (256 bytes) as a B tile of bf16 (code - 8) values (1 KiB at dst):
 * each 64 bytes read as 32 words give four tile rows, nibble i of word j being row element j of the
 * i-th row (vpermw reads an index's low 5 bits, and the table holds the 16 values twice: no mask) */
static inline SP_AMX void sp_amx_decode_tile(const uint8_t *src, uint16_t *dst, __m512i lut) {
    for (int q = 0; q < 4; q++) {
        const __m512i w = _mm512_loadu_si512((const void *)(src + 64 * q));
        _mm512_store_si512((__m512i *)(dst + 128 * q), _mm512_permutexvar_epi16(w, lut));
        _mm512_store_si512((__m512i *)(dst + 128 * q + 32), _mm512_permutexvar_epi16(_mm512_srli_epi16(w, 4), lut));
        _mm512_store_si512((__m512i *)(dst + 128 * q + 64), _mm512_permutexvar_epi16(_mm512_srli_epi16(w, 8), lut));
        _mm512_store_si512((__m512i *)(dst + 128 * q + 96), _mm512_permutexvar_epi16(_mm512_srli_epi16(w, 12), lut));
    }
}

/* one group's tiles (tpg of them, B tiles at bt, A at xa with row stride lda bytes) into C tile C,
 * stored to cdst (64-byte rows) */
#define SP_AMX_GROUP(A, B, C, xa, lda, bt, tpg, cdst)                 \
    do {                                                              \
        _tile_zero(C);                                                \
        for (int64_t t_ = 0; t_ < (tpg); t_++) {                      \
            _tile_loadd(A, (xa) + t_ * SP_AMX_KTILE, (lda));          \
            _tile_loadd(B, (bt) + 512 * t_, 64);                      \
            _tile_dpbf16ps(C, A, B);                                  \
        }                                                             \
        _tile_stored(C, (cdst), 64);                                  \
    } while (0)

/* the fp32 pass of one row tile over a chunk's groups [g0, g1): for each row r < R (a constant once
 * inlined) and group g in order, acc[r] = fma(P[g][r], scale[g], acc[r]) then acc[r] = fma(S[r, g],
 * zero[g], acc[r]), P the group's C tile in cbuf (rows rows apart), S the rows' group sums (G a row).
 * The rows' accumulators stay in registers and each group's scale and zero are widened once for all
 * rows (the same operations in the same order per row as one row at a time). */
static inline SP_AMX __attribute__((always_inline)) void sp_amx_scale_rows(
    const int R, float *acc, const float *cbuf, int rows, const float *sums, int64_t G, const uint16_t *sb,
    const uint16_t *zb, int64_t g0, int64_t g1) {
    __m512 v[SP_AMX_MTILE];
    for (int r = 0; r < R; r++) v[r] = _mm512_load_ps(acc + r * SP_AMX_NBLOCK);
    for (int64_t g = g0; g < g1; g++) {
        const __m512 s = sp_bf16x16_to_ps(sb + g * SP_AMX_NBLOCK), z = sp_bf16x16_to_ps(zb + g * SP_AMX_NBLOCK);
        const float *c = cbuf + (g - g0) * rows * SP_AMX_NBLOCK;
        for (int r = 0; r < R; r++) {
            v[r] = _mm512_fmadd_ps(_mm512_load_ps(c + r * SP_AMX_NBLOCK), s, v[r]);
            v[r] = _mm512_fmadd_ps(_mm512_set1_ps(sums[r * G + g]), z, v[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm512_store_ps(acc + r * SP_AMX_NBLOCK, v[r]);
}

/* groups decoded, then multiplied, at a time (bounds the decoded tiles to ~16 KiB, in L1) */
#define SP_AMX_CHUNK_TILES 16
/* how far ahead (bytes) the codes are prefetched: a call of few rows spends less time a tile, so it
 * looks further ahead. Measured (2-core AMX Xeon, the default model's 120 layers of one step, caches
 * flushed, 2 threads): 1 row 3.80-3.90 ms at 1024 bytes, 3.52-3.63 at 2048, 3.66-3.73 at 4096;
 * 16 rows 8.03 at 1024, 8.31 at 2048, 8.53 at 4096 (medians of 20). */
#ifndef SP_AMX_PREFETCH_FEW_ROWS
#define SP_AMX_PREFETCH_FEW_ROWS 2048
#endif
#ifndef SP_AMX_PREFETCH
#define SP_AMX_PREFETCH 1024
#endif
#define SP_AMX_FEW_ROWS 4

/* rows [0, mend) of fp32 rows 64 bytes apart (a stored C tile, a block's accumulators) rounded to bf16
 * into y (row stride N) */
static inline SP_AMX void sp_amx_store_rows(const float *c, int64_t mend, uint16_t *y, int64_t N) {
    for (int64_t m = 0; m < mend; m++)
        _mm256_storeu_si256((__m256i *)(y + m * N), sp_ps_to_bf16x16(_mm512_load_ps(c + m * SP_AMX_NBLOCK)));
}

/* The whole product (arguments as sp_amx_int4_matmul; M_pad rows of x readable, M_pad = M rounded up
 * to 16 when M > 16, else M). Per output block: the codes of a chunk of groups are decoded into B
 * tiles, then each 16-row tile of x is multiplied group by group (two sets of tile registers in turn,
 * so that one group's products overlap the next's), each group's C tile stored; then the fp32 pass
 * applies scales and zeros group after group to every row of the tile (sp_amx_scale_rows). */
static SP_AMX void sp_amx_int4_run(const uint16_t *x, int64_t M, int64_t M_pad, int64_t K, const uint8_t *codes,
                                   const uint16_t *scale, const uint16_t *zero, int64_t N, int64_t group,
                                   uint16_t *y, int num_threads) {
    const int64_t G = K / group, T = K / SP_AMX_KTILE, tpg = group / SP_AMX_KTILE;
    const int64_t blocks = N / SP_AMX_NBLOCK;
    const int rows = M_pad < SP_AMX_MTILE ? (int)M_pad : SP_AMX_MTILE;
    int64_t chunk = SP_AMX_CHUNK_TILES / tpg; /* groups a chunk */
    const int64_t prefetch = M <= SP_AMX_FEW_ROWS ? SP_AMX_PREFETCH_FEW_ROWS : SP_AMX_PREFETCH;
    if (chunk < 1) chunk = 1;
    float *sums = (float *)malloc(sizeof(float) * (size_t)(M * G));
    if (!sums) return;
    const __m512i lut = sp_amx_code_lut();
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < M * G; i++) {
            const uint16_t *xp = x + (i / G) * K + (i % G) * group;
            __m512 s = _mm512_setzero_ps();
            for (int64_t j = 0; j < group; j += 16) s = _mm512_add_ps(s, sp_bf16x16_to_ps(xp + j));
            sums[i] = _mm512_reduce_add_ps(s);
        }
        uint16_t *btiles = (uint16_t *)aligned_alloc(64, 1024 * (size_t)(chunk * tpg));
        float *cbuf = (float *)aligned_alloc(64, 64 * (size_t)(chunk * rows));
        float *acc = (float *)aligned_alloc(64, 64 * (size_t)M_pad);
        if (btiles && cbuf && acc) {
            sp_amx_configure(rows);
#pragma omp for schedule(static)
            for (int64_t b = 0; b < blocks; b++) {
                const uint16_t *sb = scale + b * G * SP_AMX_NBLOCK, *zb = zero + b * G * SP_AMX_NBLOCK;
                memset(acc, 0, 64 * (size_t)M_pad);
                for (int64_t g0 = 0; g0 < G; g0 += chunk) {
                    const int64_t g1 = g0 + chunk < G ? g0 + chunk : G;
                    for (int64_t t = g0 * tpg; t < g1 * tpg; t++) {
                        const uint8_t *src = codes + (b * T + t) * 256;
                        for (int l = 0; l < 256; l += 64) _mm_prefetch((const char *)src + prefetch + l, _MM_HINT_T0);
                        sp_amx_decode_tile(src, btiles + 512 * (t - g0 * tpg), lut);
                    }
                    for (int64_t m0 = 0; m0 < M_pad; m0 += SP_AMX_MTILE) {
                        const uint16_t *xm = x + m0 * K;
                        int64_t g = g0;
                        for (; g + 1 < g1; g += 2) {
                            SP_AMX_GROUP(0, 1, 2, xm + g * group, K * 2, btiles + 512 * (g - g0) * tpg, tpg,
                                         cbuf + (g - g0) * rows * SP_AMX_NBLOCK);
                            SP_AMX_GROUP(3, 4, 5, xm + (g + 1) * group, K * 2,
                                         btiles + 512 * (g + 1 - g0) * tpg, tpg,
                                         cbuf + (g + 1 - g0) * rows * SP_AMX_NBLOCK);
                        }
                        if (g < g1)
                            SP_AMX_GROUP(0, 1, 2, xm + g * group, K * 2, btiles + 512 * (g - g0) * tpg, tpg,
                                         cbuf + (g - g0) * rows * SP_AMX_NBLOCK);
                        const int64_t mend = M - m0 < rows ? M - m0 : rows;
                        float *am = acc + m0 * SP_AMX_NBLOCK;
                        const float *sm = sums + m0 * G;
                        switch (mend) {
#define SP_AMX_EP(R) case R: sp_amx_scale_rows(R, am, cbuf, rows, sm, G, sb, zb, g0, g1); break
                        SP_AMX_EP(1); SP_AMX_EP(2); SP_AMX_EP(3); SP_AMX_EP(4); SP_AMX_EP(5); SP_AMX_EP(6);
                        SP_AMX_EP(7); SP_AMX_EP(8); SP_AMX_EP(9); SP_AMX_EP(10); SP_AMX_EP(11); SP_AMX_EP(12);
                        SP_AMX_EP(13); SP_AMX_EP(14); SP_AMX_EP(15); SP_AMX_EP(16);
#undef SP_AMX_EP
                        default: break;
                        }
                    }
                }
                sp_amx_store_rows(acc, M, y + b * SP_AMX_NBLOCK, N);
            }
            _tile_release();
        }
        free(btiles);
        free(cbuf);
        free(acc);
    }
    free(sums);
}

/* tmm0 / tmm1: A (two row tiles of x), tmm2 / tmm3: B (two output blocks), tmm4-7: C (2 x 2) */
static inline SP_AMX void sp_amx_configure_2x2(int rows) {
    sp_tile_config cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = (uint8_t)(t == 2 || t == 3 ? 16 : rows);
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* one output block's B tiles (T of them at bt), decoded with the group's scale and zero applied:
 * w = bf16(fma(1, zero, fma(code - 8, scale, 0))), rounded to nearest even (the operations of
 * sp_amx_scale_rows for a unit input: w is the layer's dequantized weight) */
static inline SP_AMX void sp_amx_decode_block_scaled(const uint8_t *codes, const uint16_t *sb, const uint16_t *zb,
                                                     int64_t T, int64_t tpg, uint16_t *bt, __m512i lut) {
    /* lane j of a B-tile row half holds feature j / 2 (lo half) or 8 + j / 2 (hi half) */
    const __m512i idx_lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i idx_hi = _mm512_set_epi32(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8);
    const __m512 one = _mm512_set1_ps(1.0f), zf = _mm512_setzero_ps();
    for (int64_t t = 0; t < T; t++) {
        uint16_t *tile = bt + 512 * t;
        sp_amx_decode_tile(codes + t * 256, tile, lut);
        const __m512 s = sp_bf16x16_to_ps(sb + (t / tpg) * SP_AMX_NBLOCK);
        const __m512 z = sp_bf16x16_to_ps(zb + (t / tpg) * SP_AMX_NBLOCK);
        const __m512 s_lo = _mm512_permutexvar_ps(idx_lo, s), s_hi = _mm512_permutexvar_ps(idx_hi, s);
        const __m512 z_lo = _mm512_permutexvar_ps(idx_lo, z), z_hi = _mm512_permutexvar_ps(idx_hi, z);
        for (int r = 0; r < 16; r++) {
            uint16_t *row = tile + 32 * r;
            const __m512 lo = _mm512_fmadd_ps(one, z_lo, _mm512_fmadd_ps(sp_bf16x16_to_ps(row), s_lo, zf));
            const __m512 hi = _mm512_fmadd_ps(one, z_hi, _mm512_fmadd_ps(sp_bf16x16_to_ps(row + 16), s_hi, zf));
            _mm256_store_si256((__m256i *)row, sp_ps_to_bf16x16(lo));
            _mm256_store_si256((__m256i *)(row + 16), sp_ps_to_bf16x16(hi));
        }
    }
}

/* The prompt-row product (sp_amx_int4_prompt_matmul; x rows lda elements apart, M_pad of them
 * readable): per pair of output blocks, their tiles are decoded once with scales and zeros applied
 * (sp_amx_decode_block_scaled), then each pair of 16-row tiles of x is multiplied with them over the
 * whole K into four C tiles (fp32, K in order), stored once and rounded to bf16. */
static SP_AMX void sp_amx_int4_prompt_run(const uint16_t *x, int64_t lda, int64_t M, int64_t M_pad, int64_t K,
                                          const uint8_t *codes, const uint16_t *scale, const uint16_t *zero,
                                          int64_t N, int64_t group, uint16_t *y, int num_threads) {
    const int64_t G = K / group, T = K / SP_AMX_KTILE, tpg = group / SP_AMX_KTILE;
    const int64_t blocks = N / SP_AMX_NBLOCK, pairs = (blocks + 1) / 2;
    const int rows = M_pad < SP_AMX_MTILE ? (int)M_pad : SP_AMX_MTILE;
    const __m512i lut = sp_amx_code_lut();
#pragma omp parallel num_threads(num_threads)
    {
        uint16_t *btiles = (uint16_t *)aligned_alloc(64, 2 * 1024 * (size_t)T);
        float *cbuf = (float *)aligned_alloc(64, 64 * (size_t)SP_AMX_MTILE);
        if (btiles && cbuf) {
            sp_amx_configure_2x2(rows);
#pragma omp for schedule(static)
            for (int64_t p = 0; p < pairs; p++) {
                const int64_t b = 2 * p;
                const int both = b + 1 < blocks;
                for (int64_t j = 0; j < 1 + both; j++)
                    sp_amx_decode_block_scaled(codes + (b + j) * T * 256, scale + (b + j) * G * SP_AMX_NBLOCK,
                                               zero + (b + j) * G * SP_AMX_NBLOCK, T, tpg, btiles + j * 512 * T, lut);
                const uint16_t *b0 = btiles, *b1 = btiles + 512 * T;
                for (int64_t m0 = 0; m0 < M_pad; m0 += 2 * SP_AMX_MTILE) {
                    const int two = m0 + SP_AMX_MTILE < M_pad;
                    const uint16_t *xa = x + m0 * lda, *xb = x + (m0 + SP_AMX_MTILE) * lda;
                    _tile_zero(4); _tile_zero(5); _tile_zero(6); _tile_zero(7);
                    for (int64_t t = 0; t < T; t++) {
                        _tile_loadd(0, xa + t * SP_AMX_KTILE, lda * 2);
                        _tile_loadd(2, b0 + 512 * t, 64);
                        _tile_dpbf16ps(4, 0, 2);
                        if (both) {
                            _tile_loadd(3, b1 + 512 * t, 64);
                            _tile_dpbf16ps(5, 0, 3);
                        }
                        if (two) {
                            _tile_loadd(1, xb + t * SP_AMX_KTILE, lda * 2);
                            _tile_dpbf16ps(6, 1, 2);
                            if (both) _tile_dpbf16ps(7, 1, 3);
                        }
                    }
                    const int64_t m1 = M - m0 < rows ? M - m0 : rows; /* rows of the first row tile */
                    const int64_t m2 = two ? (M - m0 - rows < rows ? M - m0 - rows : rows) : 0;
                    _tile_stored(4, cbuf, 64);
                    sp_amx_store_rows(cbuf, m1, y + m0 * N + b * SP_AMX_NBLOCK, N);
                    if (both) {
                        _tile_stored(5, cbuf, 64);
                        sp_amx_store_rows(cbuf, m1, y + m0 * N + (b + 1) * SP_AMX_NBLOCK, N);
                    }
                    if (m2 > 0) {
                        _tile_stored(6, cbuf, 64);
                        sp_amx_store_rows(cbuf, m2, y + (m0 + rows) * N + b * SP_AMX_NBLOCK, N);
                        if (both) {
                            _tile_stored(7, cbuf, 64);
                            sp_amx_store_rows(cbuf, m2, y + (m0 + rows) * N + (b + 1) * SP_AMX_NBLOCK, N);
                        }
                    }
                }
            }
            _tile_release();
        }
        free(btiles);
        free(cbuf);
    }
}
#else
static int sp_amx_available(void) { return 0; }
#endif

/* y[M, N] (bf16) = x[M, K] (bf16) @ W^T; K % group == 0, group % 32 == 0, group <= 256, N % 16 == 0,
 * all arrays contiguous in the layout above. Threads (OpenMP, num_threads) take contiguous ranges of
 * the N / 16 output blocks. The kernel reads whole 16-row tiles of x: a call of more than 16 rows,
 * not a multiple of 16, runs on a copy of x padded with zero rows (their outputs are not stored).
 * Computes nothing where sp_amx_available() is 0 (or the padded copy cannot be allocated). */
static void sp_amx_int4_matmul(const uint16_t *x, int64_t M, int64_t K, const uint8_t *codes, const uint16_t *scale,
                               const uint16_t *zero, int64_t N, int64_t group, uint16_t *y, int num_threads) {
#if SP_AMX_X86
    if (!sp_amx_available() || M <= 0) return;
    const int64_t M_pad = M <= SP_AMX_MTILE ? M : (M + SP_AMX_MTILE - 1) / SP_AMX_MTILE * SP_AMX_MTILE;
    uint16_t *padded = NULL;
    if (M_pad != M) {
        padded = (uint16_t *)calloc((size_t)(M_pad * K), sizeof(uint16_t));
        if (!padded) return;
        memcpy(padded, x, sizeof(uint16_t) * (size_t)(M * K));
        x = padded;
    }
    sp_amx_int4_run(x, M, M_pad, K, codes, scale, zero, N, group, y, num_threads);
    free(padded);
#else
    (void)x; (void)M; (void)K; (void)codes; (void)scale; (void)zero; (void)N; (void)group; (void)y; (void)num_threads;
#endif
}

/* y[M, N] (bf16) = x[M, K] (bf16) @ W^T for a call's prompt rows: the arguments and the padding of
 * sp_amx_int4_matmul; W as the layer's dequantized bf16 weight (sp_amx_int4_prompt_run), summed over
 * the whole K in fp32 tile registers: not the bits of sp_amx_int4_matmul, but a row's bits do not
 * depend on the other rows, the row count or the thread count either. */
static void sp_amx_int4_prompt_matmul(const uint16_t *x, int64_t M, int64_t K, const uint8_t *codes,
                                      const uint16_t *scale, const uint16_t *zero, int64_t N, int64_t group,
                                      uint16_t *y, int num_threads) {
#if SP_AMX_X86
    if (!sp_amx_available() || M <= 0) return;
    const int64_t M_pad = M <= SP_AMX_MTILE ? M : (M + SP_AMX_MTILE - 1) / SP_AMX_MTILE * SP_AMX_MTILE;
    /* a copy whose rows are 64 bytes off a multiple of 4 KiB: a row tile's 16 lines would otherwise
     * share one L1 set (x rows of K = 2048 bf16 values are 4 KiB apart) */
    const int64_t lda = (K * 2) % 4096 == 0 ? K + 32 : K;
    uint16_t *padded = NULL;
    if (M_pad != M || lda != K) {
        padded = (uint16_t *)calloc((size_t)(M_pad * lda), sizeof(uint16_t));
        if (!padded) return;
        for (int64_t m = 0; m < M; m++) memcpy(padded + m * lda, x + m * K, sizeof(uint16_t) * (size_t)K);
        x = padded;
    }
    sp_amx_int4_prompt_run(x, lda, M, M_pad, K, codes, scale, zero, N, group, y, num_threads);
    free(padded);
#else
    (void)x; (void)M; (void)K; (void)codes; (void)scale; (void)zero; (void)N; (void)group; (void)y; (void)num_threads;
#endif
}

#include "avx2_int4.h"

/* the variant sp_int4_matmul runs here: 2 this header's AMX kernel, 1 avx2_int4.h's, 0 none. The two sum a
 * tile in other orders, so a process uses one (the same in every call: checked once a process). */
static int sp_int4_isa(void) {
    static int cached = -1;
    if (cached < 0) cached = sp_amx_available() ? 2 : sp_q8_available() ? 1 : 0;
    return cached;
}

/* y[M, N] (bf16) = x[M, K] (bf16) @ W^T on this CPU's variant (sp_int4_isa): sp_amx_int4_matmul's
 * arguments and conditions (avx2_int4.h takes any group that is a multiple of 32). */
static void sp_int4_matmul(const uint16_t *x, int64_t M, int64_t K, const uint8_t *codes, const uint16_t *scale,
                           const uint16_t *zero, int64_t N, int64_t group, uint16_t *y, int num_threads) {
    if (sp_int4_isa() == 2)
        sp_amx_int4_matmul(x, M, K, codes, scale, zero, N, group, y, num_threads);
    else
        sp_avx2_int4_matmul(x, M, K, codes, scale, zero, N, group, y, num_threads);
}

#endif
