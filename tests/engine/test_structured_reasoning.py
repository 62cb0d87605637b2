"""The grammar applies from the end of the reasoning: free thinking first, sampled exactly as without
the grammar, then the constrained answer (``StructuredOutputParams.reasoning_end_ids``)."""

from __future__ import annotations

import json
import pickle

import jsonschema
import pytest
import torch

from proxy.engine.core import EngineCore
from proxy.engine.execution.sampler import Sampler
from proxy.engine.request import Request
from proxy.engine.structured import ReasoningEnd
from proxy.sampling import SamplingParams, StructuredOutputParams
from proxy.settings import Settings

from .test_structured import MODEL_VOCAB, SCHEMA, compiler, decode, eos, model, run_engine

END, A, B, OPEN = 350, 351, 352, 353  # plain tokens of the test tokenizer standing in for markers
CHOICE = '["yes", "no"]'
PROMPT = [5, 6, 7, 8]


def engine(**kw: int) -> EngineCore:
    settings = Settings(**{"num_kv_blocks": 128, "block_size": 4, "seed": 0, **kw})
    return EngineCore(model(), settings, [eos()], 300, grammar_compiler=compiler())


def pair(seed: int, so: StructuredOutputParams, bias: dict[int, float], max_tokens: int = 60):
    plain = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, logit_bias=bias)
    return plain, SamplingParams(**{**plain.__dict__, "structured_outputs": so})


def first_marker(ids: list[int], marker: tuple[int, ...]) -> int | None:
    """The output index just after the first whole occurrence of ``marker``, or None."""
    for i in range(len(ids) - len(marker) + 1):
        if tuple(ids[i:i + len(marker)]) == marker:
            return i + len(marker)
    return None


def test_reasoning_end_follows_the_tokens_incrementally() -> None:
    """A two-token marker split across updates, a lone first half, and only the first marker counts."""
    r = ReasoningEnd(StructuredOutputParams("choice", CHOICE, reasoning_end_ids=(A, B)))
    out: list[int] = []
    for token, want in [(9, None), (A, None), (9, None), (A, None), (B, 5), (A, 5), (B, 5)]:
        out.append(token)
        assert r.update(out) == want, (out, r.update(out))
    assert ReasoningEnd(StructuredOutputParams("choice", CHOICE)).update([]) == 0  # no marker: at once
    may = StructuredOutputParams("choice", CHOICE, reasoning_end_ids=(END,), starts_in_reasoning=False,
                                 reasoning_start_ids=(OPEN, 7))
    r = ReasoningEnd(may)
    assert r.update([]) == 0 and r.open_token == OPEN  # token 0 decides, under grammar + OPEN
    assert r.update([OPEN]) is None and r.open_token is None
    assert r.update([OPEN, 7, 9, END]) == 4
    r = ReasoningEnd(may)
    assert r.update([]) == 0 and r.update([9]) == 0 and r.update([9, END]) == 0  # no thinking
    never = StructuredOutputParams("choice", CHOICE, reasoning_end_ids=(END,), starts_in_reasoning=False)
    assert ReasoningEnd(never).update([]) == 0 and ReasoningEnd(never).open_token is None
    with pytest.raises(ValueError, match="non-empty"):
        StructuredOutputParams("choice", CHOICE, reasoning_end_ids=())


