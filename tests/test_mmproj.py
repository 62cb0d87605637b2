"""A vision-language model served from its text GGUF and mmproj (``--mmproj``, ``proxy.models.mmproj``):
a tiny Idefics3 and a tiny LLaVA with a Pixtral tower written in llama.cpp's layout
(``gguf_vlm_fixtures``) load with every weight, the config and the processor of the Hugging Face folder
they were written from, and the served greedy text equals the folder's ``generate()``; a wrong pair is
refused at load, naming the file and the reason."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from api.test_vision_server import BLUE, IMAGE_PARTS, RED, assert_served_equals_generate
from gguf_vlm_fixtures import make_gguf_pair, round_vision_to_f16, write_mmproj, write_text_gguf
from vision_fixtures import FAMILIES as VISION_FAMILIES
from vision_fixtures import build_tiny_idefics3, idefics3_processor

from proxy.models import ModelLoadError
from proxy.models.source import resolve_model_source
from proxy.settings import Settings

NAME = "tiny-llava"  # chat_body's model


FAMILIES = ["idefics3", "llava_pixtral"]
_BUILT: dict[str, tuple[Path, Path, Path]] = {}


def _pair(family: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """``(the Hugging Face folder, its text GGUF, its mmproj)`` of the tiny ``family`` (built once)."""
    if family not in _BUILT:
        build, processor, _ = VISION_FAMILIES[family]
        folder = tmp_path_factory.mktemp("hf") / f"tiny-{family}"
        round_vision_to_f16(build()).save_pretrained(folder)
        processor().save_pretrained(folder)
        _BUILT[family] = (folder, *make_gguf_pair(folder, tmp_path_factory.mktemp("gguf")))
    return _BUILT[family]


@pytest.fixture(scope="module", params=FAMILIES)
def family_pair(request: pytest.FixtureRequest,
                tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    return _pair(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    return _pair("idefics3", tmp_path_factory)


def _settings(text: Path, mmproj: Path | None, cache: Path, **kw: object) -> Settings:
    return Settings(model=str(text), mmproj=None if mmproj is None else str(mmproj), cache_dir=str(cache),
                    served_model_name=NAME, max_model_len=256, num_kv_blocks=64, block_size=4, num_threads=1,
                    device="cpu", dtype="float32", **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("quantization", ["none", "auto"])
def test_the_pair_loads_the_folders_weights_config_and_processor(family_pair, tmp_path: Path,
                                                                 quantization: str) -> None:
    from transformers import AutoConfig, AutoModelForImageTextToText

    from proxy.engine.loading import load_engine_model
    from proxy.media.processor import VisionProcessor

    folder, text, mmproj = family_pair
    loaded = load_engine_model(_settings(text, mmproj, tmp_path, quantization=quantization))
    assert Path(loaded.model_path).name == f"{text.stem}+{mmproj.stem}" and loaded.gguf_path == str(text)
    want = AutoModelForImageTextToText.from_pretrained(str(folder))
    got = dict(loaded.model.named_parameters())
    assert type(loaded.model) is type(want) and sorted(got) == sorted(n for n, _ in want.named_parameters())
    for name, param in want.named_parameters():
        assert torch.equal(got[name], param.detach()), name
    ref, cfg = AutoConfig.from_pretrained(str(folder)), loaded.model.config
    def fields(config: object) -> dict[str, object]:  # the dtype is the load's, not the file's
        return {k: v for k, v in config.to_dict().items() if k != "dtype"}  # type: ignore[attr-defined]

    assert fields(cfg.vision_config) == fields(ref.vision_config)
    for key in ("image_token_id", "scale_factor", "vision_feature_layer", "vision_feature_select_strategy",
                "projector_hidden_act", "multimodal_projector_bias"):
        assert getattr(cfg, key, None) == getattr(ref, key, None), key
    for key in ("num_hidden_layers", "hidden_size", "head_dim", "num_key_value_heads"):
        assert getattr(cfg.text_config, key) == getattr(ref.text_config, key), key
    eps = [np.float32(c.text_config.rms_norm_eps) for c in (cfg, ref)]  # the GGUF holds a float32
    assert eps[0] == eps[1]
    assert loaded.vision is not None and loaded.eos_token_ids == {ref.text_config.eos_token_id}
    reference_processor = VisionProcessor.load(folder).processor  # type: ignore[union-attr]
    text_in = reference_processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": IMAGE_PARTS}], tokenize=False, add_generation_prompt=True)
    assert loaded.hf_tokenizer.apply_chat_template([{"role": "user", "content": IMAGE_PARTS}], tokenize=False,
                                                   add_generation_prompt=True) == text_in
    got_enc = loaded.vision.processor(text=[text_in], images=[RED, BLUE], return_tensors="pt",
                                      add_special_tokens=False)
    want_enc = reference_processor(text=[text_in], images=[RED, BLUE], return_tensors="pt",
                                   add_special_tokens=False)
    assert sorted(got_enc) == sorted(want_enc)
    for key in want_enc:
        assert torch.equal(got_enc[key], want_enc[key]), key


def test_served_greedy_text_equals_the_folders_generate(family_pair, tmp_path: Path) -> None:
    folder, text, mmproj = family_pair
    assert_served_equals_generate(folder, _settings(text, mmproj, tmp_path, engine_process=False))


def test_a_quantized_text_gguf_is_packed_and_the_tower_read_from_the_mmproj(pair, tmp_path: Path) -> None:
    """A Q8_0 text GGUF of the VLM: its decoder's linears are packed as a text GGUF's are (found under
    ``model.text_model.``), the vision tower is left to the mmproj, dense, equal to the folder's."""
    import gguf
    from transformers import Idefics3ForConditionalGeneration

    from proxy.engine.loading import load_engine_model
    from proxy.models import gguf_packed
    from proxy.models.device import resolve_device_dtype

    folder, _, mmproj = pair
    model = Idefics3ForConditionalGeneration.from_pretrained(str(folder))
    text = write_text_gguf(model, idefics3_processor().tokenizer, tmp_path / "tiny-q8.gguf",
                           linears=gguf.GGMLQuantizationType.Q8_0)
    settings = _settings(text, mmproj, tmp_path)
    if not gguf_packed(settings, text, resolve_device_dtype(settings)[0]):
        pytest.skip("the packed kernels are slow here: a GGUF is served dense")
    loaded = load_engine_model(settings)
    # 2 layers x 7 linears + lm_head, the k/v projections' 16 rows included
    assert loaded.quantization.startswith("gguf: Q8_0 -> int8 g32 x15"), loaded.quantization
    got = dict(loaded.model.named_parameters())
    for name, param in model.named_parameters():
        if name.startswith(("model.vision_model.", "model.connector.")):
            assert torch.equal(got[name], param.detach()), name


