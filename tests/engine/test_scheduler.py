"""BlockManager and Scheduler without a model (no torch): budgets, chunking, preemption, finishing."""

from __future__ import annotations

import sys

import pytest

from proxy.engine.block_manager import BlockManager
from proxy.engine.request import Request, RequestStatus
from proxy.engine.scheduler import Scheduler, SchedulerConfig, StepBudget
from proxy.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=4, temperature=0.0)


def make(num_blocks=16, block_size=4, max_seqs=8, budget=64, max_len=64, eos=(2,)):
    bm = BlockManager(num_blocks, block_size)
    return bm, Scheduler(bm, SchedulerConfig(max_seqs, budget, max_len), eos)


def req(rid: str, n: int, params: SamplingParams = GREEDY) -> Request:
    return Request(rid, list(range(10, 10 + n)), params)


def fake_step(sched: Scheduler, token: int = 7):
    out = sched.schedule()
    return out, sched.update(out, [token] * len(out.sample_indices))


def test_block_manager_allocate_and_free() -> None:
    bm = BlockManager(5, 4)
    r = req("a", 9)
    assert bm.allocate_slots(r, 9)
    assert len(r.block_ids) == 3 and bm.num_free_blocks == 2
    r.num_computed_tokens = 9
    assert bm.allocate_slots(r, 3)  # positions 9..11 still fit in block 2
    assert len(r.block_ids) == 3
    assert bm.allocate_slots(r, 4)  # 13 positions -> 4 blocks
    assert len(r.block_ids) == 4 and bm.num_free_blocks == 1
    r2 = req("b", 8)
    assert not bm.allocate_slots(r2, 8)  # needs 2, only 1 free: nothing taken
    assert r2.block_ids == [] and bm.num_free_blocks == 1
    bm.free(r)
    assert r.block_ids == [] and bm.num_free_blocks == 5
    assert sorted(bm._free) == [0, 1, 2, 3, 4]
    assert bm.usage == 0.0


def test_block_manager_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError):
        BlockManager(0, 4)


def test_decodes_first_then_chunked_prefill_within_budget() -> None:
    _bm, sched = make(num_blocks=64, budget=8)
    sched.add_request(req("a", 3))
    out, _ = fake_step(sched)  # a prefilled whole (3 tokens) and samples
    assert [r.request_id for r in out.requests] == ["a"] and out.num_new_tokens == [3]
    assert out.sample_indices == [0]
    sched.add_request(req("long", 20))
    out, outs = fake_step(sched)
    # a decodes (1 token), long gets the remaining 7 tokens of the budget and does not sample
    assert [r.request_id for r in out.requests] == ["a", "long"]
    assert out.num_new_tokens == [1, 7] and out.sample_indices == [0] and out.num_decodes == 1
    assert [o.request_id for o in outs] == ["a"]
    out, _ = fake_step(sched)
    assert out.num_new_tokens == [1, 7]
    out, outs = fake_step(sched)
    assert out.num_new_tokens == [1, 6] and out.sample_indices == [0, 1]
    assert [o.request_id for o in outs] == ["a", "long"]
    assert outs[0].finished and outs[0].finish_reason == "length"  # a reached max_tokens=4


def test_max_num_seqs_limits_running() -> None:
    _, sched = make(max_seqs=2)
    for i in range(3):
        sched.add_request(req(str(i), 2))
    out, _ = fake_step(sched)
    assert [r.request_id for r in out.requests] == ["0", "1"]
    assert sched.num_running == 2 and sched.num_waiting == 1


def test_eos_stop_ids_min_tokens_and_length() -> None:
    _, sched = make()
    sched.add_request(req("eos", 2, SamplingParams(max_tokens=10, temperature=0.0)))
    _, outs = fake_step(sched, token=2)
    assert outs[0].finished and outs[0].finish_reason == "stop" and outs[0].stop_reason == 2
    assert outs[0].new_token_ids == [2]
    sched.add_request(req("ign", 2, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)))
    _, outs = fake_step(sched, token=2)
    assert not outs[0].finished
    _, outs = fake_step(sched, token=2)
    assert outs[0].finished and outs[0].finish_reason == "length" and outs[0].num_output_tokens == 2
    sched.add_request(
        req("min", 2, SamplingParams(max_tokens=9, temperature=0.0, min_tokens=2, stop_token_ids=(5,)))
    )
    for _ in range(
        2
    ):  # min_tokens=2: two tokens before a stop token may end it (SamplingParams.is_stop_allowed)
        _, outs = fake_step(sched, token=5)
        assert not outs[0].finished
    _, outs = fake_step(sched, token=5)
    assert outs[0].finish_reason == "stop" and outs[0].stop_reason == 5 and outs[0].num_output_tokens == 3


