"""Images sent to a model that reads text only, and malformed image parts, on every endpoint that
takes a chat: each a 400 naming the part in the endpoint's own error envelope, never a 5xx; the
server stays healthy."""

from __future__ import annotations

from typing import Any

import pytest

from .conftest import MODEL, run, serve

PNG = "data:image/png;base64,iVBORw0KGgo="
TEXT_ONLY = f"is an image, but the model '{MODEL}' reads text only"


def _chat(content: list[dict[str, Any]]) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "system", "content": "s"},
                                         {"role": "user", "content": content}]}


def _responses(content: list[dict[str, Any]]) -> dict[str, Any]:
    return {"model": MODEL, "input": [{"role": "user", "content": content}]}


def _messages(content: list[dict[str, Any]]) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 8, "system": "s",
            "messages": [{"role": "user", "content": content}]}


LOOK = {"type": "text", "text": "What is this?"}
CHAT_IMAGE = {"type": "image_url", "image_url": {"url": PNG}}
RESP_IMAGE = {"type": "input_image", "image_url": "https://example.com/a.png", "detail": "auto"}
MSG_IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
CASES = [  # (name, path, body, param, words)
    ("chat", "/v1/chat/completions", _chat([LOOK, CHAT_IMAGE]), "messages[1].content[1]", TEXT_ONLY),
    ("chat stream", "/v1/chat/completions", {**_chat([CHAT_IMAGE]), "stream": True}, "messages[1].content[0]",
     TEXT_ONLY),
    ("chat render", "/v1/chat/completions/render", _chat([CHAT_IMAGE]), "messages[1].content[0]", TEXT_ONLY),
    ("tokenize", "/tokenize", _chat([LOOK, CHAT_IMAGE]), "messages[1].content[1]", TEXT_ONLY),
    ("responses", "/v1/responses", _responses([LOOK, RESP_IMAGE]), "input[0].content[1]", TEXT_ONLY),
    ("responses stream", "/v1/responses", {**_responses([RESP_IMAGE]), "stream": True}, "input[0].content[0]",
     TEXT_ONLY),
    ("responses input_tokens", "/v1/responses/input_tokens", _responses([RESP_IMAGE]), "input[0].content[0]",
     TEXT_ONLY),
    ("responses render", "/v1/responses/render", _responses([LOOK, RESP_IMAGE]), "input[0].content[1]",
     TEXT_ONLY),
    ("messages", "/v1/messages", _messages([LOOK, MSG_IMAGE]), "messages[0].content[1]", TEXT_ONLY),
    ("messages stream", "/v1/messages", {**_messages([MSG_IMAGE]), "stream": True}, "messages[0].content[0]",
     TEXT_ONLY),
    ("count_tokens", "/v1/messages/count_tokens", _messages([MSG_IMAGE]), "messages[0].content[0]",
     TEXT_ONLY),
    ("chat no url", "/v1/chat/completions", _chat([{"type": "image_url", "image_url": {}}]),
     "messages[1].content[0].image_url.url", "must be a non-empty URL string"),
    ("chat svg scheme", "/v1/chat/completions",
     _chat([{"type": "image_url", "image_url": {"url": "javascript:alert(1)"}}]),
     "messages[1].content[0].image_url.url", "must be a data: URL"),
    ("chat assistant image", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "assistant", "content": [CHAT_IMAGE]}]},
     "messages[0].content[0]", "only allowed in user messages"),
    ("responses file_id", "/v1/responses", _responses([{"type": "input_image", "file_id": "file-1"}]),
     "input[0].content[0].file_id", "no Files API"),
    ("messages svg", "/v1/messages", _messages([{"type": "image", "source": {
        "type": "base64", "media_type": "image/svg+xml", "data": "PHN2Zz4="}}]),
     "messages[0].content[0].source.media_type", "must be one of"),
]


@pytest.mark.parametrize(("path", "body", "param", "words"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_images_are_a_400_naming_the_part(path: str, body: dict[str, Any], param: str, words: str) -> None:
    async def main() -> tuple[Any, Any]:
        async with serve() as s:
            response = await s.client.post(path, json=body)
            health = await s.client.get("/health")
            return response, health

    response, health = run(main())
    assert response.status_code == 400, response.text
    assert health.status_code == 200
    err = response.json()["error"]
    assert err["type"] == "invalid_request_error" and f"'{param}'" in err["message"], err
    assert words in err["message"], err["message"]
    if path.startswith("/v1/messages"):  # Anthropic's envelope: the field is named in the message only
        assert response.json()["type"] == "error" and "param" not in err
    else:
        assert err["param"] == param


def test_a_vision_model_served_as_text_says_why_it_refuses_images(monkeypatch: pytest.MonkeyPatch) -> None:
    """Llama 4 loads as a text model (transformers' causal-LM mapping); its images are a 400 naming the
    part and the reason; a type with a reason of its own (``IMAGES_REFUSED``) gives that one."""
    from dataclasses import replace

    from transformers import Gemma3Config, Llama4Config, LlamaConfig

    from proxy.media import processor
    from proxy.media.processor import images_refusal

    from . import conftest

    assert images_refusal(Llama4Config()) == "is served as a text model: its vision tower is not run"
    assert images_refusal(LlamaConfig()) is None and images_refusal(Gemma3Config()) is None  # served
    monkeypatch.setitem(processor.IMAGES_REFUSED, "llama4", "is served as a text model: a reason of its own")
    why = images_refusal(Llama4Config())
    assert why == "is served as a text model: a reason of its own"
    plain = conftest.fake_client

    def text_vlm_client(*args: Any, **kwargs: Any) -> Any:
        client = plain(*args, **kwargs)
        client.model = replace(client.model, images_refused=why)
        return client

    monkeypatch.setattr(conftest, "fake_client", text_vlm_client)

    async def main() -> Any:
        async with serve() as s:
            return await s.client.post("/v1/chat/completions", json=_chat([LOOK, CHAT_IMAGE]))

    response = run(main())
    assert response.status_code == 400, response.text
    assert response.json()["error"]["message"] == (
        f"'messages[1].content[1]' is an image, but the model '{MODEL}' {why}.")
