"""``python -m proxy serve --model text.gguf --mmproj mmproj.gguf`` (uvicorn on 127.0.0.1) of the tiny
Idefics3 written as llama.cpp ships it (``gguf_vlm_fixtures``): the OpenAI SDK's image request, whole
and streamed, gets the greedy answer ``generate()`` gives from the Hugging Face folder the pair was
written from; an mmproj that is not one stops the start with one line naming the file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from gguf_vlm_fixtures import make_gguf_pair, round_vision_to_f16
from media.images import data_url, encode, picture
from vision_fixtures import build_tiny_idefics3, idefics3_processor, served_vlm, vlm_answer

from proxy.ports import REPO

NAME = "tiny-idefics3"
NEW_TOKENS = 8
PNG = encode(picture((40, 30), seed=2))
QUESTION = "What is in this picture?"


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    folder = tmp_path_factory.mktemp("hf") / NAME
    round_vision_to_f16(build_tiny_idefics3()).save_pretrained(folder)
    idefics3_processor().save_pretrained(folder)
    return (folder, *make_gguf_pair(folder, tmp_path_factory.mktemp("gguf")))


def test_openai_sdk_image_on_the_gguf_pair_equals_the_folders_generate(pair, tmp_path: Path) -> None:
    import openai

    folder, text, mmproj = pair
    expected = vlm_answer(folder, QUESTION, PNG, NEW_TOKENS, ignore_eos=True)
    extra = ("--mmproj", str(mmproj), "--cache-dir", str(tmp_path / "cache"), "--no-engine-process")
    with served_vlm(text, NAME, tmp_path / "server.log", *extra) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
        content = [{"type": "text", "text": QUESTION},
                   {"type": "image_url", "image_url": {"url": data_url(PNG)}}]
        ask = {"model": NAME, "messages": [{"role": "user", "content": content}], "max_tokens": NEW_TOKENS,
               "temperature": 0, "extra_body": {"ignore_eos": True}}
        whole = client.chat.completions.create(**ask)
        streamed = "".join(chunk.choices[0].delta.content or "" for chunk in
                           client.chat.completions.create(**ask, stream=True) if chunk.choices)
    assert whole.choices[0].message.content == expected and streamed == expected
    assert whole.usage.prompt_tokens > 20  # the image's 20 placeholders (4 tiles + the global view) counted


def test_a_file_that_is_no_mmproj_stops_the_start_naming_it(pair, tmp_path: Path) -> None:
    _, text, _ = pair
    argv = ["serve", "--model", str(text), "--mmproj", str(text), "--cache-dir", str(tmp_path), "--port", "0",
            "--device", "cpu"]
    done = subprocess.run([sys.executable, "-m", "proxy", *argv], check=False, cwd=REPO, capture_output=True,
                          text=True, timeout=300, env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 1, done.stderr[-2000:]
    assert done.stderr.splitlines()[-1].startswith(
        f"streamproxy: the model cannot be served: ModelLoadError: --mmproj {text.name}: not an mmproj file "
        "(general.architecture 'llama'")
    assert "Traceback" not in done.stderr
