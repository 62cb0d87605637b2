"""Fixed-size KV cache blocks, reference counts and automatic prefix caching (no torch).

The KV cache is a pool of ``num_blocks`` blocks of ``block_size`` token slots each (vLLM's
PagedAttention, Kwon et al. 2023). A request owns a block table: block ``i`` of the table holds the
K/V of its positions ``[i * block_size, (i + 1) * block_size)``; slot ``b * block_size + off`` is
the flat index into every layer's pool.

Automatic prefix caching (vLLM v1's design, ``vllm/v1/core/kv_cache_utils.py`` and
``block_pool.py``):

- A *full* block's identity is a hash chained over its parent's hash and its token ids:
  ``h_i = sha256(h_{i-1} || token ids of block i)`` (``h_{-1}`` = the empty digest). Equal hashes
  mean equal token prefixes, so equal K/V: the pool belongs to one model, dtype and attention
  implementation, and positions are implied by the chain. A block holding image placeholder tokens
  adds its images' encoder piece keys (``PromptImages.block_extra``, vLLM's extra keys): the same image
  reuses its K/V, another image (or the same one encoded beside others, as LLaVA-OneVision does)
  behind the same tokens does not (a LoRA adapter would have to enter the hash too). SHA-256 rather
  than Python's ``hash()`` because the prompts are client-controlled (vLLM moved to SHA-256 after a
  collision attack on the built-in hash, GHSA-rm76-4mrf-v9r8).
- With ``output_blocks_apart`` (set when output tokens run through other kernels than prompt
  tokens: the dense prompt copies of ``proxy.quant.dense_prefill``, the CPU's compiled decode
  step), a block holding any output token (position >= the request's prompt length ``P``) enters
  the hash with a marker and ``P``: its K/V came from the decode path, so a later prompt holding
  the same tokens (a chat turn resending an answer) must not be served it, nor a request whose
  prompt ends elsewhere in the block; the request itself finds it again after a preemption.
- Blocks are reference-counted; requests with a common prefix share its blocks (``n > 1`` choices
  share their prompt's blocks, a chat turn reuses the previous turn's).
- A block whose count drops to zero returns to the free queue *keeping its contents and hash*; it is
  reused (and its hash evicted) only when no block without contents is left, least recently freed
  first. The free queue: freed blocks without a hash, most recent first (a CPU pool's written pages
  are resident: reusing them keeps the RSS flat), then never-written blocks, then cached ones in LRU
  order; a request's blocks are queued tail first (a prefix is only useful from its start).
- A block is registered in the cache when the scheduler has scheduled all of its tokens
  (``cache_full_blocks``). If the step then fails, ``uncache_uncommitted`` drops the blocks
  registered since the last ``commit``: a block that may be half-written is never served.

``num_free_blocks`` counts every block with no reference (cached ones included: they are evictable),
which is what admission and the KV-usage gauge need.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable

from proxy.engine.request import Request

BlockHash = bytes
"""A block's chained SHA-256 digest (32 bytes)."""

_ROOT_HASH: BlockHash = b""


#: hashed after the token ids of a block whose K/V came from output tokens (``output_blocks_apart``),
#: followed by the request's prompt length (:func:`output_marker`).
OUTPUT_MARKER = b"output"


def output_marker(num_prompt_tokens: int) -> bytes:
    """What a block holding output tokens of a request with a prompt of ``num_prompt_tokens``
    tokens hashes after its token ids: :data:`OUTPUT_MARKER` and the length as a little-endian int64."""
    return OUTPUT_MARKER + array("q", [num_prompt_tokens]).tobytes()


def hash_block(parent: BlockHash, token_ids: list[int], extra: bytes = b"") -> BlockHash:
    """The chained hash of one full block: ``sha256(parent || token ids as little-endian int64 ||
    extra)`` (``extra``: the block's image hashes and an :func:`output_marker`, or nothing)."""
    return hashlib.sha256(parent + array("q", token_ids).tobytes() + extra).digest()


