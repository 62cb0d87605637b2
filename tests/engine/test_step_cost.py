"""StepCostModel and the measured prefill bound: measured step times -> prefill tokens a decode step
takes (proxy.engine.scheduler.step_cost), and the scheduler applying it on top of the token knobs."""

from __future__ import annotations

import pytest

from proxy.engine.block_manager import BlockManager
from proxy.engine.request import Request
from proxy.engine.scheduler import Scheduler, SchedulerConfig, StepBudget
from proxy.engine.scheduler.step_cost import StepCostModel
from proxy.sampling import SamplingParams


def _steps(model: StepCostModel, steps: list[tuple[int, int]], fixed: float = 0.0) -> None:
    """Feed steps whose time is exactly 20 ms + 3.5 ms a decode + 1.6 ms a prefill token (+ ``fixed``
    seconds for a step with any prefill)."""
    for n, p in steps:
        model.observe(n, p, 0.020 + 0.0035 * n + 0.0016 * p + (fixed if p else 0.0))


def test_the_fit_recovers_the_step_costs_and_the_limit_keeps_the_ratio() -> None:
    model = StepCostModel(2.0, min_steps=4)
    assert model.prefill_token_limit(8) is None  # nothing measured: the token knobs alone
    _steps(model, [(8, 0), (8, 0), (8, 0), (8, 0)])
    assert model.prefill_token_limit(8) is None  # decode steps only: no prefill cost known
    # under load almost no step is decode-only, and no batch size repeats: the joint fit needs neither
    _steps(model, [(0, 128), (4, 16), (6, 30), (7, 8), (8, 26), (5, 20), (3, 64)])
    a, b, c, e = model.coefficients() or (0, 0, 0, 0)
    assert (a, b, c) == pytest.approx((0.020, 0.0035, 0.0016), rel=1e-3)
    assert e == pytest.approx(0.0, abs=1e-4)
    assert model.decode_step_estimate(8) == pytest.approx(0.048, rel=1e-3)
    assert model.prefill_token_limit(8) == 30  # (2 - 1) * 48 ms / 1.6 ms
    assert model.prefill_token_limit(16) == 47
    assert model.prefill_token_limit(1) == 16  # 14.7 -> the floor: a prefill always moves on
    assert model.prefill_token_limit(0) is None  # no decodes: the step budget alone
    # requests waiting for a first step widen it by their share of the decodes: 30 x (1 + w / n)
    assert model.prefill_token_limit(8, num_waiting=1) == 33
    assert model.prefill_token_limit(8, num_waiting=3) == 41  # 41.25
    assert model.prefill_token_limit(8, num_waiting=7) == 56  # 56.25
    assert model.prefill_token_limit(8, num_waiting=9) == 63  # 63.75 (a burst is the scheduler's call)
    assert StepCostModel(3.0).prefill_token_limit(8) is None


def test_old_steps_are_forgotten() -> None:
    """The machine got twice as slow (another process took a core): the limit follows within a
    few dozen steps, because each step keeps only ``forgetting`` of the earlier ones' weight."""
    model = StepCostModel(2.0, forgetting=0.9, min_steps=4)
    mix = [(8, 0), (8, 24), (6, 16), (7, 32), (5, 0), (8, 16)]
    _steps(model, mix * 10)
    before = model.coefficients()
    for n, p in mix * 10:
        model.observe(n, p, 2 * (0.020 + 0.0035 * n + 0.0016 * p))
    after = model.coefficients()
    assert before is not None and after is not None
    assert after == pytest.approx(tuple(2 * v for v in before), rel=0.02)
    assert model.prefill_token_limit(8) in (29, 30)  # the ratio of costs is unchanged (ridge: +-1)
    model.observe(0, 0, 1.0)
    model.observe(3, 0, 0.0)  # empty or unmeasured steps are ignored
    assert model.coefficients() == after


