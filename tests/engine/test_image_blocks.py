"""Bidirectional attention within an image during prefill (Gemma 3), without a model: the image blocks
of a prompt (runs of consecutive placeholders), the masks with exact values (full layers
``OR(causal, block)``, sliding layers ``AND(window, OR(causal, block))``, as transformers'
``create_masks_for_vision_model``), a step's block ids from its rows, and a scheduler that never ends
a prompt chunk inside a block."""

from __future__ import annotations

import pytest
import torch

from proxy.engine.block_manager import BlockManager
from proxy.engine.execution.attention import PagedAttentionMetadata
from proxy.engine.execution.attention.metadata import pattern_mask
from proxy.engine.execution.image_blocks import add_prefill_image_blocks
from proxy.engine.execution.step_inputs import StepRows, build_step_inputs
from proxy.engine.request import Request
from proxy.engine.scheduler import Scheduler, SchedulerConfig
from proxy.media.prompt import PromptImages
from proxy.sampling import SamplingParams

PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
IMAGE = 3  # the placeholder token


def prompt(n: int, blocks: list[tuple[int, int]]) -> tuple[list[int], PromptImages]:
    """``n`` text tokens with the placeholders of one image per ``(first, count)`` of ``blocks``."""
    ids = [10 + i for i in range(n)]
    for first, count in blocks:
        ids[first: first + count] = [IMAGE] * count
    return ids, PromptImages.of(ids, IMAGE, [c for _, c in blocks], [f"h{i}" for i in range(len(blocks))], {})


def test_blocks_are_runs_of_consecutive_placeholders() -> None:
    _, images = prompt(30, [(4, 3), (10, 5), (15, 2)])  # the last two images touch: one block
    assert images.blocks == ((4, 6), (10, 16))
    assert images.spans() == [(4, 6), (10, 14), (15, 16)]


@pytest.mark.parametrize(("start", "num_new", "want"), [
    (0, 4, 4),  # ends before the first block
    (0, 5, 4),  # would end inside it: cut back to its first token
    (0, 7, 7),  # ends right after it
    (4, 1, 3),  # starts at it: runs on to its end
    (5, 1, 2),  # starts inside it (a prefix-cache hit): runs on to its end
    (7, 5, 3),  # would end inside the second block: cut back
    (10, 2, 7), (12, 30, 30),
])
def test_chunk_end_outside_blocks(start: int, num_new: int, want: int) -> None:
    _, images = prompt(40, [(4, 3), (10, 7)])
    assert images.chunk_end_outside_blocks(start, num_new) == want


def test_pattern_mask_with_an_image_block_exact_values() -> None:
    """Positions 0..5, the image block 1..4: a query in the block sees all of it (full layer); with
    a window of 3 only keys ``k > p - 3`` of that (sliding layer); text sees causally."""
    block = torch.tensor([-1, 0, 0, 0, 0, -1])
    same = (block[:, None] == block[None, :]) & (block[:, None] >= 0)
    pos, keys = torch.arange(6)[:, None], torch.arange(6)[None, :]
    full = pattern_mask(keys, pos, None, None, same).int().tolist()
    assert full == [[1, 0, 0, 0, 0, 0],
                    [1, 1, 1, 1, 1, 0],
                    [1, 1, 1, 1, 1, 0],
                    [1, 1, 1, 1, 1, 0],
                    [1, 1, 1, 1, 1, 0],
                    [1, 1, 1, 1, 1, 1]]
    sliding = pattern_mask(keys, pos, 3, None, same).int().tolist()
    assert sliding == [[1, 0, 0, 0, 0, 0],
                       [1, 1, 1, 1, 1, 0],
                       [1, 1, 1, 1, 1, 0],
                       [0, 1, 1, 1, 1, 0],
                       [0, 0, 1, 1, 1, 0],
                       [0, 0, 0, 1, 1, 1]]
    assert pattern_mask(keys, pos, 3, None).int().tolist()[1] == [1, 1, 0, 0, 0, 0]  # causal without


def request_at(rid: str, ids: list[int], images: PromptImages | None, computed: int,
               blocks: list[int]) -> Request:
    request = Request(rid, ids, PARAMS, images=images)
    request.num_computed_tokens = computed
    request.block_ids = blocks
    return request


