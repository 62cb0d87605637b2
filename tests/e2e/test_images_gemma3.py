"""The OpenAI SDK sends two images with its defaults to a real ``python -m proxy serve`` of a tiny random
Gemma 3 (uvicorn on 127.0.0.1, the engine in its own process: the default; a step budget of 7 tokens,
so a prompt chunk would end inside its first image, positions 12..15) and gets transformers'
``generate()`` answer for the same processor inputs, whole and streamed: the image tokens attend to
their whole image during prefill, as ``token_type_ids`` make them in transformers."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from media.images import data_url, encode, picture
from vision_fixtures import make_tiny_vlm, served_vlm

from proxy.ports import LocalServer

NAME = "tiny-gemma3"
NEW_TOKENS = 8
PNGS = [encode(picture((40, 30), seed=2)), encode(picture((24, 36), seed=3))]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_vlm("gemma3", tmp_path_factory.mktemp("vlm") / "tiny-gemma3")


@pytest.fixture(scope="module")
def server(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalServer]:
    with served_vlm(folder, NAME, tmp_path_factory.mktemp("vlm-log") / "server.log",
                    "--max-num-batched-tokens", "7") as started:
        yield started


def expected(folder: Path) -> str:
    """``generate()``'s answer to "Compare" + image + "with" + image, through the folder's processor."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText

    from proxy.media.processor import VisionProcessor

    vision = VisionProcessor.load(folder)
    assert vision is not None
    processor = vision.processor
    model = AutoModelForImageTextToText.from_pretrained(str(folder), attn_implementation="sdpa").eval()
    content = [{"type": "text", "text": "Compare"}, {"type": "image"}, {"type": "text", "text": "with"},
               {"type": "image"}]
    text = processor.tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                   add_generation_prompt=True)
    pictures = [Image.open(io.BytesIO(png)).convert("RGB") for png in PNGS]
    enc = processor(text=[text], images=pictures, return_tensors="pt", add_special_tokens=False)
    assert int(enc["token_type_ids"].sum()) == 8  # two images of 4 soft tokens
    with torch.inference_mode():
        out = model.generate(**enc, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                             pad_token_id=0)
    answer: str = processor.tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    return answer


def test_openai_sdk_two_images_on_gemma3(server: LocalServer, folder: Path) -> None:
    import openai

    want = expected(folder)
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
    images = [{"type": "image_url", "image_url": {"url": data_url(png)}} for png in PNGS]
    content = [{"type": "text", "text": "Compare"}, images[0], {"type": "text", "text": "with"}, images[1]]
    ask = {"model": NAME, "messages": [{"role": "user", "content": content}], "max_tokens": NEW_TOKENS,
           "temperature": 0, "extra_body": {"ignore_eos": True}}
    whole = client.chat.completions.create(**ask)
    assert whole.choices[0].message.content == want and want
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in
                       client.chat.completions.create(**ask, stream=True) if chunk.choices)
    assert streamed == want


def test_the_execution_plan_reports_bidirectional_image_blocks(server: LocalServer) -> None:
    plan = httpx.get(f"{server.base_url}/server_info", timeout=10).json()["execution"]
    assert plan["image_attention"] == "bidirectional blocks"
    assert ", image tokens bidirectional blocks," in plan["summary"]
