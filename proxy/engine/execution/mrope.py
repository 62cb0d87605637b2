"""The rotary positions of a step for a decoder with M-RoPE (Qwen2-VL, Qwen2.5-VL:
``proxy.models.vision.MROPE``), where they are not the tokens' cache positions.

M-RoPE rotates each query and key by three positions (temporal, height, width; ``mrope_section`` splits
the rotary frequencies between them). transformers' forward takes them as ``position_ids [3, 1, T]``; a
``[1, T]`` tensor is the same position in all three rows (``Qwen2VLTextModel.forward``). For one request:

- a text-only prompt: every row is the token's position, as for any decoder (nothing to do here);
- a prompt with images: its prompt tokens take the three rows of ``Qwen2VLModel.get_rope_index``
  (``proxy.models.vision.mrope_positions``), computed once per request at its first step and kept on
  it (``Request.rope_positions``, ``Request.rope_delta``), so a chunk, a prefix-cache hit or the
  recompute after a preemption takes exactly its slice;
- every token past such a prompt (decodes, recomputed outputs) takes its position plus the prompt's
  rope delta in all three rows, as ``generate()`` continues from the rope deltas.

Only prompt rows (always eager) need three rows; the compiled and graph decode paths get ``[1, T]``
positions with the delta added (``StepInputs.model_position_ids``). The KV slots, masks and row
plans keep the cache positions (``StepInputs.position_ids``).
"""

from __future__ import annotations

from typing import Any

import torch

from proxy.engine.execution.step_inputs import StepRows
from proxy.models.vision import mrope_positions


class MRope:
    """The rotary positions of an M-RoPE model's steps (module docstring).

    Args:
        model: the served model (its ``model.get_rope_index``).
    """

    def __init__(self, model: Any) -> None:
        self.model = model

    def positions(self, rows: StepRows, positions: torch.Tensor) -> torch.Tensor | None:
        """The rotary positions of a step whose tokens sit at the cache positions ``positions [T]``
        (int64): None when they are those, ``[1, T]`` when no row holds prompt tokens of a request with
        images (positions plus each request's rope delta), else ``[3, 1, T]`` (int64, CPU). Sets the
        rope positions of a request with images at its first step."""
        three = False
        for request, start in zip(rows.requests, rows.starts, strict=True):
            if request.images is not None and start < request.num_prompt_tokens:
                if request.rope_positions is None:
                    request.rope_positions, request.rope_delta = mrope_positions(
                        self.model, request.prompt_token_ids, request.images)
                three = True
        if not three and not any(r.rope_delta for r in rows.requests):
            return None
        deltas = torch.tensor([r.rope_delta for r in rows.requests], dtype=torch.long)
        shifted = positions + torch.repeat_interleave(deltas, torch.tensor(rows.counts, dtype=torch.long))
        if not three:
            return shifted.view(1, -1)
        out = shifted.view(1, -1).repeat(3, 1)  # [3, T]
        offset = 0
        for request, start, count in zip(rows.requests, rows.starts, rows.counts, strict=True):
            prompt = request.rope_positions
            if prompt is not None and start < request.num_prompt_tokens:
                end = min(start + count, request.num_prompt_tokens)  # later tokens keep position + delta
                out[:, offset: offset + end - start] = prompt[:, start:end]
            offset += count
        return out.view(3, 1, -1)
