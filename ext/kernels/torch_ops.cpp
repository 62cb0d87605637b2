// The CPU kernels of the torch ops streamproxy::amx_int4_mm, streamproxy::amx_int8_mm,
// streamproxy::q8_matmul(_split) and
// streamproxy::paged_decode_attention in C++, built into proxy.quant._torch_ops against the installed
// torch and loaded by proxy.quant.kernels, which defines the ops' schemas; proxy/quant/kernels.py says
// why (a compiled decode step calls them ~150 times a step without taking the GIL). The matmul kernels
// are the headers' (amx_int4.h, amx_int8.h, q8_matmul.h), the attention kernel is below; each call checks its
// arguments (the Python kernels they replace trusted the compiled graph's shapes).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cstdint>
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

extern "C" {
#include "amx_int4.h"
#include "amx_int8.h"
#include "q8_matmul.h"
}

namespace {

// y bf16 [M, N] = x bf16 [M, K] @ W^T, W the int4 plane of tiles uint8 [N / 16, K / 32, 256] and
// scales_and_zeros bf16 [2, N / 16, K / group_size, 16] (proxy.quant.amx_int4.pack).
at::Tensor amx_int4_mm(const at::Tensor& x_in, const at::Tensor& tiles, const at::Tensor& scales_and_zeros,
                       int64_t group_size) {
    TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kBFloat16 && tiles.dim() == 3 &&
                    tiles.scalar_type() == at::kByte && scales_and_zeros.dim() == 4 &&
                    scales_and_zeros.scalar_type() == at::kBFloat16,
                "amx_int4_mm takes bf16 x [M, K], uint8 tiles [N / 16, K / 32, 256] and bf16 scales_and_zeros "
                "[2, N / 16, G, 16]");
    const int64_t m = x_in.size(0), k = x_in.size(1), blocks = tiles.size(0), n = blocks * SP_AMX_NBLOCK;
    TORCH_CHECK(group_size > 0 && group_size % SP_AMX_KTILE == 0 && group_size <= SP_AMX_MAX_GROUP &&
                    k % group_size == 0 && tiles.size(1) * SP_AMX_KTILE == k && tiles.size(2) == 256 &&
                    scales_and_zeros.size(0) == 2 && scales_and_zeros.size(1) == blocks &&
                    scales_and_zeros.size(2) == k / group_size && scales_and_zeros.size(3) == SP_AMX_NBLOCK,
                "amx_int4_mm: shapes do not fit (x ", x_in.sizes(), ", tiles ", tiles.sizes(),
                ", scales_and_zeros ", scales_and_zeros.sizes(), ", group ", group_size, ")");
    TORCH_CHECK(tiles.is_contiguous() && scales_and_zeros.is_contiguous(), "amx_int4_mm takes contiguous weights");
    TORCH_CHECK(sp_int4_isa() != 0, "the int4 kernel does not run on this CPU (neither AMX-BF16 nor AVX2)");
    at::Tensor x = x_in.contiguous();
    at::Tensor out = at::empty({m, n}, x.options());
    if (m && n) {
        const auto* sz = static_cast<const uint16_t*>(scales_and_zeros.const_data_ptr());
        sp_int4_matmul(static_cast<const uint16_t*>(x.const_data_ptr()), m, k,
                       static_cast<const uint8_t*>(tiles.const_data_ptr()), sz,
                       sz + blocks * (k / group_size) * SP_AMX_NBLOCK, n, group_size,
                       static_cast<uint16_t*>(out.mutable_data_ptr()), at::get_num_threads());
    }
    return out;
}

