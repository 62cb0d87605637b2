"""The execution plan (``proxy.engine.execution.plan``): what an engine's steps run on, and why not the
rest."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from proxy.engine.core import EngineCore
from proxy.engine.execution import compiled_step
from proxy.engine.execution.attention import register
from proxy.quant import amx_int4
from proxy.quant.apply import add_dense_weights, quantize_linears
from proxy.settings import Settings

from ..arch_zoo import build_model


def _engine(model: torch.nn.Module, tmp_path: Path, **overrides: Any) -> EngineCore:
    model.set_attn_implementation(register())
    settings = Settings(block_size=4, num_kv_blocks=32, cache_dir=str(tmp_path), **overrides)
    return EngineCore(model, settings, [2], max_model_len=100)


def test_a_dense_fp32_model_runs_eager_and_says_why(tmp_path: Path) -> None:
    plan = _engine(copy.deepcopy(build_model("llama")), tmp_path).execution
    assert (plan.step, plan.decode_attention, plan.dtype, plan.prompt_linears) == (
        "eager", "gather_sdpa", "float32", "as decode")
    assert plan.linears == {"dense": 15}  # 2 layers x 7 projections + the lm_head
    assert plan.off["compiled"] == "off by default for dense models (--compile-decode turns it on)"
    assert plan.off["pools_op"] == "runs inside the compiled step only"
    assert plan.device == "cpu" and set(plan.cpu_flags) <= {"avx2", "avx512f", "avx512_bf16", "amx_bf16"}
    payload = plan.as_dict()
    assert payload["summary"] == plan.summary() and payload["linears"] == {"dense": 15}
    assert plan.summary().startswith(
        "execution: step eager, decode attention gather_sdpa, linear modules (after fusion) dense x15, ")
    assert plan.summary().endswith("; not taken: compiled: off by default for dense models (--compile-decode "
                                   "turns it on); pools_op: runs inside the compiled step only")


def test_a_packed_bf16_model_names_its_kernels(tmp_path: Path) -> None:
    model = copy.deepcopy(build_model("llama")).to(torch.bfloat16)
    quantize_linears(model, "int4", 32, torch.bfloat16)
    add_dense_weights(model, torch.bfloat16)
    plan = _engine(model, tmp_path, enforce_eager=True).execution
    int4 = f"int4 {amx_int4.kernel_isa()}" if amx_int4.in_use() else "int4 torch"
    assert plan.linears == {"dense": 1, int4: 14}  # the lm_head of 97 outputs stays dense
    assert plan.prompt_linears == "dense bfloat16 copies" and plan.off["compiled"] == "--enforce-eager"
    assert ("int4 amx" in plan.off) is (int4 == "int4 torch")


def test_the_compiled_step_attends_over_the_pools(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the compiled step (here a stand-in that runs the traced function eagerly) the plan says
    so, and which decode attention it traces (the pools op where the C++ kernels are loaded)."""
    from proxy.engine.execution.attention.kernels import paged_decode_kernel_available
    from proxy.engine.execution.traced_decode import decode_forward

    class StandIn:
        def __call__(self, *args: Any) -> torch.Tensor:
            return decode_forward(*args)

        def disable_guard_check(self) -> None:
            pass

        def save_compiled_function(self, path: str, external_data: Any = None) -> None:
            raise OSError("not saved")

    monkeypatch.setattr(compiled_step, "_compile", lambda args: StandIn())
    model = copy.deepcopy(build_model("llama"))
    plan = _engine(model, tmp_path, compile_decode=True).execution
    compiled_step.forget(model)
    assert plan.step == "compiled" and "compiled" not in plan.off
    assert plan.decode_attention == ("pools_op" if paged_decode_kernel_available() else "gather_sdpa")
