"""The vision encoder inside engine steps (tiny LLaVA): its cost in the step budget, and an encoder
that raises on one request's images, which fails that request alone (``IMAGE_ENCODING_FAILED``) while
the step's other requests keep their exact greedy output, and leaves no poisoned prefix-cache block."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from vision_fixtures import FAMILIES

from proxy.engine.core import EngineCore
from proxy.engine.request import IMAGE_ENCODING_FAILED, Request
from proxy.media.prompt import EncoderPiece, PromptImages

from .engine_helpers import assert_blocks_conserved
from .test_vision import PARAMS, Family, image


@pytest.fixture(scope="module")
def llava() -> Family:
    build, processor, tokenizer = FAMILIES["llava"]
    return Family(build(), processor(), tokenizer())


def run(core: EngineCore, prompts: list[tuple[list[int], PromptImages | None]]) -> dict[str, Any]:
    """Submit every prompt at once and run to the end: ``{id: final output with all its ids}``."""
    for i, (ids, images) in enumerate(prompts):
        core.add_request(str(i), ids, PARAMS, images)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    final: dict[str, Any] = {}
    for _ in range(1000):
        if not core.has_unfinished():
            break
        for o in core.step():
            tokens[o.request_id].extend(o.new_token_ids)
            if o.finished:
                final[o.request_id] = (tokens[o.request_id], o.finish_reason, o.error_code, o.error)
        assert_blocks_conserved(core)
    return final


def test_image_cost_is_its_patches_times_the_parameter_ratio(llava: Family) -> None:
    core = llava.engine()
    encoder = core.runner.images
    assert encoder is not None and core.scheduler.encoder_cost == encoder.pending_cost
    inner = core.runner.model.model
    vision = sum(p.numel() for m in (inner.vision_tower, inner.multi_modal_projector) for p in m.parameters())
    lm = inner.language_model
    text = sum(p.numel() for p in lm.parameters()) - lm.embed_tokens.weight.numel()
    assert encoder.patch_cost == pytest.approx(vision / text)
    _, images = llava.prompt_of(llava.text_of("What is", None, "?"), [image(0)])
    assert images is not None
    assert [piece.key for piece in images.pieces] == list(images.hashes)  # LLaVA: a piece an image
    assert encoder.cost(images.pieces[0]) == math.ceil(16 * vision / text)  # 32 x 32 pixels in 8 x 8 patches
    request = Request("r", [1], PARAMS, images=images)
    assert encoder.pending_cost(request, 0) == encoder.cost(images.pieces[0])
    request.image_embeds[0] = torch.zeros(1)
    assert encoder.pending_cost(request, 0) == 0  # encoded already


def test_a_failing_image_fails_its_request_only(llava: Family, monkeypatch: pytest.MonkeyPatch) -> None:
    text = llava.text_of("What is", None, "?")
    good, bad = llava.prompt_of(text, [image(0)]), llava.prompt_of(text, [image(1)])
    plain = llava.prompt_of(llava.text_of("Hello world! alpha beta"), [])
    cases = (("good", good), ("bad", bad), ("plain", plain))
    expected = {k: run(llava.engine(), [p])["0"][0] for k, p in cases}
    core = llava.engine(chunk=16)  # the prompts' chunks in different steps: no prompt shares another's blocks
    encoder = core.runner.images
    assert encoder is not None and bad[1] is not None
    bad_hashes = bad[1].hashes
    real_encode = encoder.encode

    def encode(piece: EncoderPiece) -> torch.Tensor:
        if piece.key in bad_hashes:
            raise RuntimeError("injected encoder fault")
        return real_encode(piece)

    monkeypatch.setattr(encoder, "encode", encode)
    out = run(core, [good, bad, plain, bad])  # two requests with the failing image, one step apart
    assert out["0"] == (expected["good"], "length", None, None)
    assert out["2"] == (expected["plain"], "length", None, None)
    for rid in ("1", "3"):
        ids, reason, code, message = out[rid]
        assert (ids, reason, code) == ([], "error", IMAGE_ENCODING_FAILED)
        assert message == ("The model's vision encoder could not encode the 1 image(s) of this request: "
                           "RuntimeError: injected encoder fault")
    monkeypatch.setattr(encoder, "encode", real_encode)
    again = run(core, [bad])["0"]  # the engine goes on, and no block computed without the image is reused
    assert again == (expected["bad"], "length", None, None)


def test_a_request_reading_the_failed_requests_blocks_fails_with_it(llava: Family,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    bad = llava.prompt_of(llava.text_of("What is", None, "?"), [image(1)])
    sharer = llava.prompt_of(llava.text_of("What is", None, "and", None), [image(1), image(0)])
    good = llava.prompt_of(llava.text_of("What is", None, "?"), [image(0)])
    want_sharer = run(llava.engine(), [sharer])["0"][0]
    want_good = run(llava.engine(), [good])["0"][0]
    core = llava.engine(chunk=256)  # one step admits all three: the sharer starts on bad's blocks
    encoder = core.runner.images
    assert encoder is not None and bad[1] is not None
    bad_hashes, real_encode = bad[1].hashes, encoder.encode

    def encode(piece: EncoderPiece) -> torch.Tensor:
        if piece.key in bad_hashes:
            raise RuntimeError("injected encoder fault")
        return real_encode(piece)

    monkeypatch.setattr(encoder, "encode", encode)
    out = run(core, [bad, sharer, good])
    assert out["0"][1:3] == out["1"][1:3] == ("error", IMAGE_ENCODING_FAILED)
    assert out["1"][3] == (  # it holds the failed image too: the encoder's message, not "send it again"
        "The model's vision encoder could not encode the 2 image(s) of this request: RuntimeError: injected "
        "encoder fault")
    assert out["2"] == (want_good, "length", None, None)  # another image: not touched
    monkeypatch.setattr(encoder, "encode", real_encode)
    assert run(core, [sharer])["0"] == (want_sharer, "length", None, None)  # sent again, it is served