// y fp32 [M, N] = x bf16 [M, K] @ (codes int8 [N, K] * scale)^T on AMX (amx_int8.h): scales fp32
// [N / 16, K / group, 16], or with sub int8 [N / 16, K / 16, 16] the split block scales fp32
// [N / 16, K / 256, 16] (group 16); six_bit: every code is in [-32, 31] (proxy.quant.amx_int8.pack).
at::Tensor amx_int8_mm(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& scales,
                       const std::optional<at::Tensor>& sub, int64_t group_size, bool six_bit) {
    TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kBFloat16 && codes.dim() == 2 &&
                    codes.scalar_type() == at::kChar && scales.dim() == 3 && scales.scalar_type() == at::kFloat &&
                    (!sub || (sub->dim() == 3 && sub->scalar_type() == at::kChar)),
                "amx_int8_mm takes bf16 x [M, K], int8 codes [N, K], fp32 scales [N / 16, G, 16] and int8 sub "
                "[N / 16, K / 16, 16] or None");
    const int64_t m = x_in.size(0), k = x_in.size(1), n = codes.size(0);
    const bool shapes = (group_size == 16 || group_size == 32) && k % 32 == 0 && n % 16 == 0 &&
                        codes.size(1) == k && scales.size(0) == n / 16 && scales.size(2) == 16 &&
                        (sub ? group_size == 16 && k % SP_A8_SPLIT == 0 && scales.size(1) == k / SP_A8_SPLIT &&
                                   sub->size(0) == n / 16 && sub->size(1) == k / 16 && sub->size(2) == 16
                             : scales.size(1) == k / group_size);
    TORCH_CHECK(shapes, "amx_int8_mm: shapes do not fit (x ", x_in.sizes(), ", codes ", codes.sizes(), ", scales ",
                scales.sizes(), ", group ", group_size, ")");
    TORCH_CHECK(codes.is_contiguous() && scales.is_contiguous() && (!sub || sub->is_contiguous()),
                "amx_int8_mm takes contiguous weights");
    TORCH_CHECK(sp_amx_available(), "the AMX int8 kernel does not run on this CPU");
    at::Tensor x = x_in.contiguous();
    at::Tensor out = at::empty({m, n}, x.options().dtype(at::kFloat));
    if (m && n)
        sp_amx_int8_matmul(static_cast<const uint16_t*>(x.const_data_ptr()), m, k, codes.const_data_ptr<int8_t>(),
                           scales.const_data_ptr<float>(), sub ? sub->const_data_ptr<int8_t>() : nullptr, group_size,
                           six_bit ? 1 : 0, n, out.mutable_data_ptr<float>(), at::get_num_threads());
    return out;
}

// y fp32 [M, N] = x fp32 [M, K] @ (codes int8 [N, K] * scales fp32 [N, K / group] + zeros)^T with
// instruction set isa (SP_Q8_AVX2 or SP_Q8_AVX512); the group (32 or 16) is K over the scales' columns;
// zeros (optional) fp32 shaped as scales.
at::Tensor q8_matmul(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& scales,
                     const std::optional<at::Tensor>& zeros, int64_t isa) {
    TORCH_CHECK(x_in.dim() == 2 && codes.dim() == 2 && scales.dim() == 2 && x_in.scalar_type() == at::kFloat &&
                    codes.scalar_type() == at::kChar && scales.scalar_type() == at::kFloat,
                "q8_matmul takes fp32 x [M, K], int8 codes [N, K] and fp32 scales [N, K / 32 or K / 16]");
    const int64_t m = x_in.size(0), k = x_in.size(1), n = codes.size(0);
    TORCH_CHECK(k % SP_Q8_GROUP == 0 && codes.size(1) == k && scales.size(0) == n &&
                    (scales.size(1) == k / SP_Q8_GROUP || scales.size(1) == k / 16),
                "q8_matmul: shapes do not fit (x ", x_in.sizes(), ", codes ", codes.sizes(), ", scales ",
                scales.sizes(), ")");
    TORCH_CHECK(codes.is_contiguous() && scales.is_contiguous(), "q8_matmul takes contiguous codes and scales");
    TORCH_CHECK(!zeros || (zeros->scalar_type() == at::kFloat && zeros->sizes() == scales.sizes() &&
                           zeros->is_contiguous()),
                "q8_matmul takes contiguous fp32 zeros shaped as the scales");
    TORCH_CHECK((isa == SP_Q8_AVX2 || isa == SP_Q8_AVX512) && isa <= sp_q8_best_isa(),
                "q8_matmul: instruction set ", isa, " does not run on this CPU");
    at::Tensor x = x_in.contiguous();
    at::Tensor out = at::empty({m, n}, x.options());
    if (m && n)
        sp_q8_matmul(x.const_data_ptr<float>(), m, k, codes.const_data_ptr<int8_t>(), scales.const_data_ptr<float>(),
                     zeros ? zeros->const_data_ptr<float>() : nullptr, k ? k / scales.size(1) : SP_Q8_GROUP, n, out.mutable_data_ptr<float>(), at::get_num_threads(),
                     static_cast<int>(isa));
    return out;
}

