"""Prefix caching with a tiny model: the same tokens with and without it (greedy, seeded sampling,
n > 1, preemption, abort, a failed step), and the hit counts it reports."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from proxy.engine.core import EngineCore
from proxy.sampling import SamplingParams
from proxy.settings import Settings

from .engine_helpers import assert_blocks_conserved, assert_greedy_matches, reference_greedy, run_staggered

EOS = 2
ON = Settings(num_kv_blocks=128, block_size=4, max_num_batched_tokens=64, seed=0)
OFF = dataclasses.replace(ON, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def pair(tiny_pair):
    return tiny_pair[1], tiny_pair[2]


def _ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 97, (n,), generator=g).tolist()


SYSTEM = _ids(21, 1)
# a shared "system prompt", then turns of one growing conversation, and unrelated prompts
CHAT = [SYSTEM + _ids(6, 2), SYSTEM + _ids(6, 2) + _ids(9, 3), SYSTEM + _ids(6, 2) + _ids(9, 3) + _ids(5, 4),
        SYSTEM + _ids(11, 5), _ids(13, 6), SYSTEM[:8]]
ARRIVALS = [0, 6, 14, 14, 15, 30]


def _run(model, settings: Settings, params: SamplingParams, prompts=CHAT, arrivals=ARRIVALS):
    core = EngineCore(model, settings, [EOS], max_model_len=256)
    hits: dict[str, int] = {}
    original = core.scheduler.update
    core.num_prompt_tokens_computed = 0  # type: ignore[attr-defined]

    def spy(sched_out, tokens, logprobs=None):
        for r, n in zip(sched_out.requests, sched_out.num_new_tokens):
            core.num_prompt_tokens_computed += max(0, min(n, r.num_prompt_tokens - r.num_computed_tokens))
        outs = original(sched_out, tokens, logprobs)
        for o in outs:
            hits[o.request_id] = o.num_cached_tokens
        return outs

    core.scheduler.update = spy  # type: ignore[method-assign]
    return core, run_staggered(core, prompts, params, arrivals), hits


def test_greedy_same_with_and_without_caching_and_matches_generate(pair) -> None:
    ref, model = pair
    params = SamplingParams(max_tokens=12, temperature=0.0)
    core_on, on, hits = _run(model, ON, params)
    core_off, off, hits_off = _run(model, OFF, params)
    for i, prompt in enumerate(CHAT):
        ref_ids, gaps = reference_greedy(ref, prompt, 12, EOS)
        assert_greedy_matches(on[str(i)], ref_ids, gaps, f"cached/{i}")
        assert_greedy_matches(off[str(i)], ref_ids, gaps, f"uncached/{i}")
    # turn 2 reuses turn 1's prompt blocks (27 tokens -> 6 full blocks), turn 3 turn 2's, ...
    assert hits["0"] == 0 and hits["1"] == 24 and hits["2"] == 36 and hits["4"] == 0
    assert hits["3"] == 20 and hits["5"] == 4
    assert set(hits_off.values()) == {0}
    assert core_on.prefix_cache_hits == sum(hits.values())
    assert core_on.prefix_cache_queries == sum(len(p) for p in CHAT)
    assert core_off.prefix_cache_queries == 0
    # the cache saved exactly the hit tokens' compute
    assert core_off.num_prompt_tokens_computed - core_on.num_prompt_tokens_computed == sum(hits.values())


def test_seeded_sampling_same_with_and_without_caching(pair) -> None:
    _, model = pair
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=77, ignore_eos=True)
    _, on, hits = _run(model, ON, params)
    _, off, _ = _run(model, OFF, params)
    assert on == off
    assert sum(hits.values()) > 0 and len({tuple(v) for v in on.values()}) == len(CHAT)


def test_n_choices_share_prompt_blocks_and_sample_as_without_caching(pair) -> None:
    _, model = pair
    prompt = SYSTEM + _ids(5, 9)  # 26 tokens: 6 full blocks
    params = [SamplingParams(max_tokens=10, temperature=1.0, seed=s, ignore_eos=True) for s in (1, 2, 3)]

    def run(settings: Settings) -> tuple[list[list[int]], list[int]]:
        core = EngineCore(model, settings, [EOS], max_model_len=256)
        for i, p in enumerate(params):
            core.add_request(f"c{i}", prompt, p)
        got: list[list[int]] = [[], [], []]
        core_outs = core.step()
        tables = [core.scheduler.requests[f"c{i}"].block_ids[:6] for i in range(3)]
        shared = [core.block_manager.ref_count(b) for b in tables[0]]
        for o in core_outs:
            got[int(o.request_id[1])] += o.new_token_ids
        while core.has_unfinished():
            for o in core.step():
                got[int(o.request_id[1])] += o.new_token_ids
            assert_blocks_conserved(core)
        assert core.num_free_blocks == core.num_total_blocks
        return got, shared

    on, shared_on = run(ON)
    off, shared_off = run(OFF)
    assert on == off and len({tuple(x) for x in on}) == 3
    assert shared_on == [3] * 6 and shared_off == [1] * 6


def test_preemption_with_shared_blocks_keeps_greedy_output(pair) -> None:
    ref, model = pair
    tiny = dataclasses.replace(ON, num_kv_blocks=22, max_num_batched_tokens=512)
    params = SamplingParams(max_tokens=16, temperature=0.0)
    core, got, _ = _run(model, tiny, params, arrivals=[0, 0, 1, 1, 2, 2])
    assert core.scheduler.num_preemptions > 0
    for i, prompt in enumerate(CHAT):
        ref_ids, gaps = reference_greedy(ref, prompt, 16, EOS)
        assert_greedy_matches(got[str(i)], ref_ids, gaps, f"preempted/{i}")


def test_abort_of_a_sharer_leaves_the_other_intact(pair) -> None:
    ref, model = pair
    core = EngineCore(model, ON, [EOS], max_model_len=256)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    core.add_request("a", CHAT[1], params)
    core.step()
    core.add_request("b", CHAT[1], params)
    got: list[int] = []
    for o in core.step():
        if o.request_id == "b":
            got += o.new_token_ids
    shared = core.scheduler.requests["b"].block_ids[:8]
    assert [core.block_manager.ref_count(x) for x in shared] == [2] * 8
    core.abort_request("a")
    assert [core.block_manager.ref_count(x) for x in shared] == [1] * 8
    while core.has_unfinished():
        for o in core.step():
            got += o.new_token_ids
        assert_blocks_conserved(core)
    ref_ids, gaps = reference_greedy(ref, CHAT[1], 10, None)
    assert_greedy_matches(got, ref_ids, gaps, "survivor")
    assert core.num_free_blocks == core.num_total_blocks


def test_blocks_of_a_failed_step_are_not_reused(pair) -> None:
    ref, model = pair
    core = EngineCore(model, ON, [EOS], max_model_len=256)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    def garbage_then_fail() -> None:
        # the step's K/V slots get garbage (as a half-run forward pass may leave them), then it fails
        for pool in core.runner.kv_cache.key_pools + core.runner.kv_cache.value_pools:
            pool.normal_()
        raise RuntimeError("injected")

    core.fault_injector = garbage_then_fail
    core.add_request("x", CHAT[0], params)
    outs = core.step()
    assert outs[0].finish_reason == "error"
    assert core.block_manager.num_cached_blocks == 0
    core.fault_injector = None
    core.add_request("y", CHAT[0], params)
    got: list[int] = []
    while core.has_unfinished():
        for o in core.step():
            got += o.new_token_ids
            assert o.num_cached_tokens == 0
    ref_ids, gaps = reference_greedy(ref, CHAT[0], 8, None)
    assert_greedy_matches(got, ref_ids, gaps, "after failure")
    assert core.prefix_cache_hits == 0
