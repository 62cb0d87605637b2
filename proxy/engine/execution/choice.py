"""What the engine runs, chosen once before the model loads and handed to the code that acts on it.

:func:`choose_execution` is the one function that reads the inputs of the choice: the settings
(``enforce_eager``, ``compile_decode``, ``dense_prefill``), the device, the environment-only switches
(:func:`proxy.settings.execution_switches`) and this machine and build (:class:`MachineProbe`:
``/proc/cpuinfo``'s flags, which compiled extensions loaded). Its :class:`ExecutionChoice` goes to the
loader (its :class:`~proxy.quant.linear_kernels.LinearKernels` part: ``proxy.engine.loading``) and to
the model runner (the step: which :class:`~proxy.engine.execution.decode_runner.DecodeRunner`; the
:class:`PrefillPlan`), and is hashed into the compiled decode step's and the self-check's keys
(``proxy.engine.execution.runtime_key``). What the built engine then runs, with the paths not taken and why,
is described by ``proxy.engine.execution.plan.describe_execution`` (the log line, ``/server_info``).

Decided later, where the facts are: whether a model's layers allow the compiled step (packed
linears, no sliding windows: ``proxy.engine.execution.compiled_step.why_not_compiled``), whether a layer's
shape takes an AMX kernel (``proxy.quant.amx_int4.why_not``, ``proxy.quant.amx_int8.why_not``), and
per call, how many rows take the Q8_0 kernel's GEMM path or the skinny fp32 path
(``proxy.quant.int8_linear``, ``proxy.quant.skinny``).

:class:`PrefillPlan`: prompt tokens through dense copies of the packed linears in calls of a fixed
row count (``proxy.quant.dense_prefill``). The model runner holds it (None when prompt tokens take
the packed kernels like every other token); the engine core hands its parts to the scheduler (a
prefill chunk below one call's rows costs a whole call) and the block manager (output tokens' KV
blocks kept apart from prompt blocks in the prefix cache), so neither they nor the core import the
quantization package for it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from proxy.quant.linear_kernels import LinearKernels
from proxy.settings import ExecutionSwitches, Settings, execution_switches

#: the CPU features the kernels are chosen by, as ``/proc/cpuinfo`` names them
KERNEL_CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


@dataclass(frozen=True)
class PrefillPlan:
    """Prompt tokens through dense copies of the packed linears (module docstring).

    Attributes:
        dtype: the copies' compute dtype, ``"bfloat16"`` or ``"float32"``.
        call_rows: rows of every dense call (``proxy.quant.dense_prefill.CALL_ROWS``).
        rows_by_position: a prompt token at position ``p`` sits in row ``p % call_rows`` of its
            call (bf16: oneDNN's row bits depend on the row's place); False: the step's prompt
            tokens in order (fp32: ``proxy.quant.dense_prefill.plan_rows``' ``by_position``).
        copies: False: no copies; the AMX int4 layers' prompt-row kernel computes the prompt tokens
            (``proxy.quant.amx_int4.amx_int4_prompt_mm``, any row count: ``call_rows`` 1).
    """

    dtype: str
    call_rows: int
    rows_by_position: bool
    copies: bool = True

    @classmethod
    def of(cls, dtype: torch.dtype) -> PrefillPlan:
        """The plan of copies computing in ``dtype`` (bf16 or fp32)."""
        from proxy.quant.dense_prefill import CALL_ROWS

        return cls(str(dtype).removeprefix("torch."), CALL_ROWS, dtype != torch.float32)

    @classmethod
    def prompt_kernel(cls) -> PrefillPlan:
        """The plan of the AMX int4 prompt-row kernel (no copies; a row's bits do not depend on the
        call, so any chunk size and the step's order)."""
        return cls("bfloat16", 1, False, copies=False)


def prefill_plan_of(model: nn.Module) -> PrefillPlan | None:
    """The :class:`PrefillPlan` of a built model: None when no packed linear holds a dense copy nor
    takes the prompt-row kernel (``proxy.quant.apply.use_prompt_tiles``)."""
    from proxy.quant.dense_prefill import dense_dtype_of

    dtype = dense_dtype_of(model)
    if dtype is not None:
        return PrefillPlan.of(dtype)
    if any(getattr(m, "prompt_tiles", False) for m in model.modules()):
        return PrefillPlan.prompt_kernel()
    return None


@dataclass(frozen=True)
class MachineProbe:
    """What this machine and build offer the kernels (read once: :meth:`read`).

    Attributes:
        cpu_flags: which of :data:`KERNEL_CPU_FLAGS` the CPU has (``/proc/cpuinfo``).
        amx_int4: None when the int4 kernel (``proxy.quant.amx_int4``: AMX or AVX2) is built and runs here,
            else why not.
        amx_int8: the same for the AMX int8 kernel (``proxy.quant.amx_int8``).
        q8_isa: the instruction set the Q8_0 kernel runs (``"avx512"``, ``"avx2"``), or None (not
            built, or a CPU without AVX2 and FMA).
        op_kernels: None when the C++ kernels of the ``streamproxy::`` ops are loaded, else why not
            (``STREAMPROXY_TORCH_OPS=0``, not built, built against another torch).
        hot_path: ``"compiled"`` or ``"python"`` (the detokenizer / stop checker / SSE framer twin).
    """

    cpu_flags: tuple[str, ...]
    amx_int4: str | None
    q8_isa: str | None
    op_kernels: str | None
    hot_path: str
    amx_int8: str | None = "not probed"
    #: the int4 kernel's variant where it runs (``proxy.quant.amx_int4.kernel_isa``)
    int4_isa: str | None = "amx"

    @classmethod
    def read(cls) -> MachineProbe:
        """Probe this process: the CPU's flags and which extensions loaded."""
        from proxy import hotpath
        from proxy.quant import amx_int4, amx_int8, int8_linear, kernels

        flags = kernels.cpu_flags()
        amx = None if amx_int4.kernel_available() else (amx_int4.KERNEL_IMPORT_ERROR or "neither AMX-BF16 "
                                                                                   "nor AVX2 here")
        amx8 = None if amx_int8.kernel_available() else (amx_int8.KERNEL_IMPORT_ERROR or "no AMX-BF16 here")
        return cls(cpu_flags=tuple(f for f in KERNEL_CPU_FLAGS if f in flags), amx_int4=amx,
                   q8_isa=int8_linear.KERNEL_ISA, op_kernels=kernels.TORCH_OPS_ERROR,
                   hot_path="compiled" if hotpath.IS_COMPILED else "python", amx_int8=amx8,
                   int4_isa=amx_int4.kernel_isa())


@dataclass(frozen=True)
class ExecutionChoice:
    """What the engine runs, chosen before the model loads (module docstring).

    Attributes:
        device: ``"cpu"`` or ``"cuda:N"``.
        step: the decode runner: ``"compiled"`` (the CPU's compiled step, where the model's layers
            allow it, else eager), ``"cuda_graphs"`` or ``"eager"``.
        linears: the kernels the loader builds the linears for.
        prefill: prompt tokens through dense copies of the packed linears, or None.
        switches: the environment-only switches in force.
        probe: the machine and build.
    """

    device: str
    step: str
    linears: LinearKernels
    prefill: PrefillPlan | None
    switches: ExecutionSwitches
    probe: MachineProbe

    def key(self) -> dict[str, Any]:
        """The choice as JSON-able values (what compiled and verified results depend on)."""
        return {"device": self.device, "step": self.step, "amx_int4": self.linears.amx_int4,
                "amx_int8": self.linears.amx_int8,
                "prefill": None if self.prefill is None else asdict(self.prefill),
                "switches": asdict(self.switches), "probe": asdict(self.probe)}


def choose_execution(settings: Settings, device: torch.device, *, switches: ExecutionSwitches | None = None,
                     probe: MachineProbe | None = None) -> ExecutionChoice:
    """The engine's :class:`ExecutionChoice` for ``device`` (module docstring).

    Args:
        switches, probe: default :func:`proxy.settings.execution_switches` and
            :meth:`MachineProbe.read` (tests pass others).
    """
    from proxy.engine.execution.compiled_step import why_not_compiled_by

    switches = execution_switches() if switches is None else switches
    probe = MachineProbe.read() if probe is None else probe
    if device.type == "cuda":
        step = "eager" if settings.enforce_eager else "cuda_graphs"
    else:
        step = "eager" if why_not_compiled_by(settings) is not None else "compiled"
    amx = switches.amx_int4 and device.type == "cpu" and probe.amx_int4 is None
    # one switch turns both AMX kernels off
    amx8 = switches.amx_int4 and device.type == "cpu" and probe.amx_int8 is None
    linears = LinearKernels.choose(settings.dense_prefill, device, amx, _copy_bytes(settings, device), amx8,
                                   amx_prompt=amx and probe.int4_isa == "amx")
    prefill = (PrefillPlan.of(linears.dense_prefill) if linears.dense_prefill is not None
               else PrefillPlan.prompt_kernel() if linears.prompt_tiles else None)
    return ExecutionChoice(device=str(device), step=step, linears=linears, prefill=prefill,
                           switches=switches, probe=probe)


def _copy_bytes(settings: Settings, device: torch.device) -> int | None:
    """What the dense prefill copies of the served GGUF would take when the default decides them
    (:func:`proxy.quant.linear_kernels.gguf_copy_bytes`); None: set explicitly, not the CPU, or not
    a GGUF."""
    if settings.dense_prefill is not None or device.type != "cpu":
        return None
    from proxy.models.source import gguf_of
    from proxy.quant.int8_linear import kernel_available
    from proxy.quant.linear_kernels import gguf_copy_bytes

    path = gguf_of(settings)
    return None if path is None else gguf_copy_bytes(path, settings.quantization, kernel_available())
