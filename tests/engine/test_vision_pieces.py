"""The vision encoder's work in pieces (``proxy.media.pieces``): each family's pieces encode to the rows
of its whole prompt, and a large image's views are encoded over several steps beside a running stream
(tiny SmolVLM, a 128 x 128 image: 4 x 4 tiles and a global view, 17 views of 4 placeholders), each
step within the prefill bound, with the greedy text of ``generate()`` and of a run without a bound."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from vision_fixtures import FAMILIES, IMAGE_SIZE, build_tiny_smolvlm, idefics3_tokenizer, smolvlm_processor

from proxy.engine.core import EngineCore
from proxy.engine.scheduler import SchedulerOutput
from proxy.media.prompt import EncoderPiece
from proxy.models.vision import encode_piece
from proxy.sampling import SamplingParams
from proxy.settings import Settings

from .engine_helpers import assert_blocks_conserved, assert_greedy_matches
from .test_vision import NEW_TOKENS, PARAMS, Family, image

PIECES = {"idefics3": [4] * 10, "smolvlm": [4] * 10, "llava": [16, 16], "llava_pixtral": [20, 20],
          "llava_next": [44, 44], "mistral3": [6, 6], "qwen2_vl": [20, 20], "qwen2_5_vl": [20, 20],
          "llava_onevision": [34]}
"""Rows of each piece of two 40 x 30 images: a view (5 each), an image, or the prompt's images (the
families not named here: one piece of every row)."""


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_pieces_encode_to_the_rows_of_the_whole_prompt(name: str) -> None:
    build, processor, tokenizer = FAMILIES[name]
    family = Family(build(), processor(), tokenizer())
    _, images = family.prompt_of(family.text_of("Compare", None, "with", None), [image(1), image(2)])
    assert images is not None
    assert [piece.rows for piece in images.pieces] == PIECES.get(name, [len(images.token_positions)])
    cpu = torch.device("cpu")
    whole = EncoderPiece("all", len(images.token_positions), images.encoder_inputs)
    want = encode_piece(family.model, whole, cpu, torch.float32)
    parts = torch.cat([encode_piece(family.model, piece, cpu, torch.float32) for piece in images.pieces])
    torch.testing.assert_close(parts, want, rtol=1e-5, atol=1e-5)
    if name in ("idefics3", "smolvlm"):  # a view's key: its image, its index and its padded size
        assert images.pieces[6].key == f"{images.hashes[1]}#view1@32x32"


def test_a_block_of_an_images_rows_is_keyed_by_what_its_rows_depend_on() -> None:
    """LLaVA-OneVision encodes an image one way beside the same image and another beside a different
    one (its piece is the whole prompt's images): a block over the first image must not match
    between the two prompts, while the same prompt again matches."""
    build, processor, tokenizer = FAMILIES["llava_onevision"]
    family = Family(build(), processor(), tokenizer())
    _, alone = family.prompt_of(family.text_of("Compare", None, "with", None), [image(1), image(1)])
    _, beside = family.prompt_of(family.text_of("Compare", None, "with", None), [image(1), image(2)])
    _, again = family.prompt_of(family.text_of("Compare", None, "with", None), [image(1), image(2)])
    assert alone is not None and beside is not None and again is not None
    first = alone.token_positions[0]
    assert beside.token_positions[0] == first and alone.hashes[0] == beside.hashes[0]
    span = (first, first + 4)
    assert alone.block_extra(*span) != beside.block_extra(*span)
    assert beside.block_extra(*span) == again.block_extra(*span) != b""
    assert alone.block_extra(0, first) == b""


@pytest.fixture(scope="module")
def smolvlm() -> Family:
    return Family(build_tiny_smolvlm(), smolvlm_processor(longest_edge=4 * IMAGE_SIZE), idefics3_tokenizer())


def engine(family: Family, threshold: int) -> EngineCore:
    """A step budget of 512 tokens; in a step with decodes, ``threshold`` prefill tokens (0: the whole
    budget), no measured bound; no prefix cache."""
    settings = Settings(num_kv_blocks=256, block_size=4, max_num_batched_tokens=512, seed=0,
                        long_prefill_token_threshold=threshold, max_prefill_step_ratio=0,
                        enable_prefix_caching=False)
    return EngineCore(copy.deepcopy(family.model), settings, [], 512)


def run_beside_a_stream(core: EngineCore, prompt: tuple[list[int], Any]) -> tuple[list[int], list[Any]]:
    """A text request runs first (64 tokens), then ``prompt`` joins it: the image prompt's ids and,
    for each step that computes a chunk of its prompt, ``(the step's number, the chunk's tokens, the
    step's encoder cost, the views it encoded)``."""
    encoder = core.runner.images
    assert encoder is not None
    chunks: dict[int, tuple[int, int]] = {}  # step -> (the image prompt's chunk, the step's encoder cost)
    encoded: list[tuple[int, str]] = []
    schedule, encode = core.scheduler.schedule, encoder.encode

    def scheduled() -> SchedulerOutput:
        out = schedule()
        for r, n in zip(out.requests, out.num_new_tokens, strict=True):
            if r.request_id == "image" and r.num_computed_tokens < r.num_prompt_tokens:
                chunks[core.num_steps + 1] = (n, out.num_encoder_tokens)
        return out

    def encoding(piece: EncoderPiece) -> torch.Tensor:
        encoded.append((core.num_steps, piece.key.split("#")[1].split("@")[0]))
        return encode(piece)

    core.scheduler.schedule = scheduled  # type: ignore[method-assign]
    encoder.encode = encoding  # type: ignore[method-assign]
    core.add_request("text", [5, 6, 7, 8], SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
    core.step()
    core.add_request("image", prompt[0], PARAMS, prompt[1])
    ids: list[int] = []
    while core.has_unfinished():
        ids += [t for o in core.step() if o.request_id == "image" for t in o.new_token_ids]
        assert_blocks_conserved(core)
    return ids, [(step, n, cost, [view for at, view in encoded if at == step])
                 for step, (n, cost) in chunks.items()]


def test_a_17_view_image_is_encoded_over_steps_within_the_prefill_bound(smolvlm: Family) -> None:
    big = [image(3, (128, 128))]
    text = smolvlm.text_of("What is", None, "?")
    prompt = smolvlm.prompt_of(text, big)
    images = prompt[1]
    assert images is not None and [p.rows for p in images.pieces] == [4] * 17  # 4 x 4 tiles + global
    core = engine(smolvlm, threshold=24)
    encoder = core.runner.images
    assert encoder is not None
    encoder.patch_cost = 1.0  # a view: 16 patches of 8 x 8, 16 prefill tokens
    assert {encoder.cost(p) for p in images.pieces} == {16}
    ids, per_step = run_beside_a_stream(core, prompt)
    # step 1 the text request alone; step 2 the image prompt's 20 text tokens up to view 0 (16 more
    # would not fit the 24); then each view's step pays its 16 and 8 tokens (its 4 rows and 4 of the
    # 12 marker tokens before the next view, which it cannot afford), and a step of tokens alone
    # reaches the next view (9 where a row of tiles ends with a newline); the global view is 8
    # tokens after view 15's first placeholder
    want: list[Any] = [(2, 20, 0, [])]
    for view in range(16):
        want.append((3 + 2 * view, 8, 16, [f"view{view}"]))
        if view < 15:
            want.append((4 + 2 * view, 9 if view % 4 == 3 else 8, 0, []))
    want += [(34, 8, 16, ["view16"]), (35, 9, 0, [])]
    assert per_step == want
    for _step, chunk, cost, _views in per_step:
        assert chunk + cost <= 24
    ref_ids, gaps = smolvlm.reference(text, big)
    assert_greedy_matches(ids, ref_ids, gaps, "a 17-view image encoded over steps")
    whole, steps = run_beside_a_stream(engine(smolvlm, threshold=0), prompt)  # no bound: one step
    assert ids == whole and len(steps) == 1 and len(steps[0][3]) == 17 and len(ids) == NEW_TOKENS
