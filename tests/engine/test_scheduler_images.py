"""The vision encoder's work in the step budget, and a failed encoding, without a model (no torch):
the chunk that reaches image pieces not encoded yet costs their encoder cost more under the prefill
bound, piece by piece, and stops before a piece it has no room for; a request whose images failed ends
alone, with its blocks out of the prefix cache."""

from __future__ import annotations

import pytest

from proxy.engine.block_manager import BlockManager
from proxy.engine.request import IMAGE_ENCODING_FAILED, Request
from proxy.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput, StepBudget
from proxy.media.prompt import EncoderPiece, PromptImages
from proxy.sampling import SamplingParams

PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
FIRST, COUNT = 5, 8  # the image's placeholder tokens: prompt positions 5..12


def image_request(rid: str, n: int = 30, image_hash: str = "h0") -> Request:
    ids = [10 + i for i in range(n)]
    for p in range(FIRST, FIRST + COUNT):
        ids[p] = 3  # the image token
    return Request(rid, ids, PARAMS, images=PromptImages.of(ids, 3, [COUNT], [image_hash], {}))


def make(cost: int, threshold: int = 16, prefix_caching: bool = False) -> Scheduler:
    """A scheduler whose images cost ``cost`` until a step computed their first placeholder (the
    model runner's ``pending_cost`` once they are encoded: 0)."""
    bm = BlockManager(64, 4, prefix_caching)
    config = SchedulerConfig(8, 64, 256, long_prefill_token_threshold=threshold)
    sched = Scheduler(bm, config, [2])
    sched.encoder_cost = lambda r, piece: 0 if r.num_computed_tokens > FIRST else cost
    return sched


def step(sched: Scheduler) -> SchedulerOutput:
    out = sched.schedule()
    sched.update(out, [7] * len(out.sample_indices))
    return out


def with_a_decode(sched: Scheduler) -> None:
    """One running request past its prompt, so the next steps (31) have a decode."""
    sched.add_request(Request("a", [10, 11, 12], SamplingParams(max_tokens=32, ignore_eos=True)))
    assert step(sched).num_new_tokens == [3]


@pytest.mark.parametrize(("cost", "chunks", "charged"), [
    (0, [16, 14], [0, 0]),  # a text prompt of the same length: the threshold alone
    (10, [6, 16, 8], [10, 0, 0]),  # the image and one token past it fit beside its 10
    (12, [5, 4, 16, 5], [0, 12, 0, 0]),  # not with 12: the chunk stops before it, the next takes it
    (40, [5, 1, 16, 8], [0, 40, 0, 0]),  # over the bound: encoded alone, with one token
])
def test_encoder_cost_counts_against_the_prefill_bound(cost: int, chunks: list[int],
                                                       charged: list[int]) -> None:
    sched = make(cost)
    with_a_decode(sched)
    sched.add_request(image_request("img"))
    got, encoder = [], []
    while not sched.requests["img"].output_token_ids:
        out = step(sched)
        assert out.requests[0].request_id == "a" and out.num_new_tokens[0] == 1  # the decode goes on
        got.append(out.num_new_tokens[1])
        encoder.append(out.num_encoder_tokens)
    assert got == chunks and encoder == charged and sum(got) == 30


def test_encoder_cost_is_free_without_decodes_and_shares_the_measured_limit() -> None:
    sched = make(cost=100)
    sched.add_request(image_request("img"))
    out = step(sched)  # no decode waits: the whole prompt, images and all
    assert out.num_new_tokens == [30] and out.num_encoder_tokens == 100
    budget = StepBudget(64, 0, 4, prefill_token_limit=lambda d, w: 20)
    budget.take(1, True)
    assert budget.prefill_chunk(30, 0, [(5, 10)]) == 10  # 20 - 10 for the image
    budget.take(10, False, encoder_cost=10)
    assert budget.num_prefill_tokens == 20
    assert budget.prefill_chunk(30) == 0  # the limit is spent, the image's share included
    budget.give_back(10, False, encoder_cost=10)
    assert budget.num_prefill_tokens == 0 and budget.prefill_chunk(30) == 20


