"""Dense fp32 linears on the CPU computed as ``(W @ x^T)^T`` when a call has few rows.

Why: ``F.linear(x, W)`` with ``x [M, K]`` and ``W [N, K]`` runs ``x @ W^T``; for the few rows of
a decode step (2 <= M <= 128) torch's CPU GEMM is far slower on that form than on ``W @ x^T``, the
same product with the roles of the operands swapped (the large matrix first, the skinny one
second), although both read the weight once. Measured on a 2-core AMD EPYC VM (AVX2, no AVX-512),
torch 2.13, SmolLM2-135M-Instruct dense fp32, a whole engine step, medians of interleaved steps
(``F.linear`` / swapped): decode of 2 sequences 236 / 160 ms, 4: 305 / 150 ms, 8: 308 / 236 ms,
16: 367 / 308 ms, 32: 507 / 424 ms; one sequence 131 / 138 ms (a GEMV either way: left as it is);
prefill of 8 tokens 276 / 189 ms, 64: 730 / 702 ms, 128: 1271 / 1233 ms, 256: 1914 / 2031 ms (so
calls of more than :data:`MAX_SWAPPED_ROWS` rows keep ``F.linear``). The lm_head on 8 sampled rows
alone: 66 / 30 ms. On a 2-core AVX-512 VM an earlier session measured the same direction for one
``[576 -> 1536]``-class layer: 8 rows 580 / 352 us, 16 rows 764 / 553 us, 64 rows 2272 / 1764 us.

Numerics: the swapped product sums the same terms in another order, so a row's bits may differ
from ``F.linear``'s in the last place (as they already differ between row counts of ``F.linear``
itself); the engine makes no batch-invariance promise for dense fp32 models (README).

Only float32 weights on the CPU are swapped: other dtypes and devices (oneDNN bf16, cuBLAS) were
not measured to gain.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

#: calls with more rows than this keep ``F.linear`` (measured: the swapped form stops gaining at 256 rows)
MAX_SWAPPED_ROWS = 128


class SkinnyLinear(nn.Linear):
    """An ``nn.Linear`` whose calls of 2 to :data:`MAX_SWAPPED_ROWS` rows compute ``(W @ x^T)^T``
    (module docstring: why and measured); :func:`use_skinny_linears` turns a model's linears into
    it in place (same module objects, parameters, hooks and state-dict keys).

    Input ``[..., in_features]``, output ``[..., out_features]`` contiguous, both the weight's dtype.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features if self.in_features else 0
        if rows < 2 or rows > MAX_SWAPPED_ROWS:
            return F.linear(x, self.weight, self.bias)
        x_t = x.reshape(rows, self.in_features).t()
        if self.bias is None:
            y = torch.mm(self.weight, x_t)
        else:
            y = torch.addmm(self.bias.unsqueeze(1), self.weight, x_t)
        return y.t().contiguous().view(*x.shape[:-1], self.out_features)


def use_skinny_linears(model: nn.Module) -> int:
    """Turn every plain ``nn.Linear`` of ``model`` whose weight is float32 on the CPU into a
    :class:`SkinnyLinear`, in place (its class changes; nothing else); other modules (packed
    linears, other dtypes or devices) are left alone. Quantization must come first: it replaces
    dense linears (``proxy.quant.apply.named_linears`` sees both kinds).

    Returns:
        how many linears were turned.
    """
    swaps = [
        m for m in model.modules()
        if type(m) is nn.Linear and m.weight.device.type == "cpu" and m.weight.dtype == torch.float32
    ]
    for module in swaps:
        module.__class__ = SkinnyLinear
    return len(swaps)
