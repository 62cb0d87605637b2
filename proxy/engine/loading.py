"""The engine's model loader: :func:`proxy.models.load_model` with the paged attention registered and
the paged engine's architecture rules (``proxy.engine.architectures``) checked on the config before
the weights load. The engine side owns both, so ``proxy.models`` never imports the engine.
"""

from __future__ import annotations

from proxy.engine.architectures import check_supported
from proxy.engine.attention import register as register_paged_attention
from proxy.models import LoadedModel, load_model
from proxy.settings import Settings


def load_engine_model(settings: Settings) -> LoadedModel:
    """Load ``settings.model`` for the paged engine (every other rule: ``proxy.models.load``).

    Raises:
        proxy.models.ModelLoadError: not found, not convertible, or an architecture the paged engine
            refuses (``proxy.engine.architectures.check_supported``).
    """
    return load_model(settings, attn_implementation=register_paged_attention(),
                      check_config=check_supported)