// q8_matmul with the group-16 scales split (q8_matmul.h's sp_q8_matmul_split): sub int8 [N, K / 16],
// block fp32 [N, K / 256] (proxy.quant.split_scales).
at::Tensor q8_matmul_split(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& sub,
                           const at::Tensor& block, int64_t isa) {
    TORCH_CHECK(x_in.dim() == 2 && codes.dim() == 2 && sub.dim() == 2 && block.dim() == 2 &&
                    x_in.scalar_type() == at::kFloat && codes.scalar_type() == at::kChar &&
                    sub.scalar_type() == at::kChar && block.scalar_type() == at::kFloat,
                "q8_matmul_split takes fp32 x [M, K], int8 codes [N, K], int8 sub [N, K / 16] and fp32 block "
                "[N, K / 256]");
    const int64_t m = x_in.size(0), k = x_in.size(1), n = codes.size(0);
    TORCH_CHECK(k % SP_Q8_SPLIT == 0 && codes.size(1) == k && sub.size(0) == n && sub.size(1) == k / 16 &&
                    block.size(0) == n && block.size(1) == k / SP_Q8_SPLIT,
                "q8_matmul_split: shapes do not fit (x ", x_in.sizes(), ", codes ", codes.sizes(), ", sub ",
                sub.sizes(), ", block ", block.sizes(), ")");
    TORCH_CHECK(codes.is_contiguous() && sub.is_contiguous() && block.is_contiguous(),
                "q8_matmul_split takes contiguous weights");
    TORCH_CHECK((isa == SP_Q8_AVX2 || isa == SP_Q8_AVX512) && isa <= sp_q8_best_isa(),
                "q8_matmul_split: instruction set ", isa, " does not run on this CPU");
    at::Tensor x = x_in.contiguous();
    at::Tensor out = at::empty({m, n}, x.options());
    if (m && n)
        sp_q8_matmul_split(x.const_data_ptr<float>(), m, k, codes.const_data_ptr<int8_t>(),
                           sub.const_data_ptr<int8_t>(), block.const_data_ptr<float>(), n,
                           out.mutable_data_ptr<float>(), at::get_num_threads(), static_cast<int>(isa));
    return out;
}

// ---- paged decode attention ----------------------------------------------------------------------
// One query token per sequence over its own context in the paged pools (vLLM's PagedAttention
// layout, proxy/engine/execution/attention/cache.py), without gathering the context into a padded tensor:
// softmax(q k^T * scale) v in fp32 over the first context_lens[b] slots of slots[b], the GQA group's
// query heads sharing one pass over each key. A row reads only its own keys, in the same order
// whatever the padded key length and the other rows: its output is the same bits alone or in any
// batch. The float math is plain loops over 16 independent lanes (no reassociation), which the
// compiler vectorizes for each target_clones instruction set.

constexpr int64_t kLanes = 16;

// exp(x) for x <= 0, fp32: Cephes' expf (range reduction by ln 2, degree-6 polynomial, ~1 ulp);
// x below -87 is clamped there (exp(-87) ~ 1.6e-38, negligible beside the row's maximum, exp(0) = 1).
inline __attribute__((always_inline)) float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
    float r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const float y = p * r * r + r + 1.0f;
    const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
    float two_n;
    std::memcpy(&two_n, &bits, sizeof two_n);
    return y * two_n;
}

template <typename T>
inline __attribute__((always_inline)) float to_float(T v) {
    if constexpr (std::is_same_v<T, at::BFloat16>) {
        const uint32_t bits = static_cast<uint32_t>(v.x) << 16;
        float f;
        std::memcpy(&f, &bits, sizeof f);
        return f;
    } else {
        return static_cast<float>(v);
    }
}

// the sum of kLanes partial sums by a fixed tree (halves added pairwise)
inline __attribute__((always_inline)) float sum_lanes(float* part) {
    for (int64_t w = kLanes / 2; w > 0; w /= 2)
        for (int64_t l = 0; l < w; ++l) part[l] += part[l + w];
    return part[0];
}

// sum of a[0:n] * b[0:n], n a multiple of kLanes, in a fixed order (lanes, then a tree over them).
inline __attribute__((always_inline)) float dot_lanes(const float* __restrict a, const float* __restrict b,
                                                      int64_t n) {
    float part[kLanes] = {};
    for (int64_t d0 = 0; d0 < n; d0 += kLanes)
        for (int64_t l = 0; l < kLanes; ++l) part[l] += a[d0 + l] * b[d0 + l];
    return sum_lanes(part);
}

// Keys ahead whose K (scores) or V (weighted sum) row is prefetched: a row's keys for one head sit a
// slot apart (H_kv x Dk values, 4 KiB for 32 heads of 64 in bf16), one page each, where the hardware
// prefetchers do not follow (measured: docs/bench/2026-12-06-load-warm.md, and for the generic loops
// docs/bench/2026-12-07-decode-overheads.md).
#ifndef SP_ATTN_PREFETCH
#define SP_ATTN_PREFETCH 16
#endif

