"""Clients send an image with their defaults to a real ``python -m proxy serve`` of a tiny random LLaVA
(uvicorn on 127.0.0.1) and get transformers' ``generate()`` answer for the same processor inputs: the
OpenAI SDK (Chat Completions, streamed too, and Responses), LangChain's ``ChatOpenAI`` with a
``HumanMessage`` holding an image, and the Anthropic SDK (an ``image`` block)."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import pytest
from media.images import data_url, encode, picture
from vision_fixtures import make_tiny_llava, served_vlm, vlm_answer

from proxy.ports import LocalServer

NAME = "tiny-llava"
NEW_TOKENS = 8
PNG = encode(picture((40, 30), seed=2))
QUESTION = "What is in this picture?"


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llava(tmp_path_factory.mktemp("vlm") / "tiny-llava")


@pytest.fixture(scope="module")
def server(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalServer]:
    log = tmp_path_factory.mktemp("vlm-log") / "server.log"
    with served_vlm(folder, NAME, log, "--no-engine-process") as started:
        yield started


@pytest.fixture(scope="module")
def expected(folder: Path) -> str:
    """``generate()``'s greedy answer (EOS ignored, as the clients below ask) with the folder's processor."""
    return vlm_answer(folder, QUESTION, PNG, NEW_TOKENS, ignore_eos=True)


def test_openai_sdk(server: LocalServer, expected: str) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
    content = [{"type": "text", "text": QUESTION}, {"type": "image_url", "image_url": {"url": data_url(PNG)}}]
    ask = {"model": NAME, "messages": [{"role": "user", "content": content}], "max_tokens": NEW_TOKENS,
           "temperature": 0, "extra_body": {"ignore_eos": True}}
    whole = client.chat.completions.create(**ask)
    assert whole.choices[0].message.content == expected
    assert whole.usage is not None and whole.usage.prompt_tokens > 16  # the image's 16 tokens counted
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in
                       client.chat.completions.create(**ask, stream=True) if chunk.choices)
    assert streamed == expected
    parts = [{"type": "input_text", "text": QUESTION},
             {"type": "input_image", "image_url": data_url(PNG), "detail": "auto"}]
    response = client.responses.create(model=NAME, max_output_tokens=NEW_TOKENS, temperature=0,
                                       extra_body={"ignore_eos": True},
                                       input=[{"role": "user", "content": parts}])
    assert response.output_text == expected


def test_langchain_human_message_with_an_image(server: LocalServer, expected: str) -> None:
    from langchain_core.messages import HumanMessage
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", model=NAME, temperature=0,
                      max_tokens=NEW_TOKENS, extra_body={"ignore_eos": True})
    message = HumanMessage(content=[{"type": "text", "text": QUESTION},
                                    {"type": "image_url", "image_url": {"url": data_url(PNG)}}])
    assert chat.invoke([message]).content == expected


def test_anthropic_sdk_image_block(server: LocalServer, expected: str) -> None:
    import anthropic

    client = anthropic.Anthropic(base_url=server.base_url, api_key="unused")
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(PNG).decode()}}
    content = [{"type": "text", "text": QUESTION}, block]
    message = client.messages.create(model=NAME, max_tokens=NEW_TOKENS,
                                     extra_body={"ignore_eos": True, "temperature": 0},
                                     messages=[{"role": "user", "content": content}])
    assert message.content[0].type == "text" and message.content[0].text == expected