class BlockManager:
    """Hands out KV blocks from a fixed pool; shares and caches full blocks by prefix hash.

    Args:
        num_blocks: blocks in the pool (>= 1).
        block_size: token slots per block (>= 1).
        enable_prefix_caching: share and keep full blocks by prefix hash (default True); when False,
            blocks are plain allocations, as before prefix caching existed.
        output_blocks_apart: blocks holding output tokens hash apart from prompt blocks of the same
            tokens and from other prompt lengths (the module docstring; default False).

    Attributes:
        num_queries_tokens, num_hit_tokens: prompt tokens looked up in the prefix cache and those
            found there, over the life of the manager (vLLM's ``prefix_cache_queries`` /
            ``prefix_cache_hits``, counted in tokens).

    Raises:
        ValueError: on a non-positive size.
    """

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
        output_blocks_apart: bool = False,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_total_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.output_blocks_apart = output_blocks_apart
        self._ref_counts = [0] * num_blocks
        self._block_hash: list[BlockHash | None] = [None] * num_blocks
        self._cached: dict[BlockHash, int] = {}
        # Blocks with no reference, in the order they are taken (front first); values unused.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._uncommitted: list[int] = []
        self.num_queries_tokens = 0
        self.num_hit_tokens = 0

    # ---- counts ----------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks not held by any request (those keeping a cached prefix included)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache (held or free)."""
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests, in [0, 1]."""
        return 1.0 - len(self._free) / self.num_total_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` positions."""
        return -(-num_tokens // self.block_size)

    def ref_count(self, block_id: int) -> int:
        """Requests holding ``block_id``."""
        return self._ref_counts[block_id]

    # ---- prefix cache lookup -----------------------------------------------------------------------

    def block_hashes(self, request: Request) -> list[BlockHash]:
        """The chained hashes of the request's full blocks (prompt and output), extended in place."""
        hashes = request.block_hashes
        bs = self.block_size
        tokens = request.all_token_ids
        # blocks from this index on hold an output token
        first_output_block = request.num_prompt_tokens // bs if self.output_blocks_apart else len(tokens)
        marker = output_marker(request.num_prompt_tokens)
        images = request.images
        for i in range(len(hashes), len(tokens) // bs):
            parent = hashes[i - 1] if i else _ROOT_HASH
            extra = images.block_extra(i * bs, (i + 1) * bs) if images is not None else b""
            if i >= first_output_block:
                extra += marker
            hashes.append(hash_block(parent, tokens[i * bs : (i + 1) * bs], extra))
        return hashes

    def find_cached_prefix(self, request: Request) -> list[int]:
        """The cached blocks of the request's longest cached prefix of full blocks (nothing taken).

        At most ``num_tokens - 1`` tokens are served from the cache: the last token is always
        computed, since its logits are needed to sample (vLLM's rule).
        """
        if not self.enable_prefix_caching:
            return []
        hashes = self.block_hashes(request)
        limit = (request.num_tokens - 1) // self.block_size
        blocks: list[int] = []
        for block_hash in hashes[:limit]:
            block_id = self._cached.get(block_hash)
            if block_id is None:
                break
            blocks.append(block_id)
        return blocks

    def record_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one prefix-cache lookup of ``num_tokens`` tokens that found ``num_hit_tokens``."""
        self.num_queries_tokens += num_tokens
        self.num_hit_tokens += num_hit_tokens

    def num_free_among(self, block_ids: list[int]) -> int:
        """How many of ``block_ids`` are free (taking them uses up free blocks)."""
        refs = self._ref_counts
        return sum(1 for b in block_ids if refs[b] == 0)

    # ---- allocation --------------------------------------------------------------------------------

    def _take_free(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        old = self._block_hash[block_id]
        if old is not None:  # evict: the block's contents are about to be overwritten
            self._block_hash[block_id] = None
            if self._cached.get(old) == block_id:
                del self._cached[old]
        self._ref_counts[block_id] = 1
        return block_id

    def allocate_slots(
        self, request: Request, num_new_tokens: int, cached_blocks: list[int] | None = None
    ) -> bool:
        """Grow the request's block table to hold ``num_computed_tokens + num_new_tokens`` positions.

        Args:
            request: the request; its ``num_computed_tokens`` excludes ``cached_blocks``.
            num_new_tokens: tokens to compute this step.
            cached_blocks: (only for a request holding no block yet) cached prefix blocks from
                ``find_cached_prefix`` to share as the start of its block table; on success
                ``num_computed_tokens`` is advanced past them.

        Returns:
            True on success; False (and nothing allocated or shared) when the pool has too few free
            blocks.
        """
        cached_blocks = cached_blocks or []
        num_cached_tokens = len(cached_blocks) * self.block_size
        total = request.num_computed_tokens + num_cached_tokens + num_new_tokens
        needed = self.num_blocks_for(total) - len(request.block_ids) - len(cached_blocks)
        if needed + self.num_free_among(cached_blocks) > len(self._free):
            return False
        refs = self._ref_counts
        for block_id in cached_blocks:
            if refs[block_id] == 0:
                del self._free[block_id]
            refs[block_id] += 1
            request.block_ids.append(block_id)
        request.num_computed_tokens += num_cached_tokens
        for _ in range(needed):
            request.block_ids.append(self._take_free())
        return True

    def cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the request's blocks that ``num_tokens`` (its scheduled extent) fills completely.

        Call once the step's tokens are scheduled; the registration stays uncommitted until
        ``commit`` (after the step's forward pass succeeded).
        """
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = min(num_tokens, request.num_tokens) // bs
        start = request.num_cached_blocks
        if num_full <= start:
            return
        hashes = self.block_hashes(request)
        block_hash_of = self._block_hash
        for i in range(start, num_full):
            block_id = request.block_ids[i]
            if block_hash_of[block_id] is not None:
                continue  # shared from the cache already
            block_hash = hashes[i]
            if block_hash in self._cached:
                continue  # an equal block exists (computed concurrently): keep the first
            block_hash_of[block_id] = block_hash
            self._cached[block_hash] = block_id
            self._uncommitted.append(block_id)
        request.num_cached_blocks = num_full

    def commit(self) -> None:
        """The step's forward pass succeeded: its newly registered blocks are now valid for good."""
        self._uncommitted.clear()

    def uncache_uncommitted(self, block_ids: Iterable[int] | None = None) -> None:
        """The step failed: unregister the blocks registered since the last ``commit`` (only those
        among ``block_ids`` when given: one request of the step failed)."""
        chosen = set(self._uncommitted if block_ids is None else block_ids)
        for block_id in [b for b in self._uncommitted if b in chosen]:
            block_hash = self._block_hash[block_id]
            if block_hash is not None:
                self._block_hash[block_id] = None
                if self._cached.get(block_hash) == block_id:
                    del self._cached[block_hash]
                if self._ref_counts[block_id] == 0:
                    self._free.move_to_end(block_id, last=False)
        self._uncommitted = [b for b in self._uncommitted if b not in chosen]

    def free(self, request: Request) -> None:
        """Drop the request's references and clear its block table.

        Blocks nobody holds any more return to the free queue: without a hash at the front (reused
        first), with one at the back, the table's tail first (evicted before its head).
        """
        refs = self._ref_counts
        free = self._free
        for block_id in reversed(request.block_ids):
            refs[block_id] -= 1
            if refs[block_id] == 0:
                free[block_id] = None
                if self._block_hash[block_id] is None:
                    free.move_to_end(block_id, last=False)
        request.block_ids = []
        request.num_cached_blocks = 0

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (blocks in use stay allocated); the free blocks that held a
        cached prefix, written and now without contents, move to the front of the free queue."""
        for block_id in reversed([b for b in self._free if self._block_hash[b] is not None]):
            self._free.move_to_end(block_id, last=False)  # in their queue order
        for block_id, block_hash in enumerate(self._block_hash):
            if block_hash is not None:
                self._block_hash[block_id] = None
        self._cached.clear()
        self._uncommitted.clear()