def test_a_fixed_cost_of_prefill_steps_is_fitted_apart_and_charged_to_the_step() -> None:
    """Prompt tokens in fixed 64-row calls (proxy.quant.dense_prefill) cost a step ~the same for 1
    or 64 tokens: the fit finds that fixed part, the limit leaves room for it, and with
    ``multiple`` the limit is a whole number of calls."""
    mix = [(8, 0), (4, 16), (6, 0), (7, 64), (8, 26), (5, 0), (3, 48), (8, 8), (2, 0), (6, 33)]
    prior = StepCostModel(2.0, min_steps=4)
    _steps(prior, mix * 3, fixed=0.030)
    _, _, _, e = prior.coefficients() or (0, 0, 0, 0)
    assert 0.020 < e < 0.030  # the prior on e (FIXED_COST_RIDGE) keeps it a little short of the data's
    model = StepCostModel(2.0, min_steps=4)
    model.FIXED_COST_RIDGE = 0.0  # exact steps, no prior: the fit recovers every cost
    _steps(model, mix * 3, fixed=0.030)
    a, b, c, e = model.coefficients() or (0, 0, 0, 0)
    assert (a, b, c, e) == pytest.approx((0.020, 0.0035, 0.0016, 0.030), rel=1e-3)
    assert model.prefill_token_limit(13) == 22  # ((2 - 1) * 65.5 ms - 30 ms) / 1.6 ms
    assert model.prefill_token_limit(16) == 28  # (76 - 30) / 1.6
    assert model.prefill_token_limit(8) == 16  # (48 - 30) / 1.6 = 11: the floor
    calls = StepCostModel(2.0, min_steps=4, multiple=64)
    calls.FIXED_COST_RIDGE = 0.0
    _steps(calls, mix * 3, fixed=0.030)
    assert calls.prefill_token_limit(8) == 64  # at least one call
    assert calls.prefill_token_limit(60) == 64  # (230 - 30) / 1.6 = 125: rounded down to one call
    assert calls.prefill_token_limit(70) == 128  # (265 - 30) / 1.6 = 146: two calls
    with pytest.raises(ValueError, match="multiple"):
        StepCostModel(2.0, multiple=0)


def test_without_decode_only_steps_the_fixed_cost_stays_in_the_step() -> None:
    """Under steady load every step carries prefill: the constant and the fixed prefill cost are
    then the same column, and the prior puts the cost in ``a`` (so ``D(n)`` is the whole step's
    constant, never a share of it split off at random)."""
    model = StepCostModel(2.0, min_steps=4)
    _steps(model, [(11, 16), (10, 24), (12, 16), (11, 32), (12, 20), (10, 16), (11, 28), (12, 24)] * 4,
           fixed=0.060)
    a, b, c, e = model.coefficients() or (0, 0, 0, 0)
    assert e == pytest.approx(0.0, abs=1e-3)
    assert (a, b, c) == pytest.approx((0.080, 0.0035, 0.0016), rel=0.02)
    assert model.decode_step_estimate(11) == pytest.approx(0.1185, rel=0.01)
    assert model.prefill_token_limit(11) == 74  # (2 - 1) * 118.5 ms / 1.6 ms
    model.FIXED_COST_RIDGE = 0.0
    model._fit = None
    split = model.coefficients()
    assert split is not None and split[3] > 0.01  # without the prior: an arbitrary share in e


@pytest.mark.parametrize("ratio", [0.5, 1.0, -1.0])
def test_ratios_that_leave_no_room_are_refused(ratio: float) -> None:
    with pytest.raises(ValueError, match="max_prefill_step_ratio"):
        StepCostModel(ratio)
    assert StepCostModel(0).prefill_token_limit(4) is None  # 0: off


def test_the_budget_shares_the_limit_among_the_steps_prefills() -> None:
    budget = StepBudget(512, 128, 2, prefill_token_limit=lambda n, w: 10 * n)
    assert budget.prefill_chunk(300) == 300  # no decodes yet: the step budget only
    budget.take(1, True)
    budget.take(1, True)
    assert budget.prefill_chunk(300) == 20
    budget.take(15, False)
    assert budget.prefill_chunk(300) == 5  # 20 in all
    budget.take(5, False)
    assert budget.prefill_chunk(300) == 0  # the limit, and max_num_partial_prefills
    budget.give_back(5, False)
    assert budget.num_prefill_tokens == 15 and budget.prefill_chunk(300) == 5  # a preempted chunk's room


def _scheduler(bm: BlockManager, max_num_seqs: int, max_num_batched_tokens: int, ratio: float,
               max_model_len: int = 512, max_long_gap_fraction: float = 0.0) -> Scheduler:
    """A scheduler with the token knobs at 128 tokens x 2 prompts and the measured bound at ``ratio``."""
    config = SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len,
                             long_prefill_token_threshold=128, max_num_partial_prefills=2,
                             max_prefill_step_ratio=ratio, max_long_gap_fraction=max_long_gap_fraction)
    return Scheduler(bm, config, [2])


def _request(rid: str, n: int, first: int) -> Request:
    return Request(rid, list(range(first, first + n)), SamplingParams(max_tokens=50, ignore_eos=True))


def test_the_scheduler_bounds_a_decode_steps_prefill_by_measured_cost() -> None:
    scheduler = _scheduler(BlockManager(256, 4), max_num_seqs=8, max_num_batched_tokens=512, ratio=2.0)
    for i in range(4):
        scheduler.add_request(_request(f"d{i}", 5, 10 * i))  # distinct prompts: no cache hits
    first = scheduler.schedule()
    assert first.num_new_tokens == [5, 5, 5, 5]  # no decodes: whole prompts
    scheduler.update(first, [7, 7, 7, 7])
    _steps(scheduler.step_cost, [(4, 0), (0, 20), (3, 16), (4, 8), (2, 0), (4, 30), (1, 12), (4, 0)])
    scheduler.add_request(_request("long", 100, 100))
    step = scheduler.schedule()
    # 34 ms / 1.6 ms = 21, x (1 + 1 waiting / 4 decodes)
    assert step.num_decodes == 4 and step.num_new_tokens == [1, 1, 1, 1, 26]


