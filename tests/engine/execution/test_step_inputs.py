"""A step's rows flattened into model inputs (``proxy.engine.execution.step_inputs``): a chunk of one request
and the same tokens as one-token rows write the same slots at the same positions; each one-token
row attends as a decode row over the keys up to its own position."""

from __future__ import annotations

import torch

from proxy.engine.execution.attention import KEY_PAD, LayerSpec, PagedKVCache
from proxy.engine.execution.step_inputs import StepRows, build_step_inputs
from proxy.engine.request import Request
from proxy.sampling import SamplingParams


def _cache() -> PagedKVCache:
    spec = LayerSpec(num_heads=2, num_kv_heads=1, key_dim=4, value_dim=4)
    return PagedKVCache([spec], num_blocks=8, block_size=4, dtype=torch.float32, device=torch.device("cpu"))


def test_a_chunk_as_one_token_rows() -> None:
    done = Request("a", list(range(10, 16)), SamplingParams())
    for t in (20, 21, 22, 23):
        done.append_token(t)
    done.block_ids = [5, 2, 7]
    other = Request("b", [1, 2, 3], SamplingParams())
    other.append_token(9)
    other.block_ids = [1]
    # b decodes its token at position 3; a recomputes its outputs at positions 6..9, sampling at 9
    rows = StepRows([other, done], [3, 6], [1, 4], [0, 1], 1)
    chunk = build_step_inputs(rows, _cache(), 4, 2)
    split, sampled = rows.one_token_rows()
    assert (split.requests, split.starts, split.num_decodes) == ([other] + [done] * 4, [3, 6, 7, 8, 9], 5)
    assert sampled == [0, 4]
    one = build_step_inputs(split, _cache(), 4, 2)
    for field in ("input_ids", "position_ids"):
        assert torch.equal(getattr(one, field), getattr(chunk, field))
    assert torch.equal(one.meta.slot_mapping, chunk.meta.slot_mapping)
    assert one.meta.slot_mapping.tolist() == [1 * 4 + 3, 2 * 4 + 2, 2 * 4 + 3, 7 * 4 + 0, 7 * 4 + 1]
    assert one.input_ids.tolist() == [[9, 20, 21, 22, 23]] and one.position_ids.tolist() == [[3, 6, 7, 8, 9]]
    assert one.meta.decode_context_lens.tolist() == [4, 7, 8, 9, 10]
    assert one.meta.decode_gather.shape == (5, KEY_PAD)
    assert one.meta.decode_gather[4, :10].tolist() == [20, 21, 22, 23, 8, 9, 10, 11, 28, 29]
    assert one.prompt_tokens is None and chunk.prompt_tokens is None
    assert one.logits_index.tolist() == [0, 1, 2, 3, 4] and chunk.logits_index.tolist() == [0, 4]


def test_prompt_tokens_are_marked() -> None:
    r = Request("a", list(range(10, 16)), SamplingParams())
    r.append_token(30)
    r.block_ids = [0, 1]
    inputs = build_step_inputs(StepRows([r], [4], [3], [0], 0), _cache(), 4, 2)
    assert inputs.prompt_tokens is not None and inputs.prompt_tokens.tolist() == [True, True, False]
    assert inputs.meta.prefill_positions is not None and inputs.meta.prefill_positions.tolist() == [[4, 5, 6]]
