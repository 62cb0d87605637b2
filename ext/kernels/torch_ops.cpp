// The CPU kernels of the torch ops streamproxy::amx_int4_mm and streamproxy::q8_matmul in C++, built
// into proxy.quant._torch_ops against the installed torch and loaded by proxy.quant.kernels, which
// defines the ops' schemas; proxy/quant/kernels.py says why (a compiled decode step calls them ~120
// times a step without taking the GIL). The kernels are the headers' (amx_int4.h, q8_matmul.h); each
// call checks its arguments (the Python kernels they replace trusted the compiled graph's shapes).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

extern "C" {
#include "amx_int4.h"
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
    TORCH_CHECK(sp_amx_available(), "the AMX int4 kernel does not run on this CPU");
    at::Tensor x = x_in.contiguous();
    at::Tensor out = at::empty({m, n}, x.options());
    if (m && n) {
        const auto* sz = static_cast<const uint16_t*>(scales_and_zeros.const_data_ptr());
        sp_amx_int4_matmul(static_cast<const uint16_t*>(x.const_data_ptr()), m, k,
                           static_cast<const uint8_t*>(tiles.const_data_ptr()), sz,
                           sz + blocks * (k / group_size) * SP_AMX_NBLOCK, n, group_size,
                           static_cast<uint16_t*>(out.mutable_data_ptr()), at::get_num_threads());
    }
    return out;
}

// y fp32 [M, N] = x fp32 [M, K] @ (codes int8 [N, K] * scales fp32 [N, K / 32])^T with instruction set
// isa (SP_Q8_AVX2 or SP_Q8_AVX512).
at::Tensor q8_matmul(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& scales, int64_t isa) {
    TORCH_CHECK(x_in.dim() == 2 && codes.dim() == 2 && scales.dim() == 2 && x_in.scalar_type() == at::kFloat &&
                    codes.scalar_type() == at::kChar && scales.scalar_type() == at::kFloat,
                "q8_matmul takes fp32 x [M, K], int8 codes [N, K] and fp32 scales [N, K / 32]");
    const int64_t m = x_in.size(0), k = x_in.size(1), n = codes.size(0);
    TORCH_CHECK(k % SP_Q8_GROUP == 0 && codes.size(1) == k && scales.size(0) == n &&
                    scales.size(1) == k / SP_Q8_GROUP,
                "q8_matmul: shapes do not fit (x ", x_in.sizes(), ", codes ", codes.sizes(), ", scales ",
                scales.sizes(), ")");
    TORCH_CHECK(codes.is_contiguous() && scales.is_contiguous(), "q8_matmul takes contiguous codes and scales");
    TORCH_CHECK((isa == SP_Q8_AVX2 || isa == SP_Q8_AVX512) && isa <= sp_q8_best_isa(),
                "q8_matmul: instruction set ", isa, " does not run on this CPU");
    at::Tensor x = x_in.contiguous();
    at::Tensor out = at::empty({m, n}, x.options());
    if (m && n)
        sp_q8_matmul(x.const_data_ptr<float>(), m, k, codes.const_data_ptr<int8_t>(), scales.const_data_ptr<float>(),
                     n, out.mutable_data_ptr<float>(), at::get_num_threads(), static_cast<int>(isa));
    return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(streamproxy, CPU, m) {
    m.impl("amx_int4_mm", &amx_int4_mm);
    m.impl("q8_matmul", &q8_matmul);
}
