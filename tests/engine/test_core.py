"""EngineCore with a tiny model: abort, seeded sampling in a busy batch, failed steps, validation."""

from __future__ import annotations

import pytest
import torch

from proxy.engine.core import EngineCore
from proxy.errors import ContextLengthExceededError, InvalidRequestError
from proxy.sampling import SamplingParams
from proxy.settings import Settings

from .engine_helpers import run_staggered

EOS = 2
SETTINGS = Settings(num_kv_blocks=64, block_size=4, max_num_batched_tokens=64, seed=0)


@pytest.fixture(scope="module")
def model(tiny_pair):
    return tiny_pair[2]


def prompts(n: int, seed: int = 7) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 97, (int(torch.randint(2, 20, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def test_abort_mid_generation_frees_every_block(model) -> None:
    core = EngineCore(model, SETTINGS, [EOS], max_model_len=256)
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts(4)):
        core.add_request(str(i), p, params)
    for _ in range(5):
        core.step()
    assert core.num_running == 4 and core.num_free_blocks < core.num_total_blocks
    out = core.abort_request("1")
    assert out is not None and out.finished and out.finish_reason == "abort" and out.num_output_tokens == 5
    assert core.abort_request("1") is None
    outs = core.step()
    assert "1" not in {o.request_id for o in outs} and len(outs) == 3
    for rid in ("0", "2", "3"):
        core.abort_request(rid)
    assert not core.has_unfinished()
    assert core.num_free_blocks == core.num_total_blocks


def test_seeded_sampling_same_alone_and_in_busy_batch(model) -> None:
    seeded = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    target = prompts(1, seed=99)[0]

    core = EngineCore(model, SETTINGS, [EOS], max_model_len=256)
    alone = run_staggered(core, [target], seeded, [0])["0"]

    busy_core = EngineCore(model, SETTINGS, [EOS], max_model_len=256)
    others = prompts(6)
    unseeded = SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True)
    for i, p in enumerate(others[:3]):
        busy_core.add_request(f"o{i}", p, unseeded)
    busy_core.step()
    busy_core.add_request("t", target, seeded)
    for i, p in enumerate(others[3:]):
        busy_core.add_request(f"o{i + 3}", p, unseeded)
    got: list[int] = []
    while busy_core.has_unfinished():
        for out in busy_core.step():
            if out.request_id == "t":
                got += out.new_token_ids
    assert got == alone
    assert len(set(alone)) > 3  # sampled, varied
    assert busy_core.num_free_blocks == busy_core.num_total_blocks


def test_failed_step_errors_its_requests_and_engine_keeps_serving(model) -> None:
    core = EngineCore(model, SETTINGS, [EOS], max_model_len=256)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    core.add_request("a", prompts(1)[0], params)
    core.step()
    calls = []

    def boom() -> None:
        calls.append(1)
        raise RuntimeError("injected fault")

    core.fault_injector = boom
    outs = core.step()
    assert len(calls) == 1
    assert [(o.request_id, o.finished, o.finish_reason) for o in outs] == [("a", True, "error")]
    assert outs[0].error == "engine step failed: RuntimeError: injected fault"
    assert core.num_free_blocks == core.num_total_blocks and not core.has_unfinished()
    core.fault_injector = None
    core.add_request("b", prompts(1)[0], params)
    tokens = []
    while core.has_unfinished():
        for o in core.step():
            tokens += o.new_token_ids
            last = o
    assert len(tokens) == 5 and last.finish_reason == "length"


def test_logprobs_match_reference_forward(tiny_pair) -> None:
    _, ref, model = tiny_pair
    core = EngineCore(model, SETTINGS, [EOS], max_model_len=256)
    prompt = prompts(1, seed=5)[0]
    core.add_request(
        "a", prompt, SamplingParams(max_tokens=3, temperature=0.0, logprobs=True, top_logprobs=3)
    )
    outs = []
    while core.has_unfinished():
        outs += core.step()
    ids = prompt + [o.new_token_ids[0] for o in outs]
    with torch.inference_mode():
        logits = ref(torch.tensor([ids])).logits[0]
    for k, out in enumerate(outs):
        lp = torch.log_softmax(logits[len(prompt) - 1 + k].float(), -1)
        entry = out.new_logprobs[0]
        assert entry.token_id == out.new_token_ids[0] == int(lp.argmax())
        assert entry.logprob == pytest.approx(float(lp.max()), abs=1e-4)
        assert [t for t, _ in entry.top] == lp.topk(3).indices.tolist()


def test_prompt_validation(model) -> None:
    core = EngineCore(model, Settings(num_kv_blocks=4, block_size=4), [EOS], max_model_len=32)
    assert core.max_model_len == 16  # lowered to what the 4 x 4-slot pool holds
    with pytest.raises(InvalidRequestError):
        core.add_request("e", [], SamplingParams())
    with pytest.raises(ContextLengthExceededError):
        core.add_request("long", [5] * 32, SamplingParams())
    with pytest.raises(ContextLengthExceededError):  # fits max_model_len, not the 16-slot pool
        core.add_request("pool", [5] * 16, SamplingParams())
    core.add_request("ok", [5] * 15, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    outs = []
    while core.has_unfinished():
        outs += core.step()
    assert outs[-1].finish_reason == "length" and outs[-1].num_output_tokens == 1  # 15 + 1 = max_model_len
    assert core.num_free_blocks == 4
