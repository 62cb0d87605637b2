"""What compiled or verified results depend on: the code and the machine (:func:`runtime_inputs`),
and a model's shape (:func:`model_inputs`, for the compiled decode step).

:func:`runtime_inputs` is one part of the key of the remembered self-check
(:mod:`proxy.engine.selfcheck_record`) and of the saved compiled decode step
(:mod:`proxy.engine.execution.compiled_step`): a change of any of it makes both be done again.
"""

from __future__ import annotations

import hashlib
import json
import platform
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

_CODE_SUFFIXES = (".py", ".so", ".pyx")


@lru_cache(maxsize=1)
def code_hash() -> str:
    """SHA-256 (hex) over the relative paths and contents of the ``proxy`` package's code files."""
    root = Path(__file__).resolve().parents[2]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        if path.suffix in _CODE_SUFFIXES and path.is_file() and "__pycache__" not in path.parts:
            digest.update(str(path.relative_to(root)).encode())
            digest.update(b"\0")
            digest.update(path.read_bytes())
            digest.update(b"\0")
    return digest.hexdigest()


def runtime_inputs(execution: dict[str, Any]) -> dict[str, Any]:
    """The code and what it runs on: the ``proxy`` package's code hash, the Python, torch and
    transformers versions, torch's CPU capability, torch's thread count, and ``execution``, the
    engine's execution choice (``proxy.engine.execution.choice.ExecutionChoice.key``: the kernels chosen, the
    switches, the CPU flags and builds they were chosen from), JSON-serializable; also part of the
    compiled decode step's key."""
    import transformers

    return {
        "code_sha256": code_hash(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "execution": execution,
        "num_threads": torch.get_num_threads(),
    }


def model_inputs(model: torch.nn.Module) -> dict[str, Any]:
    """A loaded model's shape, not its weights: its config less ``_name_or_path`` (a moved or
    copied cache folder keeps its key), a hash of its module tree, and its parameters' and buffers'
    names, shapes and dtypes (JSON-serializable)."""
    config: Any = getattr(model, "config", None)
    values = None if config is None else config.to_dict()
    if values is not None:
        values.pop("_name_or_path", None)
    return {
        "config": json.dumps(values, sort_keys=True, default=str),
        "structure": hashlib.sha256(repr(model).encode()).hexdigest(),
        "tensors": [[n, list(t.shape), str(t.dtype)]
                    for n, t in (*model.named_parameters(), *model.named_buffers())],
    }