def pieces_request(rid: str, n: int = 40) -> Request:
    """Four pieces of 4 placeholders each (an image's views), 2 text tokens apart: positions 5-8,
    11-14, 17-20 and 23-26."""
    ids = [10 + i for i in range(n)]
    for view in range(4):
        for p in range(5 + 6 * view, 9 + 6 * view):
            ids[p] = 3
    pieces = [EncoderPiece(f"h0#view{view}", 4) for view in range(4)]
    return Request(rid, ids, PARAMS, images=PromptImages.of(ids, 3, [16], ["h0"], {}, pieces))


@pytest.mark.parametrize(("cost", "chunks", "charged"), [
    # one view and the tokens up to the next fit the 16 beside its cost of 6: one view a step
    (6, [10, 7, 6, 10, 7], [6, 6, 6, 6, 0]),
    # a view over the bound: the chunk stops before it, the next takes it alone with one token
    (20, [5, 1, 5, 1, 5, 1, 5, 1, 16], [0, 20, 0, 20, 0, 20, 0, 20, 0]),
])
def test_an_images_pieces_are_encoded_over_several_steps(cost: int, chunks: list[int],
                                                         charged: list[int]) -> None:
    sched = make(cost)
    sched.encoder_cost = lambda r, piece: 0 if r.num_computed_tokens > 5 + 6 * piece else cost
    with_a_decode(sched)
    sched.add_request(pieces_request("img"))
    got, encoder = [], []
    while not sched.requests["img"].output_token_ids:
        out = step(sched)
        assert out.num_new_tokens[0] == 1  # the decode goes on
        got.append(out.num_new_tokens[1])
        encoder.append(out.num_encoder_tokens)
    assert got == chunks and encoder == charged and sum(got) == 40


def test_prompt_images_map_positions_to_pieces() -> None:
    images = pieces_request("r").images
    assert images is not None and images.piece_starts == (0, 4, 8, 12, 16)
    assert list(images.pieces_in(0, 5)) == [] and list(images.pieces_in(0, 6)) == [0]
    assert list(images.pieces_in(8, 10)) == [0, 1, 2]  # 8 is piece 0's last, 17 piece 2's first
    assert list(images.pieces_in(9, 2)) == []  # the text between two views
    assert images.piece_first_at_or_after(1, 12) == 12 and images.piece_first_at_or_after(1, 9) == 11
    assert images.piece_end(3) == 27 and images.piece_of_row(7) == 1
    assert list(images.piece_rows(2)) == [8, 9, 10, 11]
    whole = image_request("w").images  # no pieces given: one of every image
    assert whole is not None and len(whole.pieces) == 1 and whole.pieces[0].rows == COUNT
    with pytest.raises(ValueError, match="pieces fill 4 rows, but the prompt has 8"):
        PromptImages((5, 6, 7, 8, 9, 10, 11, 12), (8,), ("h",), {}, (EncoderPiece("h", 4),))


def test_failed_images_end_their_request_alone_and_leave_the_prefix_cache() -> None:
    sched = make(cost=0, threshold=0, prefix_caching=True)
    with_a_decode(sched)
    sched.add_request(image_request("img"))
    sched.add_request(image_request("other", image_hash="h1"))
    out = sched.schedule()
    img, other = sched.requests["img"], sched.requests["other"]
    bm = sched.block_manager
    assert [r.request_id for r in out.requests] == ["a", "img", "other"] and bm.num_cached_blocks == 14
    failed = sched.fail_images({img: "the encoder failed"}, IMAGE_ENCODING_FAILED)
    assert [(o.request_id, o.finish_reason, o.error, o.error_code) for o in failed] == [
        ("img", "error", "the encoder failed", IMAGE_ENCODING_FAILED)]
    outs = sched.update(out, [7] * len(out.sample_indices))
    assert [o.request_id for o in outs] == ["a", "other"]  # the others sampled as usual
    assert bm.num_cached_blocks == 8  # img's six blocks from its image on are no longer found ...
    assert len(bm.find_cached_prefix(image_request("again"))) == 1  # (the text before it was computed)
    assert len(bm.find_cached_prefix(image_request("again", image_hash="h1"))) == 7  # ... other's are
    assert "img" not in sched.requests and other.num_computed_tokens == 30
