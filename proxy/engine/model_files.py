"""The files of a model that the API process reads itself when its engine runs in a child process (the
tokenizer, the config, the image processor), read once per model and kept across its unloads.

Why: on a several-model server a model loads while others stream, and the child's load runs at a
low priority, but these reads run in the API process, under the interpreter lock that the event loop
writing every stream needs, and in long stretches that do not let it go (the tokenizer's parse in
Rust, our decode table's build and check): the streams' one long gap during a load
(``docs/bench/2026-12-06-load-gil.md``). So :data:`MODEL_FILES` reads them once: ahead, before
any model serves (:meth:`ModelFilesCache.preread`, for the models whose folder exists then;
``proxy.api.multi.start_read_ahead``), or at a model's first load; later loads of the same folder
reuse them while its files are unchanged (:func:`files_signature`).

Bound: :data:`KEPT_MODELS` models, the least recently used forgotten first (their memory is the
tokenizer's tables, measured in the decision log).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from proxy.tokenizer import Tokenizer

log = logging.getLogger(__name__)

KEPT_MODELS = 8
"""How many models' files :data:`MODEL_FILES` keeps (and :meth:`ModelFilesCache.preread` reads at
most, in catalog order)."""
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5")


def files_signature(folder: str | Path) -> tuple[tuple[str, int, int], ...]:
    """``(name, size, mtime_ns)`` of every file directly in ``folder`` but the weights: a change to
    the tokenizer, the config or the chat template changes it (the files are then read again)."""
    with os.scandir(folder) as it:
        return tuple(sorted((e.name, st.st_size, st.st_mtime_ns) for e in it
                            if e.is_file() and not e.name.endswith(WEIGHT_SUFFIXES)
                            for st in (e.stat(),)))


@dataclass(frozen=True)
class ModelFiles:
    """What the API process needs of a model's folder.

    Attributes:
        hf_tokenizer: ``AutoTokenizer.from_pretrained(folder)``.
        tokenizer: our :class:`~proxy.tokenizer.Tokenizer` of it, with the tokenizer's own EOS ids only
            (a load adds the model's: ``Tokenizer.with_generation_eos``).
        vocab_size: ``len(hf_tokenizer)`` (added tokens included).
        config: ``AutoConfig.from_pretrained(folder)``.
        vision: the image processor of a served vision model, else None
            (``proxy.media.processor.VisionProcessor.load``).
        images_refused: ``proxy.media.processor.images_refusal(config)``.
        signature: :func:`files_signature` of the folder when read.
    """

    hf_tokenizer: Any
    tokenizer: Tokenizer
    vocab_size: int
    config: Any
    vision: Any
    images_refused: str | None
    signature: tuple[tuple[str, int, int], ...]


def read_model_files(folder: str | Path) -> ModelFiles:
    """Read ``folder``'s tokenizer, config and image processor (module docs).

    Raises:
        OSError, ValueError: as transformers' ``from_pretrained`` raises them for a missing or broken file.
    """
    from transformers import AutoConfig, AutoTokenizer

    from proxy.media.processor import VisionProcessor, images_refusal

    signature = files_signature(folder)
    hf_tokenizer = AutoTokenizer.from_pretrained(str(folder))
    config = AutoConfig.from_pretrained(str(folder))
    return ModelFiles(hf_tokenizer, Tokenizer(hf_tokenizer), len(hf_tokenizer), config,
                      VisionProcessor.load(folder, config), images_refusal(config), signature)


class ModelFilesCache:
    """:class:`ModelFiles` by folder (its real path), at most ``max_models`` of them (least recently
    used forgotten first); thread-safe (one read at a time)."""

    def __init__(self, max_models: int = KEPT_MODELS) -> None:
        self.max_models = max_models
        self._files: OrderedDict[str, ModelFiles] = OrderedDict()
        self._lock = threading.Lock()
        self.num_reads = 0

    def get(self, folder: str | Path) -> ModelFiles:
        """``folder``'s files: the kept ones while its files are unchanged, else read now and kept.

        Raises:
            as :func:`read_model_files`.
        """
        key = os.path.realpath(folder)
        with self._lock:
            kept = self._files.get(key)
            if kept is not None and kept.signature == files_signature(key):
                self._files.move_to_end(key)
                return kept
            start = time.monotonic()
            files = read_model_files(key)
            self.num_reads += 1
            log.info("read the tokenizer and config of %s in %.2f s", key, time.monotonic() - start)
            self._files[key] = files
            self._files.move_to_end(key)
            while len(self._files) > self.max_models:
                self._files.popitem(last=False)
            return files

    def kept(self) -> list[str]:
        """The folders (real paths) whose files are kept, least recently used first."""
        with self._lock:
            return list(self._files)

    def preread(self, folders: Iterable[Path | None]) -> None:
        """Read the files of the first ``max_models`` folders given (None: skipped, a folder not
        there yet); a folder that cannot be read is skipped (its load says why)."""
        seen: list[str] = []
        for folder in folders:
            if folder is None or len(seen) >= self.max_models:
                continue
            key = os.path.realpath(folder)
            if key in seen:
                continue
            seen.append(key)
            try:
                self.get(key)
            except Exception as exc:  # noqa: BLE001 - the model's own load reports it
                log.debug("could not read %s ahead of its load: %s", key, exc)


MODEL_FILES = ModelFilesCache()
"""The process's kept model files (``proxy.engine.factory``'s engine-process clients read them here)."""
