"""Request validation -> SamplingParams (proxy.protocol), without the app."""

from __future__ import annotations

import pytest

from proxy import protocol
from proxy.errors import ContextLengthExceededError, InvalidRequestError
from proxy.sampling import SamplingParams

U = [{"role": "user", "content": "hi"}]


def chat(**kw):
    return protocol.parse_chat_request({"model": "m", "messages": U, **kw}, max_n=8, vocab_size=100)


def test_defaults():
    r = chat()
    assert r.model == "m" and r.n == 1 and r.max_tokens is None
    assert r.messages == ({"role": "user", "content": "hi"},)
    assert r.stream == protocol.StreamOptions(stream=False, include_usage=False)
    assert r.params == SamplingParams(max_tokens=1)


def test_all_sampling_fields_map():
    r = chat(
        temperature=0,
        top_p=0.5,
        top_k=7,
        min_p=0.1,
        seed=3,
        presence_penalty=1.5,
        frequency_penalty=-1,
        repetition_penalty=1.2,
        logit_bias={"5": -100, "7": 2.5},
        stop=["a", "b", "a"],
        stop_token_ids=[9],
        ignore_eos=True,
        logprobs=True,
        top_logprobs=3,
        min_tokens=2,
        max_tokens=9,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    assert r.params == SamplingParams(max_tokens=1, temperature=0.0, top_p=0.5, top_k=7, min_p=0.1, seed=3,
                                      presence_penalty=1.5, frequency_penalty=-1.0, repetition_penalty=1.2,
                                      logit_bias={5: -100.0, 7: 2.5}, stop=("a", "b"), stop_token_ids=(9,),
                                      ignore_eos=True, logprobs=True, top_logprobs=3, min_tokens=2)
    assert r.max_tokens == 9 and r.n == 2 and r.stream.include_usage
    assert chat(top_k=-1).params.top_k == 0
    assert chat(stop="x").params.stop == ("x",)


def test_max_completion_tokens_wins_over_max_tokens():
    assert chat(max_tokens=5, max_completion_tokens=7).max_tokens == 7
    assert chat(max_tokens=5.0).max_tokens == 5


def test_content_parts_are_joined_and_developer_is_system():
    r = protocol.parse_chat_request({"model": "m", "messages": [
        {"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": "c", "name": "bot"}]}, max_n=1)
    assert r.messages == ({"role": "system", "content": "a\nb"}, {"role": "assistant", "content": "c"})


def test_text_parts_joined_with_a_newline():
    """Issue 12 item 9: vLLM's separator (README policy), never gluing the parts' words together."""
    parts = [
        {"type": "text", "text": "Translate:"},
        {"type": "text", "text": "Bonjour"},
        {"type": "text", "text": ""},
    ]
    r = chat(messages=[{"role": "user", "content": parts}])
    assert r.messages == ({"role": "user", "content": "Translate:\nBonjour\n"},)


def test_top_p_zero_is_accepted_as_greedy():
    """Issue 12 item 5: OpenAI's range for top_p is [0, 1]; 0 means the most likely token only."""
    p = chat(top_p=0).params
    assert p.top_p == 0.0 and p.is_greedy
    assert chat(top_p=1).params.top_p == 1.0 and not chat(top_p=1).params.is_greedy


def test_seed_is_a_signed_64_bit_integer():
    """Issue 12 item 8: the whole signed 64-bit range is accepted, anything past it is a 400."""
    assert chat(seed=-(2**63)).params.seed == -(2**63)
    assert chat(seed=2**63 - 1).params.seed == 2**63 - 1
    assert chat(seed=2**32 + 1).params.seed == 2**32 + 1
    for bad, message in [(2**63, f"'seed' must be at most {2**63 - 1}, got {2**63}."),
                         (-(2**63) - 1, f"'seed' must be at least {-(2**63)}, got {-(2**63) - 1}."),
                         (2**64, f"'seed' must be at most {2**63 - 1}, got {2**64}.")]:
        with pytest.raises(InvalidRequestError) as info:
            chat(seed=bad)
        assert info.value.param == "seed" and info.value.message == message and info.value.status == 400


@pytest.mark.parametrize(
    ("kw", "param", "message"),
    [
        ({"temperature": -3}, "temperature", "'temperature' must be in [0, 2], got -3."),
        ({"top_p": -0.1}, "top_p", "'top_p' must be in [0, 1], got -0.1."),
        ({"n": 9}, "n", "'n' must be at most 8, got 9."),
        ({"max_tokens": -1}, "max_tokens", "'max_tokens' must be at least 1, got -1."),
        ({"max_tokens": True}, "max_tokens", "'max_tokens' must be an integer, not a boolean."),
        ({"logit_bias": {"100": 1}}, "logit_bias", "'logit_bias' token id 100 is outside the vocabulary."),
        (
            {"stop_token_ids": [100]},
            "stop_token_ids",
            "'stop_token_ids' contains a token id outside the vocabulary.",
        ),
        ({"stop": [""]}, "stop", "'stop[0]' must not be empty."),
        ({"messages": [None]}, "messages[0]", "'messages[0]' must be an object, not null."),
        (
            {"messages": [{"role": "user", "content": "x", "tool_calls": [{}]}]},
            "messages[0].tool_calls",
            "'messages[0].tool_calls' is only allowed on assistant messages.",
        ),
        (
            {"functions": [{"name": "f"}]},
            "functions",
            "'functions' is deprecated and not supported; use 'tools' and 'tool_choice'.",
        ),
        (
            {"stream_options": {"include_usage": True}},
            "stream_options",
            "'stream_options' is only allowed when 'stream' is true.",
        ),
        (
            {"stream": True, "stream_options": {"include_usage": "yes"}},
            "stream_options.include_usage",
            "'stream_options.include_usage' must be a boolean, not a string.",
        ),
        (
            {"messages": [{"role": "user", "content": []}]},
            "messages[0].content",
            "'messages[0].content' must not be an empty array: send a string or at least one content part.",
        ),
        ({"user": 5}, "user", "'user' must be a string, not an integer."),
    ],
)
def test_errors_name_the_param(kw, param, message):
    with pytest.raises(InvalidRequestError) as info:
        chat(**kw)
    assert info.value.param == param and info.value.message == message and info.value.status == 400


def test_parse_json_body():
    assert protocol.parse_json_body(b'{"a": 1}') == {"a": 1}
    for raw in (b"\xff", b"nope", b"[]", b"  "):
        with pytest.raises(InvalidRequestError):
            protocol.parse_json_body(raw)


def test_resolve_max_tokens():
    assert protocol.resolve_max_tokens(None, 10, 100) == 90
    assert protocol.resolve_max_tokens(90, 10, 100) == 90
    with pytest.raises(ContextLengthExceededError) as info:
        protocol.resolve_max_tokens(91, 10, 100)
    assert info.value.message == (
        "This model's maximum context length is 100 tokens. However, you requested 101 tokens "
        "(10 in the messages, 91 in the completion). Please reduce the length of the messages or the "
        "completion."
    )
    assert info.value.param == "max_tokens" and info.value.code == "context_length_exceeded"
    with pytest.raises(ContextLengthExceededError) as info:
        protocol.resolve_max_tokens(None, 100, 100, prompt_name="prompt")
    assert info.value.param == "prompt" and "(100 in the prompt, 1 in the completion)" in info.value.message


def test_choice_params_offsets_seed():
    p = SamplingParams(seed=10)
    assert [protocol.choice_params(p, i).seed for i in range(3)] == [10, 11, 12]
    assert protocol.choice_params(SamplingParams(), 2).seed is None


def test_completion_request():
    r = protocol.parse_completion_request({"model": "m", "prompt": [[1, 2]], "logprobs": 2, "echo": False,
                                           "best_of": 1}, max_n=2, vocab_size=10)
    assert r.prompt == (1, 2) and r.max_tokens == 16 and r.logprobs == 2
    assert r.params.logprobs and r.params.top_logprobs == 2
    assert protocol.parse_completion_request({"model": "m", "prompt": "x"}, max_n=1).params.logprobs is False


def test_usage_always_has_prompt_tokens_details():
    """OpenAI's ``usage`` shape (chat completion object): ``prompt_tokens_details.cached_tokens`` is
    present at 0 too; ``total_tokens`` is prompt + completion."""
    assert protocol.Usage(17, 5, 0).to_dict() == {
        "prompt_tokens": 17, "completion_tokens": 5, "total_tokens": 22,
        "prompt_tokens_details": {"cached_tokens": 0}}
    assert list(protocol.Usage(33, 1, 32).to_dict().items()) == [
        ("prompt_tokens", 33), ("completion_tokens", 1), ("total_tokens", 34),
        ("prompt_tokens_details", {"cached_tokens": 32})]
