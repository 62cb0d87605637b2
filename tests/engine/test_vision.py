"""Tiny random vision-language models (LLaVA, LLaVA-Next, LLaVA-OneVision, Idefics3, SmolVLM, Mistral3,
Pixtral-LLaVA, Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE, Gemma 3) through the engine: greedy ids equal
transformers' ``generate()`` with the same processor for one and two images, alone and batched with a
text-only request, with prefill chunks that cut images, after a preemption and from the prefix cache; the
prefix cache reuses an image's blocks for the same image only; Qwen2-VL's and Qwen3-VL's M-RoPE positions
are ``get_rope_index``'s in every chunk and continue from its delta, also through the graph and compiled
decode paths; Qwen3-VL's DeepStack rows reach its first decoder layers in image steps only; unserved
vision-language types are refused at load by name."""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from media.images import encode, picture
from vision_fixtures import FAMILIES, NUM_IMAGE_TOKENS

from proxy.engine.core import EngineCore
from proxy.engine.execution.architectures import check_supported
from proxy.engine.execution.image_embeds import ImageEncoder
from proxy.engine.selfcheck import SelfCheckError, run_self_check
from proxy.media.decode import LoadedImage, decode_image
from proxy.media.processor import NESTED, VisionProcessor
from proxy.media.prompt import PromptImages
from proxy.models.loaded import ModelLoadError
from proxy.models.vision import decoder_attention, refusal
from proxy.sampling import SamplingParams
from proxy.settings import Settings

from .engine_helpers import assert_blocks_conserved, assert_greedy_matches

NEW_TOKENS = 12
SERVED_NAMES = ("gemma3, idefics3, llava, llava_next, llava_onevision, mistral3, qwen2_5_vl, qwen2_vl, "
                "qwen3_vl, qwen3_vl_moe, smolvlm")
PARAMS = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


@dataclass(frozen=True)
class Family:
    """One tiny vision-language model with its processor and tokenizer."""

    model: Any
    processor: Any
    tokenizer: Any

    @property
    def image_token_id(self) -> int:
        """The placeholder token of one image row (Gemma 3's soft token, not its ``<start_of_image>``)."""
        return int(self.model.config.image_token_id)

    @property
    def vision(self) -> VisionProcessor:
        model_type = self.model.config.model_type
        return VisionProcessor(self.processor, self.image_token_id, nested=model_type in NESTED,
                               model_type=model_type)

    def text_of(self, *parts: str | None) -> str:
        """The chat template's prompt of one user turn (``None``: an image part)."""
        content = [{"type": "image"} if p is None else {"type": "text", "text": p} for p in parts]
        out: str = self.tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                      add_generation_prompt=True)
        return out

    def reference(self, text: str, images: list[LoadedImage]) -> tuple[list[int], list[float]]:
        """``generate(do_sample=False)`` of one prompt with the processor's inputs, and its top-2 gaps."""
        if images:
            pictures = [im.image for im in images]  # one prompt's, as apply_chat_template nests them
            enc = self.processor(text=[text], images=[pictures] if self.vision.nested else pictures,
                                 return_tensors="pt", add_special_tokens=False)
        else:
            enc = self.tokenizer([text], return_tensors="pt", add_special_tokens=False)
        with torch.inference_mode():
            out = self.model.generate(**enc, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                      do_sample=False, pad_token_id=0, output_scores=True,
                                      return_dict_in_generate=True)
        ids = out.sequences[0, enc["input_ids"].shape[1]:].tolist()
        gaps = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.scores]
        return ids, gaps

    def prompt_of(self, text: str, images: list[LoadedImage]) -> tuple[list[int], PromptImages | None]:
        if not images:
            return list(self.tokenizer.encode(text, add_special_tokens=False)), None
        return self.vision.prompt(text, images)

    def engine(self, chunk: int = 64, prefix_caching: bool = True, num_blocks: int = 256) -> EngineCore:
        settings = Settings(num_kv_blocks=num_blocks, block_size=4, max_num_batched_tokens=chunk,
                            long_prefill_token_threshold=0, enable_prefix_caching=prefix_caching, seed=0)
        eos = [self.tokenizer.convert_tokens_to_ids("<|im_end|>")]
        return EngineCore(copy.deepcopy(self.model), settings, eos, min(512, num_blocks * 4))


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest) -> Family:
    build, processor, tokenizer = FAMILIES[request.param]
    return Family(build(), processor(), tokenizer())


