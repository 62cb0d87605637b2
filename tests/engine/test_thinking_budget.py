"""The thinking budget (``SamplingParams.thinking_budget``): after ``max_tokens`` thinking tokens the
end marker is forced token by token, then the output goes on as the model writes it; the model's own
earlier close ends the budget; other requests of the batch are untouched."""

from __future__ import annotations

import pytest

from proxy.engine.core import EngineCore
from proxy.engine.thinking_budget import ThinkingBudgetState
from proxy.sampling import SamplingParams, ThinkingBudget
from proxy.settings import Settings

from .test_structured import MODES, compiler, eos, model, run_engine, run_sampler

END, A, B, OPEN = 350, 351, 352, 353  # plain tokens of the test tokenizer standing in for markers
PROMPT = [5, 6, 7, 8]


def forced_run(budget: ThinkingBudget, sampled: list[int]) -> list[int]:
    """The output when the model would write ``sampled`` and the budget forces where it does."""
    state, out = ThinkingBudgetState(budget), []
    for token in sampled:
        forced = state.forced_token(out)
        out.append(token if forced is None else forced)
    return out


def test_the_state_forces_the_marker_at_the_budget_and_only_there() -> None:
    inside = ThinkingBudget(3, (A, B))
    assert forced_run(inside, [9] * 8) == [9, 9, 9, A, B, 9, 9, 9]
    assert forced_run(inside, [9, A, B, 9, 9, 9, 9]) == [9, A, B, 9, 9, 9, 9]  # closed by the model
    assert forced_run(inside, [9, 9, A, 9, 9, 9, 9]) == [9, 9, A, A, B, 9, 9]  # begun marker stays
    assert forced_run(ThinkingBudget(0, (END,)), [9, 9, 9]) == [END, 9, 9]
    opened = ThinkingBudget(2, (END,), starts_in_reasoning=False, start_ids=(OPEN, 7))
    assert forced_run(opened, [OPEN, 7, 9, 9, 9, 9]) == [OPEN, 7, 9, 9, END, 9]
    assert forced_run(opened, [OPEN, 9, 9, 9, 9]) == [OPEN, 9, 9, 9, 9]  # not the whole open marker
    assert forced_run(opened, [9] * 6) == [9] * 6  # no thinking: nothing to cap
    assert forced_run(ThinkingBudget(1, (END,), starts_in_reasoning=False), [9] * 4) == [9] * 4
    with pytest.raises(ValueError, match="thinking budget"):
        ThinkingBudget(-1, (END,))
    with pytest.raises(ValueError, match="thinking budget"):
        ThinkingBudget(2, ())


@pytest.mark.parametrize("mode", list(MODES))
def test_every_sampling_mode_is_forced_and_its_neighbours_untouched(mode: str) -> None:
    """Through the batched sampler: the budgeted rows' first ``n`` tokens are the unbudgeted run's
    (the draw still happens), then the marker; a row without a budget is the same in both runs."""
    base = MODES[mode]
    for n, marker in ((0, (END,)), (4, (END,)), (7, (A, B))):
        budgeted = SamplingParams(**{**base.__dict__, "thinking_budget": ThinkingBudget(n, marker)})
        plain = SamplingParams(**{**base.__dict__, "seed": 99})
        for seed in range(2):
            free = run_sampler([base, plain], steps=20, seed=seed)
            capped = run_sampler([budgeted, plain], steps=20, seed=seed)
            assert capped[1] == free[1]
            head = free[0][:n]
            if eos() in head or any(tuple(head[i:i + len(marker)]) == marker for i in range(n)):
                continue
            assert capped[0][:n + len(marker)] == head + list(marker), (mode, n, seed)


def test_engine_output_with_a_budget_beside_one_without() -> None:
    """Greedy through the engine: exactly ``n`` thinking tokens, the marker, then the model's
    continuation; the unbudgeted request's tokens equal its solo run."""
    settings = Settings(num_kv_blocks=128, block_size=4, seed=0)

    def engine() -> EngineCore:
        return EngineCore(model(), settings, [eos()], 300, grammar_compiler=compiler())

    greedy = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    other = SamplingParams(max_tokens=30, temperature=0.9, seed=7, ignore_eos=True)
    solo = run_engine(engine(), {"free": (PROMPT, greedy), "other": ([9, 8, 7], other)})
    capped = SamplingParams(**{**greedy.__dict__, "thinking_budget": ThinkingBudget(6, (A, B))})
    both = run_engine(engine(), {"capped": (PROMPT, capped), "other": ([9, 8, 7], other)})
    assert both["other"] == solo["other"]
    free_ids, capped_ids = solo["free"][0], both["capped"][0]
    assert capped_ids[:8] == free_ids[:6] + [A, B] and len(capped_ids) == 30
    after = run_engine(engine(), {"x": (PROMPT + free_ids[:6] + [A, B], greedy)})["x"][0]
    assert capped_ids[8:] == after[:22]  # the continuation is the model's own after the marker
