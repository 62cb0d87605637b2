"""``--quantization int8`` / ``int4`` on a served vision-language model (``proxy.models.quantize``): its
text decoder's linears and output layer are packed, the vision tower's and the projector's stay dense
(``proxy.models.vision.encoder_linears``); the engine then builds (the scheduler's image cost reads
the packed layers' sizes) and gives the packed model's own ``generate()`` greedy ids, with an image
and without, alone and batched."""

from __future__ import annotations

import copy

import pytest
import torch
from vision_fixtures import FAMILIES

from proxy.engine.core import EngineCore
from proxy.engine.execution.image_embeds import patch_cost
from proxy.models.vision import encoder_linears
from proxy.quant import kernel_dtype
from proxy.quant.apply import quantize_linears
from proxy.settings import Settings

from .engine_helpers import assert_greedy_matches
from .test_vision import Family, image, run


def _engine(family: Family) -> EngineCore:
    """An engine over a copy of the family's model; eager steps (the compiled step is
    ``tests/engine/execution/test_compiled_decode.py``'s)."""
    settings = Settings(num_kv_blocks=256, block_size=4, max_num_batched_tokens=64, seed=0,
                        compile_decode=False)
    eos = [family.tokenizer.convert_tokens_to_ids("<|im_end|>")]
    return EngineCore(copy.deepcopy(family.model), settings, eos, 512)


#: method -> its packed and dense-by-shape counts: 2 decoder layers x 7 projections and the lm_head,
#: whose row count the int4 kernel refuses (not a multiple of its row block)
PACKED = {"int8": {"int8 g32": 15}, "int4": {"int4 g32": 14, "dense": 1}}


@pytest.mark.parametrize("method", sorted(PACKED))
def test_the_decoder_is_packed_the_encoder_kept_and_greedy_equals_generate(method: str) -> None:
    build, processor, tokenizer = FAMILIES["idefics3"]
    model = build()
    cost = patch_cost(model)
    kept = encoder_linears(model)
    assert kept == {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
                    and not n.startswith("model.text_model.") and n != "lm_head"}
    assert "model.connector.modality_projection.proj" in kept  # 64 inputs: the kernel would take it
    counts = quantize_linears(model, method, 32, kernel_dtype(torch.device("cpu")), kept)
    assert counts == {**PACKED[method], "dense (kept)": len(kept)}
    assert all(type(model.get_submodule(n)) is torch.nn.Linear for n in kept)
    assert patch_cost(model) == cost  # the packed layers count their in x out weights

    family = Family(model, processor(), tokenizer())
    text, words = family.text_of("What is", None, "?"), family.text_of("Hello world! alpha beta")
    prompts = [family.prompt_of(text, [image(0)]), family.prompt_of(words, [])]
    refs = [family.reference(text, [image(0)]), family.reference(words, [])]
    alone = [run(_engine(family), [p])["0"][0] for p in prompts]
    batched = run(_engine(family), prompts)
    for i, name in enumerate(["image", "text only"]):
        ref_ids, gaps = refs[i]
        assert_greedy_matches(alone[i], ref_ids, gaps, f"{method} {name} alone")
        assert_greedy_matches(batched[str(i)][0], ref_ids, gaps, f"{method} {name} batched")
    assert alone[0] != alone[1]