def step_meta(rows: StepRows) -> PagedAttentionMetadata:
    return build_step_inputs(rows, None, 4, 2).meta  # type: ignore[arg-type]  # the pools are not read


def test_a_step_gets_the_block_ids_of_its_prefill_rows_only() -> None:
    """A decode row, a text chunk and two image chunks (one from a prefix-cache hit inside its
    block): each chunk's queries see their own block's keys up to the chunk's end, nothing else."""
    ids, images = prompt(12, [(2, 4), (8, 2)])
    decode = request_at("d", [5, 6, 7], None, 2, [9])
    text = request_at("t", [5, 6, 7, 8, 9], None, 0, [10, 11])
    whole = request_at("w", ids, images, 0, [1, 2, 3])  # positions 0..6: the first block whole
    hit = request_at("h", ids, images, 4, [1, 4, 5])  # positions 4..9: the rest of it, the second block
    rows = StepRows([decode, text, whole, hit], [2, 0, 0, 4], [1, 5, 7, 6], [0, 1, 2, 3], 1)
    meta = step_meta(rows)
    plain = meta.prefill_mask.clone()
    assert add_prefill_image_blocks(meta, rows)
    assert meta.prefill_key_blocks is not None and meta.prefill_query_blocks is not None
    assert meta.prefill_key_blocks[:, :12].tolist() == [
        [-1] * 12,
        [-1, -1, 0, 0, 0, 0, -1, -1, -1, -1, -1, -1],
        [-1, -1, 0, 0, 0, 0, -1, -1, 1, 1, -1, -1]]
    assert (meta.prefill_key_blocks[:, 12:] == -1).all()  # the key padding of KEY_PAD
    assert meta.prefill_query_blocks.tolist() == [[-1] * 7, [-1, -1, 0, 0, 0, 0, -1],
                                                  [0, 0, -1, -1, 1, 1, 1]]  # padding repeats the last
    mask = meta.prefill_mask.view(3, 2, 7, -1)[:, 0, :, :12].int()  # the first of the GQA group of 2
    assert torch.equal(mask[0], plain.view(3, 2, 7, -1)[0, 0, :, :12].int())  # text: causal
    assert mask[1, 2].tolist() == [1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0]  # position 2 sees 3..5
    assert mask[1, 6].tolist() == [1] * 7 + [0] * 5  # after the image: causal
    assert mask[2, 0].tolist() == [1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0]  # position 4 (cached 2, 3)
    assert mask[2, 4].tolist() == [1] * 10 + [0, 0]  # position 8 sees 9, no later block
    window = meta.prefill_mask_for(3, None, 2).view(3, 2, 7, -1)[2, 1, :, :12].int()
    assert window[0].tolist() == [0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0]  # 2 (p - 3 < k) to 5
    assert window[3].tolist() == [0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0]  # position 7, text: its window


def test_a_step_without_image_rows_builds_nothing() -> None:
    ids, images = prompt(12, [(6, 4)])
    rows = StepRows([request_at("w", ids, images, 0, [1, 2, 3])], [0], [6], [0], 0)  # text before it
    meta = step_meta(rows)
    assert not add_prefill_image_blocks(meta, rows) and meta.prefill_key_blocks is None


def scheduler(budget: int, whole: bool) -> Scheduler:
    sched = Scheduler(BlockManager(64, 4, False), SchedulerConfig(8, budget, 256), [2])
    sched.whole_image_blocks = whole
    return sched


@pytest.mark.parametrize(("budget", "whole", "chunks"), [
    (10, False, [10, 10, 10, 10]),
    (10, True, [6, 10, 4, 10, 10]),  # cut back before each block that would be split
    (5, True, [5, 1, 8, 5, 1, 8, 5, 5, 2]),  # a block longer than the budget: run whole, past it
])
def test_prompt_chunks_never_end_inside_an_image_block(budget: int, whole: bool, chunks: list[int]) -> None:
    ids, images = prompt(40, [(6, 8), (20, 8)])
    sched = scheduler(budget, whole)
    sched.add_request(Request("img", ids, PARAMS, images=images))
    got = []
    while sched.requests["img"].is_in_prompt:
        out = sched.schedule()
        sched.update(out, [7] * len(out.sample_indices))
        got.append(out.num_new_tokens[0])
    assert got == chunks
