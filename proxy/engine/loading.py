"""The engine's model loader: :func:`proxy.models.load_model` with the paged attention registered, the
paged engine's architecture rules (``proxy.engine.architectures``) checked on the config before the
weights load, and the linears built for the execution plan's kernels (``proxy.engine.choice``). The
engine side owns all three, so ``proxy.models`` never imports the engine.
"""

from __future__ import annotations

from proxy.engine.architectures import check_supported
from proxy.engine.attention import register as register_paged_attention
from proxy.engine.choice import ExecutionChoice, choose_execution
from proxy.models import LoadedModel, load_model
from proxy.models.device import resolve_device
from proxy.settings import Settings


def choose_for(settings: Settings) -> ExecutionChoice:
    """The :class:`ExecutionChoice` of an engine serving ``settings`` (on ``settings.device``).

    Raises:
        proxy.models.ModelLoadError: CUDA requested but unavailable.
    """
    return choose_execution(settings, resolve_device(settings))


def load_engine_model(settings: Settings, choice: ExecutionChoice | None = None) -> LoadedModel:
    """Load ``settings.model`` for the paged engine, its linears built for ``choice``'s kernels
    (default :func:`choose_for` ``settings``; every other rule: ``proxy.models.load``).

    Raises:
        proxy.models.ModelLoadError: not found, not convertible, or an architecture the paged engine
            refuses (``proxy.engine.architectures.check_supported``).
    """
    choice = choose_for(settings) if choice is None else choice
    return load_model(settings, attn_implementation=register_paged_attention(),
                      check_config=check_supported, kernels=choice.linears)
