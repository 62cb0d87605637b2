"""What crosses the pipe between the API process and the engine process.

Messages (tuples, first item the kind):

- parent -> child: ``("add", request_id, prompt_token_ids, params)``, ``("abort", [request_id, ...])``,
  ``("compile", token, StructuredOutputParams, param)``, ``("stop",)``.
- child -> parent: ``("progress", text)`` and one ``("ready", ReadyInfo)`` or ``("failed", text)``
  while loading; then ``("step", [RequestOutput, ...], counters)`` after every engine step and after
  commands that change the counters (an abort frees blocks), and ``("compiled", token, error)``
  (``error`` None, or ``(kind, message, param)``) when a compile finished.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Send = Callable[[tuple[Any, ...]], None]  # sends one message (under the sender's lock)


@dataclass(frozen=True)
class ReadyInfo:
    """What the child reports once its engine is built.

    Attributes:
        model_path: the Hugging Face folder it loaded (the API process loads the tokenizer from it).
        served_model_name: the model's id for clients.
        max_model_len: context length in tokens as the engine enforces it.
        eos_token_ids: the generation config's EOS ids (``LoadedModel.eos_token_ids``).
        logits_width: columns of the model's logits (grammar masks cover them all).
        dtype, quantization: as in ``ModelInfo``.
        load_s: seconds from the child's start to ready.
        omp_wait_policy: ``OMP_WAIT_POLICY`` in the child's environment ("": unset, libgomp's
            default; see ``proxy.engine.core_proc.child``).
    """

    model_path: str
    served_model_name: str
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    logits_width: int
    dtype: str
    quantization: str
    load_s: float
    omp_wait_policy: str


# counters sent with every "step" message: running, waiting, kv usage, free blocks, total blocks,
# preemptions, prefix-cache queries, prefix-cache hits, adds consumed so far
Counters = tuple[int, int, float, int, int, int, int, int, int]
NO_COUNTERS: Counters = (0, 0, 0.0, 0, 0, 0, 0, 0, 0)


def counters_of(core: Any, adds_seen: int) -> Counters:
    """The counters of ``core`` (an ``EngineCore``) for a "step" message; ``adds_seen``: adds taken."""
    return (core.num_running, core.num_waiting, core.kv_cache_usage, core.num_free_blocks,
            core.num_total_blocks, core.scheduler.num_preemptions, core.prefix_cache_queries,
            core.prefix_cache_hits, adds_seen)
