"""The Vercel AI SDK's OpenAI provider (``@ai-sdk/openai``, pinned in package.json) sends an image with
its defaults (the Responses API's ``input_image`` and Chat Completions' ``image_url``, each a data: URL
of the bytes) to a real ``python -m proxy serve`` of a tiny random LLaVA and gets ``generate()``'s
answer for the same processor inputs."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from e2e.test_images_clients import NAME, PNG, QUESTION
from vision_fixtures import make_tiny_llava, served_vlm, vlm_answer

HERE = Path(__file__).resolve().parent
NODE = shutil.which("node")
NEW_TOKENS = 8

pytestmark = pytest.mark.skipif(NODE is None,
                                reason="node is not installed (the AI SDK test needs node and npm)")


def expected(folder: Path) -> str:
    """``generate()``'s greedy answer (stopping at EOS, as the server does) with the folder's processor."""
    return vlm_answer(folder, QUESTION, PNG, NEW_TOKENS, ignore_eos=False)


def test_ai_sdk_openai_provider_sends_an_image(tmp_path: Path) -> None:
    if not (HERE / "node_modules" / "@ai-sdk/openai" / "package.json").is_file():
        pytest.fail("the @ai-sdk/openai npm package is not installed in tests/node/node_modules: "
                    "run `make setup`")
    assert NODE is not None
    folder = make_tiny_llava(tmp_path / "tiny-llava")
    png = tmp_path / "picture.png"
    png.write_bytes(PNG)
    with served_vlm(folder, NAME, tmp_path / "server.log", "--no-engine-process") as server:
        proc = subprocess.run([NODE, str(HERE / "ai_sdk_image_check.mjs"), server.base_url, NAME, str(png)],
                              check=False, capture_output=True, text=True, timeout=120, cwd=HERE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    want = expected(folder)
    assert out["responses"]["text"] == out["chat"]["text"] == out["stream"]["text"] == want
    assert out["chat"]["usage"]["inputTokens"] > 16 and out["stream"]["errors"] == []  # the image's tokens
    assert out["responses"]["warnings"] == out["chat"]["warnings"] == []
