"""Weight-only quantized linears (int4 / int8 groups on torch's packed int4 kernels) and GGUF
``Q4_0`` / ``Q4_1`` / ``Q4_K`` / ``Q8_0`` / ``Q5_0`` / ``IQ4_NL`` / ``IQ4_XS`` tensors loaded into them
at their own precision.

- :mod:`proxy.quant.kernels`: the torch ops per device, the CPU BF16 check.
- :mod:`proxy.quant.linear`: :class:`PackedLinear` and float -> int4 / int8 planes.
- :mod:`proxy.quant.apply`: swap a model's ``nn.Linear`` modules (``--quantization int4|int8``).
- :mod:`proxy.quant.fuse`: q/k/v and gate/up packed siblings run as one matmul.
- :mod:`proxy.quant.skinny`: dense fp32 CPU linears compute calls of few rows as ``W @ x^T``.
- :mod:`proxy.quant.gguf_file`: a GGUF file's tensor index (memory-mapped) and tensor names.
- :mod:`proxy.quant.gguf_blocks`: a GGUF's own blocks -> packed layers (``--quantization auto``).
- :mod:`proxy.quant.gguf_types`: the block types beyond ``Q4_0`` / ``Q4_1`` / ``Q8_0`` decoded.
- :mod:`proxy.quant.embedding`: a GGUF's ``Q8_0`` token embedding served from its int8 codes.
"""

from proxy.quant.apply import describe, quantize_linears
from proxy.quant.gguf_blocks import load_gguf_linears
from proxy.quant.kernels import cpu_bf16_flags, is_fast, kernel_dtype
from proxy.quant.linear import PackedLinear

__all__ = ["PackedLinear", "cpu_bf16_flags", "describe", "is_fast", "kernel_dtype", "load_gguf_linears",
           "quantize_linears"]
