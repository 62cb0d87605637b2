"""The Anthropic Node SDK (``@anthropic-ai/sdk``, pinned in package.json) with its defaults against a
real uvicorn on 127.0.0.1 over the scripted engine (tests/api/fakes.py): ``messages.create``, the
``messages.stream()`` helper (its text events join to the text, its final message equals the non-stream
one), ``countTokens``, tools with a ``tool_use`` -> ``tool_result`` round trip, and a typed 400.

``make setup`` installs the package into ``tests/node/node_modules``; the test is skipped with its reason
only where node is not installed at all."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from api.conftest import REPLY, reply_ids
from api.fakes import FakeEngine, make_tokenizer, thread_server
from api.messages_sse import HERMES, MODEL

HERE = Path(__file__).resolve().parent
NODE = shutil.which("node")
KEY = "sk-node"

pytestmark = pytest.mark.skipif(NODE is None,
                                reason="node is not installed (the Node SDK test needs node and npm)")


def test_anthropic_node_sdk() -> None:
    if not (HERE / "node_modules" / "@anthropic-ai" / "sdk" / "package.json").is_file():
        pytest.fail("the @anthropic-ai/sdk npm package is not installed in tests/node/node_modules: "
                    "run `make setup`")
    assert NODE is not None
    engine = FakeEngine(reply_ids=reply_ids(make_tokenizer()))
    replies = {False: reply_ids(make_tokenizer()), True: reply_ids(make_tokenizer(), HERMES)}
    # a request with tools gets the tool call, one without gets the text (so the script is order-free)
    engine.script = lambda prompt, params: replies["get_weather" in make_tokenizer().decode(prompt)
                                                  and "Sunny" not in make_tokenizer().decode(prompt)]
    with thread_server(engine, api_keys=(KEY,), tool_call_parser="hermes") as (port, _):
        argv = [NODE, str(HERE / "messages_check.mjs"), f"http://127.0.0.1:{port}", MODEL, KEY]
        proc = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=120, cwd=HERE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
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
    assert "'image' is not supported" in err["message"]
