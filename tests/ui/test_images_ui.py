"""The chat page with an image, in a real headless Chromium against a tiny random LLaVA served on
127.0.0.1: a picked image is shown as a thumbnail, sent as a data: URL ``image_url`` part, shown in
the user's message, and the answer is the API's for the same request."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from media.images import data_url, encode, picture
from vision_fixtures import make_tiny_llava

from proxy.api.app import create_app
from proxy.settings import Settings

from .conftest import live_app
from .test_browser import console_errors, open_page, send, wait_for, wait_reply

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(180)]

NAME = "tiny-llava"
PNG = encode(picture((40, 30), seed=3))


@pytest.fixture(scope="module")
def vlm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder = make_tiny_llava(tmp_path_factory.mktemp("vlm") / "tiny-llava")
    settings = Settings(model=str(folder), served_model_name=NAME, max_model_len=256, num_kv_blocks=64,
                        block_size=4, num_threads=1, device="cpu", dtype="float32", engine_process=False)
    app = create_app(settings)
    with live_app(app, ready_timeout_s=120) as base:
        yield base


def test_an_attached_image_is_shown_and_sent(browser: Any, vlm_server: str, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By

    open_page(browser, vlm_server)
    browser.get_log("browser")
    browser.find_element(By.ID, "settings-toggle").click()
    for field, value in (("temperature", "0"), ("max-tokens", "8")):
        box = browser.find_element(By.ID, field)
        box.clear()
        box.send_keys(value)
    path = tmp_path / "picture.png"
    path.write_bytes(PNG)
    browser.find_element(By.ID, "image-file").send_keys(str(path))
    src = wait_for(browser, "const img = document.querySelector('#attachments img.thumb');"
                            "return img && !document.getElementById('attachments').hidden && img.src;")
    assert src == data_url(PNG)
    send(browser, "What is this?")
    reply = wait_reply(browser)
    shown = browser.execute_script(
        "const all = document.querySelectorAll('#log .message.user');"
        "return [...all[all.length - 1].querySelectorAll('img.thumb')].map(i => i.src);")
    assert shown == [data_url(PNG)]
    assert browser.execute_script("return document.getElementById('attachments').hidden") is True
    content = [{"type": "text", "text": "What is this?"},
               {"type": "image_url", "image_url": {"url": data_url(PNG)}}]
    api = httpx.post(f"{vlm_server}/v1/chat/completions", timeout=60, json={
        "model": NAME, "messages": [{"role": "user", "content": content}], "temperature": 0, "max_tokens": 8})
    assert api.status_code == 200, api.text
    assert reply["state"] == "done" and reply["text"] == api.json()["choices"][0]["message"]["content"] != ""
    assert console_errors(browser) == []
