"""One forward pass's rows (:class:`StepRows`) and the flat model inputs built from them
(:func:`build_step_inputs`): token ids, positions, the sampling rows' logits index and the step's
:class:`~proxy.engine.execution.attention.PagedAttentionMetadata`.

A *row* is a run of consecutive tokens of one request: ``counts[i]`` tokens of ``requests[i]``
from position ``starts[i]``. The scheduler's step is one row per request, starting at its
``num_computed_tokens`` (:meth:`StepRows.of`). The compiled decode step takes one-token rows only,
so a chunk of output tokens recomputed after preemption is split into one row per token
(:meth:`StepRows.one_token_rows`): several rows of one request in one call, each attending over the
keys before it, which the same call wrote first (every layer writes the step's K/V before it
attends).

Decode rows (one query token each, the first ``num_decodes`` rows) and prefill rows (chunks,
padded to the longest) get their attention metadata from two functions, :func:`_decode_metadata`
and :func:`_prefill_metadata`; both pad the key length to ``KEY_PAD`` (batch invariance,
``proxy.engine.execution.attention.metadata``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from proxy.engine.execution.attention import PagedAttentionMetadata, PagedKVCache, padded_key_length
from proxy.engine.request import Request
from proxy.engine.scheduler import SchedulerOutput


@dataclass(frozen=True)
class StepRows:
    """The rows of one forward pass, decode rows first.

    Attributes:
        requests: the request of each row (a request may own several one-token rows).
        starts: the position of each row's first token.
        counts: tokens of each row (>= 1).
        sample_indices: rows whose last token samples (ascending); the pass returns one logits row
            for each, in this order.
        num_decodes: the leading rows of one token each that attend as decode rows.
    """

    requests: list[Request]
    starts: list[int]
    counts: list[int]
    sample_indices: list[int]
    num_decodes: int

    @classmethod
    def of(cls, scheduler_output: SchedulerOutput) -> StepRows:
        """The scheduler's step: one row per request, from its ``num_computed_tokens``."""
        so = scheduler_output
        return cls(list(so.requests), [r.num_computed_tokens for r in so.requests],
                   list(so.num_new_tokens), list(so.sample_indices), so.num_decodes)

    def select(self, indices: Sequence[int]) -> StepRows:
        """The rows at ``indices`` (ascending), in order; decode rows stay leading."""
        samples = set(self.sample_indices)
        return StepRows([self.requests[i] for i in indices], [self.starts[i] for i in indices],
                        [self.counts[i] for i in indices], [j for j, i in enumerate(indices) if i in samples],
                        sum(1 for i in indices if i < self.num_decodes))

    def one_token_rows(self) -> tuple[StepRows, list[int]]:
        """Every row split into rows of one token each (all decode rows, all sampling).

        Returns:
            the split rows, and for each of this object's ``sample_indices`` the split row whose
            logits it samples (its last token's).
        """
        if len(self.sample_indices) == len(self.counts) == self.num_decodes:  # decodes only, all sampling
            return self, list(range(self.num_decodes))
        requests: list[Request] = []
        starts: list[int] = []
        last: list[int] = []
        for request, start, count in zip(self.requests, self.starts, self.counts):
            requests.extend([request] * count)
            starts.extend(range(start, start + count))
            last.append(len(starts) - 1)
        num = len(starts)
        split = StepRows(requests, starts, [1] * num, list(range(num)), num)
        return split, [last[i] for i in self.sample_indices]


@dataclass(frozen=True)
class ImageSlots:
    """The positions of one step that take image embeddings (``proxy.engine.execution.image_embeds``).

    Attributes:
        flat_index: ``[K]`` int64, indices into the step's ``T`` flat tokens (CPU).
        embeds: ``[K, hidden]`` in the model's dtype, on its device, in ``flat_index`` order; a DeepStack
            model's ``[K, 1 + N, hidden]`` (``proxy.models.vision.encode_piece``).
    """

    flat_index: torch.Tensor
    embeds: torch.Tensor

    @property
    def input_embeds(self) -> torch.Tensor:
        """``[K, hidden]``: the rows that replace the positions' token embeddings."""
        return self.embeds if self.embeds.dim() == 2 else self.embeds[:, 0]

    @property
    def deepstack_embeds(self) -> torch.Tensor | None:
        """``[K, N, hidden]``: a DeepStack model's rows added after its first ``N`` decoder layers
        (``proxy.engine.execution.deepstack``); None for any other model."""
        return None if self.embeds.dim() == 2 else self.embeds[:, 1:]