def _refusal(settings: Settings) -> str:
    with pytest.raises(ModelLoadError) as info:
        resolve_model_source(settings)
    return str(info.value)


def test_a_wrong_pair_is_refused_naming_the_file(pair, tmp_path: Path) -> None:
    folder, text, mmproj = pair
    assert text.name == "tiny-idefics3-F32.gguf"
    model = build_tiny_idefics3()
    processor = idefics3_processor()
    # a text GGUF given as the mmproj
    assert f"--mmproj {text.name}: not an mmproj file (general.architecture 'llama'" in _refusal(
        _settings(text, text, tmp_path))
    # not a GGUF at all
    junk = tmp_path / "mmproj-junk.gguf"
    junk.write_bytes(b"not a gguf file at all")
    assert "--mmproj mmproj-junk.gguf: not a GGUF file" in _refusal(_settings(text, junk, tmp_path))
    # an mmproj of another projector, or projecting to another width
    other = write_mmproj(model, processor, tmp_path / "mmproj-qwen.gguf", projector_type="qwen2vl_merger")
    assert ("mmproj-qwen.gguf: projector type 'qwen2vl_merger' is not served yet: its text GGUF's "
            "architecture (qwen2vl) is not one transformers' GGUF loader reads, nor are its M-RoPE sections "
            "(served: idefics3, pixtral)" in _refusal(_settings(text, other, tmp_path)))
    unknown = write_mmproj(model, processor, tmp_path / "mmproj-cogvlm.gguf", projector_type="cogvlm")
    assert ("mmproj-cogvlm.gguf: projector type 'cogvlm' is not served yet (served: idefics3, pixtral)"
            in _refusal(_settings(text, unknown, tmp_path)))
    wide = write_mmproj(model, processor, tmp_path / "mmproj-wide.gguf", projection_dim=64)
    assert ("mmproj-wide.gguf projects images to 64 features; tiny-idefics3-F32.gguf's hidden size is 32"
            in _refusal(_settings(text, wide, tmp_path)))
    # a text-only model: its tokenizer has no image token
    from api.fakes import make_hf_tokenizer

    plain = write_text_gguf(model, make_hf_tokenizer(), tmp_path / "text-only.gguf")
    assert "needs the image token '<image>', which text-only.gguf's tokenizer lacks" in _refusal(
        _settings(plain, mmproj, tmp_path))
    # a Hugging Face folder, or no file
    assert "goes with a .gguf --model" in _refusal(_settings(folder, mmproj, tmp_path))
    nowhere = _settings(text, Path("nowhere.gguf"), tmp_path)
    assert "--mmproj 'nowhere.gguf': no such file" in _refusal(nowhere)
    assert not [p for p in tmp_path.iterdir() if "+" in p.name]  # nothing half-written is cached


def test_models_prepare_reports_a_refused_mmproj(pair, tmp_path: Path, capsys) -> None:
    from proxy.cli import main

    _, text, _ = pair
    code = main(["models", "--convert", "--model", str(text), "--mmproj", str(text),
                 "--cache-dir", str(tmp_path)])
    assert code == 1 and f"--mmproj {text.name}: not an mmproj file" in capsys.readouterr().err
