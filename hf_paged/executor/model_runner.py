"""Scheduler output -> one packed ragged batch -> a forward -> sampled tokens (a ``ModelRunnerOutput``).

The runner sees plain data only (:mod:`hf_paged.core.scheduler_output`) and keeps its own per-sequence
state: sampling state (:class:`~hf_paged.sample.sampling.SeqState`), created the first time a sequence is scheduled,
and block tables (:class:`~hf_paged.executor.input_batch.BlockTables`), updated from each step's diffs; both
dropped when the scheduler reports the sequence finished. Each step runs on one step runner
(:mod:`hf_paged.executor.step_runners`): the fast one chosen at start where it takes steps of this kind, the
eager HF forward otherwise.
"""

from __future__ import annotations

import logging

import torch

from hf_paged.attention.function import AttentionMetadata
from hf_paged.attention.layer import AttentionLayers
from hf_paged.core.scheduler_output import ModelRunnerOutput, SampledLogprobs, ScheduledSequence, SchedulerOutput
from hf_paged.executor.input_batch import BlockTables, pack_step, table_tensor
from hf_paged.executor.step_runners import EagerStepRunner, Step, StepInputs, StepRunner, check_hidden_layers
from hf_paged.executor.kv_pool import KVPool
from hf_paged.lora.manager import LoRAManager
from hf_paged.sample.logits_processors import criteria_stop
from hf_paged.sample.sampling import Sampler, SeqState
from hf_paged.spec_decode.speculator import Speculator
from hf_paged.spec_decode.verifier import verify
from hf_paged.structured.matchers import StructuredMatchers

logger = logging.getLogger(__name__)


