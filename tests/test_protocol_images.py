"""Image parts of Chat Completions, Responses and Messages -> ImagePart (param, url, detail) and the
template content of their messages; malformed parts a 400 naming the field."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.errors import InvalidRequestError
from proxy.protocol import ImagePart, parse_chat_request
from proxy.protocol.messages_request import messages_param, parse_messages_request
from proxy.protocol.responses_request import parse_responses_request

URL = "data:image/png;base64,AAAA"


def chat(content: Any, role: str = "user", **extra: Any) -> Any:
    turns = [{"role": "system", "content": "s"}, {"role": role, "content": content}]
    return parse_chat_request({"model": "m", "messages": turns, **extra}, max_n=1)


def test_chat_image_parts_in_order_with_template_content() -> None:
    parsed = chat([{"type": "text", "text": "a"}, {"type": "text", "text": "b"},
                   {"type": "image_url", "image_url": {"url": URL, "detail": "high"}},
                   {"type": "text", "text": "c"}, {"type": "image_url", "image_url": {"url": "https://x/y.jpg"}}])
    assert parsed.images == (ImagePart("messages[1].content[2]", URL, "high"),
                             ImagePart("messages[1].content[4]", "https://x/y.jpg"))
    assert parsed.messages[1]["content"] == [{"type": "text", "text": "a\nb"}, {"type": "image"},
                                             {"type": "text", "text": "c"}, {"type": "image"}]
    assert parsed.messages[0]["content"] == "s"
    texts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert chat(texts).messages[1]["content"] == "a\nb" and chat(texts).images == ()


def test_images_across_turns_keep_prompt_order() -> None:
    image = {"type": "image_url", "image_url": {"url": URL}}
    parsed = parse_chat_request({"model": "m", "messages": [
        {"role": "user", "content": [image]}, {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [{"type": "text", "text": "and"}, image]}]}, max_n=1)
    assert [im.param for im in parsed.images] == ["messages[0].content[0]", "messages[2].content[1]"]


CHAT_BAD = [  # (content, role, param, words)
    ([{"type": "image_url"}], "user", "messages[1].content[0].image_url", "must be an object with a 'url'"),
    ([{"type": "image_url", "image_url": "https://x"}], "user", "messages[1].content[0].image_url",
     "must be an object"),
    ([{"type": "image_url", "image_url": {"url": ""}}], "user", "messages[1].content[0].image_url.url",
     "non-empty URL string"),
    ([{"type": "image_url", "image_url": {"url": "ftp://x/y.png"}}], "user",
     "messages[1].content[0].image_url.url", "got 'ftp'"),
    ([{"type": "image_url", "image_url": {"url": "/etc/passwd"}}], "user",
     "messages[1].content[0].image_url.url", "must be a data: URL"),
    ([{"type": "image_url", "image_url": {"url": URL, "detail": "max"}}], "user",
     "messages[1].content[0].image_url.detail", "must be one of auto, low, high"),
    ([{"type": "image_url", "image_url": {"url": URL}}], "assistant", "messages[1].content[0]",
     "images are only allowed in user messages (this one is role 'assistant')"),
    ([{"type": "image_url", "image_url": {"url": URL}}], "system", "messages[1].content[0]",
     "only allowed in user messages"),
    ([{"type": "input_audio", "input_audio": {}}], "user", "messages[1].content[0].type",
     "'input_audio' is not supported; only 'text' and 'image_url' are"),
]


@pytest.mark.parametrize(("content", "role", "param", "words"), CHAT_BAD)
def test_chat_bad_image_parts(content: Any, role: str, param: str, words: str) -> None:
    with pytest.raises(InvalidRequestError) as err:
        chat(content, role)
    assert err.value.param == param and words in err.value.message, err.value.message


def responses(content: Any, role: str = "user") -> Any:
    return parse_responses_request({"model": "m", "instructions": "be brief",
                                    "input": [{"role": role, "content": content}]}, [])


def test_responses_input_image() -> None:
    parsed = responses([{"type": "input_text", "text": "what"},
                        {"type": "input_image", "image_url": URL, "detail": "auto"}])
    assert parsed.chat.images == (ImagePart("input[0].content[1]", URL, "auto"),)
    assert parsed.chat.messages[1]["content"] == [{"type": "text", "text": "what"}, {"type": "image"}]


@pytest.mark.parametrize(("content", "role", "param", "words"), [
    ([{"type": "input_image", "file_id": "file-1"}], "user", "input[0].content[0].file_id", "no Files API"),
    ([{"type": "input_image"}], "user", "input[0].content[0].image_url", "non-empty URL string"),
    ([{"type": "input_image", "image_url": URL, "detail": "x"}], "user", "input[0].content[0].detail",
     "must be one of"),
    ([{"type": "input_image", "image_url": URL}], "assistant", "input[0].content[0]",
     "only allowed in user messages"),
    ([{"type": "input_file", "file_id": "f"}], "user", "input[0].content[0].type", "only text and images"),
])
def test_responses_bad_images(content: Any, role: str, param: str, words: str) -> None:
    with pytest.raises(InvalidRequestError) as err:
        responses(content, role)
    assert err.value.param == param and words in err.value.message, err.value.message


def messages(content: Any, system: Any = "s") -> Any:
    return parse_messages_request({"model": "m", "max_tokens": 5, "system": system, "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"},
        {"role": "user", "content": content}]})


def test_anthropic_image_blocks_and_their_names() -> None:
    parsed = messages([{"type": "tool_result", "tool_use_id": "t", "content": "x"},
                       {"type": "text", "text": "look"},
                       {"type": "image", "source": {"type": "base64", "media_type": "image/webp",
                                                    "data": "UklG"}},
                       {"type": "image", "source": {"type": "url", "url": "https://x/a.gif"}}])
    images = parsed.chat.images
    assert [im.url for im in images] == ["data:image/webp;base64,UklG", "https://x/a.gif"]
    assert parsed.chat.messages[-1]["content"] == [{"type": "text", "text": "look"}, {"type": "image"},
                                                   {"type": "image"}]
    # chat index 4 (system, user, assistant, tool, user) -> the Anthropic message, through messages_param
    assert [im.param for im in images] == ["messages[4].content[2]", "messages[4].content[3]"]
    renamed = [messages_param(InvalidRequestError(f"'{im.param}' x", param=im.param), parsed.paths)
               for im in images]
    assert [(e.param, e.message) for e in renamed] == [
        ("messages[2].content[2]", "'messages[2].content[2]' x"),
        ("messages[2].content[3]", "'messages[2].content[3]' x")]
    no_system = messages([{"type": "image", "source": {"type": "url", "url": "https://x/a.gif"}}], None)
    param = no_system.chat.images[0].param
    renamed_param = messages_param(InvalidRequestError("x", param=param), no_system.paths).param
    assert renamed_param == "messages[2].content[0]"


@pytest.mark.parametrize(("block", "param", "words"), [
    ({"type": "image"}, "messages[2].content[0].source", "must be an object"),
    ({"type": "image", "source": {"type": "base64", "media_type": "image/tiff", "data": "AA"}},
     "messages[2].content[0].source.media_type", "one of image/jpeg, image/png, image/gif, image/webp"),
    ({"type": "image", "source": {"type": "base64", "media_type": "image/png"}},
     "messages[2].content[0].source.data", "non-empty base64 string"),
    ({"type": "image", "source": {"type": "url", "url": "gopher://x"}}, "messages[2].content[0].source.url",
     "got 'gopher'"),
    ({"type": "image", "source": {"type": "file", "file_id": "f"}}, "messages[2].content[0].source.type",
     "no Files API"),
    ({"type": "image", "source": {"type": "text"}}, "messages[2].content[0].source.type",
     "must be 'base64' or 'url'"),
])
def test_anthropic_bad_image_blocks(block: dict[str, Any], param: str, words: str) -> None:
    with pytest.raises(InvalidRequestError) as err:
        messages([block])
    assert err.value.param == param and words in err.value.message, err.value.message
