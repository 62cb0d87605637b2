"""The engine's model loader, and the one assembly of a served engine (:func:`build_core`).

The loader: :func:`proxy.models.load_model` with the paged attention registered, the
paged engine's architecture rules (``proxy.engine.execution.architectures``) checked on the config before the
weights load, and the linears built for the execution plan's kernels (``proxy.engine.execution.choice``). The
engine side owns all three, so ``proxy.models`` never imports the engine.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from proxy.engine.execution.architectures import check_supported
from proxy.engine.execution.attention import register as register_paged_attention
from proxy.engine.execution.choice import ExecutionChoice, choose_execution
from proxy.models import LoadedModel, load_model
from proxy.models.device import resolve_device
from proxy.settings import Settings

logger = logging.getLogger(__name__)
MIB = 1 << 20

if TYPE_CHECKING:
    from proxy.engine.core import EngineCore
    from proxy.engine.structured import GrammarCompiler
    from proxy.tokenizer import Tokenizer


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
            refuses (``proxy.engine.execution.architectures.check_supported``).
    """
    choice = choose_for(settings) if choice is None else choice
    return load_model(settings, attn_implementation=register_paged_attention(),
                      check_config=check_supported, kernels=choice.linears)


@dataclass
class BuiltEngine:
    """A served engine as :func:`build_core` assembles it.

    Attributes:
        loaded: the model as loaded (weights, tokenizer, context length, EOS ids, dtype, quantization).
        core: the engine core over it (``core.max_model_len`` is the context in force).
        tokenizer: the request pipeline's tokenizer (the generation config's EOS ids joined).
        grammar_compiler: compiles constrained requests' grammars over every logit column.
        num_logits: the model's logits width (may exceed the tokenizer's vocabulary).
    """

    loaded: LoadedModel
    core: EngineCore
    tokenizer: Tokenizer
    grammar_compiler: GrammarCompiler
    num_logits: int


def build_core(settings: Settings, progress: Callable[[str], None] | None = None) -> BuiltEngine:
    """The one assembly of a served engine, in this process or the engine process: choose what runs
    (:func:`choose_for`), load the model for it, build the tokenizer, the grammar compiler and the
    :class:`~proxy.engine.core.EngineCore` with that choice, run the self-check against
    ``generate()`` or find its recorded pass (``proxy.engine.selfcheck_record``; a warning when
    ``settings.self_check`` is False), then freeze the heap (``proxy.heap``) and trim the load's freed
    temporaries. ``progress`` is told each stage (the engine process reports them to the API process).

    Raises:
        proxy.models.ModelLoadError: the model cannot be resolved or loaded, or its architecture is
            refused.
        proxy.engine.selfcheck.SelfCheckError: the self-check found a difference.
    """
    from proxy.engine.core import EngineCore
    from proxy.engine.selfcheck_record import check_at_load
    from proxy.engine.structured import GrammarCompiler, logits_width
    from proxy.heap import freeze_heap, peak_rss_bytes
    from proxy.quant.apply import trim_heap
    from proxy.tokenizer import Tokenizer

    tell = progress or (lambda stage: None)
    start = time.monotonic()
    tell("loading the model")
    choice = choose_for(settings)  # what runs, chosen once before the model loads
    loaded = load_engine_model(settings, choice)
    tokenizer = Tokenizer(loaded.hf_tokenizer, generation_eos_ids=loaded.eos_token_ids)
    loaded_at = f"model loaded in {time.monotonic() - start:.1f} s, peak RSS {peak_rss_bytes() / MIB:.0f} MiB"
    logger.info("%s (the load's high-water mark)", loaded_at)
    tell(f"{loaded_at}; building the engine (KV cache)")
    num_logits = logits_width(loaded.model)  # the masks must cover every logit column
    compiler = GrammarCompiler(loaded.hf_tokenizer, num_logits, tokenizer.eos_token_ids)
    core = EngineCore(loaded.model, settings, tokenizer.eos_token_ids, loaded.max_model_len,
                      grammar_compiler=compiler, choice=choice)
    if settings.self_check is not False:
        tell("self-check against generate() (or its recorded pass)")
    check_at_load(loaded, settings, core.max_model_len)  # refuse a model served wrong text
    freeze_heap()  # the loaded engine's objects out of the collector's full passes (proxy.heap)
    trim_heap()  # the load's and the self-check's freed temporaries (1279 -> 1161 MiB measured)
    logger.info("engine built in %.1f s; peak RSS of the start %.0f MiB (its high-water mark: load, KV "
                "pool, self-check)", time.monotonic() - start, peak_rss_bytes() / MIB)
    return BuiltEngine(loaded, core, tokenizer, compiler, num_logits)
