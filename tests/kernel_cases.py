"""Random paged-attention scenarios shared by the torch and Triton kernel tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_paged.kernels.reference import store_kv_reference


@dataclass
class PagedCase:
    query: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    scale: float

    def args(self):
        return (
            self.query, self.k_cache, self.v_cache, self.block_tables, self.seq_lens, self.cu_seqlens_q,
            self.max_seqlen_q, self.max_seqlen_k, self.scale,
        )


def make_case(
    seq_lens: list[int],
    q_lens: list[int],
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    block_size: int = 4,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    seed: int = 0,
    extra_blocks: int = 3,
) -> PagedCase:
    """Sequences with permuted block tables in a NaN-filled pool (unused slots and blocks stay NaN)."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + extra_blocks
    perm = torch.randperm(num_blocks, generator=g).tolist()
    max_blocks = max(blocks_per_seq) + 1
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    i = 0
    for s, (n, nb) in enumerate(zip(seq_lens, blocks_per_seq)):
        table = perm[i : i + nb]
        i += nb
        block_tables[s, :nb] = torch.tensor(table, dtype=torch.int32)
        # padding entries point at a NaN block that belongs to nobody
        block_tables[s, nb:] = perm[-1]
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(n)])
        k = torch.randn(n, num_kv_heads, head_dim, generator=g).to(dtype)
        v = torch.randn(n, num_kv_heads, head_dim, generator=g).to(dtype)
        store_kv_reference(k, v, k_cache, v_cache, slots)
    cu = [0]
    for q in q_lens:
        cu.append(cu[-1] + q)
    query = torch.randn(cu[-1], num_heads, head_dim, generator=g).to(dtype)
    return PagedCase(
        query=query.to(device),
        k_cache=k_cache.to(device),
        v_cache=v_cache.to(device),
        block_tables=block_tables.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
        max_seqlen_q=max(q_lens),
        max_seqlen_k=max(seq_lens),
        scale=head_dim**-0.5,
    )
