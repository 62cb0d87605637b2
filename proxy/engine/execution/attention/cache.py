"""The paged KV cache: per-layer K and V block pools, each of the shape its layer really produces.

vLLM's PagedAttention layout: one flat pool of ``num_blocks * block_size`` slots per layer and per
K / V; slot ``block * block_size + offset`` holds one position. Each layer's pools have the shapes
the layer produces (:class:`LayerSpec`, measured by
:func:`proxy.engine.execution.attention.probe.probe_layers`):
K and V of their own widths for multi-head latent attention (DeepSeek V2/V3: K is
``qk_nope_head_dim + qk_rope_head_dim`` wide, V ``v_head_dim``).
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch

from proxy.heap import mem_available_bytes
from proxy.settings import CPU_KV_FALLBACK_BYTES, CPU_KV_MEMORY_FRACTION, Settings


@dataclass(frozen=True)
class LayerSpec:
    """What one attention layer needs from the cache and the mask (measured by :func:`probe_layers`).

    Attributes:
        num_heads: query heads ``H``.
        num_kv_heads: K/V heads ``H_kv`` (``H`` for MLA, which expands its latent per head).
        key_dim, value_dim: K and V head widths (equal except for multi-head latent attention).
        sliding_window: ``W`` in tokens, or None (full attention).
        chunk_size: ``C`` in tokens for chunked attention (Llama 4), or None.
        softcap: attention logit soft-cap (Gemma 2), or None.
        has_sinks: the layer passes attention sinks (GPT-OSS ``s_aux``).
    """

    num_heads: int
    num_kv_heads: int
    key_dim: int
    value_dim: int
    sliding_window: int | None = None
    chunk_size: int | None = None
    softcap: float | None = None
    has_sinks: bool = False

    @property
    def pattern(self) -> tuple[int | None, int | None]:
        """``(sliding_window, chunk_size)``: layers with the same pattern share their masks."""
        return (self.sliding_window, self.chunk_size)


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.zeros(shape, dtype)`` whose pages become resident only once written, on the CPU.

    CPU: an anonymous ``mmap`` (the kernel zero-fills each page on first touch), so the KV cache's
    RSS grows with the blocks used instead of the whole ``kv_cache_bytes`` at startup
    (``torch.zeros`` writes every page: 1 GiB of the default server's 1.9 GB peak RSS, issue 14).
    Elsewhere: ``torch.zeros``.
    """
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)  # the tensor keeps a reference to it
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)


def activation_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype of ``model``'s hidden states, and so of its KV pools: its first parameter's that is
    not a bias (a norm's or a dense layer's weight), else its first parameter's. Biases do not decide
    it: a layer may keep its bias in fp32 (``Int8Linear`` of ``proxy.quant``), and a model whose
    embedding is int8 codes (no parameter) with q/k/v biases (Qwen2 from a GGUF) starts with one.

    Raises:
        ValueError: the model has no parameters."""
    first: torch.dtype | None = None
    for name, param in model.named_parameters():
        if not name.endswith("bias"):
            return param.dtype
        first = first or param.dtype
    if first is None:
        raise ValueError("the model has no parameters")
    return first


class PagedKVCache:
    """Per-layer K and V block pools, each of its layer's own shape.

    Layer ``i`` has a K pool ``[num_blocks * block_size, H_kv_i, key_dim_i]`` and a V pool
    ``[num_blocks * block_size, H_kv_i, value_dim_i]`` of ``dtype`` on ``device``; slot
    ``block * block_size + offset`` holds one position. Create it outside ``torch.inference_mode()``
    (writes inside inference mode then work in place). ``num_scratch_slots`` more slots follow the
    blocks (from :attr:`scratch_slot` on): no block contains them, so the padded rows of a captured
    decode graph (``proxy.engine.execution.decode_graphs``) write and read there.

    Args:
        layers: one :class:`LayerSpec` per layer, in ``layer_idx`` order.
        num_blocks, block_size: pool geometry.
        dtype, device: of the model's activations.
        num_scratch_slots: slots past the last block (0 or 1).
    """

    def __init__(
        self,
        layers: list[LayerSpec],
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        num_scratch_slots: int = 0,
    ) -> None:
        self.layers = list(layers)
        self.num_layers = len(layers)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.device = torch.device(device)
        self.num_scratch_slots = num_scratch_slots
        slots = num_blocks * block_size + num_scratch_slots
        self.key_pools = [lazy_zeros((slots, s.num_kv_heads, s.key_dim), dtype, self.device) for s in layers]
        self.value_pools = [
            lazy_zeros((slots, s.num_kv_heads, s.value_dim), dtype, self.device) for s in layers
        ]

    @staticmethod
    def bytes_per_token(layers: list[LayerSpec], dtype: torch.dtype) -> int:
        """KV cache bytes one token occupies across all layers (K and V, each of its own width)."""
        size = torch.empty((), dtype=dtype).element_size()
        return sum(s.num_kv_heads * (s.key_dim + s.value_dim) for s in layers) * size

    @property
    def scratch_slot(self) -> int:
        """The first slot past the blocks (meaningful when ``num_scratch_slots >= 1``)."""
        return self.num_blocks * self.block_size

    @property
    def num_bytes(self) -> int:
        """Bytes of the blocks of all pools (scratch slots not counted)."""
        return self.num_blocks * self.block_size * self.bytes_per_token(self.layers, self.dtype)


@dataclass(frozen=True)
class KVPoolSize:
    """The pool's size in blocks and why (the reason goes into the start-up log)."""

    num_blocks: int
    reason: str


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


