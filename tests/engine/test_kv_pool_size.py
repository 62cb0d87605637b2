"""The KV pool's default size on the CPU: from the model's bytes per token and the memory the kernel
reports available once the weights are loaded, never past what max_num_seqs full contexts need;
explicit settings win (``proxy.engine.execution.attention.cache.choose_num_blocks``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from proxy.engine.execution.attention import (
    LayerSpec,
    PagedKVCache,
    activation_dtype,
    choose_num_blocks,
    cpu_pool_size,
)
from proxy.heap import mem_available_bytes
from proxy.settings import Settings

CPU = torch.device("cpu")
GIB = 1 << 30


def smollm2_1_7b_bytes_per_token() -> int:
    """24 layers x 32 KV heads x head dim 64 x (K + V) x 2 bytes (bf16)."""
    layers = [LayerSpec(num_heads=32, num_kv_heads=32, key_dim=64, value_dim=64) for _ in range(24)]
    return PagedKVCache.bytes_per_token(layers, torch.bfloat16)


def test_bytes_per_token_is_layers_times_kv_heads_times_head_dim_times_two_times_dtype() -> None:
    assert smollm2_1_7b_bytes_per_token() == 24 * 32 * 64 * 2 * 2 == 196_608
    qwen05 = [LayerSpec(num_heads=14, num_kv_heads=2, key_dim=64, value_dim=64) for _ in range(24)]
    assert PagedKVCache.bytes_per_token(qwen05, torch.float32) == 24 * 2 * 64 * 2 * 4 == 24_576


def test_half_of_mem_available_when_full_contexts_need_more() -> None:
    # SmolLM2-1.7B shape, 32 sequences of 8192 tokens need 48 GiB; 20 GiB available -> 10 GiB of blocks
    per_token = smollm2_1_7b_bytes_per_token()
    pool = choose_num_blocks(Settings(), per_token, 8192, CPU, mem_available=20 * GIB)
    assert pool.num_blocks == (10 * GIB) // (per_token * 16) == 3413
    assert pool.reason == ("50% of MemAvailable 20.00 GiB after the weights (smaller than the 16384 blocks "
                           "(48.00 GiB) hold max_num_seqs full contexts)")


def test_full_contexts_bound_the_pool_when_memory_is_plentiful() -> None:
    per_token = smollm2_1_7b_bytes_per_token()
    settings = Settings(max_num_seqs=2)
    pool = choose_num_blocks(settings, per_token, 1000, CPU, mem_available=20 * GIB)
    assert pool.num_blocks == 2 * 63  # ceil(1000 / 16) blocks a sequence
    assert pool.reason == ("126 blocks (0.37 GiB) hold max_num_seqs full contexts, within 50% of "
                           "MemAvailable 20.00 GiB after the weights")


def test_explicit_settings_win() -> None:
    per_token = smollm2_1_7b_bytes_per_token()
    by_bytes = choose_num_blocks(Settings(kv_cache_bytes=GIB), per_token, 8192, CPU, mem_available=20 * GIB)
    assert by_bytes.num_blocks == GIB // (per_token * 16) == 341  # 5,456 tokens: the old fixed 1 GiB
    assert by_bytes.reason.startswith("kv_cache_bytes 1.00 GiB (smaller than")
    by_blocks = choose_num_blocks(Settings(num_kv_blocks=7), per_token, 8192, CPU, mem_available=0)
    assert (by_blocks.num_blocks, by_blocks.reason) == (7, "num_kv_blocks set")


def test_unreadable_mem_available_falls_back_to_one_gib() -> None:
    pool = cpu_pool_size(bytes_per_block=GIB // 4, wanted=100, kv_cache_bytes=None, mem_available=None)
    assert pool.num_blocks == 4
    assert pool.reason.startswith("MemAvailable unreadable: 1.00 GiB")


def test_not_one_block_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot hold a single block"):
        cpu_pool_size(bytes_per_block=1000, wanted=10, kv_cache_bytes=None, mem_available=1999)
    one = cpu_pool_size(bytes_per_block=1000, wanted=10, kv_cache_bytes=None, mem_available=2000)
    assert one.num_blocks == 1


def test_mem_available_is_read_from_meminfo(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   20971520 kB\n")
    assert mem_available_bytes(meminfo) == 20 * GIB
    meminfo.write_text("MemTotal:       24000000 kB\n")
    assert mem_available_bytes(meminfo) is None
    assert mem_available_bytes(tmp_path / "missing") is None


def test_the_pools_take_the_hidden_states_dtype_not_an_fp32_bias() -> None:
    """A Qwen2 GGUF served with int8 embeddings: the first parameter is layer 0's fp32 q/k/v bias
    (Int8Linear keeps biases in fp32); the pools must be bf16 like the queries."""
    model = torch.nn.Module()
    model.qkv = torch.nn.Module()
    model.qkv.bias = torch.nn.Parameter(torch.zeros(4, dtype=torch.float32), requires_grad=False)
    model.norm = torch.nn.Module()
    model.norm.weight = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16), requires_grad=False)
    assert next(model.parameters()).dtype == torch.float32
    assert activation_dtype(model) == torch.bfloat16
    only_bias = torch.nn.Module()
    only_bias.bias = torch.nn.Parameter(torch.zeros(2, dtype=torch.float16), requires_grad=False)
    assert activation_dtype(only_bias) == torch.float16
