"""SchedulerConfig (the scheduler's knobs, from Settings) and StepBudget.for_step's rule on a StepState
(proxy.engine.scheduler.config, proxy.engine.scheduler.budget); no torch."""

from __future__ import annotations

import pytest

from proxy.engine.scheduler import SchedulerConfig, StepBudget, StepCostModel, StepState
from proxy.settings import Settings


def test_from_settings_takes_every_scheduler_knob() -> None:
    settings = Settings(max_num_seqs=5, max_num_batched_tokens=300, long_prefill_token_threshold=40,
                        max_num_partial_prefills=3, max_prefill_step_ratio=1.5, max_long_gap_fraction=0.02)
    config = SchedulerConfig.from_settings(settings, max_model_len=700, prefill_token_multiple=64)
    assert config == SchedulerConfig(5, 300, 700, long_prefill_token_threshold=40, max_num_partial_prefills=3,
                                     max_prefill_step_ratio=1.5, max_long_gap_fraction=0.02,
                                     prefill_token_multiple=64, watermark=0.01)
    model = StepCostModel.from_config(config)
    assert (model.max_ratio, model.long_gap_fraction, model.multiple) == (1.5, 0.02, 64)


def test_a_bare_config_has_every_prefill_bound_off() -> None:
    config = SchedulerConfig(8, 64, 128)
    assert (config.long_prefill_token_threshold, config.max_num_partial_prefills) == (0, 1_000_000)
    assert (config.max_prefill_step_ratio, config.max_long_gap_fraction) == (0.0, 0.0)
    assert StepCostModel.from_config(config).prefill_token_limit(4, 100) is None


@pytest.mark.parametrize(("field", "value"), [
    ("max_num_seqs", 0), ("max_num_batched_tokens", 0), ("max_num_partial_prefills", 0),
    ("prefill_token_multiple", 0), ("long_prefill_token_threshold", -1), ("watermark", 1.0),
    ("max_prefill_step_ratio", 0.5), ("max_long_gap_fraction", 1.0),
])
def test_out_of_range_knobs_are_refused_by_name(field: str, value: float) -> None:
    knobs = {"max_num_seqs": 8, "max_num_batched_tokens": 64, "max_model_len": 128, field: value}
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**knobs)  # type: ignore[arg-type]


def test_the_watermark_is_a_share_of_the_pool_and_at_least_one_block() -> None:
    config = SchedulerConfig(8, 64, 128)
    assert [config.watermark_blocks(n) for n in (10, 199, 200, 1000)] == [1, 1, 2, 10]


def _limit(num_decodes: int, num_waiting: int) -> int:
    return 10 * num_decodes + num_waiting


def _config(ratio: float) -> SchedulerConfig:
    return SchedulerConfig(16, 512, 1024, long_prefill_token_threshold=128, max_num_partial_prefills=2,
                           max_prefill_step_ratio=ratio)


def test_for_step_lifts_the_bounds_in_a_burst_only() -> None:
    """4 decodes; 5 waiting with room for all is a burst (whole budget, no knobs); room for 4 only, or
    the measured bound off, is not (128-token chunks, 2 prompts, the measured limit)."""
    cost = StepCostModel.from_config(_config(2.0))
    burst = StepBudget.for_step(_config(2.0), cost, StepState(num_decodes=4, num_waiting=5, num_free_seqs=12))
    assert (burst.num_tokens_left, burst.long_prefill_token_threshold, burst.max_num_partial_prefills,
            burst.prefill_token_limit, burst.max_padded_prefill_rows) == (512, 0, 512, None, 1024)
    full_batch = StepBudget.for_step(_config(2.0), cost, StepState(4, 5, num_free_seqs=4))
    ratio_off = StepBudget.for_step(_config(0.0), cost, StepState(4, 5, num_free_seqs=12))
    for bounded in (full_batch, ratio_off):
        assert (bounded.num_tokens_left, bounded.long_prefill_token_threshold,
                bounded.max_num_partial_prefills, bounded.max_padded_prefill_rows) == (512, 128, 2, 1024)
        assert bounded.prefill_token_limit == cost.prefill_token_limit
    budget = StepBudget(512, 128, 2, prefill_token_limit=_limit)
    budget.take(1, True)
    assert budget.prefill_chunk(300, num_waiting=3) == 13  # the limit reads the waiting count it is given
    assert budget.prefill_chunk(300) == 10
