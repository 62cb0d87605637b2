"""The OpenAI SDK sends an image with its defaults to a real ``python -m proxy serve`` of a tiny random
Qwen2.5-VL (uvicorn on 127.0.0.1, the engine in its own process: the default) and gets transformers'
``generate()`` answer for the same processor inputs, whole and streamed: the processor built without
video, the vision tower, and the M-RoPE positions through the served engine, which its execution plan
reports."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from media.images import data_url, encode, picture
from vision_fixtures import make_tiny_vlm, served_vlm, vlm_answer

from proxy.ports import LocalServer

NAME = "tiny-qwen2.5-vl"
NEW_TOKENS = 8
PNG = encode(picture((40, 30), seed=2))
QUESTION = "What is in this picture?"


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_vlm("qwen2_5_vl", tmp_path_factory.mktemp("vlm") / "tiny-qwen2.5-vl")


@pytest.fixture(scope="module")
def server(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalServer]:
    with served_vlm(folder, NAME, tmp_path_factory.mktemp("vlm-log") / "server.log") as started:
        yield started


def test_openai_sdk_image_on_qwen2_5_vl(server: LocalServer, folder: Path) -> None:
    import openai

    expected = vlm_answer(folder, QUESTION, PNG, NEW_TOKENS, ignore_eos=True)
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
    content = [{"type": "text", "text": QUESTION}, {"type": "image_url", "image_url": {"url": data_url(PNG)}}]
    ask = {"model": NAME, "messages": [{"role": "user", "content": content}], "max_tokens": NEW_TOKENS,
           "temperature": 0, "extra_body": {"ignore_eos": True}}
    whole = client.chat.completions.create(**ask)
    assert whole.choices[0].message.content == expected and expected
    assert whole.usage is not None and whole.usage.prompt_tokens > 20  # the image's 20 tokens counted
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in
                       client.chat.completions.create(**ask, stream=True) if chunk.choices)
    assert streamed == expected


def test_the_execution_plan_reports_m_rope(server: LocalServer) -> None:
    plan = httpx.get(f"{server.base_url}/server_info", timeout=10).json()["execution"]
    assert plan["rope_positions"] == "m-rope" and ", rotary positions m-rope," in plan["summary"]
