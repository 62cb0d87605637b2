"""Pooling of an embedding model: how the token states of one input become one vector.

A sentence-transformers folder says it in ``modules.json`` (a list of modules: ``Transformer`` at the
folder itself, ``Pooling`` with its ``config.json``, optionally ``Normalize``), as
``sentence_transformers`` reads it. The ``Pooling`` config names the mode either as one string
``pooling_mode`` (sentence-transformers >= 5) or as the older booleans ``pooling_mode_cls_token`` /
``pooling_mode_mean_tokens`` / ``pooling_mode_lasttoken`` / ...; both are read. Served modes:
``cls`` (the first token's state), ``mean`` (the mean over the input's tokens) and ``last`` (the last
token's state; sentence-transformers' ``lasttoken``, vLLM's ``LAST``). Anything else a folder asks
for (``max``, ``weightedmean``, several modes at once, a ``Dense`` projection, ...) is refused at load
by name, never approximated. A folder without ``modules.json`` gets the server's
``--embedding-pooling`` and is L2-normalised (vLLM's default for embedding models).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from proxy.models.loaded import ModelLoadError
from proxy.settings import EMBEDDING_POOLINGS

POOLING_MODES = EMBEDDING_POOLINGS
"""Served modes (``--embedding-pooling``'s values, one source)."""

_ST_MODES = {"cls": "cls", "mean": "mean", "lasttoken": "last"}
_LEGACY_FLAGS = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
                 "pooling_mode_mean_tokens": "mean",
                 "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                 "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}
_MODULE_KINDS = ("Transformer", "Pooling", "Normalize")


@dataclass(frozen=True)
class PoolingConfig:
    """How vectors are made.

    Attributes:
        mode: one of :data:`POOLING_MODES`.
        normalize: L2-normalise each pooled vector (a ``Normalize`` module, or the default).
        max_seq_length: sentence-transformers' ``max_seq_length`` (``sentence_bert_config.json``),
            or None.
    """

    mode: str
    normalize: bool
    max_seq_length: int | None = None


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc


def _pooling_mode(config: dict[str, Any], where: Path) -> str:
    raw = config.get("pooling_mode")
    if raw is None:
        raw = [mode for flag, mode in _LEGACY_FLAGS.items() if config.get(flag)]
    modes = [raw] if isinstance(raw, str) else list(raw)
    if len(modes) != 1 or modes[0] not in _ST_MODES:
        raise ModelLoadError(f"{where} asks for pooling {modes}; served: one of {sorted(_ST_MODES)}")
    return _ST_MODES[modes[0]]


def read_pooling_config(folder: Path) -> PoolingConfig | None:
    """The pooling a sentence-transformers folder declares, or None for a folder without
    ``modules.json`` (plain transformers).

    Raises:
        ModelLoadError: unreadable files, a module other than Transformer / Pooling / Normalize, a
            Transformer module outside the folder itself, no Pooling module, or an unserved mode.
    """
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return None
    modules = _read_json(modules_file)
    if not isinstance(modules, list):
        raise ModelLoadError(f"{modules_file} is not a list of modules")
    kinds: dict[str, str] = {}
    for module in modules:
        kind = str(module.get("type", "")).rsplit(".", 1)[-1] if isinstance(module, dict) else ""
        if kind not in _MODULE_KINDS:
            raise ModelLoadError(f"{modules_file}: module {module!r} is not served (served: {_MODULE_KINDS})")
        kinds[kind] = str(module.get("path", ""))
    if kinds.get("Transformer", None) not in ("", None) or "Pooling" not in kinds:
        raise ModelLoadError(f"{modules_file}: expected a Transformer module at the folder itself and a "
                             f"Pooling module, got {kinds}")
    pooling_file = folder / kinds["Pooling"] / "config.json"
    mode = _pooling_mode(_read_json(pooling_file), pooling_file)
    st_config = folder / "sentence_bert_config.json"
    max_seq = _read_json(st_config).get("max_seq_length") if st_config.is_file() else None
    return PoolingConfig(mode, "Normalize" in kinds, int(max_seq) if max_seq else None)


def pool(hidden: torch.Tensor, lengths: torch.Tensor, mode: str) -> torch.Tensor:
    """Pool right-padded token states.

    Args:
        hidden: ``[batch, seq, width]`` last hidden states (any float dtype).
        lengths: ``[batch]`` int64, each input's token count (>= 1); positions past it are padding.
        mode: one of :data:`POOLING_MODES`.

    Returns:
        ``[batch, width]`` float32 (pooled in float32, as sentence-transformers pools fp32 states).
    """
    states = hidden.float()
    if mode == "cls":
        return states[:, 0]
    if mode == "last":
        return states[torch.arange(states.shape[0], device=states.device), lengths.to(states.device) - 1]
    if mode == "mean":
        positions = torch.arange(states.shape[1], device=states.device)
        mask = (positions[None, :] < lengths.to(states.device)[:, None]).to(states.dtype)
        return (states * mask[:, :, None]).sum(1) / mask.sum(1, keepdim=True)
    raise ValueError(f"unknown pooling mode {mode!r}")


def normalized(vectors: torch.Tensor) -> torch.Tensor:
    """``vectors`` ``[batch, width]`` scaled to unit L2 norm (``torch.nn.functional.normalize``, as
    sentence-transformers' ``Normalize`` module does; a zero vector stays zero)."""
    return torch.nn.functional.normalize(vectors, p=2.0, dim=-1)