@pytest.fixture(scope="module")
def llava() -> Family:
    build, processor, tokenizer = FAMILIES["llava"]
    return Family(build(), processor(), tokenizer())


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen3_vl"])
def mrope(request: pytest.FixtureRequest) -> Family:
    """An M-RoPE family: Qwen2-VL, and Qwen3-VL (interleaved M-RoPE, DeepStack)."""
    build, processor, tokenizer = FAMILIES[request.param]
    return Family(build(), processor(), tokenizer())


@pytest.fixture(scope="module")
def qwen3_vl() -> Family:
    build, processor, tokenizer = FAMILIES["qwen3_vl"]
    return Family(build(), processor(), tokenizer())


def image(seed: int, size: tuple[int, int] = (40, 30)) -> LoadedImage:
    return decode_image(encode(picture(size, seed=seed)), f"messages[0].content[{seed}]")


def run(core: EngineCore, prompts: list[tuple[list[int], PromptImages | None]]) -> dict[str, Any]:
    """Submit every prompt at once and run to the end: ``{id: (ids, num_prompt_tokens, cached)}``."""
    for i, (ids, images) in enumerate(prompts):
        core.add_request(str(i), ids, PARAMS, images)
    out: dict[str, list[Any]] = {str(i): [[], 0, 0] for i in range(len(prompts))}
    steps = 0
    while core.has_unfinished():
        for o in core.step():
            out[o.request_id][0].extend(o.new_token_ids)
            out[o.request_id][1:] = [o.num_prompt_tokens, o.num_cached_tokens]
        assert_blocks_conserved(core)
        steps += 1
        assert steps < 1000
    return out


CASES = {
    "one image": (("What is", None, "?"), [0]),
    "two images": (("Compare", None, "with", None), [1, 2]),
    "image first": ((None, "Describe it."), [3]),
    "text only": (("Hello world! alpha beta",), []),
}


@pytest.mark.parametrize("chunk", [64, 7], ids=["whole prompts", "chunks of 7 cutting images"])
def test_greedy_equals_generate_alone_and_batched(family: Family, chunk: int) -> None:
    prompts, refs = [], []
    for parts, seeds in CASES.values():
        images = [image(s) for s in seeds]
        text = family.text_of(*parts)
        prompts.append(family.prompt_of(text, images))
        refs.append(family.reference(text, images))
    image_token = family.image_token_id
    for ids, images in prompts:
        assert ids.count(image_token) == (sum(images.counts) if images is not None else 0)
    alone = [run(family.engine(chunk), [p])["0"] for p in prompts]
    batched = run(family.engine(chunk), prompts)
    for i, name in enumerate(CASES):
        ref_ids, gaps = refs[i]
        assert_greedy_matches(alone[i][0], ref_ids, gaps, f"{name} alone")
        assert_greedy_matches(batched[str(i)][0], ref_ids, gaps, f"{name} batched")
        assert alone[i][1] == len(prompts[i][0])  # usage counts the placeholder tokens


