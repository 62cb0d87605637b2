"""Constrained decoding: schema allow-list, compile cache, masks in every sampling mode, preemption."""

from __future__ import annotations

import functools
import json

import jsonschema
import pytest
import torch

from proxy.engine.core import EngineCore
from proxy.engine.execution.sampler import Sampler
from proxy.engine.request import Request
from proxy.engine.structured import GrammarCompiler, check_json_schema
from proxy.errors import InvalidRequestError
from proxy.sampling import SamplingParams, StructuredOutputParams
from proxy.settings import Settings

from .conftest import engine_copy

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["red", "blue"]}, "maxItems": 3},
        "kind": {"anyOf": [{"const": "a"}, {"type": "null"}]},
    },
    "required": ["name", "n", "ok", "tags", "kind"],
    "additionalProperties": False,
}
JSON = StructuredOutputParams("json", json.dumps(SCHEMA))
MODEL_VOCAB = 416  # larger than the tokenizer (400): padding columns must be masked too


@functools.cache
def hf_tokenizer():
    """A byte-level BPE tokenizer (400 tokens) trained in-process on JSON-ish text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [
        json.dumps({"name": "ab", "n": i, "ok": i % 2 == 0, "tags": ["red", "blue"][: i % 3], "kind": None})
        for i in range(50)
    ] + ["Hello world, plain text answers too.", '{"a": [1, 2.5, -3e4], "b": "x\\ny"}']
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|endoftext|>")


@functools.cache
def eos() -> int:
    return hf_tokenizer().convert_tokens_to_ids("<|im_end|>")


@functools.cache
def compiler() -> GrammarCompiler:
    return GrammarCompiler(hf_tokenizer(), MODEL_VOCAB, [eos()])


@functools.cache
def model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=MODEL_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         eos_token_id=eos(), bos_token_id=1, tie_word_embeddings=False)
    m = LlamaForCausalLM(config)
    m.set_attn_implementation("sdpa")
    return engine_copy(m.eval())


def decode(ids: list[int]) -> str:
    return hf_tokenizer().decode(ids, skip_special_tokens=True)


# ---- the schema allow-list ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("schema", "named"),
    [
        ({"type": "array", "uniqueItems": True}, "'uniqueItems'"),
        ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "'not' (at #/properties/a)"),
        ({"if": {"type": "string"}, "then": {"maxLength": 2}}, "'if'"),
        ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "'oneOf'"),
        ({"type": "object", "minProperties": 1}, "'minProperties'"),
        ({"allOf": [{"type": "integer"}, {"minimum": 3}]}, "'allOf' with more than one schema"),
        ({"type": "string", "format": "ipv6"}, "format 'ipv6'"),
        ({"type": "frobnicate"}, "invalid JSON Schema type 'frobnicate'"),
        ({"type": "object", "required": ["a"]}, "required property 'a'"),
        ("not a schema", "must be a JSON object"),
        ({"type": "object", "properties": []}, "must be an object of schemas"),
    ],
)
def test_refused_schemas_name_the_keyword(schema, named: str) -> None:
    with pytest.raises(InvalidRequestError, match="x.schema") as info:
        check_json_schema(schema, "x.schema")
    assert named in info.value.message and info.value.param == "x.schema" and info.value.status == 400
    so = StructuredOutputParams("json", json.dumps(schema))
    with pytest.raises(InvalidRequestError, match="x.schema"):
        compiler().compile(so, "x.schema")


def test_accepted_schema_keywords() -> None:
    check_json_schema(SCHEMA)
    check_json_schema({"$defs": {"A": {"type": "integer", "title": "A"}}, "type": "object",
                       "properties": {"a": {"$ref": "#/$defs/A"}, "d": {"type": "string", "format": "date"}},
                       "description": "annotations are fine"})


def test_compile_cache_and_errors() -> None:
    c = GrammarCompiler(hf_tokenizer(), MODEL_VOCAB, [eos()])
    first = c.compile(JSON)
    assert c.compile(StructuredOutputParams("json", json.dumps(SCHEMA))) is first and c.num_compiled == 1
    with pytest.raises(InvalidRequestError, match="not valid JSON"):
        c.compile(StructuredOutputParams("json", "{nope"))
    with pytest.raises(InvalidRequestError, match="cannot be compiled"):
        c.compile(StructuredOutputParams("regex", "(a"), "guided_regex")
    with pytest.raises(InvalidRequestError, match="non-empty list"):
        c.compile(StructuredOutputParams("choice", "[]"), "guided_choice")
    unresolved = {"type": "object", "properties": {"a": {"$ref": "#/$defs/nope"}}, "required": ["a"]}
    with pytest.raises(InvalidRequestError, match="cannot be compiled") as info:
        c.compile(StructuredOutputParams("json", json.dumps(unresolved)), "x.schema")
    # xgrammar's own words, without its C++ log prefix ("[20:05:45] /project/cpp/....cc:5088: ")
    assert "nope" in info.value.message and ".cc:" not in info.value.message and "[" not in info.value.message
    small = GrammarCompiler(hf_tokenizer(), MODEL_VOCAB, [eos()], cache_size=1)
    a = small.compile(JSON)
    small.compile(StructuredOutputParams("json_object"))
    assert small.compile(JSON) is not a and small.num_compiled == 3  # LRU evicted, recompiled


def test_compile_async_compiles_a_miss_at_the_lowest_priority_and_returns_a_hit_at_once() -> None:
    """A miss runs on the compiler's executor, whose threads run at nice 19 (Linux), so a large
    compile takes only the CPU the engine leaves; a hit never queues behind it."""
    import asyncio
    import os
    import threading

    c = GrammarCompiler(hf_tokenizer(), MODEL_VOCAB, [eos()])
    seen: list[tuple[str, int]] = []
    compile_ = c._compile

    def recording(so: StructuredOutputParams, param: str):  # type: ignore[no-untyped-def]
        nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        seen.append((threading.current_thread().name, nice))
        return compile_(so, param)

    c._compile = recording  # type: ignore[method-assign]
    first = asyncio.run(c.compile_async(JSON))
    c.executor.shutdown(wait=True)  # a hit must not need the executor
    assert asyncio.run(c.compile_async(StructuredOutputParams("json", json.dumps(SCHEMA)))) is first
    assert len(seen) == 1 and seen[0][0].startswith("grammar-compile")
    assert seen[0][1] == 19 or not hasattr(os, "setpriority")


# ---- the sampler --------------------------------------------------------------------------------


def run_sampler(params: list[SamplingParams], steps: int, seed: int = 0) -> list[list[int]]:
    """Sample ``steps`` tokens for each row from random logits (stopping a row at EOS)."""
    sampler = Sampler(torch.device("cpu"), [eos()], seed=5, grammar_compiler=compiler())
    reqs = [Request(str(i), [1, 5, 9], p) for i, p in enumerate(params)]
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        live = [r for r in reqs if not r.output_token_ids or r.output_token_ids[-1] != eos()]
        if not live:
            break
        logits = torch.randn(len(live), MODEL_VOCAB, generator=g) * 3
        tokens, _ = sampler.sample(logits, live)
        for r, t in zip(live, tokens):
            r.append_token(t)
    for r in reqs:
        sampler.forget(r.request_id)
    assert sampler.num_grammars == 0
    return [r.output_token_ids for r in reqs]


MODES = {
    "greedy": SamplingParams(temperature=0.0),
    "seeded top-k/p": SamplingParams(temperature=1.3, top_k=20, top_p=0.9, seed=11),
    "min_p + penalties": SamplingParams(temperature=1.0, min_p=0.05, repetition_penalty=1.3,
                                        frequency_penalty=1.0, presence_penalty=0.5, seed=3),
    "logit_bias + min_tokens": SamplingParams(temperature=0.7, logit_bias={5: 50.0}, min_tokens=500, seed=4),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_every_sampling_mode_yields_valid_json(mode: str) -> None:
    base = MODES[mode]
    constrained = SamplingParams(**{**base.__dict__, "structured_outputs": JSON})
    plain = SamplingParams(**{**base.__dict__, "seed": 99})
    for seed in range(3):
        out = run_sampler([constrained, plain, constrained], steps=150, seed=seed)
        for ids in (out[0], out[2]):
            assert ids[-1] == eos(), f"{mode}: a constrained row did not finish: {decode(ids)!r}"
            text = decode(ids)
            jsonschema.validate(json.loads(text), SCHEMA)
            assert "  " not in text and "\n" not in text  # whitespace is bounded to the separators
            assert all(t < 400 for t in ids)  # padding columns are never sampled
        assert out[1][-1] != eos() or len(out[1]) < 150


def test_unconstrained_rows_are_untouched() -> None:
    """An unconstrained row samples exactly what it samples without constrained neighbours."""
    greedy = SamplingParams(temperature=0.0)
    seeded = SamplingParams(temperature=1.0, seed=7)
    mixed = run_sampler(
        [greedy.__class__(**{**greedy.__dict__, "structured_outputs": JSON}), greedy, seeded], 30
    )
    alone = run_sampler(
        [
            SamplingParams(temperature=0.0, structured_outputs=StructuredOutputParams("json_object")),
            greedy,
            seeded,
        ],
        30,
    )
    assert mixed[1] == alone[1] and mixed[2] == alone[2]


def test_json_object_regex_choice_and_grammar_kinds() -> None:
    cases = [
        (StructuredOutputParams("json_object"), lambda t: isinstance(json.loads(t), dict)),
        (
            StructuredOutputParams("regex", "[a-c]{2,4}-[0-9]"),
            lambda t: __import__("re").fullmatch("[a-c]{2,4}-[0-9]", t),
        ),
        (
            StructuredOutputParams("choice", '["red", "blue", "gr\\"een"]'),
            lambda t: t in ("red", "blue", 'gr"een'),
        ),
        (StructuredOutputParams("grammar", 'root ::= "yes" | "no"'), lambda t: t in ("yes", "no")),
    ]
    for so, ok in cases:
        for seed in range(3):
            ids = run_sampler([SamplingParams(temperature=1.0, seed=seed, structured_outputs=so)], 200, seed)[
                0
            ]
            if so.kind != "json_object":
                assert ids[-1] == eos(), so
            if ids[-1] == eos():
                assert ok(decode(ids)), (so, decode(ids))


# ---- the engine -----------------------------------------------------------------------------------


def run_engine(
    core: EngineCore, jobs: dict[str, tuple[list[int], SamplingParams]]
) -> dict[str, tuple[list[int], str]]:
    for rid, (prompt, params) in jobs.items():
        core.add_request(rid, prompt, params)
    out: dict[str, list[int]] = {rid: [] for rid in jobs}
    reasons: dict[str, str] = {}
    for _ in range(5000):
        if not core.has_unfinished():
            break
        for o in core.step():
            out[o.request_id].extend(o.new_token_ids)
            if o.finished:
                reasons[o.request_id] = o.finish_reason
    assert core.num_free_blocks == core.num_total_blocks and core.sampler.num_grammars == 0
    return {rid: (out[rid], reasons[rid]) for rid in jobs}


def jobs_for(n: int) -> dict[str, tuple[list[int], SamplingParams]]:
    g = torch.Generator().manual_seed(1)
    modes = list(MODES.values())
    jobs = {}
    for i in range(n):
        prompt = torch.randint(3, 400, (int(torch.randint(3, 30, (1,), generator=g)),), generator=g).tolist()
        base = modes[i % len(modes)]
        so = JSON if i % 3 != 2 else None
        fields = {**base.__dict__, "max_tokens": 150, "structured_outputs": so, "min_tokens": 0}
        jobs[str(i)] = (prompt, SamplingParams(**fields))
    return jobs


def test_engine_constrained_batch_with_chunked_prefill_and_preemption() -> None:
    settings = Settings(num_kv_blocks=40, block_size=4, max_num_batched_tokens=24, max_num_seqs=8, seed=0)
    core = EngineCore(model(), settings, [eos()], max_model_len=200, grammar_compiler=compiler())
    jobs = jobs_for(9)
    results = run_engine(core, jobs)
    assert core.scheduler.num_preemptions > 0  # the small pool forced recompute
    for rid, (ids, reason) in results.items():
        if jobs[rid][1].structured_outputs is not None:
            assert reason == "stop", (rid, decode(ids))
            jsonschema.validate(json.loads(decode(ids)), SCHEMA)
    # Batch- and preemption-invariance of a greedy constrained request.
    roomy = EngineCore(model(), Settings(num_kv_blocks=512, block_size=4, seed=0), [eos()], 200,
                       grammar_compiler=compiler())
    alone = run_engine(roomy, {"0": jobs["0"]})
    assert alone["0"] == results["0"]


def test_ignore_eos_after_the_grammar_ended_allows_only_eos() -> None:
    core = EngineCore(model(), Settings(num_kv_blocks=64, block_size=4, seed=0), [eos()], 200,
                      grammar_compiler=compiler())
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=1, ignore_eos=True,
                            structured_outputs=StructuredOutputParams("choice", '["yes", "no"]'))
    (ids, reason), = run_engine(core, {"a": ([5, 6, 7], params)}).values()
    assert reason == "length" and len(ids) == 40
    first_eos = ids.index(eos())
    assert decode(ids[:first_eos]) in ("yes", "no") and set(ids[first_eos:]) == {eos()}


def test_engine_abort_drops_grammar_and_refuses_without_compiler() -> None:
    core = EngineCore(model(), Settings(num_kv_blocks=64, block_size=4, seed=0), [eos()], 200,
                      grammar_compiler=compiler())
    core.add_request("a", [5, 6, 7], SamplingParams(max_tokens=50, temperature=0.0, structured_outputs=JSON))
    core.step()
    core.step()
    assert core.sampler.num_grammars == 1
    core.abort_request("a")
    assert core.sampler.num_grammars == 0
    bare = EngineCore(model(), Settings(num_kv_blocks=64, block_size=4, seed=0), [eos()], 200)
    with pytest.raises(InvalidRequestError, match="structured outputs are not enabled"):
        bare.add_request("b", [5, 6], SamplingParams(structured_outputs=JSON))


def test_logits_width_of_a_head_without_weight() -> None:
    """A quantized output head (``PackedLinear``) has ``out_features`` but no ``weight``."""
    from proxy.engine.structured import logits_width

    m = model()
    assert logits_width(m) == MODEL_VOCAB

    class Packed(torch.nn.Module):
        out_features = 123

    class Wrapper(torch.nn.Module):
        config = m.config

        def get_output_embeddings(self):
            return Packed()

    assert logits_width(Wrapper()) == 123
