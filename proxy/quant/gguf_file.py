"""The tensor index of a GGUF file (v2/v3), read straight from its header, and the map from
transformers' module names to GGUF tensor names.

:func:`gguf_tensors` skips the metadata values instead of materializing them (gguf-py's
``GGUFReader`` reads every field, the vocabulary included) and memory-maps each tensor's bytes;
type names and block sizes come from gguf-py's tables. :func:`hf_to_gguf_names` is gguf-py's
``TensorNameMap``. :mod:`proxy.quant.gguf_blocks` decodes the tensors found here.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF value types
_STRING, _ARRAY = 8, 9


@dataclass
class GGUFTensor:
    """One tensor of a GGUF file: ``type_name`` (GGML type), ``shape`` ``(rows, cols)`` as
    PyTorch orders it (GGUF lists dims innermost first), ``data`` its bytes (memory-mapped;
    ``mapping`` and ``offset``: the file's mapping and where ``data`` starts in it)."""

    type_name: str
    shape: tuple[int, ...]
    data: np.ndarray
    mapping: mmap.mmap | None = None
    offset: int = 0

    def release(self) -> None:
        """Drop the pages of ``data`` this process has read (``madvise(MADV_DONTNEED)``; a later read
        faults them in again from the page cache). A mapping's pages read count in the RSS until it
        is unmapped: the default model's whole 94 MiB file at the end of its load, else."""
        if self.mapping is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        start = self.offset // mmap.PAGESIZE * mmap.PAGESIZE
        end = min(self.offset + self.data.nbytes, len(self.mapping))
        self.mapping.madvise(mmap.MADV_DONTNEED, start, end - start)


def gguf_tensors(path: Path) -> tuple[str, dict[str, GGUFTensor]]:
    """``(architecture, {tensor name: GGUFTensor})`` of a GGUF (v2/v3) file.

    Reads only the header's tensor index: gguf-py's ``GGUFReader`` also materializes every
    metadata field (the default model's vocabulary: 16 s on this 2-core machine under load), which
    the loader does not need. Type names and block sizes come from gguf-py's tables.

    Raises:
        ValueError: not a GGUF v2/v3 file.
    """
    import gguf

    mm = np.memmap(path, dtype=np.uint8, mode="r")
    buf = mm.data  # a memoryview of the mapping
    if bytes(buf[:4]) != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file")
    version, num_tensors, num_kv = struct.unpack_from("<IQQ", buf, 4)
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not supported")
    pos = 24

    def read_str() -> str:
        nonlocal pos
        (n,) = struct.unpack_from("<Q", buf, pos)
        pos += 8 + n
        return bytes(buf[pos - n:pos]).decode("utf-8", "replace")

    def skip_value(vtype: int) -> Any:
        nonlocal pos
        if vtype == _STRING:
            return read_str()
        if vtype == _ARRAY:
            (etype, count) = struct.unpack_from("<IQ", buf, pos)
            pos += 12
            if etype in _SCALAR_SIZES:
                pos += count * _SCALAR_SIZES[etype]
            elif etype == _STRING:  # a vocabulary: step over each string by its length, not decoded
                unpack = struct.Struct("<Q").unpack_from
                for _ in range(count):
                    pos += 8 + unpack(buf, pos)[0]
            else:
                for _ in range(count):
                    skip_value(etype)
            return None
        size = _SCALAR_SIZES[vtype]
        value = struct.unpack_from({1: "<B", 2: "<H", 4: "<I", 8: "<Q"}[size], buf, pos)[0]
        pos += size
        return value

    arch, alignment = "", 32
    for _ in range(num_kv):
        key = read_str()
        (vtype,) = struct.unpack_from("<I", buf, pos)
        pos += 4
        value = skip_value(vtype)
        if key == "general.architecture":
            arch = str(value)
        elif key == "general.alignment":
            alignment = int(value)
    index = []
    for _ in range(num_tensors):
        name = read_str()
        (ndim,) = struct.unpack_from("<I", buf, pos)
        dims = struct.unpack_from(f"<{ndim}Q", buf, pos + 4)
        ttype, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * ndim)
        pos += 4 + 8 * ndim + 12
        index.append((name, dims, ttype, offset))
    base = (pos + alignment - 1) // alignment * alignment
    tensors = {}
    for name, dims, ttype, offset in index:
        qtype = gguf.GGMLQuantizationType(ttype)
        block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        shape = tuple(int(d) for d in reversed(dims))
        row_bytes = shape[-1] // block * block_bytes
        rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
        data = mm[base + offset: base + offset + rows * row_bytes].reshape(rows, row_bytes)
        tensors[name] = GGUFTensor(qtype.name, shape, data, getattr(mm, "_mmap", None), base + offset)
    return arch, tensors


VLM_TEXT_PREFIXES = ("model.text_model.", "model.language_model.")
"""Where a vision-language model's decoder sits in transformers (Idefics3 / SmolVLM; LLaVA, Qwen2-VL,
Mistral3, ...): llama.cpp's converter drops ``text_model.`` / ``language_model.`` from those names
before it maps them (``filter_tensors`` of ``LlamaModel`` and ``ModelBase``), so the text GGUF of a
VLM holds ``model.text_model.layers.0.mlp.up_proj`` as ``blk.0.ffn_up``."""


def hf_to_gguf_names(arch: str, num_layers: int) -> Any:
    """gguf-py's ``TensorNameMap`` for ``arch`` (``get_name("model.layers.0.mlp.up_proj")`` ->
    ``"blk.0.ffn_up"``), each ``model.`` name also under :data:`VLM_TEXT_PREFIXES` (a VLM's decoder);
    for an mmproj (``clip``) each name also under ``model.`` (transformers puts a LLaVA's
    ``vision_tower.`` and ``multi_modal_projector.`` there; the checkpoints the converter reads do
    not). None for an architecture gguf-py does not know."""
    import gguf

    by_name = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}
    if arch not in by_name:
        return None
    names = gguf.get_tensor_name_map(by_name[arch], num_layers)
    for key, value in list(names.mapping.items()):
        if arch == "clip" and not key.startswith("model."):
            names.mapping.setdefault("model." + key, value)
        elif key.startswith("model."):
            for prefix in VLM_TEXT_PREFIXES:
                names.mapping.setdefault(prefix + key.removeprefix("model."), value)
    return names