def test_preempted_image_requests_recompute_their_images(family: Family) -> None:
    text = family.text_of("What is", None, "?")
    prompts = [family.prompt_of(text, [image(seed)]) for seed in range(3)]
    longest = max(len(ids) for ids, _ in prompts) + NEW_TOKENS
    core = family.engine(chunk=16, num_blocks=-(-longest // 4) * 2)  # two of the three fit at a time
    out = run(core, prompts)
    assert core.scheduler.num_preemptions >= 1
    for seed in range(3):
        ref_ids, gaps = family.reference(text, [image(seed)])
        assert_greedy_matches(out[str(seed)][0], ref_ids, gaps, f"image {seed} preempted")


def test_images_change_the_output(family: Family) -> None:
    text = family.text_of("What is", None, "?")
    a = run(family.engine(), [family.prompt_of(text, [image(0)])])["0"][0]
    b = run(family.engine(), [family.prompt_of(text, [image(1)])])["0"][0]
    assert a != b  # the image reaches the decoder (a test that could not fail otherwise)


def test_prefix_cache_reuses_the_same_image_only(family: Family) -> None:
    text = family.text_of("What is", None, "?")
    core = family.engine()
    first_image = family.prompt_of(text, [image(0)])
    ids, images = first_image
    assert images is not None
    first = run(core, [first_image])["0"]
    encoded = core.runner.images.num_encoded if core.runner.images is not None else -1
    again = run(core, [first_image])["0"]
    assert again[0] == first[0] and again[2] == (len(ids) - 1) // 4 * 4  # every full block but the last token
    other = family.prompt_of(text, [image(1)])
    assert other[0] == ids  # the same tokens ...
    third = run(core, [other])["0"]
    first_image_block = images.token_positions[0] // 4
    assert third[2] == first_image_block * 4  # ... reused only up to the block the image starts in
    assert third[0] == run(family.engine(prefix_caching=False), [other])["0"][0]
    assert other[1] is not None and core.runner.images is not None
    assert core.runner.images.num_encoded == encoded + len(other[1].pieces)  # the other image's pieces
    ref_ids, gaps = family.reference(text, [image(0)])
    assert_greedy_matches(again[0], ref_ids, gaps, "the same image again, from the prefix cache")


def test_prompt_images_positions_and_block_keys(llava: Family) -> None:
    vision = llava.vision
    ids, images = vision.prompt(llava.text_of("a", None, "b", None), [image(0), image(1)])
    assert images.counts == (NUM_IMAGE_TOKENS, NUM_IMAGE_TOKENS) and len(images.hashes) == 2
    (s0, e0), (s1, e1) = images.spans()
    assert e0 - s0 == e1 - s1 == NUM_IMAGE_TOKENS - 1 and e0 < s1
    assert all(ids[p] == vision.image_token_id for p in images.token_positions)
    assert images.block_extra(0, s0) == b""
    assert images.block_extra(s0, s0 + 1) == b"image:" + images.hashes[0].encode()
    both = b"image:" + images.hashes[0].encode() + b"image:" + images.hashes[1].encode()
    assert images.block_extra(e0, s1 + 1) == both
    gap = s1 - e0 - 1  # text tokens between the images
    offsets, rows = images.rows_in(s0 + 10, 12)  # image 0's last 6, the gap, image 1's first 6 - gap
    assert offsets == list(range(6)) + list(range(6 + gap, 12))
    assert rows == list(range(10, 16)) + list(range(16, 22 - gap))
    assert set(images.encoder_inputs) == {"pixel_values"}
    assert tuple(images.encoder_inputs["pixel_values"].shape) == (2, 3, 32, 32)


@pytest.mark.parametrize("name", ["PaliGemmaConfig", "Idefics2Config", "AyaVisionConfig"])
def test_unserved_vision_models_are_refused_at_load_by_name(name: str) -> None:
    import transformers

    config = getattr(transformers, name)()
    with pytest.raises(ModelLoadError) as err:
        check_supported(config)
    want = (f"model type '{config.model_type}' is a vision-language model that streamproxy does not serve "
            f"yet (served with images: {SERVED_NAMES}); serve it with vLLM or llama.cpp, or pick a "
            "pure-attention model")
    assert str(err.value) == want


@pytest.mark.parametrize(("name", "merge", "rows"), [("mistral3", 2, [3, 3]), ("llava_pixtral", 1, [5] * 4)])
def test_pixtral_placeholders_break_rows_and_end_each_image(name: str, merge: int, rows: list[int]) -> None:
    """A 40 x 30 image through ``PixtralProcessor``: ``[IMG]`` per (merged) 8 x 8 patch of the image
    resized up to whole patches (48 x 32 with merging, 40 x 32 without), ``[IMG_BREAK]`` after each
    row, ``[IMG_END]`` instead of the last; only the ``[IMG]`` tokens take embedding rows."""
    import sys

    from proxy.media.processor_classes import TORCHVISION_MODULE

    build, processor, tokenizer = FAMILIES[name]
    pixtral = Family(build(), processor(), tokenizer())
    assert TORCHVISION_MODULE not in sys.modules  # the stand-in is gone after the import
    ids, images = pixtral.vision.prompt(pixtral.text_of("a", None), [image(0)])
    tokens = pixtral.tokenizer.convert_ids_to_tokens(ids)
    first, last = images.spans()[0]
    want = []
    for i, width in enumerate(rows):
        want += ["[IMG]"] * width + ["[IMG_END]" if i == len(rows) - 1 else "[IMG_BREAK]"]
    assert tokens[first: last + 2] == want and images.counts == (sum(rows),)
    assert set(images.encoder_inputs) == {"pixel_values", "image_sizes"}
    assert tuple(images.encoder_inputs["image_sizes"][0].tolist()) == (32, 8 * merge * rows[0])


def test_smolvlm_without_num2words_is_refused_at_load(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from transformers import SmolVLMConfig

    find_spec = importlib.util.find_spec
    check_supported(SmolVLMConfig())  # installed: served
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "num2words"
                        else find_spec(name, *a))
    with pytest.raises(ModelLoadError, match=r"^model type 'smolvlm' is served with its images, but its "
                       r"processor needs the package 'num2words', which is not installed \(pip install "
                       r"num2words; streamproxy's own install has it\); serve it with"):
        check_supported(SmolVLMConfig())


def test_served_families_pass_and_causal_vision_models_load_as_text(family: Family) -> None:
    from transformers import Llama4Config

    check_supported(family.model.config)
    assert refusal(family.model.config) is None and refusal(Llama4Config()) is None  # Llama 4: text


@pytest.mark.parametrize("chunk", [64, 9], ids=["whole prompt", "chunks of 9 cutting the image"])
def test_onevision_shrinks_a_large_image_as_generate_does(chunk: int) -> None:
    """``anyres_max_1``: a 70 x 50 image takes the 96 x 96 pinpoint (3 x 3 views, 12 x 12 patches,
    8 x 12 once unpadded: 96 features + 8 newlines past the 16 of the base view); more than one
    view's worth, they are interpolated to 3 x 4 (+ 3 newlines): 31 placeholders, not 120."""
    build, processor, tokenizer = FAMILIES["llava_onevision"]
    onevision = Family(build(), processor(), tokenizer())
    text = onevision.text_of("What is", None, "?")
    big = [image(5, (70, 50))]
    prompt = onevision.prompt_of(text, big)
    assert prompt[1] is not None and prompt[1].counts == (31,)
    ref_ids, gaps = onevision.reference(text, big)
    out = run(onevision.engine(chunk), [prompt, onevision.prompt_of(text, [image(6)])])
    assert_greedy_matches(out["0"][0], ref_ids, gaps, "a shrunk image batched")


def test_onevision_takes_its_multi_image_mode_for_several_images() -> None:
    """Two images in one prompt (nested as ``apply_chat_template`` passes them): each its base view
    and a newline, 16 + 1 placeholders, no grid (``test_greedy_equals_generate_alone_and_batched``'s
    "two images" case checks the ids)."""
    build, processor, tokenizer = FAMILIES["llava_onevision"]
    onevision = Family(build(), processor(), tokenizer())
    text = onevision.text_of("Compare", None, "with", None)
    _, images = onevision.prompt_of(text, [image(1), image(2, (70, 50))])
    assert images is not None and images.counts == (NUM_IMAGE_TOKENS + 1, NUM_IMAGE_TOKENS + 1)
    assert images.encoder_inputs["batch_num_images"].tolist() == [2]
    _, alone = onevision.prompt_of(text.replace("with<image>", "with"), [image(1)])
    assert alone is not None and alone.counts == (31,)  # one image: the anyres grid


def paged(model: Any) -> Any:
    """A copy of ``model`` whose decoder takes the paged attention, as the loader gives it."""
    from proxy.engine.execution.attention import register

    clone = copy.deepcopy(model)
    clone.set_attn_implementation(decoder_attention(clone.config, register()))
    return clone


def test_self_check_covers_one_image(family: Family, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = Settings(block_size=4, seed=0)
    report = run_self_check(paged(family.model), settings, 256, vision=family.vision)
    assert len(report.prompt_lengths) == 4 and report.num_near_ties == 0  # 3 text prompts + the image's

    def no_images(self: ImageEncoder, input_ids: torch.Tensor, slots: Any) -> torch.Tensor:
        embeds: torch.Tensor = self.model.get_input_embeddings()(input_ids)
        return embeds  # the image positions keep their placeholder's embedding: wrong text

    monkeypatch.setattr(ImageEncoder, "embed", no_images)
    with pytest.raises(SelfCheckError, match="the image prompt .* first differs at generated token"):
        run_self_check(paged(family.model), settings, 256, vision=family.vision)


def test_mrope_positions_are_get_rope_index_in_chunks_and_continue_from_its_delta(mrope: Family) -> None:
    text = mrope.text_of("Compare", None, "with", None)
    pictures = [image(1), image(2, (24, 36))]
    enc = mrope.processor(text=[text], images=[im.image for im in pictures], return_tensors="pt",
                          add_special_tokens=False)
    want, delta = mrope.model.model.get_rope_index(enc["input_ids"], enc["mm_token_type_ids"],
                                                   image_grid_thw=enc["image_grid_thw"])
    num_prompt = enc["input_ids"].shape[1]
    assert int(delta) < 0  # the images' placeholders take fewer positions than tokens: 3-D positions differ
    core = mrope.engine(chunk=7)
    seen: list[torch.Tensor] = []
    rotary = core.runner.model.model.language_model.rotary_emb
    rotary.register_forward_hook(lambda _m, args, _out: seen.append(args[1].expand(3, 1, -1)[:, 0]))
    run(core, [mrope.prompt_of(text, pictures)])
    assert len(seen) > num_prompt // 7  # chunks, then one step a token
    got = torch.cat(seen, dim=1)
    later = torch.arange(num_prompt, num_prompt + NEW_TOKENS - 1) + int(delta)
    assert torch.equal(got, torch.cat([want[:, 0], later.expand(3, -1)], dim=1))


def test_graph_decodes_take_shifted_positions_and_a_last_prompt_token_runs_eager(mrope: Family) -> None:
    from .execution.test_decode_graphs import ReplayGraph

    graphs: list[ReplayGraph] = []

    def make_graph() -> ReplayGraph:
        graphs.append(ReplayGraph())
        return graphs[-1]

    texts = [mrope.text_of("What is" + " it" * k, None, "?") for k in range(4)]
    text = next(t for t in texts if (len(mrope.prompt_of(t, [image(0)])[0]) - 1) % 4 == 0)
    prompt = mrope.prompt_of(text, [image(0)])
    core = mrope.engine()
    core.runner.use_decode_graphs(make_graph)
    first = run(core, [prompt])["0"]
    again = run(core, [prompt])["0"]  # every token but the last from the cache: a one-token prompt row
    assert again[2] == len(prompt[0]) - 1 and sum(g.replays for g in graphs) >= 2 * (NEW_TOKENS - 2)
    ref_ids, gaps = mrope.reference(text, [image(0)])
    assert_greedy_matches(first[0], ref_ids, gaps, "graph decodes")
    assert_greedy_matches(again[0], ref_ids, gaps, "graph decodes after a one-token prompt row")
    plan = core.execution
    assert plan.rope_positions == "m-rope" and ", rotary positions m-rope," in plan.summary()
    assert plan.image_attention == "causal" and "image tokens" not in plan.summary()


def test_compiled_step_rows_take_shifted_positions_batched_and_after_preemption(mrope: Family) -> None:
    from proxy.engine.execution.compiled_step import CompiledDecodeStep
    from proxy.engine.execution.decode_runner import CompiledDecode
    from proxy.engine.execution.traced_decode import decode_forward

    text = mrope.text_of("What is", None, "?")
    words = mrope.text_of("Hello world! alpha beta")
    prompts = [mrope.prompt_of(text, [image(seed)]) for seed in range(3)] + [mrope.prompt_of(words, [])]
    longest = max(len(ids) for ids, _ in prompts) + NEW_TOKENS
    core = mrope.engine(chunk=16, num_blocks=-(-longest // 4) * 2)  # two of the four fit at a time
    # the function the compiled step traces, run as the compiled graph would be called (inductor aside)
    step = CompiledDecodeStep(decode_forward, core.runner.model, "compiled", 0.0)
    core.runner.decode = CompiledDecode(step)
    out = run(core, prompts)
    assert core.scheduler.num_preemptions >= 1 and step.num_calls >= NEW_TOKENS
    for i, seed in enumerate(range(3)):
        ref_ids, gaps = mrope.reference(text, [image(seed)])
        assert_greedy_matches(out[str(i)][0], ref_ids, gaps, f"image {seed} through the compiled step")
    ref_ids, gaps = mrope.reference(words, [])
    assert_greedy_matches(out["3"][0], ref_ids, gaps, "text only through the compiled step")


def test_deepstack_is_added_in_image_steps_only_and_changes_the_text(
        qwen3_vl: Family, monkeypatch: pytest.MonkeyPatch) -> None:
    """Qwen3-VL's DeepStack rows reach its first 2 decoder layers (of 3) in the steps that hold image
    positions, one row per position and layer, through hooks gone after each step; without them the
    text is not ``generate()``'s (the family tests check it is, in chunks that cut images)."""
    from proxy.engine.execution import model_runner

    text = qwen3_vl.text_of("What is", None, "?")
    prompt = qwen3_vl.prompt_of(text, [image(0)])
    assert prompt[1] is not None
    ref_ids, gaps = qwen3_vl.reference(text, [image(0)])
    core = qwen3_vl.engine(chunk=7)
    decoder = core.runner.model.model.language_model.layers
    assert len(decoder) == 3 and core.runner.deepstack_layers == [decoder[0], decoder[1]]
    calls: list[tuple[int, tuple[int, ...]]] = []
    real = model_runner.deepstack_added

    def spy(layers: list[torch.nn.Module], flat_index: torch.Tensor, embeds: torch.Tensor) -> Any:
        calls.append((flat_index.numel(), tuple(embeds.shape)))
        return real(layers, flat_index, embeds)

    monkeypatch.setattr(model_runner, "deepstack_added", spy)
    out = run(core, [prompt])["0"][0]
    assert_greedy_matches(out, ref_ids, gaps, "one image in chunks of 7")
    assert len(calls) >= 2 and sum(n for n, _ in calls) == len(prompt[1].token_positions)  # split image
    assert all(shape == (n, 2, 64) for n, shape in calls)
    assert not any(layer._forward_hooks for layer in decoder)
    monkeypatch.setattr(model_runner, "deepstack_added", lambda *_: contextlib.nullcontext())
    assert run(qwen3_vl.engine(chunk=7), [prompt])["0"][0] != ref_ids
