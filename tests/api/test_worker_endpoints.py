"""The endpoints routers and gateways call on a worker: vLLM's render (``/v1/chat/completions/render``,
``/v1/completions/render``), ``/tokenize`` / ``/detokenize`` and SGLang's server / model info."""

from __future__ import annotations

import random

import pytest

from .conftest import MAX_MODEL_LEN, MODEL, run, serve
from .fakes import make_hf_tokenizer

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Héllo 你好 🤗"}]
GENERATE_REQUEST_KEYS = {"request_id", "token_ids", "features", "sampling_params", "model", "stream",
                         "stream_options", "cache_salt", "priority", "kv_transfer_params"}


def _template_ids(messages, add_generation_prompt=True, **kw):
    hf = make_hf_tokenizer()
    text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kw)
    return list(hf.encode(text, add_special_tokens=False))


def _posts(*calls):
    async def main():
        async with serve(max_model_len=MAX_MODEL_LEN) as s:
            out = []
            for path, body in calls:
                r = await (s.client.get(path) if body is None else s.client.post(path, json=body))
                out.append(r)
            return out, s.engine
    return run(main())


def test_chat_render_is_vllms_generate_request_with_the_ids_generation_prefills():
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 5, "temperature": 0.5, "seed": 7,
            "stream": True, "stream_options": {"include_usage": True}, "cache_salt": "s1"}
    (render, chat), engine = _posts(("/v1/chat/completions/render", body), ("/v1/chat/completions", body))
    assert render.status_code == 200 and chat.status_code == 200
    got = render.json()
    assert set(got) == GENERATE_REQUEST_KEYS
    assert got["token_ids"] == _template_ids(CHAT) == engine.submitted[-1][1]
    assert got["request_id"].startswith("chatcmpl-") and got["features"] is None
    assert got["model"] == MODEL and got["stream"] is True
    assert got["stream_options"] == {"include_usage": True}
    assert got["cache_salt"] == "s1" and got["priority"] == 0 and got["kv_transfer_params"] is None
    sp = got["sampling_params"]
    assert (sp["max_tokens"], sp["temperature"], sp["seed"], sp["n"], sp["logprobs"]) == (5, 0.5, 7, 1, None)


def test_chat_render_skips_the_grammar_but_not_the_prompt():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 3,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
    (render,), _ = _posts(("/v1/chat/completions/render", body))
    assert render.status_code == 200, render.text  # no grammar compiler here: generating would be a 400
    assert render.json()["token_ids"] == _template_ids(CHAT)


def test_completion_render_is_a_list_and_max_tokens_is_resolved_against_the_context():
    prompt = "once upon a time, 你好"
    (render, ids_render), _ = _posts(("/v1/completions/render", {"model": MODEL, "prompt": prompt}),
                                     ("/v1/completions/render", {"model": MODEL, "prompt": [5, 6, 7],
                                                                 "max_tokens": 2}))
    got = render.json()
    ids = list(make_hf_tokenizer().encode(prompt))
    assert isinstance(got, list) and len(got) == 1 and set(got[0]) == GENERATE_REQUEST_KEYS
    assert got[0]["token_ids"] == ids and got[0]["request_id"].startswith("cmpl-")
    assert got[0]["stream"] is False and got[0]["stream_options"] is None
    assert ids_render.json()[0]["token_ids"] == [5, 6, 7]
    assert ids_render.json()[0]["sampling_params"]["max_tokens"] == 2


