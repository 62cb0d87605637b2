"""Greedy output of the batched engine == ``model.generate(do_sample=False)`` of each prompt alone.

Tiny random Llama (GQA 4/2) and Qwen2 (GQA 4/1, qkv bias), fp32 CPU; eight prompts of different
lengths arriving at staggered steps; also under a tiny KV pool (preemption by recompute) and a
token budget small enough to force chunked prefill.
"""

from __future__ import annotations

import pytest
import torch

from proxy.engine.core import EngineCore
from proxy.engine.scheduler.step_cost import StepCostModel
from proxy.sampling import SamplingParams
from proxy.settings import Settings

from .conftest import build_tiny, engine_copy
from .engine_helpers import assert_greedy_matches, reference_greedy, run_staggered

EOS = 2
MAX_NEW = 24
LENGTHS = [5, 17, 1, 33, 8, 60, 12, 3]
ARRIVALS = [0, 0, 2, 3, 3, 7, 11, 20]


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(123)
    return [torch.randint(3, 97, (n,), generator=g).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def references(tiny_pair):
    arch, ref, _ = tiny_pair
    return {arch: [reference_greedy(ref, p, MAX_NEW, EOS) for p in _prompts()]}


SCENARIOS = {
    # name: settings, expect preemption, expect a chunked prefill. Measured prefill bounds (timing)
    # are off except in "measured", whose ratio just above 1 holds every decode step's prefill to
    # a 4-token floor once two steps have been timed (by a steady clock: see _SteadyClock).
    "roomy": (Settings(num_kv_blocks=256, block_size=4, max_num_batched_tokens=512,
                       max_prefill_step_ratio=0), False, False),
    "tiny_pool": (Settings(num_kv_blocks=24, block_size=4, max_num_batched_tokens=512,
                           max_prefill_step_ratio=0), True, False),
    "measured": (Settings(num_kv_blocks=256, block_size=4, max_num_batched_tokens=512,
                          max_prefill_step_ratio=1.01), False, True),
    "chunked": (Settings(num_kv_blocks=256, block_size=4, max_num_batched_tokens=10), False, True),
    "tiny_pool_chunked": (Settings(num_kv_blocks=24, block_size=8, max_num_batched_tokens=13), True, True),
}


class _SteadyClock(StepCostModel):
    """Steps timed as 10 ms + 1 ms a token, whatever the machine: the engine's calls are real, the
    chunking they lead to is the same on every run."""

    def observe(self, num_decodes: int, num_prefill_tokens: int, seconds: float) -> None:
        super().observe(num_decodes, num_prefill_tokens, 0.010 + 0.001 * (num_decodes + num_prefill_tokens))


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_greedy_matches_generate(tiny_pair, references, scenario: str) -> None:
    arch, _, model = tiny_pair
    settings, expect_preempt, expect_chunk = SCENARIOS[scenario]
    core = EngineCore(model, settings, [EOS], max_model_len=256)
    if settings.max_prefill_step_ratio:
        core.scheduler.step_cost = _SteadyClock(settings.max_prefill_step_ratio, min_tokens=4, min_steps=2)
    chunked = []
    original_schedule = core.scheduler.schedule

    def spying_schedule():
        out = original_schedule()
        for r, n in zip(out.requests, out.num_new_tokens):
            if r.num_computed_tokens + n < r.num_tokens:
                chunked.append(r.request_id)
        return out

    core.scheduler.schedule = spying_schedule  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    results = run_staggered(core, _prompts(), params, ARRIVALS)
    for i, (ref_ids, gaps) in enumerate(references[arch]):
        assert_greedy_matches(results[str(i)], ref_ids, gaps, f"{arch}/{scenario}/prompt {i}")
    assert (core.scheduler.num_preemptions > 0) == expect_preempt
    assert bool(chunked) == expect_chunk
    # the outputs are not trivial: several distinct continuations
    assert len({tuple(v) for v in results.values()}) == len(LENGTHS)


def test_reference_outputs_not_degenerate(tiny_pair, references) -> None:
    arch, _, _ = tiny_pair
    lengths = [len(ids) for ids, _ in references[arch]]
    assert max(lengths) == MAX_NEW
    assert all(n >= 1 for n in lengths)


def test_qwen3_greedy_matches_generate_with_preemption_and_chunking() -> None:
    """A third architecture (q/k norm, explicit head_dim) under the hardest scenario."""
    ref = build_tiny("qwen3")
    model = engine_copy(ref)
    settings, _, _ = SCENARIOS["tiny_pool_chunked"]
    core = EngineCore(model, settings, [EOS], max_model_len=256)
    results = run_staggered(core, _prompts(), SamplingParams(max_tokens=MAX_NEW, temperature=0.0), ARRIVALS)
    assert core.scheduler.num_preemptions > 0
    for i, prompt in enumerate(_prompts()):
        ref_ids, gaps = reference_greedy(ref, prompt, MAX_NEW, EOS)
        assert_greedy_matches(results[str(i)], ref_ids, gaps, f"qwen3/prompt {i}")
