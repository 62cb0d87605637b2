"""The README's examples, run as written against live servers (only host/port and paths substituted)."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from api.fakes import make_tiny_model

from proxy.ports import start_serve

from .server import REPO, Server, sse_chunks

pytestmark = pytest.mark.slow

README = (REPO / "README.md").read_text(encoding="utf-8")
BLOCKS = re.findall(r"```(\w+)\n(.*?)```", README, flags=re.DOTALL)
DEFAULT_URL = "127.0.0.1:8000"


def blocks(lang: str, needle: str) -> list[str]:
    return [code for kind, code in BLOCKS if kind == lang and needle in code]


PYTHON_EXAMPLES = ["stream=True", "llm.stream(", "chat.completions.parse(", "bind_tools(",
                   "embeddings.create(", "responses.stream(", "messages.stream("]
"""One needle per Python example of the README, each in exactly one block."""


def test_readme_has_the_examples():
    assert blocks("bash", "make serve") and blocks("bash", "curl -N")
    assert blocks("python", "from openai import OpenAI") and blocks("python", "ChatOpenAI")
    assert blocks("bash", "streamproxy serve --model ") and blocks("bash", "streamproxy serve --models-max")
    assert sum(len(blocks("python", n)) for n in PYTHON_EXAMPLES) == len(blocks("python", ""))


@pytest.mark.parametrize("needle", PYTHON_EXAMPLES)
def test_python_examples(server: Server, needle: str):
    (code,) = blocks("python", needle)
    assert server.model in code
    code = code.replace(DEFAULT_URL, f"127.0.0.1:{server.port}")
    out = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip()


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_example(server: Server):
    (code,) = blocks("bash", "curl -N")
    code = code.replace(DEFAULT_URL, f"127.0.0.1:{server.port}")
    out = subprocess.run(["bash", "-c", code], check=False, capture_output=True, timeout=300)
    assert out.returncode == 0, out.stderr
    chunks = sse_chunks(out.stdout)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}


def test_serve_another_model(tmp_path: Path):
    (code,) = blocks("bash", "streamproxy serve --model ")
    folder = tmp_path / "tiny-llama"
    make_tiny_model(folder)
    argv = shlex.split(code.strip())
    assert argv[:3] == ["streamproxy", "serve", "--model"]
    argv[3] = str(folder)
    name = argv[argv.index("--served-model-name") + 1]
    srv = start_serve([*argv[2:], "--num-threads", "1", "--max-model-len", "256", "--num-kv-blocks", "64"],
                      tmp_path / "server.log", timeout_s=300)
    log, base, port = srv.log_path, srv.base_url, srv.port
    try:
        assert httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"] == name
        body = {"model": name, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 5,
                "temperature": 0, "ignore_eos": True}
        full = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60).json()
        r = httpx.post(f"{base}/v1/chat/completions", json={**body, "stream": True}, timeout=60)
        chunks = sse_chunks(r.content)
        assert full["usage"]["completion_tokens"] == 5 and full["choices"][0]["finish_reason"] == "length"
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
        assert text == full["choices"][0]["message"]["content"]
        assert "ready" in log.read_text() and f"127.0.0.1:{port}" in log.read_text()
    finally:
        srv.stop(30.0)


def test_serve_two_models(tmp_path: Path):
    """The quick start's two models: paths replaced by two tiny models, the ids kept."""
    (code,) = blocks("bash", "streamproxy serve --models-max")
    serve_line, curl_line = code.strip().splitlines()
    argv = shlex.split(serve_line)
    names = []
    for i, arg in enumerate(argv):
        if argv[i - 1] == "--model":
            names.append(arg.rpartition("=")[2])
            argv[i] = f"{make_tiny_model(tmp_path / names[-1], seed=len(names))}={names[-1]}"
    assert argv[1] == "serve"
    srv = start_serve([*argv[2:], "--num-threads", "1", "--max-model-len", "256", "--num-kv-blocks", "64",
                       "--no-engine-process"], tmp_path / "server.log", timeout_s=300)
    base = srv.base_url
    try:
        listed = subprocess.run(["bash", "-c", curl_line.replace(DEFAULT_URL, f"127.0.0.1:{srv.port}")],
                                check=True, capture_output=True, timeout=60).stdout
        assert [(m["id"], m["status"]) for m in json.loads(listed)["data"]] == [
            (n, {"value": "unloaded"}) for n in names]
        for name in (*names, names[0]):
            body = {"model": name, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3}
            assert httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120).json()["model"] == name
        states = {m["id"]: m["status"]["value"] for m in httpx.get(f"{base}/v1/models").json()["data"]}
        assert states == {names[0]: "loaded", names[1]: "unloaded"}  # --models-max 1
    finally:
        srv.stop(30.0)