// the cache lines of n values from p
template <typename T>
inline __attribute__((always_inline)) void prefetch_values(const T* p, int64_t n) {
    const char* c = reinterpret_cast<const char*>(p);
    for (int64_t o = 0; o < n * static_cast<int64_t>(sizeof(T)); o += 64) __builtin_prefetch(c + o, 0, 3);
}

// A K or V row of n values as fp32 (n_pad, n rounded up to whole vectors): an fp32 row of whole
// vectors read in place (no copy: the same values, the same bits), else converted into scratch
// (whose tail past n stays zero).
template <typename T>
inline __attribute__((always_inline)) const float* row_values(const T* row, int64_t n, int64_t n_pad,
                                                              float* scratch) {
    if constexpr (std::is_same_v<T, float>) {
        if (n == n_pad) return row;
    }
    for (int64_t d = 0; d < n; ++d) scratch[d] = to_float(row[d]);
    return scratch;
}

struct DecodeScratch {  // one thread's buffers; widths rounded up to kLanes, the tails zero
    std::vector<float> q, scores, acc, k, v;
    DecodeScratch(int64_t groups, int64_t dk_pad, int64_t dv_pad, int64_t keys)
        : q(groups * dk_pad), scores(groups * keys), acc(groups * dv_pad), k(dk_pad), v(dv_pad) {}
};

struct DecodeArgs {
    int64_t groups, dk, dv, dk_pad, dv_pad;
    int64_t q_row_stride, q_head_stride, out_row_stride, out_head_stride;
    int64_t k_slot_stride, k_head_stride, v_slot_stride, v_head_stride;
    int64_t slot_stride;  // slots' row stride
    int64_t keys;         // slots' columns (the scores buffer's row length)
    float scale;
};

// Row b, KV head h: the output rows of query heads h * groups .. (h + 1) * groups - 1.
template <typename T>
inline __attribute__((always_inline)) void decode_one(const DecodeArgs& a, const T* __restrict query,
                                                      const T* __restrict k_pool, const T* __restrict v_pool,
                                                      const int64_t* __restrict slots, int64_t ctx, int64_t b,
                                                      int64_t h, DecodeScratch& s, T* __restrict out) {
    const int64_t g_n = a.groups;
    float* __restrict qf = s.q.data();
    float* __restrict sc = s.scores.data();
    float* __restrict acc = s.acc.data();
    float* __restrict kf = s.k.data();
    float* __restrict vf = s.v.data();
    const int64_t* __restrict row_slots = slots + b * a.slot_stride;
    const auto k_row = [&](int64_t j) { return k_pool + row_slots[j] * a.k_slot_stride + h * a.k_head_stride; };
    const auto v_row = [&](int64_t j) { return v_pool + row_slots[j] * a.v_slot_stride + h * a.v_head_stride; };
    for (int64_t g = 0; g < g_n; ++g) {
        const T* qr = query + b * a.q_row_stride + (h * g_n + g) * a.q_head_stride;
        for (int64_t d = 0; d < a.dk; ++d) qf[g * a.dk_pad + d] = to_float(qr[d]);
    }
    for (int64_t j = 0; j < std::min<int64_t>(ctx, SP_ATTN_PREFETCH); ++j) prefetch_values(k_row(j), a.dk);
    for (int64_t j = 0; j < ctx; ++j) {  // scores
        if (j + SP_ATTN_PREFETCH < ctx) prefetch_values(k_row(j + SP_ATTN_PREFETCH), a.dk);
        const float* kj = row_values(k_row(j), a.dk, a.dk_pad, kf);
        for (int64_t g = 0; g < g_n; ++g) sc[g * ctx + j] = dot_lanes(qf + g * a.dk_pad, kj, a.dk_pad) * a.scale;
    }
    for (int64_t g = 0; g < g_n; ++g) {  // softmax numerators in place
        float* row = sc + g * ctx;
        float m = row[0];
        for (int64_t j = 1; j < ctx; ++j) m = row[j] > m ? row[j] : m;
        for (int64_t j = 0; j < ctx; ++j) row[j] = exp_nonpositive(row[j] - m);
    }
    std::fill(acc, acc + g_n * a.dv_pad, 0.0f);
    for (int64_t j = 0; j < std::min<int64_t>(ctx, SP_ATTN_PREFETCH); ++j) prefetch_values(v_row(j), a.dv);
    for (int64_t j = 0; j < ctx; ++j) {  // numerators @ v
        if (j + SP_ATTN_PREFETCH < ctx) prefetch_values(v_row(j + SP_ATTN_PREFETCH), a.dv);
        const float* vj = row_values(v_row(j), a.dv, a.dv_pad, vf);
        for (int64_t g = 0; g < g_n; ++g) {
            const float p = sc[g * ctx + j];
            float* __restrict ag = acc + g * a.dv_pad;
            for (int64_t d = 0; d < a.dv_pad; ++d) ag[d] += p * vj[d];
        }
    }
    for (int64_t g = 0; g < g_n; ++g) {
        const float* row = sc + g * ctx;
        float part[kLanes] = {};
        int64_t j = 0;
        for (; j + kLanes <= ctx; j += kLanes)
            for (int64_t l = 0; l < kLanes; ++l) part[l] += row[j + l];
        for (int64_t l = 0; j < ctx; ++j, ++l) part[l] += row[j];
        const float inv = 1.0f / sum_lanes(part);
        T* o = out + b * a.out_row_stride + (h * g_n + g) * a.out_head_stride;
        const float* ag = acc + g * a.dv_pad;
        for (int64_t d = 0; d < a.dv; ++d) o[d] = T(ag[d] * inv);
    }
}

