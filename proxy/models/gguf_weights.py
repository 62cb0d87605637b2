"""A GGUF's tensors as the dense weights transformers would load from it, read straight from the
memory-mapped file a few rows (or one tensor) at a time: no converted Hugging Face copy of the
weights, on disk or in memory (issue 46).

transformers' GGUF loader (``modeling_gguf_pytorch_utils.load_gguf_checkpoint``, the path every
architecture the paged engine serves takes) dequantizes each tensor with gguf-py
(``gguf.quants.dequantize``, float32) and passes it through its architecture's ``TensorProcessor``;
:class:`GGUFWeights` does the same per row:

- the base ``TensorProcessor`` (most architectures: qwen2, qwen3, phi3, ...): the stored rows as they are;
- ``LlamaTensorProcessor``: ``attn_q`` / ``attn_k`` rows in the order its reverse RoPE permute gives
  (found by passing the row numbers through its own ``process``), every other tensor as stored;
- ``Gemma2TensorProcessor`` / ``NemotronTensorProcessor``: their element-wise norm offset, applied to
  the rows read.

Any other processor reshapes whole tensors (experts, fused qkv, transposes): :func:`gguf_weights`
then dequantizes the file through ``load_gguf_checkpoint`` into memory once (a dense copy for that
load, logged with the reason) and serves it as a :class:`StateDictWeights`.
The values are cast to the model's dtype as ``from_pretrained`` casts them, so a weight equals the
one the old converted folder held bit for bit (tests/test_gguf_weights.py).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from proxy.models.loaded import ModelLoadError
from proxy.quant.gguf_file import GGUFTensor, gguf_tensors, hf_to_gguf_names
from proxy.quant.gguf_rows import WeightSource

logger = logging.getLogger(__name__)

#: transformers' processors whose result on a subset of rows is their result's rows (or a row order)
ROW_LOCAL_PROCESSORS = ("TensorProcessor", "LlamaTensorProcessor", "Gemma2TensorProcessor",
                        "NemotronTensorProcessor")


def _processor(arch: str, config: Any) -> Any:
    """transformers' ``TensorProcessor`` for a GGUF architecture, configured as
    ``load_gguf_checkpoint`` configures it (the text config's fields)."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    processor: Any = TENSOR_PROCESSORS.get(arch, TensorProcessor)
    return processor(config=config.to_dict())


def _text_config(model: nn.Module) -> Any:
    config: Any = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


class GGUFWeights:
    """The dense weights of ``model``'s parameters read from a GGUF file (module docstring), in
    ``dtype`` on ``device``. A :class:`proxy.quant.gguf_rows.WeightSource`.

    Args:
        path: the ``.gguf`` file.
        model: the model (its parameters may be on ``meta``): its config and module names.
        aliases: parameter name -> the parameter whose tensor it reads (a tied lm_head: the embedding).
        num_blocks: the blocks gguf-py's name map covers; None: the text config's ``num_hidden_layers``
            (an mmproj's vision tower passes its own).
        processor: the transformers ``TensorProcessor`` that orders the rows; None: the file
            architecture's, configured with the text config (an mmproj's: ``proxy.models.mmproj``).
    Raises:
        ModelLoadError: the architecture's tensors are rearranged by a processor that is not row-local
            (:data:`ROW_LOCAL_PROCESSORS`; :func:`gguf_weights` takes the in-memory path then).
    """

    #: rows dequantized (and cast) at a time by :meth:`full`: bounds the fp32 transient (32 MiB at K=2048)
    CHUNK_ROWS = 4096

    def __init__(self, path: Path, model: nn.Module, dtype: torch.dtype, device: torch.device,
                 aliases: dict[str, str] | None = None, num_blocks: int | None = None,
                 processor: Any = None) -> None:
        config = _text_config(model)
        self.arch, self.tensors = gguf_tensors(path)
        self.processor = _processor(self.arch, config) if processor is None else processor
        if type(self.processor).__name__ not in ROW_LOCAL_PROCESSORS:
            raise ModelLoadError(f"GGUF architecture {self.arch!r}: transformers rearranges whole tensors "
                                 f"({type(self.processor).__name__})")
        blocks = int(getattr(config, "num_hidden_layers", 0)) if num_blocks is None else num_blocks
        self.names = hf_to_gguf_names(self.arch, blocks)
        if self.names is None:
            raise ModelLoadError(f"GGUF architecture {self.arch!r} is unknown to gguf-py")
        self.dtype, self.device, self.aliases, self.path = dtype, device, aliases or {}, path

    def tensor_name(self, name: str) -> str:
        """The GGUF tensor a parameter reads (``"model.layers.0.mlp.up_proj.weight"`` ->
        ``"blk.0.ffn_up.weight"``).

        Raises:
            ModelLoadError: no tensor of the file maps to it.
        """
        for key in (name, self.aliases.get(name)):  # its own tensor first, as the folder's was
            if key is None:
                continue
            module, _, suffix = key.rpartition(".")
            gname = self.names.get_name(module)
            if gname is not None and f"{gname}.{suffix}" in self.tensors:
                return f"{gname}.{suffix}"
        raise ModelLoadError(f"weight {name!r} is missing from the GGUF file {self.path.name}")

    def _row_order(self, gname: str, num_rows: int) -> np.ndarray | None:
        """Stored row of each transformers row (None: as stored): the processor applied to the row numbers."""
        probe = np.arange(num_rows, dtype=np.float32)[:, None]
        order = self.processor.process(weights=probe, name=gname).weights[:, 0]
        return None if np.array_equal(order, probe[:, 0]) else order.astype(np.int64)

    def _values(self, gname: str, tensor: GGUFTensor, raw: np.ndarray) -> torch.Tensor:
        """Dequantized stored rows ``raw`` (uint8 ``[R, row bytes]``), the processor's element-wise
        part applied, cast: ``[R, K]``."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        values = dequantize(raw, GGMLQuantizationType[tensor.type_name])
        if type(self.processor).__name__ in ("Gemma2TensorProcessor", "NemotronTensorProcessor"):
            values = self.processor.process(weights=values, name=gname).weights
        return torch.from_numpy(np.ascontiguousarray(values)).to(device=self.device, dtype=self.dtype)

    def rows(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        """Rows ``rows`` (long ``[R]``) of parameter ``name`` in transformers' order: ``[R, K]``."""
        gname = self.tensor_name(name)
        tensor = self.tensors[gname]
        idx = rows.numpy()
        order = self._row_order(gname, tensor.data.shape[0]) if len(tensor.shape) > 1 else None
        stored = idx if order is None else order[idx]
        out = self._values(gname, tensor, tensor.data[stored])  # fancy indexing copies
        tensor.release()  # the pages read count in the RSS while mapped
        return out.reshape(len(idx), *tensor.shape[1:])

    def full(self, name: str) -> torch.Tensor:
        """The whole parameter, :attr:`CHUNK_ROWS` rows dequantized at a time; the file's pages read
        are dropped afterwards (:meth:`GGUFTensor.release`)."""
        gname = self.tensor_name(name)
        tensor = self.tensors[gname]
        if len(tensor.shape) < 2:
            small = self._values(gname, tensor, np.array(tensor.data)).reshape(tensor.shape)
            tensor.release()
            return small
        num_rows = tensor.data.shape[0]
        order = self._row_order(gname, num_rows)
        out = torch.empty((num_rows, tensor.shape[-1]), dtype=self.dtype, device=self.device)
        for i in range(0, num_rows, self.CHUNK_ROWS):
            part = slice(i, min(i + self.CHUNK_ROWS, num_rows))
            stored = tensor.data[part] if order is None else tensor.data[order[part]]
            out[part] = self._values(gname, tensor, np.array(stored))  # a copy: the mapping is read-only
        tensor.release()
        return out.reshape(tensor.shape)


class StateDictWeights:
    """A :class:`~proxy.quant.gguf_rows.WeightSource` over a dict of dense tensors (transformers'
    dequantized state dict of a GGUF whose processor is not row-local); ``aliases`` as
    :class:`GGUFWeights`'."""

    def __init__(self, tensors: dict[str, torch.Tensor], aliases: dict[str, str] | None = None) -> None:
        self.tensors, self.aliases = tensors, aliases or {}

    def full(self, name: str) -> torch.Tensor:
        key = name if name in self.tensors else self.aliases.get(name, name)
        if key not in self.tensors:
            raise ModelLoadError(f"weight {name!r} is missing from the GGUF file")
        return self.tensors[key]

    def rows(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        return self.full(name)[rows]


def gguf_weights(path: Path, model: nn.Module, dtype: torch.dtype, device: torch.device,
                 aliases: dict[str, str] | None = None) -> WeightSource:
    """:class:`GGUFWeights` of ``path`` for ``model``, or, for an architecture whose transformers
    processor rearranges whole tensors, transformers' dequantized state dict in memory
    (:class:`StateDictWeights`; a warning says it costs a dense copy during the load).

    Raises:
        ModelLoadError: transformers cannot read the file.
    """
    try:
        return GGUFWeights(path, model, dtype, device, aliases)
    except ModelLoadError as exc:
        if "rearranges" not in str(exc):
            raise
        logger.warning("%s: dequantized in memory through transformers (a dense copy during the load)", exc)
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    try:
        parsed = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model, torch_dtype=dtype)
    except (ValueError, NotImplementedError, KeyError) as exc:
        raise ModelLoadError(f"cannot read {path.name}: {type(exc).__name__}: {exc}") from exc
    return StateDictWeights({k: v.to(device) for k, v in parsed["tensors"].items()}, aliases)


class PairWeights:
    """A :class:`~proxy.quant.gguf_rows.WeightSource` over a text GGUF and its mmproj
    (``proxy.models.mmproj``): a parameter under one of ``vision_modules`` (the vision tower and
    projector, e.g. ``model.vision_model.``) is read from ``vision``, any other from ``text``."""

    def __init__(self, text: WeightSource, vision: WeightSource, vision_modules: tuple[str, ...]) -> None:
        self.text, self.vision, self.vision_modules = text, vision, vision_modules

    def _source(self, name: str) -> WeightSource:
        return self.vision if name.startswith(self.vision_modules) else self.text

    def full(self, name: str) -> torch.Tensor:
        return self._source(name).full(name)

    def rows(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        return self._source(name).rows(name, rows)
