"""A passed load-time self-check, remembered so that the next start with the same inputs skips it.

The self-check (:mod:`proxy.engine.selfcheck`) compares the engine's greedy ids with transformers'
``generate()``; its verdict depends only on the weights, the code that computes them, the library
versions, the hardware's kernels and the settings that change the numerics. :func:`self_check_key`
hashes all of those; :func:`check_at_load` skips the check when a record of a pass with that key
exists, else runs it and, only when it passed, writes the record (like vLLM's compile cache, keyed by
a hash of what the compiled result depends on). A failed check is never remembered, and a forced
check that fails deletes the record of an earlier pass under the same key.

Key inputs:

- weights: the name, size and ``st_mtime_ns`` of every file in the model folder, and of the GGUF
  file it was converted from (the default model's packed weights are read from the GGUF). A stat,
  not a content hash: hashing the default model's 540 MB folder + 97 MB GGUF costs about 1.5 s a
  start, a third of the time this saves on a fast start; a tool that rewrites a weight file changes
  its mtime (``make`` and ``pip``'s caches rely on the same).
- code: a SHA-256 of every ``.py``/``.so``/``.pyx`` file of the ``proxy`` package (any edit reruns).
- libraries and hardware: Python, torch and transformers versions, torch's CPU capability (the
  vectorized kernels' ISA), this project's CPU kernels in use (the Q8_0 kernel's ISA, whether the
  AMX int4 kernel serves), the CUDA device name where the weights are on CUDA, torch's thread count.
- the load's outcome: device, dtype, the quantization description, the served ``max_model_len``.
- settings: every ``Settings`` field except those that only shape the HTTP server
  (:data:`SERVER_ONLY_FIELDS`); a new field is part of the key until it is listed there.

Records are small JSON files ``<cache root>/self-check/<key>.json`` (cache root:
:func:`proxy.models.source.cache_root`), written to a temporary file and renamed into place.
``Settings.self_check``: None (default) skips on a matching record, True forces the check (and
rewrites the record), False skips it unchecked.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from proxy.engine.execution.choice import choose_execution
from proxy.engine.execution.runtime_key import runtime_inputs
from proxy.models.loaded import LoadedModel
from proxy.models.source import cache_root
from proxy.settings import Settings

logger = logging.getLogger(__name__)

RECORD_DIR = "self-check"
"""Folder of the records under the cache root."""
RECORD_VERSION = 1
"""Bumped when the record's meaning changes (every older record is then ignored)."""
SERVER_ONLY_FIELDS = frozenset({
    "served_model_name", "host", "port", "max_waiting", "api_keys", "allowed_origins",
    "keepalive_interval_s", "stream_headers_timeout_s", "max_body_bytes", "shutdown_grace_s",
    "cache_dir", "log_level", "self_check", "tool_call_parser", "ui",
    "extra_models", "models_dir", "models_file", "models_max", "model_ttl_s",
    "models_memory_bytes",
})
"""``Settings`` fields that cannot change the engine's greedy ids (left out of the key)."""


def _file_stamp(path: Path) -> list[Any]:
    st = path.stat()
    return [str(path.resolve()), st.st_size, st.st_mtime_ns]


def weights_stamp(loaded: LoadedModel) -> list[list[Any]]:
    """``[path, size, mtime_ns]`` of every regular file of the model folder and of its GGUF source.

    Raises:
        OSError: a file vanished between the listing and the stat.
    """
    folder = Path(loaded.model_path)
    files = sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith("."))
    if loaded.gguf_path:
        files.append(Path(loaded.gguf_path))
    return [_file_stamp(p) for p in files]


def key_inputs(loaded: LoadedModel, settings: Settings, max_model_len: int) -> dict[str, Any]:
    """Everything the self-check's verdict depends on, as JSON-serializable values (module docstring)."""
    device = torch.device(loaded.device)
    return {
        "record_version": RECORD_VERSION,
        "weights": weights_stamp(loaded),
        "mmproj": _file_stamp(Path(settings.mmproj).expanduser()) if settings.mmproj else None,
        **runtime_inputs(choose_execution(settings, device).key()),
        "cuda_device": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "device": str(device),
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "quantization": loaded.quantization,
        "max_model_len": max_model_len,
        "settings": {f.name: getattr(settings, f.name) for f in dataclasses.fields(settings)
                     if f.name not in SERVER_ONLY_FIELDS},
    }


def self_check_key(inputs: dict[str, Any]) -> str:
    """SHA-256 (hex) of :func:`key_inputs`' canonical JSON."""
    text = json.dumps(inputs, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def record_path(settings: Settings, key: str) -> Path:
    """Where the record of a pass under ``key`` lives."""
    return cache_root(settings) / RECORD_DIR / f"{key}.json"


def passed_before(path: Path, key: str) -> bool:
    """True when ``path`` holds a readable record of a pass under ``key`` (a damaged file: False)."""
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and record.get("key") == key and record.get("passed") is True


def remember_pass(path: Path, key: str, inputs: dict[str, Any], report: Any) -> None:
    """Write the record atomically (temporary file in the same folder, then ``os.replace``).

    A cache folder that cannot be written is logged and ignored (the next start checks again).
    """
    record = {"key": key, "passed": True, "passed_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "report": dataclasses.asdict(report), "inputs": inputs}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.stem[:16]}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(record, f, indent=1, sort_keys=True, default=str)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as exc:
        logger.warning("could not remember the passed self-check in %s: %s", path, exc)


def forget(path: Path) -> None:
    """Delete a record (a forced check under its key failed)."""
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:
        logger.warning("could not delete the self-check record %s: %s", path, exc)


def check_at_load(loaded: LoadedModel, settings: Settings, max_model_len: int) -> Any:
    """Run the load-time self-check unless ``settings.self_check`` is False or (None) a pass with the
    same key is recorded; record a pass. Returns the ``SelfCheckReport``, or None when skipped.

    Raises:
        proxy.engine.selfcheck.SelfCheckError: the check ran and failed (nothing is recorded).
    """
    from proxy.engine.selfcheck import SelfCheckError, run_self_check

    if settings.self_check is False:
        logger.warning("self-check off (--no-self-check): the engine's text is not verified "
                       "against generate()")
        return None
    start = time.monotonic()
    inputs = key_inputs(loaded, settings, max_model_len)
    key = self_check_key(inputs)
    path = record_path(settings, key)
    if settings.self_check is None and passed_before(path, key):
        logger.info("self-check passed earlier for these weights/settings (%s); skipped (%.2f s to tell; "
                    "--self-check forces it)", path, time.monotonic() - start)
        return None
    try:
        report = run_self_check(loaded.model, settings, max_model_len, vision=loaded.vision)
    except SelfCheckError:
        forget(path)
        raise
    remember_pass(path, key, inputs, report)
    return report

