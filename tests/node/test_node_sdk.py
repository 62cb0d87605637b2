"""End to end with the OpenAI Node SDK (the ``openai`` npm package, version pinned in package.json):
streamed text equals the non-streamed text, usage arrives in the last chunk (``include_usage``), and
bad requests reach the SDK as its typed errors with the HTTP status (400, 404), also for ``stream: true``.

``make setup`` installs the package into ``tests/node/node_modules``; the test is skipped with its reason
only where node is not installed at all."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from e2e.server import Server, get_server

HERE = Path(__file__).resolve().parent
NODE = shutil.which("node")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(NODE is None, reason="node is not installed (the Node SDK test needs node and npm)"),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Server:
    return get_server(tmp_path_factory.mktemp("node-sdk"))


def test_node_sdk_stream_usage_and_errors(server: Server) -> None:
    if not (HERE / "node_modules" / "openai" / "package.json").is_file():
        pytest.fail("the openai npm package is not installed in tests/node/node_modules: run `make setup`")
    assert NODE is not None
    proc = subprocess.run([NODE, str(HERE / "sdk_check.mjs"), server.base_url, server.model], check=False,
                          capture_output=True, text=True, timeout=300, cwd=HERE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    full, stream, errors = out["full"], out["stream"], out["errors"]

    assert full["content"] and stream["text"] == full["content"]
    assert stream["deltas"] >= 2 and stream["role"] == "assistant"
    assert stream["finish_reason"] == full["finish_reason"] == "length"
    # the counts agree; prompt_tokens_details may not (the second request's prompt hits the prefix cache)
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert [stream["usage"][k] for k in counts] == [full["usage"][k] for k in counts]
    assert 0 <= stream["usage"]["prompt_tokens_details"]["cached_tokens"] < stream["usage"]["prompt_tokens"]
    assert full["usage"]["completion_tokens"] == 12
    assert full["usage"]["total_tokens"] == full["usage"]["prompt_tokens"] + 12

    assert errors["empty_messages"]["status"] == 400
    assert errors["empty_messages"]["class"] == "BadRequestError"
    assert errors["empty_messages"]["type"] == "invalid_request_error"
    assert errors["unknown_model"]["status"] == 404 and errors["unknown_model"]["class"] == "NotFoundError"
    assert errors["stream_bad_request"]["status"] == 400
    assert errors["stream_bad_request"]["param"] == "max_tokens"
