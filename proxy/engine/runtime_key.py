"""What compiled or verified results depend on beyond the model: the code and the machine.

:func:`runtime_inputs` is one part of the key of the remembered self-check
(:mod:`proxy.engine.selfcheck_record`) and of the saved compiled decode step
(:mod:`proxy.engine.compiled_step`): a change of any of it makes both be done again.
"""

from __future__ import annotations

import hashlib
import platform
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from proxy.quant import amx_int4, int8_linear

_CODE_SUFFIXES = (".py", ".so", ".pyx")


@lru_cache(maxsize=1)
def code_hash() -> str:
    """SHA-256 (hex) over the relative paths and contents of the ``proxy`` package's code files."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        if path.suffix in _CODE_SUFFIXES and path.is_file() and "__pycache__" not in path.parts:
            digest.update(str(path.relative_to(root)).encode())
            digest.update(b"\0")
            digest.update(path.read_bytes())
            digest.update(b"\0")
    return digest.hexdigest()


def runtime_inputs() -> dict[str, Any]:
    """The code and what it runs on: the ``proxy`` package's code hash, the Python, torch and
    transformers versions, torch's CPU capability, this project's CPU kernels in use and torch's
    thread count (JSON-serializable; also part of the compiled decode step's key)."""
    import transformers

    return {
        "code_sha256": code_hash(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_kernels": {"q8_isa": int8_linear.KERNEL_ISA, "amx_int4": amx_int4.in_use()},
        "num_threads": torch.get_num_threads(),
    }
