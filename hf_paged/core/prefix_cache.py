"""The prefix-cache half of the block manager (pure Python): find a prompt's cached leading blocks, hash and
register a sequence's full computed blocks, forget every cached prefix.

:class:`PrefixCaching` is the part of :class:`~hf_paged.core.kv_cache_manager.KVCacheManager` that works on block
hashes: each full block is keyed by the hash of its tokens chained to its parent block's hash (plus extra keys,
e.g. a LoRA adapter), so a hit on block ``i`` means the whole prefix up to it matches.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Protocol

from hf_paged.core.block_pool import BlockHash, KVCacheBlock, hash_block_tokens


class TokenSource(Protocol):
    def token_ids(self, start: int, end: int) -> list[int]: ...


class _TokenList:
    """A plain token list as a token source (no hashes cached on it)."""

    def __init__(self, token_ids: Sequence[int]) -> None:
        self._ids = token_ids
        self.num_tokens = len(token_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        return list(self._ids[start:end])


class PrefixCaching:
    """Prefix-cache methods of the block manager (a mixin: the pool, tables and hashes live in ``KVCacheManager``)."""

    def find_cached_prefix(
        self, tokens: Sequence[int] | TokenSource, extra_keys: tuple = ()
    ) -> tuple[list[KVCacheBlock], list[BlockHash]]:
        """The longest run of leading full blocks of ``tokens`` that is cached, with their hashes.

        ``tokens`` is a token list, or a sequence (``num_tokens``, ``token_ids(start, end)``, ``block_hashes``)
        whose block hashes are computed once and kept on it. Never covers the last token: at least one token
        must be computed to get the next token's logits. Changes nothing (see :meth:`allocate_slots`), except
        that with KV tiers (:attr:`tiers`) a block found below the pool is promoted into a free cached pool
        block first.
        """
        if not self.pool.enable_caching:
            return [], []
        if not hasattr(tokens, "token_ids"):
            tokens = _TokenList(tokens)
        blocks: list[KVCacheBlock] = []
        hashes: list[BlockHash] = []
        parent = None
        for i in range((tokens.num_tokens - 1) // self.block_size):
            parent = self._block_hash(tokens, i, parent, extra_keys)
            block = self.pool.lookup(parent)
            if block is None and self.tiers is not None:
                bs = self.block_size
                block = self.tiers.promote(parent, tokens.token_ids(i * bs, (i + 1) * bs), blocks)
            if block is None:
                break
            blocks.append(block)
            hashes.append(parent)
        return blocks, hashes

    def _block_hash(self, tokens: TokenSource, i: int, parent: BlockHash | None, extra_keys: tuple) -> BlockHash:
        """Hash of full block ``i`` of ``tokens`` after ``parent``; a sequence keeps its hashes (``block_hashes``),
        so each of its blocks is hashed once however often it is looked up or cached again."""
        known = getattr(tokens, "block_hashes", None) if not extra_keys else None
        if known is not None and i < len(known):
            return known[i]
        # a sequence's own keys (its LoRA adapter) are fixed for its life, so its kept hashes stay valid
        extra_keys = extra_keys or getattr(tokens, "hash_extra_keys", ())
        bs = self.block_size
        block_hash = hash_block_tokens(parent, tokens.token_ids(i * bs, (i + 1) * bs), extra_keys)
        if known is not None and i == len(known):
            known.append(block_hash)
        return block_hash

    def cache_blocks(self, seq_id: Hashable, tokens: TokenSource, num_computed: int, extra_keys: tuple = ()) -> None:
        """Hash (and register in the prefix cache) the sequence's blocks that are full and computed.

        Only computed tokens are hashed, so speculative tokens that were written but not verified never are.
        """
        if not self.pool.enable_caching or seq_id in self.uncacheable:
            return
        bs = self.block_size
        hashes = self.hashes.setdefault(seq_id, [])
        table = self.tables[seq_id]
        for i in range(len(hashes), min(num_computed // bs, len(table))):
            block_hash = self._block_hash(tokens, i, hashes[-1] if hashes else None, extra_keys)
            hashes.append(block_hash)
            self.pool.cache_block(table[i], block_hash, tokens.token_ids(i * bs, (i + 1) * bs))

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit_tokens

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (e.g. the weights changed): no block is served from the cache again.

        Blocks in use keep their contents for their holders but lose their hash; free ones become plain free
        blocks.
        """
        self.pool.reset_prefix_cache()
        if self.tiers is not None:
            self.tiers.reset()
        for block in list(self.pool.cached.values()):
            self.pool.uncache(block)
        self.hashes.clear()
        # live sequences hold (and keep attending to) KV of the old weights: never cache any of their blocks
        self.uncacheable.update(self.tables, self.host_tables)
