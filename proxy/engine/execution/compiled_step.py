"""Pure-decode steps on the CPU through one ahead-of-time compiled graph, kept on disk between starts.

The decode forward (:func:`proxy.engine.execution.traced_decode.decode_forward`: embedding, every decoder
layer with the paged attention, the final norm and the lm_head) is compiled once by
``torch.compile(fullgraph=True)`` (inductor's CPU backend fuses the casts, norms, RoPE, SiLU-mul and
residual adds around the packed matmul kernels, which stay opaque custom ops) with dynamo's
ahead-of-time API (``.aot_compile``), as vLLM's ``VLLM_USE_AOT_COMPILE`` does. Three choices make
it cheap enough to be on by default:

- **One graph for every step.** The step's row count ``B`` and key length ``L`` are dynamic
  dimensions (``torch._dynamo.mark_dynamic``; traced size-obliviously, so ``B = 1`` runs the same
  graph), as are the KV pools' slot counts (the self-check's small pool and the served one share the
  graph). No padded batch sizes and no key buckets: the step's own metadata tensors go in, with the
  keys padded to a multiple of ``KEY_PAD`` as in eager steps, so the batch invariance of the padded
  attention holds.
- **No guards at run time.** The graph is called only for what it was traced for (pure-decode steps
  of this model, int64 CPU metadata, a key mask always present), which :meth:`ModelRunner.execute`
  guarantees; dynamo's guard evaluation (~0.1 ms a call over every parameter) is skipped
  (``disable_guard_check``). Layers with sliding windows or attention chunks choose their mask by
  comparing the window with ``L`` in Python, a branch a guard-free graph would freeze: such models
  run eager (:func:`supported`).
- **No Python between kernels.** Inductor writes the graph's wrapper in C++ (``cpp_wrapper``), which
  calls the generated kernels and the packed matmul ops without a Python statement between them.
- **Compiled once per machine.** The compiled function is saved (``save_compiled_function``) under
  ``<cache root>/compiled-decode/<key>.pt2``, the key a hash of everything the code depends on
  (:func:`artifact_key`); a later start loads it in about two seconds instead of compiling again.
  The shared libraries inductor built stay in its cache folder, which is set to
  ``<cache root>/inductor`` (``TORCHINDUCTOR_CACHE_DIR``, when not set already): in ``/tmp`` they
  would vanish with it, and loading would rebuild them (about a minute).

A failed compile or load is logged with its reason, and steps run eager.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import weakref
from pathlib import Path
from typing import Any

import torch

from proxy.engine.execution.attention import KEY_PAD, LayerSpec, PagedAttentionMetadata, PagedKVCache
from proxy.engine.execution.decode_graphs import padded_step_inputs
from proxy.engine.execution.runtime_key import model_inputs, runtime_inputs
from proxy.engine.execution.traced_decode import decode_forward
from proxy.settings import Settings

logger = logging.getLogger(__name__)

ARTIFACT_DIR = "compiled-decode"
"""Folder of the saved compiled functions under the cache root."""
INDUCTOR_DIR = "inductor"
"""Inductor's cache folder (``TORCHINDUCTOR_CACHE_DIR``) under the cache root, unless set already."""
ARTIFACT_VERSION = 1
"""Bumped when what is saved changes meaning (every older file is then ignored)."""
TRACE_ROWS, TRACE_KEYS = 2, 128
"""The example step traced (its sizes become symbols; dynamo would fix a size of 1 as a constant)."""

#: one compiled step per model object, shared by every runner over it (the self-check's engine and
#: the served one): compiled functions take the model and the pools as arguments.
_BY_MODEL: weakref.WeakKeyDictionary[torch.nn.Module, CompiledDecodeStep] = weakref.WeakKeyDictionary()


def supported(layers: list[LayerSpec]) -> str | None:
    """None when the compiled step serves a model with these layers, else the reason it does not."""
    for spec in layers:
        if spec.pattern != (None, None):
            return "a layer has a sliding window or attention chunks (the mask depends on the key length)"
    return None


def why_not_compiled_by(settings: Settings) -> str | None:
    """The settings' part of :func:`why_not_compiled` (known before a model is loaded):
    ``settings.enforce_eager`` or ``settings.compile_decode`` False."""
    if settings.enforce_eager:
        return "--enforce-eager"
    if settings.compile_decode is False:
        return "--no-compile-decode"
    return None


