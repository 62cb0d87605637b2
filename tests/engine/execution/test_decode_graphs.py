"""Captured decode graphs (proxy/engine/execution/decode_graphs.py), run on the CPU through a stand-in graph.

The stand-in records the forward pass at capture and re-runs it on the static buffers at replay,
writing into the captured output tensor as a CUDA graph's replay does; everything else (shape
choice, static buffers, padded rows on the scratch slot, the rows sliced back, sampling outside
the graph) is the code that runs on CUDA. No GPU ran these paths.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch

from proxy.engine.core import EngineCore
from proxy.engine.execution.attention import register
from proxy.engine.execution.decode_graphs import capture_batch_sizes, key_length_bucket
from proxy.sampling import SamplingParams
from proxy.settings import Settings

from ..arch_zoo import build_model
from ..engine_helpers import assert_blocks_conserved

EOS = 2


class ReplayGraph:
    """Stand-in for ``CudaDecodeGraph``: capture runs ``fn`` once and keeps it; replay runs it again
    on the static buffers and copies the result into the captured output (in place, as a replay)."""

    def __init__(self) -> None:
        self.fn: Callable[[], torch.Tensor] | None = None
        self.output: torch.Tensor | None = None
        self.replays = 0

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        self.fn = fn
        self.output = fn()
        return self.output

    def replay(self) -> None:
        assert self.fn is not None and self.output is not None
        with torch.inference_mode():
            self.output.copy_(self.fn())
        self.replays += 1


class FailingGraph(ReplayGraph):
    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        raise RuntimeError("operation not permitted when stream is capturing")


def _core(model: torch.nn.Module, graph: type[ReplayGraph] | None, **overrides: int) -> EngineCore:
    settings = Settings(**{"block_size": 4, "num_kv_blocks": 64, "max_num_seqs": 8, **overrides})
    core = EngineCore(model, settings, [EOS], max_model_len=256)
    if graph is not None:
        core.runner.use_decode_graphs(graph)
    return core


def _engine_model(name: str) -> torch.nn.Module:
    model = copy.deepcopy(build_model(name))
    model.set_attn_implementation(register())
    return model.eval()


def _prompts(lengths: list[int], seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 97, (n,), generator=g).tolist() for n in lengths]


def _run(
    core: EngineCore, prompts: list[list[int]], max_tokens: int, abort_at: dict[int, str]
) -> dict[str, list[int]]:
    """All prompts at step 0, greedy; abort request ``abort_at[step]`` before that step."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    got: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        core.add_request(str(i), p, params)
    step = 0
    while core.has_unfinished():
        if step in abort_at:
            core.abort_request(abort_at[step])
        for out in core.step():
            got[out.request_id] += out.new_token_ids
        assert_blocks_conserved(core)
        step += 1
        assert step < 500
    assert core.num_free_blocks == core.num_total_blocks
    return got


def test_capture_sizes_and_key_buckets() -> None:
    assert capture_batch_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    assert capture_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_batch_sizes(3) == [1, 2, 3]
    assert capture_batch_sizes(1) == [1]
    lengths = (1, 64, 65, 128, 129, 700, 1024)
    assert [key_length_bucket(n) for n in lengths] == [64, 64, 128, 128, 256, 1024, 1024]


@pytest.mark.parametrize("name", ["llama", "mistral_swa", "gemma2"])
def test_graph_decode_tokens_equal_eager(name: str) -> None:
    """5 sequences (padded to 8), then 4, then 3 (padded to 4) after two aborts; contexts cross the
    64 -> 128 key bucket; the sliding window (16) masks are rebuilt at every replay; Gemma 2's
    soft-capping goes through the explicit softmax."""
    model = _engine_model(name)
    prompts = _prompts([50, 9, 33, 20, 41])
    aborts = {6: "1", 12: "3"}
    eager = _run(_core(model, None), prompts, 24, aborts)
    core = _core(model, ReplayGraph)
    graphed = _run(core, prompts, 24, aborts)
    assert graphed == eager
    graphs = core.runner.decode_graphs
    assert graphs is not None and graphs.enabled
    assert {(8, 64), (4, 64), (4, 128)} <= set(graphs.graphs), set(graphs.graphs)
    assert graphs.num_replays >= 20
    assert len(graphed["0"]) == 24 and 0 < len(graphed["1"]) < 24


