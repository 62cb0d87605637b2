"""Pure-decode steps through the ahead-of-time compiled graph on the CPU (``Settings.compile_decode``,
``proxy.engine.execution.compiled_step``): the same tokens as eager for every batch size and key length
through one graph, saved and loaded again, and eager wherever it cannot serve or fails."""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from proxy.engine.core import EngineCore
from proxy.engine.execution import compiled_step, traced_decode
from proxy.engine.execution.attention import register
from proxy.engine.execution.choice import choose_execution
from proxy.engine.execution.decode_runner import CompiledDecode, EagerDecode
from proxy.sampling import SamplingParams
from proxy.settings import Settings

from ..arch_zoo import build_model

EOS = 2


def _core(model: torch.nn.Module, cache: Path, **overrides: Any) -> EngineCore:
    settings = Settings(block_size=4, num_kv_blocks=96, max_num_seqs=4, cache_dir=str(cache), **overrides)
    return EngineCore(model, settings, [EOS], max_model_len=200)


def _execution_key() -> dict[str, Any]:
    """The execution choice's key of :func:`_core`'s engines with ``compile_decode=True``."""
    return choose_execution(Settings(compile_decode=True), torch.device("cpu")).key()


def _greedy(core: EngineCore, prompts: list[list[int]], max_tokens: list[int]) -> dict[str, list[int]]:
    for i, (p, n) in enumerate(zip(prompts, max_tokens)):
        core.add_request(str(i), p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    got: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while core.has_unfinished():
        for out in core.step():
            got[out.request_id] += out.new_token_ids
    return got


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, 97, (n,), generator=g).tolist() for n in (20, 9, 50)]


#: three requests end after 6, 20 and 40 tokens: decode steps of 3, 2 and 1 rows; the third
#: crosses 64 and 128 keys (key lengths 64, 128 after padding)
MAX_TOKENS = [6, 20, 40]


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    m = copy.deepcopy(build_model("llama"))
    m.set_attn_implementation(register())
    return m.eval()


@pytest.fixture(scope="module")
def eager(model: torch.nn.Module, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[int]]:
    core = _core(model, tmp_path_factory.mktemp("eager"), compile_decode=False)
    assert core.runner.compiled_step is None
    return _greedy(core, _prompts(), MAX_TOKENS)


def test_compiled_then_loaded_tokens_equal_eager(model: torch.nn.Module, eager: dict[str, list[int]],
                                                  tmp_path: Path) -> None:
    """One graph serves 3, 2 and 1 rows and 64 to 128 keys; the saved file is loaded by the next
    start (a new process is a new model object: ``forget`` stands in for it)."""
    compiled_step.forget(model)
    core = _core(model, tmp_path, compile_decode=True)
    step = core.runner.compiled_step
    assert step is not None and step.source == "compiled"
    assert _greedy(core, _prompts(), MAX_TOKENS) == eager
    assert step.num_calls == 39  # every step after the one prefill step
    saved = list((tmp_path / compiled_step.ARTIFACT_DIR).glob("*.pt2"))
    assert len(saved) == 1

    assert _core(model, tmp_path, compile_decode=True).runner.compiled_step is step  # same model: shared
    compiled_step.forget(model)
    again = _core(model, tmp_path, compile_decode=True)
    loaded = again.runner.compiled_step
    assert loaded is not None and loaded.source == "loaded"
    assert _greedy(again, _prompts(), MAX_TOKENS) == eager
    assert loaded.num_calls == 39
    compiled_step.forget(model)