#if defined(__x86_64__)
// instruction sets, not "arch=" clones: GCC dispatches those by CPU model (an AMD or a newer Intel
// CPU took the SSE2 default)
#define SP_DECODE_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define SP_DECODE_CLONES
#endif
#define SP_DECODE_RANGE(NAME, T)                                                                          \
    SP_DECODE_CLONES void NAME(const DecodeArgs& a, const T* query, const T* k_pool, const T* v_pool,     \
                               const int64_t* slots, const int64_t* ctx_lens, int64_t heads_kv,          \
                               int64_t begin, int64_t end, DecodeScratch& s, T* out) {                   \
        for (int64_t i = begin; i < end; ++i)                                                             \
            decode_one<T>(a, query, k_pool, v_pool, slots, ctx_lens[i / heads_kv], i / heads_kv,          \
                          i % heads_kv, s, out);                                                          \
    }
SP_DECODE_RANGE(decode_range_bf16, at::BFloat16)
SP_DECODE_RANGE(decode_range_f16, at::Half)
SP_DECODE_RANGE(decode_range_f32, float)

using DecodeItemFn = void (*)(const DecodeArgs&, const at::BFloat16*, const at::BFloat16*, const at::BFloat16*,
                              const int64_t*, int64_t, int64_t, int64_t, float*, at::BFloat16*);

#if SP_Q8_X86  // x86-64 with GCC or clang (q8_matmul.h), which defines SP_AVX512
// The bf16 rows with AVX-512 (widths of 64 or 128): the same math with explicit vectors, the scores
// of 16 keys reduced together (transpose_sum16), exp by the same polynomial per lane.