@pytest.mark.parametrize(
    ("so", "check"),
    [
        (StructuredOutputParams("choice", CHOICE, reasoning_end_ids=(END,)), lambda t: t in ("yes", "no")),
        (StructuredOutputParams("json", json.dumps(SCHEMA), reasoning_end_ids=(END,)),
         lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    ],
    ids=["choice", "json"],
)
def test_thinking_is_sampled_as_without_the_grammar_then_the_answer_follows_it(so, check) -> None:
    """Tokens up to and including the marker equal the unconstrained run's (same seed); the tokens
    after it match the grammar. A run without the marker is never constrained."""
    num_mid = num_none = 0
    for seed in range(12):
        plain, constrained = pair(seed, so, {END: 3.0}, max_tokens=120)
        res = run_engine(engine(), {"p": (PROMPT, plain), "c": (PROMPT, constrained)})
        (free, free_reason), (ids, reason) = res["p"], res["c"]
        cut = first_marker(free, (END,))
        if cut is None:
            assert (ids, reason) == (free, free_reason)
            num_none += 1
            continue
        assert ids[:cut] == free[:cut], seed
        num_mid += cut > 1
        assert reason == "stop" and ids[-1] == eos(), (seed, decode(ids[cut:]))
        assert check(decode(ids[cut:])), (seed, decode(ids[cut:]))
        assert ids[cut:] != free[cut:len(ids)]  # the grammar did change the answer
    assert num_mid >= 6, num_mid  # the marker came mid-output in most runs


def test_a_marker_that_never_comes_leaves_the_output_unconstrained_until_length() -> None:
    so = StructuredOutputParams("choice", CHOICE, reasoning_end_ids=(END,))
    for seed in range(3):
        plain, constrained = pair(seed, so, {END: -100.0, eos(): -100.0}, max_tokens=40)
        res = run_engine(engine(), {"p": (PROMPT, plain), "c": (PROMPT, constrained)})
        assert res["c"] == res["p"] and res["c"][1] == "length" and len(res["c"][0]) == 40
        assert END not in res["c"][0]


def test_a_two_token_marker_counts_only_once_whole() -> None:
    so = StructuredOutputParams("choice", CHOICE, reasoning_end_ids=(A, B))
    num_split = 0
    for seed in range(16):
        plain, constrained = pair(seed, so, {A: 4.0, B: 4.0}, max_tokens=120)
        res = run_engine(engine(), {"p": (PROMPT, plain), "c": (PROMPT, constrained)})
        free, (ids, reason) = res["p"][0], res["c"]
        cut = first_marker(free, (A, B))
        if cut is None:
            assert ids == free
            continue
        num_split += A in free[:cut - 2]  # a lone first half came before the marker
        assert ids[:cut] == free[:cut] and reason == "stop", seed
        assert decode(ids[cut:]) in ("yes", "no"), (seed, decode(ids[cut:]))
    assert num_split >= 2, num_split


def test_batched_beside_unconstrained_requests_with_chunked_prefill_and_preemption() -> None:
    """Each request gives what it gives alone, in a small pool that forces preemption by recompute."""
    so = StructuredOutputParams("choice", CHOICE, reasoning_end_ids=(A, B))
    g = torch.Generator().manual_seed(3)
    jobs = {}
    for i in range(8):
        prompt = torch.randint(3, 340, (int(torch.randint(3, 30, (1,), generator=g)),), generator=g).tolist()
        plain, constrained = pair(i, so, {A: 4.0, B: 4.0}, max_tokens=80)
        jobs[str(i)] = (prompt, constrained if i % 2 == 0 else plain)
    small = engine(num_kv_blocks=40, max_num_batched_tokens=24, max_num_seqs=8)
    together = run_engine(small, jobs)
    assert small.scheduler.num_preemptions > 0
    for rid, job in jobs.items():
        assert run_engine(engine(), {rid: job})[rid] == together[rid], rid


def scripted_sampler(so: StructuredOutputParams, forced: dict[int, int], steps: int,
                     banned: int | None = None) -> list[int]:
    """Greedy over random logits, where ``forced[step]`` gets a logit of 50 at that step (and
    ``banned`` -50 at every step)."""
    sampler = Sampler(torch.device("cpu"), [eos()], seed=5, grammar_compiler=compiler())
    request = Request("r", [1, 5, 9], SamplingParams(temperature=0.0, structured_outputs=so))
    g = torch.Generator().manual_seed(0)
    for step in range(steps):
        logits = torch.randn(1, MODEL_VOCAB, generator=g)
        if step in forced:
            logits[0, forced[step]] = 50.0
        if banned is not None:
            logits[0, banned] = -50.0
        (token,), _ = sampler.sample(logits, [request])
        request.append_token(token)
        if token == eos():
            break
    return request.output_token_ids


def test_a_model_that_may_not_think_decides_by_its_first_token() -> None:
    """``starts_in_reasoning=False``: the open marker's first token as output token 0 starts the
    thinking (it is allowed beside the grammar); any other first token starts the grammar at once."""
    so = StructuredOutputParams("choice", CHOICE, reasoning_end_ids=(END,), starts_in_reasoning=False,
                                reasoning_start_ids=(OPEN,))
    thinking = scripted_sampler(so, {0: OPEN, 5: END}, 40)
    g = torch.Generator().manual_seed(0)
    free = [int(torch.randn(1, MODEL_VOCAB, generator=g)[0].argmax()) for _ in range(5)]
    assert thinking[0] == OPEN and thinking[1:5] == free[1:5] and thinking[5] == END
    assert decode(thinking[6:]) in ("yes", "no") and thinking[-1] == eos()
    # Token 300 would win, but it is neither the open marker nor allowed by the grammar.
    direct = scripted_sampler(so, {0: 300}, 40, banned=OPEN)
    assert decode(direct) in ("yes", "no") and direct[-1] == eos() and 300 not in direct


def test_the_params_pickle_for_the_engine_process() -> None:
    so = StructuredOutputParams("json", json.dumps(SCHEMA), reasoning_end_ids=(A, B),
                                starts_in_reasoning=False, reasoning_start_ids=(OPEN,))
    params = SamplingParams(max_tokens=5, structured_outputs=so)
    assert pickle.loads(pickle.dumps(params)) == params
    assert compiler().compile(so) is compiler().compile(StructuredOutputParams("json", json.dumps(SCHEMA)))
