"""The quantized model through the engine: greedy output under continuous batching (staggered
arrivals, chunked prefill, a tiny KV pool) equals greedy ``generate()`` of the same quantized model."""

from __future__ import annotations

import copy

import pytest
import torch
from engine.engine_helpers import assert_greedy_matches, reference_greedy, run_staggered

from proxy.engine.core import EngineCore
from proxy.engine.execution.attention import register
from proxy.quant import PackedLinear, kernel_dtype, quantize_linears
from proxy.quant.fuse import fuse_sibling_linears
from proxy.quant.int8_linear import Int8Linear, kernel_available
from proxy.sampling import SamplingParams
from proxy.settings import Settings

EOS = 2
MAX_NEW = 20
LENGTHS = [5, 17, 1, 33, 8, 40]
ARRIVALS = [0, 0, 2, 3, 7, 11]


@pytest.fixture(autouse=True)
def one_torch_thread():
    """One intra-op thread, as the engine tests use (a second OpenMP thread on a shared 2-core
    machine makes every small op wait on a barrier)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _tiny(method: str) -> torch.nn.Module:
    """A tiny random llama (every linear packable: N % 16 == 0, K % 32 == 0; head_dim 64, so q/k/v
    can be fused: N % 64 == 0), quantized."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=112, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                         max_position_embeddings=256,
                         bos_token_id=1, eos_token_id=EOS, pad_token_id=0, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.15)  # logits far from ties
    counts = quantize_linears(model, method, 32, kernel_dtype(torch.device("cpu")))
    assert counts == {f"{method} g32": 15}
    model.set_attn_implementation("sdpa")
    return model.eval()


@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused"])
@pytest.mark.parametrize("method", ["int4", "int8"])
def test_quantized_engine_greedy_matches_generate(method: str, fused: bool) -> None:
    """Also with q/k/v and gate/up fused in the engine's copy only (``generate()`` runs unfused)."""
    ref = _tiny(method)
    engine_model = copy.deepcopy(ref)
    if fused:
        assert fuse_sibling_linears(engine_model) == 4
    engine_model.set_attn_implementation(register())
    q8_kernel = method == "int8" and kernel_available()  # int8 g32 through the Q8_0 kernel
    assert type(engine_model.lm_head) is (Int8Linear if q8_kernel else PackedLinear)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 112, (n,), generator=g).tolist() for n in LENGTHS]
    settings = Settings(num_kv_blocks=20, block_size=4, max_num_batched_tokens=16)  # chunked + preemption
    core = EngineCore(engine_model, settings, [EOS], max_model_len=256)
    results = run_staggered(core, prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0.0), ARRIVALS)
    distinct = set()
    for i, p in enumerate(prompts):
        ref_ids, gaps = reference_greedy(ref, p, MAX_NEW, EOS)
        assert_greedy_matches(results[str(i)], ref_ids, gaps, f"{method} prompt {i}")
        distinct.add(tuple(ref_ids))
    assert len(distinct) > 1
