"""Shared helpers of the engine tests: reference generation and the near-tie-aware comparison."""

from __future__ import annotations

from collections.abc import Sequence

from proxy.engine.core import EngineCore
from proxy.engine.selfcheck import greedy_reference as reference_greedy  # noqa: F401 (the engine tests' reference)
from proxy.sampling import SamplingParams

TIE_TOLERANCE = 1e-4


def assert_greedy_matches(
    engine_ids: list[int], ref_ids: list[int], gaps: list[float], label: str, tolerance: float = TIE_TOLERANCE
) -> None:
    """Token-for-token equality; a divergence is accepted only at a near-tie (top-2 gap <
    ``tolerance``, 1e-4 for fp32 logits) of the reference, and then only from that position on."""
    for pos, (a, b) in enumerate(zip(engine_ids, ref_ids)):
        if a != b:
            assert gaps[pos] < tolerance, (
                f"{label}: diverged at token {pos} ({a} != {b}) where the reference's top-2 gap is "
                f"{gaps[pos]:.3g} (not a near-tie)"
            )
            return
    assert len(engine_ids) == len(ref_ids), f"{label}: length {len(engine_ids)} != {len(ref_ids)}"


def assert_blocks_conserved(core: EngineCore) -> None:
    """Blocks held by live requests (each counted once) + free blocks == the pool, and every held
    block's reference count equals the number of block tables listing it."""
    bm = core.block_manager
    holders: dict[int, int] = {}
    for request in core.scheduler.requests.values():
        for block_id in request.block_ids:
            holders[block_id] = holders.get(block_id, 0) + 1
    assert len(holders) + core.num_free_blocks == core.num_total_blocks
    for block_id, count in holders.items():
        assert bm.ref_count(block_id) == count, (block_id, bm.ref_count(block_id), count)


def run_staggered(
    core: EngineCore,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    arrival_steps: Sequence[int],
    check_blocks: bool = True,
) -> dict[str, list[int]]:
    """Submit prompt i at engine step ``arrival_steps[i]``; run to completion; return ids per request.

    Checks after every step that held + free blocks == total (a block shared by several requests
    through the prefix cache counts once), and at the end that all blocks are free.
    """
    results: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    finished: set[str] = set()
    step = 0
    pending = sorted(range(len(prompts)), key=lambda i: arrival_steps[i])
    while pending or core.has_unfinished():
        while pending and arrival_steps[pending[0]] <= step:
            i = pending.pop(0)
            core.add_request(str(i), prompts[i], params)
        for out in core.step():
            assert out.request_id not in finished
            results[out.request_id].extend(out.new_token_ids)
            if out.finished:
                assert out.finish_reason in ("stop", "length"), out
                finished.add(out.request_id)
        if check_blocks:
            assert_blocks_conserved(core)
        step += 1
        assert step < 10_000, "engine did not finish"
    assert finished == set(results)
    assert core.num_free_blocks == core.num_total_blocks
    return results