def _four_decoding(ratio: float, max_num_seqs: int = 16) -> Scheduler:
    """A scheduler with 4 streams decoding and step costs fitted (34 ms decode steps of 4, 1.6 ms a
    prefill token: the measured limit is 21 tokens)."""
    scheduler = _scheduler(BlockManager(512, 4), max_num_seqs=max_num_seqs, max_num_batched_tokens=512,
                           ratio=ratio)
    for i in range(4):
        scheduler.add_request(_request(f"d{i}", 5, 10 * i))
    first = scheduler.schedule()
    scheduler.update(first, [7, 7, 7, 7])
    _steps(scheduler.step_cost, [(4, 0), (0, 20), (3, 16), (4, 8), (2, 0), (4, 30), (1, 12), (4, 0)])
    return scheduler


def test_a_burst_takes_the_whole_token_budget_while_the_waiting_outnumber_the_decodes() -> None:
    """4 decodes and 6 requests arriving at once: the prompts join as in a step without decodes,
    up to the 512-token budget (not the measured 21 tokens, nor the knobs' 2 prompts of 128): five
    whole ones and 8 tokens of the sixth, which, then alone waiting against 9 decodes, is bounded
    again."""
    scheduler = _four_decoding(2.0)
    for i in range(6):
        scheduler.add_request(_request(f"new{i}", 100, 100 + 100 * i))
    burst = scheduler.schedule()
    assert burst.num_decodes == 4 and burst.num_new_tokens == [1] * 4 + [100] * 5 + [8]
    scheduler.update(burst, [7] * 9)
    assert scheduler.num_waiting == 0
    bounded = scheduler.schedule()  # its 92 tokens left: D(9) = 51.5 ms / 1.6 ms
    assert bounded.num_decodes == 9 and bounded.num_new_tokens[9:] == [32]


def test_a_step_caps_its_padded_prefill_rows() -> None:
    """Chunks are padded to the step's longest (``B_p x Q_p`` attention rows): with a 64-token
    budget, a 60-token prompt and 3-token ones join while chunks x 60 stays within 128 rows, so two
    short ones wait instead of making 4 x 60 rows for 69 real tokens."""
    budget = StepBudget(64, 0, 64, max_padded_prefill_rows=128)
    assert budget.prefill_chunk(60) == 60
    budget.take(60, False)
    assert budget.prefill_chunk(3) == 3
    budget.take(3, False)
    assert budget.prefill_chunk(3) == 0  # 3 x 60 = 180 rows
    first = StepBudget(512, 0, 512, max_padded_prefill_rows=512)
    first.take(100, False)
    first.take(100, False)
    assert first.prefill_chunk(300) == 170  # 3 chunks of at most 170 rows
    assert first.longest_prefill_chunk == 100


def test_a_full_batch_is_no_burst() -> None:
    """With ``max_num_seqs`` reached, the waiting requests cannot start, so however many they are
    the step is bounded: a running prompt's next chunk gets the measured limit, not the budget."""
    scheduler = _four_decoding(2.0, max_num_seqs=5)
    scheduler.add_request(_request("long", 300, 100))
    first = scheduler.schedule()  # 1 waiting against 4 decodes: bounded, 34 ms x 1.25 / 1.6 ms
    assert first.num_new_tokens == [1, 1, 1, 1, 26]
    scheduler.update(first, [7] * 4)
    for i in range(6):
        scheduler.add_request(_request(f"new{i}", 100, 1000 + 100 * i))
    step = scheduler.schedule()  # 6 waiting, no room: bounded (widened by them), 34 ms x 2.5 / 1.6 ms
    assert step.num_decodes == 4 and step.num_new_tokens == [1, 1, 1, 1, 53]


def test_without_the_measured_bound_a_burst_keeps_the_token_knobs() -> None:
    """``max_prefill_step_ratio`` 0 (vLLM's policy): the knobs hold in every step with decodes,
    burst or not: 2 prompts of at most 128 tokens."""
    scheduler = _four_decoding(0.0)
    for i in range(6):
        scheduler.add_request(_request(f"new{i}", 100, 100 + 100 * i))
    step = scheduler.schedule()
    assert step.num_decodes == 4 and step.num_new_tokens == [1, 1, 1, 1, 100, 100]


