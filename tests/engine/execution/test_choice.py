"""The execution choice (``proxy.engine.execution.choice``): made once before the model loads from settings,
device, the environment switches and a machine probe, and acted on by the loader and the runner."""

from __future__ import annotations

import copy
import dataclasses
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from proxy.engine.core import EngineCore
from proxy.engine.execution import compiled_step
from proxy.engine.execution.attention import register
from proxy.engine.execution.choice import ExecutionChoice, MachineProbe, PrefillPlan, choose_execution
from proxy.engine.execution.runtime_key import runtime_inputs
from proxy.quant import amx_int4
from proxy.quant.apply import quantize_linears
from proxy.quant.dense_prefill import dense_weight_dtype
from proxy.quant.linear import PackedLinear, quantize_int4
from proxy.quant.linear_kernels import LinearKernels
from proxy.settings import ExecutionSwitches, Settings, execution_switches

from ..arch_zoo import build_model

CPU = torch.device("cpu")
#: a CPU whose AMX kernels run, with every build loaded
AMX_MACHINE = MachineProbe(cpu_flags=("avx2", "avx512f", "avx512_bf16", "amx_bf16"), amx_int4=None,
                           q8_isa="avx512", op_kernels=None, hot_path="compiled", amx_int8=None)


def test_the_switches_are_read_from_the_environment_by_name() -> None:
    assert execution_switches({}) == ExecutionSwitches(amx_int4=True, torch_ops=True)
    assert execution_switches({"STREAMPROXY_AMX_INT4": "0"}) == ExecutionSwitches(False, True)
    assert execution_switches({"STREAMPROXY_TORCH_OPS": "0"}) == ExecutionSwitches(True, False)
    assert execution_switches({"STREAMPROXY_AMX_INT4": "1", "STREAMPROXY_TORCH_OPS": "yes"}) == \
        ExecutionSwitches(True, True)


@pytest.mark.parametrize(("device", "overrides", "step"), [
    ("cpu", {}, "compiled"),  # where the model allows (packed linears by default): the runner checks
    ("cpu", {"compile_decode": True}, "compiled"),
    ("cpu", {"compile_decode": False}, "eager"),
    ("cpu", {"enforce_eager": True, "compile_decode": True}, "eager"),
    ("cuda", {}, "cuda_graphs"),
    ("cuda", {"enforce_eager": True}, "eager"),
])
def test_the_step_is_chosen_from_the_settings_and_the_device(device: str, overrides: dict[str, Any],
                                                              step: str) -> None:
    choice = choose_execution(Settings(**overrides), torch.device(device), probe=AMX_MACHINE)
    assert choice.step == step and choice.device == device


def test_the_amx_kernel_is_chosen_where_the_switch_and_the_machine_allow() -> None:
    def amx(device: str = "cpu", switches: ExecutionSwitches | None = None,
            probe: MachineProbe = AMX_MACHINE) -> bool:
        return choose_execution(Settings(), torch.device(device), switches=switches or ExecutionSwitches(),
                                probe=probe).linears.amx_int4

    assert amx()
    assert not amx(switches=ExecutionSwitches(amx_int4=False))
    assert not amx(probe=dataclasses.replace(AMX_MACHINE, amx_int4="no AMX-BF16 here"))
    assert not amx("cuda")


def test_the_amx_int8_kernel_is_chosen_under_the_same_switch() -> None:
    def amx8(device: str = "cpu", switches: ExecutionSwitches | None = None,
             probe: MachineProbe = AMX_MACHINE) -> bool:
        choice = choose_execution(Settings(), torch.device(device), switches=switches or ExecutionSwitches(),
                                  probe=probe)
        assert choice.key()["amx_int8"] is choice.linears.amx_int8  # the compiled step's key holds it
        return choice.linears.amx_int8

    assert amx8()
    assert not amx8(switches=ExecutionSwitches(amx_int4=False))
    assert not amx8(probe=dataclasses.replace(AMX_MACHINE, amx_int8="no AMX-BF16 here"))
    assert not amx8("cuda")


def test_int8_layers_built_under_the_loaders_part_take_its_int8_kernel() -> None:
    from proxy.quant import amx_int8
    from proxy.quant.int8_linear import Int8Linear

    def layer() -> Int8Linear:
        codes = torch.randint(-128, 128, (32, 64), dtype=torch.int8)
        return Int8Linear(codes, torch.rand(32, 2), None)

    with LinearKernels(amx_int4=True, dense_prefill=None, amx_int8=False).building():
        assert not layer().amx
    with LinearKernels(amx_int4=False, dense_prefill=None, amx_int8=True).building():
        assert layer().amx is amx_int8.kernel_available()


def test_the_prefill_plan_follows_the_setting() -> None:
    assert choose_execution(Settings(dense_prefill=False), CPU, probe=AMX_MACHINE).prefill is None
    on = choose_execution(Settings(dense_prefill=True), CPU, probe=AMX_MACHINE)
    dtype = dense_weight_dtype(CPU)
    assert on.linears.dense_prefill == dtype
    assert on.prefill == PrefillPlan(str(dtype).removeprefix("torch."), 64, dtype == torch.bfloat16)
    assert choose_execution(Settings(), torch.device("cuda"), probe=AMX_MACHINE).prefill is None


