"""Gemma 3 served with its images (the tiny random model of ``vision_fixtures``, whose first layer's
sliding window of 3 is shorter than an image's 4 soft tokens): the first token's log-probability equals
transformers' prefill with ``token_type_ids`` in whole prompts and in chunks, and comes out otherwise
without the image-block mask or with chunks that end inside an image; a prefix-cache hit that ends
inside an image runs the rest of it in one chunk, past the step budget, to ``generate()``'s text.
(``test_vision.py`` runs Gemma 3 with every other family: greedy text alone and batched, chunks,
preemption, the prefix cache, the self-check.)"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from vision_fixtures import FAMILIES

from proxy.engine.execution import model_runner
from proxy.engine.request import RequestOutput
from proxy.media.processor import images_refusal
from proxy.models.vision import bidirectional_images, refusal
from proxy.sampling import SamplingParams

from .engine_helpers import assert_greedy_matches
from .test_vision import PARAMS, Family, image

FIRST = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=True)


@pytest.fixture(scope="module")
def gemma() -> Family:
    build, processor, tokenizer = FAMILIES["gemma3"]
    return Family(build(), processor(), tokenizer())


def reference_logprobs(gemma: Family, text: str, seeds: list[int]) -> torch.Tensor:
    """log_softmax of transformers' prefill logits at the last prompt token (``token_type_ids`` from
    the processor: image tokens see their whole image)."""
    enc = gemma.processor(text=[text], images=[image(s).image for s in seeds], return_tensors="pt",
                          add_special_tokens=False)
    assert "token_type_ids" in enc
    with torch.inference_mode():
        logits = gemma.model(**enc).logits[0, -1].float()
    return torch.log_softmax(logits, dim=-1)


def first_logprob(gemma: Family, text: str, seeds: list[int], chunk: int, whole_blocks: bool = True) -> Any:
    core = gemma.engine(chunk)
    core.scheduler.whole_image_blocks = whole_blocks
    ids, images = gemma.prompt_of(text, [image(s) for s in seeds])
    core.add_request("0", ids, FIRST, images)
    outs: list[RequestOutput] = []
    while core.has_unfinished():
        outs.extend(core.step())
    lp = next(o.new_logprobs for o in outs if o.new_logprobs)
    return lp[0]


def test_gemma3_is_served_with_bidirectional_images(gemma: Family) -> None:
    config = gemma.model.config
    assert refusal(config) is None and images_refusal(config) is None and bidirectional_images(config)
    assert not bidirectional_images(FAMILIES["llava"][0]().config)
    _, images = gemma.prompt_of(gemma.text_of("Compare", None, "with", None), [image(1), image(2)])
    assert images is not None and images.counts == (4, 4) and len(images.blocks) == 2
    plan = gemma.engine().execution
    assert plan.image_attention == "bidirectional blocks" and plan.rope_positions == "1-d"


@pytest.mark.parametrize("chunk", [64, 7, 2], ids=["whole prompt", "chunks of 7", "chunks of 2"])
@pytest.mark.parametrize("parts", [("What is", None, "?"), ("Compare", None, "with", None)],
                         ids=["one image", "two images"])
def test_first_logprob_equals_the_bidirectional_prefill(gemma: Family, chunk: int, parts: Any) -> None:
    seeds = [0] if len(parts) == 3 else [1, 2]
    text = gemma.text_of(*parts)
    want = reference_logprobs(gemma, text, seeds)
    got = first_logprob(gemma, text, seeds, chunk)
    assert got.token_id == int(want.argmax())
    assert abs(got.logprob - float(want[got.token_id])) < 1e-5


def test_without_the_block_mask_or_whole_blocks_the_logprob_differs(
        gemma: Family, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tests above could not fail if the blocks changed nothing: with chunks of 2 that end inside
    the image, or with the prefill masks left causal, the first log-probability moves."""
    text = gemma.text_of("What is", None, "?")
    want = reference_logprobs(gemma, text, [0])
    split = first_logprob(gemma, text, [0], 2, whole_blocks=False)
    assert abs(split.logprob - float(want[split.token_id])) > 1e-3
    monkeypatch.setattr(model_runner, "add_prefill_image_blocks", lambda meta, rows: False)
    causal = first_logprob(gemma, text, [0], 64)
    assert abs(causal.logprob - float(want[causal.token_id])) > 1e-3


def test_a_prefix_hit_inside_an_image_runs_the_rest_of_it_in_one_chunk(gemma: Family) -> None:
    """A request aborted once its first 15 tokens ran (the image is positions 11..14) leaves blocks
    0..2 in the prefix cache; the same prompt then starts at position 12, inside the image, and its
    first chunk runs to the image's end: 3 tokens over a budget of 2."""
    text = gemma.text_of("What is", None, "?")
    ids, images = gemma.prompt_of(text, [image(0)])
    assert images is not None and images.blocks == ((11, 14),)
    core = gemma.engine(chunk=2)
    core.add_request("a", ids, FIRST, images)
    chunks = []
    while core.scheduler.requests["a"].num_computed_tokens < 15:
        before = core.scheduler.requests["a"].num_computed_tokens
        core.step()
        chunks.append(core.scheduler.requests["a"].num_computed_tokens - before)
    assert chunks == [2, 2, 2, 2, 2, 1, 4]  # cut back before the image, then the image whole
    core.abort_request("a")
    core.add_request("b", ids, PARAMS, images)
    core.step()
    b = core.scheduler.requests["b"]
    assert b.num_cached_tokens == 12 and b.num_computed_tokens == 15
    while core.has_unfinished():
        core.step()
    ref_ids, gaps = gemma.reference(text, [image(0)])
    assert_greedy_matches(b.output_token_ids, ref_ids, gaps, "from a prefix-cache hit inside the image")
