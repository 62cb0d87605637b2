"""A bounded fuzz of ``/v1/messages`` bodies (hypothesis, 150 bodies, stream and not) against a real
uvicorn over the scripted engine: whatever the body, the answer is a 200 whose message (or stream)
the SDK's types accept, or a 4xx in Anthropic's envelope; never a 5xx."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from anthropic.types import Message
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .conftest import reply_ids
from .fakes import FakeEngine, make_tokenizer, thread_server
from .messages_sse import HERMES, MODEL, TOOL, events, fold

scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 40000), st.floats(-2, 3, allow_nan=False),
                    st.text(max_size=12))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)


def maybe(good: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """``good`` or any JSON value (``good`` about 3 times in 4)."""
    return st.one_of(good, good, good, values)


BLOCK_TYPES = ["text", "tool_use", "tool_result", "thinking", "redacted_thinking", "image", "document", "x"]
block = st.fixed_dictionaries({"type": maybe(st.sampled_from(BLOCK_TYPES))}, optional={
    "text": st.text(max_size=20) | values, "id": st.sampled_from(["toolu_1", "toolu_2"]) | values,
    "name": st.sampled_from(["get_weather", "other"]) | values, "input": st.just({"city": "Oslo"}) | values,
    "tool_use_id": st.sampled_from(["toolu_1", "nope"]) | values,
    "content": st.text(max_size=10) | st.lists(st.just({"type": "text", "text": "r"}), max_size=2) | values,
    "is_error": st.booleans() | values, "thinking": st.text(max_size=10), "signature": st.text(max_size=5),
    "cache_control": st.just({"type": "ephemeral"}) | values})
message = st.fixed_dictionaries({
    "role": maybe(st.sampled_from(["user", "assistant", "system", "tool"])),
    "content": maybe(st.text(max_size=30) | st.lists(block, max_size=3))})
tool = st.just(TOOL) | st.fixed_dictionaries({"name": st.text(max_size=8) | values}, optional={
    "type": st.sampled_from(["custom", "web_search_20250305"]) | values, "input_schema": values,
    "description": values})
AMOUNTS = ["input_tokens", "tool_uses", "thinking_turns", "all"]
amount = st.fixed_dictionaries({"type": st.sampled_from(AMOUNTS) | values,
                                "value": st.integers(-1, 200) | values}) | values
edit = st.fixed_dictionaries(
    {"type": st.sampled_from(["clear_tool_uses_20250919", "clear_thinking_20251015", "compact_20260112"])
     | values},
    optional={"trigger": amount, "keep": amount | st.just("all"), "clear_at_least": amount,
              "exclude_tools": st.lists(st.text(max_size=8), max_size=2) | values,
              "clear_tool_inputs": st.booleans() | st.lists(st.text(max_size=8), max_size=2) | values})
bodies = st.fixed_dictionaries({  # the required fields right (the bad-body table has them wrong)
    "model": st.just(MODEL), "max_tokens": st.integers(1, 40000),
    "messages": st.lists(message, min_size=1, max_size=3)}, optional={
    "system": st.text(max_size=20) | st.lists(block, max_size=2) | values,
    "stop_sequences": st.lists(st.text(max_size=4), max_size=2) | values,
    "temperature": maybe(st.floats(0, 1)), "top_p": values, "top_k": values,
    "tools": maybe(st.lists(tool, max_size=2)),
    "tool_choice": maybe(st.fixed_dictionaries(
        {"type": maybe(st.sampled_from(["auto", "any", "tool", "none"]))},
        optional={"name": maybe(st.just("get_weather")), "disable_parallel_tool_use": maybe(st.booleans())})),
    "thinking": st.fixed_dictionaries({"type": st.sampled_from(["enabled", "adaptive", "disabled"]) | values},
                                      optional={"budget_tokens": st.integers(0, 5000) | values}) | values,
    "metadata": st.fixed_dictionaries({}, optional={"user_id": values}) | values,
    "output_config": values, "stream": st.booleans() | values,
    "context_management": st.fixed_dictionaries({}, optional={"edits": st.lists(edit, max_size=2) | values})
    | values})


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    engine = FakeEngine(reply_ids=reply_ids(make_tokenizer(), HERMES))
    with thread_server(engine, tool_call_parser="hermes", reasoning_parser="qwen3") as (port, _):
        yield f"http://127.0.0.1:{port}"


@settings(max_examples=150, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(body=bodies)
def test_no_body_gives_a_5xx(base_url: str, body: dict[str, Any]) -> None:
    r = httpx.post(f"{base_url}/v1/messages", json=body, timeout=30)
    assert r.status_code < 500, (body, r.status_code, r.text)
    if r.status_code != 200:
        err = r.json()
        assert err["type"] == "error" and isinstance(err["error"]["message"], str), err
        assert err["error"]["type"] in ("invalid_request_error", "not_found_error"), err
    elif r.headers["content-type"].startswith("text/event-stream"):
        fold(events(r.content))
    else:
        Message.model_validate(r.json())