def test_layers_built_under_the_loaders_part_take_its_int4_kernel() -> None:
    def layer() -> PackedLinear:
        return PackedLinear(quantize_int4(torch.randn(32, 64), 32), None, 32, CPU, torch.bfloat16, "int4")

    def built(amx: bool) -> PackedLinear:
        with LinearKernels(amx_int4=amx, dense_prefill=None).building():
            return layer()

    assert not built(False).amx
    assert built(True).amx is amx_int4.kernel_available()
    assert layer().amx is amx_int4.kernel_available()  # the block restored the default
    seen: list[bool] = []
    with LinearKernels(amx_int4=False, dense_prefill=None).building():
        other = threading.Thread(target=lambda: seen.append(layer().amx))  # a load on another thread
        other.start()
        other.join()
        assert not layer().amx
    assert seen == [amx_int4.kernel_available()]


def _engine(model: torch.nn.Module, tmp_path: Path, choice: ExecutionChoice, **overrides: Any) -> EngineCore:
    model.set_attn_implementation(register())
    settings = Settings(block_size=4, num_kv_blocks=32, cache_dir=str(tmp_path), **overrides)
    return EngineCore(model, settings, [2], max_model_len=100, choice=choice)


def test_the_runner_runs_the_step_it_is_handed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_compile(args: Any) -> Any:
        raise AssertionError("compiled although the choice says eager")

    monkeypatch.setattr(compiled_step, "_compile", no_compile)
    eager = choose_execution(Settings(enforce_eager=True), CPU)
    core = _engine(copy.deepcopy(build_model("llama")), tmp_path, eager, compile_decode=True)
    assert core.runner.choice is eager and core.runner.decode.kind == "eager"
    assert core.execution.step == "eager"


def test_the_plan_names_the_switch_that_kept_the_amx_kernel_off(tmp_path: Path) -> None:
    off = choose_execution(Settings(), CPU, switches=ExecutionSwitches(amx_int4=False))
    model = copy.deepcopy(build_model("llama")).to(torch.bfloat16)
    with off.linears.building():
        quantize_linears(model, "int4", 32, torch.bfloat16)
    plan = _engine(model, tmp_path, off, enforce_eager=True).execution
    assert plan.linears == {"dense": 1, "int4 torch": 14}
    assert plan.off["int4 amx"] == "turned off (STREAMPROXY_AMX_INT4=0)"


def test_another_choice_never_shares_a_compiled_step_or_a_self_check() -> None:
    model = build_model("llama")
    on = choose_execution(Settings(), CPU, probe=AMX_MACHINE)
    off = choose_execution(Settings(), CPU, switches=ExecutionSwitches(amx_int4=False), probe=AMX_MACHINE)
    assert runtime_inputs(on.key())["execution"]["amx_int4"] is True
    assert compiled_step.artifact_key(model, on.key()) != compiled_step.artifact_key(model, off.key())
    assert compiled_step.artifact_key(model, on.key()) == compiled_step.artifact_key(model, dict(on.key()))


def test_the_default_makes_no_dense_copies_beyond_the_memory_target(tmp_path: Path, monkeypatch) -> None:
    """Issue 46: ``dense_prefill`` None makes the copies only while they take at most
    ``DEFAULT_COPY_MAX_BYTES`` (estimated from the GGUF's tensor index), and says why it made none;
    ``--dense-prefill`` still makes them."""
    from quant.test_gguf_kquant_model import MIXED, write_gguf

    from proxy.quant import kernels, linear_kernels
    from proxy.quant.linear_kernels import gguf_copy_bytes

    path = tmp_path / "mixed.gguf"
    write_gguf(path, MIXED)
    # Q4_K linears (int4 planes): q [256, 256], k [128, 256], o, gate / up [512, 256] and layer 1's o
    assert gguf_copy_bytes(path, "auto", int8_kernel=True) == 2 * 491520
    # every linear but the lm_head: without the int8 kernel, or quantized from the dense weights
    every = 2 * 1179648
    assert gguf_copy_bytes(path, "auto", int8_kernel=False) == gguf_copy_bytes(path, "int4", True) == every
    assert gguf_copy_bytes(path, "none", True) is None
    assert gguf_copy_bytes(tmp_path / "missing.gguf", "auto", True) is None
    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16", "amx_bf16"}))
    settings = Settings(model=str(path))
    on = choose_execution(settings, CPU, probe=AMX_MACHINE).linears
    assert on.dense_prefill == torch.bfloat16 and on.why_no_dense_prefill == ""
    monkeypatch.setattr(linear_kernels, "DEFAULT_COPY_MAX_BYTES", 2 * 491520 - 1)
    off = choose_execution(settings, CPU, probe=AMX_MACHINE)
    # no copies: the AMX int4 layers' prompt-row kernel takes the prompt tokens instead
    assert off.linears.dense_prefill is None and off.linears.prompt_tiles
    assert off.prefill == PrefillPlan.prompt_kernel() == PrefillPlan("bfloat16", 1, False, copies=False)
    # the int4 kernel's AVX2 variant has no prompt-row kernel: prompt tokens take the decode kernels
    avx2 = choose_execution(settings, CPU, probe=dataclasses.replace(AMX_MACHINE, int4_isa="avx2"))
    assert avx2.linears.amx_int4 and not avx2.linears.prompt_tiles and avx2.prefill is None
    monkeypatch.setenv("STREAMPROXY_AMX_INT4", "0")
    without_amx = choose_execution(settings, CPU, probe=AMX_MACHINE)
    assert without_amx.prefill is None and not without_amx.linears.prompt_tiles
    monkeypatch.delenv("STREAMPROXY_AMX_INT4")
    why = off.linears.why_no_dense_prefill
    assert why.startswith("off by default: the copies would take ") and " MiB, over 0 MiB (" in why, why
    forced = choose_execution(dataclasses.replace(settings, dense_prefill=True), CPU, probe=AMX_MACHINE)
    assert forced.linears.dense_prefill == torch.bfloat16
    assert LinearKernels.choose(None, CPU, False, copy_bytes=None).dense_prefill == torch.bfloat16