@pytest.mark.parametrize("path,body,status,param", [
    ("/v1/chat/completions/render", {"model": MODEL}, 400, "messages"),
    ("/v1/chat/completions/render", {"model": "other", "messages": CHAT}, 404, "model"),
    ("/v1/chat/completions/render", {"model": MODEL, "messages": CHAT, "priority": "high"}, 400, "priority"),
    ("/v1/completions/render", {"model": MODEL, "prompt": "x", "max_tokens": 10_000}, 400, "max_tokens"),
    ("/v1/completions/render", {"model": MODEL, "prompt": 3}, 400, "prompt"),
    ("/tokenize", {"model": MODEL}, 400, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": CHAT}, 400, "prompt"),
    ("/tokenize", {"prompt": ["a"]}, 400, "prompt"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, 400, "add_special_tokens"),
    ("/tokenize", {"messages": CHAT, "continue_final_message": True}, 400, "continue_final_message"),
    ("/tokenize", {"messages": "hi"}, 400, "messages"),
    ("/tokenize", {"prompt": "a", "model": "other"}, 404, "model"),
    ("/detokenize", {}, 400, "tokens"),
    ("/detokenize", {"tokens": [1, "2"]}, 400, "tokens[1]"),
    ("/detokenize", {"tokens": [1, -1]}, 400, "tokens[1]"),
    ("/detokenize", {"tokens": [10**9]}, 400, "tokens[0]"),
])
def test_bad_bodies_are_openai_errors_naming_the_param(path, body, status, param):
    (r,), _ = _posts((path, body))
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param


def test_tokenize_prompt_and_chat_and_detokenize_round_trip():
    hf = make_hf_tokenizer()
    calls = [("/tokenize", {"prompt": "Héllo 你好"}),
             ("/tokenize", {"prompt": "Héllo", "add_special_tokens": False, "return_token_strs": True}),
             ("/tokenize", {"model": MODEL, "messages": CHAT}),
             ("/tokenize", {"messages": CHAT, "add_generation_prompt": False}),
             ("/tokenize", {"messages": [*CHAT, {"role": "assistant", "content": "Sure"}],
                            "add_generation_prompt": False, "continue_final_message": True}),
             ("/detokenize", {"tokens": list(hf.encode("Héllo 你好 🤗"))})]
    (plain, strs, chat, no_gen, cont, detok), _ = _posts(*calls)
    ids = list(hf.encode("Héllo 你好"))
    assert plain.json() == {"count": len(ids), "max_model_len": MAX_MODEL_LEN, "tokens": ids,
                            "token_strs": None}
    bare = list(hf.encode("Héllo", add_special_tokens=False))
    assert strs.json()["token_strs"] == hf.convert_ids_to_tokens(bare)
    assert chat.json()["tokens"] == _template_ids(CHAT) and chat.json()["count"] == len(_template_ids(CHAT))
    assert no_gen.json()["tokens"] == _template_ids(CHAT, add_generation_prompt=False)
    last = [*CHAT, {"role": "assistant", "content": "Sure"}]
    assert cont.json()["tokens"] == _template_ids(last, add_generation_prompt=False,
                                                  continue_final_message=True)
    assert detok.json() == {"prompt": hf.decode(list(hf.encode("Héllo 你好 🤗")))}


def test_server_and_model_info_name_the_served_model_for_the_sglang_gateway():
    calls = [(p, None) for p in ("/server_info", "/get_server_info", "/model_info", "/get_model_info")]
    (si, gsi, mi, gmi), _ = _posts(*calls)
    assert si.json() == gsi.json() and mi.json() == gmi.json()
    server = si.json()
    assert server["served_model_name"] == MODEL and server["max_model_len"] == MAX_MODEL_LEN
    assert server["context_length"] == MAX_MODEL_LEN and server["tp_size"] == 1 and server["dp_size"] == 1
    model = mi.json()
    assert model["served_model_name"] == MODEL and model["is_generation"] is True
    assert model["model_path"] == server["model_path"]


def test_fuzzed_bodies_never_give_a_5xx():
    rng = random.Random(29)
    values = [None, True, 0, -1, 2**70, 1.5, "x", "", [], [1], ["a"], {}, {"a": 1}, [{"role": "user"}],
              [{"role": "user", "content": 5}], CHAT]
    keys = ["model", "prompt", "messages", "input", "instructions", "tokens", "add_special_tokens",
            "add_generation_prompt", "continue_final_message", "return_token_strs", "max_tokens", "stream",
            "tools", "priority",
            "cache_salt", "chat_template_kwargs"]
    paths = ["/tokenize", "/detokenize", "/v1/chat/completions/render", "/v1/completions/render",
             "/v1/responses/render"]
    calls = []
    for _ in range(160):
        body = {k: rng.choice(values) for k in rng.sample(keys, rng.randint(0, 5))}
        calls.append((rng.choice(paths), body))
    responses, _ = _posts(*calls)
    assert all(r.status_code < 500 for r in responses), [(c, r.text) for c, r in zip(calls, responses)
                                                          if r.status_code >= 500][:3]


def test_responses_render_is_the_prompt_of_the_same_responses_request():
    body = {"model": MODEL, "instructions": "Be brief.", "input": "Héllo 你好 🤗", "max_output_tokens": 4}
    (render, count, stateful), engine = _posts(
        ("/v1/responses/render", body), ("/v1/responses/input_tokens", body),
        ("/v1/responses/render", {**body, "previous_response_id": "resp_1"}))
    got = render.json()
    assert set(got) == GENERATE_REQUEST_KEYS and got["request_id"].startswith("resp-")
    assert got["token_ids"] == _template_ids(CHAT)
    assert count.json()["input_tokens"] == len(got["token_ids"])
    assert got["sampling_params"]["max_tokens"] == 4
    assert stateful.status_code == 400 and stateful.json()["error"]["param"] == "previous_response_id"
    assert engine.submitted == []
