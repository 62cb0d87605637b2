"""Sampler: greedy, filters, penalties, logit_bias, min_tokens, seeds, logprobs (exact values)."""

from __future__ import annotations

import math

import torch

from proxy.engine.execution.sampler import Sampler
from proxy.engine.request import Request
from proxy.sampling import SamplingParams

CPU = torch.device("cpu")


def r(params: SamplingParams, rid: str = "r", prompt=(5,), output=()) -> Request:
    req = Request(rid, list(prompt), params)
    for t in output:
        req.append_token(t)
    return req


def test_greedy_is_argmax_and_no_logprobs_by_default() -> None:
    s = Sampler(CPU, [0])
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, 0.0, 0.0, 6.0]])
    tokens, lps = s.sample(logits, [r(SamplingParams(temperature=0.0)), r(SamplingParams(temperature=0.0))])
    assert tokens == [1, 3] and lps is None


def test_logprobs_are_raw_model_logprobs() -> None:
    s = Sampler(CPU, [0])
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    params = SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2, logit_bias={2: 100.0})
    tokens, lps = s.sample(logits, [r(params)])
    assert tokens == [2]  # the bias decides the token ...
    raw = torch.log_softmax(logits[0], -1)
    assert lps is not None and lps[0] is not None
    assert lps[0].token_id == 2
    assert math.isclose(lps[0].logprob, float(raw[2]), rel_tol=1e-6)  # ... but logprobs stay raw
    assert [t for t, _ in lps[0].top] == [1, 3]
    assert math.isclose(lps[0].top[0][1], float(raw[1]), rel_tol=1e-6)


def test_logprobs_only_for_rows_that_ask() -> None:
    s = Sampler(CPU, [0])
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0]])
    _, lps = s.sample(
        logits, [r(SamplingParams(temperature=0.0)), r(SamplingParams(temperature=0.0, logprobs=True))]
    )
    assert lps is not None and lps[0] is None and lps[1].token_id == 0 and lps[1].top == []


def test_min_tokens_masks_eos_and_stop_ids() -> None:
    s = Sampler(CPU, [0])
    logits = torch.tensor([[9.0, 1.0, 8.0, 2.0]])
    p = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(2,))
    assert s.sample(logits, [r(p, output=[3])])[0] == [3]
    assert s.sample(logits, [r(p, output=[3, 3])])[0] == [0]
    p_ign = SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True)
    assert s.sample(logits, [r(p_ign)])[0] == [0]  # ignore_eos: EOS is not masked


def test_repetition_presence_frequency_penalties() -> None:
    s = Sampler(CPU, [99])
    logits = torch.tensor([[2.0, 1.9, -1.0, 1.0]])
    # repetition penalty 2 over prompt token 0: 2.0 -> 1.0, so 1 wins
    assert s.sample(logits, [r(SamplingParams(temperature=0.0, repetition_penalty=2.0), prompt=[0])])[0] == [
        1
    ]
    proc = s._process(logits, [r(SamplingParams(repetition_penalty=2.0), prompt=[0, 2])])
    assert proc[0].tolist() == [1.0, 1.899999976158142, -2.0, 1.0]
    # frequency 0.5 x2 occurrences + presence 0.25 on token 0: 2.0 - 1.0 - 0.25 = 0.75
    proc = s._process(
        logits, [r(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), prompt=[1], output=[0, 0])]
    )
    assert proc[0].tolist() == [0.75, 1.899999976158142, -1.0, 1.0]
    assert logits[0, 0] == 2.0  # the input is not modified


def test_top_k_top_p_min_p_restrict_the_support() -> None:
    s = Sampler(CPU, [99], seed=0)
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    cases = [
        (SamplingParams(temperature=1.0, top_k=2), {0, 1}),
        (SamplingParams(temperature=1.0, top_p=0.7), {0, 1}),  # 0.5 < 0.7, 0.8 >= 0.7: keep 2
        (SamplingParams(temperature=1.0, top_p=0.5), {0}),
        (SamplingParams(temperature=1.0, min_p=0.5), {0, 1}),  # 0.15 < 0.25
        (SamplingParams(temperature=1.0), {0, 1, 2, 3}),
    ]
    for params, support in cases:
        seen = set()
        for _ in range(400):
            seen.update(s.sample(logits, [r(params)])[0])
        assert seen == support, (params, seen)


