"""Tiny random models built from configs (fp32, CPU) for the engine tests."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from vision_fixtures import far_from_ties

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(autouse=True)
def one_torch_thread():
    """One intra-op thread for the engine tests, restored afterwards: the tiny models gain nothing
    from more, and on a shared 2-core machine a second OpenMP thread makes every small op wait on a
    barrier (measured 67 -> 5 ms per step)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def build_tiny(arch: str, seed: int = 0) -> torch.nn.Module:
    """A tiny random causal LM in eval mode using SDPA attention (fp32, CPU).

    ``arch``: "llama" (GQA 4 heads / 2 KV heads), "qwen2" (GQA 4 / 1, q/k/v bias) or "qwen3"
    (GQA 4 / 2, q/k RMSNorm, head_dim 24 != hidden / heads).
    """
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    torch.manual_seed(seed)
    common = {
        "vocab_size": 97,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 256,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "tie_word_embeddings": False,
    }
    if arch == "llama":
        config = LlamaConfig(num_key_value_heads=2, **common)
        model = LlamaForCausalLM(config)
    elif arch == "qwen2":
        config = Qwen2Config(num_key_value_heads=1, use_sliding_window=False, **common)
        model = Qwen2ForCausalLM(config)
    elif arch == "qwen3":
        config = Qwen3Config(num_key_value_heads=2, head_dim=24, use_sliding_window=False, **common)
        model = Qwen3ForCausalLM(config)
    else:
        raise ValueError(arch)
    return far_from_ties(model)


def engine_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A separate instance for the engine (switched to paged attention), so the reference keeps SDPA."""
    from proxy.engine.execution.attention import register

    name = register()
    clone = copy.deepcopy(model)
    clone.set_attn_implementation(name)
    return clone.eval()


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def tiny_pair(request: pytest.FixtureRequest) -> tuple[str, torch.nn.Module, torch.nn.Module]:
    """(arch, reference model with SDPA, engine model with paged attention)."""
    ref = build_tiny(request.param)
    return request.param, ref, engine_copy(ref)
