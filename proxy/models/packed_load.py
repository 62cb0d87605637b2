"""The low-memory load of a GGUF served at its own precision (issue 14): the model skeleton on the
``meta`` device, each linear packed straight from the GGUF's blocks, every other weight read from
the converted folder one tensor at a time (:class:`FolderWeights`); no dense copy of a packed
linear ever exists."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from proxy.models.loaded import ModelLoadError
from proxy.models.quantize import one_thread
from proxy.quant import describe, load_gguf_linears
from proxy.quant import kernel_dtype as quant_kernel_dtype


class FolderWeights:
    """The dense weights of a Hugging Face folder's ``*.safetensors`` files, read one tensor (or a
    few rows) at a time through ``safetensors.safe_open``, cast to ``dtype`` on ``device`` as
    ``from_pretrained`` casts them. A :class:`proxy.quant.gguf_blocks.WeightSource`.

    ``aliases``: parameter name -> stored name (a tied lm_head is stored as the embedding).
    """

    #: rows read (and cast) at a time by :meth:`full`: bounds the fp32 transient (9 MB at K=576).
    CHUNK_ROWS = 4096

    def __init__(
        self, folder: Path, dtype: torch.dtype, device: torch.device, aliases: dict[str, str]
    ) -> None:
        from safetensors import safe_open

        self.dtype, self.device, self.aliases = dtype, device, aliases
        self._where: dict[str, str] = {}
        for file in sorted(folder.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as handle:
                for key in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                    self._where[key] = str(file)
        if not self._where:
            raise ModelLoadError(f"{folder} has no safetensors weights")

    @contextlib.contextmanager
    def _slice(self, name: str) -> Iterator[Any]:
        """The stored tensor's lazy slice; its file is open (memory-mapped) only inside the block,
        so the pages read are unmapped right after (they would count in the RSS until then)."""
        from safetensors import safe_open

        key = name if name in self._where else self.aliases.get(name, name)
        if key not in self._where:
            raise ModelLoadError(f"weight {name!r} is missing from the model folder")
        with safe_open(self._where[key], framework="pt") as handle:
            yield handle.get_slice(key)

    def rows(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        """Rows ``rows`` (long ``[R]``, sorted) of ``name``: ``[R, K]``; contiguous runs read at once."""
        idx = rows.tolist()
        parts, start = [], 0
        with self._slice(name) as sl:
            for i in range(1, len(idx) + 1):
                if i == len(idx) or idx[i] != idx[i - 1] + 1:
                    parts.append(sl[idx[start]:idx[i - 1] + 1])
                    start = i
        return torch.cat(parts).to(device=self.device, dtype=self.dtype)

    def full(self, name: str) -> torch.Tensor:
        """The whole tensor, read and cast :attr:`CHUNK_ROWS` rows at a time."""
        with self._slice(name) as sl:
            shape = sl.get_shape()
            if len(shape) < 2:
                small: torch.Tensor = sl[:].to(device=self.device, dtype=self.dtype)
                return small
            out = torch.empty(shape, dtype=self.dtype, device=self.device)
            for i in range(0, shape[0], self.CHUNK_ROWS):
                out[i:i + self.CHUNK_ROWS] = sl[i:i + self.CHUNK_ROWS]
        return out


def load_gguf_packed(
    folder: Path, config: Any, gguf: Path, device: torch.device, dtype: torch.dtype, attn: str,
    dense_dtype: torch.dtype | None = None,
) -> tuple[Any, str]:
    """Build the model with its linears packed from the GGUF's own blocks, never holding a dense
    copy of a packed linear (issue 14: the dense-then-pack path peaked at 1.2 GB RSS for the default
    model).

    The skeleton is built by transformers on the ``meta`` device (parameters only; buffers such as
    RoPE's ``inv_freq`` are real: ``accelerate.init_empty_weights(include_buffers=False)``, as
    ``from_pretrained`` does). Each linear is packed from its GGUF tensor, matched against a few
    rows of the folder's dense weight (:func:`proxy.quant.load_gguf_linears`); every parameter still
    on ``meta`` afterwards (embedding, norms, linears kept dense) is then read from the folder, one
    tensor at a time, cast to ``dtype`` as ``from_pretrained`` casts it. The served weights equal
    the dense-then-pack path's bit for bit (tests/test_models.py). ``dense_dtype``: the packed
    linears' dense prefill copies are made while packing (``proxy.quant.load_gguf_linears``).

    Returns:
        ``(model in eval mode, quantization description)``.
    Raises:
        ModelLoadError: a weight is missing from the folder.
    """
    from accelerate import init_empty_weights  # type: ignore[import-untyped]
    from transformers import AutoModelForCausalLM, GenerationConfig

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)
    try:
        model.generation_config = GenerationConfig.from_pretrained(str(folder))
    except OSError:
        pass  # no generation_config.json: the one from_config derived stays
    names = {id(m): n for n, m in model.named_modules()}
    aliases = {}
    out, inp = model.get_output_embeddings(), model.get_input_embeddings()
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    tied = out is not None and inp is not None and (
        out.weight is inp.weight or getattr(text, "tie_word_embeddings", False)
    )
    if tied:
        aliases[f"{names[id(out)]}.weight"] = f"{names[id(inp)]}.weight"
    weights = FolderWeights(folder, dtype, device, aliases)
    with one_thread():
        counts = load_gguf_linears(model, gguf, quant_kernel_dtype(device), weights, device, dense_dtype)
    for name, param in list(model.named_parameters()):
        if param.is_meta:
            module_name, _, attr = name.rpartition(".")
            module = model.get_submodule(module_name)
            module._parameters[attr] = torch.nn.Parameter(weights.full(name), requires_grad=False)
    for name, buf in model.named_buffers():
        if buf.is_meta:
            raise ModelLoadError(f"buffer {name!r} was not initialized")
    model.to(device)  # the buffers (the parameters are there already)
    model.eval()
    return model, "gguf: " + describe(counts)
