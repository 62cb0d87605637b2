"""The default model (SmolLM2-135M-Instruct, converted from the shipped GGUF) through the engine:
greedy output of four chat prompts, batched with staggered arrival, equals ``generate()`` alone."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import assert_greedy_matches, reference_greedy, run_staggered

from proxy.engine.attention import ATTN_IMPLEMENTATION
from proxy.engine.core import EngineCore
from proxy.sampling import SamplingParams
from proxy.settings import Settings

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain in one sentence what a KV cache is in a transformer language model and why it helps.",
]
MAX_NEW = 24


def test_default_model_greedy_matches_generate() -> None:
    from proxy.models import load_model

    threads = torch.get_num_threads()
    loaded = load_model(Settings())  # num_threads=None: keeps the test session's setting
    tok = loaded.hf_tokenizer
    prompts = []
    for q in QUESTIONS:
        ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
        prompts.append(list(ids if isinstance(ids, list) else ids["input_ids"]))
    eos = min(loaded.eos_token_ids)
    settings = Settings(num_kv_blocks=64, block_size=16, max_num_batched_tokens=48)  # chunked prefill too
    core = EngineCore(loaded.model, settings, loaded.eos_token_ids, loaded.max_model_len)
    results = run_staggered(core, prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0.0), [0, 0, 2, 5])
    loaded.model.set_attn_implementation("sdpa")
    try:
        for i, p in enumerate(prompts):
            ref_ids, gaps = reference_greedy(loaded.model, p, MAX_NEW, eos)
            assert_greedy_matches(results[str(i)], ref_ids, gaps, f"default model prompt {i}")
    finally:
        loaded.model.set_attn_implementation(ATTN_IMPLEMENTATION)
    text = tok.decode(results["0"], skip_special_tokens=True)
    assert "Paris" in text
    assert torch.get_num_threads() == threads
