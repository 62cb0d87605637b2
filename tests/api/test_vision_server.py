"""A tiny random LLaVA served by the real app (engine thread and engine process): images sent on Chat
Completions, Responses and Messages give transformers' ``generate()`` ids for the same processor
inputs; usage and ``/tokenize`` count the image tokens; bad images are a 400 naming the part and the
server keeps serving."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from media.images import data_url, encode, picture
from vision_fixtures import NUM_IMAGE_TOKENS, make_tiny_llava, make_tiny_vlm

from proxy.media.decode import decode_image
from proxy.settings import Settings

from .real_app import real_app

NAME = "tiny-llava"
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llava(tmp_path_factory.mktemp("vlm") / "tiny-llava")


def reference(folder: Path, content: list[dict[str, Any]], images: list[Any]) -> tuple[str, int]:
    """``(generate()'s text, prompt length)`` of one user turn with the folder's own processor
    (``AutoProcessor``'s, or the same class built without torchvision where it needs it:
    ``proxy.media.processor_classes``)."""
    from transformers import AutoModelForImageTextToText

    from proxy.media.processor import VisionProcessor

    vision = VisionProcessor.load(folder)
    assert vision is not None
    processor = vision.processor
    model = AutoModelForImageTextToText.from_pretrained(str(folder), attn_implementation="sdpa").eval()
    text = processor.tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                   add_generation_prompt=True)
    nested = [images] if vision.nested and images else images  # as apply_chat_template nests them
    enc = processor(text=[text], images=nested or None, return_tensors="pt", add_special_tokens=False)
    with torch.inference_mode():
        out = model.generate(**enc, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                             pad_token_id=0)
    n = enc["input_ids"].shape[1]
    return processor.tokenizer.decode(out[0, n:].tolist(), skip_special_tokens=True), n


def settings(folder: Path, engine_process: bool) -> Settings:
    return Settings(model=str(folder), served_model_name=NAME, max_model_len=256, num_kv_blocks=64,
                    block_size=4, num_threads=1, device="cpu", dtype="float32", engine_process=engine_process)


RED, BLUE = picture((40, 30), seed=0), picture((24, 36), seed=1)
IMAGE_PARTS = [{"type": "text", "text": "What is"}, {"type": "image"}, {"type": "text", "text": "and"},
               {"type": "image"}]


def chat_body(**kw: Any) -> dict[str, Any]:
    content = [{"type": "text", "text": "What is"},
               {"type": "image_url", "image_url": {"url": data_url(encode(RED))}},
               {"type": "text", "text": "and"},
               {"type": "image_url", "image_url": {"url": data_url(encode(BLUE, "WEBP", lossless=True),
                                                                   "image/webp")}}]
    return {"model": NAME, "messages": [{"role": "user", "content": content}], "max_tokens": NEW_TOKENS,
            "temperature": 0, "ignore_eos": True, **kw}


@pytest.mark.parametrize("engine_process", [False, True], ids=["engine-thread", "engine-process"])
def test_images_on_every_wire_format_equal_generate(model_dir: Path, engine_process: bool) -> None:
    want, prompt_len = reference(model_dir, IMAGE_PARTS, [RED, BLUE])
    text_want, _ = reference(model_dir, [{"type": "text", "text": "What is this?"}], [])

    async def scenario(client: httpx.AsyncClient, state: Any) -> dict[str, Any]:
        chat, text_only, tokenized, render = await asyncio.gather(
            client.post("/v1/chat/completions", json=chat_body()),
            client.post("/v1/chat/completions", json={**chat_body(), "messages": [
                {"role": "user", "content": "What is this?"}]}),
            client.post("/tokenize", json={"model": NAME, "messages": chat_body()["messages"]}),
            client.post("/v1/chat/completions/render", json=chat_body()))
        responses = await client.post("/v1/responses", json={
            "model": NAME, "max_output_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True,
            "input": [{"role": "user", "content": [
                {"type": "input_text", "text": "What is"},
                {"type": "input_image", "image_url": data_url(encode(RED))},
                {"type": "input_text", "text": "and"},
                {"type": "input_image", "image_url": data_url(encode(BLUE)), "detail": "high"}]}]})
        messages = await client.post("/v1/messages", json={
            "model": NAME, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": "What is"},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": data_url(encode(RED)).split(",", 1)[1]}},
                {"type": "text", "text": "and"},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": data_url(encode(BLUE)).split(",", 1)[1]}}]}]})
        return {"chat": chat, "text": text_only, "tokenize": tokenized, "render": render,
                "responses": responses, "messages": messages, "health": await client.get("/health")}

    async def main() -> dict[str, Any]:
        async with real_app(settings(model_dir, engine_process)) as (client, state):
            assert state.features.accepts_images
            return await scenario(client, state)

    out = asyncio.run(main())
    for name in ("chat", "text", "tokenize", "render", "responses", "messages", "health"):
        assert out[name].status_code == 200, (name, out[name].text)
    chat = out["chat"].json()
    text = chat["choices"][0]["message"]["content"]
    assert text == want and chat["usage"]["completion_tokens"] == NEW_TOKENS
    assert chat["usage"]["prompt_tokens"] == prompt_len  # the 2 x 16 image tokens counted
    assert out["text"].json()["choices"][0]["message"]["content"] == text_want != want
    tokens = out["tokenize"].json()
    assert tokens["count"] == prompt_len and tokens["tokens"].count(tokens["tokens"][-1]) >= 1
    assert sum(1 for t in tokens["tokens"] if t == 400) == 2 * NUM_IMAGE_TOKENS  # <image> is id 400
    rendered = out["render"].json()
    assert rendered["token_ids"] == tokens["tokens"]
    spans = rendered["features"]["mm_placeholders"]["image"]
    assert [s["length"] for s in spans] == [NUM_IMAGE_TOKENS] * 2
    ids = tokens["tokens"]
    assert all(ids[s["offset"]: s["offset"] + s["length"]] == [400] * NUM_IMAGE_TOKENS for s in spans)
    hashes = rendered["features"]["mm_hashes"]["image"]
    assert len(hashes) == 2 and hashes[0] != hashes[1] and all(len(h) == 64 for h in hashes)
    resp = out["responses"].json()
    assert resp["output"][-1]["content"][0]["text"] == text and resp["usage"]["input_tokens"] == prompt_len
    msg = out["messages"].json()
    assert msg["content"][0]["text"] == text
    assert msg["usage"]["input_tokens"] + msg["usage"]["cache_read_input_tokens"] == prompt_len


BAD = [  # (name, url, words)
    ("truncated", data_url(encode(RED)[:60]), "could not be decoded"),
    ("svg", data_url(b"<svg xmlns='http://www.w3.org/2000/svg'/>", "image/svg+xml"),
     "not an image in a supported"),
    ("text", "data:text/plain;base64,aGVsbG8=", "is not an image type"),
    ("bad base64", "data:image/png;base64,***", "not valid base64"),
    ("file off", "file:///etc/hosts", "without --allowed-local-media-path"),
    ("unreachable", "http://127.0.0.1:9/a.png", "fetching the image failed"),
]


def test_bad_images_are_a_400_naming_the_part_and_the_server_keeps_serving(model_dir: Path) -> None:
    async def main() -> tuple[list[httpx.Response], httpx.Response, httpx.Response]:
        async with real_app(settings(model_dir, False)) as (client, _):
            bad = []
            for _, url, _ in BAD:
                body = chat_body()
                body["messages"][0]["content"][3]["image_url"]["url"] = url
                bad.append(await client.post("/v1/chat/completions", json=body))
            image = {"type": "image_url", "image_url": {"url": data_url(encode(RED))}}
            too_long = await client.post("/v1/chat/completions", json={
                **chat_body(), "messages": [{"role": "user", "content": [image] * 16}]})
            return bad, too_long, await client.post("/v1/chat/completions", json=chat_body())

    bad, too_long, good = asyncio.run(main())
    for (name, _, words), response in zip(BAD, bad, strict=True):
        assert response.status_code == 400, (name, response.text)
        err = response.json()["error"]
        assert err["param"] == "messages[0].content[3]" and words in err["message"], (name, err)
    assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"
    assert good.status_code == 200


@pytest.mark.parametrize("family", ["idefics3", "llava_next", "llava_onevision", "smolvlm", "mistral3",
                                    "gemma3", "qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_other_families_equal_generate(family: str, tmp_path: Path) -> None:
    folder = make_tiny_vlm(family, tmp_path / family)
    assert_served_equals_generate(folder, settings(folder, False))


def assert_served_equals_generate(folder: Path, served: Settings) -> None:
    """A real app serving ``served`` answers :func:`chat_body`'s two-image request with the greedy
    text and prompt length of :func:`reference` on the Hugging Face ``folder``."""
    want, prompt_len = reference(folder, IMAGE_PARTS, [RED, BLUE])

    async def main() -> httpx.Response:
        async with real_app(served) as (client, state):
            assert state.features.accepts_images
            return await client.post("/v1/chat/completions", json=chat_body())

    response = asyncio.run(main())
    assert response.status_code == 200, response.text
    chat = response.json()
    assert chat["choices"][0]["message"]["content"] == want and chat["usage"]["prompt_tokens"] == prompt_len


def test_n_choices_follow_up_turns_and_previous_response_id(model_dir: Path) -> None:
    want, _ = reference(model_dir, IMAGE_PARTS, [RED, BLUE])
    turns = [*chat_body()["messages"], {"role": "assistant", "content": "Two pictures."},
             {"role": "user", "content": "Which is red?"}]

    async def main() -> dict[str, httpx.Response]:
        async with real_app(settings(model_dir, False)) as (client, _):
            parts = [{"type": "input_text", "text": "What is"},
                     {"type": "input_image", "image_url": data_url(encode(RED))}]
            first = await client.post("/v1/responses", json={
                "model": NAME, "max_output_tokens": 4, "temperature": 0,
                "input": [{"role": "user", "content": parts}]})
            return {
                "n": await client.post("/v1/chat/completions", json=chat_body(n=2)),
                "turns": await client.post("/v1/chat/completions", json={**chat_body(), "messages": turns}),
                "count": await client.post("/tokenize", json={"model": NAME, "messages": turns,
                                                               "add_generation_prompt": True}),
                "first": first,
                "second": await client.post("/v1/responses", json={
                    "model": NAME, "max_output_tokens": 4, "temperature": 0, "input": "And the colour?",
                    "previous_response_id": first.json()["id"]}),
            }

    out = asyncio.run(main())
    for name, response in out.items():
        assert response.status_code == 200, (name, response.text)
    assert [c["message"]["content"] for c in out["n"].json()["choices"]] == [want, want]
    assert out["turns"].json()["usage"]["prompt_tokens"] == out["count"].json()["count"]
    first, second = out["first"].json()["usage"], out["second"].json()["usage"]
    assert second["input_tokens"] > first["input_tokens"] + first["output_tokens"]  # the image came along
    assert second["input_tokens_details"]["cached_tokens"] > NUM_IMAGE_TOKENS  # its blocks reused


def test_an_image_the_encoder_fails_on_is_a_400_and_other_streams_go_on(model_dir: Path) -> None:
    """An exception in the vision encoder (injected: it raises on the red image, which only the
    two-image prompts have; LLaVA encodes each image on its own) ends that request alone, as a 400,
    while a one-image stream beside it runs to its ``generate()`` text."""
    want, _ = reference(model_dir, [{"type": "text", "text": "What is"}, {"type": "image"}], [BLUE])
    want_both, _ = reference(model_dir, IMAGE_PARTS, [RED, BLUE])
    parts = chat_body()["messages"][0]["content"]
    one_image = {**chat_body(), "messages": [{"role": "user", "content": [parts[0], parts[3]]}]}
    red = decode_image(encode(RED), "red").content_hash

    async def main() -> dict[str, Any]:
        async with real_app(settings(model_dir, False)) as (client, state):
            encoder = state.client.core.core.runner.images
            real = encoder.encode

            def encode(piece: Any) -> torch.Tensor:
                if piece.key == red:
                    raise RuntimeError("injected encoder fault")
                return real(piece)

            encoder.encode = encode
            streamed, failed, failed_stream = await asyncio.gather(
                client.post("/v1/chat/completions", json={**one_image, "stream": True}),
                client.post("/v1/chat/completions", json=chat_body()),
                client.post("/v1/chat/completions", json=chat_body(stream=True)))
            encoder.encode = real
            return {"streamed": streamed, "failed": failed, "failed_stream": failed_stream,
                    "after": await client.post("/v1/chat/completions", json=chat_body())}

    out = asyncio.run(main())
    for name in ("failed", "failed_stream"):
        assert out[name].status_code == 400, out[name].text
        assert out[name].json()["error"] == {
            "message": "The model's vision encoder could not encode the 2 image(s) of this request: "
                       "RuntimeError: injected encoder fault",
            "type": "invalid_request_error", "param": None, "code": "image_encoding_failed"}
    lines = [ln for ln in out["streamed"].text.split("\n") if ln.startswith("data: {")]
    text = "".join(json.loads(ln[6:])["choices"][0]["delta"].get("content") or "" for ln in lines
                   if json.loads(ln[6:])["choices"])
    assert out["streamed"].status_code == 200 and text == want
    after = out["after"]  # the server keeps serving, and no block computed without the images is reused
    assert after.status_code == 200 and after.json()["choices"][0]["message"]["content"] == want_both
