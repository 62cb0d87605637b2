"""ChunkFramer and dumps: every event byte-identical to json.dumps(ensure_ascii=False, compact) of the
OpenAI chunk dict (key order included); golden escapes, Hypothesis texts, compiled vs Python."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ._impls import IMPL_IDS, IMPLS, compiled, python


def sse(d) -> bytes:
    return b"data: " + json.dumps(d, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def head(obj, rid="chatcmpl-1", created=1700000000, model="smollm2"):
    return {"id": rid, "object": obj, "created": created, "model": model}


def with_usage(d, include_usage):
    if include_usage:
        d["usage"] = None
    return d


CHAT = "chat.completion.chunk"
TEXT = "text_completion"
TRICKY = 'a"b\\c\n\r\t\b\f\x00\x01\x1f\x7f é 你 🤗 \u2028\u2029 </script>'


@pytest.mark.parametrize("impl", IMPLS, ids=IMPL_IDS)
@pytest.mark.parametrize("include_usage", [False, True])
class TestChat:
    def test_role(self, impl, include_usage):
        f = impl.ChunkFramer(CHAT, "chatcmpl-1", 1700000000, "smollm2", include_usage)
        d = head(CHAT) | {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                       "logprobs": None, "finish_reason": None}]}
        assert f.role(0) == sse(with_usage(d, include_usage))

    def test_content_tricky_text(self, impl, include_usage):
        f = impl.ChunkFramer(CHAT, "chatcmpl-1", 1700000000, "smollm2", include_usage)
        d = head(CHAT) | {"choices": [{"index": 3, "delta": {"content": TRICKY}, "logprobs": None,
                                       "finish_reason": None}]}
        assert f.content(3, TRICKY) == sse(with_usage(d, include_usage))

    def test_content_with_logprobs(self, impl, include_usage):
        f = impl.ChunkFramer(CHAT, "chatcmpl-1", 1700000000, "smollm2", include_usage)
        lp = {"content": [{"token": "Hi", "logprob": -0.25, "bytes": [72, 105], "top_logprobs": []}]}
        d = head(CHAT) | {"choices": [{"index": 0, "delta": {"content": "Hi"}, "logprobs": lp,
                                       "finish_reason": None}]}
        assert f.content(0, "Hi", impl.dumps(lp)) == sse(with_usage(d, include_usage))

    def test_reasoning_tricky_text(self, impl, include_usage):
        f = impl.ChunkFramer(CHAT, "chatcmpl-1", 1700000000, "smollm2", include_usage)
        delta = {"reasoning_content": TRICKY, "reasoning": TRICKY}
        d = head(CHAT) | {"choices": [{"index": 2, "delta": delta, "logprobs": None, "finish_reason": None}]}
        assert f.reasoning(2, TRICKY) == sse(with_usage(d, include_usage))

    def test_tool_calls(self, impl, include_usage):
        f = impl.ChunkFramer(CHAT, "chatcmpl-1", 1700000000, "smollm2", include_usage)
        calls = [{"index": 0, "id": "call_1", "type": "function",
                  "function": {"name": "get_weather", "arguments": "{\"city\": \"é\"}"}}]
        d = head(CHAT) | {"choices": [{"index": 1, "delta": {"tool_calls": calls}, "logprobs": None,
                                       "finish_reason": None}]}
        assert f.tool_calls(1, impl.dumps(calls)) == sse(with_usage(d, include_usage))

    @pytest.mark.parametrize("reason", ["stop", "length", "tool_calls"])
    def test_finish(self, impl, include_usage, reason):
        f = impl.ChunkFramer(CHAT, "chatcmpl-1", 1700000000, "smollm2", include_usage)
        d = head(CHAT) | {"choices": [{"index": 1, "delta": {}, "logprobs": None, "finish_reason": reason}]}
        assert f.finish(1, reason) == sse(with_usage(d, include_usage))

    def test_usage_error_done(self, impl, include_usage):
        f = impl.ChunkFramer(CHAT, "chatcmpl-1", 1700000000, "smollm2", include_usage)
        d = head(CHAT) | {"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 30,
                                                   "total_tokens": 42,
                                                   "prompt_tokens_details": {"cached_tokens": 0}}}
        assert f.usage(12, 30, 0) == sse(d)
        d["usage"]["prompt_tokens_details"] = {"cached_tokens": 8}
        assert f.usage(12, 30, 8) == sse(d)
        with pytest.raises(TypeError):  # the cached count is never left out by accident
            f.usage(12, 30)  # type: ignore[call-arg]
        e = {
            "error": {"message": 'boom "x"\n', "type": "server_error", "param": None, "code": "engine_error"}
        }
        assert f.error('boom "x"\n', "server_error", "engine_error") == sse(e)
        assert f.done() == b"data: [DONE]\n\n"


@pytest.mark.parametrize("impl", IMPLS, ids=IMPL_IDS)
def test_text_completion(impl):
    f = impl.ChunkFramer(TEXT, "cmpl-9", 5, "m/x\u00e9", False)
    base = head(TEXT, "cmpl-9", 5, "m/x\u00e9")
    assert f.content(0, TRICKY) == sse(base | {"choices": [{"index": 0, "text": TRICKY, "logprobs": None,
                                                             "finish_reason": None}]})
    assert f.finish(0, "length") == sse(base | {"choices": [{"index": 0, "text": "", "logprobs": None,
                                                              "finish_reason": "length"}]})
    assert f.role(0) == b""
    assert f.usage(17, 2, 16) == sse(base | {"choices": [], "usage": {
        "prompt_tokens": 17, "completion_tokens": 2, "total_tokens": 19,
        "prompt_tokens_details": {"cached_tokens": 16}}})


@pytest.mark.parametrize("impl", IMPLS, ids=IMPL_IDS)
def test_unknown_object_rejected(impl):
    with pytest.raises(ValueError):
        impl.ChunkFramer("chat.completion", "x", 1, "m", False)


@pytest.mark.parametrize("impl", IMPLS, ids=IMPL_IDS)
def test_large_index_and_id_escaping(impl):
    f = impl.ChunkFramer(CHAT, 'id"\\', 0, "m", False)
    d = head(CHAT, 'id"\\', 0, "m") | {"choices": [{"index": 123, "delta": {"content": "x"}, "logprobs": None,
                                                   "finish_reason": None}]}
    assert f.content(123, "x") == sse(d)


TEXTS = st.text(alphabet=st.characters(exclude_categories=("Cs",)), max_size=40)


@pytest.mark.parametrize("impl", IMPLS, ids=IMPL_IDS)
@settings(max_examples=300, deadline=None)
@given(text=TEXTS, index=st.integers(0, 40), include_usage=st.booleans(), chat=st.booleans())
def test_content_matches_json_dumps(impl, text, index, include_usage, chat):
    obj = CHAT if chat else TEXT
    f = impl.ChunkFramer(obj, "r", 7, "m", include_usage)
    choice = {"index": index, "delta": {"content": text}} if chat else {"index": index, "text": text}
    d = head(obj, "r", 7, "m") | {"choices": [choice | {"logprobs": None, "finish_reason": None}]}
    assert f.content(index, text) == sse(with_usage(d, include_usage))


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | TEXTS,
    lambda c: st.lists(c, max_size=4) | st.dictionaries(TEXTS, c, max_size=4),
    max_leaves=12,
)


@pytest.mark.parametrize("impl", IMPLS, ids=IMPL_IDS)
@settings(max_examples=200, deadline=None)
@given(obj=JSON)
def test_dumps_matches_json_dumps(impl, obj):
    assert impl.dumps(obj) == json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


@pytest.mark.skipif(compiled is None, reason="compiled hot path not built")
@settings(max_examples=200, deadline=None)
@given(text=TEXTS, lp=st.none() | st.just('{"content":[]}'), chat=st.booleans())
def test_differential_compiled_vs_python(text, lp, chat):
    obj = CHAT if chat else TEXT
    a = compiled.ChunkFramer(obj, "r", 7, "m", True)
    b = python.ChunkFramer(obj, "r", 7, "m", True)
    assert a.content(2, text, lp) == b.content(2, text, lp)
    assert a.role(0) == b.role(0) and a.finish(0, "stop") == b.finish(0, "stop")


def event_sse(d) -> bytes:
    return b"event: " + d["type"].encode() + b"\ndata: " + json.dumps(
        d, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


@pytest.mark.parametrize("impl", IMPLS, ids=IMPL_IDS)
def test_event_framer_sequence_and_shapes(impl):
    f = impl.EventFramer()
    created = {"response": {"id": "resp_1", "status": "in_progress", "output": []}}
    assert f.event("response.created", impl.dumps(created)) == event_sse(
        {"type": "response.created", "sequence_number": 0} | created)
    assert f.event("response.in_progress", "{}") == event_sse(
        {"type": "response.in_progress", "sequence_number": 1})
    assert f.delta("response.output_text.delta", "msg_1", 0, 0, TRICKY, "[]") == event_sse(
        {"type": "response.output_text.delta", "sequence_number": 2, "item_id": "msg_1", "output_index": 0,
         "content_index": 0, "delta": TRICKY, "logprobs": []})
    assert f.delta("response.function_call_arguments.delta", "fc_1", 3, None, '{"a": "é"}') == event_sse(
        {"type": "response.function_call_arguments.delta", "sequence_number": 3, "item_id": "fc_1",
         "output_index": 3, "delta": '{"a": "é"}'})
    assert f.delta("response.reasoning_text.delta", "rs_1", 0, 0, "") == event_sse(
        {"type": "response.reasoning_text.delta", "sequence_number": 4, "item_id": "rs_1", "output_index": 0,
         "content_index": 0, "delta": ""})
    assert f.sequence_number == 5


@given(st.text())
@settings(max_examples=200, deadline=None)
def test_event_framer_twins_agree(text):
    if compiled is None:
        return
    a, b = python.EventFramer(), compiled.EventFramer()
    assert a.delta("response.output_text.delta", "m", 1, 0, text, "[]") == b.delta(
        "response.output_text.delta", "m", 1, 0, text, "[]")
