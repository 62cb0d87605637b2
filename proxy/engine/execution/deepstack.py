"""DeepStack (Qwen3-VL: ``proxy.models.vision.DEEPSTACK``) in a step: after decoder layer ``i``, the hidden
states of the step's image placeholder positions take ``+=`` their DeepStack embedding of layer ``i``.

transformers does it in ``Qwen3VLTextModel.forward`` (``_deepstack_process``: ``hidden[mask] + embeds[i]``
for ``i`` below the number of DeepStack embeddings, the mask over every image position of the prompt),
but only from embeddings it computed from ``pixel_values`` in the same call. The engine's prompt rows
come as ``inputs_embeds`` (``proxy.engine.execution.image_embeds``), and a step holds rows of many
requests, a chunk perhaps part of an image, so the step adds them itself: :func:`deepstack_added`
hooks those decoder layers (``register_forward_hook``) for one forward pass only, with the step's
flat image positions and exactly their rows (``ImageSlots``), and removes the hooks when it ends.
Steps without image rows register nothing, so decode steps, the compiled step and CUDA graphs (traced
or captured without hooks) are untouched. The add is the same element-wise sum in the hidden states'
dtype as transformers', so a chunk boundary inside an image changes nothing.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch


@contextmanager
def deepstack_added(layers: Sequence[torch.nn.Module], flat_index: torch.Tensor,
                    embeds: torch.Tensor) -> Iterator[None]:
    """While the block runs, the output of ``layers[i]`` (``[1, T, hidden]``) takes ``embeds[:, i]``
    added at the flat token indices ``flat_index``.

    Args:
        layers: the decoder layers that take DeepStack embeddings, first to last
            (``proxy.models.vision.deepstack_layers``).
        flat_index: ``[K]`` int64, the step's image positions (any device; moved to the outputs').
        embeds: ``[K, len(layers), hidden]``, each position's DeepStack embeddings (cast to the
            hidden states' dtype and device, as ``_deepstack_process`` casts them).

    Raises:
        ValueError: ``embeds`` has another number of layers than ``layers``.
    """
    if embeds.shape[1] != len(layers):
        raise ValueError(f"{embeds.shape[1]} DeepStack embeddings per position for {len(layers)} layers")
    handles = [layer.register_forward_hook(_adder(flat_index, embeds[:, i]))
               for i, layer in enumerate(layers)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _adder(flat_index: torch.Tensor, rows: torch.Tensor) -> Any:
    """A forward hook adding ``rows [K, hidden]`` to its layer's output at ``flat_index`` (in place:
    the output is the layer's own fresh residual sum, under inference mode)."""

    def hook(_module: torch.nn.Module, _args: Any, output: Any) -> Any:
        hidden = output[0] if isinstance(output, tuple) else output
        index = flat_index.to(hidden.device)
        hidden[0, index] = hidden[0, index] + rows.to(hidden.device, hidden.dtype)
        return output

    return hook
