"""The CPU KV cache's pages become resident only once written (issue 14: ``torch.zeros`` made the
whole ``kv_cache_bytes`` resident at startup, 1 GiB of the default server's peak RSS)."""

from __future__ import annotations

from pathlib import Path

import torch

from proxy.engine.execution.attention import LayerSpec, PagedKVCache, lazy_zeros


def rss_kb() -> int:
    """Resident anonymous + shared memory of this process, kB."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return sum(int(fields[k].split()[0]) for k in ("RssAnon", "RssShmem"))


def test_cpu_kv_pools_are_zero_and_resident_only_where_written() -> None:
    layers = [LayerSpec(num_heads=4, num_kv_heads=4, key_dim=64, value_dim=64) for _ in range(4)]
    before = rss_kb()
    cache = PagedKVCache(layers, num_blocks=2048, block_size=16, dtype=torch.bfloat16, device="cpu")
    pool_kb = cache.num_bytes // 1024  # 128 MiB, 16 MiB a pool
    assert pool_kb == 128 * 1024
    assert all(int(torch.count_nonzero(p)) == 0 for p in cache.key_pools + cache.value_pools)
    assert rss_kb() - before < pool_kb // 8  # reading zeros maps no pages
    cache.key_pools[0][:16] = 1.0  # one block of one layer written
    assert float(cache.key_pools[0][:16].float().sum()) == 16 * 4 * 64
    assert int(torch.count_nonzero(cache.key_pools[0])) == 16 * 4 * 64
    cache.value_pools[1].fill_(2.0)  # a whole pool written: now resident
    assert rss_kb() - before >= pool_kb // 8 - 256


def test_lazy_zeros_matches_torch_zeros() -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        t = lazy_zeros((3, 5, 7), dtype, torch.device("cpu"))
        assert t.dtype == dtype and t.shape == (3, 5, 7) and t.is_contiguous()
        assert torch.equal(t, torch.zeros(3, 5, 7, dtype=dtype))
    assert lazy_zeros((0, 4), torch.float32, torch.device("cpu")).shape == (0, 4)