def test_max_model_len_finishes_with_length() -> None:
    bm, sched = make(max_len=6)
    sched.add_request(req("a", 4, SamplingParams(max_tokens=100, temperature=0.0)))
    _, outs = fake_step(sched)
    assert not outs[0].finished
    _, outs = fake_step(sched)
    assert outs[0].finished and outs[0].finish_reason == "length" and outs[0].num_output_tokens == 2
    assert bm.num_free_blocks == bm.num_total_blocks


def test_preemption_by_recompute_and_blocks_return() -> None:
    bm, sched = make(num_blocks=6, block_size=2, budget=64)
    params = SamplingParams(max_tokens=6, temperature=0.0)
    sched.add_request(req("a", 3, params))
    sched.add_request(req("b", 3, params))
    out, _ = fake_step(sched)  # a and b take 2 blocks each; each needs 5 to finish: 10 > 6
    assert len(out.requests) == 2
    seen_preempt = False
    steps = 0
    while sched.has_unfinished():
        fake_step(sched)
        used = {b for r in sched.requests.values() for b in r.block_ids}
        assert len(used) + bm.num_free_blocks == bm.num_total_blocks
        seen_preempt |= sched.num_preemptions > 0
        steps += 1
        assert steps < 100
    assert seen_preempt
    assert bm.num_free_blocks == bm.num_total_blocks
    assert sched.requests == {}


def test_sequence_larger_than_pool_finishes_with_length() -> None:
    bm, sched = make(num_blocks=2, block_size=2)
    sched.add_request(req("a", 3, SamplingParams(max_tokens=50, temperature=0.0)))
    outs_all = []
    for _ in range(10):
        outs_all += fake_step(sched)[1]
        if not sched.has_unfinished():
            break
    assert outs_all[-1].finished and outs_all[-1].finish_reason == "length"
    assert outs_all[-1].num_output_tokens == 2  # 4 slots = 3 prompt + 1 computed output, 2nd sampled
    assert bm.num_free_blocks == 2


def test_abort_and_fail_free_blocks_and_are_idempotent() -> None:
    bm, sched = make(max_seqs=2)
    sched.add_request(req("a", 9))
    sched.add_request(req("b", 5))
    sched.add_request(req("w", 5))
    fake_step(sched)
    out = sched.abort_request("a")
    assert out is not None and out.finished and out.finish_reason == "abort"
    assert sched.abort_request("a") is None
    assert sched.abort_request("nope") is None
    outs = sched.fail_requests([sched.requests["b"]], "boom")
    assert outs[0].finish_reason == "error" and outs[0].error == "boom"
    assert sched.abort_request("w").finish_reason == "abort"  # a waiting request
    assert not sched.has_unfinished()
    assert bm.num_free_blocks == bm.num_total_blocks


def test_request_status_transitions() -> None:
    _, sched = make()
    r = req("a", 2)
    sched.add_request(r)
    assert r.status is RequestStatus.WAITING
    fake_step(sched)
    assert r.status is RequestStatus.RUNNING
    with pytest.raises(ValueError):
        sched.add_request(req("a", 2))


