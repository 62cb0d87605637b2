"""Claude Code end to end (the npm ``@anthropic-ai/claude-code`` CLI, pinned in package.json), headless
(``claude -p ... --output-format json``), against a real uvicorn on 127.0.0.1 serving a 40k context.

The engine is the scripted one of the API tests (``tests/api/fakes.py``) behind the real app, with a
real tokenizer (the zoo's qwen2) and a Qwen3-shaped chat template (tools in ``<tool_call>`` tags,
``<think>`` thinking; ``qwen3_tools_template.jinja``): Claude Code's own requests (a ~11k-token prompt:
its system blocks, tools, a trailing system message, ``thinking: adaptive``, ``max_tokens: 32000``,
streamed, ``?beta=true``, ``Authorization: Bearer``) go through the whole Messages pipeline; the script
answers the first turn with thinking, text and a ``Read`` tool call of a file, and the second (which
carries the ``tool_result``) with the word the file holds, which Claude Code reports as its result.
The share of the second turn's prompt that is the first turn's prompt (what the prefix cache reuses)
is measured and printed.

``make setup`` installs the CLI into ``tests/node/node_modules`` (about 380 MB); the test is skipped
with its reason only where node is not installed."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from api.fakes import FakeEngine, thread_server
from testdata import zoo_path
from transformers import AutoTokenizer

from proxy.engine.client import AsyncEngineClient, ModelInfo
from proxy.sampling import SamplingParams
from proxy.tokenizer import Tokenizer

HERE = Path(__file__).resolve().parent
NODE = shutil.which("node")
CLAUDE = HERE / "node_modules" / ".bin" / "claude"  # the package's native binary
MODEL, KEY, CONTEXT = "local-model", "sk-claude", 40960

pytestmark = pytest.mark.skipif(NODE is None, reason="node is not installed (Claude Code needs node and npm)")


def _claude_env(base_url: str, home: Path) -> dict[str, str]:
    """The environment the README documents for Claude Code against this server."""
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home),
            "ANTHROPIC_BASE_URL": base_url, "ANTHROPIC_AUTH_TOKEN": KEY, "ANTHROPIC_MODEL": MODEL,
            "ANTHROPIC_DEFAULT_OPUS_MODEL": MODEL, "ANTHROPIC_DEFAULT_SONNET_MODEL": MODEL,
            "ANTHROPIC_DEFAULT_HAIKU_MODEL": MODEL, "ANTHROPIC_SMALL_FAST_MODEL": MODEL,
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1",
            "DISABLE_AUTOUPDATER": "1", "CLAUDE_CODE_ATTRIBUTION_HEADER": "0"}


def test_claude_code_first_turn_and_tool_round_trip(tmp_path: Path) -> None:
    if not CLAUDE.is_file():
        pytest.fail("the @anthropic-ai/claude-code npm package is not installed in tests/node/node_modules: "
                    "run `make setup`")
    hf = AutoTokenizer.from_pretrained(str(zoo_path("qwen2")))
    hf.chat_template = (HERE / "qwen3_tools_template.jinja").read_text()
    tok = Tokenizer(hf)
    secret = tmp_path / "work" / "secret.txt"
    secret.parent.mkdir()
    secret.write_text("The secret word is PLATYPUS.\n")
    eos = [hf.convert_tokens_to_ids("<|im_end|>")]
    prompts: list[list[int]] = []

    def script(prompt: list[int], params: SamplingParams) -> list[int]:
        text = tok.decode(prompt)
        prompts.append(list(prompt))
        if "<tool_response>" in text:
            found = re.search(r"secret word is (\w+)", text)
            word = found.group(1) if found else "?"
            reply = f"<think>The file was read.</think>The secret word is {word}."
        elif "secret.txt" in text:
            call = json.dumps({"name": "Read", "arguments": {"file_path": str(secret)}})
            reply = f"<think>I should read it.</think>I will read it.\n<tool_call>\n{call}\n</tool_call>"
        else:
            reply = "OK."
        return tok.encode(reply) + eos

    engine = FakeEngine(script=script)
    engine.eos_token_ids = tok.eos_token_ids
    client = AsyncEngineClient(engine, tok, ModelInfo(MODEL, CONTEXT, len(hf)))
    with thread_server(engine, MODEL, client=client, api_keys=(KEY,), tool_call_parser="hermes",
                       reasoning_parser="qwen3") as (port, app):
        argv = [str(CLAUDE), "-p", f"What is the secret word in {secret}?", "--output-format", "json",
                "--allowedTools", "Read", "--max-turns", "4"]
        proc = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=300,
                              cwd=secret.parent, env=_claude_env(f"http://127.0.0.1:{port}", tmp_path))
        metrics = app.state.server.client.metrics.render().decode()
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
    result = json.loads(proc.stdout)
    assert result["is_error"] is False and result["subtype"] == "success", result
    assert result["result"] == "The secret word is PLATYPUS." and result["num_turns"] == 2
    first, second = [p for p in prompts if len(p) > 1000][:2]
    assert len(first) > 5000  # Claude Code's system blocks and tools, rendered by the template
    shared = next((i for i, (a, b) in enumerate(zip(first, second)) if a != b), min(len(first), len(second)))
    print(f"claude code: prompts of {len(first)} and {len(second)} tokens; the second shares its first "
          f"{shared} tokens ({shared / len(second):.1%}) with the first")
    assert shared / len(second) > 0.9
    assert 'endpoint="/v1/messages"' in metrics
