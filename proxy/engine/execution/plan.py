"""The execution plan: which kernels serve each part of a step on this machine, and why the others
do not (:class:`ExecutionPlan`, built by :func:`describe_execution` once an engine is built, from
the :class:`~proxy.engine.execution.choice.ExecutionChoice` made before the model loaded and what was built).

What is chosen, and from what (``docs/execution.md`` has the table with the switches and where each
path is measured):

- **the step**: ``compiled`` (the CPU's ahead-of-time compiled decode step,
  ``proxy.engine.execution.compiled_step``: every token past a prompt), ``cuda_graphs`` (captured pure-decode
  steps on CUDA, ``proxy.engine.execution.decode_graphs``) or ``eager``; prompt tokens always run eager;
- **decode attention**: ``pools_op`` (``streamproxy::paged_decode_attention`` over the pools, inside
  the compiled step, where the C++ op kernels are loaded) or ``gather_sdpa`` (a gather of each row's
  keys and ``scaled_dot_product_attention``); prefill attention is always ``gather_sdpa``;
- **linears**, counted by kernel: ``int4 amx`` / ``int4 avx2`` (``proxy.quant.amx_int4``'s variants),
  ``int4 torch`` (torch's packed int4 kernel), ``int8 amx`` (``proxy.quant.amx_int8``, bf16 activations),
  ``int8 q8 <isa>`` (``proxy.quant.int8_linear``'s Q8_0 kernel; both int8 kernels' names end in ``split
  scales`` where a layer's group-16 scales are held split) or ``int8 q8 reference``, ``skinny fp32``
  (``proxy.quant.skinny``), ``dense``;
- **prompt tokens' linears**: dense copies of the packed weights (``proxy.quant.dense_prefill``) in
  bf16 or fp32, the AMX kernels' prompt-row variants where the copies would take too much memory
  (``amx prompt kernels``: ``amx_int4_prompt_mm``, ``amx_int8_prompt_mm`` of ``proxy.quant``), or the
  packed kernels;
- **rotary positions**: ``1-d`` (each token's cache position) or ``m-rope`` (Qwen2-VL's three rows:
  prompt tokens of a request with images run eager with three rows, every other token with its
  position plus its prompt's rope delta on whatever path the step takes;
  ``proxy.engine.execution.mrope``);
- **the op kernels**: the C++ kernels of the ``streamproxy::`` ops or their Python kernels
  (``STREAMPROXY_TORCH_OPS``), and the hot path's compiled or pure-Python twin
  (``STREAMPROXY_PURE_PYTHON``).

The plan is what the engine was built with: a compiled step that fails later is dropped (logged)
and the steps run eager from then on.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

from proxy.settings import Settings

if TYPE_CHECKING:
    from proxy.engine.execution.model_runner import ModelRunner


@dataclass(frozen=True)
class ExecutionPlan:
    """What serves each part of a step (module docstring).

    Attributes:
        device: ``"cpu"`` or ``"cuda:N"``; dtype: the activations' (``"bfloat16"``).
        cpu_flags: which of ``proxy.engine.execution.choice.KERNEL_CPU_FLAGS`` this CPU has (CPU only).
        step: ``"compiled"``, ``"cuda_graphs"`` or ``"eager"``.
        decode_attention: ``"pools_op"`` or ``"gather_sdpa"``.
        linears: linear layers by kernel (``{"int4 amx": 210, "int8 q8 avx512": 1, ...}``).
        prompt_linears: ``"dense bfloat16 copies"``, ``"dense float32 copies"`` or ``"as decode"``.
        op_kernels: ``"c++"`` or ``"python"`` (the ``streamproxy::`` ops).
        hot_path: ``"compiled"`` or ``"python"`` (detokenizer, stop strings, SSE framing).
        off: each path not taken -> why.
        rope_positions: ``"1-d"`` or ``"m-rope"``.
        image_attention: ``"causal"`` or ``"bidirectional blocks"`` (an image's tokens see their
            whole image during prefill: ``proxy.engine.execution.image_blocks``).
    """

    device: str
    dtype: str
    cpu_flags: tuple[str, ...]
    step: str
    decode_attention: str
    linears: dict[str, int]
    prompt_linears: str
    op_kernels: str
    hot_path: str
    off: dict[str, str]
    rope_positions: str = "1-d"
    image_attention: str = "causal"

    def summary(self) -> str:
        """The one log line: ``execution: step compiled, decode attention pools_op, linear modules
        (after fusion) int4 amx x120 + int8 q8 avx512 x1, prompt tokens dense bfloat16 copies, op
        kernels c++, detokenizer/SSE hot path compiled (cpu: avx2 avx512f avx512_bf16 amx_bf16,
        bfloat16)``, with ``, rotary positions m-rope`` and ``, image tokens bidirectional blocks`` after
        the decode attention for such models, then ``; not taken: PATH: WHY; ...`` when a path is off."""
        linears = " + ".join(f"{kind} x{n}" for kind, n in self.linears.items()) or "none"
        where = f"cpu: {' '.join(self.cpu_flags) or 'no avx2'}" if self.device == "cpu" else self.device
        off = "; ".join(f"{path}: {why}" for path, why in self.off.items())
        rope = "" if self.rope_positions == "1-d" else f", rotary positions {self.rope_positions}"
        if self.image_attention != "causal":
            rope += f", image tokens {self.image_attention}"
        return (f"execution: step {self.step}, decode attention {self.decode_attention}{rope}, linear "
                f"modules (after fusion) {linears}, prompt tokens {self.prompt_linears}, op kernels "
                f"{self.op_kernels}, detokenizer/SSE hot path {self.hot_path} ({where}, {self.dtype})"
                + (f"; not taken: {off}" if off else ""))

    def as_dict(self) -> dict[str, Any]:
        """The plan as JSON-able fields and its :meth:`summary` (``/server_info``'s and
        ``/health``'s ``"execution"``)."""
        payload = asdict(self)
        payload["cpu_flags"] = list(self.cpu_flags)
        payload["summary"] = self.summary()
        return payload


def _linear_kernel(module: nn.Module) -> str | None:
    """The kernel a linear layer runs (:class:`ExecutionPlan`'s ``linears`` keys), None for others."""
    from proxy.quant import int8_linear
    from proxy.quant.int8_linear import Int8Linear
    from proxy.quant.linear import PackedLinear
    from proxy.quant.skinny import SkinnyLinear

    if isinstance(module, PackedLinear):
        if module.num_planes != 1:
            return "int8 two int4 planes"
        if not module.amx:
            return "int4 torch"
        from proxy.quant import amx_int4

        return f"int4 {amx_int4.kernel_isa()}"
    if isinstance(module, Int8Linear):
        # group-16 scales held split (proxy.quant.split_scales: fewer bytes a step, the same bits)
        split = " split scales" if module.amx_sub is not None or module.sub_scales is not None else ""
        if module.amx:
            return "int8 amx" + split
        if module._mm is int8_linear.q8_matmul:
            return f"int8 q8 {int8_linear.KERNEL_ISA}{split}"
        return "int8 q8 reference"
    if isinstance(module, SkinnyLinear):
        return "skinny fp32"
    if type(module) is nn.Linear:
        return "dense"
    return None


def describe_execution(settings: Settings, model: nn.Module, runner: ModelRunner) -> ExecutionPlan:
    """The plan of an engine built over ``model`` by ``runner`` with ``settings`` (module docstring)."""
    from proxy.engine.execution.compiled_step import why_not_compiled
    from proxy.quant import amx_int4

    device = runner.device
    choice = runner.choice
    probe = choice.probe
    off: dict[str, str] = {}
    step = runner.decode.kind
    if device.type == "cuda":
        if step != "cuda_graphs":
            off["cuda_graphs"] = "--enforce-eager"
    elif step != "compiled":
        off["compiled"] = (why_not_compiled(settings, model, runner.layers)
                           or "compiling or loading it failed (logged)")
    if step == "compiled" and probe.op_kernels is None:
        decode_attention = "pools_op"
    else:
        decode_attention = "gather_sdpa"
        off["pools_op"] = ("runs inside the compiled step only" if step != "compiled"
                           else f"the C++ op kernels are not loaded ({probe.op_kernels})")
    linears = Counter(k for m in model.modules() if (k := _linear_kernel(m)) is not None)
    if linears["int4 torch"] and device.type == "cpu":
        with amx_int4.enabled(choice.switches.amx_int4):  # the layers' rule, under the plan's switch
            why = amx_int4.why_not(16, 32, 32, 1, device, runner.dtype)
        off["int4 amx"] = why or "layer shapes the AMX kernel does not take"
    if any(k.startswith("int8 q8") for k in linears) and device.type == "cpu":
        from proxy.quant import amx_int8

        # one switch for both AMX kernels; on a CPU without AMX why_not says so, not "turned off"
        with amx_int8.enabled(choice.switches.amx_int4):
            why = amx_int8.why_not(16, 32, 32, False, device)
        off["int8 amx"] = why or "layers with zeros or shapes the AMX int8 kernel does not take"
    prefill = runner.prefill_plan
    prompt_linears = ("as decode" if prefill is None else f"dense {prefill.dtype} copies" if prefill.copies
                      else "amx prompt kernels")
    if (prefill is None or not prefill.copies) and any(k.startswith(("int4", "int8")) for k in linears):
        why = choice.linears.why_no_dense_prefill or "off by default on this device"
        off["dense prompt copies"] = "--no-dense-prefill" if settings.dense_prefill is False else why
    if probe.op_kernels is not None:
        off["c++ op kernels"] = probe.op_kernels
    return ExecutionPlan(
        device=str(device), dtype=str(runner.dtype).removeprefix("torch."),
        cpu_flags=probe.cpu_flags if device.type == "cpu" else (), step=step,
        decode_attention=decode_attention, linears=dict(sorted(linears.items())),
        prompt_linears=prompt_linears, op_kernels="c++" if probe.op_kernels is None else "python",
        hot_path=probe.hot_path, off=off, rope_positions="1-d" if runner.mrope is None else "m-rope",
        image_attention="bidirectional blocks" if runner.image_blocks else "causal",
    )