def test_scheduler_and_block_manager_do_not_import_torch() -> None:
    import subprocess

    code = (
        "import sys; import proxy.engine.scheduler, proxy.engine.block_manager, proxy.engine.request; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- prefix caching ---------------------------------------------------------------------------------


def test_request_starts_after_its_cached_prefix_and_reports_it() -> None:
    bm, sched = make(num_blocks=32, block_size=4)
    sched.add_request(req("a", 10))
    fake_step(sched)
    sched.add_request(req("b", 10))  # same prompt: 2 full blocks cached; the last 2 tokens computed
    out, outs = fake_step(sched)
    assert [r.request_id for r in out.requests] == ["a", "b"] and out.num_new_tokens == [1, 2]
    b = sched.requests["b"]
    assert b.block_ids[:2] == sched.requests["a"].block_ids[:2]
    assert outs[1].request_id == "b" and outs[1].num_cached_tokens == 8 and outs[0].num_cached_tokens == 0
    assert (bm.num_queries_tokens, bm.num_hit_tokens) == (20, 8)


def test_identical_prompts_in_one_step_share_the_prompt_blocks() -> None:
    """n > 1: the second choice hits the blocks the first one computes in the same step (the
    attention layer writes a step's K/V before it reads)."""
    bm, sched = make(num_blocks=32, block_size=4)
    sched.add_request(req("c0", 9))
    sched.add_request(req("c1", 9))
    out, _ = fake_step(sched)
    assert out.num_new_tokens == [1, 9] and [r.request_id for r in out.requests] == ["c1", "c0"]
    assert out.num_decodes == 1 and sorted(out.sample_indices) == [0, 1]
    c0, c1 = sched.requests["c0"], sched.requests["c1"]
    assert c0.block_ids[:2] == c1.block_ids[:2] and c0.block_ids[2] != c1.block_ids[2]
    assert bm.num_free_blocks == 32 - 4


def test_preempted_request_recomputes_only_what_the_cache_lost() -> None:
    bm, sched = make(num_blocks=64, block_size=2)
    r = req("a", 7, SamplingParams(max_tokens=20, temperature=0.0))
    sched.add_request(r)
    for _ in range(3):
        fake_step(sched)
    assert r.num_computed_tokens == 9 and r.num_tokens == 10
    sched.running.remove(r)
    sched._preempt(r)
    out, outs = fake_step(sched)
    assert out.num_new_tokens == [2]  # 4 full blocks (8 tokens) cached, 2 recomputed
    assert outs[0].num_cached_tokens == 0  # counted at the first scheduling only
    assert bm.num_hit_tokens == 0


def test_failed_step_unregisters_its_blocks() -> None:
    bm, sched = make(num_blocks=32, block_size=4)
    sched.add_request(req("a", 10))
    out = sched.schedule()
    assert bm.num_cached_blocks == 2
    sched.fail_step(out, "boom")
    assert bm.num_cached_blocks == 0 and bm.num_free_blocks == 32
    sched.add_request(req("b", 10))
    out, outs = fake_step(sched)
    assert out.num_new_tokens == [10] and outs[0].num_cached_tokens == 0


def test_prefix_caching_off_computes_every_token() -> None:
    bm = BlockManager(32, 4, enable_prefix_caching=False)
    sched = Scheduler(bm, SchedulerConfig(8, 64, 64), (2,))
    sched.add_request(req("a", 10))
    fake_step(sched)
    sched.add_request(req("b", 10))
    out, _ = fake_step(sched)
    assert out.num_new_tokens == [1, 10]
    assert (bm.num_queries_tokens, bm.num_hit_tokens) == (0, 0)


# ---- prefill work joining decode steps ---------------------------------------------------------------


def test_prefill_joining_decodes_is_bounded() -> None:
    bm = BlockManager(64, 4)
    config = SchedulerConfig(8, 64, 256, long_prefill_token_threshold=5, max_num_partial_prefills=1)
    sched = Scheduler(bm, config, (2,))
    params = SamplingParams(max_tokens=50, temperature=0.0)
    sched.add_request(Request("d", list(range(3, 9)), params))
    out, _ = fake_step(sched)
    assert out.num_new_tokens == [6]  # no decode running: the whole prompt at once
    sched.add_request(Request("p", list(range(20, 32)), params))
    sched.add_request(Request("q", list(range(40, 44)), params))
    out, _ = fake_step(sched)
    # one decode + one prefill chunk of at most 5 tokens; q waits (one partial prefill at a time)
    assert [r.request_id for r in out.requests] == ["d", "p"] and out.num_new_tokens == [1, 5]
    out, _ = fake_step(sched)
    assert [r.request_id for r in out.requests] == ["d", "p"] and out.num_new_tokens == [1, 5]
    out, _ = fake_step(sched)
    assert [r.request_id for r in out.requests] == ["d", "p"] and out.num_new_tokens == [1, 2]
    out, _ = fake_step(sched)
    assert [r.request_id for r in out.requests] == ["d", "p", "q"] and out.num_new_tokens == [1, 1, 4]


def test_without_threshold_the_budget_alone_bounds_prefill() -> None:
    _, sched = make(num_blocks=64, budget=8)
    params = SamplingParams(max_tokens=50, temperature=0.0)
    sched.add_request(req("d", 2, params))
    fake_step(sched)
    sched.add_request(Request("p", list(range(40, 60)), params))
    out, _ = fake_step(sched)
    assert out.num_new_tokens == [1, 7]


def test_step_budget_caps_prefill_only_beside_decodes_and_takes_back_a_preempted_entry() -> None:
    budget = StepBudget(10, long_prefill_token_threshold=4, max_num_partial_prefills=1)
    assert budget.prefill_chunk(20) == 10  # no decode in the step yet: the whole budget
    budget.take(1, is_decode=True)
    assert budget.prefill_chunk(20) == 4  # beside a decode: at most the threshold
    budget.take(4, is_decode=False)
    assert (budget.num_tokens_left, budget.num_decodes, budget.num_prefills) == (5, 1, 1)
    assert budget.prefill_chunk(20) == 0  # max_num_partial_prefills reached
    budget.give_back(4, is_decode=False)  # that prefill's request was preempted
    assert (budget.num_tokens_left, budget.num_prefills) == (9, 0)
    assert budget.prefill_chunk(3) == 3


def test_generated_token_rows_come_first() -> None:
    """One-token rows lead the step (the runner attends them as decode rows), those feeding a
    generated token first, then a prompt's last token, then the other chunks."""
    from proxy.engine.scheduler import SchedulerOutput

    prompt_tail = req("tail", 6)
    prompt_tail.num_computed_tokens = 5  # only the prompt's last token left
    decode_a, decode_b = req("a", 4), req("b", 3)
    for r in (decode_a, decode_b):
        r.num_computed_tokens = r.num_prompt_tokens
        r.append_token(7)
    chunk = req("chunk", 9)
    out = SchedulerOutput.from_scheduled({prompt_tail: 1, chunk: 5, decode_a: 1, decode_b: 1})
    assert [r.request_id for r in out.requests] == ["a", "b", "tail", "chunk"]
    assert out.num_decodes == 3
    assert out.sample_indices == [0, 1, 2]
    assert [r.request_id for r in SchedulerOutput.from_scheduled({prompt_tail: 1, decode_a: 1}).requests] == [
        "a", "tail"]


def test_recomputed_output_tokens_never_share_a_chunk_with_prompt_tokens() -> None:
    """``outputs_on_decode_path`` (the CPU's compiled decode step): a preempted request recomputes
    its prompt up to its end, then its output tokens in chunks that keep the step's output-token
    rows (decodes included) within ``max_num_seqs``."""
    bm = BlockManager(64, 4, enable_prefix_caching=False)
    config = SchedulerConfig(3, 64, 64, outputs_on_decode_path=True)
    sched = Scheduler(bm, config, (2,))
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    running = req("run", 3, params)
    sched.add_request(running)
    fake_step(sched)  # its prompt: from now on a decode
    resumed = req("resumed", 6, params)
    for t in range(9):
        resumed.append_token(30 + t)  # 9 output tokens, none computed (as after a preemption)
    sched.add_request(resumed)
    chunks = []
    while resumed.num_tokens_to_compute > 1:
        out, _ = fake_step(sched)
        assert running in out.requests  # the decode keeps its row
        chunks.append(dict(zip((r.request_id for r in out.requests), out.num_new_tokens))["resumed"])
    # the prompt (6) alone; then 2 output tokens a step beside the decode: 3 rows = max_num_seqs
    assert chunks == [6, 2, 2, 2, 2]
    assert (resumed.num_computed_tokens, resumed.num_tokens) == (14, 15)  # one left: a decode
    limit = sched.chunk_limit
    assert limit(resumed, 4, {}) == 2 and limit(resumed, 6, {running: 1}) == 2
    assert limit(resumed, 6, {running: 1, req("other", 3): 3}) == 2  # prompt rows take no decode row


def test_without_the_decode_path_rule_a_chunk_crosses_the_prompt_end() -> None:
    bm = BlockManager(64, 4, enable_prefix_caching=False)
    sched = Scheduler(bm, SchedulerConfig(3, 64, 64), (2,))
    resumed = req("resumed", 6, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    for t in range(9):
        resumed.append_token(30 + t)
    sched.add_request(resumed)
    out, _ = fake_step(sched)
    assert out.num_new_tokens == [15]