class ModelRunner:
    """Runs scheduled steps on a HF model whose attention is "hf_paged".

    Args:
        model: The HF model.
        pool: The KV pool.
        attention: The engine's attention layer objects over ``pool`` (each holds the backend chosen once).
        sampler: Samples the next tokens.
        max_model_len: Longest sequence.
        fast: The fast step runner chosen at start (decode buckets or the CPU native program), or None.
        block_tables: The persistent block tables (shared with ``fast``, which reads the step's rows from them).
        lora: The LoRA adapters (``enable_lora``), or None. A step with adapter rows sets its row mapping on
            it for the forward and runs on the eager runner (the fast runners do not apply the slots yet).
    """

    def __init__(
        self, model: torch.nn.Module, pool: KVPool, attention: AttentionLayers, sampler: Sampler, max_model_len: int,
        fast: StepRunner | None = None, block_tables: BlockTables | None = None, lora: LoRAManager | None = None,
    ) -> None:
        self.model = model
        self.pool = pool
        self.attention = attention
        self._other_layers: list[AttentionLayers] = []  # draft models' layers over their own pools
        self.sampler = sampler
        self.max_model_len = max_model_len
        self.speculator = Speculator()
        self.eager = EagerStepRunner(model)
        self.fast = fast
        self.device = pool.device
        self.block_size = pool.block_size
        self.states: dict[int, SeqState] = {}
        self.structured = StructuredMatchers()  # grammar matchers of structured-output sequences
        self.block_tables = BlockTables() if block_tables is None else block_tables
        self.hidden_layers: tuple[int, ...] = ()  # decoder layers whose outputs every step captures
        self.last_hidden: dict[int, torch.Tensor] = {}  # their outputs in the last step, [T, hidden] each
        self.tiers = None  # the KV tiers' store (executor/kv_tiers.py), when the engine has tiers
        self.lora = lora

    def close(self) -> None:
        """Drop the speculative proposers, the fast step runner (its buffers, graphs, packs) and all state."""
        self.speculator.close()
        self.fast = None
        for layers in (self.attention, *self._other_layers):
            layers.clear()  # the layer objects hold the pool tensors: let them go with the pool
        self._other_layers.clear()
        self.states.clear()
        self.structured = StructuredMatchers()
        self.block_tables = BlockTables()

    def update_states(self, out: SchedulerOutput) -> None:
        if out.finished_seq_ids:  # an EAGLE head writes its KV of what finished sequences leave in the cache
            self.speculator.settle(out.finished_seq_ids, self.states, self.block_tables.lists)
        for seq_id in out.finished_seq_ids:
            self.states.pop(seq_id, None)
            self.block_tables.drop(seq_id)
        self.structured.drop(out.finished_seq_ids)
        self.speculator.forget(out.finished_seq_ids, out.preempted_seq_ids)
        for data in out.new_sequences:
            self.states[data.seq_id] = SeqState.from_new(data)
            grammar = data.sampling_params.structured_outputs
            if grammar is not None and grammar.compiled is not None:
                stops = data.stop_token_ids if grammar.stop_token_ids is None else grammar.stop_token_ids
                self.structured.add(data.seq_id, grammar.compiled, stops, data.output_token_ids, kind=grammar.kind,
                                    token_mask=grammar.token_mask)
        for item in out.scheduled:
            self.block_tables.apply(item)

    def attention_layers(self, pool: KVPool | None) -> AttentionLayers:
        """The attention layer objects over ``pool`` (a draft model's), with the engine's backend; the target's
        own for None (a ``self:N`` draft runs the target's first layers over the target's pool)."""
        if pool is None or pool is self.pool:
            return self.attention
        layers = AttentionLayers.for_pool(pool, self.attention.backend)
        self._other_layers.append(layers)
        return layers

    def prepare(self, scheduled: list[ScheduledSequence]) -> StepInputs:
        """Pack this step's sequences over the engine's pool, their tables from the runner's persistent copy."""
        return self.prepare_batch(scheduled, self.attention)

    def prepare_batch(self, scheduled: list[ScheduledSequence], layers: AttentionLayers, tables=None) -> StepInputs:
        """Pack sequences into one ragged batch for the attention ``layers`` (the target's, or a draft model's
        over its own pool); ``tables`` (seq id -> block ids) default to the runner's persistent tables."""
        persistent = tables is None
        tables = self.block_tables.lists if persistent else tables
        ids, positions, slots, seq_lens, cu, sample_rows = pack_step(scheduled, tables, self.block_size)
        device = self.device
        if persistent or all(tables[item.seq_id] is self.block_tables.lists.get(item.seq_id) for item in scheduled):
            # the runner's own tables (a draft model's steps read them too): their rows, gathered in one copy
            width = max(len(tables[item.seq_id]) for item in scheduled)
            block_tables = self.block_tables.gather([item.seq_id for item in scheduled], width)
        else:
            block_tables = table_tensor(scheduled, tables)
        block_tables = block_tables.to(device, non_blocking=True)
        seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=device)
        cu_t = torch.tensor(cu, dtype=torch.int32, device=device)
        q_lens = [cu[i + 1] - cu[i] for i in range(len(scheduled))]
        slot_mapping = torch.tensor(slots, dtype=torch.long, device=device)
        impl = layers.backend.plan(block_tables, seq_lens, q_lens, len(ids), seq_lens_t, cu_t, slot_mapping,
                                   layers.kv_caches)
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            block_tables=block_tables,
            seq_lens=seq_lens_t,
            cu_seqlens_q=cu_t,
            max_seqlen_q=max(q_lens),
            max_seqlen_k=max(seq_lens),
            layers=layers,
            impl=impl,
        )
        return StepInputs(
            input_ids=torch.tensor([ids], dtype=torch.long, device=device),
            position_ids=torch.tensor([positions], dtype=torch.long, device=device),
            metadata=meta,
            logits_indices=torch.tensor(sample_rows, dtype=torch.long, device=device),
            sampled=[item for item in scheduled if item.sample],
        )

    def capture_hidden(self, hidden_layers: tuple[int, ...]) -> None:
        """From the next step on, capture the outputs of decoder layers ``hidden_layers`` in every step
        (:attr:`last_hidden`), on whichever runner serves it: the native program records the copies, decode
        buckets leave such steps to the eager forward. ``()`` stops."""
        self.hidden_layers = check_hidden_layers(self.model, tuple(hidden_layers))
        if hasattr(self.fast, "set_capture"):
            self.fast.set_capture(self.hidden_layers)

    def compute_logits(self, step: Step, model: torch.nn.Module | None = None, fast: StepRunner | None = None) -> torch.Tensor:
        """Logits ``[N, V]`` at the sampled rows of ``step``: on the fast runner where it takes the step, else
        on the eager forward; ``model`` and ``fast``: a draft model and its own fast runner (default: the
        target's). A step with adapter rows runs with the step's LoRA plan and slots set: on the native decode
        program (its delta ops) or the decode buckets (static, CUDA graphs) where they take the step, else
        eagerly (a draft runs base)."""
        if model is None:
            fast = self.fast
            if self.lora is not None and any(item.lora_int_id for item in step.scheduled):
                try:  # the step's adapter of each row, for every slot; cleared after
                    self.lora.set_step([(item.lora_int_id, item.num_new_tokens) for item in step.scheduled], self.device)
                    serves = fast is not None and getattr(fast, "serves_lora", False) and fast.accepts(step.scheduled)
                    logits = fast.run(step) if serves else None
                    return self.eager.run(step) if logits is None else logits
                finally:
                    self.lora.clear_step()
        logits = fast.run(step) if fast is not None and fast.accepts(step.scheduled) else None
        return self.eager.run(step, model) if logits is None else logits

    def draft_logits(self, batch: list[ScheduledSequence], attention: AttentionLayers, tables: dict[int, list[int]],
                     model: torch.nn.Module, fast: StepRunner | None = None) -> torch.Tensor:
        """A draft step for a proposer (:data:`~hf_paged.spec_decode.draft_model.DraftForward`): ``batch`` packed
        over ``attention``'s pool with ``tables``, logits ``[N, V]`` at its sampled rows from ``model``, on its
        own fast runner ``fast`` (a native program) where it takes the step, else eagerly."""
        step = Step(batch, lambda scheduled: self.prepare_batch(scheduled, attention, tables))
        return self.compute_logits(step, model, fast)

    def move_blocks(self, out: SchedulerOutput) -> None:
        """The step's block moves, in the one safe order: tier demotions read cached blocks before anything
        reuses them; tier promotions fill fresh blocks after the swaps and copies (an empty step may carry tier
        moves too: a promotion whose request could not be admitted yet)."""
        self.pool.commit(out.blocks_high_water)
        if self.tiers is not None:
            self.tiers.demote(out.tier_moves)
        self.pool.swap_out(out.swap_out)
        self.pool.swap_in(out.swap_in)
        self.pool.copy_blocks(out.block_copies)
        if self.tiers is not None:
            self.tiers.promote(out.tier_moves)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step: take the scheduler's diffs, move blocks as scheduled, forward, sample."""
        self.update_states(out)
        self.move_blocks(out)
        self.speculator.move_blocks(out)  # an empty step may carry tier moves too
        if out.is_empty:
            return ModelRunnerOutput()
        step = Step(out.scheduled, self.prepare, self.hidden_layers)
        logits = self.compute_logits(step)
        self.last_hidden = step.hidden
        if step.hidden:  # an EAGLE head keeps the rows of its sequences (prompt chunks too)
            self.speculator.observe(out.scheduled, step.hidden, self.states)
        if not step.sampled:  # only mid-prompt chunks: the KV is written, no token is sampled
            return ModelRunnerOutput()
        return self.sample(logits, step.sampled)

    @torch.inference_mode()
    def execute_forward(self, out: SchedulerOutput) -> None:
        """A tensor-parallel worker's step: the same block moves and forward as :meth:`execute` on rank 0 (its
        collectives meet rank 0's), no sampling."""
        self.update_states(out)
        self.move_blocks(out)
        if out.is_empty:
            return
        self.compute_logits(Step(out.scheduled, self.prepare, self.hidden_layers))

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
                beam_row = logits[row : row + 1]
                dead: dict[int, str] = {}
                if item.seq_id in self.structured:  # its matcher follows the search's tokens; forbidden: -inf
                    self.structured.follow(item.seq_id, len(state.prompt_token_ids), item.start, item.token_ids)
                    beam_row = self.structured.mask(beam_row, [item.seq_id], dead=dead)
                if dead:  # its grammar allows nothing: the beam cannot continue (-inf, never NaN, for the search)
                    result.beam_rows[item.seq_id] = torch.full_like(beam_row[0], float("-inf"), dtype=torch.float32)
                else:
                    result.beam_rows[item.seq_id] = torch.log_softmax(beam_row[0].float(), dim=-1)
            elif item.num_draft_tokens:
                verify_items.append((row, item, state))
            else:
                rows.append(row)
                states.append(state)
                for index, child_id in enumerate(item.fork_seq_ids, start=1):
                    child = self.states[child_id] = state.fork(child_id, index)
                    self.structured.fork(item.seq_id, child_id)
                    rows.append(row)
                    states.append(child)
            row += 1 + item.num_draft_tokens
        scores: dict = {}
        if rows:
            sub = logits if rows == list(range(logits.shape[0])) else logits[rows]
            if self.structured:  # masked in place unless a row's logprobs need its raw logits after sampling
                keep_raw = any(s.params.logprobs is not None for s in states)
                dead: dict[int, str] = {}
                masked = self.structured.mask(sub, [s.seq_id for s in states], inplace=not keep_raw, dead=dead)
                if dead:  # a grammar that allows no token fails its sequence alone (the constraint's error)
                    result.errors.update(dead)
                    keep = [i for i, s in enumerate(states) if s.seq_id not in dead]
                    sub, masked, states = sub[keep], masked[keep], [states[i] for i in keep]
            else:
                masked = sub
            tokens = self._sample_isolated(masked, states, scores, result.errors) if states else []
            for i, (state, token) in enumerate(zip(states, tokens)):
                if token is None:
                    continue
                if state.params.stopping_criteria and not self._check_criteria(result, state, token, sub[i : i + 1]):
                    continue
                self._emit(result, state, [token], sub[i : i + 1])
        if verify_items:
            self._verify(logits, verify_items, result, scores)
        result.scores = scores
        proposing = [item for item in sampled if item.propose and item.seq_id in result.sampled_token_ids]
        if proposing:
            states = [self.states[item.seq_id] for item in proposing]
            result.spec_token_ids = self.speculator.propose(states, self.max_model_len, proposing,
                                                            self.block_tables.lists)
        return result

    def _emit(self, result: ModelRunnerOutput, state: SeqState, tokens: list[int], rows: torch.Tensor) -> None:
        error = self.structured.accept(state.seq_id, tokens) if self.structured else None
        if error is not None:
            result.errors[state.seq_id] = error
        state.output_token_ids.extend(tokens)
        result.sampled_token_ids[state.seq_id] = tokens
        if state.params.logprobs is not None:
            result.logprobs[state.seq_id] = [_logprobs(rows[i], t, state.params.logprobs) for i, t in enumerate(tokens)]

    def _check_criteria(self, result: ModelRunnerOutput, state: SeqState, token: int, row: torch.Tensor) -> bool:
        """Run the sequence's stopping criteria on its new token (a True marks it stopped); False if one raised
        (the request then fails alone with the error)."""
        try:
            if criteria_stop(state, token, row.float()):
                result.stopped.add(state.seq_id)
        except Exception as e:  # noqa: BLE001 - the request fails, the step goes on
            logger.warning("a stopping criterion failed for sequence %s: %s", state.seq_id, e)
            result.errors[state.seq_id] = f"stopping criterion failed: {type(e).__name__}: {e}"
            return False
        return True

    def _verify(self, logits: torch.Tensor, items: list, result: ModelRunnerOutput, scores: dict) -> None:
        index = torch.tensor([r for row, item, _ in items for r in range(row, row + 1 + item.num_draft_tokens)],
                             device=logits.device)
        sub = logits.index_select(0, index)
        states = [state for _, _, state in items]
        drafts = [item.token_ids[-item.num_draft_tokens :] for _, item, _ in items]
        dead: dict[int, int] = {}  # sequence -> the position where its grammar allows no token
        if self.structured:  # every verified position masked as if the drafts before it were accepted
            sub_raw, sub = sub, self.structured.mask_verify(sub, [s.seq_id for s in states], drafts, dead=dead)
        else:
            sub_raw = sub
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
            if tokens is not None and len(tokens) > dead.get(state.seq_id, len(tokens)):
                # a token was verified where the grammar allows none: the sequence fails (the constraint's error)
                result.errors[state.seq_id] = self.structured.dead_end(state.seq_id, dead[state.seq_id])
            elif tokens is not None:
                self._emit(result, state, tokens, sub_raw[offset : offset + len(tokens)])
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