def test_temperature_sampling_follows_the_distribution() -> None:
    s = Sampler(CPU, [99], seed=1)
    logits = torch.log(torch.tensor([0.6, 0.3, 0.1])).repeat(2000, 1)
    reqs = [r(SamplingParams(temperature=1.0), rid=str(i)) for i in range(2000)]
    tokens = torch.tensor(s.sample(logits, reqs)[0])
    freq = torch.bincount(tokens, minlength=3).float() / 2000
    assert torch.allclose(freq, torch.tensor([0.6, 0.3, 0.1]), atol=0.04), freq


def test_seeded_rows_do_not_depend_on_the_batch() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(3))
    seeded = SamplingParams(temperature=0.8, seed=42)
    alone = Sampler(CPU, [99])
    alone_tokens = [alone.sample(logits[2:3], [r(seeded, rid="x")])[0][0] for _ in range(20)]
    busy = Sampler(CPU, [99])
    busy_tokens = []
    for step in range(20):
        others = [r(SamplingParams(temperature=1.0), rid=f"o{i}") for i in range(5)]
        reqs = others[:2] + [r(seeded, rid="x")] + others[2:]
        busy_tokens.append(busy.sample(logits, reqs)[0][2])
    assert alone_tokens == busy_tokens
    assert len(set(alone_tokens)) > 1  # really sampled, not argmax


def _seeded_tokens(seed: int, steps: int = 40) -> list[int]:
    """Tokens a fresh sampler draws for one request with ``seed`` over a flat 1000-token distribution."""
    s = Sampler(CPU, [99999])
    logits = torch.zeros(1, 1000)
    req = r(SamplingParams(temperature=1.0, seed=seed), rid="x")
    return [s.sample(logits, [req])[0][0] for _ in range(steps)]


def test_every_64_bit_seed_has_its_own_stream() -> None:
    """Issue 12 item 8: mt19937 keeps 32 bits of a seed; 1 and 2**32 + 1 (and 0 and -2**63, i.e. 2**63
    modulo 2**64) must still differ, while each seed stays reproducible."""
    pairs = [(1, 2**32 + 1), (0, -(2**63)), (5, 5 + (2**40)), (2**63 - 1, 2**31 - 1), (-1, 2**32 - 1)]
    for a, b in pairs:
        ta, tb = _seeded_tokens(a), _seeded_tokens(b)
        assert ta == _seeded_tokens(a) and tb == _seeded_tokens(b)
        assert ta != tb, (a, b)
        assert len(set(tb)) > 20  # a real draw over the 1000 tokens, not a constant


def test_high_seed_noise_follows_the_distribution() -> None:
    """The two-generator draw of seeds past 32 bits samples from p like the one-generator draw."""
    logits = torch.log(torch.tensor([0.6, 0.3, 0.1])).repeat(3000, 1)
    s = Sampler(CPU, [99])
    reqs = [r(SamplingParams(temperature=1.0, seed=(i + 1) << 33), rid=str(i)) for i in range(3000)]
    tokens = torch.tensor(s.sample(logits, reqs)[0])
    freq = torch.bincount(tokens, minlength=3).float() / 3000
    assert torch.allclose(freq, torch.tensor([0.6, 0.3, 0.1]), atol=0.035), freq


def test_top_p_zero_is_greedy() -> None:
    """Issue 12 item 5: top_p 0 keeps only the most likely token: the same tokens as temperature 0."""
    assert SamplingParams(top_p=0.0).is_greedy and not SamplingParams(top_p=0.01).is_greedy
    s = Sampler(CPU, [99], seed=0)
    logits = torch.randn(8, 300, generator=torch.Generator().manual_seed(7))
    top0 = s.sample(logits, [r(SamplingParams(temperature=1.5, top_p=0.0), rid=str(i)) for i in range(8)])[0]
    greedy = s.sample(logits, [r(SamplingParams(temperature=0.0), rid=str(i)) for i in range(8)])[0]
    assert top0 == greedy == logits.argmax(dim=-1).tolist()


def test_argmax_rows_is_argmax_with_ties_and_nans() -> None:
    from proxy.engine.execution.sampler import argmax_rows

    g = torch.Generator().manual_seed(0)
    values = torch.randint(0, 40, (6, 49152), generator=g).float()  # ties everywhere
    values[1, 7] = values[1, 40000] = 99.0  # a tie between two far lanes: the first
    values[2, [5, 30000]] = float("nan")  # NaN wins, the first one
    values[3] = float("-inf")
    values[4, 49151] = 1000.0  # the last lane
    got = argmax_rows(values)
    assert torch.equal(got, values.argmax(dim=-1))
    assert got[:5].tolist()[1:] == [7, 5, 0, 49151]
