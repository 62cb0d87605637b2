"""How a step's tokens past their prompts run: one :class:`DecodeRunner` object, chosen once when the
model runner is built and replaced (never branched on) when its path fails.

- :class:`EagerDecode`: every row through the eager forward (``ModelRunner.forward_inputs``).
- :class:`CudaGraphDecode`: a pure-decode step replays a captured graph
  (``proxy.engine.execution.decode_graphs``) where one has its shape; other steps run eager.
- :class:`CompiledDecode`: every row past its prompt (decodes, and the output tokens a preempted
  request recomputes) through the CPU's ahead-of-time compiled step
  (``proxy.engine.execution.compiled_step``),
  one token a row; prompt rows run eager beside them. The scheduler never mixes prompt and output
  tokens in one chunk (``SchedulerConfig.outputs_on_decode_path``), so every generated token's K/V
  and logits come from the same kernels whatever the load.

The model takes ``StepInputs.model_position_ids``: an M-RoPE model's rotary positions
(``proxy.engine.execution.mrope``) are one row past a prompt (the compiled step's rows, every decode
row but a prompt's last token); a step with three rows (an image prompt's tokens) runs eager.

A compiled call that fails returns None (the step logged it: "decode steps run eager from now
on"); the model runner then puts an :class:`EagerDecode` in its place and runs the step again.
nano-vllm makes the same eager / graph choice with one ``if`` (``engine/model_runner.py``); vLLM
names its modes in ``CompilationConfig`` / ``CUDAGraphMode``.
"""

from __future__ import annotations

from typing import Protocol

import torch

from proxy.engine.execution.attention import PagedKVCache
from proxy.engine.execution.compiled_step import CompiledDecodeStep
from proxy.engine.execution.decode_graphs import DecodeGraphRunner
from proxy.engine.execution.step_inputs import StepInputs, StepRows


class ModelRunner(Protocol):
    """What a decode runner uses of ``proxy.engine.execution.model_runner.ModelRunner``."""

    device: torch.device
    kv_cache: PagedKVCache
    num_groups: int

    def build_inputs(self, rows: StepRows) -> StepInputs:
        """The CPU inputs of a forward pass over ``rows``."""
        ...

    def forward_inputs(self, inputs: StepInputs) -> torch.Tensor:
        """Logits ``[S, V]`` float32 of ``inputs`` through the eager forward."""
        ...


class DecodeRunner(Protocol):
    """One way of running a step (module docstring)."""

    #: the plan's step name: ``"eager"``, ``"cuda_graphs"`` or ``"compiled"``
    kind: str

    def execute(self, runner: ModelRunner, rows: StepRows) -> torch.Tensor | None:
        """Logits ``[S, V]`` float32 on the model's device, one row per ``rows.sample_indices``
        (S may be 0); None when this path failed for good (the caller replaces it)."""
        ...


class EagerDecode:
    """Every row through the eager forward."""

    kind = "eager"

    def execute(self, runner: ModelRunner, rows: StepRows) -> torch.Tensor:
        """:class:`DecodeRunner.execute` (never None)."""
        return runner.forward_inputs(runner.build_inputs(rows))


class CudaGraphDecode:
    """Pure-decode steps through captured graphs, others eager.

    Args:
        graphs: the captured-graph runner (one graph per padded batch size and key bucket).
    """

    kind = "cuda_graphs"

    def __init__(self, graphs: DecodeGraphRunner) -> None:
        self.graphs = graphs

    def execute(self, runner: ModelRunner, rows: StepRows) -> torch.Tensor:
        """:class:`DecodeRunner.execute` (never None: a shape without a graph runs eager)."""
        inputs = runner.build_inputs(rows)
        meta = inputs.meta
        positions = inputs.model_position_ids
        # a one-token prompt chunk at an image placeholder runs eager (the graphs take token ids), and
        # so does a row with M-RoPE's three position rows
        if (meta.num_decodes == len(rows.requests) and meta.row_plan is None and positions.dim() == 2
                and inputs.image_slots is None):
            logits = self.graphs.run(inputs.input_ids, positions, meta)
            if logits is not None:  # sampling rows selected outside the graph (a copy)
                return logits.index_select(0, inputs.logits_index.to(runner.device)).float()
        return runner.forward_inputs(inputs)


class CompiledDecode:
    """Rows past their prompts through the compiled step, prompt rows eager (module docstring).

    Args:
        step: the model's compiled decode step.
    """

    kind = "compiled"

    def __init__(self, step: CompiledDecodeStep) -> None:
        self.step = step

    def execute(self, runner: ModelRunner, rows: StepRows) -> torch.Tensor | None:
        """:class:`DecodeRunner.execute`; None when the compiled call failed."""
        on_step = [i for i, r in enumerate(rows.requests) if not r.is_in_prompt]
        if not on_step:
            return runner.forward_inputs(runner.build_inputs(rows))
        every = len(on_step) == len(rows.requests)
        compiled = self._compiled(runner, rows if every else rows.select(on_step))
        if compiled is None or every:
            return compiled
        taken = set(on_step)
        eager = runner.forward_inputs(runner.build_inputs(
            rows.select([i for i in range(len(rows.requests)) if i not in taken])))
        is_compiled = torch.tensor([i in taken for i in rows.sample_indices], dtype=torch.bool)
        logits = torch.empty((len(rows.sample_indices), compiled.shape[1]), dtype=compiled.dtype,
                             device=compiled.device)
        logits[is_compiled] = compiled
        logits[~is_compiled] = eager
        return logits

    def _compiled(self, runner: ModelRunner, rows: StepRows) -> torch.Tensor | None:
        """Logits ``[S, V]`` float32 of ``rows`` (all past their prompts), one token a row; None
        when the call failed."""
        split, sampled = rows.one_token_rows()
        inputs = runner.build_inputs(split)
        logits = self.step(runner.kv_cache, runner.num_groups, inputs.input_ids, inputs.model_position_ids,
                           inputs.meta)
        if logits is None:
            return None
        if len(sampled) != len(split.counts):  # some rows feed a token without sampling
            logits = logits.index_select(0, torch.tensor(sampled, dtype=torch.long))
        return logits.float()