SP_AVX512 inline __m512 bf16x16_to_f32(const at::BFloat16* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

SP_AVX512 inline __m512 exp_nonpositive16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

// lane i of the result = the sum of v[i]'s 16 lanes (a fixed tree: pairs within 128-bit lanes, then
// across them), 45 instructions for 16 dot products instead of 16 reductions of ~8 dependent steps.
SP_AVX512 inline __m512 transpose_sum16(const __m512* v) {
    __m512 a[8], b[4];
    for (int i = 0; i < 8; ++i)
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; ++i) {
        const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
        b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    const __m512 c0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_f32x4(b[0], b[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 c1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_f32x4(b[2], b[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(c0, c1, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(c0, c1, _MM_SHUFFLE(3, 1, 3, 1)));
}

// One (row, KV head) item with G query heads and K/V widths of NK/NV vectors of 16: queries and
// accumulators stay in registers; scores 16 keys at a time.
template <int G, int NK, int NV>
SP_AVX512 void decode_item_bf16_avx512(const DecodeArgs& a, const at::BFloat16* query, const at::BFloat16* k_pool,
                                       const at::BFloat16* v_pool, const int64_t* row_slots, int64_t ctx, int64_t b,
                                       int64_t h, float* sc, at::BFloat16* out) {
    __m512 q[G][NK];
    for (int g = 0; g < G; ++g) {
        const at::BFloat16* qr = query + b * a.q_row_stride + (h * G + g) * a.q_head_stride;
        for (int c = 0; c < NK; ++c) q[g][c] = bf16x16_to_f32(qr + c * kLanes);
    }
    // key j's K and V rows of this head
    const auto k_row = [&](int64_t j) { return k_pool + row_slots[j] * a.k_slot_stride + h * a.k_head_stride; };
    const auto v_row = [&](int64_t j) { return v_pool + row_slots[j] * a.v_slot_stride + h * a.v_head_stride; };
    for (int64_t j = 0; j < std::min<int64_t>(ctx, SP_ATTN_PREFETCH); ++j) {  // the first keys' rows
        prefetch_values(k_row(j), NK * kLanes);
        prefetch_values(v_row(j), NV * kLanes);
    }
    const __m512 scale = _mm512_set1_ps(a.scale);
    alignas(64) __m512 dots[G][kLanes];
    for (int64_t j0 = 0; j0 < ctx; j0 += kLanes) {  // scores
        const int n = static_cast<int>(std::min<int64_t>(kLanes, ctx - j0));
        for (int jj = 0; jj < n; ++jj) {
            if (j0 + jj + SP_ATTN_PREFETCH < ctx) prefetch_values(k_row(j0 + jj + SP_ATTN_PREFETCH), NK * kLanes);
            const at::BFloat16* kr = k_row(j0 + jj);
            __m512 k[NK];
            for (int c = 0; c < NK; ++c) k[c] = bf16x16_to_f32(kr + c * kLanes);
            for (int g = 0; g < G; ++g) {
                __m512 d = _mm512_mul_ps(q[g][0], k[0]);
                for (int c = 1; c < NK; ++c) d = _mm512_fmadd_ps(q[g][c], k[c], d);
                dots[g][jj] = d;
            }
        }
        for (int g = 0; g < G; ++g) {
            for (int jj = n; jj < kLanes; ++jj) dots[g][jj] = _mm512_setzero_ps();
            const __mmask16 keep = static_cast<__mmask16>((1u << n) - 1u);
            _mm512_mask_storeu_ps(sc + g * a.keys + j0, keep, _mm512_mul_ps(transpose_sum16(dots[g]), scale));
        }
    }
    float inv[G];
    for (int g = 0; g < G; ++g) {  // softmax numerators in place
        float* row = sc + g * a.keys;
        __m512 mv = _mm512_set1_ps(row[0]);
        int64_t j = 0;
        for (; j + kLanes <= ctx; j += kLanes) mv = _mm512_max_ps(mv, _mm512_loadu_ps(row + j));
        const __mmask16 tail = static_cast<__mmask16>((1u << (ctx - j)) - 1u);
        mv = _mm512_mask_max_ps(mv, tail, mv, _mm512_maskz_loadu_ps(tail, row + j));
        const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
        __m512 total = _mm512_setzero_ps();
        for (j = 0; j + kLanes <= ctx; j += kLanes) {
            const __m512 e = exp_nonpositive16(_mm512_sub_ps(_mm512_loadu_ps(row + j), m));
            _mm512_storeu_ps(row + j, e);
            total = _mm512_add_ps(total, e);
        }
        if (tail) {
            const __m512 e = exp_nonpositive16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, row + j), m));
            _mm512_mask_storeu_ps(row + j, tail, e);
            total = _mm512_mask_add_ps(total, tail, total, e);
        }
        inv[g] = 1.0f / _mm512_reduce_add_ps(total);
    }
    __m512 acc[G][NV];
    for (int g = 0; g < G; ++g)
        for (int c = 0; c < NV; ++c) acc[g][c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < ctx; ++j) {  // numerators @ v
        if (j + SP_ATTN_PREFETCH < ctx) prefetch_values(v_row(j + SP_ATTN_PREFETCH), NV * kLanes);
        const at::BFloat16* vr = v_row(j);
        __m512 v[NV];
        for (int c = 0; c < NV; ++c) v[c] = bf16x16_to_f32(vr + c * kLanes);
        for (int g = 0; g < G; ++g) {
            const __m512 p = _mm512_set1_ps(sc[g * a.keys + j]);
            for (int c = 0; c < NV; ++c) acc[g][c] = _mm512_fmadd_ps(p, v[c], acc[g][c]);
        }
    }
    for (int g = 0; g < G; ++g) {
        at::BFloat16* o = out + b * a.out_row_stride + (h * G + g) * a.out_head_stride;
        const __m512 w = _mm512_set1_ps(inv[g]);
        for (int c = 0; c < NV; ++c) {
            alignas(64) float tmp[kLanes];
            _mm512_store_ps(tmp, _mm512_mul_ps(acc[g][c], w));
            for (int l = 0; l < kLanes; ++l) o[c * kLanes + l] = at::BFloat16(tmp[l]);
        }
    }
}

template <int N>
DecodeItemFn decode_item_for(int64_t groups) {  // groups 1..8 with widths of N vectors
    switch (groups) {
        case 1: return decode_item_bf16_avx512<1, N, N>;
        case 2: return decode_item_bf16_avx512<2, N, N>;
        case 3: return decode_item_bf16_avx512<3, N, N>;
        case 4: return decode_item_bf16_avx512<4, N, N>;
        case 5: return decode_item_bf16_avx512<5, N, N>;
        case 6: return decode_item_bf16_avx512<6, N, N>;
        case 7: return decode_item_bf16_avx512<7, N, N>;
        case 8: return decode_item_bf16_avx512<8, N, N>;
        default: return nullptr;
    }
}

// The AVX-512 item kernel for these shapes (bf16, Dk == Dv in {64, 128}, 1-8 query heads a KV
// head), or nullptr: the generic loops serve.
DecodeItemFn bf16_avx512_item(int64_t groups, int64_t dk, int64_t dv) {
    if (!__builtin_cpu_supports("avx512f") || dk != dv) return nullptr;
    if (dk == 64) return decode_item_for<4>(groups);
    if (dk == 128) return decode_item_for<8>(groups);
    return nullptr;
}
#else
DecodeItemFn bf16_avx512_item(int64_t, int64_t, int64_t) { return nullptr; }
#endif

template <typename T, typename Range>
void run_decode(Range range, const DecodeArgs& a, const at::Tensor& q, const at::Tensor& k_pool,
                const at::Tensor& v_pool, const at::Tensor& slots, const at::Tensor& ctx_lens, int64_t heads_kv,
                at::Tensor& out) {
    const int64_t items = q.size(0) * heads_kv;
    // about 32k multiply-adds a task: one row of SmolLM2-135M's 3 KV heads at ~60 keys each
    const int64_t work = std::max<int64_t>(1, a.keys * a.groups * (a.dk_pad + a.dv_pad));
    const int64_t grain = std::max<int64_t>(1, 32768 / work);
    const T* qp = q.const_data_ptr<T>();
    const T* kp = k_pool.const_data_ptr<T>();
    const T* vp = v_pool.const_data_ptr<T>();
    const int64_t* sp = slots.const_data_ptr<int64_t>();
    const int64_t* cp = ctx_lens.const_data_ptr<int64_t>();
    T* op = out.mutable_data_ptr<T>();
    // OpenMP directly, as the other kernels here, not at::parallel_for: its inlined first-call
    // initialisation (a thread_local flag of this library's own) would set the calling thread's
    // OpenMP count to the process-wide value of the last torch.set_num_threads call, which in the
    // server is the embedding worker's 1 (the engine then decoded on one thread, 1.5x slower).
    const int64_t tasks = (items + grain - 1) / grain;
    const int threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), tasks));
    if (threads <= 1 || omp_in_parallel()) {
        DecodeScratch s(a.groups, a.dk_pad, a.dv_pad, a.keys);
        range(a, qp, kp, vp, sp, cp, heads_kv, 0, items, s, op);
        return;
    }
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), n = omp_get_num_threads();
        const int64_t begin = items * t / n, end = items * (t + 1) / n;
        if (begin < end) {
            DecodeScratch s(a.groups, a.dk_pad, a.dv_pad, a.keys);
            range(a, qp, kp, vp, sp, cp, heads_kv, begin, end, s, op);
        }
    }
}