def _eager_stand_in(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Replace inductor by a stand-in that runs ``decode_forward`` eagerly (counts its compiles)."""
    compiles: list[int] = []

    class StandIn:
        def __call__(self, *args: Any) -> torch.Tensor:
            return traced_decode.decode_forward(*args)

        def disable_guard_check(self) -> None:
            pass

        def save_compiled_function(self, path: str, external_data: Any = None) -> None:
            Path(path).write_bytes(b"stand-in")

    def fake_compile(args: tuple[Any, ...]) -> StandIn:
        compiles.append(len(args))
        return StandIn()

    monkeypatch.setattr(compiled_step, "_compile", fake_compile)
    return compiles


def test_damaged_file_compiles_again(model: torch.nn.Module, eager: dict[str, list[int]],
                                     tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     caplog: pytest.LogCaptureFixture) -> None:
    compiles = _eager_stand_in(monkeypatch)
    compiled_step.forget(model)
    folder = tmp_path / compiled_step.ARTIFACT_DIR
    folder.mkdir()
    path = folder / f"{compiled_step.artifact_key(model, _execution_key())}.pt2"
    path.write_bytes(b"not a compiled function")
    with caplog.at_level(logging.WARNING, logger="proxy.engine.execution.compiled_step"):
        core = _core(model, tmp_path, compile_decode=True)
    assert "could not load the compiled decode step" in caplog.text
    assert compiles == [9] and path.read_bytes() == b"stand-in"
    step = core.runner.compiled_step
    assert step is not None and step.source == "compiled"
    assert _greedy(core, _prompts(), MAX_TOKENS) == eager
    compiled_step.forget(model)


def test_a_file_that_does_not_run_on_this_model_compiles_again(
        model: torch.nn.Module, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A file that loads but fails on this model (saved for another one under this key) is caught by
    the load's trial step, not by the first request."""
    compiles = _eager_stand_in(monkeypatch)
    compiled_step.forget(model)
    folder = tmp_path / compiled_step.ARTIFACT_DIR
    folder.mkdir()
    path = folder / f"{compiled_step.artifact_key(model, _execution_key())}.pt2"
    path.write_bytes(b"another model's step")

    class Foreign:
        def disable_guard_check(self) -> None:
            pass

        def __call__(self, *args: Any) -> torch.Tensor:
            raise KeyError("weight")

    monkeypatch.setattr(torch.compiler, "load_compiled_function", lambda f, external_data=None: Foreign())
    with caplog.at_level(logging.WARNING, logger="proxy.engine.execution.compiled_step"):
        step = _core(model, tmp_path, compile_decode=True).runner.compiled_step
    assert "could not load the compiled decode step" in caplog.text and "KeyError" in caplog.text
    assert step is not None and step.source == "compiled" and compiles == [9]
    compiled_step.forget(model)


def test_a_failing_call_runs_eager_from_then_on(model: torch.nn.Module, eager: dict[str, list[int]],
                                                tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                caplog: pytest.LogCaptureFixture) -> None:
    _eager_stand_in(monkeypatch)
    compiled_step.forget(model)
    core = _core(model, tmp_path, compile_decode=True)
    step = core.runner.compiled_step
    assert step is not None and type(core.runner.decode) is CompiledDecode
    calls = []

    def fails_on_the_fifth(*args: Any) -> torch.Tensor:
        calls.append(1)
        if len(calls) == 5:
            raise RuntimeError("an inductor kernel crashed")
        return traced_decode.decode_forward(*args)

    step._fn = fails_on_the_fifth
    with caplog.at_level(logging.WARNING, logger="proxy.engine.execution.compiled_step"):
        assert _greedy(core, _prompts(), MAX_TOKENS) == eager
    assert "decode steps run eager from now on" in caplog.text
    assert core.runner.compiled_step is None and len(calls) == 5
    assert type(core.runner.decode) is EagerDecode  # the object replaced, once
    assert _core(model, tmp_path, compile_decode=True).runner.compiled_step is not step  # dropped
    compiled_step.forget(model)


def test_compile_failure_runs_eager(model: torch.nn.Module, eager: dict[str, list[int]],
                                    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                    caplog: pytest.LogCaptureFixture) -> None:
    def broken(args: tuple[Any, ...]) -> Any:
        raise RuntimeError("inductor is not installed")

    monkeypatch.setattr(compiled_step, "_compile", broken)
    compiled_step.forget(model)
    with caplog.at_level(logging.WARNING, logger="proxy.engine.execution.compiled_step"):
        core = _core(model, tmp_path, compile_decode=True)
    assert "compiling the decode step failed (RuntimeError: inductor is not installed)" in caplog.text
    assert core.runner.compiled_step is None
    assert _greedy(core, _prompts(), MAX_TOKENS) == eager
    assert not (tmp_path / compiled_step.ARTIFACT_DIR).exists()


@pytest.mark.parametrize(("overrides", "on"), [
    ({}, False),  # default (None): a dense model runs eager
    ({"compile_decode": True, "enforce_eager": True}, False),
    ({"compile_decode": False}, False),
    ({"compile_decode": True}, True),
])
def test_when_it_is_on(model: torch.nn.Module, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                       overrides: dict[str, Any], on: bool) -> None:
    _eager_stand_in(monkeypatch)
    compiled_step.forget(model)
    assert (_core(model, tmp_path, **overrides).runner.compiled_step is not None) is on
    compiled_step.forget(model)


def test_default_is_on_for_packed_linears(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from proxy.quant.apply import quantize_linears

    compiles = _eager_stand_in(monkeypatch)
    packed = copy.deepcopy(build_model("llama"))
    assert quantize_linears(packed, "int4", 32, torch.float32)["int4 g32"] > 0
    packed.set_attn_implementation(register())
    assert _core(packed, tmp_path).runner.compiled_step is not None
    assert compiles == [9]


def test_sliding_window_runs_eager(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A layer's window is compared with the key length in Python: a guard-free graph would freeze it."""
    compiles = _eager_stand_in(monkeypatch)
    windowed = copy.deepcopy(build_model("mistral_swa"))
    windowed.set_attn_implementation(register())
    assert _core(windowed, tmp_path, compile_decode=True).runner.compiled_step is None
    assert compiles == []


@pytest.mark.slow
def test_default_model_self_check_runs_through_the_compiled_step() -> None:
    """The default model as served (the GGUF's int4/int8 layers, compiled by default): the load-time
    self-check (greedy ids against ``generate()``, near-ties aside) passes through the compiled step.
    Inductor keeps fused intermediates in fp32 where eager rounds each op to bf16, so compiled and
    eager greedy runs can part at near-ties; batch invariance under it: test_batch_invariance.py."""
    from proxy.engine.loading import load_engine_model
    from proxy.engine.selfcheck import run_self_check

    loaded = load_engine_model(Settings())
    settings = Settings()
    step = EngineCore(loaded.model, settings, loaded.eos_token_ids, loaded.max_model_len).runner.compiled_step
    assert step is not None
    before = step.num_calls
    report = run_self_check(loaded.model, settings, loaded.max_model_len)
    assert len(report.prompt_lengths) == 3 and step.num_calls > before


@pytest.mark.parametrize("available", [True, False])
def test_decode_rows_attend_through_the_pools_op_where_it_is_built(
    model: torch.nn.Module, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, available: bool
) -> None:
    """``decode_forward`` (run eager here, the function the graph is traced from) sends every
    layer's decode rows through ``paged_decode_attention`` where the C++ kernels are loaded, and
    through the gather and SDPA where they are not."""
    from proxy.engine.execution.attention import kernels
    from proxy.engine.execution.decode_graphs import padded_step_inputs

    calls: list[tuple[int, ...]] = []
    op = kernels.paged_decode_attention

    def counted(*args: Any) -> torch.Tensor:
        calls.append(tuple(args[0].shape))
        return op(*args)

    monkeypatch.setattr(kernels, "paged_decode_attention", counted)
    monkeypatch.setattr(traced_decode, "paged_decode_kernel_available", lambda: available)
    core = _core(model, tmp_path, compile_decode=False)
    cache = core.runner.kv_cache
    with torch.no_grad():
        logits = traced_decode.decode_forward(model, cache, core.runner.num_groups,
                                              *padded_step_inputs(cache.scratch_slot, 2, 64))
    assert logits.shape[0] == 2 and bool(torch.isfinite(logits).all())
    layers = model.config.num_hidden_layers
    heads = model.config.num_attention_heads
    assert calls == ([(2, heads, model.config.head_dim)] * layers if available else [])