def why_not_compiled(settings: Settings, model: torch.nn.Module, layers: list[LayerSpec]) -> str | None:
    """None when a CPU model's decode steps run compiled, else why not: :func:`why_not_compiled_by`
    the settings, or ``settings.compile_decode`` None (the default) and the model has no packed CPU
    linears (int4 / int8 codes, where transformers' small ops are most of a step), or layers
    :func:`supported` refuses."""
    from proxy.quant.int8_linear import Int8Linear
    from proxy.quant.linear import PackedLinear

    reason = why_not_compiled_by(settings)
    if reason is not None:
        return reason
    if settings.compile_decode is None and not any(isinstance(m, (PackedLinear, Int8Linear))
                                                   for m in model.modules()):
        return "off by default for dense models (--compile-decode turns it on)"
    return supported(layers)


def compile_decode_wanted(settings: Settings, model: torch.nn.Module, layers: list[LayerSpec]) -> bool:
    """Whether a CPU model's decode steps run compiled (:func:`why_not_compiled` says no reason); a
    model whose layers :func:`supported` refuses is logged."""
    reason = why_not_compiled(settings, model, layers)
    if reason is not None and reason == supported(layers):
        logger.info("decode steps run eager: %s", reason)
    return reason is None


def artifact_key(model: torch.nn.Module, execution: dict[str, Any]) -> str:
    """SHA-256 (hex) over what the compiled code depends on: the model's config (norm epsilons and
    RoPE constants are written into the code), its modules, and its parameters' and buffers' names,
    shapes and dtypes (the weights themselves are inputs of the graph, not part of it); the
    ``proxy`` package's code; the Python, torch and transformers versions; torch's CPU capability;
    torch's thread count (inductor writes it into its OpenMP loops); ``execution``, the engine's
    execution choice (``ExecutionChoice.key``: kernels, switches, CPU flags, builds), so that another
    choice never loads this one's step."""
    inputs = {"version": ARTIFACT_VERSION, **model_inputs(model), **runtime_inputs(execution)}
    text = json.dumps(inputs, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


class CompiledDecodeStep:
    """The compiled decode forward of one model (see the module docstring).

    Call it with the step's CPU metadata; it returns logits ``[B, V]`` in the model's dtype.
    """

    def __init__(self, fn: Any, model: torch.nn.Module, source: str, seconds: float) -> None:
        self._fn = fn
        self._model = weakref.ref(model)
        #: "compiled" or "loaded", and how long it took (seconds)
        self.source = source
        self.seconds = seconds
        self.num_calls = 0

    def __call__(self, kv_cache: PagedKVCache, num_groups: int, input_ids: torch.Tensor,
                 position_ids: torch.Tensor, meta: PagedAttentionMetadata) -> torch.Tensor | None:
        """Logits ``[B, V]`` of a pure-decode step (``meta.num_decodes == B``, no prefill rows), or
        None when the call raised (logged once; the step is dropped for this model: run eager)."""
        model = self._model()
        assert model is not None and meta.decode_gather is not None and meta.decode_context_lens is not None
        mask = meta.decode_mask
        if mask is None:  # the eager path drops an all-visible mask; the graph always takes one
            mask = torch.ones((input_ids.shape[1], 1, 1, meta.decode_gather.shape[1]), dtype=torch.bool)
        self.num_calls += 1
        try:
            with torch.no_grad():
                out: torch.Tensor = self._fn(model, kv_cache, num_groups, input_ids, position_ids,
                                             meta.slot_mapping, meta.decode_gather,
                                             meta.decode_context_lens, mask)
        except Exception as exc:
            logger.warning("the compiled decode step failed (%s: %s); decode steps run eager from now on",
                           type(exc).__name__, exc, exc_info=True)
            forget(model)
            return None
        return out


def _example_args(model: torch.nn.Module, kv_cache: PagedKVCache, num_groups: int) -> tuple[Any, ...]:
    """A traced step of :data:`TRACE_ROWS` padded rows (all on the scratch slot), its dynamic dims marked."""
    ids, pos, slots, gather, ctx, mask = padded_step_inputs(kv_cache.scratch_slot, TRACE_ROWS, TRACE_KEYS)
    for t in (ids, pos):
        torch._dynamo.mark_dynamic(t, 1)
    for t in (slots, gather, ctx, mask):
        torch._dynamo.mark_dynamic(t, 0)
    torch._dynamo.mark_dynamic(gather, 1)
    torch._dynamo.mark_dynamic(mask, 3)
    for pool in (*kv_cache.key_pools, *kv_cache.value_pools):
        torch._dynamo.mark_dynamic(pool, 0)
    return (model, kv_cache, num_groups, ids, pos, slots, gather, ctx, mask)


def _compile(args: tuple[Any, ...]) -> Any:
    """``decode_forward`` compiled ahead of time over ``args`` (no guards kept: see the module docstring)."""
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config
    import torch.fx.experimental._config as fx_config

    compiled: Any = torch.compile(decode_forward, fullgraph=True,
                                  options={"guard_filter_fn": torch.compiler.skip_all_guards_unsafe})
    # only the marked dimensions are dynamic: an earlier compile of another model in this process
    # must not turn this one's constants (the GQA group) into symbols; casts round as eager's do
    # (fused intermediates stay closer to the eager forward the prompt tokens take)
    oblivious = fx_config.patch(backed_size_oblivious=True)  # type: ignore[attr-defined]
    with torch.no_grad(), oblivious, dynamo_config.patch(automatic_dynamic_shapes=False), \
            inductor_config.patch(emulate_precision_casts=True, cpp_wrapper=True):
        return compiled.aot_compile((args, {}))


def compiled_decode_step(
    model: torch.nn.Module, kv_cache: PagedKVCache, num_groups: int, cache_dir: Path | None,
    execution: dict[str, Any],
) -> CompiledDecodeStep | None:
    """The model's compiled decode step: the one already made for this model object, else loaded
    from ``cache_dir`` (a file saved under :func:`artifact_key` of the model and ``execution``, the
    engine's ``ExecutionChoice.key``), else compiled now (logged with its time) and saved there.
    ``cache_dir`` None: compiled, not saved.

    Returns:
        the step, or None (logged with the reason) when compiling or loading fails: run eager.
    """
    step = _BY_MODEL.get(model)
    if step is not None:
        return step
    start = time.monotonic()
    if cache_dir is not None:
        _keep_inductor_cache_beside(cache_dir.parent / INDUCTOR_DIR)
    path = cache_dir / f"{artifact_key(model, execution)}.pt2" if cache_dir is not None else None
    external = {"model": model, "kv_cache": kv_cache}
    fn: Any = None
    source = "loaded"
    if path is not None and path.is_file():
        try:
            with open(path, "rb") as f:
                fn = torch.compiler.load_compiled_function(f, external_data=external)
            fn.disable_guard_check()
            _smoke_test(fn, model, kv_cache, num_groups)
        except Exception as exc:  # noqa: BLE001 - a stale, damaged or foreign file: compile again
            logger.warning("could not load the compiled decode step %s (%s: %s); compiling it again",
                           path, type(exc).__name__, exc)
            fn = None
    saved = False
    if fn is None:
        source = "compiled"
        logger.info("compiling the decode step with torch.compile (once per machine and model; "
                    "--enforce-eager skips it)")
        try:
            fn = _compile(_example_args(model, kv_cache, num_groups))
            fn.disable_guard_check()
            _smoke_test(fn, model, kv_cache, num_groups)
        except Exception as exc:
            logger.warning("compiling the decode step failed (%s: %s); decode steps run eager",
                           type(exc).__name__, exc, exc_info=logger.isEnabledFor(logging.DEBUG))
            return None
        saved = path is not None and _save(fn, path, external)
    step = CompiledDecodeStep(fn, model, source, time.monotonic() - start)
    where = f" ({path})" if source == "loaded" or saved else " (not saved)"
    logger.info("decode step %s in %.1f s%s", source, step.seconds, where)
    _BY_MODEL[model] = step
    return step


def _keep_inductor_cache_beside(folder: Path) -> None:
    """Point inductor's cache at ``folder`` unless ``TORCHINDUCTOR_CACHE_DIR`` names another place
    than inductor's default (importing ``torch._inductor`` sets the variable to that default in
    ``/tmp``; inductor reads it again at every use)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or os.path.abspath(current) == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)


def _smoke_test(fn: Any, model: torch.nn.Module, kv_cache: PagedKVCache, num_groups: int) -> None:
    """Run ``fn`` once on a padded one-row step (it writes and reads only the scratch slot).

    Raises:
        Exception: whatever the call raises (a file compiled for another model), or RuntimeError
            when the logits are not ``[1, V]`` and finite.
    """
    ids, pos, slots, gather, ctx, mask = padded_step_inputs(kv_cache.scratch_slot, 1, KEY_PAD)
    with torch.no_grad():
        logits = fn(model, kv_cache, num_groups, ids, pos, slots, gather, ctx, mask)
    if logits.dim() != 2 or logits.shape[0] != 1 or not bool(torch.isfinite(logits).all()):
        raise RuntimeError(f"the compiled step gave logits of shape {tuple(logits.shape)}, or not finite")


def _save(fn: Any, path: Path, external: dict[str, Any]) -> bool:
    """Save ``fn`` atomically at ``path``; False (logged) when the cache folder cannot be written."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fn.save_compiled_function(str(path), external_data=external)
    except Exception as exc:  # noqa: BLE001 - the next start compiles again
        logger.warning("could not save the compiled decode step to %s (%s: %s)",
                       path, type(exc).__name__, exc)
        return False
    return True


def forget(model: torch.nn.Module) -> None:
    """Drop the in-process compiled step of ``model`` (tests: the next runner loads or compiles again)."""
    _BY_MODEL.pop(model, None)

