"""Maps requests to the blocks that hold their KV (pure Python)."""

from __future__ import annotations

from hf_paged.core.block_pool import BlockPool, KVCacheBlock
from hf_paged.sequence import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Block tables of all live requests, on top of one :class:`BlockPool`.

    ``allocate_slots`` is the only mutator that grows a table; ``can_allocate`` is its predicate.
    Running out of blocks is normal: ``allocate_slots`` returns None and the scheduler preempts.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def num_new_blocks_needed(self, request: Request, num_new_tokens: int, num_lookahead_tokens: int = 0) -> int:
        total = request.num_computed_tokens + num_new_tokens + num_lookahead_tokens
        held = len(self.req_to_blocks.get(request.request_id, ()))
        return max(0, self.blocks_for_tokens(total) - held)

    def can_allocate(self, request: Request, num_new_tokens: int, num_lookahead_tokens: int = 0) -> bool:
        need = self.num_new_blocks_needed(request, num_new_tokens, num_lookahead_tokens)
        return need <= self.pool.num_free_blocks

    def allocate_slots(
        self, request: Request, num_new_tokens: int, num_lookahead_tokens: int = 0
    ) -> list[int] | None:
        """Make room for ``num_new_tokens`` (+ lookahead) after the request's computed tokens.

        Returns the ids of the newly added blocks (possibly empty), or None if the pool cannot supply them,
        in which case nothing changes.
        """
        assert num_new_tokens >= 0 and num_lookahead_tokens >= 0
        need = self.num_new_blocks_needed(request, num_new_tokens, num_lookahead_tokens)
        if need > self.pool.num_free_blocks:
            return None
        new_blocks = self.pool.get_new_blocks(need)
        self.req_to_blocks.setdefault(request.request_id, []).extend(new_blocks)
        return [b.block_id for b in new_blocks]

    def free(self, request: Request) -> None:
        """Release every block of the request; the tail is freed first so shared heads stay cached longest."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        if blocks:
            self.pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def num_allocated_slots(self) -> int:
        return (self.pool.num_blocks - self.pool.num_free_blocks) * self.block_size

    def check_consistency(self) -> None:
        owned = (b.block_id for blocks in self.req_to_blocks.values() for b in blocks)
        self.pool.check_consistency(owned)
