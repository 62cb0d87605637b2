"""What a model will take in host memory before it loads (issue 48's ``--models-memory-bytes``): its
weight files plus its KV pool as the engine will size it, and the budget the loaded models share.

``proxy.api.registry`` checks a load against :func:`memory_budget` with :func:`estimate_bytes`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from proxy.heap import MEMINFO, mem_available_bytes
from proxy.settings import CPU_KV_FALLBACK_BYTES, CPU_KV_MEMORY_FRACTION, Settings

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
"""Files counted as a model's weights by :func:`estimate_bytes`."""
ENGINE_PROCESS_BYTES = 400 << 20
"""What an engine process costs beside its weights and KV pool (its own interpreter, torch and
transformers): a model served from an engine process took 720-780 MB of RSS against 310 MB on a
thread of the server (``docs/bench/2026-12-06-several-models.md``)."""


def estimate_bytes(settings: Settings) -> int:
    """Host memory a model's engine is counted at against ``--models-memory-bytes``: the size of its
    weight files (``WEIGHT_SUFFIXES`` directly in its folder, or its ``.gguf`` file and its mmproj)
    plus its KV cache pool (:func:`kv_pool_bytes`), plus :data:`ENGINE_PROCESS_BYTES` when it runs in
    an engine process (``settings.engine_process`` True: a several-model server's default,
    ``proxy.catalog.entry_settings``)."""
    path = Path(settings.model or "").expanduser()
    files = [path] if path.is_file() else [p for p in path.glob("*") if p.suffix.lower() in WEIGHT_SUFFIXES]
    files += [Path(settings.mmproj).expanduser()] if settings.mmproj else []  # its vision tower
    process = ENGINE_PROCESS_BYTES if settings.engine_process else 0
    return sum(p.stat().st_size for p in files if p.is_file()) + kv_pool_bytes(settings, path) + process


def _kv_shape(path: Path) -> tuple[int, int, int, int]:
    """(layers, KV heads, head size, context) from a folder's ``config.json`` (its ``text_config``
    when nested) or a GGUF's metadata (``{arch}.block_count`` etc., as llama.cpp names them).

    Raises:
        OSError, ValueError, KeyError, TypeError, IndexError, ZeroDivisionError: unreadable.
    """
    if path.is_file():
        from gguf import GGUFReader

        fields = GGUFReader(str(path)).fields

        def value(key: str) -> Any:
            field = fields[key]
            return field.parts[field.data[0]]

        arch = bytes(value("general.architecture")).decode()
        config = {name: int(value(f"{arch}.{key}")[0]) for name, key in (
            ("num_hidden_layers", "block_count"), ("hidden_size", "embedding_length"),
            ("num_attention_heads", "attention.head_count"), ("max_position_embeddings", "context_length"))}
        if f"{arch}.attention.head_count_kv" in fields:
            config["num_key_value_heads"] = int(value(f"{arch}.attention.head_count_kv")[0])
    else:
        config = json.loads((path / "config.json").read_text())
        config = config.get("text_config", config)
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    return (int(config["num_hidden_layers"]), int(config.get("num_key_value_heads") or heads), head_dim,
            int(config.get("max_position_embeddings") or 0))


def kv_pool_bytes(settings: Settings, path: Path, meminfo: Path = MEMINFO) -> int:
    """The CPU KV pool's bytes as the engine sizes it (``proxy.engine.execution.attention.cache.
    choose_num_blocks``): ``num_kv_blocks`` blocks, else enough for ``max_num_seqs`` full contexts
    within ``kv_cache_bytes`` (None: :data:`~proxy.settings.CPU_KV_MEMORY_FRACTION` of ``MemAvailable``
    now); a token's keys and values from the model's shape (:func:`_kv_shape`: layers x KV heads x
    head size x 2, 4 bytes in float32, else 2). Without a readable shape: that budget."""
    budget = settings.kv_cache_bytes
    if budget is None:
        available = mem_available_bytes(meminfo)
        budget = CPU_KV_FALLBACK_BYTES if available is None else int(available * CPU_KV_MEMORY_FRACTION)
    try:
        layers, kv_heads, head_dim, model_len = _kv_shape(path)
    except (OSError, ValueError, KeyError, TypeError, IndexError, ZeroDivisionError):
        return budget
    per_token = 2 * layers * kv_heads * head_dim * (4 if settings.dtype == "float32" else 2)
    context = settings.max_model_len or model_len
    if settings.num_kv_blocks is not None:
        return per_token * settings.block_size * settings.num_kv_blocks
    return min(budget, per_token * settings.max_num_seqs * context) if context else budget


def memory_budget(settings: Settings, meminfo: Path = MEMINFO) -> int:
    """``--models-memory-bytes``, or when unset 90% of ``MemAvailable`` now (0: no check, also where
    ``meminfo`` cannot be read)."""
    if settings.models_memory_bytes is not None:
        return settings.models_memory_bytes
    available = mem_available_bytes(meminfo)
    return 0 if available is None else available * 9 // 10
