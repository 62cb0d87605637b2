"""Anthropic context editing (``context_management``) on ``/v1/messages`` and ``count_tokens``: the edits
as rules over the messages, and served (the prompt the engine gets, ``applied_edits`` on the message and
on the stream's ``message_delta``, ``original_input_tokens`` from ``count_tokens``), over the scripted
engine."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from anthropic.types.beta import BetaMessage, BetaMessageTokensCount, BetaRawMessageDeltaEvent

from proxy.errors import InvalidRequestError
from proxy.protocol.messages_context import (
    CLEARED_TOOL_RESULT,
    ClearToolUses,
    clear_thinking,
    clear_tool_uses,
    parse_context_management,
)

from .conftest import run, serve
from .messages_sse import TOOL, body, events

LOOKUP = {**TOOL, "name": "lookup"}


def conversation(num_calls: int, thinking: bool = False) -> list[dict[str, Any]]:
    """A user question, then ``num_calls`` rounds of (assistant tool_use, user tool_result) with long
    results, alternating the tools get_weather / lookup."""
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Oslo and Bergen?"}]
    for k in range(num_calls):
        name = "get_weather" if k % 2 == 0 else "lookup"
        content: list[dict[str, Any]] = [{"type": "tool_use", "id": f"toolu_{k}", "name": name,
                                          "input": {"city": f"City{k}"}}]
        if thinking:
            content.insert(0, {"type": "thinking", "thinking": f"Step {k} needs a call.", "signature": "x"})
        msgs.append({"role": "assistant", "content": content})
        msgs.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_{k}",
                                                  "content": f"Result {k}: " + "sunny and mild " * 30}]})
    return msgs


def results(msgs: list[dict[str, Any]]) -> list[Any]:
    return [b["content"] for m in msgs if isinstance(m["content"], list) for b in m["content"]
            if b["type"] == "tool_result"]


def test_clear_tool_uses_keeps_the_newest_and_the_excluded() -> None:
    msgs = conversation(5)
    before = copy.deepcopy(msgs)
    edit = ClearToolUses(keep=2, exclude_tools=frozenset({"lookup"}),
                         clear_tool_inputs=frozenset({"get_weather"}))
    out, num = clear_tool_uses(msgs, edit)
    assert msgs == before  # the client's history is not touched
    # tool uses 0..2 are the candidates (3 and 4 kept); 1 is a lookup (excluded): 0 and 2 cleared
    assert num == 2
    got = results(out)
    assert got[0] == got[2] == CLEARED_TOOL_RESULT
    assert got[1] == results(before)[1] and got[3:] == results(before)[3:]
    assert [m["content"][0]["input"] for m in out[1::2]] == [{}, {"city": "City1"}, {}, {"city": "City3"},
                                                            {"city": "City4"}]
    assert clear_tool_uses(out, edit)[1] == 0  # already cleared: nothing more
    assert clear_tool_uses(msgs, ClearToolUses(keep=9))[1] == 0


def test_clear_thinking_keeps_the_last_turns() -> None:
    msgs = conversation(3, thinking=True)
    out, num = clear_thinking(msgs, 1)
    assert num == 2
    assert [[b["type"] for b in m["content"]] for m in out[1::2]] == [["tool_use"], ["tool_use"],
                                                                       ["thinking", "tool_use"]]
    assert clear_thinking(msgs, None) == (msgs, 0) and clear_thinking(msgs, 3) == (msgs, 0)


@pytest.mark.parametrize(("value", "param"), [
    ({"edits": [{"type": "compact_20260112"}]}, "context_management.edits[0].type"),
    ({"edits": [{"type": "clear_thinking_20251015"}, {"type": "nope"}]}, "context_management.edits[1].type"),
    ({"edits": [{"type": "clear_tool_uses_20250919", "keep": {"type": "input_tokens", "value": 3}}]},
     "context_management.edits[0].keep.type"),
    ({"edits": [{"type": "clear_tool_uses_20250919", "trigger": {"type": "tool_uses", "value": 0}}]},
     "context_management.edits[0].trigger.value"),
    ({"edits": [{"type": "clear_tool_uses_20250919", "exclude_tools": "lookup"}]},
     "context_management.edits[0].exclude_tools"),
    ({"edits": [{"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 0}}]},
     "context_management.edits[0].keep.value"),
    ({"edits": {}}, "context_management.edits"),
    ([], "context_management"),
])
def test_bad_edits_are_refused_by_name(value: Any, param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        parse_context_management(value)
    assert info.value.param == param


def test_parsed_defaults() -> None:
    tools, thinking, everything = parse_context_management({"edits": [
        {"type": "clear_tool_uses_20250919"}, {"type": "clear_thinking_20251015"},
        {"type": "clear_thinking_20251015", "keep": "all"}]})
    assert tools == ClearToolUses("input_tokens", 100_000, 3, 0, frozenset(), False)
    assert thinking.keep == 1 and everything.keep is None


def _tool_edit(**kw: Any) -> dict[str, Any]:
    return {"edits": [{"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens", "value": 50},
                       "keep": {"type": "tool_uses", "value": 1}, **kw}]}


def test_served_tool_use_clearing() -> None:
    msgs = conversation(4)
    edited, _ = clear_tool_uses(msgs, ClearToolUses(keep=1))
    ask = body(tools=[TOOL, LOOKUP], messages=msgs)

    async def main():
        async with serve(max_model_len=4096) as s:
            async def post(path: str, b: dict[str, Any]) -> dict[str, Any]:
                r = await s.client.post(path, json=b)
                assert r.status_code == 200, r.text
                return r.json()

            full = await post("/v1/messages/count_tokens", ask)
            cut = await post("/v1/messages/count_tokens", {**ask, "messages": edited})
            managed = {**ask, "context_management": _tool_edit()}
            count = await post("/v1/messages/count_tokens", managed)
            msg = await post("/v1/messages", managed)
            prompt = s.tokenizer.decode(s.engine.submitted[-1][1])
            raw = (await s.client.post("/v1/messages", json={**managed, "stream": True})).content
            too_little = await post("/v1/messages", {**ask, "context_management": _tool_edit(
                clear_at_least={"type": "input_tokens", "value": 10**6})})
            not_yet = await post("/v1/messages", {**ask, "context_management": {"edits": [
                {"type": "clear_tool_uses_20250919", "trigger": {"type": "tool_uses", "value": 4}}]}})
            claude_code = await post("/v1/messages", {**ask, "context_management": {"edits": [
                {"type": "clear_thinking_20251015", "keep": "all"}]}})
            plain = await post("/v1/messages", ask)
            return full, cut, count, msg, prompt, events(raw), too_little, not_yet, claude_code, plain

    full, cut, count, msg, prompt, evts, too_little, not_yet, claude_code, plain = run(main())
    freed = full["input_tokens"] - cut["input_tokens"]
    assert freed > 0
    applied = {"applied_edits": [{"type": "clear_tool_uses_20250919", "cleared_tool_uses": 3,
                                  "cleared_input_tokens": freed}]}
    assert BetaMessageTokensCount.model_validate(count)
    assert count == {"input_tokens": cut["input_tokens"],
                     "context_management": {"original_input_tokens": full["input_tokens"]}}
    assert BetaMessage.model_validate(msg).context_management is not None
    assert msg["context_management"] == applied
    usage = msg["usage"]
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == cut["input_tokens"]
    assert prompt.count(CLEARED_TOOL_RESULT) == 3 and "Result 3: sunny" in prompt and "Result 0" not in prompt
    delta = next(e for e in evts if e["type"] == "message_delta")
    assert BetaRawMessageDeltaEvent.model_validate(delta).context_management is not None
    assert delta["context_management"] == applied
    assert "context_management" not in next(e for e in evts if e["type"] == "message_start")["message"]
    for unchanged in (too_little, not_yet, claude_code):
        assert unchanged["context_management"] == {"applied_edits": []}
        assert unchanged["usage"]["input_tokens"] + unchanged["usage"]["cache_read_input_tokens"] == full[
            "input_tokens"]
    assert "context_management" not in plain


def test_served_thinking_clearing_reports_the_turns() -> None:
    ask = body(messages=conversation(3, thinking=True), tools=[TOOL, LOOKUP], thinking={"type": "adaptive"},
               context_management={"edits": [{"type": "clear_thinking_20251015"}]})

    async def main():
        async with serve(reasoning_parser="qwen3", max_model_len=4096) as s:
            msg = (await s.client.post("/v1/messages", json=ask)).json()
            kept = (await s.client.post("/v1/messages/count_tokens", json={
                **ask, "messages": clear_thinking(ask["messages"], 1)[0]})).json()
            whole = (await s.client.post("/v1/messages/count_tokens", json={
                k: v for k, v in ask.items() if k != "context_management"})).json()
            return msg, kept, whole

    msg, kept, whole = run(main())
    assert msg["context_management"] == {"applied_edits": [{
        "type": "clear_thinking_20251015", "cleared_thinking_turns": 2,
        "cleared_input_tokens": whole["input_tokens"] - kept["input_tokens"]}]}