def cpu_pool_size(
    bytes_per_block: int, wanted: int, kv_cache_bytes: int | None, mem_available: int | None
) -> KVPoolSize:
    """The CPU pool: ``min(wanted, budget // bytes_per_block)`` blocks.

    The budget is ``kv_cache_bytes`` when set, else ``CPU_KV_MEMORY_FRACTION`` of ``mem_available``
    (bytes, ``MemAvailable`` after the weights are loaded), else (unreadable) ``CPU_KV_FALLBACK_BYTES``.
    ``wanted`` (blocks for ``max_num_seqs`` full contexts) bounds it: more could never be used.

    Raises:
        ValueError: when not even one block fits.
    """
    need = f"{wanted} blocks ({_gib(wanted * bytes_per_block)}) hold max_num_seqs full contexts"
    if kv_cache_bytes is not None:
        budget, source = kv_cache_bytes, f"kv_cache_bytes {_gib(kv_cache_bytes)}"
    elif mem_available is not None:
        budget = int(mem_available * CPU_KV_MEMORY_FRACTION)
        source = f"{CPU_KV_MEMORY_FRACTION:.0%} of MemAvailable {_gib(mem_available)} after the weights"
    else:
        budget, source = CPU_KV_FALLBACK_BYTES, f"MemAvailable unreadable: {_gib(CPU_KV_FALLBACK_BYTES)}"
    fits = budget // bytes_per_block
    if fits < 1:
        raise ValueError(
            f"the KV cache cannot hold a single block ({bytes_per_block} bytes) within {source}; "
            "raise kv_cache_bytes or lower block_size"
        )
    if wanted <= fits:
        return KVPoolSize(wanted, f"{need}, within {source}")
    return KVPoolSize(fits, f"{source} (smaller than the {need})")


def choose_num_blocks(
    settings: Settings,
    bytes_per_token: int,
    max_model_len: int,
    device: torch.device,
    mem_available: int | None = None,
) -> KVPoolSize:
    """Number of KV blocks for the pool, and why: ``settings.num_kv_blocks`` when set; otherwise
    enough blocks for ``max_num_seqs`` full contexts, capped on CUDA by ``free memory *
    gpu_memory_utilization`` (``torch.cuda.mem_get_info`` after the weights are loaded) and on CPU
    as :func:`cpu_pool_size` says (``mem_available``: bytes, default ``MemAvailable`` read now).

    Raises:
        ValueError: when not even one block fits.
    """
    bytes_per_block = bytes_per_token * settings.block_size
    # never more than max_num_seqs full-length sequences can use
    wanted = settings.max_num_seqs * -(-max_model_len // settings.block_size)
    if settings.num_kv_blocks is not None:
        return KVPoolSize(settings.num_kv_blocks, "num_kv_blocks set")
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        num_blocks = min(wanted, int(free * settings.gpu_memory_utilization) // bytes_per_block)
        if num_blocks < 1:
            raise ValueError("the KV cache cannot hold a single block; lower block_size")
        return KVPoolSize(num_blocks, f"gpu_memory_utilization {settings.gpu_memory_utilization} of free "
                                      f"{_gib(free)}, at most max_num_seqs full contexts")
    if mem_available is None:
        mem_available = mem_available_bytes()
    return cpu_pool_size(bytes_per_block, wanted, settings.kv_cache_bytes, mem_available)