// out [B, H, Dv] (query's dtype) = attention of query [B, H, Dk] (the step's decode rows, RoPE
// applied, its last dim contiguous) over each row's first context_lens[b] slots of slots [B, L]
// in key_pool [S, H_kv, Dk] and value_pool [S, H_kv, Dv] (H a multiple of H_kv; the new token's
// K/V already written).
at::Tensor paged_decode_attention(const at::Tensor& query_in, const at::Tensor& key_pool,
                                  const at::Tensor& value_pool, const at::Tensor& slots_in,
                                  const at::Tensor& context_lens_in, double scale) {
    TORCH_CHECK(query_in.dim() == 3 && key_pool.dim() == 3 && value_pool.dim() == 3 && slots_in.dim() == 2 &&
                    context_lens_in.dim() == 1,
                "paged_decode_attention takes query [B, H, Dk], key_pool [S, H_kv, Dk], value_pool "
                "[S, H_kv, Dv], slots [B, L] and context_lens [B]");
    const auto dtype = query_in.scalar_type();
    TORCH_CHECK(key_pool.scalar_type() == dtype && value_pool.scalar_type() == dtype &&
                    (dtype == at::kBFloat16 || dtype == at::kHalf || dtype == at::kFloat),
                "paged_decode_attention takes query and pools of one dtype (bfloat16, float16 or float32), "
                "not ", dtype, ", ", key_pool.scalar_type(), ", ", value_pool.scalar_type());
    TORCH_CHECK(slots_in.scalar_type() == at::kLong && context_lens_in.scalar_type() == at::kLong,
                "paged_decode_attention takes int64 slots and context_lens");
    const int64_t rows = query_in.size(0), heads = query_in.size(1), dk = query_in.size(2);
    const int64_t num_slots = key_pool.size(0), heads_kv = key_pool.size(1), dv = value_pool.size(2);
    const int64_t keys = slots_in.size(1);
    TORCH_CHECK(heads_kv > 0 && heads % heads_kv == 0 && key_pool.size(2) == dk && value_pool.size(0) == num_slots &&
                    value_pool.size(1) == heads_kv && slots_in.size(0) == rows && context_lens_in.size(0) == rows,
                "paged_decode_attention: shapes do not fit (query ", query_in.sizes(), ", key_pool ",
                key_pool.sizes(), ", value_pool ", value_pool.sizes(), ", slots ", slots_in.sizes(),
                ", context_lens ", context_lens_in.sizes(), ")");
    TORCH_CHECK(key_pool.stride(2) == 1 && value_pool.stride(2) == 1, "paged_decode_attention takes pools whose "
                "last dim is contiguous");
    const at::Tensor query = query_in.stride(2) == 1 ? query_in : query_in.contiguous();
    const at::Tensor slots = slots_in.stride(1) == 1 ? slots_in : slots_in.contiguous();
    const at::Tensor ctx_lens = context_lens_in.contiguous();
    const int64_t* sp = slots.const_data_ptr<int64_t>();
    const int64_t* cp = ctx_lens.const_data_ptr<int64_t>();
    for (int64_t b = 0; b < rows; ++b) {
        TORCH_CHECK(cp[b] >= 1 && cp[b] <= keys, "paged_decode_attention: context_lens[", b, "] = ", cp[b],
                    " is not in [1, ", keys, "]");
        for (int64_t j = 0; j < cp[b]; ++j) {
            const int64_t slot = sp[b * slots.stride(0) + j];
            TORCH_CHECK(slot >= 0 && slot < num_slots, "paged_decode_attention: slot ", slot, " (row ", b,
                        ", key ", j, ") is outside the pools' ", num_slots, " slots");
        }
    }
    at::Tensor out = at::empty({rows, heads, dv}, query.options());
    if (rows == 0) return out;
    const int64_t groups = heads / heads_kv;
    DecodeArgs a{groups, dk, dv, (dk + kLanes - 1) / kLanes * kLanes, (dv + kLanes - 1) / kLanes * kLanes,
                 query.stride(0), query.stride(1), out.stride(0), out.stride(1),
                 key_pool.stride(0), key_pool.stride(1), value_pool.stride(0), value_pool.stride(1),
                 slots.stride(0), keys, static_cast<float>(scale)};
    const DecodeItemFn item = dtype == at::kBFloat16 ? bf16_avx512_item(groups, dk, dv) : nullptr;
    if (item != nullptr) {
        const auto range = [item](const DecodeArgs& a, const at::BFloat16* q, const at::BFloat16* k,
                                  const at::BFloat16* v, const int64_t* sl, const int64_t* cl, int64_t hkv,
                                  int64_t begin, int64_t end, DecodeScratch& s, at::BFloat16* o) {
            for (int64_t i = begin; i < end; ++i)
                item(a, q, k, v, sl + (i / hkv) * a.slot_stride, cl[i / hkv], i / hkv, i % hkv, s.scores.data(), o);
        };
        run_decode<at::BFloat16>(range, a, query, key_pool, value_pool, slots, ctx_lens, heads_kv, out);
    } else if (dtype == at::kBFloat16) {
        run_decode<at::BFloat16>(decode_range_bf16, a, query, key_pool, value_pool, slots, ctx_lens, heads_kv, out);
    } else if (dtype == at::kHalf) {
        run_decode<at::Half>(decode_range_f16, a, query, key_pool, value_pool, slots, ctx_lens, heads_kv, out);
    } else {
        run_decode<float>(decode_range_f32, a, query, key_pool, value_pool, slots, ctx_lens, heads_kv, out);
    }
    return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(streamproxy, CPU, m) {
    m.impl("amx_int4_mm", &amx_int4_mm);
    m.impl("amx_int8_mm", &amx_int8_mm);
    m.impl("q8_matmul", &q8_matmul);
    m.impl("q8_matmul_split", &q8_matmul_split);
    m.impl("paged_decode_attention", &paged_decode_attention);
}
