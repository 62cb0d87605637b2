"""Resolve ``--model`` (an HF folder, a ``.gguf`` file, or the default model) and load it for the
engine: :func:`load_model` -> :class:`LoadedModel`, or :class:`ModelLoadError`.

One module a step:

- :mod:`proxy.models.loaded`: :class:`LoadedModel` (what the engine receives), :class:`ModelLoadError`.
- :mod:`proxy.models.source`: ``--model`` -> a Hugging Face folder; the default model's GGUF; a GGUF's
  config and tokenizer written once into the cache (``settings.cache_dir`` or
  ``~/.cache/streamproxy``; its weights stay in the file).
- :mod:`proxy.models.gguf_weights`: a GGUF's tensors as transformers' dense weights, read from the
  memory-mapped file a few rows or one tensor at a time (with ``--mmproj``, from the two files).
- :mod:`proxy.models.mmproj`: a vision-language model's llama.cpp ``mmproj`` GGUF read into its
  transformers config and processor; the pairs refused, by reason.
- :mod:`proxy.models.device`: device and dtype, ``"auto"`` resolved (bf16 on CUDA and on CPUs with
  BF16 instructions, else fp32).
- :mod:`proxy.models.quantize`: ``--quantization`` applied to a dense model; the one-thread rule
  for packing.
- :mod:`proxy.models.packed_load`: the low-memory load of a GGUF served at its own precision (a
  ``meta`` skeleton, linears packed from the GGUF's blocks, the rest dequantized from the file), and
  the dense load of a GGUF.
- :mod:`proxy.models.load`: :func:`load_model` (context length, EOS ids) ties the steps together;
  the engine's loader (``proxy.engine.loading``) gives it the attention implementation and the
  architecture check. This package never imports the engine.

``streamproxy models --convert [--model X.gguf] [--mmproj M.gguf] [--cache-dir DIR]`` (or
``python -m proxy.models``) converts ahead of time (``proxy.cli.prepare_model``).
"""

from proxy.models.device import auto_dtype, resolve_device_dtype
from proxy.models.load import eos_ids_of, load_model
from proxy.models.loaded import LoadedModel, ModelLoadError
from proxy.models.packed_load import load_gguf_dense, load_gguf_packed
from proxy.models.quantize import QUANTIZATIONS, apply_quantization, gguf_packed, one_thread
from proxy.models.source import (
    DEFAULT_GGUF_FILE,
    DEFAULT_GGUF_PACKAGE,
    DEFAULT_MODEL_NAME,
    cache_root,
    convert_gguf,
    default_gguf_path,
    resolve_model_path,
    resolve_model_source,
)

__all__ = [
    "DEFAULT_GGUF_FILE",
    "DEFAULT_GGUF_PACKAGE",
    "DEFAULT_MODEL_NAME",
    "QUANTIZATIONS",
    "LoadedModel",
    "ModelLoadError",
    "apply_quantization",
    "auto_dtype",
    "cache_root",
    "convert_gguf",
    "default_gguf_path",
    "eos_ids_of",
    "gguf_packed",
    "load_gguf_dense",
    "load_gguf_packed",
    "load_model",
    "one_thread",
    "resolve_device_dtype",
    "resolve_model_path",
    "resolve_model_source",
]
