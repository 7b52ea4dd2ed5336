"""Scheduler output -> one packed ragged batch -> HF forward -> sampled tokens."""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from hf_paged.attention import METADATA_KWARG, AttentionMetadata, engine_forward
from hf_paged.cache import KVPool
from hf_paged.core.scheduler import ScheduledRequest, SchedulerOutput
from hf_paged.kernels import TorchAttentionPlan, cpu_attention
from hf_paged.sampling import Sampler
from hf_paged.sequence import Request


@dataclass
class StepInputs:
    """A step packed as one sequence of ``num_tokens`` tokens (shapes in brackets)."""

    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T]
    metadata: AttentionMetadata
    logits_indices: torch.Tensor  # [N] rows of the step whose next token is sampled
    sample_requests: list[Request]  # the N requests, in row order

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]


def pack_step(
    scheduled: list[ScheduledRequest], block_size: int
) -> tuple[list[int], list[int], list[int], list[list[int]], list[int], list[int], list[int]]:
    """Pure-Python packing: token ids, positions, slots, block tables, seq_lens, cu_seqlens_q, sample rows."""
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    tables: list[list[int]] = []
    seq_lens: list[int] = []
    cu = [0]
    sample_rows: list[int] = []
    for item in scheduled:
        start, end = item.start, item.seq_len
        ids.extend(item.request.token_ids(start, end))
        positions.extend(range(start, end))
        table = item.block_ids
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, end))
        tables.append(table)
        seq_lens.append(end)
        cu.append(cu[-1] + item.num_new_tokens)
        if item.sample:
            sample_rows.append(cu[-1] - 1)
    return ids, positions, slots, tables, seq_lens, cu, sample_rows


class ModelRunner:
    """Runs scheduled steps on a HF model whose attention is "hf_paged".

    Inputs are built as Python lists and turned into tensors once per step. The layout (a packed ``[1, T]``
    batch, per-sequence query lengths, logits only at sampled rows) already allows several query tokens
    per sequence in decode (speculative verification) and copying into fixed-size buffers (CUDA graphs).
    """

    def __init__(self, model: torch.nn.Module, pool: KVPool, backend: str, sampler: Sampler) -> None:
        self.model = model
        self.pool = pool
        self.backend = backend
        self.sampler = sampler
        self.device = pool.device
        self.block_size = pool.block_size
        self._logits_to_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        self._native_max_q = cpu_attention.MAX_Q if backend == "cpu" and pool.supports_native() else 0

    def prepare(self, out: SchedulerOutput) -> StepInputs:
        ids, positions, slots, tables, seq_lens, cu, sample_rows = pack_step(out.scheduled, self.block_size)
        device = self.device
        max_blocks = max(len(t) for t in tables)
        block_tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int32, device=device)
        seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=device)
        cu_t = torch.tensor(cu, dtype=torch.int32, device=device)
        q_lens = [cu[i + 1] - cu[i] for i in range(len(tables))]
        plan = None
        if self.backend in ("torch", "cpu"):
            plan = TorchAttentionPlan(
                block_tables, seq_lens, q_lens, self.block_size, len(ids), self._native_max_q, seq_lens_t, cu_t
            )
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            block_tables=block_tables,
            seq_lens=seq_lens_t,
            cu_seqlens_q=cu_t,
            max_seqlen_q=max(q_lens),
            max_seqlen_k=max(seq_lens),
            kv_caches=self.pool.kv_caches,
            backend=self.backend,
            has_padding=False,
            torch_plan=plan,
        )
        sample_requests = [item.request for item in out.scheduled if item.sample]
        return StepInputs(
            input_ids=torch.tensor([ids], dtype=torch.long, device=device),
            position_ids=torch.tensor([positions], dtype=torch.long, device=device),
            metadata=meta,
            logits_indices=torch.tensor(sample_rows, dtype=torch.long, device=device),
            sample_requests=sample_requests,
        )

    def compute_logits(self, inputs: StepInputs) -> torch.Tensor:
        """Forward the packed step; logits ``[N, V]`` at the sampled rows only."""
        kwargs = {METADATA_KWARG: inputs.metadata}
        if self._logits_to_keep:
            kwargs["logits_to_keep"] = inputs.logits_indices
        with engine_forward():
            output = self.model(
                input_ids=inputs.input_ids, position_ids=inputs.position_ids, use_cache=False, **kwargs
            )
        logits = output.logits[0]
        if not self._logits_to_keep:
            logits = logits.index_select(0, inputs.logits_indices)
        return logits

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> dict[str, list[int]]:
        """Run one step; return the sampled token(s) of each request that reached its sampling point."""
        self.sampler.forget(out.finished_req_ids)
        inputs = self.prepare(out)
        if not inputs.sample_requests:
            # Only mid-prompt chunks: the KV still has to be written, but no logits are needed.
            inputs.logits_indices = inputs.logits_indices.new_zeros(0)
        logits = self.compute_logits(inputs)
        if not inputs.sample_requests:
            return {}
        tokens = self.sampler.sample(logits, inputs.sample_requests)
        return {req.request_id: [tok] for req, tok in zip(inputs.sample_requests, tokens)}
