"""Scheduler output -> one packed ragged batch -> HF forward -> sampled tokens (a ``ModelRunnerOutput``).

The runner sees plain data only (:mod:`hf_paged.core.scheduler_output`) and keeps its own per-sequence
state (:class:`~hf_paged.sampling.SeqState`): created the first time a sequence is scheduled, dropped when
the scheduler reports it finished.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass

import torch

from hf_paged.attention import METADATA_KWARG, AttentionMetadata, engine_forward
from hf_paged.kv_pool import KVPool
from hf_paged.core.scheduler_output import ModelRunnerOutput, SampledLogprobs, ScheduledSequence, SchedulerOutput
from hf_paged.cpu import attention as cpu_attention
from hf_paged.kernels import TorchAttentionPlan
from hf_paged.sampling import Sampler, SeqState
from hf_paged.spec_decode.speculator import Speculator
from hf_paged.spec_decode.verifier import verify

logger = logging.getLogger(__name__)


@dataclass
class StepInputs:
    """A step packed as one sequence of ``num_tokens`` tokens (shapes in brackets)."""

    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T]
    metadata: AttentionMetadata
    logits_indices: torch.Tensor  # [N] rows of the step whose next token is sampled
    sampled: list[ScheduledSequence]  # the N sequences, in row order

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]


def pack_step(
    scheduled: list[ScheduledSequence], block_size: int
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
        ids.extend(item.token_ids)
        positions.extend(range(start, end))
        table = item.block_ids
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, end))
        tables.append(table)
        seq_lens.append(end)
        cu.append(cu[-1] + item.num_new_tokens)
        if item.sample:  # a verified sequence needs the logits of its last token and of every draft
            sample_rows.extend(range(cu[-1] - 1 - item.num_draft_tokens, cu[-1]))
    return ids, positions, slots, tables, seq_lens, cu, sample_rows


class ModelRunner:
    """Runs scheduled steps on a HF model whose attention is "hf_paged"."""

    def __init__(
        self, model: torch.nn.Module, pool: KVPool, backend: str, sampler: Sampler, max_model_len: int,
        speculator: Speculator | None = None, decode=None,
    ) -> None:
        self.model = model
        self.pool = pool
        self.backend = backend
        self.sampler = sampler
        self.max_model_len = max_model_len
        self.speculator = speculator
        self.decode = decode  # a DecodeGraphRunner (decode_runner.py) for bucketed static decode steps, or None
        self.device = pool.device
        self.block_size = pool.block_size
        self.states: dict[int, SeqState] = {}
        self._logits_to_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        self._native_max_q = cpu_attention.MAX_Q if backend == "cpu" and pool.supports_native() else 0
        self.fused_layers = False  # the model's decoder layers have the fused CPU forward (cpu/fused_layers.py)
        self.program = None  # a DecodeProgram (cpu/native_program.py) replaying native steps, or None

    def update_states(self, out: SchedulerOutput) -> None:
        for seq_id in out.finished_seq_ids:
            self.states.pop(seq_id, None)
        if self.speculator is not None:
            self.speculator.forget(out.finished_seq_ids, out.preempted_seq_ids)
        for data in out.new_sequences:
            self.states[data.seq_id] = SeqState.from_new(data)

    def prepare(self, out: SchedulerOutput) -> StepInputs:
        return self.prepare_batch(out.scheduled, self.pool.kv_caches)

    def prepare_batch(self, scheduled: list[ScheduledSequence], kv_caches) -> StepInputs:
        """Pack sequences into one ragged batch over the pool ``kv_caches`` (the target's, or a draft's)."""
        ids, positions, slots, tables, seq_lens, cu, sample_rows = pack_step(scheduled, self.block_size)
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
        slot_mapping = torch.tensor(slots, dtype=torch.long, device=device)
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            block_tables=block_tables,
            seq_lens=seq_lens_t,
            cu_seqlens_q=cu_t,
            max_seqlen_q=max(q_lens),
            max_seqlen_k=max(seq_lens),
            kv_caches=kv_caches,
            backend=self.backend,
            has_padding=False,
            torch_plan=plan,
            fused=self.fused_layers,
            native_step=cpu_attention.NativeStep.build(plan, slot_mapping, kv_caches) if self._native_max_q else None,
        )
        return StepInputs(
            input_ids=torch.tensor([ids], dtype=torch.long, device=device),
            position_ids=torch.tensor([positions], dtype=torch.long, device=device),
            metadata=meta,
            logits_indices=torch.tensor(sample_rows, dtype=torch.long, device=device),
            sampled=[item for item in scheduled if item.sample],
        )

    def compute_logits(self, inputs: StepInputs, model: torch.nn.Module | None = None) -> torch.Tensor:
        """Forward the packed step (through ``model``, the target by default); logits ``[N, V]`` at the
        sampled rows only."""
        model = self.model if model is None else model
        if self.program is not None and model is self.model and inputs.metadata.native_step is not None:
            logits = self.program.run(inputs)
            if logits is not None:
                return logits
        kwargs = {METADATA_KWARG: inputs.metadata}
        keep = self._logits_to_keep if model is self.model else "logits_to_keep" in inspect.signature(model.forward).parameters
        if keep:
            kwargs["logits_to_keep"] = inputs.logits_indices
        with engine_forward():
            output = model(input_ids=inputs.input_ids, position_ids=inputs.position_ids, use_cache=False, **kwargs)
        logits = output.logits[0]
        if not keep:
            logits = logits.index_select(0, inputs.logits_indices)
        return logits

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step: move blocks as scheduled, forward, sample."""
        self.update_states(out)
        self.pool.commit(out.blocks_high_water)
        self.pool.swap_out(out.swap_out)
        self.pool.swap_in(out.swap_in)
        self.pool.copy_blocks(out.block_copies)
        if self.speculator is not None:
            self.speculator.move_blocks(out)
        planned = self.decode.plan(out.scheduled) if self.decode is not None else None
        if planned is not None:
            logits = self.decode.run(out.scheduled, *planned)
            if logits is not None:
                return self.sample(logits, out.scheduled)
        inputs = self.prepare(out)
        if not inputs.sampled:
            # Only mid-prompt chunks: the KV still has to be written, but no logits are needed.
            inputs.logits_indices = inputs.logits_indices.new_zeros(0)
        logits = self.compute_logits(inputs)
        if not inputs.sampled:
            return ModelRunnerOutput()
        return self.sample(logits, inputs.sampled)

    # -- sampling -----------------------------------------------------------------------------------
    def sample(self, logits: torch.Tensor, sampled: list[ScheduledSequence]) -> ModelRunnerOutput:
        """Tokens for the sampled rows: a row that forks (n > 1) is sampled once per sample, a sequence with
        drafts is verified (accepted drafts + one token); then drafts for the next step are proposed."""
        result = ModelRunnerOutput()
        rows: list[int] = []
        states: list[SeqState] = []
        verify_items: list[tuple[int, ScheduledSequence, SeqState]] = []
        row = 0
        for item in sampled:
            state = self.states[item.seq_id]
            if state.is_beam:
                result.beam_rows[item.seq_id] = torch.log_softmax(logits[row].float(), dim=-1)
            elif item.num_draft_tokens:
                verify_items.append((row, item, state))
            else:
                rows.append(row)
                states.append(state)
                for index, child_id in enumerate(item.fork_seq_ids, start=1):
                    child = self.states[child_id] = state.fork(child_id, index)
                    rows.append(row)
                    states.append(child)
            row += 1 + item.num_draft_tokens
        scores: dict = {}
        if rows:
            sub = logits if len(rows) == logits.shape[0] else logits[rows]
            tokens = self._sample_isolated(sub, states, scores, result.errors)
            for i, (state, token) in enumerate(zip(states, tokens)):
                if token is not None:
                    self._emit(result, state, [token], sub[i : i + 1])
        if verify_items:
            self._verify(logits, verify_items, result, scores)
        result.scores = scores
        proposing = [item for item in sampled if item.propose and item.seq_id in result.sampled_token_ids]
        if self.speculator is not None and proposing:
            states = [self.states[item.seq_id] for item in proposing]
            result.spec_token_ids = self.speculator.propose(states, self.max_model_len, proposing)
        return result

    def _emit(self, result: ModelRunnerOutput, state: SeqState, tokens: list[int], rows: torch.Tensor) -> None:
        state.output_token_ids.extend(tokens)
        result.sampled_token_ids[state.seq_id] = tokens
        if state.params.logprobs is not None:
            result.logprobs[state.seq_id] = [_logprobs(rows[i], t, state.params.logprobs) for i, t in enumerate(tokens)]

    def _verify(self, logits: torch.Tensor, items: list, result: ModelRunnerOutput, scores: dict) -> None:
        index = torch.tensor([r for row, item, _ in items for r in range(row, row + 1 + item.num_draft_tokens)],
                             device=logits.device)
        sub = logits.index_select(0, index)
        states = [state for _, _, state in items]
        drafts = [item.token_ids[-item.num_draft_tokens :] for _, item, _ in items]
        try:
            emitted = verify(self.sampler, sub, states, drafts, scores)
        except Exception:  # noqa: BLE001 - isolate the failing sequence below
            emitted = []
            offset = 0
            for state, draft in zip(states, drafts):
                try:
                    emitted.append(verify(self.sampler, sub[offset : offset + len(draft) + 1], [state], [draft], scores)[0])
                except Exception as e:  # noqa: BLE001
                    result.errors[state.seq_id] = f"sampling failed: {type(e).__name__}: {e}"
                    emitted.append(None)
                offset += len(draft) + 1
        offset = 0
        for state, draft, tokens in zip(states, drafts, emitted):
            if tokens is not None:
                self._emit(result, state, tokens, sub[offset : offset + len(tokens)])
                result.num_draft_tokens[state.seq_id] = len(draft)
                result.num_accepted_tokens[state.seq_id] = len(tokens) - 1
                state.record_acceptance(len(draft), len(tokens) - 1)
            offset += len(draft) + 1

    def _sample_isolated(
        self, logits: torch.Tensor, states: list[SeqState], scores: dict, errors: dict[int, str]
    ) -> list[int | None]:
        """Sample all rows at once; if that raises, row by row, so one bad request fails alone."""
        try:
            return self.sampler.sample(logits, states, scores)
        except Exception:  # noqa: BLE001 - isolate the failing row below
            logger.debug("batched sampling failed; sampling row by row", exc_info=True)
        tokens: list[int | None] = []
        for i, state in enumerate(states):
            try:
                tokens.append(self.sampler.sample(logits[i : i + 1], [state], scores)[0])
            except Exception as e:  # noqa: BLE001 - the request fails, the step goes on
                logger.warning("sampling failed for sequence %s: %s", state.seq_id, e)
                errors[state.seq_id] = f"sampling failed: {type(e).__name__}: {e}"
                tokens.append(None)
        return tokens


def _logprobs(row: torch.Tensor, token: int, k: int) -> SampledLogprobs:
    lp = torch.log_softmax(row.float(), dim=-1)
    top = {}
    if k > 0:
        values, ids = lp.topk(min(k, lp.shape[-1]))
        top = dict(zip(ids.tolist(), values.tolist()))
    return SampledLogprobs(float(lp[token]), top)