def test_padded_rows_write_only_the_scratch_slot() -> None:
    """A 3-row decode step runs the 4-row graph: the pools change only at the 3 rows' new slots and at
    the scratch slot past the last block; every other slot (other blocks, free blocks) keeps its bits."""
    core = _core(_engine_model("llama"), ReplayGraph)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(_prompts([10, 7, 11])):  # no prompt fills its last block
        core.add_request(str(i), p, params)
    core.step()  # the prefills
    cache = core.runner.kv_cache
    written = []
    for request in core.scheduler.requests.values():
        pos = request.num_computed_tokens
        written.append(request.block_ids[pos // cache.block_size] * cache.block_size + pos % cache.block_size)
    before = [p.clone() for p in cache.key_pools + cache.value_pools]
    assert not any(bool(p[cache.scratch_slot].any()) for p in before)
    core.step()
    graphs = core.runner.decode_graphs
    assert graphs is not None and set(graphs.graphs) == {(4, 64)} and graphs.num_replays == 1
    assert cache.scratch_slot == cache.num_blocks * cache.block_size
    static = graphs.graphs[(4, 64)].meta
    assert static.slot_mapping[:3].tolist() == written and int(static.slot_mapping[3]) == cache.scratch_slot
    untouched = torch.ones(cache.scratch_slot + 1, dtype=torch.bool)
    untouched[written + [cache.scratch_slot]] = False
    for old, new in zip(before, cache.key_pools + cache.value_pools):
        assert torch.equal(old[untouched], new[untouched])
        assert not torch.equal(old[written], new[written])
        assert bool(new[cache.scratch_slot].any())  # the padded row wrote there


def test_mixed_and_prefill_steps_run_eager() -> None:
    core = _core(_engine_model("llama"), ReplayGraph)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    core.add_request("a", _prompts([10])[0], params)
    core.step()  # prefill: eager
    graphs = core.runner.decode_graphs
    assert graphs is not None and graphs.num_replays == 0
    core.step()  # decode of "a" alone: the 1-row graph
    assert graphs.num_replays == 1
    core.add_request("b", _prompts([12], seed=4)[0], params)
    core.step()  # a's decode beside b's prefill: eager
    assert graphs.num_replays == 1 and set(graphs.graphs) == {(1, 64)}


def test_a_failed_capture_turns_graphs_off() -> None:
    model = _engine_model("llama")
    prompts = _prompts([20, 30, 25])
    eager = _run(_core(model, None), prompts, 10, {})
    core = _core(model, FailingGraph)
    assert _run(core, prompts, 10, {}) == eager
    graphs = core.runner.decode_graphs
    assert graphs is not None and not graphs.enabled and not graphs.graphs


def test_batches_and_contexts_past_the_captured_sizes_run_eager() -> None:
    core = _core(_engine_model("llama"), ReplayGraph, max_num_seqs=2)
    graphs = core.runner.decode_graphs
    assert graphs is not None
    assert graphs.shape_for(2, 64) == (2, 64) and graphs.shape_for(3, 64) is None
    assert graphs.shape_for(1, 256) == (1, 256) and graphs.shape_for(1, 257) is None  # max_model_len 256


def test_the_cpu_runner_never_touches_cuda_graphs(monkeypatch) -> None:
    """On CPU (and with --enforce-eager) no graph runner exists and torch.cuda's graph API is never
    called: it raises here, and the engine serves."""
    def forbidden(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("torch.cuda graph API used on a CPU machine")

    for name in ("CUDAGraph", "graph", "graph_pool_handle", "Stream", "current_stream"):
        monkeypatch.setattr(torch.cuda, name, forbidden)
    for enforce_eager in (False, True):
        core = EngineCore(_engine_model("llama"), Settings(block_size=4, num_kv_blocks=32,
                                                           enforce_eager=enforce_eager), [EOS], 128)
        assert core.runner.decode_graphs is None
        got = _run(core, _prompts([8, 5]), 4, {})
        assert [len(v) for v in got.values()] == [4, 4]


@pytest.mark.slow
def test_default_model_graph_decode_tokens_equal_eager() -> None:
    """The default model as served (bf16 + the GGUF's int4/int8 on a CPU with BF16 instructions):
    4 chat prompts (padded to 4, then 3 after an abort, padded to 4 again), greedy."""
    from proxy.engine.loading import load_engine_model

    loaded = load_engine_model(Settings())
    tok = loaded.hf_tokenizer
    prompts = []
    for q in ("What is the capital of France?", "Write a haiku about the sea.", "Name three primes.",
              "Explain in one sentence what a KV cache is."):
        ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
        prompts.append(list(ids if isinstance(ids, list) else ids["input_ids"]))
    results = []
    for graph in (None, ReplayGraph):
        core = EngineCore(loaded.model, Settings(num_kv_blocks=64, max_num_seqs=8, compile_decode=False),
                          loaded.eos_token_ids, loaded.max_model_len)
        if graph is not None:
            core.runner.use_decode_graphs(graph)
        results.append(_run(core, prompts, 16, {5: "2"}))
    assert results[0] == results[1]
    graphs = core.runner.decode_graphs
    assert graphs is not None and graphs.num_replays >= 10 and {(4, 64)} <= set(graphs.graphs)
