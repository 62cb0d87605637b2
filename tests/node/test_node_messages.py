"""The Anthropic Node SDK (``@anthropic-ai/sdk``) and the Vercel AI SDK's Anthropic provider
(``@ai-sdk/anthropic``), pinned in package.json, with their defaults against a real uvicorn on 127.0.0.1
over the scripted engine (tests/api/fakes.py): ``messages.create``, the ``messages.stream()`` helper (its
text events join to the text, its final message equals the non-stream one), ``countTokens``, tools with
a ``tool_use`` -> ``tool_result`` round trip, a typed 400; ``generateText`` / ``streamText`` with and
without a tool call.

``make setup`` installs the package into ``tests/node/node_modules``; the test is skipped with its reason
only where node is not installed at all."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from api.conftest import REPLY, reply_ids
from api.fakes import FakeEngine, make_tokenizer, thread_server
from api.messages_sse import HERMES, MODEL

HERE = Path(__file__).resolve().parent
NODE = shutil.which("node")
KEY = "sk-node"

pytestmark = pytest.mark.skipif(NODE is None,
                                reason="node is not installed (the Node SDK test needs node and npm)")


def _run(script: str, package: str) -> dict[str, Any]:
    """Run ``script`` against a server whose scripted engine answers a request with tools (and no tool
    result yet) with a hermes call of ``get_weather``, any other with :data:`REPLY`; its JSON line."""
    if not (HERE / "node_modules" / package / "package.json").is_file():
        pytest.fail(f"the {package} npm package is not installed in tests/node/node_modules: "
                    "run `make setup`")
    assert NODE is not None
    engine = FakeEngine(reply_ids=reply_ids(make_tokenizer()))
    replies = {False: reply_ids(make_tokenizer()), True: reply_ids(make_tokenizer(), HERMES)}
    engine.script = lambda prompt, params: replies["get_weather" in make_tokenizer().decode(prompt)
                                                  and "Sunny" not in make_tokenizer().decode(prompt)]
    with thread_server(engine, api_keys=(KEY,), tool_call_parser="hermes") as (port, _):
        argv = [NODE, str(HERE / script), f"http://127.0.0.1:{port}", MODEL, KEY]
        proc = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=120, cwd=HERE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def test_anthropic_node_sdk() -> None:
    out = _run("messages_check.mjs", "@anthropic-ai/sdk")
    full = out["full"]
    assert full["type"] == "message" and full["content"] == [{"type": "text", "text": REPLY}]
    assert full["stop_reason"] == "end_turn" and out["same"] and out["text"] == REPLY
    assert out["count"] == full["usage"]["input_tokens"] + full["usage"]["cache_read_input_tokens"]
    call = out["call"]
    assert call["stop_reason"] == "tool_use" and out["toolSame"]
    use = call["content"][-1]
    assert use["type"] == "tool_use" and use["id"].startswith("toolu_") and use["input"] == {"city": "Oslo"}
    assert out["answer"]["content"] == [{"type": "text", "text": REPLY}]
    err = out["error"]
    assert err["class"] == "BadRequestError" and err["status"] == 400
    assert err["type"] == "invalid_request_error"
    assert "is an image, but the model" in err["message"] and "reads text only" in err["message"]


def test_ai_sdk_anthropic_provider() -> None:
    out = _run("ai_sdk_anthropic_check.mjs", "@ai-sdk/anthropic")
    gen, stream = out["generate"], out["stream"]
    assert gen["text"] == stream["text"] == REPLY and gen["finishReason"] == stream["finishReason"] == "stop"
    assert gen["usage"]["outputTokens"] == stream["usage"]["outputTokens"] > 0 and gen["warnings"] == []
    oslo = [{"name": "get_weather", "input": {"city": "Oslo"}}]
    assert out["tool"]["calls"] == out["streamTool"]["calls"] == oslo
    assert out["tool"]["finishReason"] == out["streamTool"]["finishReason"] == "tool-calls"
    assert out["errors"] == []