def test_a_burst_into_an_idle_engine_is_prefilled_together() -> None:
    """The first of 8 simultaneous requests reached the idle engine alone; the other 7 then
    outnumber its one decode, so they all join the next step (2048-token budget) and take their
    first tokens together, instead of two 128-token chunks a step beside the growing decodes."""
    scheduler = _scheduler(BlockManager(1024, 16), max_num_seqs=16, max_num_batched_tokens=2048,
                           ratio=2.0, max_model_len=1024)
    scheduler.add_request(_request("r0", 134, 0))
    first = scheduler.schedule()
    assert first.num_new_tokens == [134]
    scheduler.update(first, [7])
    for i in range(1, 8):
        scheduler.add_request(_request(f"r{i}", 134, 1000 * i))
    burst = scheduler.schedule()
    assert burst.num_decodes == 1 and burst.num_new_tokens == [1] + [134] * 7
    scheduler.update(burst, [7] * 8)
    assert scheduler.schedule().num_new_tokens == [1] * 8  # all decoding, none left


def test_a_share_of_long_gaps_lifts_the_bound_for_an_occasional_prompt() -> None:
    """``long_gap_fraction``: the bound is lifted for a step while the inter-token gaps of steps
    that ran longer than ``max_ratio`` decode steps stay within that share of all recent gaps
    (p99.5 ITL within the ratio at 0.005), so one conversation's next turn is prefilled in one
    step beside another's decode instead of in floor-sized chunks, while frequent arrivals stay
    bounded."""
    model = StepCostModel(2.0, min_steps=4, long_gap_fraction=0.01, gap_forgetting=1.0)
    _steps(model, [(4, 0), (0, 20), (3, 16), (4, 8), (2, 0), (4, 12), (1, 12), (4, 0)])
    assert model.prefill_token_limit(1) == 16  # 22 gaps, none long: a long one would be 1 in 23
    _steps(model, [(1, 0)] * 77)  # 99 gaps, none long: a long gap for 1 decode would be 1 in 100
    assert model.prefill_token_limit(1) is None
    assert model.prefill_token_limit(2) == 16  # 2 long gaps in 101: above 1%
    model.observe(1, 60, 0.020 + 0.0035 + 0.0016 * 60)  # 119.5 ms against 2 x 23.5: a long gap
    assert model.prefill_token_limit(1) == 16  # spent: bounded again
    _steps(model, [(1, 0)] * 98)
    assert model.prefill_token_limit(1) == 16  # 2 in 199
    _steps(model, [(1, 0)] * 5)
    assert model.prefill_token_limit(1) is None  # 2 in 204
    model.observe(1, 10, 0.020 + 0.0035 + 0.0016 * 10)  # a bounded step within the ratio: not long
    assert model.prefill_token_limit(1) is None
    assert StepCostModel(2.0, long_gap_fraction=0).long_gap_fraction == 0  # 0: never lifted
    with pytest.raises(ValueError, match="long_gap_fraction"):
        StepCostModel(2.0, long_gap_fraction=1.0)


def test_the_scheduler_lets_an_occasional_prompt_in_whole_while_long_gaps_are_rare() -> None:
    """4 streams decode; after 400 of their gaps with none long, a 100-token prompt joins one step
    whole (the token knob's 128 allow it; the measured bound alone would give 21); that step's
    time over 2 decode steps makes 4 long gaps in 404, so the next prompt is bounded again (widened by
    the one request waiting)."""
    scheduler = _scheduler(BlockManager(256, 4), max_num_seqs=8, max_num_batched_tokens=512, ratio=2.0,
                           max_long_gap_fraction=0.01)
    scheduler.step_cost.gap_forgetting = 1.0  # gaps counted without forgetting: exact shares
    for i in range(4):
        scheduler.add_request(_request(f"d{i}", 5, 10 * i))
    scheduler.update(scheduler.schedule(), [7, 7, 7, 7])
    cost = scheduler.step_cost
    _steps(cost, [(0, 20), (3, 16), (4, 8), (2, 0), (4, 12), (1, 12)])
    _steps(cost, [(4, 0)] * 96)  # 4 + 3 + 4 + 2 + 4 + 1 + 384 = 402 gaps, none long
    scheduler.add_request(_request("turn", 100, 100))
    step = scheduler.schedule()
    assert step.num_decodes == 4 and step.num_new_tokens == [1, 1, 1, 1, 100]
    _steps(cost, [(4, 100)])  # 214 ms against 2 x 34 ms: 4 long gaps
    scheduler.update(step, [7] * 5)
    scheduler.add_request(_request("next", 100, 300))
    step = scheduler.schedule()
    # 37.5 ms / 1.6 ms = 23, x (1 + 1 waiting / 5 decodes)
    assert step.num_decodes == 5 and step.num_new_tokens == [1, 1, 1, 1, 1, 28]
