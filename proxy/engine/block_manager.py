"""Fixed-size KV cache block allocation (no torch).

The KV cache is a pool of ``num_blocks`` blocks of ``block_size`` token slots each (vLLM's
PagedAttention, Kwon et al. 2023). A request owns a block table: block ``i`` of the table holds the
K/V of its positions ``[i * block_size, (i + 1) * block_size)``; slot ``b * block_size + off`` is
the flat index into every layer's pool. Blocks return to the pool on finish, abort and preemption.
"""

from __future__ import annotations

from proxy.engine.request import Request


class BlockManager:
    """Hands out KV blocks from a fixed pool.

    Args:
        num_blocks: blocks in the pool (>= 1).
        block_size: token slots per block (>= 1).

    Raises:
        ValueError: on a non-positive size.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_total_blocks = num_blocks
        self.block_size = block_size
        # A stack: the most recently freed block is reused first (warm in cache).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free_blocks(self) -> int:
        """Blocks not held by any request."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, in [0, 1]."""
        return 1.0 - len(self._free) / self.num_total_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` positions."""
        return -(-num_tokens // self.block_size)

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Grow the request's block table to hold ``num_computed_tokens + num_new_tokens`` positions.

        Returns:
            True on success; False (and nothing allocated) when the pool has too few free blocks.
        """
        needed = self.num_blocks_for(request.num_computed_tokens + num_new_tokens) - len(request.block_ids)
        if needed <= 0:
            return True
        if needed > len(self._free):
            return False
        free = self._free
        for _ in range(needed):
            request.block_ids.append(free.pop())
        return True

    def free(self, request: Request) -> None:
        """Return all of the request's blocks to the pool and clear its block table."""
        if request.block_ids:
            self._free.extend(reversed(request.block_ids))
            request.block_ids = []
