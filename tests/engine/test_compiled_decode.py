"""Pure-decode steps through ``torch.compile`` on the CPU (``Settings.compile_decode``,
``proxy.engine.graph_kinds.CompiledDecodeGraph``): the same tokens as eager, through the compiled
graphs, and off under ``enforce_eager``."""

from __future__ import annotations

import copy

import pytest
import torch

from proxy.engine.attention import register
from proxy.engine.core import EngineCore
from proxy.engine.graph_kinds import CompiledDecodeGraph
from proxy.sampling import SamplingParams
from proxy.settings import Settings

from .arch_zoo import build_model

EOS = 2


def _core(model: torch.nn.Module, **overrides: bool) -> EngineCore:
    settings = Settings(block_size=4, num_kv_blocks=64, max_num_seqs=4, **overrides)
    return EngineCore(copy.deepcopy(model), settings, [EOS], max_model_len=128)


def _greedy(core: EngineCore, prompts: list[list[int]], max_tokens: int) -> dict[str, list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        core.add_request(str(i), p, params)
    got: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while core.has_unfinished():
        for out in core.step():
            got[out.request_id] += out.new_token_ids
    return got


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    m = copy.deepcopy(build_model("llama"))
    m.set_attn_implementation(register())
    return m.eval()


def test_compiled_decode_tokens_equal_eager(model: torch.nn.Module) -> None:
    """Batch 1 is compiled at load; three sequences (padded to 4) compile a second shape at their
    first decode step; every decode step then runs compiled and the tokens equal eager's."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 97, (n,), generator=g).tolist() for n in (20, 9, 33)]
    eager = _greedy(_core(model), prompts, 12)
    core = _core(model, compile_decode=True)
    graphs = core.runner.decode_graphs
    assert graphs is not None and set(graphs.graphs) == {(1, 64)}  # the warm-up at load
    assert isinstance(graphs.graphs[(1, 64)].graph, CompiledDecodeGraph)
    compiled = _greedy(core, prompts, 12)
    assert compiled == eager
    assert graphs.enabled and set(graphs.graphs) == {(1, 64), (4, 64)}
    assert graphs.num_replays == 11  # every step after the prefill step
    assert graphs.num_shapes == 3 * 2  # batch 1, 2, 4 x keys 64, 128


def test_enforce_eager_turns_compile_off(model: torch.nn.Module) -> None:
    core = _core(model, compile_decode=True, enforce_eager=True)
    assert core.runner.decode_graphs is None
