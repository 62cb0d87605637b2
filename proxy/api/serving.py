"""The default engine factory: ``Settings`` -> loaded model -> ``EngineCore`` -> ``AsyncEngine``.

Runs in a worker thread at startup (see ``app.create_app``); imports torch through the engine.
"""

from __future__ import annotations

from proxy.settings import Settings

from .routes import ServingModel


def build_serving_model(settings: Settings) -> ServingModel:
    """Load ``settings.model`` (HF folder, GGUF file or the default model) behind an ``AsyncEngine``.

    The engine is not started: ``AsyncEngine.start()`` must run on the event loop.
    """
    from proxy.engine.async_engine import AsyncEngine
    from proxy.engine.core import EngineCore
    from proxy.models import load_model
    from proxy.tokenizer import Tokenizer

    loaded = load_model(settings)
    tokenizer = Tokenizer(loaded.hf_tokenizer)
    core = EngineCore(loaded.model, settings, loaded.eos_token_ids, loaded.max_model_len)
    engine = AsyncEngine(core, settings.max_waiting)
    return ServingModel(
        engine=engine,
        tokenizer=tokenizer,
        served_model_name=loaded.served_model_name,
        max_model_len=core.max_model_len,  # lowered to the KV pool's capacity if smaller
        vocab_size=len(loaded.hf_tokenizer),
        core=core,
    )