@dataclass
class StepInputs:
    """The flat CPU inputs of one forward pass over :class:`StepRows` of ``T`` tokens and ``S``
    sampling rows.

    Attributes:
        input_ids, position_ids: ``[1, T]`` int64.
        logits_index: ``[S]`` int64, the flat index of each sampling row's last token.
        meta: the attention metadata (``row_plan`` unset: the model runner's).
        prompt_tokens: ``[T]`` bool, True where a token is a prompt token of its request; None when
            no row holds one.
        image_slots: the positions that take image embeddings instead of their token's (set by the
            model runner of a vision-language model); None: none.
        rope_position_ids: the rotary positions where they are not ``position_ids`` (set by the model
            runner of an M-RoPE model, ``proxy.engine.execution.mrope``): ``[1, T]`` or ``[3, 1, T]``
            int64; None: ``position_ids``. The KV slots and masks always take ``position_ids``.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    logits_index: torch.Tensor
    meta: PagedAttentionMetadata
    prompt_tokens: torch.Tensor | None
    image_slots: ImageSlots | None = None
    rope_position_ids: torch.Tensor | None = None

    @property
    def model_position_ids(self) -> torch.Tensor:
        """The ``position_ids`` the model takes: :attr:`rope_position_ids`, else :attr:`position_ids`."""
        return self.position_ids if self.rope_position_ids is None else self.rope_position_ids


def build_step_inputs(rows: StepRows, kv_cache: PagedKVCache, block_size: int, num_groups: int) -> StepInputs:
    """Flatten ``rows`` into CPU tensors (the model runner moves them to its device).

    Args:
        rows: the pass's rows; a row's tokens are ``request.all_token_ids[start : start + count]``.
        kv_cache: the pools; block_size: tokens per KV block; num_groups: the GQA group size the
            prefill mask is folded with.
    """
    token_ids: list[int] = []
    positions: list[int] = []
    max_blocks = 0
    for request, start, count in zip(rows.requests, rows.starts, rows.counts):
        if count == 1:
            token_ids.append(request.all_token_ids[start])
            positions.append(start)
        else:
            token_ids.extend(request.all_token_ids[start : start + count])
            positions.extend(range(start, start + count))
        max_blocks = max(max_blocks, len(request.block_ids))
    block_tables = torch.tensor([r.block_ids + [0] * (max_blocks - len(r.block_ids)) for r in rows.requests],
                                dtype=torch.long)
    nums_t = torch.tensor(rows.counts, dtype=torch.long)
    starts_t = torch.tensor(rows.starts, dtype=torch.long)
    row_of_token = torch.repeat_interleave(torch.arange(len(rows.counts)), nums_t)
    ends_t = torch.cumsum(nums_t, 0)  # flat end index of each row
    pos_t = torch.tensor(positions, dtype=torch.long)
    slot_mapping = block_tables[row_of_token, pos_t // block_size] * block_size + pos_t % block_size
    meta = PagedAttentionMetadata(kv_cache=kv_cache, slot_mapping=slot_mapping, num_decodes=rows.num_decodes,
                                  num_groups=num_groups)
    nd = rows.num_decodes
    if nd:
        _decode_metadata(meta, block_tables[:nd], starts_t[:nd] + 1, block_size)
    if nd < len(rows.counts):
        _prefill_metadata(meta, block_tables[nd:], starts_t[nd:], nums_t[nd:], ends_t[nd:], block_size)
    prompt_tokens = None
    if any(s < len(r.prompt_token_ids) for r, s in zip(rows.requests, rows.starts)):
        prompt_lens = torch.tensor([r.num_prompt_tokens for r in rows.requests], dtype=torch.long)
        prompt_tokens = pos_t < prompt_lens[row_of_token]
    logits_index = ends_t[rows.sample_indices] - 1
    return StepInputs(torch.tensor(token_ids, dtype=torch.long).view(1, -1), pos_t.view(1, -1), logits_index,
                      meta, prompt_tokens)


def _decode_metadata(meta: PagedAttentionMetadata, block_tables: torch.Tensor, context_lens: torch.Tensor,
                     block_size: int) -> None:
    """Set the decode fields of ``meta``: rows ``[B_d]`` with block tables ``[B_d, N]`` and context
    lengths ``context_lens [B_d]`` (their query's position + 1); keys padded to ``KEY_PAD``."""
    meta.decode_context_lens = context_lens
    real_len = int(context_lens.max())
    max_len = padded_key_length(real_len)
    ar = torch.arange(max_len)
    ar_real = ar.clamp_max(real_len - 1)  # padding keys read a real slot and are masked
    meta.decode_gather = block_tables[:, ar_real // block_size] * block_size + ar_real % block_size
    if int(context_lens.min()) != max_len:
        meta.decode_mask = (ar[None, :] < context_lens[:, None]).view(len(context_lens), 1, 1, max_len)


def _prefill_metadata(meta: PagedAttentionMetadata, block_tables: torch.Tensor, starts: torch.Tensor,
                      nums: torch.Tensor, ends: torch.Tensor, block_size: int) -> None:
    """Set the prefill fields of ``meta``: ``B_p`` chunks with block tables ``[B_p, N]``, first
    positions ``starts``, token counts ``nums`` and flat end indices ``ends`` (``[B_p]`` int64);
    queries padded to the longest chunk ``Q_p``, keys to ``KEY_PAD``, a bottom-right causal mask
    (query ``j`` of chunk ``i`` sees keys ``k <= starts[i] + j``) folded over ``meta.num_groups``."""
    first = ends - nums  # flat index of each chunk's first token
    num_seqs = len(nums)
    q_len = int(nums.max())
    real_len = int((starts + nums).max())
    max_len = padded_key_length(real_len)
    qa = torch.arange(q_len)
    ka = torch.arange(max_len)
    ka_real = ka.clamp_max(real_len - 1)
    q_clamped = torch.minimum(qa[None, :], nums[:, None] - 1)  # [B_p, Q_p]
    meta.prefill_query_index = (first[:, None] + q_clamped).reshape(-1)
    meta.prefill_gather = block_tables[:, ka_real // block_size] * block_size + ka_real % block_size
    meta.prefill_positions = starts[:, None] + q_clamped  # [B_p, Q_p]
    mask = ka[None, None, :] <= meta.prefill_positions[:, :, None]  # [B_p, Q_p, L_p]
    g = meta.num_groups
    meta.prefill_mask = mask[:, None].expand(num_seqs, g, q_len, max_len).reshape(
        num_seqs, 1, g * q_len, max_len)
    meta.num_prefill_seqs = num_seqs
    meta.prefill_query_len = q_len
    if int(nums.min()) != q_len:
        valid = (qa[None, :] < nums[:, None]).reshape(-1)
        meta.prefill_valid = valid.nonzero().squeeze(1)
        meta.prefill_token_index = meta.prefill_query_index[meta.prefill_valid]
