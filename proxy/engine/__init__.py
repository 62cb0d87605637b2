"""The continuous-batching engine (see ``../../docs/internals.md``, engine section).

Torch-free names (``Request``, ``RequestOutput``, ``TokenLogprob``, ``BlockManager``, ``Scheduler``)
import eagerly; the torch side (``EngineCore``, ``AsyncEngine``, ``ModelRunner``, ``Sampler``) is
imported on first access, so ``proxy.engine.scheduler`` and ``proxy.engine.block_manager`` stay
usable without loading torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from proxy.engine.block_manager import BlockManager
from proxy.engine.request import Request, RequestOutput, RequestStatus, TokenLogprob
from proxy.engine.scheduler import Scheduler, SchedulerOutput

if TYPE_CHECKING:
    from proxy.engine.async_engine import AsyncEngine
    from proxy.engine.core import EngineCore
    from proxy.engine.execution.model_runner import ModelRunner
    from proxy.engine.execution.sampler import Sampler

_LAZY = {
    "EngineCore": "proxy.engine.core",
    "AsyncEngine": "proxy.engine.async_engine",
    "ModelRunner": "proxy.engine.execution.model_runner",
    "Sampler": "proxy.engine.execution.sampler",
}

__all__ = [
    "AsyncEngine",
    "BlockManager",
    "EngineCore",
    "ModelRunner",
    "Request",
    "RequestOutput",
    "RequestStatus",
    "Sampler",
    "Scheduler",
    "SchedulerOutput",
    "TokenLogprob",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'proxy.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
