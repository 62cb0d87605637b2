"""The Responses API (``/v1/responses``) end to end from Node: the OpenAI Node SDK
(``responses.create({stream: true})`` and the ``responses.stream`` helper, responses_check.mjs) and the
Vercel AI SDK's default OpenAI provider (``openai(model)`` of ``@ai-sdk/openai`` is the Responses API;
``generateText``, ``streamText``, a required tool call streamed and not, ai_sdk_check.mjs). The AI SDK
validates every event and body with zod schemas, so a field we lack fails the call.

Versions are pinned in package.json; ``make setup`` installs them into ``tests/node/node_modules``. Skipped
with its reason only where node is not installed at all."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from e2e.server import Server, get_server

HERE = Path(__file__).resolve().parent
NODE = shutil.which("node")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(NODE is None, reason="node is not installed (the Node SDK tests need node and npm)"),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Server:
    return get_server(tmp_path_factory.mktemp("node-responses"))


def run_script(script: str, package: str, server: Server) -> dict[str, Any]:
    if not (HERE / "node_modules" / package / "package.json").is_file():
        pytest.fail(
            f"the {package} npm package is not installed in tests/node/node_modules: run `make setup`"
        )
    assert NODE is not None
    proc = subprocess.run(
        [NODE, str(HERE / script), server.base_url, server.model],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=HERE,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def test_openai_node_sdk_responses_stream(server: Server) -> None:
    out = run_script("responses_check.mjs", "openai", server)
    full, stream, helper = out["full"], out["stream"], out["helper"]
    assert stream["sequence"] == list(range(len(stream["types"])))
    n = stream["deltas"]
    assert n >= 2 and stream["types"] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * n,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert full["text"] and stream["text"] == stream["final_text"] == full["text"]
    assert full["status"] == stream["status"] == "incomplete"
    assert full["incomplete"] == stream["incomplete"] == {"reason": "max_output_tokens"}
    counts = ("input_tokens", "output_tokens", "total_tokens")
    assert [stream["usage"][k] for k in counts] == [full["usage"][k] for k in counts]
    assert full["usage"]["output_tokens"] == 8
    assert helper["status"] == "completed"
    assert helper["text"] == helper["final_text"] == "Hello there, friend!"


def test_vercel_ai_sdk_openai_provider(server: Server) -> None:
    out = run_script("ai_sdk_check.mjs", "@ai-sdk/openai", server)
    gen, stream, called, streamed = out["generate"], out["stream"], out["tool"], out["streamTool"]
    assert gen["id"].startswith("resp_") and gen["warnings"] == []
    assert gen["text"] and stream["text"] == gen["text"] and stream["deltas"] >= 2
    assert gen["finishReason"] == stream["finishReason"] == "length"
    assert gen["usage"]["outputTokens"] == stream["usage"]["outputTokens"] == 8
    assert gen["usage"]["inputTokens"] == stream["usage"]["inputTokens"] > 0
    assert stream["errors"] == [] and streamed["errors"] == []
    for result in (called, streamed):
        assert result["finishReason"] == "tool-calls"
        (call,) = result["calls"]
        assert (
            call["name"] == "get_weather"
            and set(call["input"]) == {"city"}
            and call["id"].startswith("call_")
        )
    assert {"tool-input-start", "tool-input-delta", "tool-input-end", "tool-call"} <= set(streamed["parts"])
