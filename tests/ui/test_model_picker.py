"""The chat page on a several-model server: the model picker lists the generating models with their
state, a message to an unloaded model loads it and gets its reply, and the states refresh after it."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from api.fakes import FakeEngine, fake_client, make_hf_tokenizer, make_tokenizer

from proxy.api.app import create_app
from proxy.settings import Settings

from .conftest import live_app
from .test_browser import WAIT_S, console_errors, open_page, send, wait_for, wait_reply


class Embedder:
    served_model_name, created, max_model_len = "", 0, 128

    def shutdown(self) -> None:
        pass


def _factory(gate: threading.Event) -> Any:
    def build(settings: Settings) -> Any:
        name = settings.served_model_name or ""
        assert gate.wait(WAIT_S)
        eos = make_hf_tokenizer().convert_tokens_to_ids("<|im_end|>")
        engine = FakeEngine(reply_ids=[*make_tokenizer().encode(f"I am {name}."), eos])
        return fake_client(engine, name, 1024, vocab_size=len(make_hf_tokenizer()))

    return build


def options(driver: Any) -> list[str]:
    return list(driver.execute_script("return [...document.querySelectorAll('#model option')]"
                                      ".map(o => o.value + ': ' + o.textContent);"))


def test_the_picker_shows_each_models_state_and_loads_the_chosen_one(browser: Any, tmp_path: Path) -> None:
    for name in ("chat", "coder", "bge"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
    file = tmp_path / "models.toml"
    file.write_text('[models.chat]\npath = "chat"\n[models.coder]\npath = "coder"\n'
                    '[models.bge]\npath = "bge"\nkind = "embedding"\n')
    gate = threading.Event()
    settings = Settings(models_file=str(file), keepalive_interval_s=0.2, models_memory_bytes=0)
    app = create_app(settings, _factory(gate), embedding_factory=lambda s, m: Embedder())
    with live_app(app) as base:
        open_page(browser, base)
        assert options(browser) == ["chat: chat (unloaded)", "coder: coder (unloaded)"]
        browser.execute_script("document.getElementById('model').value = 'coder';")
        send(browser, "hello")
        wait_for(browser, "return document.querySelector('#log .message.assistant') !== null")
        assert app.state.server.registry.find("coder").status == "loading"
        gate.set()
        assert wait_reply(browser)["text"] == "I am coder."
        wait_for(browser, "return [...document.querySelectorAll('#model option')]"
                          ".some(o => o.textContent === 'coder (1024 ctx)');")
        assert options(browser) == ["chat: chat (unloaded)", "coder: coder (1024 ctx)"]
        assert browser.execute_script("return document.getElementById('model').value") == "coder"
        assert console_errors(browser) == []
